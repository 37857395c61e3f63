//! Tests of the progress a long run shows on stderr (`bench all` here; bench
//! loss, bench peers and cluster up share the same code):
//!
//! - stderr a pipe (CI logs): plain lines "kccl bench all: experiment k/n
//!   NAME · point i/m ... · mm:ss elapsed", one at least per experiment, and
//!   "done in"; nothing of it on stdout, whose result lines stay as they were;
//! - `KCCL_PROGRESS=off`: no progress at all;
//! - stderr a terminal (a pty from `script`): an indicatif bar redrawn in
//!   place (carriage returns, "ETA"), not the plain lines.
//!
//! Each run is the smoke suite of two cheap experiments on a virtual cluster
//! (root: network namespaces, BPF).

use std::process::{Command, Output, Stdio};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::{root_or_skip, Scratch};

const KCCL: &str = env!("CARGO_BIN_EXE_kccl");
const EXPERIMENTS: &str = "bcast-size,agg-cpu";

fn suite_args(out: &Scratch) -> Vec<String> {
    ["bench", "all", "--smoke", "--no-peers", "--experiments", EXPERIMENTS, "--out"]
        .iter()
        .map(|s| s.to_string())
        .chain([out.path("suite").display().to_string()])
        .collect()
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout:\n{}\n--- stderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn suite(out: &Scratch, progress: Option<&str>) -> Output {
    let mut cmd = Command::new(KCCL);
    cmd.args(suite_args(out)).stdin(Stdio::null());
    match progress {
        Some(v) => cmd.env("KCCL_PROGRESS", v),
        None => cmd.env_remove("KCCL_PROGRESS"),
    };
    cmd.output().expect("running kccl bench all")
}

#[test]
fn bench_all_shows_plain_progress_lines_when_stderr_is_not_a_terminal() {
    if !root_or_skip("bench_all_shows_plain_progress_lines_when_stderr_is_not_a_terminal", "network namespaces, BPF") {
        return;
    }
    let out = Scratch::new("progress-plain");
    let o = suite(&out, None);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let stdout = String::from_utf8_lossy(&o.stdout);
    for (k, name) in EXPERIMENTS.split(',').enumerate() {
        let head = format!("kccl bench all: experiment {}/2 {name} · point 1/", k + 1);
        let line = err.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no {head:?}: {}", show(&o)));
        assert!(line.ends_with(" elapsed") || line.contains(" elapsed · ETA "), "{line:?}");
        // The result lines of the experiment are still on stdout, with its place in the suite.
        assert!(stdout.contains(&format!("[{}/2 {name} ", k + 1)), "{}", show(&o));
    }
    assert!(err.lines().any(|l| l.starts_with("kccl bench all: done in ")), "{}", show(&o));
    assert!(!stdout.contains("kccl bench all: "), "progress on stdout: {}", show(&o));
    assert!(!err.contains('\r') && !err.contains("\x1b["), "terminal control codes in a log: {}", show(&o));

    let quiet = suite(&out, Some("off"));
    assert_eq!(quiet.status.code(), Some(0), "{}", show(&quiet));
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("kccl bench all: "), "{}", show(&quiet));
}

#[test]
fn bench_all_draws_a_bar_on_a_terminal() {
    if !root_or_skip("bench_all_draws_a_bar_on_a_terminal", "network namespaces, BPF") {
        return;
    }
    let out = Scratch::new("progress-bar");
    // script(1) runs the command on a new pty and copies what it drew to our stdout.
    let line = std::iter::once(KCCL.to_owned()).chain(suite_args(&out)).collect::<Vec<_>>().join(" ");
    let o = Command::new("script")
        .args(["-qec", &format!("stty cols 120; {line}"), "/dev/null"])
        .env_remove("KCCL_PROGRESS")
        .stdin(Stdio::null())
        .output()
        .expect("running script(1) from util-linux");
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(tty.contains("kccl bench all: experiment 1/2 bcast-size ["), "no bar: {}", show(&o));
    assert!(tty.contains("kccl bench all: experiment 2/2 agg-cpu ["), "no bar for the second experiment: {}", show(&o));
    assert!(tty.contains(" · ETA ") && tty.contains("\r\x1b[2K"), "bar not redrawn in place: {}", show(&o));
    assert!(
        !tty.contains("kccl bench all: experiment 1/2 bcast-size · point"),
        "plain lines on a terminal: {}",
        show(&o)
    );
    assert!(tty.contains("[1/2 bcast-size "), "result lines lost under the bar: {}", show(&o));
}
