//! Broadcast on a virtual cluster, checked receiver by receiver.
//!
//! ```text
//!     sender (rank 0)              receivers (ranks 1..N)
//!   netns kccl-<name>-h0       netns kccl-<name>-h1   ...   netns kccl-<name>-hN
//!  +----------------------+   +----------------------+     +----------------------+
//!  | Broadcaster          |   | Receiver (rank 1)    |     | Receiver (rank N)    |
//!  |  tc_bcast at TCX     |   |  UDP 10.77.0.2:47000 |     |  UDP 10.77.A.B:47000 |
//!  |  egress of eth0      |   |                      |     |                      |
//!  | eth0 10.77.0.1/16    |   | eth0 10.77.0.2/16    |     | eth0 10.77.A.B/16    |
//!  +---------|------------+   +---------|------------+     +---------|------------+
//!            | veth                     | veth                       | veth
//!  +---------h0-------------------------h1-----------  ...  ---------hN-----------+
//!  |                        br0 (STP off, static FDB)                              |
//!  |                           netns kccl-<name>-sw                                |
//!  +-------------------------------------------------------------------------------+
//! ```
//!
//! Kernel path: rank 0 hands the kernel one datagram per fragment and per
//! 64-rank window of the destination mask; tc_bcast at h0's TCX egress turns
//! it into one copy per destination (rewritten MAC/IP/port), so every copy
//! crosses the bridge as an ordinary unicast UDP datagram.  User path: rank 0
//! sends every copy itself.  Receivers are plain UDP sockets either way.
//!
//! Every test makes its own uniquely named cluster inside a ClusterGuard
//! (removed also when an assertion fails), runs one receiver thread per
//! receiving rank inside that rank's namespace and the sender on a thread
//! inside h0, and then checks, per receiver, exactly which messages arrived
//! (count, sender rank, sequence number, every byte) and that nothing else
//! did: after the expected messages, each receiver must time out on a short
//! further `recv`, and ranks that were not addressed must not see a single
//! datagram.  Without root each test prints `SKIPPED <test>: needs root` and
//! returns.
//!
//! Run: `cargo test --release -p kccl-testbed --test topology_broadcast -- --test-threads=1 --nocapture`

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kccl::bcast::{Broadcaster, Message, Receiver, RecvStats, Reliability, SendReport};

use kccl::error::Error;
use kccl::group::Group;
use kccl::kernel::BcastStats;
use kccl::netns;
use kccl::transport::{Path, PathChoice};
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::{pattern, root_or_skip};

/// How long a receiver waits for each expected message (generous: the
/// machine has 2 cores shared by every host).
const EACH: Duration = Duration::from_secs(20);

/// How long a receiver listens for anything beyond what it expected.
const QUIET: Duration = Duration::from_millis(300);

/// A cluster of `hosts` hosts; rank i lives in host i.
struct Topo {
    guard: ClusterGuard,
}

impl Topo {
    fn up(prefix: &str, hosts: usize) -> Topo {
        let name = cluster::unique_name(prefix);
        let t = Instant::now();
        let guard = ClusterGuard::up(&ClusterSpec::new(&name, hosts)).expect("cluster up");
        println!("cluster {name}: {hosts} hosts up in {:?}", t.elapsed());
        Topo { guard }
    }

    fn name(&self) -> &str {
        &self.guard.cluster.name
    }

    fn group(&self) -> &Group {
        &self.guard.cluster.group
    }

    fn ns(&self, rank: u16) -> String {
        cluster::host_netns(self.name(), rank.into())
    }
}

/// None if equal; else where they first differ (no multi-megabyte dumps).
fn diff(got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} bytes, expected {}", got.len(), want.len()));
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    let n = got[i..].iter().zip(&want[i..]).filter(|(a, b)| a != b).count();
    Some(format!("{n} bytes differ, the first at offset {i} (got {:#04x}, expected {:#04x})", got[i], want[i]))
}

/// Runs `f` on a thread inside network namespace `ns` and returns its result
/// (a panic in `f` is re-raised here, with its message).
fn on_host<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            netns::enter(ns).unwrap_or_else(|e| panic!("entering {ns}: {e}"));
            f()
        });
        h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

enum Cmd {
    /// Receive `n` messages, waiting at most `each` for every one.
    Take { n: usize, each: Duration },
    /// One more `recv` with this timeout (expected to time out).
    Quiet(Duration),
}

enum Reply {
    Took(Vec<Message>, Option<Error>),
    Quiet(Result<Message, Error>, RecvStats),
}

/// What one receiver saw in one round.
struct Outcome {
    rank: u16,
    msgs: Vec<Message>,
    /// Why it stopped before getting all the messages it expected.
    take_err: Option<Error>,
    /// The extra `recv` after the expected messages.
    quiet: Result<Message, Error>,
    /// Receiver counters of this round only.
    stats: RecvStats,
}

struct Worker {
    cmd: Option<mpsc::Sender<Cmd>>,
    reply: Mutex<mpsc::Receiver<Reply>>,
    thread: Option<JoinHandle<()>>,
}

/// One thread per receiving rank, each inside its host's namespace holding a
/// `kccl::bcast::Receiver`, driven by commands so that receiving runs
/// concurrently with the sender.  Sync: the sender thread may drive it.
struct Receivers {
    workers: BTreeMap<u16, Worker>,
    stop: Arc<AtomicBool>,
}

/// `recv` in short slices until `deadline`, so that a stop request (test
/// failure elsewhere) ends the thread quickly.
fn recv_until(r: &mut Receiver, deadline: Instant, stop: &AtomicBool) -> Result<Message, Error> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match r.recv(Some(left.min(Duration::from_millis(250)))) {
            Err(Error::Timeout { .. }) if !left.is_zero() && !stop.load(Ordering::Relaxed) => continue,
            other => return other,
        }
    }
}

impl Receivers {
    fn start(group: &Group, ranks: impl IntoIterator<Item = u16>) -> Receivers {
        let mut rs = Receivers { workers: BTreeMap::new(), stop: Arc::new(AtomicBool::new(false)) };
        let (ready_tx, ready_rx) = mpsc::channel::<(u16, Result<(), Error>)>();
        for rank in ranks {
            let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>();
            let (reply_tx, reply_rx) = mpsc::channel::<Reply>();
            let group = group.clone();
            let ready = ready_tx.clone();
            let stop = Arc::clone(&rs.stop);
            let thread = std::thread::Builder::new()
                .name(format!("recv-{rank}"))
                .spawn(move || {
                    let setup = || -> Result<Receiver, Error> {
                        let ns = group.member(rank.into())?.netns.clone().expect("cluster members have a netns");
                        netns::enter(&ns)?;
                        Receiver::new(&group, rank)
                    };
                    let mut r = match setup() {
                        Ok(r) => {
                            let _ = ready.send((rank, Ok(())));
                            r
                        }
                        Err(e) => {
                            let _ = ready.send((rank, Err(e)));
                            return;
                        }
                    };
                    let mut base = RecvStats::default();
                    while let Ok(cmd) = cmd_rx.recv() {
                        let reply = match cmd {
                            Cmd::Take { n, each } => {
                                base = r.stats();
                                let mut msgs = Vec::with_capacity(n);
                                let mut err = None;
                                while msgs.len() < n {
                                    match recv_until(&mut r, Instant::now() + each, &stop) {
                                        Ok(m) => msgs.push(m),
                                        Err(e) => {
                                            err = Some(e);
                                            break;
                                        }
                                    }
                                }
                                Reply::Took(msgs, err)
                            }
                            Cmd::Quiet(window) => {
                                let res = r.recv(Some(window));
                                Reply::Quiet(res, r.stats().delta(&base))
                            }
                        };
                        if reply_tx.send(reply).is_err() {
                            return;
                        }
                    }
                })
                .expect("spawning a receiver thread");
            rs.workers.insert(rank, Worker { cmd: Some(cmd_tx), reply: Mutex::new(reply_rx), thread: Some(thread) });
        }
        for _ in 0..rs.workers.len() {
            match ready_rx.recv_timeout(Duration::from_secs(20)) {
                Ok((_, Ok(()))) => {}
                Ok((rank, Err(e))) => panic!("receiver rank {rank}: {e}"),
                Err(e) => panic!("receivers did not get ready: {e}"),
            }
        }
        rs
    }

    /// Every receiver starts taking the number of messages `expect` gives
    /// for it (0 for ranks not listed).
    fn begin(&self, expect: &BTreeMap<u16, usize>) {
        for (rank, w) in &self.workers {
            let n = expect.get(rank).copied().unwrap_or(0);
            w.cmd.as_ref().expect("running").send(Cmd::Take { n, each: EACH }).expect("receiver thread alive");
        }
        for rank in expect.keys() {
            assert!(self.workers.contains_key(rank), "no receiver thread for rank {rank}");
        }
    }

    /// After the sender is done: every receiver listens `QUIET` longer
    /// (after its expected messages); returns what each saw.
    fn end(&self) -> BTreeMap<u16, Outcome> {
        for w in self.workers.values() {
            w.cmd.as_ref().expect("running").send(Cmd::Quiet(QUIET)).expect("receiver thread alive");
        }
        let wait = |rank: u16, w: &Worker| -> Reply {
            w.reply
                .lock()
                .expect("reply lock")
                .recv_timeout(Duration::from_secs(600))
                .unwrap_or_else(|e| panic!("receiver rank {rank} did not answer: {e}"))
        };
        let mut out = BTreeMap::new();
        for (&rank, w) in &self.workers {
            let Reply::Took(msgs, take_err) = wait(rank, w) else { panic!("rank {rank}: replies out of order") };
            let Reply::Quiet(quiet, stats) = wait(rank, w) else { panic!("rank {rank}: replies out of order") };
            out.insert(rank, Outcome { rank, msgs, take_err, quiet, stats });
        }
        out
    }

    /// begin + end, for rounds where the sender is already done.
    fn collect(&self, expect: &BTreeMap<u16, usize>) -> BTreeMap<u16, Outcome> {
        self.begin(expect);
        self.end()
    }
}

impl Drop for Receivers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers.values_mut() {
            w.cmd.take();
        }
        for w in self.workers.values_mut() {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// `n` messages expected by each of `ranks`.
fn expecting(ranks: &[u16], n: usize) -> BTreeMap<u16, usize> {
    ranks.iter().map(|&r| (r, n)).collect()
}

/// Problems with what `o` got, given that it should have received exactly
/// the messages `want` ((seq, bytes)) from `sender`, each once.
fn check_exact(o: &Outcome, sender: u16, want: &[(u32, &[u8])]) -> Vec<String> {
    let r = o.rank;
    let mut bad = Vec::new();
    if let Some(e) = &o.take_err {
        bad.push(format!("rank {r}: got {}/{} messages, then: {e}", o.msgs.len(), want.len()));
    }
    let mut seen = BTreeSet::new();
    for m in &o.msgs {
        if m.src_rank != sender {
            bad.push(format!("rank {r}: message {} claims sender rank {}, expected {sender}", m.seq, m.src_rank));
        }
        if !seen.insert(m.seq) {
            bad.push(format!("rank {r}: message {} delivered twice", m.seq));
            continue;
        }
        match want.iter().find(|(s, _)| *s == m.seq) {
            None => bad.push(format!("rank {r}: unexpected message seq {} ({} bytes)", m.seq, m.data.len())),
            Some((_, bytes)) => {
                if let Some(d) = diff(&m.data, bytes) {
                    bad.push(format!("rank {r}: message {}: {d}", m.seq));
                }
            }
        }
    }
    for (s, _) in want {
        if !seen.contains(s) {
            bad.push(format!("rank {r}: message {s} never arrived"));
        }
    }
    match &o.quiet {
        Err(Error::Timeout { .. }) => {}
        Ok(m) => bad.push(format!(
            "rank {r}: an extra message after the expected ones: seq {} from rank {} ({} bytes)",
            m.seq,
            m.src_rank,
            m.data.len()
        )),
        Err(e) => bad.push(format!("rank {r}: the extra recv failed with {e} instead of timing out")),
    }
    let s = o.stats;
    if s.messages != want.len() as u64 {
        bad.push(format!("rank {r}: stats.messages {} != {}", s.messages, want.len()));
    }
    // Duplicates can follow a sender's probe (a receiver slower than the
    // retransmission timeout on this shared machine); bad input cannot.
    if s.dropped() + s.evicted > 0 {
        bad.push(format!("rank {r}: receiver dropped datagrams: {s:?}"));
    }
    if s.messages > 0 && s.acks_sent < s.messages {
        bad.push(format!("rank {r}: {} messages but only {} acknowledgments sent", s.messages, s.acks_sent));
    }
    bad
}

/// Problems if `o` received anything at all (a rank nobody addressed).
fn check_nothing(o: &Outcome) -> Vec<String> {
    let r = o.rank;
    let mut bad = Vec::new();
    if !o.msgs.is_empty() || o.take_err.is_some() {
        bad.push(format!("rank {r}: took {} messages ({:?})", o.msgs.len(), o.take_err));
    }
    match &o.quiet {
        Err(Error::Timeout { .. }) => {}
        Ok(m) => bad.push(format!(
            "rank {r} was not addressed but received message {} from rank {} ({} bytes)",
            m.seq,
            m.src_rank,
            m.data.len()
        )),
        Err(e) => bad.push(format!("rank {r}: recv failed with {e} instead of timing out")),
    }
    if o.stats.datagrams != 0 {
        bad.push(format!("rank {r} was not addressed but its socket got datagrams: {:?}", o.stats));
    }
    bad
}

fn assert_clean(what: &str, bad: Vec<String>) {
    assert!(bad.is_empty(), "{what}: {} problems:\n  {}", bad.len(), bad.join("\n  "));
}

/// Windows of 64 ranks the destination set spans (kernel datagrams per fragment).
fn windows(dests: &[u16]) -> usize {
    dests.iter().map(|d| d / 64).collect::<BTreeSet<_>>().len()
}

/// What the sender saw for one broadcast.
struct Sent {
    len: usize,
    report: SendReport,
    /// tc_bcast counters for this call (zero on the user path).
    kstats: BcastStats,
    /// Fragments (per window) counted by the sender.
    fragments: u64,
    payload: usize,
    started: Instant,
}

/// One broadcast, with the fan-out counters around it.
fn send(b: &mut Broadcaster, data: &[u8], dests: &[u16]) -> Sent {
    let before = b.fanout().map(|f| f.stats().expect("reading tc_bcast stats")).unwrap_or_default();
    let frags_before = b.stats().fragments;
    let started = Instant::now();
    let report = b.broadcast(data, dests).unwrap_or_else(|e| panic!("broadcast of {} bytes: {e}", data.len()));
    let after = b.fanout().map(|f| f.stats().expect("reading tc_bcast stats")).unwrap_or_default();
    Sent {
        len: data.len(),
        report,
        kstats: after.delta(&before),
        fragments: b.stats().fragments - frags_before,
        payload: b.payload_per_packet(),
        started,
    }
}

/// Kernel-path accounting of one broadcast to `dests` with nothing missed.
fn check_kernel_send(s: &Sent, dests: &[u16]) -> Vec<String> {
    let nfrag = s.len.div_ceil(s.payload).max(1);
    let w = windows(dests);
    let mut bad = Vec::new();
    let what = format!("message {} ({} bytes, {nfrag} fragments x {w} windows)", s.report.seq, s.len);
    if s.report.path != Path::Kernel {
        bad.push(format!("{what}: sent over the {} path", s.report.path));
    }
    if s.fragments != (nfrag * w) as u64 {
        bad.push(format!("{what}: sender counted {} fragments", s.fragments));
    }
    if s.report.datagrams != nfrag * w {
        bad.push(format!("{what}: user space sent {} datagrams, expected {}", s.report.datagrams, nfrag * w));
    }
    if s.report.fallback_copies != 0 {
        bad.push(format!("{what}: {} fallback copies", s.report.fallback_copies));
    }
    let k = s.kstats;
    // Retransmissions (probes of a receiver slower than the timeout) are
    // fan-out datagrams too, with exactly the receivers that need them.
    let retx = s.report.retransmit_datagrams as u64;
    if s.fragments != (nfrag * w) as u64 || k.fanout_pkts != (nfrag * w) as u64 + retx {
        bad.push(format!(
            "{what}: fanout_pkts {} (sender fragments {}, retransmissions {retx})",
            k.fanout_pkts, s.fragments
        ));
    }
    if k.copies != (nfrag * dests.len() + s.report.retransmitted) as u64 {
        bad.push(format!(
            "{what}: copies {}, expected {} x {} + {} re-sent",
            k.copies,
            nfrag,
            dests.len(),
            s.report.retransmitted
        ));
    }
    if k.missed != 0 || k.malformed != 0 || k.other_job != 0 {
        bad.push(format!("{what}: tc_bcast counters {k:?}"));
    }
    bad
}

/// Message sizes of the per-size tests: single packets (empty, tiny, one
/// full packet) and one multi-packet message.
const SINGLE: [usize; 4] = [0, 1, 64, 1432];
const MULTI: usize = 200 * 1024;

fn messages() -> Vec<Vec<u8>> {
    SINGLE.iter().chain([MULTI].iter()).enumerate().map(|(i, &len)| pattern(len, i as u64 + 1)).collect()
}

/// Test a (and d): rank 0 sends every message of `messages()` to ranks
/// 1..=receivers over `choice`; every receiver must get exactly those.
fn broadcast_to_all(test: &str, prefix: &str, receivers: usize, choice: PathChoice) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up(prefix, receivers + 1);
    let group = topo.group().clone();
    let dests: Vec<u16> = (1..=receivers as u16).collect();
    let rs = Receivers::start(&group, dests.iter().copied());
    let msgs = messages();
    rs.begin(&expecting(&dests, msgs.len()));
    let sent = on_host(&topo.ns(0), || {
        let mut b = Broadcaster::new(&group, 0, choice).unwrap_or_else(|e| panic!("Broadcaster::new: {e}"));
        match choice {
            PathChoice::User => {
                assert_eq!(b.path(), Path::User);
                assert!(b.fanout().is_none(), "user path requested but a BPF program is loaded");
            }
            _ => {
                assert_eq!(b.path(), Path::Kernel, "{}", b.path_reason());
                assert!(b.fanout().is_some_and(|f| f.is_attached()), "kernel path without an attached tc_bcast");
            }
        }
        let mtu = group.mtu as usize;
        assert_eq!(b.payload_per_packet(), mtu - 68, "veth MTU {mtu} leaves {} message bytes per packet", mtu - 68);
        msgs.iter().map(|m| send(&mut b, m, &dests)).collect::<Vec<_>>()
    });
    let got = rs.end();

    let mut bad = Vec::new();
    for s in &sent {
        let nfrag = s.len.div_ceil(s.payload).max(1);
        match choice {
            PathChoice::User => {
                if s.report.path != Path::User || s.report.datagrams != nfrag * dests.len() {
                    bad.push(format!(
                        "message {} ({} bytes): path {}, {} datagrams, expected {} x {}",
                        s.report.seq,
                        s.len,
                        s.report.path,
                        s.report.datagrams,
                        nfrag,
                        dests.len()
                    ));
                }
                if s.kstats != BcastStats::default() {
                    bad.push(format!("user path moved tc_bcast counters: {:?}", s.kstats));
                }
            }
            _ => bad.extend(check_kernel_send(s, &dests)),
        }
    }
    let want: Vec<(u32, &[u8])> = sent.iter().zip(&msgs).map(|(s, m)| (s.report.seq, m.as_slice())).collect();
    let seqs: BTreeSet<u32> = want.iter().map(|w| w.0).collect();
    assert_eq!(seqs.len(), msgs.len(), "every message gets its own sequence number");
    for o in got.values() {
        bad.extend(check_exact(o, 0, &want));
    }
    assert_clean(test, bad);

    let big = sent.last().expect("sent");
    let last_done =
        got.values().filter_map(|o| o.msgs.iter().find(|m| m.seq == big.report.seq)).map(|m| m.completed).max();
    println!(
        "{test}: {} receivers x {} messages, all bytes checked; {} KiB message: {} fragments, {} kernel copies, \
         last receiver done {:?} after the send started; test {:?}",
        receivers,
        msgs.len(),
        MULTI / 1024,
        big.fragments,
        big.kstats.copies,
        last_done.map(|t| t.saturating_duration_since(big.started)),
        t0.elapsed()
    );
}

#[test]
fn a_kernel_path_1_receiver() {
    broadcast_to_all("a_kernel_path_1_receiver", "tb1", 1, PathChoice::Kernel);
}

#[test]
fn a_kernel_path_9_receivers() {
    broadcast_to_all("a_kernel_path_9_receivers", "tb9", 9, PathChoice::Kernel);
}

#[test]
fn a_kernel_path_32_receivers() {
    broadcast_to_all("a_kernel_path_32_receivers", "tb32", 32, PathChoice::Kernel);
}

/// 64 receivers are ranks 1..=64: two mask windows (ranks 0..63 and 64..127),
/// so every fragment leaves user space twice.
#[test]
fn a_kernel_path_64_receivers() {
    broadcast_to_all("a_kernel_path_64_receivers", "tb64", 64, PathChoice::Kernel);
}

#[test]
fn b_kernel_path_subset_of_destinations() {
    let test = "b_kernel_path_subset_of_destinations";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("tbsub", 10);
    let group = topo.group().clone();
    let all: Vec<u16> = (1..=9).collect();
    let chosen = [2u16, 5, 7];
    let rs = Receivers::start(&group, all.iter().copied());
    let small = pattern(700, 11);
    let multi = pattern(10_000, 12);
    // Receivers run while the sender waits for their acknowledgments.
    rs.begin(&expecting(&chosen, 2));
    let sent = on_host(&topo.ns(0), || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        // Unsorted, with a repeat: the same three ranks, each served once.
        vec![send(&mut b, &small, &chosen), send(&mut b, &multi, &[7, 2, 5, 2])]
    });
    let got = rs.end();
    let mut bad = Vec::new();
    for s in &sent {
        bad.extend(check_kernel_send(s, &chosen));
    }
    let want = [(sent[0].report.seq, small.as_slice()), (sent[1].report.seq, multi.as_slice())];
    for o in got.values() {
        if chosen.contains(&o.rank) {
            bad.extend(check_exact(o, 0, &want));
        } else {
            bad.extend(check_nothing(o));
        }
    }
    assert_clean(test, bad);
    println!("{test}: ranks {chosen:?} got both messages, ranks 1,3,4,6,8,9 nothing; {:?}", t0.elapsed());
}

#[test]
fn c_64_mib_to_2_receivers_kernel_and_user() {
    let test = "c_64_mib_to_2_receivers_kernel_and_user";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("tbig", 3);
    let group = topo.group().clone();
    let dests = [1u16, 2];
    let rs = Receivers::start(&group, dests);
    let data = pattern(64 << 20, 64);
    // One broadcaster, both paths (use_path detaches tc_bcast for the user
    // path): receivers drain while the sender sends.
    let rounds = on_host(&topo.ns(0), || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        let mut rounds = Vec::new();
        for p in [Path::Kernel, Path::User] {
            b.use_path(p).unwrap_or_else(|e| panic!("use_path({p}): {e}"));
            assert_eq!(b.fanout().is_some_and(|f| f.is_attached()), p == Path::Kernel);
            rs.begin(&expecting(&dests, 1));
            let s = send(&mut b, &data, &dests);
            let send_time = s.started.elapsed();
            let got = rs.end();
            rounds.push((p, s, send_time, got));
        }
        rounds
    });
    let mut bad = Vec::new();
    for (p, s, send_time, got) in &rounds {
        let nfrag = data.len().div_ceil(s.payload);
        match p {
            Path::Kernel => bad.extend(check_kernel_send(s, &dests)),
            Path::User => {
                if s.report.path != Path::User || s.report.datagrams != nfrag * dests.len() {
                    bad.push(format!("user round: path {}, {} datagrams", s.report.path, s.report.datagrams));
                }
                if s.kstats != BcastStats::default() {
                    bad.push(format!("tc_bcast counted packets while detached: {:?}", s.kstats));
                }
            }
        }
        for o in got.values() {
            bad.extend(check_exact(o, 0, &[(s.report.seq, data.as_slice())]));
        }
        let done = got.values().filter_map(|o| o.msgs.first()).map(|m| m.completed).max();
        let total = done.map(|d| d.saturating_duration_since(s.started));
        let mbps = total.map(|t| data.len() as f64 / t.as_secs_f64() / 1e6);
        println!(
            "{test}: {p} path: 64 MiB ({nfrag} fragments) to 2 receivers: broadcast() returned after {send_time:?}, \
             last receiver complete after {total:?} ({:.0} MB/s of message per receiver); {} user-space datagrams, \
             {} acks, {} copies re-sent, {} probe timeouts",
            mbps.unwrap_or(f64::NAN),
            s.report.datagrams,
            s.report.acks,
            s.report.retransmitted,
            s.report.timeouts
        );
    }
    assert_clean(test, bad);
    println!("{test}: {:?}", t0.elapsed());
}

#[test]
fn d_user_path_9_receivers() {
    broadcast_to_all("d_user_path_9_receivers", "tbu9", 9, PathChoice::User);
}

/// Test e: h0 has no neighbour entry for rank `lost` when the broadcaster
/// starts, so tc_bcast reports that destination as missed and the sender
/// serves it from user space (which makes the kernel resolve it by ARP).
fn unresolved_neighbour(test: &str, prefix: &str, lost: u16) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up(prefix, 10);
    let group = topo.group().clone();
    let dests: Vec<u16> = (1..=9).collect();
    let lost_addr = group.member(lost.into()).expect("member").addr.to_string();
    let h0 = topo.ns(0);
    let out = Command::new("ip").args(["-n", &h0, "neigh", "del", &lost_addr, "dev", "eth0"]).output().expect("ip");
    assert!(out.status.success(), "ip neigh del: {}", String::from_utf8_lossy(&out.stderr));
    let show = Command::new("ip").args(["-n", &h0, "neigh", "show", &lost_addr]).output().expect("ip");
    assert!(String::from_utf8_lossy(&show.stdout).trim().is_empty(), "neighbour entry still there");

    let rs = Receivers::start(&group, dests.iter().copied());
    // First a multi-packet message (all its fallback copies go out while
    // the neighbour is being resolved), then single packets and another
    // multi-packet one.
    let msgs: Vec<Vec<u8>> = [MULTI, 100, 1432, 5, 3000, 1]
        .iter()
        .enumerate()
        .map(|(i, &l)| pattern(l, 100 + u64::from(lost) * 10 + i as u64))
        .collect();
    rs.begin(&expecting(&dests, msgs.len()));
    let (sent, sstats) = on_host(&h0, || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        let sent: Vec<Sent> = msgs.iter().map(|m| send(&mut b, m, &dests)).collect();
        (sent, b.stats())
    });
    let got = rs.end();

    let mut bad = Vec::new();
    let first = &sent[0];
    let nfrag0 = first.len.div_ceil(first.payload);
    if first.report.fallback_copies < nfrag0 {
        bad.push(format!(
            "first message ({nfrag0} fragments): {} fallback copies, expected one per fragment for rank {lost}",
            first.report.fallback_copies
        ));
    }
    // At least every first-transmission copy of rank {lost} is missed (a
    // retransmission to it before the neighbour resolved is missed too).
    if first.kstats.missed < nfrag0 as u64 || first.kstats.missed != first.report.fallback_copies as u64 {
        bad.push(format!("first message: tc_bcast counters {:?}", first.kstats));
    }
    if sstats.unresolved_misses == 0 || sstats.fallback_copies == 0 {
        bad.push(format!("sender stats: {sstats:?}"));
    }
    for s in &sent {
        if s.report.path != Path::Kernel {
            bad.push(format!("message {} went over the {} path", s.report.seq, s.report.path));
        }
        // Every destination is served exactly once per fragment: by the
        // kernel or by the fallback.
        let nfrag = s.len.div_ceil(s.payload).max(1);
        if s.kstats.copies + s.report.fallback_copies as u64 != (nfrag * dests.len() + s.report.retransmitted) as u64 {
            bad.push(format!(
                "message {}: {} kernel copies + {} fallback copies != {nfrag} x {} + {} re-sent",
                s.report.seq,
                s.kstats.copies,
                s.report.fallback_copies,
                dests.len(),
                s.report.retransmitted
            ));
        }
    }
    let want: Vec<(u32, &[u8])> = sent.iter().zip(&msgs).map(|(s, m)| (s.report.seq, m.as_slice())).collect();
    for o in got.values() {
        bad.extend(check_exact(o, 0, &want));
    }
    assert_clean(test, bad);
    let per_msg: Vec<String> =
        sent.iter().map(|s| format!("{}:{}k+{}u", s.report.seq, s.kstats.copies, s.report.fallback_copies)).collect();
    println!(
        "{test}: rank {lost} ({lost_addr}) unresolved at start; copies per message (kernel+user) {}; sender {:?}; {:?}",
        per_msg.join(" "),
        sstats,
        t0.elapsed()
    );
}

/// Rank 1: the address user space sends each fan-out datagram to, so the
/// original packet itself waits for ARP before it reaches TCX egress.
#[test]
fn e_unresolved_neighbour_rank_1_first_destination() {
    unresolved_neighbour("e_unresolved_neighbour_rank_1_first_destination", "tbne1", 1);
}

#[test]
fn e_unresolved_neighbour_rank_4() {
    unresolved_neighbour("e_unresolved_neighbour_rank_4", "tbne4", 4);
}

/// Rank 9: the highest rank, whose copy the original skb would carry; tc_bcast
/// must drop the original and leave rank 9 to user space.
#[test]
fn e_unresolved_neighbour_rank_9_highest() {
    unresolved_neighbour("e_unresolved_neighbour_rank_9_highest", "tbne9", 9);
}

fn python_ok() -> Result<(), String> {
    match Command::new("python3").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!("python3 --version failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Err(format!("python3 not runnable: {e}")),
    }
}

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("kccl-topo-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("creating scratch dir");
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn f_interop_plain_python_udp_receiver() {
    let test = "f_interop_plain_python_udp_receiver";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    if let Err(why) = python_ok() {
        println!("SKIPPED {test}: {why}");
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("tbpy", 3);
    let group = topo.group().clone();
    let scratch = Scratch::new("py");
    let out = scratch.0.join("out.bin");
    let ready = scratch.0.join("ready");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/interop/plain_udp_receiver.py");
    let py = group.member(1).expect("member").clone();
    // Three fragments at the cluster's MTU (68 bytes of headers each).
    let data = pattern(2 * (group.mtu as usize - 68) + 500, 77);
    let argv: Vec<String> = vec![
        "python3".into(),
        script.into(),
        py.addr.to_string(),
        py.port.to_string(),
        "3".into(),
        out.display().to_string(),
        "--ready".into(),
        ready.display().to_string(),
        "--timeout".into(),
        "10".into(),
    ];
    let name = topo.name().to_owned();
    let child = std::thread::spawn(move || cluster::exec(&name, "h1", &argv));
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ready.exists() {
        assert!(!child.is_finished(), "the python receiver ended before binding");
        assert!(Instant::now() < deadline, "the python receiver did not bind within 15 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Rank 2 is a kccl receiver next to it: same datagrams, parsed by kccl.
    let rs = Receivers::start(&group, [2u16]);
    let s = on_host(&topo.ns(0), || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        // A plain UDP program does not acknowledge: fire-and-forget.
        b.set_reliability(Reliability { enabled: false, ..Default::default() }).expect("config");
        send(&mut b, &data, &[1, 2])
    });
    let status = child.join().expect("exec thread").expect("running python3 in h1");
    let got = rs.collect(&expecting(&[2], 1));
    let mut bad = check_kernel_send(&s, &[1, 2]);
    if s.fragments != 3 {
        bad.push(format!("expected a 3-fragment message, sent {} fragments", s.fragments));
    }
    if !status.success() {
        bad.push(format!("python receiver exited with {status}"));
    }
    match std::fs::read(&out) {
        Ok(bytes) => {
            if let Some(d) = diff(&bytes, &data) {
                bad.push(format!("python receiver's output: {d}"));
            }
        }
        Err(e) => bad.push(format!("reading {}: {e}", out.display())),
    }
    bad.extend(check_exact(&got[&2], 0, &[(s.report.seq, data.as_slice())]));
    assert_clean(test, bad);
    println!("{test}: python3 in h1 reassembled {} bytes from 3 kernel copies; {:?}", data.len(), t0.elapsed());
}

#[test]
fn g_bad_destinations_are_refused_and_send_nothing() {
    let test = "g_bad_destinations_are_refused_and_send_nothing";
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("tbbad", 4);
    let group = topo.group().clone();
    let receivers = [1u16, 2, 3];
    let rs = Receivers::start(&group, receivers);
    match Broadcaster::new(&group, 42, PathChoice::Kernel) {
        Err(Error::UnknownRank { rank: 42, .. }) => {}
        Err(e) => panic!("Broadcaster::new for rank 42: wrong error {e}"),
        Ok(_) => panic!("Broadcaster::new accepted rank 42, which is not in the group"),
    }
    let data = pattern(3000, 5);
    let (nothing, after, ok) = on_host(&topo.ns(0), || {
        let mut b = Broadcaster::new(&group, 0, PathChoice::Kernel).unwrap_or_else(|e| panic!("{e}"));
        let first_seq = b.next_seq();
        let cases: [(&str, &[u16]); 6] = [
            ("empty", &[]),
            ("unknown 99", &[99]),
            ("self", &[0]),
            ("valid then unknown", &[1, 99]),
            ("valid then self", &[2, 0]),
            ("self then valid", &[0, 3]),
        ];
        for (what, dests) in cases {
            let r = b.broadcast(&data, dests);
            match (what, &r) {
                ("empty", Err(Error::EmptyDestinations { sender: 0 })) => {}
                ("unknown 99" | "valid then unknown", Err(Error::UnknownRank { rank: 99, .. })) => {}
                ("self" | "valid then self" | "self then valid", Err(e)) => {
                    assert!(e.to_string().contains("sender"), "{what}: error does not say why: {e}");
                }
                _ => panic!("{what} {dests:?}: expected a specific error, got {r:?}"),
            }
        }
        let st = b.stats();
        assert_eq!((st.messages, st.datagrams, st.syscalls), (0, 0, 0), "refused calls sent something: {st:?}");
        let k = b.fanout().expect("kernel path").stats().expect("stats");
        assert_eq!(k, BcastStats::default(), "tc_bcast saw packets from refused calls");
        // Nobody got anything...
        let nothing = rs.collect(&BTreeMap::new());
        // ...and the broadcaster still works, with no sequence number used up.
        rs.begin(&expecting(&[3], 1));
        let ok = send(&mut b, &data, &[3]);
        (nothing, rs.end(), (ok, first_seq))
    });
    let (ok, first_seq) = ok;
    let mut bad = Vec::new();
    for o in nothing.values() {
        bad.extend(check_nothing(o));
    }
    if ok.report.seq != first_seq {
        bad.push(format!("first accepted message has seq {}, expected {first_seq}", ok.report.seq));
    }
    bad.extend(check_kernel_send(&ok, &[3]));
    for o in after.values() {
        if o.rank == 3 {
            bad.extend(check_exact(o, 0, &[(ok.report.seq, data.as_slice())]));
        } else {
            bad.extend(check_nothing(o));
        }
    }
    assert_clean(test, bad);
    println!("{test}: 6 bad destination lists refused, nothing on the wire; {:?}", t0.elapsed());
}
