//! `kccl bench loss`: throughput of reduce and broadcast under packet loss,
//! relative to the same path without loss, kernel and user path in one run.
//!
//! Loss is made by the project's fault injector (bpf/tc_fault.bpf.c) at TCX
//! egress of EVERY host's interface, so each datagram crossing the virtual
//! cluster is dropped with the given probability once, whichever path sent
//! it.  The injector is installed at loss 0 too, so the "no loss" point pays
//! the same per-packet cost and the ratios measure the loss alone.  Host i
//! draws from seed `seed + i`; the seed is in every record.
//!
//! Reduce uses the aggregation harness (a checked operation before the timed
//! ones); broadcast sends one message of `bcast_bytes` to every receiver and
//! counts it done when the last receiver holds every byte (checked by hash).

use crate::progress::Progress;
use std::time::Duration;

use crate::bench::agg::{AggHarness, Kind};
use crate::bench::{percentile, BcastHarness};
use crate::cluster;
use crate::error::{Error, Result};
use kccl::agg::{AggConfig, AggOp};
use kccl::fault::{self, FaultConfig, FaultStats};
use kccl::group::Group;
use kccl::transport::{Path, PathChoice};

/// What to measure.
#[derive(Debug, Clone)]
pub struct LossSpec {
    /// Drop probabilities in [0, 1); the first must be 0 (the reference).
    pub losses: Vec<f64>,
    pub seed: u64,
    /// Bytes of each rank's int32 vector in the reduce.
    pub reduce_bytes: usize,
    pub senders: usize,
    /// Bytes of the broadcast message.
    pub bcast_bytes: usize,
    pub receivers: usize,
    pub iters: usize,
}

/// One row of `kccl bench loss` (JSON record).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LossRecord {
    /// "reduce" or "broadcast".
    pub collective: &'static str,
    pub path: Path,
    pub loss: f64,
    pub seed: u64,
    /// Bytes of each rank's vector (reduce) or of the message (broadcast).
    pub bytes: usize,
    /// Senders (reduce) or receivers (broadcast).
    pub peers: usize,
    pub iters: usize,
    /// Median goodput: reduce counts every sender's vector, broadcast every
    /// receiver's copy.
    pub mb_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// mb_s / mb_s of the same collective and path at loss 0.
    pub relative: f64,
    /// Packets the injectors saw and dropped during this point.
    pub packets: u64,
    pub dropped: u64,
    /// Operations that did not complete (broadcast only; reduce fails the run).
    pub failed: usize,
}

impl LossSpec {
    pub fn validate(&self) -> Result<()> {
        if self.losses.first() != Some(&0.0) {
            return Err(Error::setting("--loss", "must start with 0 (the no-loss reference)"));
        }
        if let Some(bad) = self.losses.iter().find(|l| !(0.0..1.0).contains(*l)) {
            return Err(Error::setting(format!("--loss {bad}"), "loss rates are probabilities in [0, 1)"));
        }
        if self.reduce_bytes == 0 || self.reduce_bytes % 4 != 0 {
            return Err(Error::setting("--reduce-bytes", "must be a positive multiple of 4"));
        }
        if self.bcast_bytes == 0 || self.senders == 0 || self.receivers == 0 || self.iters == 0 {
            return Err(Error::setting("--bcast-bytes, --senders, --receivers and --iters", "must be positive"));
        }
        Ok(())
    }
}

/// Injectors on every member's interface, removed on drop (also on error).
struct Faults {
    targets: Vec<(Option<String>, String)>,
}

impl Faults {
    fn install(group: &Group, loss: f64, seed: u64) -> Result<Faults> {
        let mut f = Faults { targets: Vec::new() };
        for (i, m) in group.members.iter().enumerate() {
            let cfg = FaultConfig::from_fractions(loss, 0.0, 0.0, seed.wrapping_add(i as u64))?;
            fault::install(m.netns.as_deref(), &m.iface, &cfg)?;
            f.targets.push((m.netns.clone(), m.iface.clone()));
        }
        Ok(f)
    }

    fn stats(&self) -> Result<FaultStats> {
        let mut sum = FaultStats::default();
        for (ns, iface) in &self.targets {
            let s = fault::pinned_stats(ns.as_deref(), iface)?;
            sum.seen += s.seen;
            sum.dropped += s.dropped;
            sum.duplicated += s.duplicated;
            sum.held += s.held;
            sum.released += s.released;
            sum.passed += s.passed;
        }
        Ok(sum)
    }
}

impl Drop for Faults {
    fn drop(&mut self) {
        for (ns, iface) in &self.targets {
            let _ = fault::clear(ns.as_deref(), iface);
        }
    }
}

/// Fills `relative` from the loss-0 row of the same collective and path.
fn relate(rows: &mut [LossRecord]) {
    let base: Vec<(&'static str, Path, f64)> =
        rows.iter().filter(|r| r.loss == 0.0).map(|r| (r.collective, r.path, r.mb_s)).collect();
    for r in rows.iter_mut() {
        if let Some(b) = base.iter().find(|b| b.0 == r.collective && b.1 == r.path) {
            r.relative = r.mb_s / b.2;
        }
    }
}

pub fn print_row(r: &LossRecord) {
    crate::outln!(
        "  {:<9} {:<6} loss={:<7} {:>8.1} MB/s ({:>5.2}x of no loss)  p50={:>8.2}ms p99={:>8.2}ms  dropped {}/{} packets{}",
        r.collective,
        r.path.to_string(),
        r.loss,
        r.mb_s,
        r.relative,
        r.p50_ms,
        r.p99_ms,
        r.dropped,
        r.packets,
        if r.failed > 0 { format!("  FAILED {}", r.failed) } else { String::new() }
    );
}

/// Runs the whole benchmark: reduce first, then broadcast, each on its own
/// cluster, both paths at every loss rate.
/// Runs every point, reporting each on `progress` (stages "reduce" and
/// "broadcast", one point per loss rate and path).
pub fn run(spec: &LossSpec, progress: &Progress) -> Result<Vec<LossRecord>> {
    spec.validate()?;
    // Each path at each loss rate runs the same operations; loss slows them
    // by amounts unknown ahead, so every point weighs the same.
    let points = vec![1; spec.losses.len() * 2];
    progress.stage("reduce");
    progress.plan(&points);
    let mut rows = reduce_points(spec, progress)?;
    progress.stage("broadcast");
    progress.plan(&points);
    rows.extend(broadcast_points(spec, progress)?);
    progress.finish();
    relate(&mut rows);
    Ok(rows)
}

fn reduce_points(spec: &LossSpec, progress: &Progress) -> Result<Vec<LossRecord>> {
    let h = AggHarness::new(&cluster::unique_name("bloss"), spec.senders)?;
    // Single datagrams per send (not the default): the injector sees a GSO
    // send as one packet and would drop all its datagrams together, while a
    // real link loses frames one at a time (after segmentation).
    let cfg = AggConfig { deadline: Duration::from_secs(60), gso: false, ..AggConfig::default() };
    let mut rows = Vec::new();
    for &loss in &spec.losses {
        let faults = Faults::install(h.group(), loss, spec.seed)?;
        for choice in [PathChoice::Kernel, PathChoice::User] {
            progress.point(format!("loss={loss} {} path", format!("{choice:?}").to_lowercase()));
            let before = faults.stats()?;
            let r = h
                .measure(Kind::Reduce, AggOp::Sum, spec.senders, &[choice], &[spec.reduce_bytes], spec.iters, &cfg)?
                .into_iter()
                .next()
                .ok_or_else(|| Error::wrong("reduce", "the harness returned no result"))?;
            let d = faults.stats()?.delta(&before);
            let mut row = LossRecord {
                collective: "reduce",
                path: r.path,
                loss,
                seed: spec.seed,
                bytes: spec.reduce_bytes,
                peers: spec.senders,
                iters: spec.iters,
                mb_s: r.elems_per_s * 4.0 / 1e6,
                p50_ms: r.p50_ms,
                p99_ms: r.p99_ms,
                relative: f64::NAN,
                packets: d.seen,
                dropped: d.dropped,
                failed: 0,
            };
            relate_one(&mut row, &rows);
            print_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

fn relate_one(row: &mut LossRecord, done: &[LossRecord]) {
    let mut v = done.to_vec();
    v.push(row.clone());
    relate(&mut v);
    row.relative = v.last().map_or(f64::NAN, |r| r.relative);
}

fn broadcast_points(spec: &LossSpec, progress: &Progress) -> Result<Vec<LossRecord>> {
    let h = BcastHarness::new(&cluster::unique_name("bloss"), spec.receivers)?;
    let n = spec.receivers;
    let data: Vec<u8> =
        (0..spec.bcast_bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect();
    let group = h.group().clone();
    h.with_sender(PathChoice::Kernel, |h, b| {
        let mut rows: Vec<LossRecord> = Vec::new();
        for &loss in &spec.losses {
            let faults = Faults::install(&group, loss, spec.seed)?;
            for path in [Path::Kernel, Path::User] {
                progress.point(format!("loss={loss} {path} path"));
                // Checked before timing: every receiver holds every byte.
                h.verify(b, path, n, spec.bcast_bytes.min(1 << 16))?;
                let before = faults.stats()?;
                let mut times = Vec::with_capacity(spec.iters);
                let mut failed = 0;
                // A message lost for good counts as failed, not as a time.
                let timeout = Duration::from_secs(10);
                for _ in 0..spec.iters {
                    match h.deliver(b, &data, n, timeout)? {
                        Some(t) => times.push(t.as_secs_f64()),
                        None => failed += 1,
                    }
                }
                let d = faults.stats()?.delta(&before);
                times.sort_by(f64::total_cmp);
                let p50 = percentile(&times, 50.0);
                let mut row = LossRecord {
                    collective: "broadcast",
                    path,
                    loss,
                    seed: spec.seed,
                    bytes: spec.bcast_bytes,
                    peers: n,
                    iters: spec.iters,
                    mb_s: (spec.bcast_bytes * n) as f64 / p50 / 1e6,
                    p50_ms: p50 * 1e3,
                    p99_ms: percentile(&times, 99.0) * 1e3,
                    relative: f64::NAN,
                    packets: d.seen,
                    dropped: d.dropped,
                    failed,
                };
                relate_one(&mut row, &rows);
                print_row(&row);
                rows.push(row);
            }
        }
        Ok(rows)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(collective: &'static str, path: Path, loss: f64, mb_s: f64) -> LossRecord {
        LossRecord {
            collective,
            path,
            loss,
            seed: 1,
            bytes: 4,
            peers: 1,
            iters: 1,
            mb_s,
            p50_ms: 1.0,
            p99_ms: 1.0,
            relative: f64::NAN,
            packets: 0,
            dropped: 0,
            failed: 0,
        }
    }

    #[test]
    fn relative_is_per_collective_and_path() {
        let mut v = vec![
            row("reduce", Path::Kernel, 0.0, 100.0),
            row("reduce", Path::User, 0.0, 50.0),
            row("reduce", Path::Kernel, 0.01, 80.0),
            row("reduce", Path::User, 0.01, 10.0),
            row("broadcast", Path::Kernel, 0.0, 10.0),
            row("broadcast", Path::Kernel, 0.05, 5.0),
        ];
        relate(&mut v);
        let rel: Vec<f64> = v.iter().map(|r| r.relative).collect();
        assert_eq!(rel, vec![1.0, 1.0, 0.8, 0.2, 1.0, 0.5]);
    }

    #[test]
    fn spec_refuses_bad_input() {
        let ok = LossSpec {
            losses: vec![0.0, 0.01],
            seed: 1,
            reduce_bytes: 4096,
            senders: 2,
            bcast_bytes: 4096,
            receivers: 2,
            iters: 1,
        };
        assert!(ok.validate().is_ok());
        for bad in [
            LossSpec { losses: vec![0.01], ..ok.clone() },
            LossSpec { losses: vec![0.0, 1.0], ..ok.clone() },
            LossSpec { losses: vec![0.0, -0.1], ..ok.clone() },
            LossSpec { reduce_bytes: 6, ..ok.clone() },
            LossSpec { iters: 0, ..ok.clone() },
        ] {
            assert!(matches!(bad.validate(), Err(Error::BadSetting { .. })), "{bad:?}");
        }
    }
}
