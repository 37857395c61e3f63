//! Integration tests of the virtual cluster (`kccl_testbed::cluster`).
//!
//! ```text
//!   kccl-<name>-h0        kccl-<name>-h1        kccl-<name>-h2
//!   eth0 10.77.0.1        eth0 10.77.0.2        eth0 10.77.0.3
//!   02:6b:63:00:00:01     02:6b:63:00:00:02     02:6b:63:00:00:03
//!        |  veth               |  veth               |  veth
//!   +----h0--------------------h1--------------------h2----+
//!   |                         br0                          |
//!   |                   kccl-<name>-sw                     |
//!   +------------------------------------------------------+
//! ```
//!
//! Every test makes its own uniquely named cluster inside a ClusterGuard, so
//! the namespaces are removed even when an assertion fails. The tests need
//! root; without it each prints `SKIPPED <test>: needs root (network
//! namespaces)` and returns.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kccl::netns;
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};
use kccl_testbed::queues;
use kccl_testbed::Error;

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

/// Names of existing namespaces that start with "kccl-<name>-".
fn namespaces_of(name: &str) -> Vec<String> {
    let prefix = format!("kccl-{name}-");
    let mut v: Vec<String> = std::fs::read_dir(netns::NETNS_RUN_DIR)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `ip -n NS -j ARGS`, parsed.
fn ip_json(ns: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new("ip").args(["-n", ns, "-j"]).args(args).output().expect("running ip");
    assert!(out.status.success(), "ip -n {ns} -j {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("ip -j prints JSON")
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn three_hosts_addresses_neighbours_and_udp() {
    if !root_or_skip("three_hosts_addresses_neighbours_and_udp", "network namespaces") {
        return;
    }
    let name = cluster::unique_name("t3");
    let t = Instant::now();
    // Two queues per link whatever the CPU count, so XPS is set up and
    // checked on any machine.
    let mut spec = ClusterSpec::new(&name, 3);
    spec.queues = Some(2);
    let guard = ClusterGuard::up(&spec).expect("cluster up");
    println!("up of 3 hosts: {:?}", t.elapsed());
    let c = &guard.cluster;
    assert_eq!(c.hosts.len(), 3);
    assert_eq!(namespaces_of(&name).len(), 4, "3 hosts + the switch");

    // Per host: address, MAC, no IPv6 address, and a PERMANENT neighbour
    // entry for every other host with that host's MAC.
    for h in &c.hosts {
        let want_addr = Ipv4Addr::new(10, 77, 0, h.index as u8 + 1);
        let want_mac = format!("02:6b:63:00:00:{:02x}", h.index + 1);
        assert_eq!(h.addr, want_addr);
        assert_eq!(h.netns, format!("kccl-{name}-h{}", h.index));

        let addr = ip_json(&h.netns, &["addr", "show", "dev", "eth0"]);
        let link = &addr[0];
        assert_eq!(link["address"], want_mac.as_str(), "{}: MAC of eth0", h.netns);
        assert_eq!(link["operstate"], "UP", "{}: eth0 state", h.netns);
        let infos = link["addr_info"].as_array().expect("addr_info");
        let inet: Vec<(String, u64)> = infos
            .iter()
            .filter(|a| a["family"] == "inet")
            .map(|a| (a["local"].as_str().unwrap_or("").to_owned(), a["prefixlen"].as_u64().unwrap_or(0)))
            .collect();
        assert_eq!(inet, vec![(want_addr.to_string(), 16)], "{}: IPv4 of eth0", h.netns);
        assert!(infos.iter().all(|a| a["family"] != "inet6"), "{}: IPv6 must be off, got {infos:?}", h.netns);

        let neigh = ip_json(&h.netns, &["neigh", "show", "dev", "eth0"]);
        let entries = neigh.as_array().expect("neigh list");
        for o in c.hosts.iter().filter(|o| o.index != h.index) {
            let e = entries
                .iter()
                .find(|e| e["dst"] == o.addr.to_string().as_str())
                .unwrap_or_else(|| panic!("{}: no neighbour entry for {}: {neigh}", h.netns, o.addr));
            assert_eq!(e["lladdr"], format!("02:6b:63:00:00:{:02x}", o.index + 1).as_str());
            let state = e["state"].as_array().expect("state list");
            assert!(state.iter().any(|s| s == "PERMANENT"), "{}: {} state {state:?}", h.netns, o.addr);
        }
        assert_eq!(entries.len(), 2, "{}: exactly one entry per other host: {neigh}", h.netns);

        // Queues: 2 each way on eth0 and on its switch port, whose XPS
        // masks send each CPU's frames on that CPU's queue.
        let d = ip_json(&h.netns, &["-d", "link", "show", "dev", "eth0"]);
        assert_eq!((d[0]["num_tx_queues"].as_u64(), d[0]["num_rx_queues"].as_u64()), (Some(2), Some(2)), "{}", h.netns);
        let port = format!("h{}", h.index);
        let sw = cluster::switch_netns(&name);
        let d = ip_json(&sw, &["-d", "link", "show", "dev", &port]);
        assert_eq!((d[0]["num_tx_queues"].as_u64(), d[0]["num_rx_queues"].as_u64()), (Some(2), Some(2)), "{port}");
        for (q, cpus) in queues::xps_plan(&queues::allowed_cpus(), 2).iter().enumerate() {
            let out = Command::new("ip")
                .args(["netns", "exec", &sw, "cat", &format!("/sys/class/net/{port}/queues/tx-{q}/xps_cpus")])
                .output()
                .expect("read xps_cpus");
            let got = String::from_utf8_lossy(&out.stdout).replace(',', "");
            let want = if cpus.is_empty() { "0".to_owned() } else { queues::cpumask(cpus).replace(',', "") };
            assert_eq!(
                u128::from_str_radix(got.trim(), 16).ok(),
                u128::from_str_radix(&want, 16).ok(),
                "{port} tx-{q} XPS mask {got:?}, want CPUs {cpus:?}"
            );
        }
    }

    // UDP: h0 -> h2 and h1 -> h2, from threads inside the namespaces.
    let port = 47999;
    let h2 = c.hosts[2].clone();
    let (ready_tx, ready_rx) = mpsc::channel();
    let receiver = std::thread::spawn(move || {
        netns::run_in(Some(&h2.netns), move || {
            let sock = UdpSocket::bind((h2.addr, port)).map_err(|e| kccl::Error::io("bind in h2", e))?;
            sock.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| kccl::Error::io("timeout", e))?;
            let _ = ready_tx.send(());
            let mut got = Vec::new();
            let mut buf = [0u8; 256];
            for _ in 0..2 {
                let (n, from) = sock.recv_from(&mut buf).map_err(|e| kccl::Error::io("recv in h2", e))?;
                got.push((from, buf[..n].to_vec()));
            }
            // Nothing else may arrive.
            sock.set_read_timeout(Some(Duration::from_millis(300))).map_err(|e| kccl::Error::io("timeout", e))?;
            if let Ok((n, from)) = sock.recv_from(&mut buf) {
                got.push((from, buf[..n].to_vec()));
            }
            Ok(got)
        })
    });
    ready_rx.recv_timeout(Duration::from_secs(5)).expect("receiver in h2 is ready");
    for sender in [0usize, 1] {
        let ns = c.hosts[sender].netns.clone();
        let dst = SocketAddr::from((c.hosts[2].addr, port));
        let sent = netns::run_in(Some(&ns), move || {
            let sock = UdpSocket::bind("0.0.0.0:0").map_err(|e| kccl::Error::io("bind", e))?;
            sock.send_to(format!("from h{sender}").as_bytes(), dst).map_err(|e| kccl::Error::io("send", e))
        })
        .expect("send from a host");
        assert_eq!(sent, 7);
    }
    let got = receiver.join().expect("receiver thread").expect("receive in h2");
    let got: BTreeSet<(Ipv4Addr, String)> = got
        .into_iter()
        .map(|(from, p)| {
            let ip = match from {
                SocketAddr::V4(a) => *a.ip(),
                SocketAddr::V6(a) => panic!("IPv6 source {a}"),
            };
            (ip, String::from_utf8_lossy(&p).into_owned())
        })
        .collect();
    let want: BTreeSet<(Ipv4Addr, String)> =
        [(Ipv4Addr::new(10, 77, 0, 1), "from h0".to_owned()), (Ipv4Addr::new(10, 77, 0, 2), "from h1".to_owned())]
            .into_iter()
            .collect();
    assert_eq!(got, want, "h2 receives exactly one datagram from h0 and one from h1");

    // Down removes the 4 namespaces and the state dir.
    let state = guard.cluster.group_path.parent().expect("state dir").to_path_buf();
    assert!(state.exists());
    let t = Instant::now();
    assert_eq!(cluster::down(&name).expect("down"), 4);
    println!("down of 3 hosts: {:?}", t.elapsed());
    assert_eq!(namespaces_of(&name), Vec::<String>::new());
    assert!(!state.exists(), "{} must be gone", state.display());
    assert_eq!(cluster::down(&name).expect("second down"), 0);
}

#[test]
fn sixty_five_hosts_up_down_and_load() {
    if !root_or_skip("sixty_five_hosts_up_down_and_load", "network namespaces") {
        return;
    }
    let name = cluster::unique_name("t65");
    let mut spec = ClusterSpec::new(&name, 65);
    spec.port = 47100;
    spec.job_id = 9;
    let t = Instant::now();
    let guard = ClusterGuard::up(&spec).expect("cluster up");
    let up_time = t.elapsed();
    let c = &guard.cluster;
    assert_eq!(c.hosts.len(), 65);
    assert_eq!(namespaces_of(&name).len(), 66);
    assert_eq!(c.hosts[64].addr, Ipv4Addr::new(10, 77, 0, 65));

    let g = kccl::group::Group::load(&c.group_path).expect("group file loads");
    assert_eq!(g.members.len(), 65);
    assert_eq!(g.job_id, 9);
    assert_eq!(g.name, name);
    for (i, m) in g.members.iter().enumerate() {
        assert_eq!(usize::from(m.rank), i);
        assert_eq!(m.addr, cluster::host_addr(i));
        assert_eq!(m.port, 47100);
        assert_eq!(m.iface, "eth0");
        assert_eq!(m.netns.as_deref(), Some(cluster::host_netns(&name, i).as_str()));
    }
    let loaded = cluster::load(&name).expect("load");
    assert_eq!(&loaded, c, "load() returns what up() returned");

    // The last host has permanent entries for all 64 others.
    let neigh = ip_json(&c.hosts[64].netns, &["neigh", "show", "dev", "eth0", "nud", "permanent"]);
    assert_eq!(neigh.as_array().map(Vec::len), Some(64));

    let t = Instant::now();
    assert_eq!(cluster::down(&name).expect("down"), 66);
    let down_time = t.elapsed();
    println!("65 hosts: up {up_time:?}, down {down_time:?}");
    assert!(namespaces_of(&name).is_empty());
    assert!(!c.group_path.exists());
    assert!(up_time < Duration::from_secs(30), "up took {up_time:?}");
    assert!(down_time < Duration::from_secs(30), "down took {down_time:?}");
    drop(guard);
}

#[test]
fn errors_are_clear() {
    if !root_or_skip("errors_are_clear", "network namespaces") {
        return;
    }
    for bad in ["", "Upper", "a_b", "a/b", "thirteenchars"] {
        match cluster::up(&ClusterSpec::new(bad, 2)) {
            Err(Error::Cluster { msg, .. }) => println!("name {bad:?}: {msg}"),
            other => panic!("name {bad:?} must be refused, got {other:?}"),
        }
    }
    let name = cluster::unique_name("te");
    match cluster::up(&ClusterSpec::new(&name, 1)) {
        Err(Error::Cluster { msg, .. }) => assert!(msg.contains("2 to 1000"), "{msg}"),
        other => panic!("1 host must be refused, got {other:?}"),
    }
    assert!(namespaces_of(&name).is_empty(), "a refused up creates nothing");

    let guard = ClusterGuard::up(&ClusterSpec::new(&name, 2)).expect("cluster up");
    match cluster::up(&ClusterSpec::new(&name, 3)) {
        Err(e @ Error::Cluster { .. }) => {
            let s = e.to_string();
            assert!(s.contains("exists") && s.contains(&format!("kccl cluster down --name {name}")), "{s}");
        }
        other => panic!("second up must be refused, got {other:?}"),
    }
    // The first cluster is untouched.
    assert_eq!(namespaces_of(&name).len(), 3);
    assert_eq!(cluster::load(&name).expect("load"), guard.cluster);
    // Quiet: the tool's output would land in the middle of the test lines.
    let ok = cluster::exec(&name, "h0", &strings(&["sh", "-c", "ip -o link show dev eth0 > /dev/null"])).expect("exec");
    assert!(ok.success());

    for host in ["h2", "7", "x", "", "kccl-other-h0", "h-1", "h+1", "+1"] {
        match cluster::exec(&name, host, &strings(&["true"])) {
            Err(Error::Cluster { msg, .. }) => assert!(msg.contains("h0..h1"), "{host}: {msg}"),
            other => panic!("host {host:?} must be refused, got {other:?}"),
        }
    }
    assert!(matches!(cluster::exec(&name, "h0", &[]), Err(Error::BadSetting { .. })));
    match cluster::exec(&cluster::unique_name("none"), "h0", &strings(&["true"])) {
        Err(Error::Cluster { msg, .. }) => assert!(msg.contains("no such cluster"), "{msg}"),
        other => panic!("exec in a missing cluster must fail, got {other:?}"),
    }
    match cluster::load(&cluster::unique_name("none")) {
        Err(Error::Cluster { msg, .. }) => assert!(msg.contains("no such cluster"), "{msg}"),
        other => panic!("load of a missing cluster must fail, got {other:?}"),
    }
}

#[test]
fn failed_up_leaves_nothing_and_races_leave_the_winner() {
    if !root_or_skip("failed_up_leaves_nothing_and_races_leave_the_winner", "network namespaces") {
        return;
    }
    // A failure after the namespaces exist: make writing the group file fail
    // by putting a directory where it goes.
    let name = cluster::unique_name("tf");
    let blocker = cluster::group_path(&name);
    std::fs::create_dir_all(&blocker).expect("create blocker dir");
    let r = cluster::up(&ClusterSpec::new(&name, 3));
    let leftover = namespaces_of(&name);
    let _ = std::fs::remove_dir_all(cluster::state_dir(&name));
    let _ = cluster::down(&name);
    match r {
        Err(e) => println!("failed up: {e}"),
        Ok(c) => panic!("up must fail when the group file cannot be written, got {c:?}"),
    }
    assert!(leftover.is_empty(), "a failed up must remove its namespaces: {leftover:?}");

    // Two concurrent ups of one name: exactly one wins, and the loser must
    // not remove the winner's namespaces while cleaning up after itself.
    for round in 0..5 {
        let name = cluster::unique_name("tr");
        let spawn = |n: String| std::thread::spawn(move || cluster::ClusterGuard::up(&ClusterSpec::new(&n, 4)));
        let (a, b) = (spawn(name.clone()), spawn(name.clone()));
        let results = [a.join().expect("thread a"), b.join().expect("thread b")];
        let winners: Vec<&ClusterGuard> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: exactly one up wins: {results:?}");
        if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
            println!("round {round}: loser: {e}");
        }
        assert_eq!(namespaces_of(&name).len(), 5, "round {round}: the winner is intact");
        assert_eq!(&cluster::load(&name).expect("load"), &winners[0].cluster);
        let st = cluster::exec(&name, "h3", &strings(&["true"])).expect("exec in the winner");
        assert!(st.success());
        drop(results);
        assert!(namespaces_of(&name).is_empty());
    }
}

#[test]
fn exec_runs_inside_the_host() {
    if !root_or_skip("exec_runs_inside_the_host", "network namespaces") {
        return;
    }
    let name = cluster::unique_name("tx");
    let guard = ClusterGuard::up(&ClusterSpec::new(&name, 2)).expect("cluster up");

    let st =
        cluster::exec(&name, "h1", &strings(&["sh", "-c", "ip -o -4 addr show dev eth0 > /dev/null"])).expect("exec");
    assert!(st.success(), "{st:?}");

    let out = std::env::temp_dir().join(format!("kccl-{name}-exec.txt"));
    let script = format!("ip -o -4 addr show dev eth0 > {}", out.display());
    // "1" and the full namespace name name the same host.
    for host in ["1".to_owned(), cluster::host_netns(&name, 1)] {
        let _ = std::fs::remove_file(&out);
        let st = cluster::exec(&name, &host, &strings(&["sh", "-c", &script])).expect("exec");
        assert!(st.success());
        let text = std::fs::read_to_string(&out).expect("exec wrote the file");
        assert!(text.contains("10.77.0.2/16"), "{host}: {text}");
    }

    // Exit codes come back; the BPF filesystem (if mounted) stays visible,
    // which `ip netns exec` would hide.
    let st = cluster::exec(&name, "h0", &strings(&["sh", "-c", "exit 3"])).expect("exec");
    assert_eq!(st.code(), Some(3));
    if Path::new("/sys/fs/bpf").exists() {
        let _ = std::fs::remove_file(&out);
        let script = format!("stat -f -c %T /sys/fs/bpf > {}", out.display());
        cluster::exec(&name, "h0", &strings(&["sh", "-c", &script])).expect("exec");
        let inside = std::fs::read_to_string(&out).unwrap_or_default();
        let here = Command::new("stat").args(["-f", "-c", "%T", "/sys/fs/bpf"]).output().expect("stat");
        assert_eq!(inside.trim(), String::from_utf8_lossy(&here.stdout).trim(), "same /sys/fs/bpf inside");
    }
    let _ = std::fs::remove_file(&out);
    drop(guard);
    assert!(namespaces_of(&name).is_empty());
}
