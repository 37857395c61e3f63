//! summary.md and the targets of the issues, from the experiments' results.

use super::*;

pub(super) fn fmt_v(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub(super) fn find<'a>(
    res: &'a [ExperimentResult],
    e: Experiment,
    series: &str,
    point: &str,
    system: &str,
) -> Option<&'a SuiteRow> {
    res.iter()
        .find(|r| r.experiment == e.name())?
        .rows
        .iter()
        .find(|r| r.series == series && r.point == point && r.system == system)
}

/// The targets, checked against this run's figures.
pub(super) fn targets(res: &[ExperimentResult]) -> Vec<String> {
    let mut out = Vec::new();
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let bc = Experiment::BcastReceivers;
    match (find(res, bc, BC_APP, "receivers=9", SYS_KERNEL), find(res, bc, BC_APP, "receivers=9", SYS_USER)) {
        (Some(k), Some(u)) => {
            let mut line = format!(
                "broadcast, 9 receivers (to the last receiving application): kernel median {} us = {:.2}x user ({} us); \
                 target <= 0.5x: {}",
                fmt_v(k.median),
                k.median / u.median,
                fmt_v(u.median),
                verdict(k.median / u.median <= 0.5)
            );
            if let (Some(kh), Some(uh)) =
                (find(res, bc, BC_HELD, "receivers=9", SYS_KERNEL), find(res, bc, BC_HELD, "receivers=9", SYS_USER))
            {
                write!(
                    line,
                    "; to the kernel's receive timestamp: kernel {} us = {:.2}x user ({} us): {}",
                    fmt_v(kh.median),
                    kh.median / uh.median,
                    fmt_v(uh.median),
                    verdict(kh.median / uh.median <= 0.5)
                )
                .unwrap_or(());
            }
            for p in ["gloo", "mpi"] {
                match find(res, bc, BC_APP, "receivers=9", p) {
                    Some(r) => write!(line, "; below {p} ({} us): {}", fmt_v(r.median), verdict(k.median < r.median))
                        .unwrap_or(()),
                    None => write!(line, "; {p}: not measured in this run").unwrap_or(()),
                }
            }
            out.push(line);
        }
        _ => out.push("broadcast, 9 receivers: not measured in this run".into()),
    }
    let big: Vec<&SuiteRow> = res
        .iter()
        .filter(|r| r.experiment == Experiment::AggThroughput.name())
        .flat_map(|r| r.rows.iter())
        .filter(|r| r.system == SYS_KERNEL && r.x >= (64u64 << 20) as f64)
        .collect();
    if big.is_empty() {
        out.push("reduce, 4 senders, >= 64 MB: not measured in this run".into());
    }
    for k in big {
        let speed = 1.0 / k.ratio_to_user;
        out.push(format!(
            "reduce, 4 senders, {} MiB: kernel {} ms vs user {} ms = {:.2}x the user path's throughput; target >= 4x: {}",
            k.x / (1u64 << 20) as f64,
            fmt_v(k.median),
            fmt_v(k.median / k.ratio_to_user),
            speed,
            verdict(speed >= 4.0)
        ));
    }
    match find(res, Experiment::ParamServer, "ResNet-34", "ResNet-34 workers=4", SYS_KERNEL) {
        Some(k) => {
            let mut line = format!("ResNet-34 allreduce, 4 workers: kernel {} ms", fmt_v(k.median));
            for p in [SYS_USER, "gloo", "mpi"] {
                match find(res, Experiment::ParamServer, "ResNet-34", "ResNet-34 workers=4", p) {
                    Some(r) => {
                        write!(line, "; {p} {} ms (kernel faster: {})", fmt_v(r.median), verdict(k.median < r.median))
                            .unwrap_or(())
                    }
                    None => write!(line, "; {p}: not measured").unwrap_or(()),
                }
            }
            out.push(line + "; target: kernel faster than gloo and mpi");
        }
        None => out.push("ResNet-34 allreduce, 4 workers: not measured in this run".into()),
    }
    out.push(sharded_line(res));
    out
}

/// Issue 33's target: the sharded kernel-path allreduce of ResNet-34's
/// gradient at 4 workers within SHARDED_TARGET x Gloo's time.
pub(super) const SHARDED_TARGET: f64 = 0.75;

fn sharded_line(res: &[ExperimentResult]) -> String {
    let (series, point) = ("ResNet-34", "ResNet-34 workers=4");
    let get = |sys| find(res, Experiment::ParamServer, series, point, sys);
    match (get(SYS_KERNEL_SHARDED), get("gloo")) {
        (Some(k), Some(g)) if g.median > 0.0 => {
            let x = k.median / g.median;
            let mut line = format!(
                "ResNet-34 allreduce, 4 workers, sharded: kernel {} ms vs gloo {} ms = **{x:.2}x**",
                fmt_v(k.median),
                fmt_v(g.median)
            );
            for sys in [SYS_USER_SHARDED, SYS_KERNEL] {
                if let Some(r) = get(sys) {
                    write!(line, "; {sys} {} ms", fmt_v(r.median)).unwrap_or(());
                }
            }
            line + &format!(
                "; target <= {SHARDED_TARGET}x gloo: {}",
                if x <= SHARDED_TARGET { "met" } else { "NOT met" }
            )
        }
        (None, _) => "ResNet-34 allreduce, 4 workers, sharded: not measured in this run".into(),
        (Some(k), _) => format!(
            "ResNet-34 allreduce, 4 workers, sharded: kernel {} ms; gloo not measured, so no ratio",
            fmt_v(k.median)
        ),
    }
}

/// The stall target (issue 32): no timed operation beyond this many times
/// its point's median.
pub(super) const WORST_OVER_MEDIAN: f64 = 3.0;

/// The slowest timed operation of the run against its point's median, over
/// every row that keeps it (the aggregation experiments and the peers).
pub(super) fn worst_line(res: &[ExperimentResult]) -> String {
    let worst = res
        .iter()
        .flat_map(|r| r.rows.iter().map(move |row| (r, row)))
        .filter(|(_, row)| row.worst.is_finite() && row.median > 0.0)
        .map(|(r, row)| (row.worst / row.median, r, row))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match worst {
        None => "stalls: not measured (no row kept its slowest operation)".into(),
        Some((x, r, row)) => format!(
            "stalls: the slowest timed operation took **{x:.2}x** its point's median ({} {}, {}: {} vs {} {}); \
             target: none beyond {WORST_OVER_MEDIAN}x: {}",
            r.experiment,
            row.point,
            row.system,
            fmt_v(row.worst),
            fmt_v(row.median),
            r.unit,
            if x <= WORST_OVER_MEDIAN { "met" } else { "**not met**" }
        ),
    }
}

pub(super) fn summary_md(res: &[ExperimentResult], env: &Env, spec: &SuiteSpec) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# kccl benchmark suite{}\n",
        if spec.smoke { " (smoke: tiny sizes, few iterations; not for comparison)" } else { "" }
    );
    let _ = writeln!(
        s,
        "- date: {}\n- machine: {}\n- command: `kccl bench all{}`\n",
        env.date,
        env.machine,
        if spec.smoke { " --smoke" } else { "" }
    );
    let _ = writeln!(
        s,
        "Per experiment and system: median and p99 of the experiment's metric (median over repeats of each repeat's median/p99), \
         the ratio of the median to the tuned user-space path's median at the same point (< 1: faster than user space), \
         min/median/max of the repeats' medians (the machine's noise; for the peers, of separate runs), and `timed`, the timed \
         operations behind the row (all repeats, or all peer runs, together). Systems: `kccl-kernel` (BPF data path), \
         `kccl-user` (same protocol in user space, sendmmsg/recvmmsg), `gloo` (torch.distributed), `mpi` (Open MPI 4.1 + mpi4py).\n"
    );
    let _ = writeln!(
        s,
        "The experiments repeat those of the papers kccl implements (AggBox: in-kernel broadcast and aggregation; \
         sgbpf: in-kernel scatter-gather); figure numbers refer to them.\n"
    );
    let _ = writeln!(s, "## Performance targets (this run)\n");
    for t in targets(res) {
        let _ = writeln!(s, "- {t}");
    }
    let _ = writeln!(s, "- {}", worst_line(res));
    let _ = writeln!(s);
    for r in res {
        let _ = writeln!(s, "## {} — {}\n", r.experiment, r.title);
        let _ = writeln!(
            s,
            "Status: **{}** (run {}, {:.0} s). Metric: {} [{}].\n",
            r.status, r.date, r.seconds, r.metric, r.unit
        );
        for n in &r.notes {
            let _ = writeln!(s, "- {n}");
        }
        for k in &r.skipped {
            let _ = writeln!(s, "- skipped: {k}");
        }
        for e in &r.errors {
            let _ = writeln!(s, "- **FAILED**: {e}");
        }
        if !r.rows.is_empty() {
            let _ = writeln!(
                s,
                "\n| point | system | median | p99 | x user | repeats min / median / max | timed | CPU/op | Melem/s |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
            for row in &r.rows {
                let mut reps = row.repeat_medians.clone();
                reps.sort_by(f64::total_cmp);
                let reps_s = if reps.len() > 1 {
                    format!(
                        "{} / {} / {} ({})",
                        fmt_v(reps[0]),
                        fmt_v(percentile(&reps, 50.0)),
                        fmt_v(reps[reps.len() - 1]),
                        reps.len()
                    )
                } else {
                    "1 run".into()
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    if row.series.is_empty() || row.point.starts_with(&row.series) {
                        row.point.clone()
                    } else {
                        format!("{} ({})", row.point, row.series)
                    },
                    row.system,
                    fmt_v(row.median),
                    fmt_v(row.p99),
                    if row.ratio_to_user.is_nan() { "-".into() } else { format!("{:.2}x", row.ratio_to_user) },
                    reps_s,
                    row.iters,
                    fmt_v(row.cpu_per_op),
                    fmt_v(row.melem_per_s)
                );
            }
        }
        let _ = writeln!(s);
    }
    s
}
