//! The benchmark harness behind `kccl bench` and `kccl demo`: broadcast
//! ([`bcast`]), aggregation ([`agg`], aggregator CPU in [`cpu`]) and loss
//! ([`loss`]), and what they share: percentiles, CPU clocks, the message hash,
//! and the JSON + PNG output of every benchmark.

pub mod agg;
pub mod bcast;
pub mod cpu;
pub mod loss;
pub mod wire;

use std::time::Duration;

use crate::error::{Error, Result};

pub use bcast::{print_rows, BcastHarness, BcastRecord, BCAST_LEGEND};

/// FNV-1a of a message: receivers' bytes are checked by length and this hash.
pub fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The `p`-th percentile of ascending `sorted`, interpolated linearly
/// between the two closest ranks (numpy's default): the median of an even
/// count is the mean of the middle two, not the upper one (with the few
/// samples of large benchmark points, rounding the rank up made every
/// median the worse value).  NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// CPU time of the whole process (all threads).
pub fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid clock id and timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Writes `records` as JSON and, if `plot` is given, a PNG through
/// bench/plot.py (matplotlib, run with /usr/bin/python3).
pub fn write_outputs<T: serde::Serialize>(
    records: &[T],
    json: &std::path::Path,
    plot: Option<&std::path::Path>,
    kind: &str,
) -> Result<()> {
    let text = serde_json::to_string_pretty(records)
        .map_err(|e| Error::Host { what: "serializing results as JSON".into(), detail: e.to_string() })?;
    std::fs::write(json, text).map_err(|e| Error::io(format!("writing {}", json.display()), e))?;
    if let Some(png) = plot {
        let out = std::process::Command::new(python())
            .arg("-c")
            .arg(PLOT_PY)
            .arg(kind)
            .arg(json)
            .arg(png)
            .output()
            .map_err(|e| Error::io("running python3 for the plot (make setup installs matplotlib)", e))?;
        if !out.status.success() {
            return Err(Error::Tool {
                cmd: format!("python3 plot.py {kind} {} {}", json.display(), png.display()),
                detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                hint: "make setup installs python3-matplotlib".into(),
            });
        }
    }
    Ok(())
}

const PLOT_PY: &str = include_str!("../../py/plot.py");

fn python() -> &'static str {
    if std::path::Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

#[cfg(test)]
mod percentile_tests {
    use super::percentile;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        assert!(percentile(&[], 50.0).is_nan());
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[1.0, 3.0], 50.0), 2.0, "median of two is their mean");
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 10.0], 50.0), 2.5);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 0.0), 1.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 100.0), 3.0);
        let v: Vec<f64> = (0..101).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 99.0);
    }
}
