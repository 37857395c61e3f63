//! The date, the machine and memory estimates, for the record and to skip points that do not fit.

use super::*;

/// The date and the machine, for the record.
pub(super) struct Env {
    pub(super) date: String,
    pub(super) machine: String,
}

impl Env {
    pub(super) fn probe() -> Env {
        let date = cmd_out("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_else(|| "unknown date".into());
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
        let mem_gib = meminfo_kib("MemTotal").map(|k| k as f64 / (1 << 20) as f64).unwrap_or(f64::NAN);
        let os = std::fs::read_to_string("/etc/os-release")
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned()))
            })
            .unwrap_or_else(|| "unknown OS".into());
        let kernel = cmd_out("uname", &["-r"]).unwrap_or_else(|| "unknown kernel".into());
        let load = std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default();
        Env {
            date,
            machine: format!(
                "{ncpu} vCPU ({cpu}), {mem_gib:.0} GiB RAM, {os}, kernel {kernel}; every virtual host shares these cores; load average at start {load}"
            ),
        }
    }
}

pub(super) fn cmd_out(cmd: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(cmd).args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// A field of /proc/meminfo in KiB.
pub(super) fn meminfo_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Why a point whose peak memory is estimated at `need` bytes cannot run
/// now: over 80% of MemAvailable (the rest is for the machine's other work;
/// the estimates below already carry a margin over measured peaks).
pub(super) fn over_memory(need: u64) -> Option<String> {
    let avail = meminfo_kib("MemAvailable")? * 1024;
    (need > avail / 10 * 8)
        .then(|| format!("estimated peak ~{} MB, over 80% of the {} MB available now", need >> 20, avail >> 20))
}

/// Peak memory of kccl's benchmark process, in which every rank is a thread
/// (measured peak RSS on this machine, 2026-11-23, with ~25% margin):
/// - allreduce of float32 (param-server): each worker holds its input and
///   its result, plus the runtime's buffers: measured 2.4x the vector per
///   worker (Wav2Vec2-base, 4 workers: 3.6 GB; GPT-2 small, 4 workers: see
///   docs/BENCHMARKS.md); estimate 3x + 256 MB;
/// - reduce (agg-throughput, agg-gemm): the root holds its input, the
///   result and int64 accumulators, every sender its input; estimate 4x the
///   vector per rank (not limiting here: 512 MiB needs ~10 GB).
pub(super) fn kccl_memory(kind: Kind, senders: usize, bytes: usize) -> u64 {
    let bytes = bytes as u64;
    match kind {
        Kind::Allreduce => senders as u64 * bytes * 3 + (256 << 20),
        Kind::Reduce => (senders as u64 + 1) * bytes * 4,
    }
}

/// A peer rank is a Python process: the interpreter with torch or mpi4py,
/// the input, the result, the scripts' int64 reference arrays and the
/// library's buffers: measured up to 6.8x the vector per rank
/// (Gloo, 4 ranks: 10.3 GB at 380 MB, 13.4 GB at 496 MB); estimate 7.5x + 200 MB.
pub(super) fn peer_memory(ranks: usize, bytes: usize) -> u64 {
    ranks as u64 * (bytes as u64 * 15 / 2 + (200 << 20))
}
