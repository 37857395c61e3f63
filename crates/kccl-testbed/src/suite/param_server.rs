//! param-server: float32 gradient allreduce of the models of AggBox's table 3.

use super::*;

/// The models of AggBox's table 3: (name, float32 parameters).
pub const MODELS: [(&str, usize); 3] =
    [("ResNet-34", 21_800_000), ("Wav2Vec2-base", 95_000_000), ("GPT-2 small", 124_000_000)];

/// Worker counts of the paper's table 3 (`--workers 2,4,6,8,10`).
pub const PS_WORKERS_ALL: [usize; 5] = [2, 4, 6, 8, 10];

/// Worker counts of a default full run: float32 allreduces of these models at
/// 6 to 10 workers take 15-40 s per operation on this 2-core machine, and 6
/// operations per path and point (1 checked + 5 timed) of every column would
/// take the full run from ~35 minutes to well over an hour (docs/BENCHMARKS.md,
/// "Time of the full run").  4 workers is the target.
pub const PS_WORKERS: [usize; 2] = [2, 4];

/// Timed allreduces per path and point (after one checked one), and separate
/// runs of each peer point (each up to 1 warm-up + 3 timed).  One peer run:
/// a second would add ~1 minute (start-up of every rank, 4 more allreduces
/// per point), over the full run's budget; `kccl bench peers` repeats them.
pub(super) const PS_ITERS: usize = 5;
pub(super) const PS_PEER_RUNS: usize = 1;

pub(super) fn param_server(spec: &SuiteSpec, env: &Env, prog: &ExperimentProgress<'_>) -> ExperimentResult {
    let e = Experiment::ParamServer;
    let mut res = ExperimentResult::new(
        e,
        spec,
        env,
        "time of one float32 allreduce of the gradient (barrier to the slowest worker holding it)",
        "ms",
        "workers",
        false,
    );
    let scale = if spec.smoke { 100 } else { 1 };
    let workers: Vec<usize> = match &spec.workers {
        Some(w) => w.clone(),
        None if spec.smoke => vec![2],
        None => {
            let rest: Vec<String> =
                PS_WORKERS_ALL.iter().filter(|w| !PS_WORKERS.contains(w)).map(|w| w.to_string()).collect();
            res.skipped.push(format!(
                "workers={}: not run by default, for time (the full run stays near 35 minutes); \
                 `kccl bench all --experiments param-server --workers 2,4,6,8,10` runs all of table 3",
                rest.join(",")
            ));
            PS_WORKERS.to_vec()
        }
    };
    let (iters, ps_runs) = (if spec.smoke { 3 } else { PS_ITERS }, peer_runs(spec, PS_PEER_RUNS));
    res.notes.push(format!(
        "allreduce (sum) of one float32 gradient per worker (element i of worker r = ((i * 2654435761 + r * 40503) mod 2001 - 1000) \
         / 1e5) through kccl's float32 allreduce: quantized at the edge with the automatic per-chunk scale (docs/AGGREGATION.md), \
         quantization, the exponent pre-pass and dequantization inside the timed call; kccl: workers are hosts 1..=W, host 0 is the \
         aggregator service (kccl-kernel, kccl-user) or idles while every worker combines 1/W of the chunks (kccl-*-sharded), the peers run W ranks on hosts 0..W-1, float32 too; before timing, each path's checked \
         allreduce is compared on every worker with the f64 sum within the documented quantization bound; 1 checked + {iters} \
         timed operations per path; peers: {ps_runs} run(s) of 1 warm-up + up to 3 timed{}",
        if scale > 1 { format!("; SMOKE: every model scaled down {scale}x") } else { String::new() }
    ));
    let mut acc = Acc::default();
    let skip = |w: usize, bytes: usize| -> Option<String> {
        if bytes > spec.max_bytes {
            return Some(format!("{bytes} B above --max-bytes {}", spec.max_bytes));
        }
        over_memory(kccl_memory(Kind::Allreduce, w, bytes))
            .map(|why| format!("{w} workers x {bytes} B in this process: {why}"))
    };
    let model_bytes = |&(m, p): &(&'static str, usize)| (m, p / scale * 4);
    // Time grows with the workers and the model's bytes; skipped points weigh
    // nothing and, per worker count, come first (the order of the loop below).
    let weights: Vec<u64> = workers
        .iter()
        .flat_map(|&w| {
            let (skipped, run): (Vec<usize>, Vec<usize>) =
                MODELS.iter().map(model_bytes).map(|(_, b)| b).partition(|&b| skip(w, b).is_some());
            skipped.into_iter().map(|_| 0).chain(run.into_iter().map(move |b| (w * b) as u64))
        })
        .collect();
    prog.plan(&weights);
    for &w in &workers {
        let mut models: Vec<(&str, usize)> = Vec::new();
        for (m, bytes) in MODELS.iter().map(model_bytes) {
            match skip(w, bytes) {
                Some(why) => {
                    prog.point(&format!("{m} workers={w}"));
                    res.skipped.push(format!("{m} workers={w}: {why}"));
                }
                None => models.push((m, bytes)),
            }
        }
        if models.is_empty() {
            continue;
        }
        let c = match AggCluster::up(spec, e, "su-ps", w, prog, &format!(" (aggregator + {w} workers)")) {
            Ok(c) => c,
            Err(err) => {
                res.errors.push(format!("workers={w}: building the cluster: {err}"));
                continue;
            }
        };
        for (m, bytes) in models {
            let point = format!("{m} workers={w}");
            prog.point(&point);
            // Both allreduce modes (issue 33): the aggregator service on
            // host 0, and sharded (every worker combines 1/W, host 0 idles).
            for mode in [AllreduceMode::Aggregator, AllreduceMode::Sharded] {
                let sharded = mode == AllreduceMode::Sharded;
                prog.say(format!("{point}: float32 allreduce of {bytes} B, {mode}, both paths, {iters} timed each"));
                match c.h.measure_with::<f32>(
                    Kind::Allreduce,
                    AggOp::Sum,
                    w,
                    &[PathChoice::Kernel, PathChoice::User],
                    &[bytes],
                    iters,
                    &AggConfig { allreduce: mode, ..agg_cfg() },
                    None,
                ) {
                    Ok(rows) => {
                        for r in rows {
                            acc.add(m, w as f64, &point, sys_of_mode(r.path, sharded), agg_sample(&r));
                            res.raw(&point, &r);
                        }
                    }
                    Err(err) => res.errors.push(format!("{point}: kccl {mode} allreduce: {err}")),
                }
            }
            let pp = PeerPoint {
                op: PeerOp::Allreduce,
                dtype: DType::Float32,
                bytes,
                ranks: w,
                iters: Some((1, 3)),
                runs: ps_runs,
                series: m,
                x: w as f64,
                point: &point,
                to_unit: 1e-3,
                senders: w,
                extra: 0.0,
            };
            c.run_peers(spec, &mut res, &mut acc, prog, &pp);
        }
        drop(c);
    }
    res.rows = acc.rows();
    res
}
