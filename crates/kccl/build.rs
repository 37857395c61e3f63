//! Compiles the BPF data plane (bpf/*.bpf.c) with clang-16 against a vmlinux.h
//! generated from the running kernel's BTF, and generates libbpf-rs skeletons.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use libbpf_cargo::SkeletonBuilder;

/// BPF programs: (source file in bpf/, skeleton module name).
const PROGRAMS: &[(&str, &str)] = &[
    ("tc_bcast.bpf.c", "tc_bcast"),
    ("xdp_agg.bpf.c", "xdp_agg"),
    ("tc_agg_result.bpf.c", "tc_agg_result"),
    ("tc_fault.bpf.c", "tc_fault"),
    ("xdp_sg.bpf.c", "xdp_sg"),
];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let bpf_dir = manifest.join("../../bpf");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let clang = env::var("KCCL_CLANG").unwrap_or_else(|_| "clang-16".into());

    let vmlinux = out.join("vmlinux.h");
    generate_vmlinux_h(&vmlinux);

    for (src, name) in PROGRAMS {
        let src_path = bpf_dir.join(src);
        let skel = out.join(format!("{name}.skel.rs"));
        SkeletonBuilder::new()
            .source(&src_path)
            .clang(&clang)
            .clang_args([
                "-I".as_ref(),
                out.as_os_str(),
                "-I".as_ref(),
                bpf_dir.join("include").as_os_str(),
                // lib/ and agg/ are included by path ("lib/kccl_xdp.h").
                "-I".as_ref(),
                bpf_dir.as_os_str(),
                "-D__TARGET_ARCH_x86".as_ref(),
                "-Wall".as_ref(),
                "-Werror".as_ref(),
            ])
            .build_and_generate(&skel)
            .unwrap_or_else(|e| panic!("building BPF program {src} with {clang} failed: {e:#}"));
        println!("cargo:rerun-if-changed={}", src_path.display());
    }
    rerun_if_any_changed(&bpf_dir);
    write_libbpf_headers(&out.join("libbpf"));
    println!("cargo:rerun-if-env-changed=KCCL_CLANG");
}

/// Every file under bpf/ (include/, lib/, agg/): a header change rebuilds
/// the programs that include it.
fn rerun_if_any_changed(dir: &Path) {
    println!("cargo:rerun-if-changed={}", dir.display());
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = entry.expect("readable dir entry").path();
        if path.is_dir() {
            rerun_if_any_changed(&path);
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// libbpf's BPF-side headers (bpf/bpf_helpers.h, ...) as the programs were
/// built with, for the header checks of tests/bpf_headers.rs, which compile
/// each header of bpf/ on its own.
fn write_libbpf_headers(dst: &Path) {
    let dir = dst.join("bpf");
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    for (name, text) in libbpf_rs::libbpf_sys::API_HEADERS {
        fs::write(dir.join(name), text).unwrap_or_else(|e| panic!("writing {name} into OUT_DIR: {e}"));
    }
}

/// vmlinux.h comes from the running kernel (CO-RE relocates against the target
/// kernel at load time anyway).  KCCL_VMLINUX_H overrides it for builds on a
/// host without /sys/kernel/btf/vmlinux.
fn generate_vmlinux_h(dst: &Path) {
    if let Ok(given) = env::var("KCCL_VMLINUX_H") {
        fs::copy(&given, dst).unwrap_or_else(|e| panic!("copying KCCL_VMLINUX_H={given}: {e}"));
        return;
    }
    let out = Command::new("bpftool")
        .args(["btf", "dump", "file", "/sys/kernel/btf/vmlinux", "format", "c"])
        .output()
        .unwrap_or_else(|e| {
            panic!("running bpftool to generate vmlinux.h failed ({e}); run `make setup` (installs bpftool)")
        });
    if !out.status.success() {
        panic!(
            "bpftool btf dump failed: {}; the kernel needs CONFIG_DEBUG_INFO_BTF, or set KCCL_VMLINUX_H",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    fs::write(dst, out.stdout).expect("writing vmlinux.h into OUT_DIR");
    println!("cargo:rerun-if-env-changed=KCCL_VMLINUX_H");
}
