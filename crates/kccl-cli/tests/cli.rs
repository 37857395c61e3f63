//! Tests of the `kccl` command line, run as a user would run it: the built
//! binary (CARGO_BIN_EXE_kccl), group files in temporary directories, exit
//! codes and stderr.
//!
//! - group-file errors name the field and the line and exit with 1;
//! - `kccl broadcast` refuses bad destination lists, paths and ranks;
//! - a member interface that does not exist: `--path kernel` fails naming it,
//!   `--path auto` falls back to the user-space path and says so (members on
//!   127.0.0.1 with distinct ports, so no namespace is needed);
//! - end to end in a 3-host virtual cluster (`kccl cluster up/down`,
//!   `kccl receive` entering its member's namespace by itself), over both
//!   paths;
//! - as user `nobody`: `--path auto` falls back because it is not root,
//!   `--path kernel` fails saying root is needed;
//! - `kccl reduce` / `kccl allreduce` / `kccl aggregator` end to end in a
//!   4-host cluster over both paths, results compared with the sums.
//!
//! Tests that need root print `SKIPPED <test>: <reason>` without it.

use std::fs::{self, File};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kccl::error::is_root;

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::{command_with, non_root_prefix, pattern, root_or_skip, Scratch};

const KCCL: &str = env!("CARGO_BIN_EXE_kccl");

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Runs `kccl ARGS` (optionally through a prefix such as setpriv) and waits.
fn run_with(prefix: &[&str], args: &[&str]) -> Output {
    let mut cmd = command_with(prefix, KCCL);
    cmd.args(args).stdin(Stdio::null()).output().expect("running kccl")
}

fn run(args: &[&str]) -> Output {
    run_with(&[], args)
}

fn err_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `n` UDP ports on 127.0.0.1 that were free a moment ago (all held at once
/// while choosing, so they are distinct).
fn free_ports(n: usize) -> Vec<u16> {
    let socks: Vec<UdpSocket> =
        (0..n).map(|_| UdpSocket::bind("127.0.0.1:0").expect("binding an ephemeral port")).collect();
    socks.iter().map(|s| s.local_addr().expect("local addr").port()).collect()
}

/// A group file body: one member per port, all on 127.0.0.1, rank i on
/// `ports[i]`, sending from `iface`.  Member i's `[[member]]` line is
/// 3 + 6 * i (line 1 `job`, line 2 empty, members 6 lines apart).
fn loopback_group(ports: &[u16], iface: &str) -> String {
    let mut t = String::from("job = 1\n");
    for (rank, port) in ports.iter().enumerate() {
        t += &format!("\n[[member]]\nrank = {rank}\naddr = \"127.0.0.1\"\nport = {port}\niface = \"{iface}\"\n");
    }
    t
}

/// A background `kccl receive` with stderr in a file; killed on drop if it
/// is still running.
struct Recv {
    child: Child,
    err_file: PathBuf,
    what: String,
}

impl Recv {
    /// `kccl receive --group G --rank R --count 1 --timeout T --out OUT`,
    /// returned once its socket is bound on `port`.
    fn start(prefix: &[&str], group: &Path, rank: u16, port: u16, out: &Path, scratch: &Scratch) -> Recv {
        let err_file = scratch.path(&format!("recv-{rank}.stderr"));
        let mut cmd = match prefix.split_first() {
            Some((p, rest)) => {
                let mut c = Command::new(p);
                c.args(rest).arg(KCCL);
                c
            }
            None => Command::new(KCCL),
        };
        let rank_s = rank.to_string();
        cmd.args(["receive", "--group", s(group), "--rank", &rank_s, "--count", "1", "--timeout", "10"])
            .args(["--out", s(out)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&err_file).expect("stderr file"));
        let child = cmd.spawn().expect("spawning kccl receive");
        let mut r = Recv { child, err_file, what: format!("kccl receive (rank {rank})") };
        r.wait_bound(port);
        r
    }

    fn stderr(&self) -> String {
        fs::read_to_string(&self.err_file).unwrap_or_default()
    }

    /// Waits until the process has a UDP socket on `port` in its own network
    /// namespace (/proc/PID/net/udp shows the namespace of that process).
    fn wait_bound(&mut self, port: u16) {
        let needle = format!(":{port:04X}");
        let table = format!("/proc/{}/net/udp", self.child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = fs::read_to_string(&table).unwrap_or_default();
            // Column 2 is local_address, e.g. 0100007F:A029.
            if text.lines().skip(1).any(|l| l.split_whitespace().nth(1).is_some_and(|a| a.ends_with(&needle))) {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("{} exited ({st}) before binding port {port}: {}", self.what, self.stderr());
            }
            assert!(Instant::now() < deadline, "{} did not bind port {port} within 10 s", self.what);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Exit code and stderr, waiting at most `limit`.
    fn finish(mut self, limit: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait().expect("waiting for kccl receive") {
                Some(st) => return (st.code(), self.stderr()),
                None if Instant::now() >= deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    panic!("{} still running after {limit:?}: {}", self.what, self.stderr());
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

impl Drop for Recv {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// None if equal; else where they first differ.
fn diff(got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} bytes, expected {}", got.len(), want.len()));
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    Some(format!("first difference at byte {i}"))
}

fn check_file(problems: &mut Vec<String>, what: &str, path: &Path, want: &[u8]) {
    match fs::read(path) {
        Ok(got) => {
            if let Some(d) = diff(&got, want) {
                problems.push(format!("{what}: {} holds {d}", path.display()));
            }
        }
        Err(e) => problems.push(format!("{what}: reading {}: {e}", path.display())),
    }
}

fn assert_clean(test: &str, problems: Vec<String>) {
    assert!(problems.is_empty(), "{test}: {} problems:\n  {}", problems.len(), problems.join("\n  "));
}

/// Problems if `o` did not exit with 1 and an error naming all of `needles`.
fn expect_error(what: &str, o: &Output, needles: &[&str]) -> Vec<String> {
    let err = err_of(o);
    let mut p = Vec::new();
    if o.status.code() != Some(1) {
        p.push(format!("{what}: exit {:?}, expected 1 (stderr: {err:?})", o.status.code()));
    }
    if !err.contains("kccl: error:") {
        p.push(format!("{what}: stderr has no `kccl: error:` line: {err:?}"));
    }
    for n in needles {
        if !err.contains(n) {
            p.push(format!("{what}: stderr does not mention {n:?}: {err:?}"));
        }
    }
    p
}

/// The `line N` numbers an error message quotes (the first one comes right
/// after the file name).
fn lines_quoted(err: &str) -> Vec<usize> {
    err.split("line ").skip(1).filter_map(|t| t.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()).collect()
}

/// The two-member loopback group of the group-file tests.  Its second member
/// spans lines 9..=13:
///   9 [[member]]  10 rank = 1  11 addr = ...  12 port = ...  13 iface = ...
fn two_members() -> String {
    let g = loopback_group(&[41_000, 41_001], "lo");
    assert_eq!(g.lines().nth(8), Some("[[member]]"), "layout assumption: {g}");
    g
}

/// Two-member group with the second member's `field` line replaced by
/// `line` (removed when `line` is empty).
fn edit_member2(field: &str, line: &str) -> String {
    let mut out = String::new();
    for (i, l) in two_members().lines().enumerate() {
        if i + 1 >= 9 && l.starts_with(&format!("{field} =")) {
            if !line.is_empty() {
                out += line;
                out.push('\n');
            }
        } else {
            out += l;
            out.push('\n');
        }
    }
    out
}

/// A bad group file: its text, words stderr must contain, and the `line N`
/// values that are right.  A problem inside a member may be reported on its
/// [[member]] line or on the line of the field itself.
struct BadGroup {
    case: &'static str,
    text: String,
    words: Vec<&'static str>,
    lines: Vec<usize>,
}

/// Runs `kccl broadcast` and `kccl receive` on each bad group file: exit 1,
/// an error naming the file, the words and an acceptable line.
fn check_bad_groups(tag: &str, cases: &[BadGroup]) -> Vec<String> {
    let dir = Scratch::new(tag);
    let input = dir.write("in.bin", b"hello");
    let mut problems = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let g = dir.write(&format!("g{i}.toml"), &c.text);
        for cmd in [
            vec!["broadcast", "--group", s(&g), "--rank", "0", "--to", "1", s(&input)],
            vec!["receive", "--group", s(&g), "--rank", "1", "--count", "1", "--timeout", "1"],
        ] {
            let o = run(&cmd);
            let what = format!("{} ({})", c.case, cmd[0]);
            let mut w: Vec<&str> = c.words.clone();
            w.push(s(&g));
            problems.extend(expect_error(&what, &o, &w));
            let err = err_of(&o);
            match lines_quoted(&err).first() {
                Some(n) if c.lines.contains(n) => {}
                Some(n) => problems.push(format!("{what}: names line {n}, expected one of {:?}: {err:?}", c.lines)),
                None => problems.push(format!("{what}: no `line N` in {err:?}")),
            }
        }
    }
    problems
}

#[test]
fn bad_group_files_name_field_and_line() {
    let test = "bad_group_files_name_field_and_line";
    let bad = |case, text, words, lines| BadGroup { case, text, words, lines };
    let cases = [
        bad("missing addr", edit_member2("addr", ""), vec!["addr"], vec![9, 10, 11, 12, 13]),
        bad("bad IP", edit_member2("addr", "addr = \"127.0.0.300\""), vec!["addr", "127.0.0.300"], vec![9, 11]),
        bad("duplicate rank", edit_member2("rank", "rank = 0"), vec!["rank", "already used on line 3"], vec![9, 10]),
        bad("unknown field", format!("{}colour = \"red\"\n", two_members()), vec!["colour"], vec![14]),
        bad("invalid TOML: key twice", edit_member2("port", "port = 41001\nport = 41002"), vec!["port"], vec![13]),
    ];
    let mut problems = check_bad_groups("badgroup", &cases);
    let dir = Scratch::new("nogroup");
    let missing = dir.path("does-not-exist.toml");
    let o = run(&["broadcast", "--group", s(&missing), "--rank", "0", "--to", "1", "-"]);
    problems.extend(expect_error("nonexistent file", &o, &[s(&missing), "No such file"]));
    let o = run(&["receive", "--group", s(&missing), "--rank", "1", "--count", "1", "--timeout", "1"]);
    problems.extend(expect_error("nonexistent file (receive)", &o, &[s(&missing), "No such file"]));
    assert_clean(test, problems);
}

/// A TOML syntax error inside a value (`port = ` with nothing after it): the
/// message must say which line and which field.
#[test]
fn invalid_toml_value_names_field_and_line() {
    let test = "invalid_toml_value_names_field_and_line";
    let cases = [BadGroup {
        case: "invalid TOML: missing value",
        text: edit_member2("port", "port = "),
        words: vec!["port"],
        lines: vec![12],
    }];
    assert_clean(test, check_bad_groups("badtoml", &cases));
}

#[test]
fn broadcast_refuses_bad_ranks_and_paths() {
    let test = "broadcast_refuses_bad_ranks_and_paths";
    let dir = Scratch::new("badranks");
    let ports = free_ports(3);
    let g = dir.write("g.toml", loopback_group(&ports, "lo"));
    let input = dir.write("in.bin", pattern(3000, 1));
    // Listens on rank 1's and rank 2's ports: a refused command sends nothing.
    let watch: Vec<UdpSocket> = ports[1..]
        .iter()
        .map(|p| {
            let s = UdpSocket::bind(("127.0.0.1", *p)).expect("binding a member port");
            s.set_nonblocking(true).expect("nonblocking");
            s
        })
        .collect();
    let cases: [(&str, &[&str], &[&str]); 8] = [
        ("--to 99", &["--rank", "0", "--to", "99"], &["rank 99", "not a member", "0-2"]),
        ("--to ''", &["--rank", "0", "--to", ""], &["empty destination set"]),
        ("--to ','", &["--rank", "0", "--to", ","], &["empty destination set"]),
        ("--to 0", &["--rank", "0", "--to", "0"], &["rank 0 is the sender"]),
        ("--to 0-2", &["--rank", "0", "--to", "0-2"], &["rank 0 is the sender"]),
        ("--to 1,99", &["--rank", "0", "--to", "1,99"], &["rank 99", "not a member"]),
        ("--path bogus", &["--rank", "0", "--to", "1", "--path", "bogus"], &["bogus", "kernel, user or auto"]),
        ("--rank 42", &["--rank", "42", "--to", "1"], &["rank 42", "not a member"]),
    ];
    let mut problems = Vec::new();
    for (what, args, words) in cases {
        let mut cmd = vec!["broadcast", "--group", s(&g)];
        cmd.extend_from_slice(args);
        cmd.push(s(&input));
        problems.extend(expect_error(what, &run(&cmd), words));
    }
    std::thread::sleep(Duration::from_millis(100));
    for (w, p) in watch.iter().zip(&ports[1..]) {
        let mut buf = [0u8; 2048];
        if let Ok((n, from)) = w.recv_from(&mut buf) {
            problems.push(format!("a refused command still sent a {n}-byte datagram from {from} to port {p}"));
        }
    }
    assert_clean(test, problems);
}

#[test]
fn missing_interface_kernel_fails_auto_falls_back() {
    let test = "missing_interface_kernel_fails_auto_falls_back";
    if !root_or_skip(test, "as non-root the kernel path fails for lack of root first") {
        return;
    }
    let dir = Scratch::new("noiface");
    let ports = free_ports(2);
    let g = dir.write("g.toml", loopback_group(&ports, "nosuch0"));
    let data = pattern(5000, 2);
    let input = dir.write("in.bin", &data);
    let mut problems = Vec::new();

    let watch = UdpSocket::bind(("127.0.0.1", ports[1])).expect("binding rank 1's port");
    watch.set_nonblocking(true).expect("nonblocking");
    let o = run(&["broadcast", "--group", s(&g), "--rank", "0", "--to", "1", "--path", "kernel", s(&input)]);
    problems.extend(expect_error("--path kernel", &o, &["interface", "nosuch0"]));
    std::thread::sleep(Duration::from_millis(100));
    if let Ok((n, _)) = watch.recv_from(&mut [0u8; 2048]) {
        problems.push(format!("--path kernel failed but sent a {n}-byte datagram"));
    }
    drop(watch);

    let out = dir.path("out.bin");
    let r = Recv::start(&[], &g, 1, ports[1], &out, &dir);
    let o = run(&["broadcast", "--group", s(&g), "--rank", "0", "--to", "1", "--path", "auto", s(&input)]);
    let err = err_of(&o);
    if !o.status.success() {
        problems.push(format!("--path auto: exit {:?}: {err:?}", o.status.code()));
    }
    for n in ["kernel path off", "nosuch0", "user-space path", "over the user path"] {
        if !err.contains(n) {
            problems.push(format!("--path auto: stderr does not mention {n:?}: {err:?}"));
        }
    }
    let (code, rerr) = r.finish(Duration::from_secs(15));
    if code != Some(0) {
        problems.push(format!("kccl receive exited {code:?}: {rerr:?}"));
    }
    check_file(&mut problems, "--path auto", &out, &data);
    assert_clean(test, problems);
    println!("{test}: --path kernel refused naming nosuch0; --path auto fell back and delivered {} bytes", data.len());
}

/// `kccl cluster down` on drop.
struct ClusterDown(String);

impl Drop for ClusterDown {
    fn drop(&mut self) {
        let o = run(&["cluster", "down", "--name", &self.0]);
        if !o.status.success() {
            eprintln!("kccl cluster down --name {} failed: {}", self.0, err_of(&o));
        }
    }
}

fn namespaces_of(cluster: &str) -> Vec<String> {
    let prefix = format!("kccl-{cluster}-");
    fs::read_dir("/var/run/netns")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn end_to_end_in_a_3_host_cluster() {
    let test = "end_to_end_in_a_3_host_cluster";
    if !root_or_skip(test, "network namespaces, BPF") {
        return;
    }
    let t0 = Instant::now();
    let name = kccl_testbed::cluster::unique_name("cli");
    let dir = Scratch::new("e2e");
    let data = pattern(100 * 1024, 3);
    let input = dir.write("in.bin", &data);
    let mut problems = Vec::new();
    {
        let down = ClusterDown(name.clone());
        let o = run(&["cluster", "up", "--hosts", "3", "--name", &name]);
        assert!(o.status.success(), "kccl cluster up: {}", err_of(&o));
        let g = kccl_testbed::cluster::group_path(&name);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(stdout.contains(s(&g)), "cluster up does not print the group file {}: {stdout}", g.display());
        assert_eq!(namespaces_of(&name).len(), 4, "3 hosts + switch");
        let port = kccl_testbed::cluster::DEFAULT_PORT;
        for path in ["kernel", "user"] {
            let out1 = dir.path(&format!("out1-{path}.bin"));
            let out2 = dir.path(&format!("out2-{path}.bin"));
            let r1 = Recv::start(&[], &g, 1, port, &out1, &dir);
            let r2 = Recv::start(&[], &g, 2, port, &out2, &dir);
            let o = run(&["broadcast", "--group", s(&g), "--rank", "0", "--to", "1-2", "--path", path, s(&input)]);
            let err = err_of(&o);
            if !o.status.success() {
                problems.push(format!("{path}: broadcast exit {:?}: {err:?}", o.status.code()));
            }
            let says: &[&str] = match path {
                "kernel" => &["kernel path: tc_bcast attached", "to 2 ranks over the kernel path"],
                _ => &["user-space path requested", "to 2 ranks over the user path"],
            };
            for n in says {
                if !err.contains(n) {
                    problems.push(format!("{path}: broadcast stderr does not say {n:?}: {err:?}"));
                }
            }
            for (rank, r, out) in [(1, r1, &out1), (2, r2, &out2)] {
                let (code, rerr) = r.finish(Duration::from_secs(20));
                if code != Some(0) {
                    problems.push(format!("{path}: kccl receive rank {rank} exited {code:?}: {rerr:?}"));
                }
                let line = format!("from rank 0: {} bytes", data.len());
                if !rerr.contains(&line) {
                    problems.push(format!("{path}: receive rank {rank} stderr lacks {line:?}: {rerr:?}"));
                }
                check_file(&mut problems, &format!("{path} rank {rank}"), out, &data);
            }
        }
        drop(down);
    }
    let left = namespaces_of(&name);
    assert!(left.is_empty(), "namespaces left after cluster down: {left:?}");
    assert!(!kccl_testbed::cluster::state_dir(&name).exists(), "state directory left after cluster down");
    assert_clean(test, problems);
    println!("{test}: 100 KiB to ranks 1-2 over the kernel and the user path, bytes checked; {:?}", t0.elapsed());
}

#[test]
fn non_root_auto_falls_back_kernel_needs_root() {
    let test = "non_root_auto_falls_back_kernel_needs_root";
    // As root, drop to nobody for the sender; as anyone else, run directly.
    let Some(prefix) = non_root_prefix(test, KCCL) else { return };
    let dir = Scratch::new("nobody");
    let ports = free_ports(2);
    // iface "lo" exists: the only reason left for the kernel path to fail is root.
    let g = dir.write("g.toml", loopback_group(&ports, "lo"));
    let data = pattern(5000, 4);
    let input = dir.write("in.bin", &data);
    let mut problems = Vec::new();

    let out = dir.path("out.bin");
    let r = Recv::start(&[], &g, 1, ports[1], &out, &dir);
    let o = run_with(prefix, &["broadcast", "--group", s(&g), "--rank", "0", "--to", "1", "--path", "auto", s(&input)]);
    let err = err_of(&o);
    if !o.status.success() {
        problems.push(format!("--path auto as non-root: exit {:?}: {err:?}", o.status.code()));
    }
    for n in ["kernel path off", "not root", "over the user path"] {
        if !err.contains(n) {
            problems.push(format!("--path auto as non-root: stderr does not mention {n:?}: {err:?}"));
        }
    }
    let (code, rerr) = r.finish(Duration::from_secs(15));
    if code != Some(0) {
        problems.push(format!("kccl receive exited {code:?}: {rerr:?}"));
    }
    check_file(&mut problems, "--path auto as non-root", &out, &data);

    let o =
        run_with(prefix, &["broadcast", "--group", s(&g), "--rank", "0", "--to", "1", "--path", "kernel", s(&input)]);
    problems.extend(expect_error("--path kernel as non-root", &o, &["root"]));

    // Making a cluster needs root too, and says so.
    let name = kccl_testbed::cluster::unique_name("clinr");
    let _down = is_root().then(|| ClusterDown(name.clone()));
    let o = run_with(prefix, &["cluster", "up", "--hosts", "2", "--name", &name]);
    problems.extend(expect_error("cluster up as non-root", &o, &["needs root"]));
    assert_clean(test, problems);
    println!(
        "{test}: as {}: auto fell back (not root) and delivered; kernel refused",
        if is_root() { "nobody" } else { "this user" }
    );
}

/// `kccl aggregator`: refused for a group without `aggregator = <rank>` or
/// for another rank, with the fix in the message; runs and stops after
/// `--seconds` on the user path (loopback members, no root needed).
#[test]
fn aggregator_command() {
    let dir = Scratch::new("agg");
    let ports = free_ports(2);
    let plain = dir.write("plain.toml", loopback_group(&ports, "lo"));
    let o = run(&["aggregator", "--group", s(&plain), "--rank", "1", "--path", "user"]);
    let mut bad = expect_error("no aggregator key", &o, &["aggregator = 1"]);
    let with = dir.write("with.toml", format!("aggregator = 1\n{}", loopback_group(&ports, "lo")));
    let o = run(&["aggregator", "--group", s(&with), "--rank", "0", "--path", "user"]);
    bad.extend(expect_error("wrong rank", &o, &["not the group's aggregator", "aggregator = 1"]));
    let o = run(&["aggregator", "--group", s(&with), "--rank", "1", "--path", "user", "--stats-every", "0"]);
    bad.extend(expect_error("--stats-every 0", &o, &["--stats-every 0", "positive"]));
    let args = ["aggregator", "--group", s(&with), "--rank", "1", "--path", "user", "--seconds", "0.5"];
    let o = run(&[&args[..], &["--stats-every", "0.2"]].concat());
    let err = err_of(&o);
    if !o.status.success() {
        bad.push(format!("aggregator --seconds 0.5 failed: {err}"));
    } else if !err.contains("user-space path") || !err.contains("kernel counters: none") {
        bad.push(format!("aggregator output: {err}"));
    } else if err.matches("aggregator counters").count() < 2 {
        bad.push(format!("--stats-every 0.2 over 0.5 s printed the counters fewer than twice: {err}"));
    }
    assert_clean("aggregator_command", bad);
}

/// Spawns `kccl ARGS` with piped output (a member of a collective).
fn spawn(args: &[&str]) -> Child {
    Command::new(KCCL).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning kccl")
}

fn le_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `kccl reduce` and `kccl allreduce` as a user runs them: one process per
/// member of a 4-host cluster, each with its own input file; the root's (or
/// every member's) `--out` file must be the element-wise sum, on both paths.
///
/// ```text
///   h0 (root / member) ─┐
///   h1 ─────────────────┼── br0 (kccl-<name>-sw)
///   h2 ─────────────────┤
///   h3 (allreduce aggregator: `kccl aggregator`) ─┘
/// ```
#[test]
fn reduce_and_allreduce_through_the_cli() {
    let test = "reduce_and_allreduce_through_the_cli";
    if !root_or_skip(test, "network namespaces, BPF") {
        return;
    }
    let name = kccl_testbed::cluster::unique_name("clia");
    let dir = Scratch::new("agg-e2e");
    let n = 3000; // three chunks of 358 int32 and a partial one
    let data: Vec<Vec<i32>> =
        (0..4).map(|r| (0..n).map(|i| (i as i32 * 7 + r * 1000) % 2001 - 1000).collect()).collect();
    let inputs: Vec<PathBuf> = (0..4).map(|r| dir.write(&format!("in{r}.bin"), le_i32(&data[r]))).collect();
    let sum = |ranks: &[usize]| -> Vec<u8> {
        le_i32(&(0..n).map(|i| ranks.iter().map(|&r| data[r][i]).sum()).collect::<Vec<i32>>())
    };
    let mut problems = Vec::new();
    let _down = ClusterDown(name.clone());
    let o = run(&["cluster", "up", "--hosts", "4", "--name", &name]);
    assert!(o.status.success(), "kccl cluster up: {}", err_of(&o));
    let g = kccl_testbed::cluster::group_path(&name);
    let text = fs::read_to_string(&g).expect("reading the group file");
    let ga = dir.write("with-aggregator.toml", format!("aggregator = 3\n{text}"));
    for path in ["kernel", "user"] {
        // reduce to rank 0 of all four members.
        let out = dir.path(&format!("reduce-{path}.bin"));
        let mut kids = Vec::new();
        for (r, input) in inputs.iter().enumerate() {
            let rank = r.to_string();
            let mut args = vec!["reduce", "--group", s(&g), "--rank", &rank, "--root", "0", "--path", path];
            args.extend(["--input", s(input)]);
            if r == 0 {
                args.extend(["--out", s(&out)]);
            }
            kids.push(spawn(&args));
        }
        for (r, k) in kids.into_iter().enumerate() {
            let o = k.wait_with_output().expect("waiting for kccl reduce");
            if !o.status.success() {
                problems.push(format!("{path}: reduce rank {r} exit {:?}: {}", o.status.code(), err_of(&o)));
            } else if r == 0 && !String::from_utf8_lossy(&o.stdout).contains("reduce SUM at root 0: 3000 elements") {
                problems.push(format!("{path}: root output: {}", String::from_utf8_lossy(&o.stdout)));
            }
        }
        check_file(&mut problems, &format!("{path}: reduce result"), &out, &sum(&[0, 1, 2, 3]));

        // allreduce of ranks 0..2 through aggregator rank 3.
        let agg = spawn(&["aggregator", "--group", s(&ga), "--rank", "3", "--path", path, "--seconds", "30"]);
        let mut kids = Vec::new();
        let outs: Vec<PathBuf> = (0..3).map(|r| dir.path(&format!("allreduce-{path}-{r}.bin"))).collect();
        for r in 0..3 {
            let rank = r.to_string();
            let args = ["allreduce", "--group", s(&ga), "--rank", &rank, "--path", path, "--input", s(&inputs[r])];
            let mut args = args.to_vec();
            args.extend(["--out", s(&outs[r])]);
            kids.push(spawn(&args));
        }
        for (r, k) in kids.into_iter().enumerate() {
            let o = k.wait_with_output().expect("waiting for kccl allreduce");
            if !o.status.success() {
                problems.push(format!("{path}: allreduce rank {r} exit {:?}: {}", o.status.code(), err_of(&o)));
            }
        }
        // SIGTERM ends the aggregator cleanly, with its counters: on the
        // kernel path xdp_agg's by name (the results it sent among them).
        // SAFETY: kill(2) of the child we spawned.
        unsafe { libc::kill(agg.id() as i32, libc::SIGTERM) };
        let o = agg.wait_with_output().expect("waiting for kccl aggregator");
        let want =
            if path == "kernel" { "kernel counters (xdp_agg, tc_agg_result): " } else { "kernel counters: none" };
        let err = err_of(&o);
        if !o.status.success() || !err.contains(want) || (path == "kernel" && !err.contains(" results=")) {
            problems.push(format!("{path}: aggregator after SIGTERM: exit {:?}, stderr {err:?}", o.status.code()));
        }
        for (r, out) in outs.iter().enumerate() {
            check_file(&mut problems, &format!("{path}: allreduce result at rank {r}"), out, &sum(&[0, 1, 2]));
        }
    }
    assert_clean(test, problems);
}

#[test]
fn bench_all_rejects_bad_arguments() {
    let test = "bench_all_rejects_bad_arguments";
    let dir = Scratch::new("suite-bad");
    let file = dir.write("not-a-dir", "x");
    let mut problems = Vec::new();
    let o = run(&["bench", "all", "--smoke", "--experiments", "bcast,agg-cpu", "--out", s(&dir.path("o1"))]);
    problems.extend(expect_error(
        "unknown experiment",
        &o,
        &["unknown experiment 'bcast'", "bcast-receivers", "param-server"],
    ));
    let o = run(&["bench", "all", "--smoke", "--out", s(&file)]);
    problems.extend(expect_error("--out is a file", &o, &["not-a-dir", "not a directory"]));
    let o = run(&["bench", "all", "--smoke", "--max-bytes", "0", "--out", s(&dir.path("o2"))]);
    problems.extend(expect_error("--max-bytes 0", &o, &["--max-bytes 0"]));
    let o = run(&["bench", "all", "--smoke", "--experiments", "", "--out", s(&dir.path("o3"))]);
    problems.extend(expect_error("empty experiment list", &o, &["experiment"]));
    // Not an option of the suite: clap's usage error (exit 2) names it.
    let o = run(&["bench", "all", "--smoke", "--iters", "5"]);
    if o.status.code() != Some(2) || !err_of(&o).contains("--iters") {
        problems.push(format!("--iters: exit {:?}, stderr {:?}", o.status.code(), err_of(&o)));
    }
    // Nothing was created for a rejected run.
    for d in ["o1", "o2", "o3"] {
        if dir.path(d).exists() {
            problems.push(format!("a rejected run created {d}"));
        }
    }
    assert_clean(test, problems);
}

#[test]
fn bench_all_runs_a_tiny_subset() {
    let test = "bench_all_runs_a_tiny_subset";
    let dir = Scratch::new("suite-run");
    let out = dir.path("out");
    let mut problems = Vec::new();
    // Scatter-gather does not exist yet: recorded as not measured, no root needed.
    let o = run(&["bench", "all", "--smoke", "--experiments", "scatter-gather", "--out", s(&out)]);
    if !o.status.success() {
        problems.push(format!("scatter-gather only: exit {:?}: {}", o.status.code(), err_of(&o)));
    }
    let summary = fs::read_to_string(out.join("summary.md")).unwrap_or_default();
    if !summary.contains("not measured: kccl has no scatter-gather yet") {
        problems.push(format!("summary.md does not say scatter-gather is not measured: {summary:?}"));
    }
    let sg = fs::read_to_string(out.join("scatter-gather.json")).unwrap_or_default();
    if !sg.contains("\"status\": \"not measured\"") {
        problems.push(format!("scatter-gather.json: {sg:?}"));
    }
    if !root_or_skip(&format!("{test} (broadcast part)"), "network namespaces, BPF") {
        assert_clean(test, problems);
        return;
    }
    // One real experiment, checked results, both kccl paths (the peers have tests/peers.rs).
    let o = run(&["bench", "all", "--smoke", "--experiments", "bcast-size", "--no-peers", "--out", s(&out)]);
    if !o.status.success() {
        problems.push(format!("bcast-size: exit {:?}: {}", o.status.code(), err_of(&o)));
    }
    let json = fs::read_to_string(out.join("bcast-size.json")).unwrap_or_default();
    match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(v) => {
            let rows = v[0]["rows"].as_array().cloned().unwrap_or_default();
            // Two series: to the receiving application, and to the kernel's receive timestamp.
            for series in ["app", "held"] {
                for sys in ["kccl-kernel", "kccl-user"] {
                    let n = rows
                        .iter()
                        .filter(|r| {
                            r["series"] == series && r["system"] == sys && r["median"].as_f64().is_some_and(|m| m > 0.0)
                        })
                        .count();
                    if n != 2 {
                        problems.push(format!(
                            "bcast-size.json: {n} {series} rows of {sys} with a positive median, expected 2 (sizes 64, 1472)"
                        ));
                    }
                }
            }
            if v[0]["status"] != "measured" {
                problems.push(format!("bcast-size status {}", v[0]["status"]));
            }
        }
        Err(e) => problems.push(format!("bcast-size.json is not JSON: {e}")),
    }
    if fs::metadata(out.join("bcast-size.png")).map(|m| m.len()).unwrap_or(0) < 1000 {
        problems.push("bcast-size.png missing or empty".into());
    }
    assert_clean(test, problems);
}

/// A result check that fails makes `kccl bench all` exit non-zero and
/// summary.md mark the failure: the test-only KCCL_BENCH_CORRUPT corrupts one
/// element of each checked kccl result of one cheap experiment; the same run
/// without it must pass (so the failure is the corruption's, not the run's).
#[test]
fn bench_all_fails_when_a_result_check_fails() {
    let test = "bench_all_fails_when_a_result_check_fails";
    if !root_or_skip(test, "network namespaces, BPF") {
        return;
    }
    let dir = Scratch::new("suite-corrupt");
    let mut problems = Vec::new();
    let args = |out: &Path| -> Vec<String> {
        ["bench", "all", "--smoke", "--no-peers", "--experiments", "agg-throughput", "--max-bytes", "65536", "--out"]
            .iter()
            .map(|a| a.to_string())
            .chain([s(out).to_string()])
            .collect()
    };
    let run_env = |out: &Path, corrupt: Option<&str>| -> Output {
        let mut cmd = Command::new(KCCL);
        cmd.args(args(out)).stdin(Stdio::null()).env_remove("KCCL_BENCH_CORRUPT");
        if let Some(e) = corrupt {
            cmd.env("KCCL_BENCH_CORRUPT", e);
        }
        cmd.output().expect("running kccl")
    };
    let good = dir.path("good");
    let o = run_env(&good, None);
    if !o.status.success() {
        problems.push(format!("without corruption: exit {:?}: {}", o.status.code(), err_of(&o)));
    }
    let bad = dir.path("bad");
    let o = run_env(&bad, Some("agg-throughput"));
    if o.status.success() || o.status.code() != Some(1) {
        problems.push(format!("with a corrupted result: exit {:?}, expected 1", o.status.code()));
    }
    if !err_of(&o).contains("1 of 1 experiments failed") {
        problems.push(format!("stderr does not count the failed experiment: {:?}", err_of(&o)));
    }
    let summary = fs::read_to_string(bad.join("summary.md")).unwrap_or_default();
    let failed_line = summary.lines().find(|l| l.starts_with("- **FAILED**: bytes=65536: kccl reduce: reduce check"));
    if failed_line.is_none() {
        problems.push(format!("summary.md has no FAILED line for the reduce check: {summary:?}"));
    }
    if !summary.contains("Status: **failed**") {
        problems.push("summary.md does not mark agg-throughput as failed".into());
    }
    let json = fs::read_to_string(bad.join("agg-throughput.json")).unwrap_or_default();
    if !json.contains("\"status\": \"failed\"") {
        problems.push(format!("agg-throughput.json is not marked failed: {json:.300}"));
    }
    assert_clean(test, problems);
}
