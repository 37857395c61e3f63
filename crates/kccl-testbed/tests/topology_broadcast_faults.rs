//! Reliable broadcast under loss, duplication, reordering, a dead receiver and
//! forged acknowledgments, on a virtual cluster, checked receiver by receiver.
//!
//! ```text
//!   sender rank 0            receivers ranks 1..4 (rank 2: the "member link")
//!  kccl-<name>-h0           kccl-<name>-h1 ... kccl-<name>-h4
//! +------------------+     +-----------------+    +-----------------+
//! | Broadcaster      |     | Receiver rank 1 |    | Receiver rank 2 |
//! |  tc_bcast  (TCX) |     |                 |    |  [tc_fault] on  |
//! |  [tc_fault] on   |     |                 |    |  eth0: its ACKs |
//! |  eth0: sender's  |     |                 |    |                 |
//! |  link (data out) |     | eth0 10.77.0.2  |    | eth0 10.77.0.3  |
//! +--------|---------+     +--------|--------+    +--------|--------+
//!          | veth                   | veth                 | veth
//! +--------h0-----------------------h1---------------------h2-[tc_fault]-----+
//! |                 br0, netns kccl-<name>-sw     (h2 egress: data to rank 2) |
//! +---------------------------------------------------------------------------+
//! ```
//!
//! Faults come from the project's injector (crate::fault, tc_fault at TCX
//! egress): on the sender's link it hits every data packet (the fan-out
//! original and each copy) and nothing else; on rank 2's link it is installed
//! on both directions (the switch port's egress carries the data to rank 2,
//! rank 2's eth0 egress carries its acknowledgments).
//!
//! Every randomized case prints its seed (`KCCL_TEST_SEED=<n>` replays a run;
//! one CPU's decisions are then reproducible, see tc_fault).  For each case
//! and both paths: every receiver got every message exactly once, byte for
//! byte (length and FNV-1a checksum per receiver), and broadcast() returned
//! Ok, i.e. every receiver confirmed.
//!
//! Run: `cargo test --release -p kccl-testbed --test topology_broadcast_faults -- --test-threads=1 --nocapture`

use std::collections::BTreeMap;
use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kccl::bcast::{Broadcaster, Message, Receiver, RecvStats, Reliability, SenderStats};

use kccl::error::Error;
use kccl::fault::{self, FaultConfig, FaultStats};
use kccl::group::Group;
use kccl::netns;
use kccl::transport::{Path, PathChoice};
use kccl::wire::{BcastAck, Header, ACK_COMPLETE, HDR_LEN, T_BCAST, T_BCAST_ACK, VERSION};
use kccl_testbed::bench::fnv1a;
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::{pattern, root_or_skip};

const RECEIVERS: [u16; 4] = [1, 2, 3, 4];
/// The receiver whose link gets the faults in the "member link" cases.
const MEMBER: u16 = 2;

/// Base seed: KCCL_TEST_SEED, else the clock.  Printed by every case.
fn base_seed() -> u64 {
    std::env::var("KCCL_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    })
}

/// Single packets, packet boundaries and multi-packet messages up to ~733
/// packets (1 MiB at MTU 1500).  Sizes scale with the payload per packet of
/// the cluster's MTU, so every MTU sends as many packets and sees as many
/// drops at a given loss rate.
fn messages(salt: u64, mtu: u32) -> Vec<Vec<u8>> {
    let p = mtu as usize - 68;
    [1usize, p, p + 1, 20_000 * p / 1432, 300_000 * p / 1432, (1 << 20) * p / 1432]
        .iter()
        .enumerate()
        .map(|(i, &l)| pattern(l, salt + i as u64))
        .collect()
}

fn on_host<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            netns::enter(ns).unwrap_or_else(|e| panic!("entering {ns}: {e}"));
            f()
        });
        h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Fault injectors installed by a case; removed on drop (also on panic).
struct Faults(Vec<(String, String)>);

impl Faults {
    fn install(at: &[(String, &str)], cfg: &FaultConfig) -> Faults {
        let mut f = Faults(Vec::new());
        for (i, (ns, iface)) in at.iter().enumerate() {
            // Each injector its own decision sequence.
            let c = FaultConfig { seed: cfg.seed.wrapping_add(i as u64 * 0x9e37), ..*cfg };
            fault::install(Some(ns), iface, &c).unwrap_or_else(|e| panic!("fault on {iface} in {ns}: {e}"));
            f.0.push((ns.clone(), iface.to_string()));
        }
        f
    }

    fn stats(&self) -> FaultStats {
        let mut t = FaultStats::default();
        for (ns, iface) in &self.0 {
            let s = fault::pinned_stats(Some(ns), iface).unwrap_or_default();
            t.seen += s.seen;
            t.dropped += s.dropped;
            t.duplicated += s.duplicated;
            t.held += s.held;
        }
        t
    }
}

impl Drop for Faults {
    fn drop(&mut self) {
        for (ns, iface) in &self.0 {
            let _ = fault::clear(Some(ns), iface);
        }
    }
}

/// What one receiver thread took, and its counters.
type Took = (Vec<Message>, RecvStats);

/// Receiver threads that keep receiving (and so acknowledging) until stopped.
struct Rx {
    stop: Arc<AtomicBool>,
    threads: Vec<(u16, JoinHandle<Took>)>,
}

impl Rx {
    fn start(group: &Group, ranks: &[u16], rel: Reliability) -> Rx {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let mut threads = Vec::new();
        for &rank in ranks {
            let (group, stop, ready) = (group.clone(), Arc::clone(&stop), ready_tx.clone());
            let h = std::thread::spawn(move || {
                let setup = || -> Result<Receiver, Error> {
                    netns::enter(group.member(rank.into())?.netns.as_deref().unwrap_or_default())?;
                    let mut r = Receiver::new(&group, rank)?;
                    r.set_reliability(rel)?;
                    Ok(r)
                };
                let mut r = match setup() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready.send(Err(format!("rank {rank}: {e}")));
                        return (Vec::new(), RecvStats::default());
                    }
                };
                let _ = ready.send(Ok(()));
                let mut got = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match r.recv(Some(Duration::from_millis(20))) {
                        Ok(m) => got.push(m),
                        Err(Error::Timeout { .. }) => {}
                        Err(e) => panic!("rank {rank}: recv: {e}"),
                    }
                }
                (got, r.stats())
            });
            threads.push((rank, h));
        }
        for _ in ranks {
            ready_rx.recv_timeout(Duration::from_secs(20)).expect("receiver ready").unwrap_or_else(|e| panic!("{e}"));
        }
        Rx { stop, threads }
    }

    fn finish(mut self) -> BTreeMap<u16, (Vec<Message>, RecvStats)> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads.drain(..).map(|(r, h)| (r, h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))).collect()
    }
}

impl Drop for Rx {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for (_, h) in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Each receiver holds exactly `want` (seq base + i = message i), each once.
fn check_all(got: &BTreeMap<u16, (Vec<Message>, RecvStats)>, base: u32, want: &[Vec<u8>], what: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for (rank, (msgs, st)) in got {
        let mut seen = BTreeMap::new();
        for m in msgs {
            if m.src_rank != 0 {
                bad.push(format!("{what}: rank {rank}: message from rank {}", m.src_rank));
            }
            let i = m.seq.wrapping_sub(base);
            *seen.entry(i).or_insert(0) += 1;
            match want.get(i as usize) {
                None => bad.push(format!("{what}: rank {rank}: unexpected seq {}", m.seq)),
                Some(w) if m.data.len() != w.len() || fnv1a(&m.data) != fnv1a(w) => bad.push(format!(
                    "{what}: rank {rank}: message {}: {} bytes fnv {:016x}, expected {} bytes fnv {:016x}",
                    m.seq,
                    m.data.len(),
                    fnv1a(&m.data),
                    w.len(),
                    fnv1a(w)
                )),
                Some(_) => {}
            }
        }
        for s in 0..want.len() as u32 {
            match seen.get(&s) {
                Some(1) => {}
                Some(n) => bad.push(format!("{what}: rank {rank}: message {s} delivered {n} times")),
                None => bad.push(format!("{what}: rank {rank}: message {s} missing")),
            }
        }
        if st.dropped() > 0 {
            bad.push(format!("{what}: rank {rank}: bad-input counters moved: {st:?}"));
        }
    }
    bad
}

struct Case {
    name: &'static str,
    /// Message sizes (None: [`messages`]).
    sizes: Option<&'static [usize]>,
    member_link: bool,
    loss: f64,
    dup: f64,
    reorder: f64,
    per_packet: bool,
}

/// Runs `case` on both paths of one cluster.
fn run_case(test: &str, prefix: &str, case: &Case) {
    let seed = base_seed();
    let name = cluster::unique_name(prefix);
    let guard = ClusterGuard::up(&ClusterSpec::new(&name, RECEIVERS.len() + 1)).expect("cluster up");
    let group = guard.cluster.group.clone();
    let rel = Reliability { per_packet: case.per_packet, deadline: Duration::from_secs(60), ..Default::default() };
    let mut bad = Vec::new();
    for (pi, path) in [Path::Kernel, Path::User].into_iter().enumerate() {
        let s = seed.wrapping_add(pi as u64);
        println!(
            "{test}: case {} path {path}: seed={s} loss={} dup={} reorder={} per_packet={} (KCCL_TEST_SEED={seed})",
            case.name, case.loss, case.dup, case.reorder, case.per_packet
        );
        let cfg = FaultConfig::from_fractions(case.loss, case.dup, case.reorder, s).expect("fault config");
        let at: Vec<(String, &str)> = if case.member_link {
            vec![(cluster::switch_netns(&name), "h2"), (cluster::host_netns(&name, MEMBER.into()), "eth0")]
        } else {
            vec![(cluster::host_netns(&name, 0), "eth0")]
        };
        let rx = Rx::start(&group, &RECEIVERS, rel);
        let msgs = match case.sizes {
            Some(sz) => sz.iter().enumerate().map(|(i, &l)| pattern(l, s + i as u64)).collect(),
            None => messages(s, group.mtu),
        };
        let faults = Faults::install(&at, &cfg);
        let t0 = Instant::now();
        let (reports, st, base) = on_host(&cluster::host_netns(&name, 0), || {
            let choice = if path == Path::Kernel { PathChoice::Kernel } else { PathChoice::User };
            let mut b = Broadcaster::new(&group, 0, choice).unwrap_or_else(|e| panic!("{e}"));
            b.set_reliability(rel).expect("config");
            let base = b.next_seq();
            let r: Vec<Result<_, Error>> = msgs.iter().map(|m| b.broadcast(m, &RECEIVERS)).collect();
            (r, b.stats(), base)
        });
        let elapsed = t0.elapsed();
        let fs = faults.stats();
        drop(faults);
        let got = rx.finish();
        let what = format!("{} {path} seed={s}", case.name);
        for (i, r) in reports.iter().enumerate() {
            match r {
                Ok(rep) if rep.path == path => {}
                Ok(rep) => bad.push(format!("{what}: message {i} went over the {} path", rep.path)),
                Err(e) => bad.push(format!("{what}: broadcast of message {i}: {e}")),
            }
        }
        bad.extend(check_all(&got, base, &msgs, &what));
        if case.loss >= 0.01 && (fs.dropped == 0 || st.retransmitted == 0) {
            bad.push(format!("{what}: expected drops and retransmissions: faults {fs:?}, sender {st:?}"));
        }
        let rs: RecvStats = got.values().fold(RecvStats::default(), |a, (_, s)| sum_recv(&a, s));
        println!(
            "  {path}: {} messages x {} receivers complete in {elapsed:?}; faults: {} seen, {} dropped, {} duplicated, \
             {} held; sender: {} acks ({} gap reports), {} copies re-sent in {} datagrams, {} probe timeouts; \
             receivers: {} acks sent, {} duplicates, {} after completion, {} re-acks",
            msgs.len(),
            RECEIVERS.len(),
            fs.seen,
            fs.dropped,
            fs.duplicated,
            fs.held,
            st.acks,
            st.gap_reports,
            st.retransmitted,
            st.retransmit_datagrams,
            st.timeouts,
            rs.acks_sent,
            rs.duplicates,
            rs.after_complete,
            rs.reacks
        );
        print_sender_bad_input(&st);
    }
    assert!(bad.is_empty(), "{test}: {} problems:\n  {}", bad.len(), bad.join("\n  "));
}

fn sum_recv(a: &RecvStats, b: &RecvStats) -> RecvStats {
    RecvStats {
        acks_sent: a.acks_sent + b.acks_sent,
        duplicates: a.duplicates + b.duplicates,
        after_complete: a.after_complete + b.after_complete,
        reacks: a.reacks + b.reacks,
        ..Default::default()
    }
}

fn print_sender_bad_input(st: &SenderStats) {
    let n = st.ack_malformed + st.ack_wrong_job + st.ack_not_member + st.ack_not_destination + st.ack_unknown_seq;
    if n + st.ack_invalid + st.ack_stale > 0 {
        println!(
            "  sender ignored: {} malformed, {} wrong job, {} not member, {} not destination, {} unknown seq, \
             {} stale, {} invalid",
            st.ack_malformed,
            st.ack_wrong_job,
            st.ack_not_member,
            st.ack_not_destination,
            st.ack_unknown_seq,
            st.ack_stale,
            st.ack_invalid
        );
    }
}

fn loss_cases(test: &str, prefix: &str, member_link: bool) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    for (i, loss) in [0.0001, 0.001, 0.01, 0.05].into_iter().enumerate() {
        let case = Case { sizes: None, name: "loss", member_link, loss, dup: 0.0, reorder: 0.0, per_packet: false };
        run_case(test, &format!("{prefix}{i}"), &case);
    }
}

#[test]
fn a_loss_on_sender_link() {
    loss_cases("a_loss_on_sender_link", "tfls", false);
}

#[test]
fn b_loss_on_member_link() {
    loss_cases("b_loss_on_member_link", "tflm", true);
}

#[test]
fn c_duplication_and_reordering() {
    let test = "c_duplication_and_reordering";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let sender = Case {
        sizes: None,
        name: "dup+reorder+loss",
        member_link: false,
        loss: 0.01,
        dup: 0.05,
        reorder: 0.05,
        per_packet: false,
    };
    run_case(test, "tfdr", &sender);
    let member = Case {
        sizes: None,
        name: "dup+reorder",
        member_link: true,
        loss: 0.0,
        dup: 0.05,
        reorder: 0.05,
        per_packet: false,
    };
    run_case(test, "tfdm", &member);
}

#[test]
fn d_per_packet_acknowledgments() {
    let test = "d_per_packet_acknowledgments";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let case = Case {
        sizes: None,
        name: "per-packet",
        member_link: false,
        loss: 0.01,
        dup: 0.01,
        reorder: 0.01,
        per_packet: true,
    };
    run_case(test, "tfpp", &case);
    let case = Case {
        sizes: None,
        name: "per-packet",
        member_link: true,
        loss: 0.01,
        dup: 0.0,
        reorder: 0.0,
        per_packet: true,
    };
    run_case(test, "tfpm", &case);
}

/// A 16 MiB message (11717 packets, 12 ACK groups) under 1% loss, on the
/// sender's link and on a member's link: gap reports per group, bounded
/// repair, no retransmission storm (re-sent copies are printed).
#[test]
fn g_large_message_under_loss() {
    let test = "g_large_message_under_loss";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    for (prefix, member_link) in [("tfbgs", false), ("tfbgm", true)] {
        let case = Case {
            sizes: Some(&[16 << 20]),
            name: "16 MiB",
            member_link,
            loss: 0.01,
            dup: 0.0,
            reorder: 0.0,
            per_packet: false,
        };
        run_case(test, prefix, &case);
    }
}

/// Rank 4 stops (closes its socket) after the first datagrams of an 8 MiB
/// message: broadcast() fails at the deadline naming exactly rank 4, the
/// others hold the message, and the group goes on without rank 4.
#[test]
fn e_dead_receiver_mid_message() {
    let test = "e_dead_receiver_mid_message";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let name = cluster::unique_name("tfdead");
    let guard = ClusterGuard::up(&ClusterSpec::new(&name, RECEIVERS.len() + 1)).expect("cluster up");
    let group = guard.cluster.group.clone();
    let deadline = Duration::from_secs(3);
    let rel = Reliability { deadline, ..Default::default() };
    let live = [1u16, 2, 3];
    let rx = Rx::start(&group, &live, rel);
    let (stopped_tx, stopped_rx) = mpsc::channel::<u64>();
    let g4 = group.clone();
    let dying = std::thread::spawn(move || {
        netns::enter(g4.member(4).expect("rank 4").netns.as_deref().unwrap_or_default()).expect("enter h4");
        let mut r = Receiver::new(&g4, 4).expect("receiver 4");
        let t = Instant::now();
        while r.stats().datagrams == 0 && t.elapsed() < Duration::from_secs(30) {
            let _ = r.recv(Some(Duration::from_millis(1)));
        }
        let _ = stopped_tx.send(r.stats().datagrams);
        // Dropping r closes the socket: rank 4 is gone mid-message.
    });
    let big = pattern(8 << 20, 99);
    let small = pattern(5000, 98);
    let (first, took, second) = on_host(&cluster::host_netns(&name, 0), || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        b.set_reliability(rel).expect("config");
        let base = b.next_seq();
        let t = Instant::now();
        let first = b.broadcast(&big, &RECEIVERS);
        let took = t.elapsed();
        (first, took, (b.broadcast(&small, &live), base))
    });
    let (second, base) = second;
    dying.join().expect("rank 4 thread");
    let got_before_stop = stopped_rx.recv_timeout(Duration::from_secs(1)).unwrap_or(0);
    let got = rx.finish();
    println!(
        "{test}: rank 4 stopped after {got_before_stop} datagrams; broadcast() returned after {took:?}: {first:?}"
    );
    match &first {
        Err(Error::BroadcastUnconfirmed { ranks, seq, .. }) => {
            assert_eq!(*seq, base);
            assert_eq!(ranks, &vec![4u16], "exactly rank 4 did not confirm");
        }
        other => panic!("expected BroadcastUnconfirmed naming rank 4, got {other:?}"),
    }
    assert!(took >= deadline, "failed before the deadline ({took:?} < {deadline:?})");
    assert!(got_before_stop > 0, "rank 4 must have stopped mid-message, after some datagrams");
    let second = second.unwrap_or_else(|e| panic!("the next broadcast to the remaining ranks: {e}"));
    assert_eq!(second.seq, base.wrapping_add(1));
    let bad = check_all(&got, base, &[big, small], test);
    assert!(bad.is_empty(), "{test}:\n  {}", bad.join("\n  "));
}

/// ACK header + payload as a receiver would send it.
fn ack_bytes(job: u32, from_rank: u16, seq: u32, msg_len: u32, ack: &BcastAck) -> Vec<u8> {
    let mut body = Vec::new();
    ack.encode(&mut body);
    let h = Header {
        version: VERSION,
        msg_type: T_BCAST_ACK,
        flags: 0,
        job_id: job,
        src_rank: from_rank,
        mask_base: 0,
        dst_mask: 1,
        msg_seq: seq,
        frag_off: 0,
        msg_len,
        payload_len: body.len() as u16,
        agg_op: 0,
        dtype: 0,
    };
    let mut d = h.to_bytes().to_vec();
    d.extend_from_slice(&body);
    d
}

/// Forged and wrong acknowledgments while rank 3 (a destination) is silent:
/// each kind is ignored and counted, and none makes the sender believe rank
/// 3 confirmed: broadcast() fails naming exactly rank 3, ranks 1 and 2 hold
/// the message.  Then bad data at a receiver: a retransmission after
/// completion is re-acknowledged and not delivered again; a forged sender
/// rank is dropped.
#[test]
fn f_bad_input_ignored_and_counted() {
    let test = "f_bad_input_ignored_and_counted";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let name = cluster::unique_name("tfbad");
    let guard = ClusterGuard::up(&ClusterSpec::new(&name, RECEIVERS.len() + 1)).expect("cluster up");
    let group = guard.cluster.group.clone();
    let job = group.job_id;
    let rel = Reliability { deadline: Duration::from_millis(1500), ..Default::default() };
    let rx = Rx::start(&group, &[1, 2], rel);
    let data = pattern(3000, 7);
    let len = data.len() as u32;
    let (addr_tx, addr_rx) = mpsc::channel::<(SocketAddrV4, u32)>();
    let done = Arc::new(AtomicBool::new(false));
    let m3 = group.member(3).expect("rank 3").clone();
    let m4 = group.member(4).expect("rank 4").clone();
    let d2 = Arc::clone(&done);
    let forger = std::thread::spawn(move || -> usize {
        let (to, seq) = addr_rx.recv_timeout(Duration::from_secs(20)).expect("sender address");
        // Rank 3's own address and port (it is a destination, but never
        // acknowledges validly), and another port of rank 3's address.
        let (ns3, ns4) = (m3.netns.clone().unwrap_or_default(), m4.netns.clone().unwrap_or_default());
        let (a3, a3_other, a4) = std::thread::scope(|s| {
            let a = s
                .spawn(|| {
                    netns::enter(&ns3).expect("h3");
                    let a3 = UdpSocket::bind((m3.addr, m3.port)).expect("bind rank 3's port");
                    let o = UdpSocket::bind((m3.addr, 0)).expect("bind");
                    (a3, o)
                })
                .join()
                .expect("h3 thread");
            let b = s
                .spawn(|| {
                    netns::enter(&ns4).expect("h4");
                    UdpSocket::bind((m4.addr, m4.port)).expect("bind rank 4's port")
                })
                .join()
                .expect("h4 thread");
            (a.0, a.1, b)
        });
        let complete = BcastAck { pkt_bytes: 0, npkts: 1, cum: 1, flags: ACK_COMPLETE, ..Default::default() };
        let kinds: Vec<(&UdpSocket, Vec<u8>)> = vec![
            // unknown sequence (ahead of anything sent)
            (&a3, ack_bytes(job, 3, seq.wrapping_add(1000), len, &complete)),
            // wrong message length; cum beyond the message
            (&a3, ack_bytes(job, 3, seq, len + 1, &complete)),
            (&a3, ack_bytes(job, 3, seq, len, &BcastAck { cum: 2, ..complete.clone() })),
            // other job; not an ACK at all
            (&a3, ack_bytes(job + 1, 3, seq, len, &complete)),
            (&a3, b"KCCL not an ack".to_vec()),
            // rank 3 from another port; rank 4 forging rank 3
            (&a3_other, ack_bytes(job, 3, seq, len, &complete)),
            (&a4, ack_bytes(job, 3, seq, len, &complete)),
            // a member that is not a destination
            (&a4, ack_bytes(job, 4, seq, len, &complete)),
        ];
        let mut sent = 0;
        while !d2.load(Ordering::Relaxed) {
            for (s, d) in &kinds {
                let _ = s.send_to(d, to);
                sent += 1;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        sent
    });
    let (res, st, seq) = on_host(&cluster::host_netns(&name, 0), || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        b.set_reliability(rel).expect("config");
        let seq = b.next_seq();
        addr_tx.send((b.local_addr().expect("local addr"), seq)).expect("forger alive");
        // Let forged ACKs queue before the message exists, too.
        std::thread::sleep(Duration::from_millis(100));
        let r = b.broadcast(&data, &[1, 2, 3]);
        (r, b.stats(), seq)
    });
    done.store(true, Ordering::Relaxed);
    let forged = forger.join().expect("forger");
    println!("{test}: {forged} forged datagrams; result {res:?}");
    print_sender_bad_input(&st);
    match &res {
        Err(Error::BroadcastUnconfirmed { ranks, .. }) => assert_eq!(ranks, &vec![3u16]),
        other => panic!("forged ACKs must not confirm rank 3: {other:?}"),
    }
    let mut bad = Vec::new();
    for (what, n) in [
        ("unknown seq", st.ack_unknown_seq),
        ("invalid", st.ack_invalid),
        ("wrong job", st.ack_wrong_job),
        ("malformed", st.ack_malformed),
        ("not member (wrong address/port, forged rank)", st.ack_not_member),
        ("not destination", st.ack_not_destination),
    ] {
        if n == 0 {
            bad.push(format!("sender counter '{what}' did not move: {st:?}"));
        }
    }
    if st.acks < 2 {
        bad.push(format!("ranks 1 and 2 acknowledged, yet only {} acks taken", st.acks));
    }

    // Receiver side: a copy of message 0 after completion from the sender's
    // address (re-acknowledged, never delivered twice), and a data packet
    // from rank 4's address claiming to be rank 0 (forged sender rank).
    let h = Header {
        version: VERSION,
        msg_type: T_BCAST,
        flags: 0,
        job_id: job,
        src_rank: 0,
        mask_base: 0,
        dst_mask: 0b110,
        msg_seq: seq,
        frag_off: 0,
        msg_len: len,
        payload_len: 1432,
        agg_op: 0,
        dtype: 0,
    };
    let mut pkt = h.to_bytes().to_vec();
    pkt.extend_from_slice(&data[..1432]);
    assert_eq!(pkt.len(), HDR_LEN + 1432);
    let m0 = group.member(0).expect("rank 0").clone();
    let m1 = group.member(1).expect("rank 1").clone();
    let to1 = SocketAddrV4::new(m1.addr, m1.port);
    on_host(&cluster::host_netns(&name, 0), || {
        let s = UdpSocket::bind((m0.addr, 0)).expect("bind");
        s.send_to(&pkt, to1).expect("send after completion");
    });
    on_host(&cluster::host_netns(&name, 4), || {
        let s = UdpSocket::bind((m4.addr, 0)).expect("bind");
        s.send_to(&pkt, to1).expect("send forged");
    });
    std::thread::sleep(Duration::from_millis(200));
    let got = rx.finish();
    let (msgs1, st1) = &got[&1];
    println!("{test}: rank 1 stats {st1:?}");
    if msgs1.len() != 1 || msgs1[0].data != data {
        bad.push(format!("rank 1 got {} messages (expected message 0 once)", msgs1.len()));
    }
    if st1.after_complete == 0 || st1.reacks == 0 {
        bad.push(format!("rank 1 did not count/re-acknowledge the copy after completion: {st1:?}"));
    }
    if st1.not_member == 0 {
        bad.push(format!("rank 1 did not count the forged sender rank: {st1:?}"));
    }
    let (msgs2, _) = &got[&2];
    if msgs2.len() != 1 || msgs2[0].data != data {
        bad.push(format!("rank 2 got {} messages", msgs2.len()));
    }
    assert!(bad.is_empty(), "{test}:\n  {}", bad.join("\n  "));
}
