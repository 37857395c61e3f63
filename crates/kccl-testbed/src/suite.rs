//! The benchmark suite behind `kccl bench all` (issue 5): the AggBox paper's
//! experiments (section 5) that fit one machine, each comparing the kernel
//! path, the tuned user-space path (same protocol) and the peers (Gloo, Open
//! MPI) where the operation exists, in one run.
//!
//! Nothing is measured here that the per-collective harnesses do not already
//! measure: broadcast runs through [`BcastHarness::measure`], aggregation
//! through [`AggHarness::measure`] and [`measure_cpu`], the peers through
//! [`peers::run`].  Each of those checks its result against a reference
//! before anything is timed and returns an error otherwise.  This module picks
//! the points, repeats them to show the machine's noise, turns the records into
//! one table per experiment (median, p99, ratio to the user-space path,
//! min/median/max of the repeats' medians), writes one JSON and one PNG per
//! experiment and `summary.md`.
//!
//! An experiment that fails (a result check, a peer that errs) is recorded as
//! failed in its JSON and in the summary; the others still run, and the suite's
//! outcome counts the failures so the CLI exits non-zero.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::bench::agg::{measure_cpu, rank_value, AggHarness, AggRecord, Kind, RootWork};
use crate::bench::{percentile, write_outputs, BcastHarness, BcastRecord};
use crate::cluster;
use crate::peers::{self, DType, Peer, PeerError, PeerOp, PeerResult, PeerSpec};
use kccl::agg::{AggConfig, AggOp};
use kccl::bcast::{Path, PathChoice};
use kccl::{Error, Result};

/// One experiment of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Experiment {
    BcastReceivers,
    BcastSize,
    AggThroughput,
    AggGemm,
    AggCpu,
    ParamServer,
    ScatterGather,
}

impl Experiment {
    pub const ALL: [Experiment; 7] = [
        Experiment::BcastReceivers,
        Experiment::BcastSize,
        Experiment::AggThroughput,
        Experiment::AggGemm,
        Experiment::AggCpu,
        Experiment::ParamServer,
        Experiment::ScatterGather,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Experiment::BcastReceivers => "bcast-receivers",
            Experiment::BcastSize => "bcast-size",
            Experiment::AggThroughput => "agg-throughput",
            Experiment::AggGemm => "agg-gemm",
            Experiment::AggCpu => "agg-cpu",
            Experiment::ParamServer => "param-server",
            Experiment::ScatterGather => "scatter-gather",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Experiment::BcastReceivers => "Broadcast latency vs receivers (AggBox fig. 3)",
            Experiment::BcastSize => "Broadcast latency vs packet size (AggBox fig. 4)",
            Experiment::AggThroughput => "Reduce time and throughput vs data size, 4 senders (AggBox fig. 7)",
            Experiment::AggGemm => "Reduce followed by user-space GEMM vs matrix size, 4 senders (AggBox fig. 8)",
            Experiment::AggCpu => "Aggregator CPU vs senders at a paced reduce load (AggBox fig. 11)",
            Experiment::ParamServer => "Parameter-server allreduce of model gradients vs workers (AggBox table 3)",
            Experiment::ScatterGather => "Scatter-gather fan-out/fan-in latency (sgbpf)",
        }
    }

    /// Runs Gloo and Open MPI (unless --no-peers).
    pub fn uses_peers(self) -> bool {
        !matches!(self, Experiment::AggCpu | Experiment::ScatterGather)
    }

    /// Needs root (namespaces, BPF).
    pub fn needs_root(self) -> bool {
        self != Experiment::ScatterGather
    }
}

impl std::fmt::Display for Experiment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Experiment {
    type Err = Error;
    fn from_str(s: &str) -> Result<Experiment> {
        Experiment::ALL.into_iter().find(|e| e.name() == s.trim()).ok_or_else(|| {
            let names: Vec<&str> = Experiment::ALL.iter().map(|e| e.name()).collect();
            Error::Usage(format!("unknown experiment '{s}': choose from {} (or all)", names.join(", ")))
        })
    }
}

/// Parses "all" or a comma list of experiment names (order kept, duplicates removed).
pub fn parse_experiments(list: &[String]) -> Result<Vec<Experiment>> {
    let mut out: Vec<Experiment> = Vec::new();
    for s in list {
        if s.trim() == "all" {
            out.extend(Experiment::ALL);
            continue;
        }
        out.push(s.parse()?);
    }
    if out.is_empty() {
        return Err(Error::Usage("--experiments: name at least one experiment (or all)".into()));
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// What to run.
#[derive(Debug, Clone)]
pub struct SuiteSpec {
    pub smoke: bool,
    pub out: PathBuf,
    pub experiments: Vec<Experiment>,
    /// Run Gloo and Open MPI too (`make setup-peers` installs them).
    pub peers: bool,
    /// Skip data sizes above this (bytes per rank); the skip is recorded.
    pub max_bytes: usize,
    /// param-server's worker counts (None: [`PS_WORKERS`], smoke 2).
    pub workers: Option<Vec<usize>>,
    /// Test of the result checks only ([`CORRUPT_ENV`]): this experiment's
    /// first checking rank corrupts one element of its checked result.
    pub corrupt: Option<Experiment>,
}

/// Test-only environment variable: `KCCL_BENCH_CORRUPT=<experiment>` makes
/// that experiment (agg-throughput, agg-gemm or param-server) corrupt one
/// element of each checked kccl result before the check, so the check fails,
/// the experiment is recorded as failed and `kccl bench all` exits 1.
pub const CORRUPT_ENV: &str = "KCCL_BENCH_CORRUPT";

/// Experiments whose checks [`CORRUPT_ENV`] can corrupt.
pub const CORRUPTIBLE: [Experiment; 3] = [Experiment::AggThroughput, Experiment::AggGemm, Experiment::ParamServer];

impl SuiteSpec {
    /// Checks the spec before anything is built: `out` must be a directory
    /// (it is created) and at least one experiment is named.
    pub fn validate(&self) -> Result<()> {
        if self.experiments.is_empty() {
            return Err(Error::Usage("no experiment selected".into()));
        }
        if self.out.exists() && !self.out.is_dir() {
            return Err(Error::Usage(format!(
                "--out {}: exists and is not a directory (the suite writes one JSON and one PNG per experiment and summary.md into it)",
                self.out.display()
            )));
        }
        if self.max_bytes < 4 {
            return Err(Error::Usage(format!("--max-bytes {}: must be at least 4", self.max_bytes)));
        }
        if let Some(w) = self.workers.as_ref().and_then(|w| w.iter().find(|&&w| !(1..=64).contains(&w))) {
            return Err(Error::Usage(format!("--workers {w}: param-server runs 1 to 64 workers")));
        }
        if let Some(e) = self.corrupt.filter(|e| !CORRUPTIBLE.contains(e)) {
            let names: Vec<&str> = CORRUPTIBLE.iter().map(|e| e.name()).collect();
            return Err(Error::Usage(format!(
                "{CORRUPT_ENV}={e}: only the checks of {} can be corrupted",
                names.join(", ")
            )));
        }
        Ok(())
    }
}

/// One row of an experiment's table: one system at one point.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SuiteRow {
    /// The point, e.g. "receivers=9" or "ResNet-34 workers=4".
    pub point: String,
    /// The x of the plot (receivers, bytes, N, senders, workers).
    #[serde(deserialize_with = "nan_if_null")]
    pub x: f64,
    /// A series of the plot within the experiment (the model for param-server).
    pub series: String,
    /// kccl-kernel, kccl-user, gloo or mpi.
    pub system: String,
    /// Median over repeats of each repeat's median (the experiment's unit).
    #[serde(deserialize_with = "nan_if_null")]
    pub median: f64,
    /// Median over repeats of each repeat's p99.
    #[serde(deserialize_with = "nan_if_null")]
    pub p99: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub mean: f64,
    /// Each repeat's median: min/median/max of these show the machine's noise.
    #[serde(deserialize_with = "nans_if_null")]
    pub repeat_medians: Vec<f64>,
    /// median / the kccl-user median at the same point (NaN without one).
    #[serde(deserialize_with = "nan_if_null")]
    pub ratio_to_user: f64,
    /// CPU per operation of every process/thread involved, in the unit's time
    /// unit (NaN where not measured).
    #[serde(deserialize_with = "nan_if_null")]
    pub cpu_per_op: f64,
    /// Elements aggregated per second (aggregation experiments), millions.
    #[serde(deserialize_with = "nan_if_null")]
    pub melem_per_s: f64,
    pub iters: usize,
}

/// The JSON of one experiment.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ExperimentResult {
    pub experiment: String,
    pub title: String,
    /// measured, partial (some points failed or were skipped), failed, not measured.
    pub status: String,
    pub smoke: bool,
    pub date: String,
    pub machine: String,
    /// What the median/p99 columns are.
    pub metric: String,
    pub unit: String,
    pub x_label: String,
    pub log_x: bool,
    pub rows: Vec<SuiteRow>,
    /// Points not run, each with the reason.
    pub skipped: Vec<String>,
    /// Failures (result checks, peers): the suite exits non-zero if any.
    pub errors: Vec<String>,
    pub notes: Vec<String>,
    /// The underlying records of the harnesses (every field they measured).
    pub raw: Vec<serde_json::Value>,
    pub seconds: f64,
}

/// serde_json writes NaN (not measured) as null; read it back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(<Option<f64> as serde::Deserialize>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn nans_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<f64>, D::Error> {
    let v = <Vec<Option<f64>> as serde::Deserialize>::deserialize(d)?;
    Ok(v.into_iter().map(|x| x.unwrap_or(f64::NAN)).collect())
}

/// An experiment's JSON written by an earlier run into `dir`, if any.
fn load_earlier(dir: &std::path::Path, e: Experiment) -> Option<ExperimentResult> {
    let text = std::fs::read_to_string(dir.join(format!("{}.json", e.name()))).ok()?;
    let mut v: Vec<ExperimentResult> = serde_json::from_str(&text).ok()?;
    v.pop().filter(|r| r.experiment == e.name())
}

impl ExperimentResult {
    fn new(e: Experiment, spec: &SuiteSpec, env: &Env, metric: &str, unit: &str, x_label: &str, log_x: bool) -> Self {
        ExperimentResult {
            experiment: e.name().into(),
            title: e.title().into(),
            status: "measured".into(),
            smoke: spec.smoke,
            date: env.date.clone(),
            machine: env.machine.clone(),
            metric: metric.into(),
            unit: unit.into(),
            x_label: x_label.into(),
            log_x,
            rows: Vec::new(),
            skipped: Vec::new(),
            errors: Vec::new(),
            notes: Vec::new(),
            raw: Vec::new(),
            seconds: 0.0,
        }
    }

    fn raw<T: serde::Serialize>(&mut self, tag: &str, r: &T) {
        if let Ok(mut v) = serde_json::to_value(r) {
            if let Some(o) = v.as_object_mut() {
                o.insert("tag".into(), tag.into());
            }
            self.raw.push(v);
        }
    }
}

/// What the suite did.
#[derive(Debug)]
pub struct SuiteOutcome {
    pub results: Vec<ExperimentResult>,
    pub summary: PathBuf,
    /// Experiments with at least one error.
    pub failed: usize,
}

impl SuiteOutcome {
    /// The process's exit status: 1 if any experiment recorded an error (a
    /// result check that failed, a peer that failed), else 0.
    pub fn exit_status(&self) -> u8 {
        exit_status(&self.results)
    }
}

/// Experiments of `results` that recorded an error.
fn failed_count(results: &[ExperimentResult]) -> usize {
    results.iter().filter(|r| !r.errors.is_empty()).count()
}

/// See [`SuiteOutcome::exit_status`].
pub fn exit_status(results: &[ExperimentResult]) -> u8 {
    u8::from(failed_count(results) > 0)
}

/// The date and the machine, for the record.
struct Env {
    date: String,
    machine: String,
}

impl Env {
    fn probe() -> Env {
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

fn cmd_out(cmd: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(cmd).args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// A field of /proc/meminfo in KiB.
fn meminfo_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Why a point whose peak memory is estimated at `need` bytes cannot run
/// now: over 80% of MemAvailable (the rest is for the machine's other work;
/// the estimates below already carry a margin over measured peaks).
fn over_memory(need: u64) -> Option<String> {
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
fn kccl_memory(kind: Kind, senders: usize, bytes: usize) -> u64 {
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
fn peer_memory(ranks: usize, bytes: usize) -> u64 {
    ranks as u64 * (bytes as u64 * 15 / 2 + (200 << 20))
}

/// Prints where the suite is.
struct Progress {
    t0: Instant,
    idx: usize,
    total: usize,
    name: &'static str,
}

impl Progress {
    fn say(&self, msg: impl AsRef<str>) {
        let s = self.t0.elapsed().as_secs();
        println!("[{}/{} {} {:02}:{:02}] {}", self.idx, self.total, self.name, s / 60, s % 60, msg.as_ref());
    }
}

/// Per (point, system): one sample per repeat.
#[derive(Default)]
struct Acc {
    /// Key: (series, x as bits, point, system) keeps the plot order.
    cells: BTreeMap<(String, u64, String, String), Vec<Sample>>,
}

#[derive(Clone, Copy)]
struct Sample {
    median: f64,
    p99: f64,
    mean: f64,
    cpu: f64,
    melem: f64,
    iters: usize,
}

impl Sample {
    fn new(median: f64, p99: f64) -> Sample {
        Sample { median, p99, mean: f64::NAN, cpu: f64::NAN, melem: f64::NAN, iters: 0 }
    }
}

impl Acc {
    fn add(&mut self, series: &str, x: f64, point: &str, system: &str, s: Sample) {
        self.cells.entry((series.into(), x.to_bits(), point.into(), system.into())).or_default().push(s);
    }

    fn rows(self) -> Vec<SuiteRow> {
        let med = |v: Vec<f64>| {
            let mut v: Vec<f64> = v.into_iter().filter(|x| !x.is_nan()).collect();
            v.sort_by(f64::total_cmp);
            percentile(&v, 50.0)
        };
        let mut rows: Vec<SuiteRow> = self
            .cells
            .into_iter()
            .map(|((series, x, point, system), ss)| SuiteRow {
                point,
                x: f64::from_bits(x),
                series,
                system,
                median: med(ss.iter().map(|s| s.median).collect()),
                p99: med(ss.iter().map(|s| s.p99).collect()),
                mean: med(ss.iter().map(|s| s.mean).collect()),
                repeat_medians: ss.iter().map(|s| s.median).collect(),
                ratio_to_user: f64::NAN,
                cpu_per_op: med(ss.iter().map(|s| s.cpu).collect()),
                melem_per_s: med(ss.iter().map(|s| s.melem).collect()),
                iters: ss.iter().map(|s| s.iters).sum(),
            })
            .collect();
        let user: BTreeMap<(String, String), f64> = rows
            .iter()
            .filter(|r| r.system == SYS_USER)
            .map(|r| ((r.series.clone(), r.point.clone()), r.median))
            .collect();
        for r in &mut rows {
            if let Some(u) = user.get(&(r.series.clone(), r.point.clone())) {
                r.ratio_to_user = r.median / u;
            }
        }
        rows
    }
}

const SYS_KERNEL: &str = "kccl-kernel";
const SYS_USER: &str = "kccl-user";

fn sys_of(p: Path) -> &'static str {
    match p {
        Path::Kernel => SYS_KERNEL,
        Path::User => SYS_USER,
    }
}

/// One point the peers run: `runs` separate runs (each starts its ranks
/// anew), each one sample of the point, so the summary shows min/median/max
/// across runs as it does for kccl's repeats.
struct PeerPoint<'a> {
    op: PeerOp,
    dtype: DType,
    bytes: usize,
    ranks: usize,
    /// (warm-up, timed) iterations per run, at most; None: the runner's default for the size.
    iters: Option<(usize, usize)>,
    runs: usize,
    series: &'a str,
    x: f64,
    point: &'a str,
    /// Factor from microseconds to the experiment's unit.
    to_unit: f64,
    /// Contributing senders for Melem/s (0: none).
    senders: usize,
    /// Added to each run's median, p99 and mean (agg-gemm: the root's GEMM,
    /// which the peers' scripts do not do), in the experiment's unit.
    extra: f64,
}

/// Runs of each peer point: one in the smoke run (which also takes the
/// runner's 1 warm-up + 5 timed iterations at most).
fn peer_runs(spec: &SuiteSpec, runs: usize) -> usize {
    if spec.smoke {
        1
    } else {
        runs.max(1)
    }
}

/// The peers' reduce of `bytes` per rank by SENDERS senders to host 0, as
/// agg-throughput and agg-gemm time it (`extra`: agg-gemm's GEMM, in ms).
fn reduce_peer_point<'a>(bytes: usize, iters: (usize, usize), x: f64, point: &'a str, extra: f64) -> PeerPoint<'a> {
    PeerPoint {
        op: PeerOp::Reduce,
        dtype: DType::Int32,
        bytes,
        ranks: SENDERS + 1,
        iters: Some(iters),
        runs: PEER_RUNS,
        series: "",
        x,
        point,
        to_unit: 1e-3,
        senders: SENDERS,
        extra,
    }
}

/// Runs the peers of one point, adding verified results to `acc`; a peer that
/// fails is recorded in `res.errors` (a failed check is a failure of the suite).
fn run_peers(
    spec: &SuiteSpec,
    res: &mut ExperimentResult,
    acc: &mut Acc,
    prog: &Progress,
    cl: &cluster::Cluster,
    pp: &PeerPoint<'_>,
) {
    if !spec.peers {
        return;
    }
    let (point, ranks, bytes, op) = (pp.point, pp.ranks, pp.bytes, pp.op);
    if let Some(why) = over_memory(peer_memory(ranks, bytes)) {
        res.skipped.push(format!("{point}: gloo and mpi not run: {ranks} ranks x {bytes} B: {why}"));
        return;
    }
    let runs = peer_runs(spec, pp.runs);
    for run_i in 0..runs {
        for peer in [Peer::Gloo, Peer::Mpi] {
            let run = || -> std::result::Result<PeerResult, PeerError> {
                let mut ps = PeerSpec::new(peer, op, pp.dtype, bytes, ranks)?;
                if spec.smoke {
                    ps = ps.smoke();
                }
                if let Some((w, n)) = pp.iters {
                    ps.warmup = w.min(ps.warmup);
                    ps.iters = n.min(ps.iters);
                }
                peers::run(cl, &ps)
            };
            prog.say(format!("{point}: {peer} {op} ({ranks} ranks, {bytes} B {}), run {}/{runs}", pp.dtype, run_i + 1));
            match run() {
                Ok(r) => {
                    prog.say(format!("  {}", r.summary()));
                    let mut s = Sample::new(r.median_us * pp.to_unit + pp.extra, r.p99_us * pp.to_unit + pp.extra);
                    s.mean = r.mean_us * pp.to_unit + pp.extra;
                    s.cpu = r.cpu_median_us * pp.to_unit;
                    s.iters = r.iters;
                    if pp.senders > 0 {
                        // Of the whole timed figure, as kccl's rows (agg-gemm: with the GEMM).
                        let med_us = r.median_us + pp.extra / pp.to_unit;
                        s.melem = (bytes / 4 * pp.senders) as f64 / (med_us / 1e6) / 1e6;
                    }
                    acc.add(pp.series, pp.x, point, &peer.to_string(), s);
                    let mut r = r;
                    // The per-iteration samples stay in `kccl bench peers`; here the summary suffices.
                    r.samples_us.clear();
                    r.cpu_samples_us.clear();
                    res.raw(&format!("{point} run {run_i}"), &r);
                }
                Err(e) => {
                    res.errors.push(format!("{point}: {peer} {op}: {e}"));
                    return;
                }
            }
        }
    }
}

/// Runs the suite; see the module comment.
pub fn run(spec: &SuiteSpec) -> Result<SuiteOutcome> {
    spec.validate()?;
    std::fs::create_dir_all(&spec.out).map_err(|e| Error::io(format!("creating {}", spec.out.display()), e))?;
    let env = Env::probe();
    println!("== kccl benchmark suite{}: {}", if spec.smoke { " (smoke)" } else { "" }, env.machine);
    if spec.peers && spec.experiments.iter().any(|e| e.uses_peers()) {
        for p in [Peer::Gloo, Peer::Mpi] {
            if let Err(e) = peers::check_installed(p) {
                return Err(Error::Usage(format!("{e} (or run the suite with --no-peers)")));
            }
        }
    }
    let t0 = Instant::now();
    let total = spec.experiments.len();
    let summary = spec.out.join("summary.md");
    let mut results = Vec::new();
    for (i, &e) in spec.experiments.iter().enumerate() {
        let prog = Progress { t0, idx: i + 1, total, name: e.name() };
        prog.say(format!("start: {}", e.title()));
        let te = Instant::now();
        let mut res = match e {
            Experiment::BcastReceivers | Experiment::BcastSize => bcast(e, spec, &env, &prog),
            Experiment::AggThroughput => agg_throughput(spec, &env, &prog),
            Experiment::AggGemm => agg_gemm(spec, &env, &prog),
            Experiment::AggCpu => agg_cpu(spec, &env, &prog),
            Experiment::ParamServer => param_server(spec, &env, &prog),
            Experiment::ScatterGather => {
                let mut r = ExperimentResult::new(e, spec, &env, "latency", "us", "workers", false);
                r.status = "not measured".into();
                r.notes.push(SG_NOT_MEASURED.into());
                r
            }
        };
        res.seconds = te.elapsed().as_secs_f64();
        if res.status != "not measured" {
            if !res.errors.is_empty() {
                res.status = if res.rows.is_empty() { "failed" } else { "partial" }.into();
            } else if !res.skipped.is_empty() {
                res.status = "partial".into();
            }
        }
        let json = spec.out.join(format!("{}.json", e.name()));
        let png = spec.out.join(format!("{}.png", e.name()));
        let plot = (!res.rows.is_empty()).then_some(png.as_path());
        if let Err(err) = write_outputs(std::slice::from_ref(&res), &json, plot, "suite") {
            res.errors.push(format!("writing {}: {err}", json.display()));
        }
        prog.say(format!(
            "done in {:.0} s: {} ({} rows, {} skipped, {} errors) -> {}",
            res.seconds,
            res.status,
            res.rows.len(),
            res.skipped.len(),
            res.errors.len(),
            json.display()
        ));
        for k in &res.skipped {
            prog.say(format!("  skipped: {k}"));
        }
        for err in &res.errors {
            prog.say(format!("  FAILED: {err}"));
        }
        results.push(res);
        // After every experiment: a run stopped part-way still has the table of what it finished.
        // Experiments not run this time keep the results an earlier run left in the directory
        // (each with its own date), so a partial re-run updates the summary instead of shrinking it.
        let mut all: Vec<ExperimentResult> = Vec::new();
        for e in Experiment::ALL {
            if let Some(r) = results.iter().find(|r| r.experiment == e.name()) {
                all.push(r.clone());
            } else if !spec.experiments.contains(&e) {
                all.extend(load_earlier(&spec.out, e).filter(|r| r.smoke == spec.smoke));
            }
        }
        let text = summary_md(&all, &env, spec);
        std::fs::write(&summary, text).map_err(|e| Error::io(format!("writing {}", summary.display()), e))?;
    }
    let failed = failed_count(&results);
    Ok(SuiteOutcome { results, summary, failed })
}

const SG_NOT_MEASURED: &str = "not measured: scatter-gather does not exist yet (roadmap item 5); \
     the comparison with blocking, epoll and io_uring baselines waits for it";

// ---------------------------------------------------------------- broadcast

/// Series of the broadcast experiments: first send to the last receiving
/// application returning the message (every system), and to the kernel's
/// receive timestamp of the last datagram at the last receiver (kccl only).
const BC_APP: &str = "app";
const BC_HELD: &str = "held";

struct BcastPlan {
    receivers: Vec<usize>,
    size: usize,
    sizes: Vec<usize>,
    size_receivers: usize,
    iters: usize,
    repeats: usize,
    peer_receivers: Vec<usize>,
    /// Separate runs of each peer point, and timed broadcasts per run.
    peer_runs: usize,
    peer_iters: usize,
}

fn bcast_plan(smoke: bool) -> BcastPlan {
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

fn bcast(e: Experiment, spec: &SuiteSpec, env: &Env, prog: &Progress) -> ExperimentResult {
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
    let measured = h.with_sender(PathChoice::Kernel, |h, b| {
        let mut out: Vec<(usize, BcastRecord)> = Vec::new();
        for rep in 0..plan.repeats {
            for &(n, size) in &points {
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

// -------------------------------------------------------------- aggregation

const SENDERS: usize = 4;

fn agg_cfg() -> AggConfig {
    // Large vectors on a loaded 2-core machine: allow slow progress.
    AggConfig { deadline: Duration::from_secs(120), ..AggConfig::default() }
}

fn agg_sample(r: &AggRecord) -> Sample {
    let mut s = Sample::new(r.p50_ms, r.p99_ms);
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
fn agg_iters(smoke: bool, bytes: usize) -> (usize, usize) {
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
fn peer_reduce_iters(bytes: usize) -> (usize, usize) {
    if bytes >= 64 << 20 {
        (1, 4)
    } else {
        (2, 10)
    }
}

/// Separate runs of every peer point of the broadcast and reduce experiments.
const PEER_RUNS: usize = 3;

/// The repeats of one reduce point through both kccl paths (SENDERS
/// senders, checked by the harness before timing) into `acc` at `x`, with
/// the root's `work` on each result inside the timed operation (agg-gemm).
/// Returns the records.  Stops at the first failed repeat.
#[allow(clippy::too_many_arguments)]
fn kccl_reduce_repeats(
    spec: &SuiteSpec,
    h: &AggHarness,
    res: &mut ExperimentResult,
    acc: &mut Acc,
    prog: &Progress,
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
struct AggCluster {
    name: String,
    h: AggHarness,
    peers: Result<cluster::Cluster>,
}

impl AggCluster {
    /// Builds a cluster named `prefix`-unique with `senders` + 1 hosts for
    /// experiment `e` (the suite's test of its result checks,
    /// `KCCL_BENCH_CORRUPT=e`, switched on if asked).
    fn up(spec: &SuiteSpec, e: Experiment, prefix: &str, senders: usize, prog: &Progress, what: &str) -> Result<Self> {
        let name = cluster::unique_name(prefix);
        prog.say(format!("cluster {name}: {} hosts{what}", senders + 1));
        let mut h = AggHarness::new(&name, senders)?;
        h.corrupt_results = spec.corrupt == Some(e);
        let peers = cluster::load(&name);
        Ok(AggCluster { name, h, peers })
    }

    /// [`run_peers`] on this cluster's hosts.
    fn run_peers(
        &self,
        spec: &SuiteSpec,
        res: &mut ExperimentResult,
        acc: &mut Acc,
        prog: &Progress,
        pp: &PeerPoint<'_>,
    ) {
        match &self.peers {
            Ok(cl) => run_peers(spec, res, acc, prog, cl, pp),
            Err(err) => res.errors.push(format!("loading cluster {} for the peers: {err}", self.name)),
        }
    }
}

fn agg_throughput(spec: &SuiteSpec, env: &Env, prog: &Progress) -> ExperimentResult {
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
    for &bytes in &sizes {
        let point = format!("bytes={bytes}");
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

/// C = A x B for n x n row-major matrices (i-k-j order, vectorizable).
fn gemm(a: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0f32; n * n];
    for i in 0..n {
        let ci = &mut c[i * n..(i + 1) * n];
        for k in 0..n {
            let aik = a[i * n + k];
            let bk = &b[k * n..(k + 1) * n];
            for (cv, bv) in ci.iter_mut().zip(bk) {
                *cv += aik * bv;
            }
        }
    }
    c
}

/// The f64 reference of [`gemm`]: the product and, per entry, the sum of the
/// magnitudes of its terms (what the float32 rounding error is bounded by).
fn gemm_f64(a: &[f64], b: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut c, mut mag) = (vec![0f64; n * n], vec![0f64; n * n]);
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            let bk = &b[k * n..(k + 1) * n];
            let (ci, mi) = (&mut c[i * n..(i + 1) * n], &mut mag[i * n..(i + 1) * n]);
            for ((cv, mv), &bv) in ci.iter_mut().zip(mi.iter_mut()).zip(bk) {
                let p = aik * f64::from(bv);
                *cv += p;
                *mv += p.abs();
            }
        }
    }
    (c, mag)
}

/// Checks every entry of a float32 product of n-term dot products against
/// the f64 reference: a sum of n float32 terms accumulated in order is off
/// by at most gamma_n * sum|terms|, gamma_n = n u / (1 - n u), u = 2^-24
/// (the products of these integer-valued matrices are exact in float32).
fn check_gemm(c: &[f32], want: &[f64], mag: &[f64], n: usize) -> Result<()> {
    let nu = n as f64 * f64::from(f32::EPSILON) / 2.0;
    let gamma = nu / (1.0 - nu);
    if c.len() != want.len() {
        return Err(Error::Usage(format!("GEMM check: {} entries, expected {}", c.len(), want.len())));
    }
    for (idx, ((&got, &w), &m)) in c.iter().zip(want).zip(mag).enumerate() {
        let tol = gamma * m + m * 1e-12;
        if (f64::from(got) - w).abs() > tol || got.is_nan() {
            return Err(Error::Usage(format!(
                "GEMM check: C[{}][{}] = {got}, expected {w} within {tol:.3e}",
                idx / n,
                idx % n
            )));
        }
    }
    Ok(())
}

fn agg_gemm(spec: &SuiteSpec, env: &Env, prog: &Progress) -> ExperimentResult {
    let e = Experiment::AggGemm;
    let mut res = ExperimentResult::new(
        e,
        spec,
        env,
        "reduce of N x N int32 matrices and the root's float32 GEMM of the result, one timed operation",
        "ms",
        "matrix size N",
        true,
    );
    let ns: Vec<usize> = if spec.smoke { vec![64, 128] } else { vec![128, 256, 512, 1024] };
    res.notes.push(format!(
        "kccl: each timed operation runs from the barrier all ranks leave together (every rank's first send) to the root \
         holding C = float32(reduced matrix) x B (single-threaded i-k-j GEMM, B a fixed N x N matrix), as in the paper's \
         figure 8; median/p99 are those of these per-operation totals; before timing, each path's checked operation compares \
         the reduced matrix element by element and every entry of C with an f64 reference (float32 bound n 2^-24 sum|a b|); \
         `gemm-only` = the median time of the GEMM inside the timed operations (both paths); peers ({} run(s)): their \
         timed reduce + that GEMM median, since the peers' scripts do not multiply (not one timed operation)",
        peer_runs(spec, PEER_RUNS)
    ));
    let mut acc = Acc::default();
    let c = match AggCluster::up(spec, e, "su-gm", SENDERS, prog, "") {
        Ok(c) => c,
        Err(err) => {
            res.errors.push(format!("building the cluster: {err}"));
            return res;
        }
    };
    let contributors: Vec<u16> = (0..=SENDERS as u16).collect();
    for &n in &ns {
        let point = format!("N={n}");
        let bytes = n * n * 4;
        if bytes > spec.max_bytes {
            res.skipped.push(format!("{point}: {bytes} B per rank above --max-bytes {}", spec.max_bytes));
            continue;
        }
        prog.say(format!("{point}: f64 reference of the GEMM on the reduced matrix"));
        let sum: Vec<f64> =
            (0..n * n).map(|i| f64::from(contributors.iter().map(|&r| rank_value(r, i)).sum::<i32>())).collect();
        let b: Vec<f32> = (0..n * n).map(|i| rank_value(0, i) as f32).collect();
        let (want, mag) = gemm_f64(&sum, &b, n);
        let work = |r: &[i32], check: bool| -> Result<()> {
            let a: Vec<f32> = r.iter().map(|&v| v as f32).collect();
            let c = gemm(&a, &b, n);
            if check {
                check_gemm(&c, &want, &mag, n)?;
            }
            std::hint::black_box(&c);
            Ok(())
        };
        let recs = kccl_reduce_repeats(spec, &c.h, &mut res, &mut acc, prog, &point, n as f64, bytes, Some(&work));
        let mut g: Vec<f64> = recs.iter().filter_map(|r| r.root_work_p50_ms).collect();
        g.sort_by(f64::total_cmp);
        if g.is_empty() {
            continue;
        }
        let g50 = percentile(&g, 50.0);
        prog.say(format!("  GEMM {n}x{n} inside the timed reduce: median {g50:.2} ms"));
        let mut gs = Sample::new(g50, f64::NAN);
        gs.iters = recs.iter().map(|r| r.iters).sum();
        acc.add("", n as f64, &point, "gemm-only", gs);
        let pp = reduce_peer_point(bytes, (3, 20), n as f64, &point, g50);
        c.run_peers(spec, &mut res, &mut acc, prog, &pp);
    }
    drop(c);
    res.rows = acc.rows();
    res
}

fn agg_cpu(spec: &SuiteSpec, env: &Env, prog: &Progress) -> ExperimentResult {
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
    for &n in &senders {
        let point = format!("senders={n}");
        for rep in 0..reps {
            for choice in [PathChoice::Kernel, PathChoice::User] {
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

/// The models of AggBox's table 3: (name, float32 parameters).
pub const MODELS: [(&str, usize); 3] =
    [("ResNet-34", 21_800_000), ("Wav2Vec2-base", 95_000_000), ("GPT-2 small", 124_000_000)];

/// Worker counts of the paper's table 3 (`--workers 2,4,6,8,10`).
pub const PS_WORKERS_ALL: [usize; 5] = [2, 4, 6, 8, 10];

/// Worker counts of a default full run: float32 allreduces of these models at
/// 6 to 10 workers take 15-40 s per operation on this 2-core machine, and 6
/// operations per path and point (1 checked + 5 timed) of every column would
/// take the full run from ~35 minutes to well over an hour (docs/BENCHMARKS.md,
/// "Time of the full run").  4 workers is the issue's target.
pub const PS_WORKERS: [usize; 2] = [2, 4];

/// Timed allreduces per path and point (after one checked one), and separate
/// runs of each peer point (each up to 1 warm-up + 3 timed).  One peer run:
/// a second would add ~1 minute (start-up of every rank, 4 more allreduces
/// per point), over the full run's budget; `kccl bench peers` repeats them.
const PS_ITERS: usize = 5;
const PS_PEER_RUNS: usize = 1;

fn param_server(spec: &SuiteSpec, env: &Env, prog: &Progress) -> ExperimentResult {
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
         quantization, the exponent pre-pass and dequantization inside the timed call; kccl: host 0 is the aggregator service and \
         workers are hosts 1..=W, the peers run W ranks on hosts 0..W-1, float32 too; before timing, each path's checked \
         allreduce is compared on every worker with the f64 sum within the documented quantization bound; 1 checked + {iters} \
         timed operations per path; peers: {ps_runs} run(s) of 1 warm-up + up to 3 timed{}",
        if scale > 1 { format!("; SMOKE: every model scaled down {scale}x") } else { String::new() }
    ));
    let mut acc = Acc::default();
    for &w in &workers {
        let models: Vec<(&str, usize)> = MODELS
            .iter()
            .map(|&(m, p)| (m, p / scale * 4))
            .filter(|&(m, bytes)| {
                let point = format!("{m} workers={w}");
                if bytes > spec.max_bytes {
                    res.skipped.push(format!("{point}: {bytes} B above --max-bytes {}", spec.max_bytes));
                    return false;
                }
                if let Some(why) = over_memory(kccl_memory(Kind::Allreduce, w, bytes)) {
                    res.skipped.push(format!("{point}: {w} workers x {bytes} B in this process: {why}"));
                    return false;
                }
                true
            })
            .collect();
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
            prog.say(format!("{point}: float32 allreduce of {bytes} B, both paths, {iters} timed each"));
            match c.h.measure_with::<f32>(
                Kind::Allreduce,
                AggOp::Sum,
                w,
                &[PathChoice::Kernel, PathChoice::User],
                &[bytes],
                iters,
                &agg_cfg(),
                None,
            ) {
                Ok(rows) => {
                    for r in rows {
                        acc.add(m, w as f64, &point, sys_of(r.path), agg_sample(&r));
                        res.raw(&point, &r);
                    }
                }
                Err(err) => res.errors.push(format!("{point}: kccl allreduce: {err}")),
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

// ------------------------------------------------------------------ summary

fn fmt_v(v: f64) -> String {
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

fn find<'a>(
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

/// The issue's targets, checked against this run's figures.
fn targets(res: &[ExperimentResult]) -> Vec<String> {
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
    out
}

fn summary_md(res: &[ExperimentResult], env: &Env, spec: &SuiteSpec) -> String {
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
    let _ = writeln!(s, "## Targets of issue 5 (this run)\n");
    for t in targets(res) {
        let _ = writeln!(s, "- {t}");
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experiment_names_parse() {
        for e in Experiment::ALL {
            assert_eq!(e.name().parse::<Experiment>().ok(), Some(e));
        }
        let err = "bcast".parse::<Experiment>().expect_err("unknown name");
        assert!(err.to_string().contains("bcast-receivers"), "{err}");
        let all = parse_experiments(&["all".into()]).expect("all");
        assert_eq!(all, Experiment::ALL.to_vec());
        let two = parse_experiments(&["param-server".into(), "bcast-size".into(), "bcast-size".into()]).expect("two");
        assert_eq!(two, vec![Experiment::BcastSize, Experiment::ParamServer]);
        assert!(parse_experiments(&[]).is_err());
    }

    #[test]
    fn rows_take_medians_and_ratio_to_user() {
        let mut acc = Acc::default();
        for (m, p) in [(10.0, 20.0), (12.0, 30.0), (11.0, 25.0)] {
            acc.add("", 9.0, "receivers=9", SYS_KERNEL, Sample::new(m, p));
        }
        acc.add("", 9.0, "receivers=9", SYS_USER, Sample::new(44.0, 50.0));
        acc.add("", 9.0, "receivers=9", "gloo", Sample::new(88.0, 90.0));
        let rows = acc.rows();
        let k = rows.iter().find(|r| r.system == SYS_KERNEL).expect("kernel row");
        assert_eq!((k.median, k.p99), (11.0, 25.0));
        assert_eq!(k.repeat_medians, vec![10.0, 12.0, 11.0]);
        assert_eq!(k.ratio_to_user, 0.25);
        let g = rows.iter().find(|r| r.system == "gloo").expect("gloo row");
        assert_eq!(g.ratio_to_user, 2.0);
    }

    #[test]
    fn gemm_matches_naive() {
        let n = 5;
        let a: Vec<f32> = (0..n * n).map(|i| i as f32 - 7.0).collect();
        let b: Vec<f32> = (0..n * n).map(|i| (i % 3) as f32).collect();
        let c = gemm(&a, &b, n);
        for i in 0..n {
            for j in 0..n {
                let want: f32 = (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum();
                assert_eq!(c[i * n + j], want);
            }
        }
    }

    #[test]
    fn gemm_check_accepts_the_product_and_refuses_a_wrong_entry() {
        let n = 64;
        let a: Vec<f64> = (0..n * n).map(|i| f64::from((0..5).map(|r| rank_value(r, i)).sum::<i32>())).collect();
        let b: Vec<f32> = (0..n * n).map(|i| rank_value(0, i) as f32).collect();
        let (want, mag) = gemm_f64(&a, &b, n);
        let af: Vec<f32> = a.iter().map(|&v| v as f32).collect();
        let mut c = gemm(&af, &b, n);
        check_gemm(&c, &want, &mag, n).expect("the float32 product is within the bound");
        // One entry off by 1e-3 of its terms' magnitudes (the bound is 64 * 2^-24 = 3.8e-6 of them).
        c[3 * n + 5] += (mag[3 * n + 5] * 1e-3) as f32;
        let err = check_gemm(&c, &want, &mag, n).expect_err("a wrong entry");
        assert!(err.to_string().contains("C[3][5]"), "{err}");
    }

    fn result_with(errors: &[&str]) -> ExperimentResult {
        let spec = failed_spec();
        let env = Env { date: "d".into(), machine: "m".into() };
        let mut r = ExperimentResult::new(Experiment::AggThroughput, &spec, &env, "t", "ms", "bytes", true);
        r.errors = errors.iter().map(|e| e.to_string()).collect();
        r
    }

    #[test]
    fn exit_status_is_one_when_any_experiment_failed() {
        assert_eq!(exit_status(&[]), 0);
        assert_eq!(exit_status(&[result_with(&[]), result_with(&[])]), 0);
        let failed = [result_with(&[]), result_with(&["bytes=65536: kccl reduce: reduce check: ..."])];
        assert_eq!(exit_status(&failed), 1);
        assert_eq!(failed_count(&failed), 1);
        // The summary marks it.
        let env = Env { date: "d".into(), machine: "m".into() };
        let md = summary_md(&failed, &env, &SuiteSpec { smoke: true, ..failed_spec() });
        assert!(md.contains("- **FAILED**: bytes=65536: kccl reduce"), "{md}");
    }

    fn failed_spec() -> SuiteSpec {
        SuiteSpec {
            smoke: false,
            out: PathBuf::from("/tmp"),
            experiments: vec![Experiment::AggThroughput],
            peers: false,
            max_bytes: usize::MAX,
            workers: None,
            corrupt: None,
        }
    }

    #[test]
    fn spec_refuses_corrupting_an_experiment_without_kccl_checks() {
        let mut spec = failed_spec();
        spec.corrupt = Some(Experiment::BcastSize);
        let err = spec.validate().expect_err("bcast-size cannot be corrupted");
        assert!(err.to_string().contains(CORRUPT_ENV) && err.to_string().contains("agg-gemm"), "{err}");
        spec.corrupt = Some(Experiment::AggGemm);
        spec.validate().expect("agg-gemm can");
        spec.workers = Some(vec![2, 0]);
        assert!(spec.validate().is_err());
    }

    #[test]
    fn spec_rejects_a_file_as_out() {
        let spec = SuiteSpec {
            smoke: true,
            out: PathBuf::from("/proc/self/status"),
            experiments: vec![Experiment::ScatterGather],
            peers: false,
            max_bytes: usize::MAX,
            workers: None,
            corrupt: None,
        };
        let err = spec.validate().expect_err("a file is not a directory");
        assert!(err.to_string().contains("not a directory"), "{err}");
    }

    #[test]
    fn results_round_trip_through_json_with_nan() {
        let dir = std::env::temp_dir().join(format!("kccl-suite-rt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let spec = SuiteSpec {
            smoke: true,
            out: dir.clone(),
            experiments: vec![Experiment::AggCpu],
            peers: false,
            max_bytes: usize::MAX,
            workers: None,
            corrupt: None,
        };
        let env = Env { date: "d".into(), machine: "m".into() };
        let mut r = ExperimentResult::new(Experiment::AggCpu, &spec, &env, "cpu", "%", "senders", false);
        let mut acc = Acc::default();
        acc.add("", 2.0, "senders=2", SYS_KERNEL, Sample::new(3.0, f64::NAN));
        r.rows = acc.rows();
        write_outputs(std::slice::from_ref(&r), &dir.join("agg-cpu.json"), None, "suite").expect("write");
        let back = load_earlier(&dir, Experiment::AggCpu).expect("read back");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(back.rows.len(), 1);
        assert_eq!(back.rows[0].median, 3.0);
        assert!(back.rows[0].p99.is_nan() && back.rows[0].ratio_to_user.is_nan());
        assert!(load_earlier(std::path::Path::new("/nonexistent"), Experiment::AggCpu).is_none());
    }

    #[test]
    fn targets_say_not_measured_without_rows() {
        let t = targets(&[]);
        assert_eq!(t.len(), 3);
        assert!(t.iter().all(|l| l.contains("not measured")), "{t:?}");
    }
}
