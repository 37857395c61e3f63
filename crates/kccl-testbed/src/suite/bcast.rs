//! The broadcast experiments (bcast-size, bcast-receivers).

use super::*;

/// Series of the broadcast experiments: first send to the last receiving
/// application returning the message (every system), and to the kernel's
/// receive timestamp of the last datagram at the last receiver (kccl only).
pub(super) const BC_APP: &str = "app";
pub(super) const BC_HELD: &str = "held";

pub(super) struct BcastPlan {
    pub(super) receivers: Vec<usize>,
    pub(super) size: usize,
    pub(super) sizes: Vec<usize>,
    pub(super) size_receivers: usize,
    pub(super) iters: usize,
    pub(super) repeats: usize,
    pub(super) peer_receivers: Vec<usize>,
    /// Separate runs of each peer point, and timed broadcasts per run.
    pub(super) peer_runs: usize,
    pub(super) peer_iters: usize,
}

pub(super) fn bcast_plan(smoke: bool) -> BcastPlan {
    if smoke {
        BcastPlan {
            receivers: vec![1, 3],
            size: 1472,
            sizes: vec![64, 1472],
            size_receivers: 3,
            iters: 30,
            repeats: 2,
            peer_receivers: vec![3],
            peer_runs: 1,
            peer_iters: 5,
        }
    } else {
        BcastPlan {
            receivers: vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32],
            size: 1472,
            sizes: vec![64, 128, 256, 512, 1024, 1472],
            size_receivers: 9,
            iters: 300,
            repeats: 3,
            peer_receivers: vec![1, 3, 5, 7, 9, 16, 32],
            peer_runs: 3,
            peer_iters: 100,
        }
    }
}

pub(super) fn bcast(e: Experiment, spec: &SuiteSpec, env: &Env, prog: &ExperimentProgress<'_>) -> ExperimentResult {
    let plan = bcast_plan(spec.smoke);
    let by_recv = e == Experiment::BcastReceivers;
    let mut res = if by_recv {
        ExperimentResult::new(
            e,
            spec,
            env,
            "first send to last receiving application holding the message",
            "us",
            "receivers",
            false,
        )
    } else {
        ExperimentResult::new(
            e,
            spec,
            env,
            "first send to last receiving application holding the message",
            "us",
            "UDP payload bytes per packet",
            false,
        )
    };
    // (receivers, size) points.
    let points: Vec<(usize, usize)> = if by_recv {
        plan.receivers.iter().map(|&n| (n, plan.size)).collect()
    } else {
        plan.sizes.iter().map(|&s| (plan.size_receivers, s)).collect()
    };
    let max = points.iter().map(|p| p.0).max().unwrap_or(1);
    res.notes.push(format!(
        "{} timed broadcasts per path per repeat after a checked one and warm-up, {} repeats, paths alternating in blocks; \
         median/p99 = first send to the last receiving application returning the whole message (what the peers' figures measure too); \
         the `held` series is first send to the kernel's receive timestamp of the last datagram at the last receiver (kccl only); CPU/op = the whole kccl process per broadcast (us)",
        plan.iters, plan.repeats
    ));
    if spec.peers {
        res.notes.push(format!(
            "peers: {} separate run(s) per point (each starts every rank anew), each {} warm-up + {} timed broadcasts",
            plan.peer_runs,
            if spec.smoke { 1 } else { 20 },
            plan.peer_iters
        ));
    }
    let mut acc = Acc::default();
    let name = cluster::unique_name("su-bc");
    prog.say(format!("cluster {name}: {} hosts", max + 1));
    let h = match BcastHarness::new(&name, max) {
        Ok(h) => h,
        Err(err) => {
            res.errors.push(format!("building the {}-host cluster: {err}", max + 1));
            return res;
        }
    };
    // Time grows with the receivers and the packets per message.
    let weights: Vec<u64> = points.iter().map(|&(n, size)| (n * (size + 1024)) as u64).collect();
    prog.plan(&weights.repeat(plan.repeats));
    let measured = h.with_sender(PathChoice::Kernel, |h, b| {
        let mut out: Vec<(usize, BcastRecord)> = Vec::new();
        for rep in 0..plan.repeats {
            for &(n, size) in &points {
                prog.point(&format!("repeat {}/{} receivers={n} size={size}", rep + 1, plan.repeats));
                prog.say(format!("repeat {}/{}: receivers={n} size={size}", rep + 1, plan.repeats));
                let rows = h.measure(b, &[Path::Kernel, Path::User], n, size, plan.iters)?;
                crate::bench::print_rows(&rows);
                out.extend(rows.into_iter().map(|r| (rep, r)));
            }
        }
        Ok(out)
    });
    match measured {
        Ok(recs) => {
            for (rep, r) in recs {
                let (x, point) = if by_recv {
                    (r.receivers as f64, format!("receivers={}", r.receivers))
                } else {
                    (r.size as f64, format!("size={}", r.size))
                };
                let mut s = Sample::new(r.app_p50_us, r.app_p99_us);
                s.mean = r.app_mean_us;
                s.cpu = r.total_cpu_us;
                s.iters = r.iters;
                if r.lost > 0 {
                    res.notes.push(format!(
                        "{point} {}: {} of {} broadcasts not complete within 1 s (lost)",
                        r.path, r.lost, r.iters
                    ));
                }
                acc.add(BC_APP, x, &point, sys_of(r.path), s);
                // The kernel's receive timestamp at the last receiver: kccl's own
                // figure, without the receiving threads' wake-up.
                let mut held = Sample::new(r.p50_us, r.p99_us);
                held.mean = r.mean_us;
                held.cpu = r.total_cpu_us;
                held.iters = r.iters;
                acc.add(BC_HELD, x, &point, sys_of(r.path), held);
                res.raw(&format!("repeat {rep}"), &r);
            }
        }
        Err(err) => res.errors.push(format!("kccl broadcast: {err}")),
    }
    if spec.peers {
        match cluster::load(&name) {
            Ok(cl) => {
                for &(n, size) in &points {
                    if by_recv && !plan.peer_receivers.contains(&n) {
                        continue;
                    }
                    let (x, point) = if by_recv {
                        (n as f64, format!("receivers={n}"))
                    } else {
                        (size as f64, format!("size={size}"))
                    };
                    // kccl's size counts its header; the peers send the same payload bytes.
                    let bytes = size / 4 * 4;
                    run_peers(
                        spec,
                        &mut res,
                        &mut acc,
                        prog,
                        &cl,
                        &PeerPoint {
                            op: PeerOp::Broadcast,
                            dtype: DType::Int32,
                            bytes,
                            ranks: n + 1,
                            iters: Some((20, plan.peer_iters)),
                            runs: plan.peer_runs,
                            series: BC_APP,
                            x,
                            point: &point,
                            to_unit: 1.0,
                            senders: 0,
                            extra: 0.0,
                        },
                    );
                }
                if by_recv {
                    let skipped: Vec<String> = plan
                        .receivers
                        .iter()
                        .filter(|n| !plan.peer_receivers.contains(n))
                        .map(|n| n.to_string())
                        .collect();
                    if !skipped.is_empty() {
                        res.notes.push(format!(
                            "peers run at receivers {:?} only (each peer run starts one Python process per host; receivers {} skipped for time)",
                            plan.peer_receivers,
                            skipped.join(",")
                        ));
                    }
                }
            }
            Err(err) => res.errors.push(format!("loading cluster {name} for the peers: {err}")),
        }
    }
    drop(h);
    res.rows = acc.rows();
    res
}
