//! Reduce and allreduce under loss, duplication and reordering (the
//! project's fault injector, tc_fault at TCX egress), a member that dies in
//! the middle of an operation, and forged/stale packets.
//!
//! ```text
//!  ranks 0, 1, 2 (contributors)                      rank 3
//!  netns kccl-<name>-h0 .. -h2                       netns kccl-<name>-h3
//!  +----------------------------+  T_AGG chunks    +------------------------------+
//!  | Collective (rank i)        | ---------------> | allreduce: Aggregator        |
//!  |  AIMD window, retransmit   | <--------------- |  (xdp_agg + tc_agg_result or |
//!  | eth0 [tc_fault egress: h0] | RESULT/ACK/      |   the user-space aggregator) |
//!  +-------------|--------------+ PENDING          | eth0 [tc_fault egress]       |
//!                | veth                            +-------------|----------------+
//!  +-------------h0 .. h2--------------------------------------h3---------------+
//!  |                     br0 (netns kccl-<name>-sw)                             |
//!  +----------------------------------------------------------------------------+
//!  reduce phase: ranks 0, 1 contribute, rank 2 is the root (no aggregator).
//!  sharded phase: no aggregator; ranks 0-3 each own a shard of the chunks
//!  (combined in their own xdp_agg or user space) and fan its results out.
//! ```
//!
//! Faults are installed on the aggregator's (rank 3's, the reduce root's:
//! rank 2's; in a sharded run on rank 3's, an owner) eth0, on a member's (rank 0's) eth0, or 1% loss on every
//! eth0 of the operation; every randomized run prints its seed.  The
//! cluster's MTU (KCCL_CLUSTER_MTU, default 9000) sets the chunk size:
//! `make test` runs the kernel cases at MTU 1500 and 65000 too.  Results must be bit-exact (integers) against a
//! reference computed here.
//!
//! Run: `cargo test --release -p kccl-testbed --test topology_agg_faults -- --test-threads=1 --nocapture`

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kccl::agg::{AggConfig, AggOp, Aggregator, Collective};

use kccl::error::Error;
use kccl::fault::{self, FaultConfig};
use kccl::group::Group;
use kccl::netns;
use kccl::transport::PathChoice;
use kccl::wire::{Header, DT_I32, F_ALLREDUCE, F_LAST_FRAG, OP_SUM, T_AGG, VERSION};
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

const AGG: u16 = 3;
const ALLREDUCE_JOB: u32 = 31;
const REDUCE_JOB: u32 = 32;
const SHARDED_JOB: u32 = 33;
/// Elements per operation: 100 chunks of 1432 bytes (int32).
const LEN: usize = 358 * 100;

fn cfg() -> AggConfig {
    AggConfig {
        deadline: Duration::from_secs(3),
        slot_timeout: Duration::from_millis(400),
        rto: Duration::from_millis(10),
        ..AggConfig::default()
    }
}

struct Topo {
    guard: ClusterGuard,
}

impl Topo {
    fn up(prefix: &str) -> Topo {
        let name = cluster::unique_name(prefix);
        let guard = ClusterGuard::up(&ClusterSpec::new(&name, 4)).expect("cluster up");
        Topo { guard }
    }

    fn ns(&self, rank: u16) -> String {
        cluster::host_netns(&self.guard.cluster.name, rank.into())
    }

    fn group(&self, job: u32, ranks: &[u16], aggregator: Option<u16>) -> Group {
        let members = self.guard.cluster.group.members.iter().filter(|m| ranks.contains(&m.rank)).cloned().collect();
        let mut g = Group::new(&self.guard.cluster.name, job, members);
        g.aggregator = aggregator;
        g
    }

    /// Installs (or changes) the fault injector on `rank`'s eth0.
    fn fault(&self, rank: u16, f: &FaultConfig) {
        fault::install(Some(&self.ns(rank)), "eth0", f).unwrap_or_else(|e| panic!("fault on rank {rank}: {e}"));
    }

    fn clear_faults(&self) {
        for r in 0..=AGG {
            let _ = fault::clear(Some(&self.ns(r)), "eth0");
        }
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        self.clear_faults();
    }
}

fn on_host<T: Send + 'static>(ns: String, f: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
    std::thread::spawn(move || {
        netns::enter(&ns).unwrap_or_else(|e| panic!("entering {ns}: {e}"));
        f()
    })
}

/// The allreduce aggregator service on rank AGG's host until `stop`; prints
/// its kernel counters at the end.
fn serve_aggregator(topo: &Topo, group: &Group, path: PathChoice, stop: &Arc<AtomicBool>) -> JoinHandle<()> {
    let (g, s) = (group.clone(), Arc::clone(stop));
    on_host(topo.ns(AGG), move || {
        let mut a = Aggregator::new(&g, AGG, path, cfg()).expect("aggregator");
        a.serve(&s).expect("serve");
        #[cfg(feature = "kernel-agg")]
        if let Some(k) = a.kernel_stats().expect("kernel stats") {
            println!("aggregator kernel counters: {k:?}");
        }
    })
}

/// Rank r's data of run `k`: deterministic, sums of 3 stay in int32.
fn data(rank: u16, k: usize) -> Vec<i32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(rank) << 40) ^ k as u64;
    (0..LEN)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as i32) >> 3
        })
        .collect()
}

fn sum_of(ranks: &[u16], k: usize) -> Vec<i32> {
    let mut out = vec![0i32; LEN];
    for &r in ranks {
        for (o, v) in out.iter_mut().zip(data(r, k)) {
            *o += v;
        }
    }
    out
}

/// The fault scenarios: (label, ranks whose egress misbehaves, config;
/// each rank's injector seeded apart).
fn scenarios(seed: u64, agg_rank: u16, all: &[u16]) -> Vec<(String, Vec<u16>, FaultConfig)> {
    let mut v = vec![("no fault".to_string(), vec![], FaultConfig::default())];
    for (who, rank) in [("aggregator", agg_rank), ("member 0", 0)] {
        for loss in [0.0001, 0.001, 0.01, 0.05] {
            let f = FaultConfig::from_fractions(loss, 0.0, 0.0, seed).expect("fault config");
            v.push((format!("loss {loss} on {who}'s link"), vec![rank], f));
        }
        let f = FaultConfig::from_fractions(0.0, 0.05, 0.05, seed).expect("fault config");
        v.push((format!("dup 5% + reorder 5% on {who}'s link"), vec![rank], f));
    }
    let f = FaultConfig::from_fractions(0.01, 0.0, 0.0, seed).expect("fault config");
    v.push(("loss 0.01 on every link".to_string(), all.to_vec(), f));
    v
}

/// What a fault run exercises.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    /// Allreduce through the dedicated aggregator, rank 3.
    Aggregator = 0,
    /// Reduce of ranks 0 and 1 to rank 2.
    Reduce = 1,
    /// Allreduce of ranks 0-3 with no aggregator: each owns a shard.
    Sharded = 2,
}

/// Runs every scenario on one set of members (Collectives kept across
/// scenarios).
fn exact_under_faults(prefix: &str, path: PathChoice, mode: Mode) {
    let reduce = mode == Mode::Reduce;
    let seed = 0x5eed_0000 + mode as u64 * 7 + if path == PathChoice::User { 1 } else { 0 };
    println!(
        "seed {seed:#x} (path {path:?}, {})",
        match mode {
            Mode::Reduce => "reduce to rank 2, single datagrams",
            Mode::Aggregator => "allreduce via rank 3, UDP GSO sends",
            Mode::Sharded => "sharded allreduce of ranks 0-3, UDP GSO sends",
        }
    );
    let topo = Topo::up(prefix);
    // agg_rank: the rank whose link the "aggregator" scenarios fault (a
    // sharded run's rank 3 owns a shard like every other member).
    let (group, members, agg_rank): (Group, Vec<u16>, u16) = match mode {
        Mode::Reduce => (topo.group(REDUCE_JOB, &[0, 1, 2], None), vec![0, 1, 2], 2),
        Mode::Aggregator => (topo.group(ALLREDUCE_JOB, &[0, 1, 2, AGG], Some(AGG)), vec![0, 1, 2], AGG),
        Mode::Sharded => (topo.group(SHARDED_JOB, &[0, 1, 2, 3], None), vec![0, 1, 2, 3], 3),
    };
    let contributors: Vec<u16> = match mode {
        Mode::Reduce => vec![0, 1],
        Mode::Aggregator => vec![0, 1, 2],
        Mode::Sharded => vec![0, 1, 2, 3],
    };
    let mut all = members.clone();
    if !all.contains(&agg_rank) {
        all.push(agg_rank);
    }
    let sc = scenarios(seed, agg_rank, &all);
    let n = sc.len();
    let stop = Arc::new(AtomicBool::new(false));
    let agg = (mode == Mode::Aggregator).then(|| serve_aggregator(&topo, &group, path, &stop));
    let barrier = Arc::new(Barrier::new(members.len() + 1));
    let handles: Vec<_> = members
        .iter()
        .map(|&rank| {
            let (g, b) = (group.clone(), Arc::clone(&barrier));
            on_host(topo.ns(rank), move || {
                // The allreduce runs send with UDP GSO (the default): the
                // injector then drops whole GSO sends, bursts of chunks;
                // the reduce runs send single datagrams.
                let c_cfg = AggConfig { gso: !reduce, ..cfg() };
                let mut c = Collective::new(&g, rank, path, c_cfg).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                let mut got = Vec::new();
                for k in 0..n {
                    b.wait();
                    let mine = data(rank, k);
                    let r = if reduce {
                        c.reduce(&mine, AggOp::Sum, 2).map(|o| {
                            o.map(|mut v| {
                                // The root folds its own data in: take it out
                                // to compare with the contributors' sum.
                                v.iter_mut().zip(&mine).for_each(|(o, m)| *o -= m);
                                v
                            })
                        })
                    } else {
                        c.allreduce(&mine, AggOp::Sum).map(Some)
                    };
                    got.push(r.map_err(|e| e.to_string()));
                    if (reduce && rank == 2) || mode == Mode::Sharded {
                        // The root (a sharded run: every owner) keeps
                        // answering retransmissions (an ACK lost on its
                        // link) until every contributor's receipt says it
                        // is done: nothing else tells it, and on the user
                        // path nobody else answers.
                        match c.settle(Duration::from_secs(3)) {
                            Ok(open) if !open.is_empty() => println!("run {k}: no receipt from ranks {open:?}"),
                            Ok(_) => {}
                            Err(e) => panic!("settle: {e}"),
                        }
                    }
                    b.wait();
                }
                let _ = c.serve_for(Duration::from_millis(200));
                (rank, got, c.stats())
            })
        })
        .collect();
    for (k, (label, rank, f)) in sc.iter().enumerate() {
        topo.clear_faults();
        for &r in rank {
            topo.fault(r, &FaultConfig { seed: f.seed + u64::from(r), ..*f });
        }
        barrier.wait();
        let t = Instant::now();
        barrier.wait();
        println!("run {k}: {label}: {:?}", t.elapsed());
    }
    let mut bad = Vec::new();
    for h in handles {
        let (rank, got, st) = h.join().expect("member thread");
        println!(
            "rank {rank}: retransmits {} stalls {} pending {} window min/max/last {}/{}/{} cuts {}",
            st.contrib.retransmits,
            st.contrib.stalls,
            st.contrib.pending,
            st.contrib.window_min,
            st.contrib.window_max,
            st.contrib.window_last,
            st.contrib.window_cuts
        );
        for (k, r) in got.iter().enumerate() {
            match r {
                Ok(Some(v)) if *v != sum_of(&contributors, k) => {
                    bad.push(format!("rank {rank}, run {k} ({}): result differs from the no-fault sum", sc[k].0))
                }
                Ok(None) if !reduce || rank == 2 => bad.push(format!("rank {rank}, run {k}: no result")),
                Ok(_) => {}
                Err(e) => bad.push(format!("rank {rank}, run {k} ({}): {e}", sc[k].0)),
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(a) = agg {
        a.join().expect("aggregator thread");
    }
    assert!(bad.is_empty(), "seed {seed:#x}:\n{}", bad.join("\n"));
}

#[cfg(feature = "kernel-agg")]
#[test]
fn allreduce_exact_under_faults_kernel() {
    if root_or_skip("allreduce_exact_under_faults_kernel", "network namespaces and BPF") {
        exact_under_faults("af-ak", PathChoice::Kernel, Mode::Aggregator);
    }
}

#[test]
fn allreduce_exact_under_faults_user() {
    if root_or_skip("allreduce_exact_under_faults_user", "network namespaces and BPF") {
        exact_under_faults("af-au", PathChoice::User, Mode::Aggregator);
    }
}

#[cfg(feature = "kernel-agg")]
#[test]
fn reduce_exact_under_faults_kernel() {
    if root_or_skip("reduce_exact_under_faults_kernel", "network namespaces and BPF") {
        exact_under_faults("af-rk", PathChoice::Kernel, Mode::Reduce);
    }
}

#[cfg(feature = "kernel-agg")]
#[test]
fn sharded_exact_under_faults_kernel() {
    if root_or_skip("sharded_exact_under_faults_kernel", "network namespaces and BPF") {
        exact_under_faults("af-sk", PathChoice::Kernel, Mode::Sharded);
    }
}

#[test]
fn sharded_exact_under_faults_user() {
    if root_or_skip("sharded_exact_under_faults_user", "network namespaces") {
        exact_under_faults("af-su", PathChoice::User, Mode::Sharded);
    }
}

#[test]
fn reduce_exact_under_faults_user() {
    if root_or_skip("reduce_exact_under_faults_user", "network namespaces and BPF") {
        exact_under_faults("af-ru", PathChoice::User, Mode::Reduce);
    }
}

/// A contribution of `rank` as raw bytes (for forged packets).
fn contribution(src_rank: u16, mask: u64, op_id: u32, values: &[i32]) -> Vec<u8> {
    let mut p: Vec<u8> = values.iter().flat_map(|v| v.to_be_bytes()).collect();
    let h = Header {
        version: VERSION,
        msg_type: T_AGG,
        flags: F_ALLREDUCE | F_LAST_FRAG,
        job_id: ALLREDUCE_JOB,
        src_rank,
        mask_base: 0,
        dst_mask: mask,
        msg_seq: op_id,
        frag_off: 0,
        msg_len: p.len() as u32,
        payload_len: p.len() as u16,
        agg_op: OP_SUM,
        dtype: DT_I32,
    };
    let mut b = h.to_bytes().to_vec();
    b.append(&mut p);
    b
}

/// The call rank 2 died in: rank 2 fails somehow; every other member with
/// Error::MembersMissing naming rank 2, no earlier than the deadline.
fn check_dead_call(rank: u16, got: &Result<Vec<i32>, Error>, bad: &mut Vec<String>) {
    match (rank, got) {
        (2, Err(_)) => {}
        (_, Err(Error::MembersMissing { ranks, ms, .. })) => {
            if ranks != &[2] {
                bad.push(format!("rank {rank}: missing ranks {ranks:?}, want [2]"));
            }
            if *ms < cfg().deadline.as_millis() as u64 {
                bad.push(format!("rank {rank}: gave up after {ms} ms, before the deadline"));
            }
        }
        (_, other) => bad.push(format!(
            "rank {rank}: call 1 gave {:?}, want MembersMissing",
            other.as_ref().map(|v| v.len()).map_err(|e| e.to_string())
        )),
    }
}

/// Rank 2 dies (all its packets vanish) in the middle of an allreduce:
/// ranks 0 and 1 fail with Error::MembersMissing naming rank 2 (on both
/// paths: the aggregator answers their retransmissions with PENDING), on the
/// kernel path the aggregator's slot map holds nothing ACTIVE for that
/// operation once the sweep ran, and ranks 0 and 1 go on without rank 2.
/// Forged and stale packets are sent meanwhile: counted, never added.
fn dead_member(prefix: &str, path: PathChoice) {
    let kernel = path == PathChoice::Kernel;
    let topo = Topo::up(prefix);
    let group = topo.group(ALLREDUCE_JOB, &[0, 1, 2, AGG], Some(AGG));
    let big: i32 = 358 * 10_000; // 10000 chunks: still running when rank 2 dies
    let stop = Arc::new(AtomicBool::new(false));
    let (slots_tx, slots_rx) = mpsc::channel::<Option<Vec<(u32, kccl::kernel_agg::SlotState)>>>();
    // The failing call is call 1 (op id 5); call 0 and call 2 succeed.
    let dead_op = 5u32;
    let agg = {
        let (g, s) = (group.clone(), Arc::clone(&stop));
        on_host(topo.ns(AGG), move || {
            let mut a = Aggregator::new(&g, AGG, path, cfg()).expect("aggregator");
            a.serve(&s).expect("serve");
            // The kernel's sweep runs every slot_timeout / 4 while serving.
            let end = Instant::now() + cfg().slot_timeout * 3;
            while Instant::now() < end {
                a.serve_once(Duration::from_millis(20)).expect("serve");
            }
            slots_tx.send(a.kernel_slots_of_op(dead_op).expect("slots")).expect("send");
            (a.kernel_stats().expect("stats"), a.stats())
        })
    };
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = [0u16, 1, 2]
        .into_iter()
        .map(|rank| {
            let (g, b) = (group.clone(), Arc::clone(&barrier));
            on_host(topo.ns(rank), move || {
                let mut c = Collective::new(&g, rank, path, cfg()).expect("collective");
                let small = data(rank, 0);
                let first = c.allreduce(&small, AggOp::Sum).map_err(|e| e.to_string());
                b.wait();
                let mine: Vec<i32> = (0..big).map(|i| i % 1000 - i32::from(rank)).collect();
                let t = Instant::now();
                let second = c.allreduce(&mine, AggOp::Sum);
                let took = t.elapsed();
                b.wait();
                let third = if rank == 2 {
                    None
                } else {
                    c.exclude_ranks(&[2]).expect("exclude");
                    Some(c.allreduce(&data(rank, 2), AggOp::Sum).map_err(|e| e.to_string()))
                };
                (rank, first, second, took, third)
            })
        })
        .collect();
    barrier.wait();
    std::thread::sleep(Duration::from_millis(5));
    // Rank 2 dies: everything it sends from now on is lost.
    topo.fault(2, &FaultConfig::from_fractions(1.0, 0.0, 0.0, 1).expect("fault"));
    // Bad input while the others wait: a forged rank (rank 1's id from rank
    // 0's address), a non-member contributor (rank 3 is not in the mask), a
    // retransmission of the finished call 0 (op id 1).
    let agg_addr = SocketAddrV4::new(cluster::host_addr(AGG.into()), group.members[AGG as usize].port);
    let forge = on_host(topo.ns(0), move || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind");
        for _ in 0..3 {
            s.send_to(&contribution(1, 0b111, dead_op, &[1 << 20; 358]), agg_addr).expect("send");
            s.send_to(&contribution(3, 0b111, dead_op, &[1 << 20; 358]), agg_addr).expect("send");
        }
    });
    forge.join().expect("forger");
    barrier.wait();
    let mut bad = Vec::new();
    for h in handles {
        let (rank, first, second, took, third) = h.join().expect("member");
        let brief = |r: &Result<Vec<i32>, String>| r.as_ref().map(|v| v.len()).map_err(Clone::clone);
        println!(
            "rank {rank}: call 0 {:?}; call 1 after {took:?}: {:?}; call 2 {:?}",
            brief(&first),
            second.as_ref().map(|v| v.len()).map_err(|e| e.to_string()),
            third.as_ref().map(brief)
        );
        if first.as_ref().map(|v| *v != sum_of(&[0, 1, 2], 0)).unwrap_or(true) {
            bad.push(format!("rank {rank}: call 0 wrong: {:?}", brief(&first)));
        }
        check_dead_call(rank, &second, &mut bad);
        if rank != 2 && third.as_ref().and_then(|r| r.as_ref().ok()) != Some(&sum_of(&[0, 1], 2)) {
            bad.push(format!("rank {rank}: call 2 without rank 2 wrong: {:?}", third.as_ref().map(brief)));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let left = slots_rx.recv_timeout(Duration::from_secs(30)).expect("slot report");
    let (k, u) = agg.join().expect("aggregator");
    println!("aggregator: slots of op {dead_op} left: {left:?}; kernel {k:?}; user space {u:?}");
    // Where the aggregator counts: xdp_agg on the kernel path, its user
    // space on the user path.
    let (not_member, not_contrib, pending) = match (&k, kernel) {
        (Some(k), true) => (k.not_member, k.not_contrib, k.pending),
        (None, false) => (u.not_member, u.not_contrib, u.pending),
        _ => panic!("aggregator on the {path:?} path reported kernel counters {k:?}"),
    };
    if not_member < 3 || not_contrib < 3 {
        bad.push(format!("forged packets not counted: not_member {not_member} not_contrib {not_contrib}"));
    }
    if pending == 0 {
        bad.push("no PENDING answer was sent".into());
    }
    if kernel {
        let left = left.unwrap_or_default();
        if left.iter().any(|(_, s)| *s == kccl::kernel_agg::SlotState::Active) {
            bad.push(format!("ACTIVE slots of op {dead_op} left behind: {left:?}"));
        }
        if k.is_some_and(|k| k.swept == 0) {
            bad.push("the sweep freed nothing".into());
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[cfg(feature = "kernel-agg")]
#[test]
fn dead_member_kernel() {
    if root_or_skip("dead_member_kernel", "network namespaces and BPF") {
        dead_member("af-dead", PathChoice::Kernel);
    }
}

#[test]
fn dead_member_user() {
    if root_or_skip("dead_member_user", "network namespaces") {
        dead_member("af-deadu", PathChoice::User);
    }
}

/// Rank 2 of a sharded allreduce (ranks 0-3, no aggregator) dies in the
/// middle of a call: it owned a shard and contributed to every other
/// shard.  Ranks 0, 1 and 3 fail with Error::MembersMissing naming rank 2
/// (the owners' PENDING answers say who is missing, and rank 2's own
/// shard never answers), no earlier than the deadline; after excluding it
/// they allreduce among themselves, exact.
fn sharded_dead_member(prefix: &str, path: PathChoice) {
    let topo = Topo::up(prefix);
    let group = topo.group(SHARDED_JOB, &[0, 1, 2, 3], None);
    let big: i32 = 358 * 10_000; // 10000 chunks: still running when rank 2 dies
    let barrier = Arc::new(Barrier::new(5));
    let handles: Vec<_> = [0u16, 1, 2, 3]
        .into_iter()
        .map(|rank| {
            let (g, b) = (group.clone(), Arc::clone(&barrier));
            on_host(topo.ns(rank), move || {
                let mut c = Collective::new(&g, rank, path, cfg()).expect("collective");
                let first = c.allreduce(&data(rank, 0), AggOp::Sum).map_err(|e| e.to_string());
                b.wait();
                let mine: Vec<i32> = (0..big).map(|i| i % 1000 - i32::from(rank)).collect();
                let t = Instant::now();
                let second = c.allreduce(&mine, AggOp::Sum);
                let took = t.elapsed();
                b.wait();
                let third = if rank == 2 {
                    None
                } else {
                    c.exclude_ranks(&[2]).expect("exclude");
                    let r = c.allreduce(&data(rank, 2), AggOp::Sum).map_err(|e| e.to_string());
                    // Owners answer late retransmissions until all confirmed.
                    let open = c.settle(Duration::from_secs(3)).map_err(|e| e.to_string());
                    Some((r, open))
                };
                (rank, first, second, took, third)
            })
        })
        .collect();
    barrier.wait();
    std::thread::sleep(Duration::from_millis(5));
    // Rank 2 dies: everything it sends from now on is lost.
    topo.fault(2, &FaultConfig::from_fractions(1.0, 0.0, 0.0, 1).expect("fault"));
    barrier.wait();
    let mut bad = Vec::new();
    for h in handles {
        let (rank, first, second, took, third) = h.join().expect("member");
        let brief = |r: &Result<Vec<i32>, String>| r.as_ref().map(|v| v.len()).map_err(Clone::clone);
        println!(
            "rank {rank}: call 0 {:?}; call 1 after {took:?}: {:?}; call 2 {:?}",
            brief(&first),
            second.as_ref().map(|v| v.len()).map_err(|e| e.to_string()),
            third.as_ref().map(|(r, open)| (brief(r), open))
        );
        if first.as_ref().map(|v| *v != sum_of(&[0, 1, 2, 3], 0)).unwrap_or(true) {
            bad.push(format!("rank {rank}: call 0 wrong: {:?}", brief(&first)));
        }
        check_dead_call(rank, &second, &mut bad);
        if let Some((r, open)) = &third {
            if r.as_ref().ok() != Some(&sum_of(&[0, 1, 3], 2)) {
                bad.push(format!("rank {rank}: call 2 without rank 2 wrong: {:?}", brief(r)));
            }
            if !matches!(open, Ok(o) if o.is_empty()) {
                bad.push(format!("rank {rank}: call 2 not settled: {open:?}"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[cfg(feature = "kernel-agg")]
#[test]
fn sharded_dead_member_kernel() {
    if root_or_skip("sharded_dead_member_kernel", "network namespaces and BPF") {
        sharded_dead_member("af-sdead", PathChoice::Kernel);
    }
}

#[test]
fn sharded_dead_member_user() {
    if root_or_skip("sharded_dead_member_user", "network namespaces") {
        sharded_dead_member("af-sdeadu", PathChoice::User);
    }
}

/// Member processes started again against a long-lived aggregator: every
/// round makes fresh Collectives (call numbers from 0) with other data.
/// Without KCCL_T_AGG_SYNC the second round would reuse op ids: its chunks
/// would be answered from the first round's finished slots (a wrong result)
/// or dropped as late copies of chunks the members proved they hold.
fn restarted_members(prefix: &str, path: PathChoice) {
    let topo = Topo::up(prefix);
    let group = topo.group(ALLREDUCE_JOB, &[0, 1, 2, AGG], Some(AGG));
    let stop = Arc::new(AtomicBool::new(false));
    let agg = serve_aggregator(&topo, &group, path, &stop);
    let mut bad = Vec::new();
    for round in 0..3usize {
        let handles: Vec<_> = [0u16, 1, 2]
            .iter()
            .map(|&rank| {
                let g = group.clone();
                on_host(topo.ns(rank), move || {
                    let mut c = Collective::new(&g, rank, path, cfg()).expect("member");
                    (rank, c.allreduce(&data(rank, round), AggOp::Sum).map_err(|e| e.to_string()))
                })
            })
            .collect();
        for h in handles {
            match h.join().expect("member thread") {
                (_, Ok(v)) if v == sum_of(&[0, 1, 2], round) => {}
                (rank, Ok(_)) => bad.push(format!("round {round}, rank {rank}: wrong result")),
                (rank, Err(e)) => bad.push(format!("round {round}, rank {rank}: {e}")),
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    agg.join().expect("aggregator thread");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[cfg(feature = "kernel-agg")]
#[test]
fn restarted_members_kernel() {
    if root_or_skip("restarted_members_kernel", "network namespaces and BPF") {
        restarted_members("rs-k", PathChoice::Kernel);
    }
}

#[test]
fn restarted_members_user() {
    if root_or_skip("restarted_members_user", "network namespaces and BPF") {
        restarted_members("rs-u", PathChoice::User);
    }
}
