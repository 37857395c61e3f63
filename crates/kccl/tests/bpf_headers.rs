//! Every header under bpf/ stands on its own: it includes what it uses and
//! is guarded against a second inclusion.  The programs include them in one
//! order; a header that silently relies on what an earlier include or the
//! including program defined (a map, a macro, a global) breaks the first
//! program that includes it another way.  So each header is compiled alone,
//! twice in one translation unit:
//!
//! - bpf/include/ (the layouts that cross the kernel/user boundary) as
//!   ordinary host C, the way user-space C would include them;
//! - bpf/lib/ and bpf/agg/ (program-side pieces) as BPF C, against the
//!   vmlinux.h and libbpf headers the programs were built with (build.rs
//!   puts both in OUT_DIR).
//!
//! No kernel, no root: this runs wherever the crate builds.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bpf_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bpf")
}

fn clang() -> String {
    std::env::var("KCCL_CLANG").unwrap_or_else(|_| "clang-16".into())
}

/// The headers directly in `bpf/<sub>/`, sorted.
fn headers(sub: &str) -> Vec<PathBuf> {
    let dir = bpf_dir().join(sub);
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no headers in {}", dir.display());
    found
}

/// Compiles `#include <header>` twice with `args`; the compiler's complaint
/// if it fails.
fn compile_alone(header: &Path, args: &[&str]) -> Result<(), String> {
    let include = format!("#include \"{0}\"\n#include \"{0}\"\n", header.display());
    let mut child = Command::new(clang())
        .args(["-fsyntax-only", "-Wall", "-Werror", "-x", "c", "-"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {} failed ({e}); run `make setup`", clang()));
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin.write_all(include.as_bytes()).expect("writing to the compiler");
    }
    let out = child.wait_with_output().expect("waiting for the compiler");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}:\n{}", header.display(), String::from_utf8_lossy(&out.stderr)))
    }
}

fn check_all(subs: &[&str], args: &[&str]) {
    let failures: Vec<String> =
        subs.iter().flat_map(|sub| headers(sub)).filter_map(|h| compile_alone(&h, args).err()).collect();
    assert!(failures.is_empty(), "headers that do not compile on their own:\n{}", failures.join("\n"));
}

#[test]
fn layout_headers_compile_as_host_c() {
    let include = bpf_dir().join("include");
    let include = include.to_str().expect("utf-8 path");
    check_all(&["include"], &["-I", include]);
}

#[test]
fn program_pieces_compile_as_bpf_c() {
    let out = env!("OUT_DIR");
    let libbpf = format!("{out}/libbpf");
    let bpf = bpf_dir();
    let include = bpf.join("include");
    check_all(
        &["lib", "agg"],
        &[
            "-target",
            "bpf",
            "-D__TARGET_ARCH_x86",
            // A header's static inline helpers are used by its includers.
            "-Wno-unused-function",
            "-I",
            out,
            "-I",
            &libbpf,
            "-I",
            include.to_str().expect("utf-8 path"),
            "-I",
            bpf.to_str().expect("utf-8 path"),
        ],
    );
}

/// The check itself can fail: a header that uses what it does not include.
#[test]
fn a_header_missing_an_include_is_caught() {
    let dir = std::env::temp_dir().join(format!("kccl-bpf-headers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.h");
    std::fs::write(&bad, "#ifndef BAD_H\n#define BAD_H\nstatic __u32 x;\n#endif\n").expect("writing bad.h");
    let unguarded = dir.join("unguarded.h");
    std::fs::write(&unguarded, "struct twice { int a; };\n").expect("writing unguarded.h");
    let bad_result = compile_alone(&bad, &[]);
    let unguarded_result = compile_alone(&unguarded, &[]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(bad_result.is_err(), "a header using __u32 without <linux/types.h> compiled");
    assert!(unguarded_result.is_err(), "an unguarded header included twice compiled");
}
