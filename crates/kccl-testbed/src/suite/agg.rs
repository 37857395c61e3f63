//! The aggregation experiments agg-throughput and agg-cpu, and what they share with agg-gemm and param-server.

use super::*;

pub(super) const SENDERS: usize = 4;

pub(super) fn agg_cfg() -> AggConfig {
    // Large vectors on a loaded 2-core machine: allow slow progress.
    AggConfig { deadline: Duration::from_secs(120), ..AggConfig::default() }
}

pub(super) fn agg_sample(r: &AggRecord) -> Sample {
    let mut s = Sample::new(r.p50_ms, r.p99_ms);
    s.worst = r.max_ms;
    s.cpu = r.aggregator_cpu_ms + r.sender_cpu_ms * r.senders as f64;
    // From the median time, so the two columns agree (the harness's own rate is
    // the median of per-iteration rates, which differs from it with 2 iterations).
    s.melem = (r.elems * r.senders) as f64 / (r.p50_ms / 1e3).max(1e-12) / 1e6;
    s.iters = r.iters;
    s
}

/// (iterations, repeats) for an aggregation of `bytes` per rank: at least 5
/// timed operations per point up to 256 MiB, 3 at 512 MiB (each repeat
/// also runs one checked operation per path, so large points take one repeat).
pub(super) fn agg_iters(smoke: bool, bytes: usize) -> (usize, usize) {
    match (smoke, bytes) {
        (true, _) => (3, 2),
        (false, 0..=16_777_216) => (5, 3),
        (false, 16_777_217..=134_217_728) => (3, 2),
        (false, 134_217_729..=268_435_456) => (5, 1),
        _ => (3, 1),
    }
}

/// (warm-up, timed) iterations per peer run of a reduce of `bytes` per rank
/// (at most; the runner's defaults for the size may be lower); the runs of
/// [`PEER_RUNS`] together give at least as many timed operations as kccl's.
pub(super) fn peer_reduce_iters(bytes: usize) -> (usize, usize) {
    if bytes >= 64 << 20 {
        (1, 4)
    } else {
        (2, 10)
    }
}

/// Separate runs of every peer point of the broadcast and reduce experiments.
pub(super) const PEER_RUNS: usize = 3;

/// The repeats of one reduce point through both kccl paths (SENDERS
/// senders, checked by the harness before timing) into `acc` at `x`, with
/// the root's `work` on each result inside the timed operation (agg-gemm).
/// Returns the records.  Stops at the first failed repeat.
#[allow(clippy::too_many_arguments)]
pub(super) fn kccl_reduce_repeats(
    spec: &SuiteSpec,
    h: &AggHarness,
    res: &mut ExperimentResult,
    acc: &mut Acc,
    prog: &ExperimentProgress<'_>,
    point: &str,
    x: f64,
    bytes: usize,
    work: Option<RootWork<'_, i32>>,
) -> Vec<AggRecord> {
    let (iters, reps) = agg_iters(spec.smoke, bytes);
    let mut out = Vec::new();
    for rep in 0..reps {
        prog.say(format!(
            "{point} repeat {}/{reps}: reduce of {bytes} B, kernel and user path, {iters} timed each",
            rep + 1
        ));
        let paths = [PathChoice::Kernel, PathChoice::User];
        match h.measure_with(Kind::Reduce, AggOp::Sum, SENDERS, &paths, &[bytes], iters, &agg_cfg(), work) {
            Ok(rows) => {
                for r in rows {
                    acc.add("", x, point, sys_of(r.path), agg_sample(&r));
                    res.raw(&format!("repeat {rep}"), &r);
                    out.push(r);
                }
            }
            Err(err) => {
                res.errors.push(format!("{point}: kccl reduce: {err}"));
                break;
            }
        }
    }
    out
}

/// An aggregation cluster of one experiment: kccl's harness and the same
/// hosts as a cluster description for the peers.
pub(super) struct AggCluster {
    pub(super) name: String,
    pub(super) h: AggHarness,
    pub(super) peers: Result<cluster::Cluster>,
}

impl AggCluster {
    /// Builds a cluster named `prefix`-unique with `senders` + 1 hosts for
    /// experiment `e` (the suite's test of its result checks,
    /// `KCCL_BENCH_CORRUPT=e`, switched on if asked).
    pub(super) fn up(
        spec: &SuiteSpec,
        e: Experiment,
        prefix: &str,
        senders: usize,
        prog: &ExperimentProgress<'_>,
        what: &str,
    ) -> Result<Self> {
        let name = cluster::unique_name(prefix);
        prog.say(format!("cluster {name}: {} hosts{what}", senders + 1));
        let mut h = AggHarness::new(&name, senders)?;
        h.corrupt_results = spec.corrupt == Some(e);
        let peers = cluster::load(&name);
        Ok(AggCluster { name, h, peers })
    }

    /// [`run_peers`] on this cluster's hosts.
    pub(super) fn run_peers(
        &self,
        spec: &SuiteSpec,
        res: &mut ExperimentResult,
        acc: &mut Acc,
        prog: &ExperimentProgress<'_>,
        pp: &PeerPoint<'_>,
    ) {
        match &self.peers {
            Ok(cl) => run_peers(spec, res, acc, prog, cl, pp),
            Err(err) => res.errors.push(format!("loading cluster {} for the peers: {err}", self.name)),
        }
    }
}

pub(super) fn agg_throughput(spec: &SuiteSpec, env: &Env, prog: &ExperimentProgress<'_>) -> ExperimentResult {
    let e = Experiment::AggThroughput;
    let mut res = ExperimentResult::new(
        e,
        spec,
        env,
        "time of one reduce (barrier to the root holding the result)",
        "ms",
        "bytes per rank",
        true,
    );
    let sizes: Vec<usize> = if spec.smoke {
        vec![65_536, 1 << 20]
    } else {
        vec![1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20, 256 << 20, 512 << 20]
    };
    res.notes.push(format!(
        "reduce (sum) of int32 vectors: the root (host 0) and {SENDERS} senders contribute; throughput = elements x senders / time \
         (the paper's ops/s); cpu_per_op = aggregator + sender threads (ms); timed operations x repeats per path: <=16 MiB 5x3, \
         <=128 MiB 3x2, 256 MiB 5x1, 512 MiB 3x1 (column `timed`); peers: {} run(s) per point of up to 10 timed reduces \
         (4 from 64 MiB)",
        peer_runs(spec, PEER_RUNS)
    ));
    let mut acc = Acc::default();
    let c = match AggCluster::up(spec, e, "su-ag", SENDERS, prog, "") {
        Ok(c) => c,
        Err(err) => {
            res.errors.push(format!("building the cluster: {err}"));
            return res;
        }
    };
    // Time grows with the bytes; a point skipped below weighs nothing.
    let runs =
        |bytes: usize| bytes <= spec.max_bytes && over_memory(kccl_memory(Kind::Reduce, SENDERS, bytes)).is_none();
    prog.plan(&sizes.iter().map(|&b| if runs(b) { (b + (1 << 20)) as u64 } else { 0 }).collect::<Vec<_>>());
    for &bytes in &sizes {
        let point = format!("bytes={bytes}");
        prog.point(&point);
        if bytes > spec.max_bytes {
            res.skipped.push(format!("{point}: above --max-bytes {}", spec.max_bytes));
            continue;
        }
        if let Some(why) = over_memory(kccl_memory(Kind::Reduce, SENDERS, bytes)) {
            res.skipped.push(format!("{point}: {} ranks x {bytes} B in this process: {why}", SENDERS + 1));
            continue;
        }
        kccl_reduce_repeats(spec, &c.h, &mut res, &mut acc, prog, &point, bytes as f64, bytes, None);
        let pp = reduce_peer_point(bytes, peer_reduce_iters(bytes), bytes as f64, &point, 0.0);
        c.run_peers(spec, &mut res, &mut acc, prog, &pp);
    }
    drop(c);
    res.rows = acc.rows();
    res
}

pub(super) fn agg_cpu(spec: &SuiteSpec, env: &Env, prog: &ExperimentProgress<'_>) -> ExperimentResult {
    let e = Experiment::AggCpu;
    let mut res = ExperimentResult::new(
        e,
        spec,
        env,
        "aggregator CPU (NAPI thread + aggregator thread) / wall time",
        "% of one CPU",
        "senders",
        false,
    );
    let (senders, secs, reps): (Vec<usize>, f64, usize) =
        if spec.smoke { (vec![2], 0.5, 1) } else { (vec![2, 4, 6, 8, 10, 16, 20, 30], 4.0, 2) };
    let (bytes, period) = (65_536usize, Duration::from_millis(20));
    res.notes.push(format!(
        "every sender reduces a {bytes}-byte int32 vector to host 0 every {} ms for {secs} s (the same offered load on both paths); \
         no p99 (one figure per run); {reps} repeat(s); the peers are not run here: their CPU is reported per operation, summed over \
         every rank, in agg-throughput",
        period.as_millis()
    ));
    let mut acc = Acc::default();
    // Every run takes `secs` plus the bring-up of its cluster.
    prog.plan(&senders.iter().flat_map(|&n| std::iter::repeat_n(n as u64 + 10, reps * 2)).collect::<Vec<_>>());
    for &n in &senders {
        let point = format!("senders={n}");
        for rep in 0..reps {
            for choice in [PathChoice::Kernel, PathChoice::User] {
                prog.point(&format!("{point} repeat {}/{reps} {} path", rep + 1, format!("{choice:?}").to_lowercase()));
                prog.say(format!("{point} repeat {}/{reps}: {choice:?} path", rep + 1));
                match measure_cpu(
                    &cluster::unique_name("su-cp"),
                    n,
                    choice,
                    bytes,
                    period,
                    Duration::from_secs_f64(secs),
                    &agg_cfg(),
                ) {
                    Ok(r) => {
                        prog.say(format!(
                            "  {}: cpu {:.1}% (napi {:.1}% + thread {:.1}%), offered {:.1} MB/s achieved {:.1} MB/s",
                            r.path, r.cpu_pct, r.napi_cpu_pct, r.thread_cpu_pct, r.offered_mb_s, r.achieved_mb_s
                        ));
                        let mut s = Sample::new(r.cpu_pct, f64::NAN);
                        s.iters = r.ops;
                        acc.add("", n as f64, &point, sys_of(r.path), s);
                        res.raw(&format!("repeat {rep}"), &r);
                        if r.achieved_mb_s < r.offered_mb_s * 0.9 {
                            res.notes.push(format!(
                                "{point} {}: achieved {:.1} of {:.1} MB/s offered: the path could not keep up, its CPU is that of a saturated run",
                                r.path, r.achieved_mb_s, r.offered_mb_s
                            ));
                        }
                    }
                    Err(err) => res.errors.push(format!("{point}: {choice:?}: {err}")),
                }
            }
        }
    }
    res.rows = acc.rows();
    res
}
