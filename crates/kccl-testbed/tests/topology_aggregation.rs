//! Reduce and allreduce on a virtual cluster, checked member by member
//! against a reference computed here.
//!
//! ```text
//!   senders (ranks 0..N-1)                     rank N
//!  netns kccl-<name>-h0 ... -h<N-1>          netns kccl-<name>-h<N>
//!  +----------------------+                 +-------------------------------+
//!  | Collective (rank i)  |  T_AGG chunks   | reduce group:    root         |
//!  |  window of chunks,   | --------------> |   Collective::reduce(.., N)   |
//!  |  retransmit, decode  | <-------------- | allreduce group: aggregator   |
//!  | eth0 10.77.0.i+1/16  |  ACK / RESULT   |   Aggregator::serve           |
//!  +---------|------------+  (one per       | eth0 10.77.0.N+1/16           |
//!            | veth           contributor)  +---------|---------------------+
//!  +---------h0 ... h<N-1>----------------------------hN--------------------+
//!  |                     br0 (STP off, static FDB)                          |
//!  |                        netns kccl-<name>-sw                            |
//!  +------------------------------------------------------------------------+
//! ```
//!
//! One cluster of N+1 hosts serves two groups over the same hosts: the
//! reduce group (job 11, no aggregator; ranks 0..N-1 send, rank N is the
//! root and folds its own data in) and the allreduce group (job 12,
//! `aggregator = N`; ranks 0..N-1 contribute and all get the result).  The
//! phases run one after the other (rank N's address is bound by the root
//! Collective, then by the Aggregator).
//!
//! Every member runs the same sequence of calls with its own deterministic
//! random data; results are compared with a reference computed here:
//! bit-exact for i32/i64 (every op) and for f32 MAX/MIN/COUNT; f32 SUM/AVG
//! within the bound of docs/AGGREGATION.md (per chunk: n/(2s) with the
//! chunk's scale, plus half an ulp of the float32 result).
//!
//! Each test is parametrized by path: `user` (every role in user space),
//! `kernel` (every member and the aggregator with `--path kernel`: each
//! loads the engine, since any member can be a reduce root) and
//! `kernel_aggregator_only` (only the reduce root / allreduce aggregator on
//! the kernel path, contributors without BPF).  The kernel variants need the
//! cargo feature `kernel-agg` (crate::kernel_agg, from the agg-bpf branch)
//! and root.  Without root each test prints `SKIPPED <test>: needs root`.
//!
//! Run: `cargo test --release -p kccl-testbed --test topology_aggregation -- --test-threads=1 --nocapture`

use std::collections::BTreeMap;
use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kccl::agg::user::AggStats;
use kccl::agg::{abort, quant, AggConfig, AggOp, Aggregator, Collective, Element, Quant};
use kccl::error::Error;
use kccl::group::{Group, Member};
use kccl::netns;
use kccl::transport::{Path, PathChoice};
use kccl::wire::{AbortReason, Header, DT_I32, F_ALLREDUCE, F_LAST_FRAG, OP_SUM, T_AGG, T_AGG_ABORT, VERSION};
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

/// Which path each role runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Paths {
    /// Every member and the aggregator on the user-space path.
    User,
    /// Every member and the aggregator on the kernel path (`--path kernel`
    /// everywhere: each member loads the engine, as a reduce root needs it).
    #[cfg_attr(not(feature = "kernel-agg"), allow(dead_code))]
    Kernel,
    /// Only the aggregating rank (reduce root, allreduce aggregator) on the
    /// kernel path; the contributors run no BPF.
    #[cfg_attr(not(feature = "kernel-agg"), allow(dead_code))]
    KernelAggregatorOnly,
}

impl Paths {
    /// The reduce root and the allreduce aggregator.
    fn aggregating(self) -> PathChoice {
        match self {
            Paths::User => PathChoice::User,
            _ => PathChoice::Kernel,
        }
    }

    fn contributor(self) -> PathChoice {
        match self {
            Paths::Kernel => PathChoice::Kernel,
            _ => PathChoice::User,
        }
    }

    fn kernel(self) -> bool {
        self != Paths::User
    }
}

fn path_of(c: PathChoice) -> Path {
    if c == PathChoice::User {
        Path::User
    } else {
        Path::Kernel
    }
}

/// Counters of the kernel aggregation (xdp_agg/tc_agg_result) of an
/// aggregating rank; zero on the user path.
#[derive(Debug, Clone, Copy, Default)]
struct KernelCounters {
    pkts: u64,
    results: u64,
    records: u64,
    ring_full: u64,
    mismatch: u64,
    not_member: u64,
    overflow: u64,
    own_records: u64,
    own_ring_full: u64,
    own_skipped: u64,
}

#[cfg(feature = "kernel-agg")]
fn kernel_counters(s: Option<kccl::kernel_agg::AggStats>) -> KernelCounters {
    s.map(|k| KernelCounters {
        pkts: k.pkts,
        results: k.results,
        records: k.records,
        ring_full: k.ring_full,
        mismatch: k.mismatch,
        not_member: k.not_member,
        overflow: k.overflow,
        own_records: k.own_records,
        own_ring_full: k.own_ring_full,
        own_skipped: k.own_skipped,
    })
    .unwrap_or_default()
}

const REDUCE_JOB: u32 = 11;
const ALLREDUCE_JOB: u32 = 12;
const SHARDED_JOB: u32 = 13;

/// The test's aggregation settings: the defaults, with a deadline short
/// enough for the failure cases and a slot timeout that lets abandoned
/// chunks go quickly.
fn cfg() -> AggConfig {
    AggConfig { deadline: Duration::from_secs(10), slot_timeout: Duration::from_millis(500), ..AggConfig::default() }
}

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

    fn ns(&self, rank: u16) -> String {
        cluster::host_netns(&self.guard.cluster.name, rank.into())
    }

    /// Ranks 0..=n of the cluster as a group with `job`.
    fn group(&self, job: u32, n: u16, aggregator: Option<u16>) -> Group {
        let members: Vec<Member> = self.guard.cluster.group.members.iter().filter(|m| m.rank <= n).cloned().collect();
        let mut g = Group::new(&self.guard.cluster.name, job, members);
        g.aggregator = aggregator;
        g
    }
}

/// Deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64, rank: u16, case: usize) -> Rng {
        Rng((seed ^ (u64::from(rank) << 32) ^ (case as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    I32,
    I64,
    F32,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    op: AggOp,
    ty: Ty,
    len: usize,
}

/// One member's data of case `case`.
#[derive(Debug, Clone)]
enum Data {
    I32(Vec<i32>),
    I64(Vec<i64>),
    F32(Vec<f32>),
}

fn gen(c: &Case, case: usize, rank: u16) -> Data {
    let mut r = Rng::new(0x05ee_da66, rank, case);
    match c.ty {
        // Sums of 17 members stay inside int32: |x| < 2^26.
        Ty::I32 => Data::I32(
            (0..c.len)
                .map(|i| match r.next() % 16 {
                    0 => 0,
                    1 if c.op != AggOp::Sum && c.op != AggOp::Avg => {
                        if i % 2 == 0 {
                            i32::MAX
                        } else {
                            i32::MIN
                        }
                    }
                    _ => (r.next() as i32) >> 6,
                })
                .collect(),
        ),
        // |x| < 2^58: sums of 17 stay inside int64.
        Ty::I64 => Data::I64(
            (0..c.len)
                .map(|_| match r.next() % 16 {
                    0 => 0,
                    _ => (r.next() as i64) >> 6,
                })
                .collect(),
        ),
        // Mixed magnitudes (2^-20..2^20), signs, zeros, some subnormals.
        Ty::F32 => Data::F32(
            (0..c.len)
                .map(|_| {
                    let k = r.next() % 32;
                    let sign = if r.next() % 2 == 0 { 1.0f32 } else { -1.0 };
                    match k {
                        0 => 0.0,
                        1 => f32::from_bits((r.next() as u32) & 0x007f_ffff) * sign,
                        _ => {
                            let m = (r.next() >> 40) as f32 / (1u64 << 24) as f32 + 0.5;
                            let e = (r.next() % 41) as i32 - 20;
                            sign * m * 2f32.powi(e)
                        }
                    }
                })
                .collect(),
        ),
    }
}

/// What a member got for one case.
#[derive(Debug)]
enum Got {
    I32(Vec<i32>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    /// A contributor of a reduce.
    Sent,
    Err(String),
}

fn run_case(c: &mut Collective, case: &Case, data: &Data, reduce_root: Option<u16>) -> Got {
    fn go<T: Element>(c: &mut Collective, d: &[T], op: AggOp, root: Option<u16>, wrap: fn(Vec<T>) -> Got) -> Got {
        match root {
            Some(r) => match c.reduce(d, op, r) {
                Ok(Some(v)) => wrap(v),
                Ok(None) => Got::Sent,
                Err(e) => Got::Err(e.to_string()),
            },
            // Into a reused buffer that holds other values (the input
            // reversed): every element must be written.
            None => {
                let mut out: Vec<T> = d.iter().rev().copied().collect();
                match c.allreduce_into(d, op, &mut out) {
                    Ok(()) => wrap(out),
                    Err(e) => Got::Err(e.to_string()),
                }
            }
        }
    }
    match data {
        Data::I32(d) => go(c, d, case.op, reduce_root, Got::I32),
        Data::I64(d) => go(c, d, case.op, reduce_root, Got::I64),
        Data::F32(d) => go(c, d, case.op, reduce_root, Got::F32),
    }
}

/// Exact reference for integers: i128 accumulation, AVG truncating.
fn int_ref(op: AggOp, vals: &[i128]) -> i128 {
    match op {
        AggOp::Sum => vals.iter().sum(),
        AggOp::Avg => vals.iter().sum::<i128>() / vals.len() as i128,
        AggOp::Max => *vals.iter().max().expect("members"),
        AggOp::Min => *vals.iter().min().expect("members"),
        AggOp::Count => vals.iter().filter(|&&v| v != 0).count() as i128,
    }
}

fn ulp(x: f32) -> f64 {
    let a = x.abs();
    if !a.is_finite() {
        return f64::INFINITY;
    }
    f64::from(f32::from_bits(a.to_bits() + 1) - a)
}

/// Problems of one member's result of one case (empty when correct).
/// `datas`: every member's data, the local root's last (reduce); `quantized`:
/// the members whose data was quantized (reduce: not the root);
/// `headroom`: true for allreduce (int32 result).
fn check(
    case: &Case,
    idx: usize,
    datas: &[Data],
    quantized: usize,
    allreduce: bool,
    chunk: usize,
    got: &Got,
) -> Vec<String> {
    let mut bad = Vec::new();
    let n = datas.len();
    let what = format!("case {idx} ({:?} {} x{})", case.ty, case.op, case.len);
    match (got, case.ty) {
        (Got::I32(v), Ty::I32) => {
            let mut wrong = 0;
            for i in 0..case.len {
                let vals: Vec<i128> =
                    datas.iter().map(|d| if let Data::I32(x) = d { i128::from(x[i]) } else { 0 }).collect();
                let want = int_ref(case.op, &vals);
                if v.len() != case.len || i128::from(v[i]) != want {
                    if wrong < 3 {
                        bad.push(format!("{what}: element {i} = {:?}, expected {want}", v.get(i)));
                    }
                    wrong += 1;
                }
            }
            if wrong > 3 {
                bad.push(format!("{what}: {wrong} elements wrong"));
            }
        }
        (Got::I64(v), Ty::I64) => {
            let mut wrong = 0;
            for i in 0..case.len {
                let vals: Vec<i128> =
                    datas.iter().map(|d| if let Data::I64(x) = d { i128::from(x[i]) } else { 0 }).collect();
                let want = int_ref(case.op, &vals);
                if v.len() != case.len || i128::from(v[i]) != want {
                    if wrong < 3 {
                        bad.push(format!("{what}: element {i} = {:?}, expected {want}", v.get(i)));
                    }
                    wrong += 1;
                }
            }
            if wrong > 3 {
                bad.push(format!("{what}: {wrong} elements wrong"));
            }
        }
        (Got::F32(v), Ty::F32) => {
            let f: Vec<&Vec<f32>> =
                datas.iter().map(|d| if let Data::F32(x) = d { x } else { unreachable!("f32 case") }).collect();
            if v.len() != case.len {
                bad.push(format!("{what}: {} elements, expected {}", v.len(), case.len));
                return bad;
            }
            // Per-chunk scale as the doc specifies it: e = max exponent
            // over the quantized members' block, s = 2^(30 - e - h).
            let block = chunk / 4;
            let h = if allreduce { quant::headroom(quantized) } else { 0 };
            let mut wrong = 0;
            let mut worst = 0f64;
            for b in 0..case.len.div_ceil(block) {
                let r = b * block..((b + 1) * block).min(case.len);
                let e = f[..quantized]
                    .iter()
                    .flat_map(|x| x[r.clone()].iter())
                    .map(|&x| quant::exponent(x))
                    .max()
                    .unwrap_or(quant::E_ZERO);
                let s = quant::auto_scale(e, h);
                for i in r {
                    let ok = match case.op {
                        AggOp::Max | AggOp::Min | AggOp::Count => {
                            let want = match case.op {
                                AggOp::Max => f.iter().map(|x| x[i]).fold(f32::NEG_INFINITY, f32::max),
                                AggOp::Min => f.iter().map(|x| x[i]).fold(f32::INFINITY, f32::min),
                                _ => f.iter().filter(|x| x[i] != 0.0).count() as f32,
                            };
                            // -0.0 and 0.0 compare equal: bit-exact otherwise.
                            v[i] == want
                        }
                        AggOp::Sum | AggOp::Avg => {
                            let exact: f64 = f.iter().map(|x| f64::from(x[i])).sum();
                            let abs: f64 = f.iter().map(|x| f64::from(x[i]).abs()).sum();
                            let div = if case.op == AggOp::Avg { n as f64 } else { 1.0 };
                            let want = exact / div;
                            let tol =
                                quantized as f64 / (2.0 * s) / div + ulp(v[i]) / 2.0 + abs * n as f64 * f64::EPSILON;
                            let err = (f64::from(v[i]) - want).abs();
                            worst = worst.max(err / tol);
                            err <= tol
                        }
                    };
                    if !ok {
                        if wrong < 3 {
                            bad.push(format!("{what}: element {i} = {:e}, outside the bound", v[i]));
                        }
                        wrong += 1;
                    }
                }
            }
            if wrong > 3 {
                bad.push(format!("{what}: {wrong} elements outside the bound (worst error/bound {worst:.3})"));
            }
        }
        (Got::Err(e), _) => bad.push(format!("{what}: {e}")),
        (other, _) => bad.push(format!("{what}: unexpected {other:?}")),
    }
    bad
}

/// Runs `f` on a thread inside network namespace `ns`.
fn on_host<T: Send + 'static>(ns: String, f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
    std::thread::spawn(move || {
        netns::enter(&ns).unwrap_or_else(|e| panic!("entering {ns}: {e}"));
        f()
    })
}

/// The allreduce aggregator of `group` on its host until the guard drops.
struct AggHost {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<AggOutcome>>,
}

/// What the aggregator counted: user space, mismatch reports, kernel.
struct AggOutcome {
    user: AggStats,
    mismatches: Vec<String>,
    kernel: KernelCounters,
}

impl AggHost {
    fn start(topo: &Topo, group: &Group, choice: PathChoice) -> AggHost {
        let rank = group.aggregator.expect("allreduce group");
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (g, s) = (group.clone(), Arc::clone(&stop));
        let thread = on_host(topo.ns(rank), move || {
            let mut a = match Aggregator::new(&g, rank, choice, cfg()) {
                Ok(a) => a,
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return AggOutcome {
                        user: AggStats::default(),
                        mismatches: vec![],
                        kernel: KernelCounters::default(),
                    };
                }
            };
            let _ = tx.send(Ok((a.path(), a.path_reason().to_owned())));
            if let Err(e) = a.serve(&s) {
                panic!("aggregator: {e}");
            }
            #[cfg(feature = "kernel-agg")]
            let kernel = kernel_counters(a.kernel_stats().expect("reading the kernel counters"));
            #[cfg(not(feature = "kernel-agg"))]
            let kernel = KernelCounters::default();
            let mismatches =
                a.take_mismatches().into_iter().map(|m| format!("rank {}: {}", m.rank, m.detail)).collect();
            AggOutcome { user: a.stats(), mismatches, kernel }
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(Ok((path, why))) => assert_eq!(path, path_of(choice), "aggregator path: {why}"),
            Ok(Err(e)) => panic!("Aggregator::new: {e}"),
            Err(e) => panic!("aggregator did not start: {e}"),
        }
        AggHost { stop, thread: Some(thread) }
    }

    fn finish(mut self) -> AggOutcome {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().expect("running").join().expect("aggregator thread")
    }
}

impl Drop for AggHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Every member of `ranks` runs `cases` in order (reduce to `root` or
/// allreduce); returns what each got per case and its Collective's stats.
fn run_members(
    topo: &Topo,
    group: &Group,
    ranks: &[u16],
    paths: Paths,
    cases: &[Case],
    root: Option<u16>,
    linger: Duration,
) -> BTreeMap<u16, (Vec<Got>, kccl::agg::CollectiveStats, KernelCounters)> {
    let barrier = Arc::new(Barrier::new(ranks.len()));
    let handles: Vec<_> = ranks
        .iter()
        .map(|&rank| {
            let (g, b, cs) = (group.clone(), Arc::clone(&barrier), cases.to_vec());
            on_host(topo.ns(rank), move || {
                let choice = if Some(rank) == root { paths.aggregating() } else { paths.contributor() };
                let mut c = Collective::new(&g, rank, choice, cfg()).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert_eq!(c.path(), path_of(choice), "rank {rank}: {}", c.path_reason());
                b.wait();
                // After its first failure a member stops (the others then
                // fail at most one more case), so a broken path costs a few
                // deadlines, not one per case.
                let mut got: Vec<Got> = Vec::with_capacity(cs.len());
                for (i, case) in cs.iter().enumerate() {
                    if got.iter().any(|g| matches!(g, Got::Err(_))) {
                        got.push(Got::Err("not run after an earlier failure of this member".into()));
                        continue;
                    }
                    got.push(run_case(&mut c, case, &gen(case, i, rank), root));
                }
                if Some(rank) == root {
                    // Answer retransmissions of contributors whose last ACK
                    // was lost (none expected on a bridge).
                    let _ = c.serve_for(linger);
                }
                if root.is_none() && g.aggregator.is_none() {
                    // Sharded: every member owns a shard; it answers
                    // retransmissions until every member confirmed, and
                    // its programs stay attached until all are done.
                    let open = c.settle(Duration::from_secs(5));
                    assert!(matches!(&open, Ok(o) if o.is_empty()), "rank {rank}: settle {open:?}");
                    b.wait();
                }
                #[cfg(feature = "kernel-agg")]
                let kernel = kernel_counters(c.kernel_stats().expect("reading the kernel counters"));
                #[cfg(not(feature = "kernel-agg"))]
                let kernel = KernelCounters::default();
                (rank, got, c.stats(), kernel)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            let (r, g, s, k) = h.join().expect("member thread");
            (r, (g, s, k))
        })
        .collect()
}

fn assert_clean(what: &str, bad: Vec<String>) {
    let shown: Vec<&str> = bad.iter().take(20).map(String::as_str).collect();
    assert!(bad.is_empty(), "{what}: {} problems (first {}):\n  {}", bad.len(), shown.len(), shown.join("\n  "));
}

/// Every op over every type, sizes from 1 element to several chunks.
fn cases(sizes: &[usize]) -> Vec<Case> {
    let mut v = Vec::new();
    for &len in sizes {
        for ty in [Ty::I32, Ty::I64, Ty::F32] {
            for op in [AggOp::Sum, AggOp::Count, AggOp::Max, AggOp::Min, AggOp::Avg] {
                v.push(Case { op, ty, len });
            }
        }
    }
    v
}

/// N senders: reduce to rank N (which folds its own data in) and allreduce
/// through aggregator rank N, every case checked on every member.
fn reduce_and_allreduce(test: &str, senders: u16, paths: Paths, sizes: &[usize]) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("agg", senders as usize + 1);
    let n = senders;
    let cases = cases(sizes);
    let all: Vec<u16> = (0..=n).collect();
    let senders_v: Vec<u16> = (0..n).collect();

    // Reduce: ranks 0..N-1 send, rank N is the root.
    let rg = topo.group(REDUCE_JOB, n, None);
    let t = Instant::now();
    let got = run_members(&topo, &rg, &all, paths, &cases, Some(n), Duration::from_millis(200));
    let reduce_time = t.elapsed();
    let mut bad = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        // The root's data last: it is not quantized.
        let mut datas: Vec<Data> = senders_v.iter().map(|&r| gen(case, i, r)).collect();
        datas.push(gen(case, i, n));
        for (&rank, (g, _, _)) in &got {
            if rank == n {
                bad.extend(check(case, i, &datas, n as usize, false, rg.chunk_bytes as usize, &g[i]));
            } else if !matches!(g[i], Got::Sent) {
                bad.push(format!("reduce case {i}: contributor {rank} got {:?}", g[i]));
            }
        }
    }
    for (rank, (_, s, _)) in &got {
        if s.contrib.bad_answers != 0 || s.agg.rejected() != 0 {
            bad.push(format!("rank {rank}: dropped packets: {s:?}"));
        }
    }
    let root_stats = got[&n].1;
    // The kernel did the root's aggregation: nothing reached its socket.
    if paths.kernel() && (root_stats.agg.pkts != 0 || root_stats.root_chunks == 0) {
        bad.push(format!("kernel path root: user-space aggregation {:?}", root_stats.agg));
    }
    assert_clean(&format!("{test}: reduce to rank {n}"), bad);

    // Allreduce through aggregator rank N.
    let ag = topo.group(ALLREDUCE_JOB, n, Some(n));
    let agg = AggHost::start(&topo, &ag, paths.aggregating());
    let t = Instant::now();
    let got = run_members(&topo, &ag, &senders_v, paths, &cases, None, Duration::ZERO);
    let allreduce_time = t.elapsed();
    let AggOutcome { user: astats, mismatches, kernel } = agg.finish();
    let mut bad = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let datas: Vec<Data> = senders_v.iter().map(|&r| gen(case, i, r)).collect();
        for (rank, (g, _, _)) in &got {
            for p in check(case, i, &datas, n as usize, true, ag.chunk_bytes as usize, &g[i]) {
                bad.push(format!("rank {rank}: {p}"));
            }
        }
    }
    if astats.rejected() != 0 || !mismatches.is_empty() {
        bad.push(format!("aggregator dropped packets: {astats:?} {mismatches:?}"));
    }
    if !paths.kernel() && astats.results == 0 {
        bad.push(format!("user path but the user-space aggregator made no results: {astats:?}"));
    }
    if paths.kernel() && (astats.pkts != 0 || kernel.results == 0 || kernel.mismatch != 0) {
        bad.push(format!("kernel path: user-space aggregator {astats:?}, kernel {kernel:?}"));
    }
    assert_clean(&format!("{test}: allreduce via rank {n}"), bad);
    println!(
        "{test}: {} cases x {senders} senders: reduce {reduce_time:?} (root: {} chunks, {} pkts, dup {}), \
         allreduce {allreduce_time:?} (aggregator: {} pkts, {} results, {} answers, dup {}, busy {}; kernel {} pkts, {} results); total {:?}",
        cases.len(),
        root_stats.root_chunks,
        root_stats.agg.pkts,
        root_stats.agg.dup,
        astats.pkts,
        astats.results,
        astats.answers_sent,
        astats.dup,
        astats.busy,
        kernel.pkts,
        kernel.results,
        t0.elapsed()
    );
}

const SIZES: [usize; 4] = [1, 358, 359, 5000];
/// 2 senders also do a 100 000-element case of every op and type.
const SIZES_2: [usize; 5] = [1, 358, 359, 5000, 100_000];

#[test]
fn a_user_path_2_senders() {
    reduce_and_allreduce("a_user_path_2_senders", 2, Paths::User, &SIZES_2);
}

#[test]
fn a_user_path_4_senders() {
    reduce_and_allreduce("a_user_path_4_senders", 4, Paths::User, &SIZES);
}

#[test]
fn a_user_path_8_senders() {
    reduce_and_allreduce("a_user_path_8_senders", 8, Paths::User, &SIZES);
}

#[test]
fn a_user_path_16_senders() {
    reduce_and_allreduce("a_user_path_16_senders", 16, Paths::User, &SIZES);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_path_2_senders() {
    reduce_and_allreduce("a_kernel_path_2_senders", 2, Paths::Kernel, &SIZES_2);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_path_4_senders() {
    reduce_and_allreduce("a_kernel_path_4_senders", 4, Paths::Kernel, &SIZES);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_path_8_senders() {
    reduce_and_allreduce("a_kernel_path_8_senders", 8, Paths::Kernel, &SIZES);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_path_16_senders() {
    reduce_and_allreduce("a_kernel_path_16_senders", 16, Paths::Kernel, &SIZES);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_aggregator_only_2_senders() {
    reduce_and_allreduce("a_kernel_aggregator_only_2_senders", 2, Paths::KernelAggregatorOnly, &SIZES_2);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_aggregator_only_16_senders() {
    reduce_and_allreduce("a_kernel_aggregator_only_16_senders", 16, Paths::KernelAggregatorOnly, &SIZES);
}

/// The sharded allreduce: no aggregator, each of `n` members combines a
/// shard of every vector (on the kernel path in its own xdp_agg, its own
/// contribution through BPF_PROG_TEST_RUN) and fans it out; every case
/// checked on every member.
///
///   host 0 ----+
///   host 1 ----+-- bridge (each host owns 1/n of the chunks, sends the
///   ...        |   rest to their owners, gets every result back)
///   host n-1 --+
fn sharded_allreduce(test: &str, n: u16, paths: Paths, sizes: &[usize]) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("shard", n as usize);
    let cases = cases(sizes);
    let ranks: Vec<u16> = (0..n).collect();
    let g = topo.group(SHARDED_JOB, n - 1, None);
    let got = run_members(&topo, &g, &ranks, paths, &cases, None, Duration::ZERO);
    let mut bad = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let datas: Vec<Data> = ranks.iter().map(|&r| gen(case, i, r)).collect();
        for (rank, (got, _, _)) in &got {
            for p in check(case, i, &datas, n as usize, true, g.chunk_bytes as usize, &got[i]) {
                bad.push(format!("rank {rank}: {p}"));
            }
        }
    }
    let mut kernel_total = KernelCounters::default();
    for (rank, (_, s, k)) in &got {
        if s.contrib.bad_answers != 0 || s.agg.rejected() != 0 {
            bad.push(format!("rank {rank}: dropped packets: {s:?}"));
        }
        // Every member owns shards of the multi-chunk cases.
        if paths.kernel() {
            // The kernel combined them: no contribution reached a socket.
            if s.agg.pkts != 0 || k.pkts == 0 || k.mismatch != 0 || k.own_ring_full != 0 {
                bad.push(format!("rank {rank}: kernel path: user-space aggregator {:?}, kernel {k:?}", s.agg));
            }
            kernel_total.own_records += k.own_records;
            kernel_total.own_skipped += k.own_skipped;
        } else if s.agg.results == 0 {
            bad.push(format!("rank {rank}: combined nothing: {:?}", s.agg));
        }
    }
    // Remote contributions completed some owned chunks: the owners' copies
    // came from the ring, and the fan-out left the owners out.
    if paths.kernel() && (kernel_total.own_records == 0 || kernel_total.own_skipped < kernel_total.own_records) {
        bad.push(format!("kernel path: owners' copies {kernel_total:?}"));
    }
    assert_clean(&format!("{test}: sharded allreduce over {n} members"), bad);
    println!(
        "{test}: {} cases x {n} members, sharded: owners' records {}, fan-outs skipping the owner {}; total {:?}",
        cases.len(),
        kernel_total.own_records,
        kernel_total.own_skipped,
        t0.elapsed()
    );
}

#[test]
fn e_user_path_sharded_4_members() {
    sharded_allreduce("e_user_path_sharded_4_members", 4, Paths::User, &SIZES);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn e_kernel_path_sharded_4_members() {
    sharded_allreduce("e_kernel_path_sharded_4_members", 4, Paths::Kernel, &SIZES_2);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn e_kernel_path_sharded_8_members() {
    sharded_allreduce("e_kernel_path_sharded_8_members", 8, Paths::Kernel, &SIZES);
}

/// Regression: on the kernel path the root's kernel ACKs every reduce chunk
/// by itself, so the contributors can finish many calls before the root's
/// runtime reads their ring buffer records.  The root used to keep only the
/// records of its next two calls and dropped the others, whose chunks were
/// then lost for good: it timed out on the third call it was behind
/// (a_kernel_path_2_senders flaked like this under CPU load).  Here the lag
/// is certain: the contributors run every call before the root starts.  A
/// stash of 16 chunks (nslots 16) also makes the root leave most records in
/// the ring buffer until it reaches their call.
fn root_behind_contributors(test: &str, paths: Paths) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let t0 = Instant::now();
    let topo = Topo::up("agg-lag", 3);
    let n = 2u16;
    let cases = cases(&[1, 358, 5000]);
    let rg = topo.group(REDUCE_JOB, n, None);
    let c = AggConfig { nslots: 16, window: 8, deadline: Duration::from_secs(3), ..cfg() };
    // Every Collective exists (BPF loaded); then the contributors are done.
    let (ready, sent) = (Arc::new(Barrier::new(3)), Arc::new(Barrier::new(3)));
    let handles: Vec<_> = (0..=n)
        .map(|rank| {
            let (g, c, cs, ready, sent) = (rg.clone(), c.clone(), cases.clone(), ready.clone(), sent.clone());
            on_host(topo.ns(rank), move || {
                let choice = if rank == n { paths.aggregating() } else { paths.contributor() };
                let mut col = Collective::new(&g, rank, choice, c).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert_eq!(col.path(), path_of(choice), "rank {rank}: {}", col.path_reason());
                ready.wait();
                if rank == n {
                    sent.wait();
                }
                let mut got: Vec<Got> = Vec::with_capacity(cs.len());
                for (i, case) in cs.iter().enumerate() {
                    if got.iter().any(|g| matches!(g, Got::Err(_))) {
                        got.push(Got::Err("not run after an earlier failure of this member".into()));
                        continue;
                    }
                    got.push(run_case(&mut col, case, &gen(case, i, rank), Some(n)));
                }
                if rank != n {
                    sent.wait();
                }
                #[cfg(feature = "kernel-agg")]
                let kernel = kernel_counters(col.kernel_stats().expect("reading the kernel counters"));
                #[cfg(not(feature = "kernel-agg"))]
                let kernel = KernelCounters::default();
                (rank, got, col.stats(), kernel)
            })
        })
        .collect();
    let got: BTreeMap<u16, _> = handles
        .into_iter()
        .map(|h| {
            let (r, g, s, k) = h.join().expect("member thread");
            (r, (g, s, k))
        })
        .collect();
    let mut bad = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let mut datas: Vec<Data> = (0..n).map(|r| gen(case, i, r)).collect();
        datas.push(gen(case, i, n));
        for (&rank, (g, _, _)) in &got {
            if rank == n {
                bad.extend(check(case, i, &datas, n as usize, false, rg.chunk_bytes as usize, &g[i]));
            } else if !matches!(g[i], Got::Sent) {
                bad.push(format!("case {i}: contributor {rank} got {:?}", g[i]));
            }
        }
    }
    let (_, root, kernel) = &got[&n];
    // Every chunk the kernel recorded reached the root, most of them
    // through its stash (none was from a past call), and the ring did not
    // overflow: the contributors never had to wait.
    if root.stashed == 0 || root.stale_chunks != 0 || root.root_chunks != kernel.records || kernel.ring_full != 0 {
        bad.push(format!("root: {root:?}; kernel {kernel:?}"));
    }
    assert_clean(&format!("{test}: reduce to rank {n} after the contributors finished"), bad);
    println!(
        "{test}: {} calls; root: {} chunks, {} stashed; kernel {} records; total {:?}",
        cases.len(),
        root.root_chunks,
        root.stashed,
        kernel.records,
        t0.elapsed()
    );
}

#[cfg(feature = "kernel-agg")]
#[test]
fn a_kernel_path_root_behind_2_senders() {
    root_behind_contributors("a_kernel_path_root_behind_2_senders", Paths::Kernel);
}

/// 22M float32 (88 MB per member), SUM, 2 senders: reduce and allreduce.
fn large_float_sum(test: &str, paths: Paths) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    const LEN: usize = 22_000_000;
    let topo = Topo::up("agg-big", 3);
    let cases = [Case { op: AggOp::Sum, ty: Ty::F32, len: LEN }];
    let rg = topo.group(REDUCE_JOB, 2, None);
    let t = Instant::now();
    let got = run_members(&topo, &rg, &[0, 1, 2], paths, &cases, Some(2), Duration::from_millis(200));
    let dt = t.elapsed();
    let datas = [gen(&cases[0], 0, 0), gen(&cases[0], 0, 1), gen(&cases[0], 0, 2)];
    assert_clean(
        &format!("{test}: reduce"),
        check(&cases[0], 0, &datas, 2, false, rg.chunk_bytes as usize, &got[&2].0[0]),
    );
    let s = got[&0].1.contrib;
    println!(
        "{test}: reduce of {LEN} f32 from 2 senders in {dt:?} ({:.0} MB/s per sender; sender 0: {} chunks, {} datagrams, \
         {} retransmitted, {} send calls)",
        LEN as f64 * 4.0 / dt.as_secs_f64() / 1e6,
        s.chunks,
        s.datagrams,
        s.retransmits,
        s.send_calls
    );
    drop(got);

    let ag = topo.group(ALLREDUCE_JOB, 2, Some(2));
    let agg = AggHost::start(&topo, &ag, paths.aggregating());
    let t = Instant::now();
    let got = run_members(&topo, &ag, &[0, 1], paths, &cases, None, Duration::ZERO);
    let dt = t.elapsed();
    let AggOutcome { user: astats, kernel, .. } = agg.finish();
    for (rank, (g, _, _)) in &got {
        assert_clean(
            &format!("{test}: allreduce rank {rank}"),
            check(&cases[0], 0, &datas[..2], 2, true, ag.chunk_bytes as usize, &g[0]),
        );
    }
    println!(
        "{test}: allreduce of {LEN} f32 over 2 senders in {dt:?} ({:.0} MB/s per sender; aggregator: {} pkts, dup {}, \
         busy {}, {} recv calls, {} send calls; kernel {} pkts)",
        LEN as f64 * 4.0 / dt.as_secs_f64() / 1e6,
        astats.pkts,
        astats.dup,
        astats.busy,
        astats.recv_calls,
        astats.send_calls,
        kernel.pkts
    );
}

#[test]
fn b_user_path_22m_float32() {
    large_float_sum("b_user_path_22m_float32", Paths::User);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn b_kernel_path_22m_float32() {
    large_float_sum("b_kernel_path_22m_float32", Paths::Kernel);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn b_kernel_aggregator_only_22m_float32() {
    large_float_sum("b_kernel_aggregator_only_22m_float32", Paths::KernelAggregatorOnly);
}

/// Bad input: mismatched lengths (clear error at the root, timeouts naming
/// the missing chunks at the contributors, counted at the aggregator); NaN
/// (Error::NonFinite before anything is sent); a sender outside the group
/// (ignored and counted); int32 overflow (exact int64 redo: i32 SUM is an
/// error naming the element, f32 with a fixed scale is redone exactly);
/// and the members recover for the next call after each failure.
/// The reduce after a failed one works: root `root` gets `want`, the
/// others Ok(None).
fn check_next_reduce(rank: u16, root: u16, got: Result<Option<Vec<i32>>, Error>, want: &[i32], bad: &mut Vec<String>) {
    match got {
        Ok(Some(v)) if rank == root && v == want => {}
        Ok(None) if rank != root => {}
        other => bad.push(format!("rank {rank} (root {root}): the next reduce after the failure: {other:?}")),
    }
}

fn bad_input(test: &str, paths: Paths) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    // Ranks 0..2 send, rank 3 is root/aggregator, host 4 is outside the group.
    let topo = Topo::up("agg-bad", 5);
    let short = AggConfig { deadline: Duration::from_millis(1500), slot_timeout: Duration::from_millis(300), ..cfg() };

    // 1. Reduce with mismatched lengths: rank 1 passes 1000 elements, the
    //    others 1001.  Then a correct reduce.
    let rg = topo.group(REDUCE_JOB, 3, None);
    // The application's own resynchronisation after a failed call (here: a
    // barrier), so that nobody's next call times out waiting for the
    // members that are still timing out of the failed one.
    let sync = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..=3u16)
        .map(|rank| {
            let (g, c, sync) = (rg.clone(), short.clone(), Arc::clone(&sync));
            on_host(topo.ns(rank), move || {
                let choice = if rank == 3 { paths.aggregating() } else { paths.contributor() };
                let mut col = Collective::new(&g, rank, choice, c).expect("collective");
                let len = if rank == 1 { 1000 } else { 1001 };
                let data: Vec<i32> = (0..len).map(|i| i + i32::from(rank)).collect();
                let first = col.reduce(&data, AggOp::Sum, 3);
                sync.wait();
                let data: Vec<i32> = (0..500).map(|i| i * i32::from(rank)).collect();
                let second = col.reduce(&data, AggOp::Sum, 3);
                if rank == 3 {
                    let _ = col.serve_for(Duration::from_millis(200));
                }
                (rank, first, second, col.stats())
            })
        })
        .collect();
    let mut bad = Vec::new();
    for h in handles {
        let (rank, first, second, stats) = h.join().expect("member thread");
        match (rank, &first) {
            (3, Err(Error::Mismatch { rank: 1, detail, .. })) => {
                if !(detail.contains("4000") && detail.contains("4004")) {
                    bad.push(format!("root: mismatch error does not name both lengths: {detail}"));
                }
                if stats.agg.mismatch == 0 {
                    bad.push(format!("root: mismatch not counted: {:?}", stats.agg));
                }
            }
            // The kernel drops mismatching contributions itself (counted in
            // its map); the root then times out with the hint.
            (3, Err(Error::Timeout { what, .. })) if paths.kernel() && what.contains("same length") => {}
            (3, other) => bad.push(format!("root: expected Error::Mismatch naming rank 1, got {other:?}")),
            // A root that found the mismatch itself (its user-space
            // aggregator saw rank 1's contribution) tells the contributors at
            // once, naming rank 1's length.
            (_, Err(Error::Aborted { rank: 3, reason: AbortReason::Mismatch, detail, .. })) => {
                if !detail.contains("rank 1") {
                    bad.push(format!("rank {rank}: the root's abort does not name rank 1: {detail}"));
                }
            }
            (_, Err(Error::Timeout { what, .. })) => {
                if !(what.contains("unanswered") && what.contains("chunks 0")) {
                    bad.push(format!("rank {rank}: timeout does not name the missing chunks: {what}"));
                }
            }
            // The aggregator (either path) keeps whichever length claimed a
            // slot first and drops the other: PENDING answers then name the
            // ranks whose contributions it dropped (rank 1, or, seen from
            // rank 1 when its chunk came first, the others), never the
            // asking rank itself.  A member that gave up first stops
            // retransmitting; once the sweep freed the chunk's slot, a later
            // PENDING names it too (seen 1 time in 6 runs: [0, 1] at rank 2).
            (_, Err(Error::MembersMissing { ranks, .. })) => {
                let plausible = !ranks.is_empty() && !ranks.contains(&rank) && (rank == 1 || ranks.contains(&1));
                if !plausible {
                    bad.push(format!(
                        "rank {rank}: missing ranks {ranks:?}, want 1 among them (or others seen from rank 1)"
                    ));
                }
            }
            (_, other) => bad.push(format!("rank {rank}: expected a timeout, got {other:?}")),
        }
        let want: Vec<i32> = (0..500).map(|i| i * 6).collect(); // ranks 0+1+2+3
        check_next_reduce(rank, 3, second, &want, &mut bad);
    }
    assert_clean(&format!("{test}: mismatched reduce lengths"), bad);

    // 1b. The root aborts a reduce (NaN in its own input) before rank 2 has
    //     even opened its socket, so rank 2 misses the abort datagram: its
    //     contribution, sent late, is answered with the abort by the root's
    //     aggregator side (the kernel passes contributions of the aborted
    //     call up instead of aggregating them), well before its deadline.
    //     Then an int64 reduce overflows at the root, and every rank's
    //     next reduce works.
    let (started, root_failed) = (Arc::new(Barrier::new(3)), Arc::new(Barrier::new(2)));
    let late_done = Arc::new(AtomicBool::new(false));
    let sync = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..=3u16)
        .map(|rank| {
            let (g, c, sync) = (rg.clone(), short.clone(), Arc::clone(&sync));
            let (started, root_failed) = (Arc::clone(&started), Arc::clone(&root_failed));
            let late_done = Arc::clone(&late_done);
            on_host(topo.ns(rank), move || {
                let choice = if rank == 3 { paths.aggregating() } else { paths.contributor() };
                if rank == 2 {
                    root_failed.wait();
                }
                let mut col = Collective::new(&g, rank, choice, c).expect("collective");
                if rank != 2 {
                    // Loading the kernel path takes a while: time the call
                    // from when the root can announce.
                    started.wait();
                }
                let mut data: Vec<f32> = (0..3000).map(|i| i as f32).collect();
                if rank == 3 {
                    data[2500] = f32::NAN;
                }
                let t0 = Instant::now();
                let first = col.reduce(&data, AggOp::Sum, 3).map(|_| ());
                let took = t0.elapsed();
                match rank {
                    3 => {
                        root_failed.wait();
                        let until = Instant::now() + Duration::from_secs(4);
                        while !late_done.load(Ordering::Relaxed) && Instant::now() < until {
                            let _ = col.serve_for(Duration::from_millis(20));
                        }
                    }
                    2 => late_done.store(true, Ordering::Relaxed),
                    _ => {}
                }
                sync.wait();
                // An int64 sum that overflows at the root: the contributors'
                // part is done (acknowledged) before the root decodes the
                // result, so only the root fails, naming the element.
                let big: Vec<i64> = (0..5000).map(|i| if i == 4321 { i64::MAX / 3 } else { i }).collect();
                let t1 = Instant::now();
                let ovf = col.reduce(&big, AggOp::Sum, 3).map(|_| ());
                let ovf_took = t1.elapsed();
                if rank == 3 {
                    let _ = col.serve_for(Duration::from_millis(300));
                }
                sync.wait();
                let data: Vec<i32> = (0..700).map(|i| i - i32::from(rank)).collect();
                let second = col.reduce(&data, AggOp::Sum, 3);
                if rank == 3 {
                    let _ = col.serve_for(Duration::from_millis(200));
                }
                (rank, first, took, (ovf, ovf_took), second)
            })
        })
        .collect();
    let mut bad = Vec::new();
    for h in handles {
        let (rank, first, took, (ovf, ovf_took), second) = h.join().expect("member thread");
        match (rank, &first) {
            (3, Err(Error::NonFinite { index: 2500 })) => {}
            (3, other) => bad.push(format!("root: expected NonFinite at element 2500, got {other:?}")),
            (_, Err(Error::Aborted { rank: 3, reason: AbortReason::NonFinite, .. })) => {
                if took > short.deadline / 2 {
                    bad.push(format!("rank {rank}: the root's abort came after {took:?}, not within a round trip"));
                }
            }
            (_, other) => bad.push(format!("rank {rank}: expected the root's NonFinite abort, got {other:?}")),
        }
        match (rank, &ovf) {
            (3, Err(Error::Overflow { detail, .. })) if detail.contains("element 4321") => {}
            (3, other) => bad.push(format!("root: expected an overflow naming element 4321, got {other:?}")),
            (_, Ok(())) if ovf_took < short.deadline / 2 => {}
            (_, other) => bad.push(format!("rank {rank}: overflowing reduce: {other:?} after {ovf_took:?}")),
        }
        let want: Vec<i32> = (0..700).map(|i| 4 * i - 6).collect(); // ranks 0+1+2+3
        check_next_reduce(rank, 3, second, &want, &mut bad);
    }
    assert_clean(&format!("{test}: a late contributor of a reduce its root aborted"), bad);

    // 2. Allreduce through rank 3 with: mismatched lengths, NaN on rank 1,
    //    packets of an outsider (host 4) claiming rank 0, an i32 SUM that
    //    overflows int32, an f32 SUM with a fixed scale whose sum overflows
    //    int32 (redone exactly), and a correct call after each failure.
    let ag = topo.group(ALLREDUCE_JOB, 3, Some(3));
    let agg = AggHost::start(&topo, &ag, paths.aggregating());
    let outsider_stop = Arc::new(AtomicBool::new(false));
    let agg_addr = SocketAddrV4::new(cluster::host_addr(3), ag.members[3].port);
    let outsider = {
        let s = Arc::clone(&outsider_stop);
        on_host(topo.ns(4), move || {
            // Bound to the group's port on a host that is not a member.
            let sock = UdpSocket::bind(SocketAddrV4::new(cluster::host_addr(4), agg_addr.port())).expect("bind");
            let mut sent = 0u64;
            while !s.load(Ordering::Relaxed) {
                for op_id in 0..32u32 {
                    let h = Header {
                        version: VERSION,
                        msg_type: T_AGG,
                        flags: F_ALLREDUCE | F_LAST_FRAG,
                        job_id: ALLREDUCE_JOB,
                        src_rank: 0,
                        mask_base: 0,
                        dst_mask: 0b111,
                        msg_seq: op_id,
                        frag_off: 0,
                        msg_len: 4,
                        payload_len: 4,
                        agg_op: OP_SUM,
                        dtype: DT_I32,
                    };
                    let mut d = h.to_bytes().to_vec();
                    d.extend_from_slice(&1_000_000i32.to_be_bytes());
                    if sock.send_to(&d, agg_addr).is_ok() {
                        sent += 1;
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            sent
        })
    };
    let sync = Arc::new(Barrier::new(3));
    let handles: Vec<_> = (0..3u16)
        .map(|rank| {
            let (g, c, sync) = (ag.clone(), short.clone(), Arc::clone(&sync));
            on_host(topo.ns(rank), move || {
                let mut col = Collective::new(&g, rank, paths.contributor(), c).expect("collective");
                let r = i32::from(rank);
                let mut out: Vec<String> = Vec::new();
                // 0. every member has started (and synced its first call
                //    with the aggregator) before the mismatch below, so
                //    that every member meets the abort in step a: a member
                //    that starts after the abort is told the aborted call
                //    and, on the user path, gets the abort when it
                //    contributes; on the kernel path its contribution takes
                //    a kernel slot and it fails by its deadline instead
                out.push(format!("{:?}", col.allreduce(&[1i32], AggOp::Sum)));
                sync.wait();
                // a. mismatched lengths
                let len = if rank == 2 { 10 } else { 11 };
                out.push(format!("{:?}", col.allreduce(&vec![1i32; len], AggOp::Sum).map(|v| v.len())));
                sync.wait();
                // b. one element (1 + r) summed: 6 (the outsider's 1e6 must not count)
                out.push(format!("{:?}", col.allreduce(&[1 + r], AggOp::Sum)));
                // c. NaN on rank 1 at index 17
                let mut f = vec![0.5f32; 40];
                if rank == 1 {
                    f[17] = f32::NAN;
                }
                out.push(match col.allreduce(&f, AggOp::Sum) {
                    Err(Error::NonFinite { index }) => format!("NonFinite {index}"),
                    Err(Error::Timeout { .. }) => "Timeout".into(),
                    Err(Error::MembersMissing { ranks, .. }) => format!("MembersMissing {ranks:?}"),
                    Err(Error::Aborted { rank, reason, .. }) => format!("Aborted by {rank}: {reason:?}"),
                    other => format!("{other:?}"),
                });
                sync.wait();
                // d. recovery: an f32 SUM of 3 x 0.5
                out.push(format!("{:?}", col.allreduce(&[0.5f32], AggOp::Sum)));
                // e. i32 SUM overflowing int32 at element 2 (3 x 1e9)
                let big = [1, 2, 1_000_000_000, 4];
                out.push(match col.allreduce(&big, AggOp::Sum) {
                    Err(Error::Overflow { detail, .. }) => format!("Overflow {detail}"),
                    other => format!("{other:?}"),
                });
                // f. i32 AVG of the same: the sum overflows, the average
                //    does not (exact through the redo)
                out.push(format!("{:?}", col.allreduce(&big, AggOp::Avg)));
                // g. rank 2 runs another kccl version: its contribution to
                //    the next call has op 9, which the aggregator does not
                //    know; the others fail at once with that cause (not at
                //    their deadline), and rank 2 is told too.  (The call's
                //    op id: every member synced at call 0 with the fresh
                //    aggregator, so it is the number of calls made, times 4.)
                let stats = col.stats();
                if rank == 2 {
                    let call_op = stats.calls as u32 * 4;
                    let port = g.members[2].port;
                    drop(col);
                    let sock = UdpSocket::bind(SocketAddrV4::new(cluster::host_addr(2), port)).expect("bind rank 2");
                    sock.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
                    sync.wait();
                    let h = Header {
                        version: VERSION,
                        msg_type: T_AGG,
                        flags: F_ALLREDUCE | F_LAST_FRAG,
                        job_id: ALLREDUCE_JOB,
                        src_rank: 2,
                        mask_base: 0,
                        dst_mask: 0b111,
                        msg_seq: call_op,
                        frag_off: 0,
                        msg_len: 4,
                        payload_len: 4,
                        agg_op: 9,
                        dtype: DT_I32,
                    };
                    let mut d = h.to_bytes().to_vec();
                    d.extend_from_slice(&3i32.to_be_bytes());
                    let mut got = String::from("no abort in 10 tries");
                    let mut buf = [0u8; 2048];
                    'tries: for _ in 0..10 {
                        sock.send_to(&d, agg_addr).expect("send");
                        while let Ok((n, _)) = sock.recv_from(&mut buf) {
                            if let Ok((a, p)) = Header::decode(&buf[..n]) {
                                if a.msg_type == T_AGG_ABORT {
                                    let text = abort::parse(p).map(|(_, t)| t).unwrap_or_default();
                                    got = format!("abort from {}: {text} (op {})", a.src_rank, a.msg_seq);
                                    break 'tries;
                                }
                            }
                        }
                    }
                    out.push(got);
                } else {
                    sync.wait();
                    out.push(match col.allreduce(&[1 + r], AggOp::Sum) {
                        Err(Error::Aborted { rank, reason, detail, .. }) => {
                            format!("Aborted by {rank}: {reason:?}: {detail}")
                        }
                        other => format!("{other:?}"),
                    });
                }
                (rank, out, stats)
            })
        })
        .collect();
    let mut results = BTreeMap::new();
    for h in handles {
        let (rank, out, stats) = h.join().expect("member thread");
        results.insert(rank, (out, stats));
    }
    outsider_stop.store(true, Ordering::Relaxed);
    let sent = outsider.join().expect("outsider thread");
    let AggOutcome { user: astats, mismatches, kernel } = agg.finish();
    let mut bad = Vec::new();
    for (rank, (out, stats)) in &results {
        // The aggregator's PENDING answers (both paths) name the member
        // whose contribution is missing (mismatching).
        let expect: [&str; 8] = [
            "Ok([3])",
            // (the aggregator aborts the call: every member gets the
            // mismatch from it, naming both lengths; on the kernel path
            // xdp_agg passes the mismatching contribution up flagged)
            "Err(",
            "Ok([6])",
            // (rank 1 finds the NaN before it sends anything and tells the
            // others at once)
            if *rank == 1 { "NonFinite 17" } else { "Aborted by 1: NonFinite" },
            "Ok([1.5])",
            "Overflow element 2 sums to 3000000000",
            "Ok([1, 2, 1000000000, 4])",
            if *rank == 2 { "abort from 3: rank 2 sent op 9" } else { "Aborted by 3: Unsupported: rank 2 sent op 9" },
        ];
        if out.len() != expect.len() {
            bad.push(format!("rank {rank}: {} steps ran", out.len()));
        }
        for (i, (got, want)) in out.iter().zip(expect).enumerate() {
            // Step a: the aggregator finds the members disagree on the
            // chunk and aborts the call for all of them at once.
            let step0_ok = i != 1
                || (got.starts_with("Err(Aborted")
                    && got.contains("reason: Mismatch")
                    && got.contains("40 bytes")
                    && got.contains("44 bytes"));
            if !got.starts_with(want) || !step0_ok {
                bad.push(format!("rank {rank}: step {i}: got {got}, expected {want}..."));
            }
        }
        if stats.redo_ops == 0 {
            bad.push(format!("rank {rank}: no int64 redo ran: {stats:?}"));
        }
    }
    // The kernel counts what it drops itself; user space also names ranks.
    let reported = mismatches.iter().any(|m| m.contains("44 bytes") || m.contains("40 bytes"));
    if astats.mismatch + kernel.mismatch == 0 || (!paths.kernel() && !reported) {
        bad.push(format!("aggregator: mismatched lengths not counted/reported: {astats:?} {kernel:?} {mismatches:?}"));
    }
    if sent == 0 || astats.not_member + kernel.not_member == 0 {
        bad.push(format!(
            "outsider sent {sent} packets; not_member: user {} kernel {}",
            astats.not_member, kernel.not_member
        ));
    }
    // Rank 1's abort of the NaN call reached the aggregator too (which then
    // frees the slots the others' contributions claimed, if they came first:
    // a race here, so checked by the fixtures and unit tests instead).
    if astats.aborts == 0 {
        bad.push(format!("aggregator: the NaN call's abort did not reach it: {astats:?}"));
    }
    // Both paths: rank 2's unknown op reached user space and was counted.
    if astats.unsupported == 0 {
        bad.push(format!("aggregator: rank 2's op 9 not counted as unsupported: {astats:?}"));
    }
    // Both paths: the redo's USER_ONLY packets reach the user-space aggregator.
    if astats.user_only == 0 {
        bad.push(format!("the redo did not reach the aggregator with USER_ONLY: {astats:?}"));
    }
    println!("{test}: aggregator {astats:?}; kernel {kernel:?}; outsider sent {sent}");
    assert_clean(&format!("{test}: bad allreduce input"), bad);
}

#[test]
fn c_user_path_bad_input() {
    bad_input("c_user_path_bad_input", Paths::User);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn c_kernel_path_bad_input() {
    bad_input("c_kernel_path_bad_input", Paths::Kernel);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn c_kernel_aggregator_only_bad_input() {
    bad_input("c_kernel_aggregator_only_bad_input", Paths::KernelAggregatorOnly);
}

/// f32 SUM with a fixed scale whose int32 sum overflows is redone exactly in
/// int64 (USER_ONLY) and the result is right; an element that does not fit
/// the scale at all is refused before sending.
fn fixed_scale_redo(test: &str, paths: Paths) {
    if !root_or_skip(test, "network namespaces and BPF") {
        return;
    }
    let topo = Topo::up("agg-fix", 4);
    let ag = topo.group(ALLREDUCE_JOB, 3, Some(3));
    let agg = AggHost::start(&topo, &ag, paths.aggregating());
    let fixed = AggConfig { quant: Quant::Fixed(1e8), ..cfg() };
    let handles: Vec<_> = (0..3u16)
        .map(|rank| {
            let (g, c) = (ag.clone(), fixed.clone());
            on_host(topo.ns(rank), move || {
                let mut col = Collective::new(&g, rank, paths.contributor(), c).expect("collective");
                // 3 x 15 = 45: 4.5e9 does not fit int32: chunk 0 overflows,
                // chunk 1 (elements 358..) does not.
                let mut d = vec![0.125f32; 400];
                d[0] = 15.0;
                d[1] = -15.0;
                let sum = col.allreduce(&d, AggOp::Sum);
                let avg = col.allreduce(&d, AggOp::Avg);
                let refused = col.allreduce(&[30.0f32], AggOp::Sum);
                (sum, avg, refused, col.stats())
            })
        })
        .collect();
    let mut bad = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let (sum, avg, refused, stats) = h.join().expect("member thread");
        match sum {
            Ok(v) => {
                let want = |i: usize| match i {
                    0 => 45.0,
                    1 => -45.0,
                    _ => 0.375,
                };
                for (i, x) in v.iter().enumerate() {
                    if (f64::from(*x) - want(i)).abs() > 3.0 / 2e8 + ulp(*x) {
                        bad.push(format!("rank {rank}: sum element {i} = {x}"));
                    }
                }
            }
            Err(e) => bad.push(format!("rank {rank}: sum: {e}")),
        }
        match avg {
            Ok(v) if (v[0] - 15.0).abs() < 1e-6 && (v[2] - 0.125).abs() < 1e-7 => {}
            other => bad.push(format!("rank {rank}: avg: {other:?}")),
        }
        match refused {
            Err(Error::Overflow { what, detail }) if what.contains("element 0") && detail.contains("Quant::Auto") => {}
            other => bad.push(format!("rank {rank}: 30.0 * 1e8 must be refused before sending: {other:?}")),
        }
        if stats.redo_ops != 2 || stats.contrib.overflow_chunks != 2 {
            bad.push(format!("rank {rank}: expected 2 redos of 1 chunk each: {stats:?}"));
        }
    }
    let AggOutcome { user: astats, kernel, .. } = agg.finish();
    // Who saturated: user space on the user path, the kernel on the other.
    if astats.overflow + kernel.overflow != 2 {
        bad.push(format!("aggregator: {astats:?} {kernel:?}: expected 2 overflowed chunks"));
    }
    assert_clean(test, bad);
}

#[test]
fn d_user_path_fixed_scale_redo() {
    fixed_scale_redo("d_user_path_fixed_scale_redo", Paths::User);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn d_kernel_path_fixed_scale_redo() {
    fixed_scale_redo("d_kernel_path_fixed_scale_redo", Paths::Kernel);
}

#[cfg(feature = "kernel-agg")]
#[test]
fn d_kernel_aggregator_only_fixed_scale_redo() {
    fixed_scale_redo("d_kernel_aggregator_only_fixed_scale_redo", Paths::KernelAggregatorOnly);
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Throughput probe (ignored; timing only): allreduce of f32 SUM.
/// KCCL_PERF_LEN (elements), KCCL_PERF_SENDERS, KCCL_PERF_WINDOW, KCCL_PERF_RTO_MS, KCCL_PERF_REPS.
/// `cargo test --release -p kccl-testbed --test topology_aggregation z_perf -- --ignored --nocapture`
#[test]
#[ignore]
fn z_perf_allreduce_user_path() {
    if !root_or_skip("z_perf_allreduce_user_path", "network namespaces and BPF") {
        return;
    }
    let len: usize = env_or("KCCL_PERF_LEN", 4_000_000);
    let n: u16 = env_or("KCCL_PERF_SENDERS", 2);
    let reps: usize = env_or("KCCL_PERF_REPS", 3);
    let window: usize = env_or("KCCL_PERF_WINDOW", AggConfig::default().window);
    let rto = Duration::from_millis(env_or("KCCL_PERF_RTO_MS", AggConfig::default().rto.as_millis() as u64));
    let topo = Topo::up("agg-perf", n as usize + 1);
    let ag = topo.group(ALLREDUCE_JOB, n, Some(n));
    let agg = AggHost::start(&topo, &ag, PathChoice::User);
    let barrier = Arc::new(Barrier::new(n as usize));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (g, b) = (ag.clone(), Arc::clone(&barrier));
            on_host(topo.ns(rank), move || {
                let c = AggConfig { window, rto, ..cfg() };
                let mut col = Collective::new(&g, rank, PathChoice::User, c).expect("collective");
                let data: Vec<f32> = (0..len).map(|i| (i % 1000) as f32 * 0.001 + f32::from(rank)).collect();
                let mut times = Vec::new();
                for _ in 0..reps {
                    b.wait();
                    let t = Instant::now();
                    let r = col.allreduce(&data, AggOp::Sum).expect("allreduce");
                    times.push(t.elapsed());
                    assert_eq!(r.len(), len);
                }
                (rank, times, col.stats())
            })
        })
        .collect();
    for h in handles {
        let (rank, times, s) = h.join().expect("member");
        let best = times.iter().min().copied().unwrap_or_default();
        println!(
            "rank {rank}: {len} f32 x{n} window {window} rto {rto:?}: best {best:?} ({:.0} MB/s), all {times:?}; {:?}",
            len as f64 * 4.0 / best.as_secs_f64() / 1e6,
            s.contrib
        );
    }
    println!("aggregator: {:?}", agg.finish().user);
}
