//! Aggregation benchmarks (`kccl bench reduce|allreduce|cpu`, `kccl demo`).
//!
//! One process drives a virtual cluster: host 0 is the aggregator (the reduce
//! root, or the allreduce aggregator service), hosts 1..=senders contribute,
//! each on a thread that entered its own namespace.  All ranks start each
//! operation together (a barrier), so one operation is timed from the barrier
//! to the result being complete: at the root for reduce, at the slowest member
//! for allreduce.  Paths alternate per size in one run.
//!
//! Throughput: `elems_per_s` = vector elements x contributing senders / time,
//! i.e. element contributions aggregated per second (the paper's "ops/s").
//! Before any timing, one untimed operation per path and size is checked
//! element by element against a reference computed independently from every
//! rank's generator.
//!
//! The aggregator CPU benchmark (`kccl bench cpu`) is in [`super::cpu`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::bench::percentile;
use crate::bench::wire::{self, HostWire, WireBytes};
use crate::cluster::{ClusterGuard, ClusterSpec};
use crate::error::{Error, Result};
use kccl::agg::{quant, AggConfig, AggOp, Aggregator, AllreduceMode, Collective, Element};
use kccl::group::Group;
use kccl::netns;
use kccl::transport::{thread_cpu_time, Path, PathChoice};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Reduce,
    Allreduce,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Reduce => "reduce",
            Kind::Allreduce => "allreduce",
        })
    }
}

/// One result row of `kccl bench reduce|allreduce` (JSON record).
#[derive(Debug, Clone, serde::Serialize)]
pub struct AggRecord {
    pub kind: Kind,
    pub path: Path,
    /// The op's wire name in lower case ("sum", ...).
    pub op: String,
    pub dtype: &'static str,
    /// Ranks whose data crosses the network (the reduce root's own data is
    /// folded in by its runtime and not counted).
    pub senders: usize,
    /// Bytes of each rank's vector.
    pub bytes: usize,
    pub elems: usize,
    pub iters: usize,
    /// Median of elements x senders / seconds.
    pub elems_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// The slowest timed operation (outliers: the suite's worst ratio).
    pub max_ms: f64,
    /// Aggregator-side thread CPU per operation (the root's reduce call, or
    /// for allreduce the aggregator service thread).
    pub aggregator_cpu_ms: f64,
    /// Mean CPU per operation of one sender thread.
    pub sender_cpu_ms: f64,
    /// Median time of the root's work on each result inside the timed
    /// operation (agg-gemm's GEMM); None without such work.
    pub root_work_p50_ms: Option<f64>,
    /// Loss recovery during the timed operations (where time goes that the
    /// wire does not explain).
    pub recovery: Recovery,
    /// Bytes on each host's link per timed operation, host 0 first, next
    /// to the byte model (empty without timed operations).
    pub wire: Vec<HostWire>,
}

/// Loss-recovery counters per timed operation: the senders' (summed over
/// senders) and, on the kernel path, xdp_agg's at the root.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Recovery {
    /// Contribution datagrams (first sends and retransmissions).
    pub datagrams: f64,
    pub retransmits: f64,
    /// Retransmissions because later chunks were answered.
    pub fast_retransmits: f64,
    /// Sender passes in which a chunk timed out.
    pub stalls: f64,
    pub window_cuts: f64,
    /// The senders' congestion windows (chunks) after the last timed
    /// operation, averaged over the ranks that sent: a window far below
    /// AggConfig::window_chunks means recovery, not the aggregator, set
    /// the pace.
    pub window_end: f64,
    /// xdp_agg: results the ring buffer had no room for.
    pub ring_full: f64,
    /// xdp_agg: contributions that found their slot held by another chunk.
    pub busy: f64,
    /// xdp_agg: contributions waiting for a slot whose answer is not proven held.
    pub held: f64,
    /// xdp_agg: contributions already counted (duplicates).
    pub dup: f64,
}

/// Counter snapshot of one rank, taken before the first and after the last
/// timed operation.
#[derive(Clone, Copy, Default)]
struct Counters {
    contrib: kccl::agg::member::ContribStats,
    kernel: Option<kccl::kernel_agg::AggStats>,
}

impl Counters {
    fn take(c: &Collective) -> Result<Counters> {
        let kernel = c
            .kernel_stats()
            .map_err(|e| Error::Host { what: "reading xdp_agg's counters".into(), detail: e.to_string() })?;
        Ok(Counters { contrib: c.stats().contrib, kernel })
    }
}

impl Recovery {
    /// Sums the (before, after) snapshots of every rank, per operation.
    fn from_snapshots(snaps: &[(Counters, Counters)], iters: usize) -> Recovery {
        let n = iters.max(1) as f64;
        let mut r = Recovery::default();
        // Ranks that sent (the root of a reduce has no window).
        let windows: Vec<f64> = snaps.iter().map(|(_, a)| a.contrib.window_last as f64).filter(|&w| w > 0.0).collect();
        r.window_end = windows.iter().sum::<f64>() / windows.len().max(1) as f64;
        for (b, a) in snaps {
            let (cb, ca) = (&b.contrib, &a.contrib);
            r.datagrams += (ca.datagrams - cb.datagrams) as f64 / n;
            r.retransmits += (ca.retransmits - cb.retransmits) as f64 / n;
            r.fast_retransmits += (ca.fast_retransmits - cb.fast_retransmits) as f64 / n;
            r.stalls += (ca.stalls - cb.stalls) as f64 / n;
            r.window_cuts += (ca.window_cuts - cb.window_cuts) as f64 / n;
            if let (Some(kb), Some(ka)) = (&b.kernel, &a.kernel) {
                let d = ka.delta(kb);
                r.ring_full += d.ring_full as f64 / n;
                r.busy += d.busy as f64 / n;
                r.held += d.held as f64 / n;
                r.dup += d.dup as f64 / n;
            }
        }
        r
    }
}

/// One row of `kccl bench cpu`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CpuRecord {
    pub path: Path,
    pub op: &'static str,
    pub senders: usize,
    pub bytes: usize,
    /// Offered load: bytes per second all senders together try to send.
    pub offered_mb_s: f64,
    /// Load actually aggregated (bytes of completed operations per second).
    pub achieved_mb_s: f64,
    /// Aggregator CPU (NAPI thread + aggregator thread) / wall time, percent
    /// of one CPU.
    pub cpu_pct: f64,
    pub napi_cpu_pct: f64,
    pub thread_cpu_pct: f64,
    pub ops: usize,
}

/// Deterministic per-rank data: small values so that sums of up to 64 ranks
/// fit any type; the mix of signs exercises MAX/MIN.
pub fn rank_value(rank: u16, i: usize) -> i32 {
    let x = (i as u64).wrapping_mul(2_654_435_761).wrapping_add(rank as u64 * 40_503) % 2001;
    x as i32 - 1000
}

pub fn rank_data(rank: u16, elems: usize) -> Vec<i32> {
    (0..elems).map(|i| rank_value(rank, i)).collect()
}

/// Reference result of `op` over `ranks` for element i.
fn reference(op: AggOp, ranks: &[u16], i: usize) -> i32 {
    let vals = ranks.iter().map(|&r| rank_value(r, i));
    match op {
        AggOp::Sum => vals.sum(),
        AggOp::Count => vals.filter(|&v| v != 0).count() as i32,
        AggOp::Max => vals.max().unwrap_or(0),
        AggOp::Min => vals.min().unwrap_or(0),
        AggOp::Avg => vals.sum::<i32>() / ranks.len().max(1) as i32,
    }
}

pub(super) fn check(kind: Kind, op: AggOp, ranks: &[u16], got: &[i32], elems: usize, who: u16) -> Result<()> {
    if got.len() != elems {
        return Err(Error::wrong(kind, format!("rank {who} got {} elements, expected {elems}", got.len())));
    }
    if let Some(i) = (0..elems).find(|&i| got[i] != reference(op, ranks, i)) {
        return Err(Error::wrong(
            kind,
            format!(
                "rank {who} element {i} is {}, expected {} ({op:?} over ranks {ranks:?})",
                got[i],
                reference(op, ranks, i)
            ),
        ));
    }
    Ok(())
}

/// Gradient-like float32 data of `rank`: `rank_value / 1e5`, in (-0.01, 0.01)
/// with the magnitudes of every block spread over two decades.
pub fn rank_value_f32(rank: u16, i: usize) -> f32 {
    rank_value(rank, i) as f32 * 1e-5
}

/// Half an ulp of a float32 is the rounding of the result; this is one ulp.
fn ulp(x: f32) -> f64 {
    let a = x.abs();
    if !a.is_finite() {
        return f64::INFINITY;
    }
    f64::from(f32::from_bits(a.to_bits() + 1) - a)
}

/// The automatic scale of one block (elements `r`) of the data of
/// `quantized` ranks with headroom `h` (docs/AGGREGATION.md).
fn block_scale(quantized: &[u16], r: std::ops::Range<usize>, h: u32) -> f64 {
    let e = quantized
        .iter()
        .flat_map(|&q| r.clone().map(move |i| quant::exponent(rank_value_f32(q, i))))
        .max()
        .unwrap_or(quant::E_ZERO);
    quant::auto_scale(e, h)
}

/// Checks a float32 SUM against an f64 reference within the bound of
/// docs/AGGREGATION.md ("Error bound"): per block of `chunk / 4` elements the
/// scale is `s = 2^(30 - e - h)` (`e`: largest exponent of the quantized
/// members' block; `h`: headroom, allreduce only), and
/// `|got - exact| <= q / (2s) + ulp(got) / 2` for `q` quantized
/// contributions, plus the f64 rounding of the reference.  Reduce: the root
/// (`ranks[0]`) is not quantized.
fn check_f32_sum(kind: Kind, ranks: &[u16], got: &[f32], elems: usize, who: u16, chunk: usize) -> Result<()> {
    if got.len() != elems {
        return Err(Error::wrong(kind, format!("rank {who} got {} elements, expected {elems}", got.len())));
    }
    let quantized: &[u16] = match kind {
        Kind::Reduce => &ranks[1.min(ranks.len())..],
        Kind::Allreduce => ranks,
    };
    let h = if kind == Kind::Allreduce { quant::headroom(quantized.len()) } else { 0 };
    let block = (chunk / 4).max(1);
    let n = ranks.len() as f64;
    for start in (0..elems).step_by(block) {
        let r = start..(start + block).min(elems);
        let s = block_scale(quantized, r.clone(), h);
        for i in r {
            let (exact, abs) = ranks.iter().fold((0f64, 0f64), |(x, a), &q| {
                let v = f64::from(rank_value_f32(q, i));
                (x + v, a + v.abs())
            });
            let tol = quantized.len() as f64 / (2.0 * s) + ulp(got[i]) / 2.0 + abs * n * f64::EPSILON;
            let err = (f64::from(got[i]) - exact).abs();
            if err.is_nan() || err > tol {
                return Err(Error::wrong(
                    format!("{kind} (float32 sum)"),
                    format!(
                        "rank {who} element {i} is {:e}, expected {exact:e} within {tol:.3e} \
                     (the quantization bound of docs/AGGREGATION.md; ranks {ranks:?})",
                        got[i]
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Element types of the aggregation benchmarks: each rank's data and the
/// check of a result against a reference computed from every rank's
/// generator.
pub trait BenchElem: Element {
    fn data(rank: u16, elems: usize) -> Vec<Self>;
    /// `chunk`: the collective's chunk bytes (float32 scales are per chunk).
    fn check(kind: Kind, op: AggOp, ranks: &[u16], got: &[Self], who: u16, chunk: usize) -> Result<()>;
    /// Makes one result element wrong (the suite's test of its checks).
    fn corrupt(v: &mut Self);
}

impl BenchElem for i32 {
    fn data(rank: u16, elems: usize) -> Vec<i32> {
        rank_data(rank, elems)
    }
    fn check(kind: Kind, op: AggOp, ranks: &[u16], got: &[i32], who: u16, _chunk: usize) -> Result<()> {
        check(kind, op, ranks, got, got.len(), who)
    }
    fn corrupt(v: &mut i32) {
        *v = v.wrapping_add(1);
    }
}

impl BenchElem for f32 {
    fn data(rank: u16, elems: usize) -> Vec<f32> {
        (0..elems).map(|i| rank_value_f32(rank, i)).collect()
    }
    fn check(kind: Kind, op: AggOp, ranks: &[u16], got: &[f32], who: u16, chunk: usize) -> Result<()> {
        if op != AggOp::Sum {
            return Err(Error::setting(
                format!("float32 {kind} benchmark"),
                format!("only sum is checked, not {op:?}"),
            ));
        }
        check_f32_sum(kind, ranks, got, got.len(), who, chunk)
    }
    fn corrupt(v: &mut f32) {
        *v += 1.0;
    }
}

/// Work the reduce root does on each result inside the timed operation
/// (agg-gemm multiplies the reduced matrix).  The flag asks it to check its
/// own output against its reference (the checked, untimed operation).
pub type RootWork<'a, T> = &'a (dyn Fn(&[T], bool) -> Result<()> + Sync);

/// A barrier that a failing rank can break, so the others return an error
/// instead of waiting forever for it.
pub(super) struct Gate {
    parties: usize,
    state: Mutex<(usize, u64, bool)>, // (arrived, generation, broken)
    cv: std::sync::Condvar,
}

impl Gate {
    pub(super) fn new(parties: usize) -> Gate {
        Gate { parties, state: Mutex::new((0, 0, false)), cv: std::sync::Condvar::new() }
    }

    pub(super) fn wait(&self) -> Result<()> {
        let mut g = self.state.lock().map_err(|_| poisoned())?;
        if g.2 {
            return Err(broken());
        }
        let gen = g.1;
        g.0 += 1;
        if g.0 == self.parties {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while g.1 == gen && !g.2 {
            g = self.cv.wait(g).map_err(|_| poisoned())?;
        }
        if g.1 == gen {
            return Err(broken());
        }
        Ok(())
    }

    pub(super) fn is_broken(&self) -> bool {
        self.state.lock().map(|g| g.2).unwrap_or(true)
    }

    pub(super) fn break_all(&self) {
        if let Ok(mut g) = self.state.lock() {
            g.2 = true;
        }
        self.cv.notify_all();
    }
}

fn broken() -> Error {
    Error::OtherRankFailed
}

fn is_broken(e: &Error) -> bool {
    matches!(e, Error::OtherRankFailed)
}

/// Keeps the error that caused a run to fail: the first that is not just
/// "another rank failed" (the ranks that gave up waiting on the gate).
fn keep_cause(first: &mut Option<Error>, e: Error) {
    if first.as_ref().is_none_or(is_broken) {
        *first = Some(e);
    }
}

/// Runs `f`, breaking `gate` if it fails so that no other rank waits forever.
pub(super) fn guarded<T>(gate: &Gate, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let r = f();
    if r.is_err() {
        gate.break_all();
    }
    r
}

/// A cluster with the aggregator on host 0 and `senders` contributing hosts.
pub struct AggHarness {
    guard: Option<ClusterGuard>,
    group: Group,
    /// Test of the result checks: the first checking rank corrupts one
    /// element of its checked result, so every measurement fails.
    pub corrupt_results: bool,
    /// Print each row's loss-recovery counters (`kccl bench`; the demo
    /// keeps to the figures a newcomer reads).
    pub show_recovery: bool,
}

impl AggHarness {
    pub fn new(name: &str, senders: usize) -> Result<AggHarness> {
        AggHarness::on_cluster(&ClusterSpec::new(name, senders + 1))
    }

    /// Creates the cluster `spec` describes (host 0 aggregates).
    pub fn on_cluster(spec: &ClusterSpec) -> Result<AggHarness> {
        let guard = ClusterGuard::up(spec)?;
        let group = guard.cluster.group.clone();
        Ok(AggHarness { guard: Some(guard), group, corrupt_results: false, show_recovery: false })
    }

    /// An existing group (its rank 0 aggregates), e.g. loopback members.
    pub fn on_group(group: Group) -> AggHarness {
        AggHarness { guard: None, group, corrupt_results: false, show_recovery: false }
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Runs `kind` with `op` over int32 vectors of each size in `sizes`
    /// (bytes) on each path in `paths`: one checked operation, then `iters`
    /// timed ones.  Paths take turns per size.
    #[allow(clippy::too_many_arguments)]
    pub fn measure(
        &self,
        kind: Kind,
        op: AggOp,
        senders: usize,
        paths: &[PathChoice],
        sizes: &[usize],
        iters: usize,
        cfg: &AggConfig,
    ) -> Result<Vec<AggRecord>> {
        self.measure_with::<i32>(kind, op, senders, paths, sizes, iters, cfg, None)
    }

    /// [`AggHarness::measure`] for element type `T` (i32, or f32 through the
    /// quantization of the runtime), with optional `root_work` that a reduce
    /// root does on each result inside the timed operation.
    #[allow(clippy::too_many_arguments)]
    pub fn measure_with<T: BenchElem>(
        &self,
        kind: Kind,
        op: AggOp,
        senders: usize,
        paths: &[PathChoice],
        sizes: &[usize],
        iters: usize,
        cfg: &AggConfig,
        root_work: Option<RootWork<'_, T>>,
    ) -> Result<Vec<AggRecord>> {
        let mut out = Vec::new();
        for &bytes in sizes {
            for &p in paths {
                let r = self.run_one::<T>(kind, op, senders, p, bytes / 4, iters, cfg, root_work)?;
                print_agg_row(&r);
                if self.show_recovery {
                    print_recovery_row(&r.recovery);
                    print_wire_row(&r.wire);
                }
                out.push(r);
            }
            print_agg_ratio(&out[out.len().saturating_sub(paths.len())..]);
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_one<T: BenchElem>(
        &self,
        kind: Kind,
        op: AggOp,
        senders: usize,
        choice: PathChoice,
        elems: usize,
        iters: usize,
        cfg: &AggConfig,
        root_work: Option<RootWork<'_, T>>,
    ) -> Result<AggRecord> {
        // Only a reduce root does work on its result.
        let root_work = root_work.filter(|_| kind == Kind::Reduce);
        let corrupt = self.corrupt_results;
        // Host 0 is the reduce root, or the allreduce aggregator service (a
        // reduce root must not be the group's allreduce aggregator).  A
        // sharded allreduce has no service: host 0 stays named as the
        // aggregator, so that it is no member, and idles; the senders
        // combine a shard each.
        let mut group = self.group.clone();
        let agg_rank = group.members[0].rank;
        group.aggregator = (kind == Kind::Allreduce).then_some(agg_rank);
        let sharded = kind == Kind::Allreduce && cfg.allreduce == AllreduceMode::Sharded;
        let group = &group;
        let senders_ranks: Vec<u16> = group.members.iter().skip(1).take(senders).map(|m| m.rank).collect();
        if senders_ranks.len() < senders {
            return Err(Error::setting(
                format!("{senders} senders"),
                format!("the cluster has {}", senders_ranks.len()),
            ));
        }
        // Reduce: the root contributes its own data too (folded in by its
        // runtime); allreduce: the aggregator service only combines.
        let contributors: Vec<u16> = match kind {
            Kind::Reduce => std::iter::once(agg_rank).chain(senders_ranks.iter().copied()).collect(),
            Kind::Allreduce => senders_ranks.clone(),
        };
        let runners: Vec<u16> = contributors.clone();
        let barrier = Gate::new(runners.len());
        let stop = AtomicBool::new(false);
        let times: Mutex<Vec<(u16, usize, Duration, Duration)>> = Mutex::new(Vec::new());
        let work_times: Mutex<Vec<f64>> = Mutex::new(Vec::new());
        let path_used: Mutex<Option<Path>> = Mutex::new(None);
        let service_cpu: Mutex<Duration> = Mutex::new(Duration::ZERO);
        let snapshots: Mutex<Vec<(Counters, Counters)>> = Mutex::new(Vec::new());
        // Every host's byte counters (host 0 first), read by the first
        // contributor between barriers, when no operation runs, before the
        // first and after the last timed one; and the chunk size for the model.
        let hosts: Vec<u16> = std::iter::once(agg_rank).chain(senders_ranks.iter().copied()).collect();
        let wire_snaps: Mutex<Vec<Vec<WireBytes>>> = Mutex::new(Vec::new());
        let chunk_used = std::sync::atomic::AtomicUsize::new(0);
        // Calls the other ranks finished: a reduce root keeps answering
        // retransmissions (an ACK lost in the fan-out) until every one of
        // an iteration returned, before it waits at the barrier (on the user
        // path nobody else would answer them).
        let finished = std::sync::atomic::AtomicUsize::new(0);
        let others = runners.len() - 1;
        let sub = group.clone();

        std::thread::scope(|s| -> Result<()> {
            // The allreduce aggregator service.
            let service = if kind == Kind::Allreduce && !sharded {
                let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
                let (sub, stop, service_cpu) = (&sub, &stop, &service_cpu);
                let h = s.spawn(move || -> Result<()> {
                    let setup = || -> Result<Aggregator> {
                        enter_host(sub, agg_rank)?;
                        Ok(Aggregator::new(sub, agg_rank, choice, cfg.clone())?)
                    };
                    let mut a = match setup() {
                        Ok(a) => {
                            let _ = ready_tx.send(Ok(()));
                            a
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(Error::Host {
                                what: "starting the aggregator".into(),
                                detail: e.to_string(),
                            }));
                            return Err(e);
                        }
                    };
                    let c0 = thread_cpu_time();
                    let r = a.serve(stop);
                    *service_cpu.lock().map_err(|_| poisoned())? = thread_cpu_time() - c0;
                    Ok(r?)
                });
                match ready_rx.recv_timeout(Duration::from_secs(20)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(Error::Timeout { ms: 20_000, what: "the aggregator to start".into() }),
                }
                Some(h)
            } else {
                None
            };
            let mut handles = Vec::new();
            for &rank in &runners {
                let (sub, barrier, times, work_times, path_used, contributors, finished, snapshots) =
                    (&sub, &barrier, &times, &work_times, &path_used, &contributors, &finished, &snapshots);
                let (hosts, wire_snaps, chunk_used) = (&hosts, &wire_snaps, &chunk_used);
                // Between two barriers: every rank finished the operation
                // before and none started the next.
                let read_wire = move || -> Result<()> {
                    barrier.wait()?;
                    if rank == contributors[0] {
                        let w = wire::read_hosts(sub, hosts)?;
                        wire_snaps.lock().map_err(|_| poisoned())?.push(w);
                    }
                    Ok(())
                };
                handles.push(s.spawn(move || -> Result<()> {
                    guarded(barrier, || {
                        enter_host(sub, rank)?;
                        let mut c = Collective::new(sub, rank, choice, cfg.clone())?;
                        let chunk = c.chunk_bytes();
                        if rank == contributors[0] {
                            *path_used.lock().map_err(|_| poisoned())? = Some(c.path());
                            chunk_used.store(chunk, Ordering::Relaxed);
                        }
                        let data = T::data(rank, elems);
                        // The result buffer, reused from call to call
                        // (reduce_into, allreduce_into), as Gloo writes into
                        // its tensor.
                        let mut out = vec![T::default(); elems];
                        let mut before = Counters::default();
                        for it in 0..=iters {
                            if it == 1 {
                                before = Counters::take(&c)?;
                                read_wire()?;
                            }
                            barrier.wait()?;
                            let c0 = thread_cpu_time();
                            let t0 = Instant::now();
                            let mut res = match kind {
                                Kind::Reduce => {
                                    c.reduce_into(&data, op, agg_rank, &mut out)?.then(|| std::mem::take(&mut out))
                                }
                                Kind::Allreduce => {
                                    c.allreduce_into(&data, op, &mut out)?;
                                    Some(std::mem::take(&mut out))
                                }
                            };
                            // The root's work is part of the timed operation
                            // (not of the checked one: it runs after the check).
                            if let (Some(w), Some(r), true) = (root_work, &res, it > 0) {
                                let tw = Instant::now();
                                w(r, false)?;
                                work_times.lock().map_err(|_| poisoned())?.push(tw.elapsed().as_secs_f64() * 1e3);
                            }
                            let dt = t0.elapsed();
                            let cpu = thread_cpu_time() - c0;
                            if kind == Kind::Reduce && rank == agg_rank {
                                serve_until(&mut c, finished, (it + 1) * others, cfg.deadline, barrier)?;
                            } else if sharded {
                                // Every member owns a shard: it answers the
                                // others' retransmissions until all returned.
                                finished.fetch_add(1, Ordering::SeqCst);
                                serve_until(&mut c, finished, (it + 1) * (others + 1), cfg.deadline, barrier)?;
                            } else {
                                finished.fetch_add(1, Ordering::SeqCst);
                            }
                            if it == 0 {
                                // The checked, untimed operation.
                                if let Some(r) = &mut res {
                                    if corrupt && rank == contributors[0] {
                                        if let Some(v) = r.first_mut() {
                                            T::corrupt(v);
                                        }
                                    }
                                    T::check(kind, op, contributors, r, rank, chunk)?;
                                    if let Some(w) = root_work {
                                        w(r, true)?;
                                    }
                                }
                            } else {
                                times.lock().map_err(|_| poisoned())?.push((rank, it, dt, cpu));
                            }
                            if let Some(r) = res {
                                out = r;
                            }
                        }
                        if iters > 0 {
                            snapshots.lock().map_err(|_| poisoned())?.push((before, Counters::take(&c)?));
                            read_wire()?;
                        }
                        Ok(())
                    })
                }));
            }
            let mut first_err = None;
            for h in handles {
                let r = h.join().map_err(|_| Error::panicked("a benchmark rank"))?;
                if let Err(e) = r {
                    keep_cause(&mut first_err, e);
                }
            }
            stop.store(true, Ordering::Relaxed);
            if let Some(h) = service {
                let r = h.join().map_err(|_| Error::panicked("the aggregator"))?;
                if let Err(e) = r {
                    keep_cause(&mut first_err, e);
                }
            }
            match first_err {
                Some(e) => Err(e),
                None => Ok(()),
            }
        })?;

        let times = times.into_inner().map_err(|_| poisoned())?;
        let path = path_used.into_inner().map_err(|_| poisoned())?.unwrap_or(Path::User);
        // Per iteration: reduce is done when the root returns; allreduce when
        // the slowest member does.
        let mut per_iter: Vec<f64> = (1..=iters)
            .map(|it| {
                times
                    .iter()
                    .filter(|t| t.1 == it && (kind == Kind::Allreduce || t.0 == agg_rank))
                    .map(|t| t.2.as_secs_f64())
                    .fold(0.0, f64::max)
            })
            .collect();
        per_iter.sort_by(f64::total_cmp);
        let mut rates: Vec<f64> = per_iter.iter().map(|&t| (elems * senders) as f64 / t.max(1e-9)).collect();
        rates.sort_by(f64::total_cmp);
        let agg_cpu = match kind {
            Kind::Reduce => times.iter().filter(|t| t.0 == agg_rank).map(|t| t.3).sum::<Duration>(),
            Kind::Allreduce => service_cpu.into_inner().map_err(|_| poisoned())?,
        };
        let sender_cpu: Duration = times.iter().filter(|t| t.0 != agg_rank).map(|t| t.3).sum();
        let n = iters.max(1) as f64;
        Ok(AggRecord {
            kind,
            path,
            op: op.to_string().to_lowercase(),
            dtype: T::NAME,
            senders,
            bytes: elems * 4,
            elems,
            iters,
            elems_per_s: percentile(&rates, 50.0),
            p50_ms: percentile(&per_iter, 50.0) * 1e3,
            p99_ms: percentile(&per_iter, 99.0) * 1e3,
            max_ms: per_iter.last().copied().unwrap_or(f64::NAN) * 1e3,
            aggregator_cpu_ms: agg_cpu.as_secs_f64() * 1e3 / n,
            sender_cpu_ms: sender_cpu.as_secs_f64() * 1e3 / n / senders.max(1) as f64,
            root_work_p50_ms: {
                let mut w = work_times.into_inner().map_err(|_| poisoned())?;
                w.sort_by(f64::total_cmp);
                (!w.is_empty()).then(|| percentile(&w, 50.0))
            },
            recovery: Recovery::from_snapshots(&snapshots.into_inner().map_err(|_| poisoned())?, iters),
            wire: match wire_snaps.into_inner().map_err(|_| poisoned())?.as_slice() {
                [b, a] => {
                    let mode = if sharded { AllreduceMode::Sharded } else { AllreduceMode::Aggregator };
                    let m = wire::model(kind, mode, senders, elems * 4, chunk_used.into_inner());
                    wire::per_op(&hosts, b, a, iters, &m)
                }
                _ => Vec::new(),
            },
        })
    }
}

impl Drop for AggHarness {
    fn drop(&mut self) {
        self.guard.take();
    }
}

/// A reduce root answers retransmissions (of chunks whose ACK the fan-out
/// lost) until the other ranks finished `want` calls in all, `deadline`
/// passed, or another rank failed.
pub(super) fn serve_until(
    c: &mut Collective,
    finished: &std::sync::atomic::AtomicUsize,
    want: usize,
    deadline: Duration,
    gate: &Gate,
) -> Result<()> {
    let end = Instant::now() + deadline;
    while finished.load(Ordering::SeqCst) < want && Instant::now() < end && !gate.is_broken() {
        c.serve_for(Duration::from_millis(5))?;
    }
    Ok(())
}

pub(super) fn enter_host(group: &Group, rank: u16) -> Result<()> {
    if let Some(ns) = group.member(rank.into())?.netns.as_deref() {
        netns::enter(ns)?;
    }
    Ok(())
}

pub(super) fn poisoned() -> Error {
    Error::panicked("a benchmark thread holding a lock")
}

pub fn print_agg_row(r: &AggRecord) {
    crate::outln!(
        "  {:<9} {:<6} senders={:<2} bytes={:<10} {:>8.2} Melem/s  p50={:>9.2}ms p99={:>9.2}ms  aggregator cpu={:>8.2}ms/op sender cpu={:>8.2}ms/op",
        r.kind.to_string(),
        r.path.to_string(),
        r.senders,
        r.bytes,
        r.elems_per_s / 1e6,
        r.p50_ms,
        r.p99_ms,
        r.aggregator_cpu_ms,
        r.sender_cpu_ms
    );
}

/// One line of every host's bytes per operation against the byte model.
pub fn print_wire_row(w: &[HostWire]) {
    if w.is_empty() {
        return;
    }
    let mb = |b: f64| b / 1e6;
    let hosts: Vec<String> = w
        .iter()
        .map(|h| {
            let vs = |got: f64, model: f64| {
                if model > 0.0 {
                    format!("{:.1} ({:+.1}%)", mb(got), (got / model - 1.0) * 100.0)
                } else {
                    format!("{:.2}", mb(got))
                }
            };
            format!("{}: rx {} tx {}", h.rank, vs(h.rx_per_op, h.model_rx), vs(h.tx_per_op, h.model_tx))
        })
        .collect();
    crate::outln!("            MB per op on each host's link (vs byte model): {}", hosts.join(" | "));
}

/// Prints a row's loss-recovery counters (per timed operation).
pub fn print_recovery_row(v: &Recovery) {
    crate::outln!(
        "            per op: datagrams={:.0} retransmits={:.1} (fast {:.1}) stalls={:.1} window cuts={:.1} end={:.0} | root ring_full={:.1} busy={:.1} held={:.1} dup={:.1}",
        v.datagrams,
        v.retransmits,
        v.fast_retransmits,
        v.stalls,
        v.window_cuts,
        v.window_end,
        v.ring_full,
        v.busy,
        v.held,
        v.dup
    );
}

/// Prints the kernel/user ratios of one point's rows (nothing without both paths).
pub fn print_agg_ratio(rows: &[AggRecord]) {
    let k = rows.iter().find(|r| r.path == Path::Kernel);
    let u = rows.iter().find(|r| r.path == Path::User);
    if let (Some(k), Some(u)) = (k, u) {
        crate::outln!(
            "  ratio kernel/user: throughput {} | p50 time {} | aggregator cpu {} | sender cpu {}",
            ratio(k.elems_per_s, u.elems_per_s, "elem/s"),
            ratio(k.p50_ms, u.p50_ms, "ms"),
            ratio(k.aggregator_cpu_ms, u.aggregator_cpu_ms, "ms/op"),
            ratio(k.sender_cpu_ms, u.sender_cpu_ms, "ms/op")
        );
    }
}

/// "0.52x", or both figures when one is under a tenth of the other (a
/// ratio of a near-zero figure says nothing: the kernel path's aggregator
/// thread barely runs, XDP does its work in softirq).
pub fn ratio(k: f64, u: f64, unit: &str) -> String {
    if k >= u / 10.0 && u >= k / 10.0 && u > 0.0 {
        format!("{:.2}x", k / u)
    } else {
        format!("{} vs {} {unit}", figure(k), figure(u))
    }
}

fn figure(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else {
        format!("{v:.2}")
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// What the runtime's automatic quantization gives for an allreduce SUM
    /// of `ranks` (docs/AGGREGATION.md), computed without the network.
    fn quantized_sum(ranks: &[u16], elems: usize, chunk: usize) -> Vec<f32> {
        let block = chunk / 4;
        let h = quant::headroom(ranks.len());
        let mut out = Vec::with_capacity(elems);
        for start in (0..elems).step_by(block) {
            let r = start..(start + block).min(elems);
            let s = block_scale(ranks, r.clone(), h);
            for i in r {
                let q: i64 = ranks.iter().map(|&k| quant::quantize(rank_value_f32(k, i), s)).sum();
                out.push((q as f64 / s) as f32);
            }
        }
        out
    }

    #[test]
    fn f32_check_accepts_the_quantized_sum_and_refuses_more_error() {
        let (ranks, elems, chunk) = ([1u16, 2, 3, 4], 5000, 1432);
        let mut got = quantized_sum(&ranks, elems, chunk);
        check_f32_sum(Kind::Allreduce, &ranks, &got, elems, 1, chunk).expect("within the bound");
        <f32 as BenchElem>::check(Kind::Allreduce, AggOp::Sum, &ranks, &got, 1, chunk).expect("via the trait");
        // An element off by 1e-6 (~0.1 ulp-scale of 0.04, but 1000x the
        // quantization bound of ~4 * 2^-31 * 2^-6): refused.
        got[4321] += 1e-6;
        let err = check_f32_sum(Kind::Allreduce, &ranks, &got, elems, 1, chunk).expect_err("outside the bound");
        assert!(err.to_string().contains("element 4321"), "{err}");
        // The corruption the suite's test uses is caught too.
        let mut bad = quantized_sum(&ranks, elems, chunk);
        <f32 as BenchElem>::corrupt(&mut bad[0]);
        assert!(check_f32_sum(Kind::Allreduce, &ranks, &bad, elems, 1, chunk).is_err());
        assert!(check_f32_sum(Kind::Allreduce, &ranks, &bad[..10], elems, 1, chunk).is_err());
    }

    #[test]
    fn no_ratio_of_a_near_zero_figure() {
        assert_eq!(ratio(0.75, 56.71, "ms/op"), "0.75 vs 56.71 ms/op");
        assert_eq!(ratio(56.71, 0.0, "ms/op"), "56.71 vs 0.00 ms/op");
        assert_eq!(ratio(25.0, 50.0, "ms"), "0.50x");
        assert_eq!(ratio(3.0e8, 1.5e8, "elem/s"), "2.00x");
    }

    #[test]
    fn recovery_sums_ranks_per_operation() {
        let snap = |datagrams, retransmits, ring_full: Option<u64>| Counters {
            contrib: kccl::agg::member::ContribStats {
                datagrams,
                retransmits,
                window_last: if ring_full.is_none() { datagrams / 2 } else { 0 },
                ..Default::default()
            },
            kernel: ring_full.map(|ring_full| kccl::kernel_agg::AggStats { ring_full, ..Default::default() }),
        };
        // A sender (no engine) and the root (engine counters), 4 operations.
        let snaps = [
            (snap(10, 1, None), snap(50, 9, None)),
            (snap(10, 1, None), snap(90, 9, None)),
            (snap(0, 0, Some(3)), snap(0, 0, Some(11))),
        ];
        let r = Recovery::from_snapshots(&snaps, 4);
        assert_eq!((r.datagrams, r.retransmits, r.ring_full), (30.0, 4.0, 2.0));
        assert_eq!(r.window_end, 35.0, "the senders' windows (25, 45) averaged; the root has none");
    }

    #[test]
    fn i32_check_refuses_the_corrupted_result() {
        let ranks = [0u16, 1, 2];
        let mut got: Vec<i32> = (0..100).map(|i| reference(AggOp::Sum, &ranks, i)).collect();
        <i32 as BenchElem>::check(Kind::Reduce, AggOp::Sum, &ranks, &got, 0, 1432).expect("exact");
        <i32 as BenchElem>::corrupt(&mut got[0]);
        assert!(<i32 as BenchElem>::check(Kind::Reduce, AggOp::Sum, &ranks, &got, 0, 1432).is_err());
    }
}
