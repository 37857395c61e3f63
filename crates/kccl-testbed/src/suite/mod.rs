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

use crate::bench::agg::{rank_value, AggHarness, AggRecord, Kind, RootWork};
use crate::bench::cpu::measure_cpu;
use crate::bench::{percentile, write_outputs, BcastHarness, BcastRecord};
use crate::cluster;
use crate::error::{Error, Result};
use crate::peers::{self, DType, Peer, PeerError, PeerOp, PeerResult, PeerSpec};
use crate::progress::Progress;
use kccl::agg::{AggConfig, AggOp, AllreduceMode};
use kccl::transport::{Path, PathChoice};

mod agg;
mod bcast;
mod env;
mod gemm;
mod param_server;
mod report;

use agg::*;
use bcast::*;
use env::*;
use gemm::*;
use param_server::*;
use report::*;

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
            Experiment::BcastReceivers => "Broadcast latency vs receivers (the AggBox paper's fig. 3)",
            Experiment::BcastSize => "Broadcast latency vs packet size (the AggBox paper's fig. 4)",
            Experiment::AggThroughput => {
                "Reduce time and throughput vs data size, 4 senders (the AggBox paper's fig. 7)"
            }
            Experiment::AggGemm => {
                "Reduce followed by user-space GEMM vs matrix size, 4 senders (the AggBox paper's fig. 8)"
            }
            Experiment::AggCpu => "Aggregator CPU vs senders at a paced reduce load (the AggBox paper's fig. 11)",
            Experiment::ParamServer => {
                "Parameter-server allreduce of model gradients vs workers (the AggBox paper's table 3)"
            }
            Experiment::ScatterGather => "Scatter-gather fan-out/fan-in latency (the sgbpf paper's)",
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
            Error::setting(format!("unknown experiment '{s}'"), format!("choose from {} (or all)", names.join(", ")))
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
        return Err(Error::setting("--experiments", "name at least one experiment (or all)"));
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
            return Err(Error::setting("--experiments", "no experiment selected"));
        }
        if self.out.exists() && !self.out.is_dir() {
            return Err(Error::setting(
                format!("--out {}", self.out.display()),
                "exists and is not a directory (the suite writes one JSON and one PNG per experiment and summary.md into it)",
            ));
        }
        if self.max_bytes < 4 {
            return Err(Error::setting(format!("--max-bytes {}", self.max_bytes), "must be at least 4"));
        }
        if let Some(w) = self.workers.as_ref().and_then(|w| w.iter().find(|&&w| !(1..=64).contains(&w))) {
            return Err(Error::setting(format!("--workers {w}"), "param-server runs 1 to 64 workers"));
        }
        if let Some(e) = self.corrupt.filter(|e| !CORRUPTIBLE.contains(e)) {
            let names: Vec<&str> = CORRUPTIBLE.iter().map(|e| e.name()).collect();
            return Err(Error::setting(
                format!("{CORRUPT_ENV}={e}"),
                format!("only the checks of {} can be corrupted", names.join(", ")),
            ));
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
    /// The slowest timed operation of all repeats (NaN where the
    /// experiment does not keep it).
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub worst: f64,
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
fn nan() -> f64 {
    f64::NAN
}

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

/// Where the suite is: result lines on stdout prefixed with the experiment
/// and the suite's clock, and the live progress of the run (stderr).
pub(super) struct ExperimentProgress<'a> {
    t0: Instant,
    idx: usize,
    total: usize,
    name: &'static str,
    live: &'a Progress,
}

impl ExperimentProgress<'_> {
    pub(super) fn say(&self, msg: impl AsRef<str>) {
        let s = self.t0.elapsed().as_secs();
        self.live.say(format!(
            "[{}/{} {} {:02}:{:02}] {}",
            self.idx,
            self.total,
            self.name,
            s / 60,
            s % 60,
            msg.as_ref()
        ));
    }

    /// The experiment's points, by expected share of its time (see [`Progress::plan`]).
    pub(super) fn plan(&self, weights: &[u64]) {
        self.live.plan(weights);
    }

    /// The next planned point begins.
    pub(super) fn point(&self, label: &str) {
        self.live.point(label);
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
    /// The slowest timed operation of the repeat.
    worst: f64,
    mean: f64,
    cpu: f64,
    melem: f64,
    iters: usize,
}

impl Sample {
    fn new(median: f64, p99: f64) -> Sample {
        Sample { median, p99, worst: f64::NAN, mean: f64::NAN, cpu: f64::NAN, melem: f64::NAN, iters: 0 }
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
                worst: ss.iter().map(|s| s.worst).filter(|w| !w.is_nan()).fold(f64::NAN, f64::max),
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
/// The sharded allreduce (every worker combines a shard; param-server).
const SYS_KERNEL_SHARDED: &str = "kccl-kernel-sharded";
const SYS_USER_SHARDED: &str = "kccl-user-sharded";

fn sys_of(p: Path) -> &'static str {
    match p {
        Path::Kernel => SYS_KERNEL,
        Path::User => SYS_USER,
    }
}

/// The system name of an allreduce row: its path and whether it was sharded.
fn sys_of_mode(p: Path, sharded: bool) -> &'static str {
    match (p, sharded) {
        (_, false) => sys_of(p),
        (Path::Kernel, true) => SYS_KERNEL_SHARDED,
        (Path::User, true) => SYS_USER_SHARDED,
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
    prog: &ExperimentProgress<'_>,
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
                let mut on_iteration = |done, total| prog.live.detail(format!("{peer} {op}: iteration {done}/{total}"));
                peers::run_reporting(cl, &ps, Some(&mut on_iteration))
            };
            prog.say(format!("{point}: {peer} {op} ({ranks} ranks, {bytes} B {}), run {}/{runs}", pp.dtype, run_i + 1));
            match run() {
                Ok(r) => {
                    prog.say(format!("  {}", r.summary()));
                    let mut s = Sample::new(r.median_us * pp.to_unit + pp.extra, r.p99_us * pp.to_unit + pp.extra);
                    s.mean = r.mean_us * pp.to_unit + pp.extra;
                    s.worst = r.max_us * pp.to_unit + pp.extra;
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
    crate::outln!("== kccl benchmark suite{}: {}", if spec.smoke { " (smoke)" } else { "" }, env.machine);
    if spec.peers && spec.experiments.iter().any(|e| e.uses_peers()) {
        for p in [Peer::Gloo, Peer::Mpi] {
            if let Err(e) = peers::check_installed(p) {
                return Err(Error::setting(
                    "the peers (Gloo, Open MPI)",
                    format!("{e} (or run the suite with --no-peers)"),
                ));
            }
        }
    }
    let t0 = Instant::now();
    let total = spec.experiments.len();
    let summary = spec.out.join("summary.md");
    let mut results = Vec::new();
    let live = Progress::new("kccl bench all");
    for (i, &e) in spec.experiments.iter().enumerate() {
        live.stage(format!("experiment {}/{total} {}", i + 1, e.name()));
        let prog = ExperimentProgress { t0, idx: i + 1, total, name: e.name(), live: &live };
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
    live.finish();
    let failed = failed_count(&results);
    Ok(SuiteOutcome { results, summary, failed })
}

const SG_NOT_MEASURED: &str = "not measured: kccl has no scatter-gather yet; \
     the comparison with blocking, epoll and io_uring baselines waits for it";

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
    fn worst_line_names_the_slowest_operation_against_its_median() {
        let mut r = result_with(&[]);
        assert!(report::worst_line(std::slice::from_ref(&r)).contains("not measured"));
        let mut acc = Acc::default();
        let s = |m: f64, w: f64| {
            let mut s = Sample::new(m, m);
            s.worst = w;
            s
        };
        acc.add("", 1.0, "bytes=1", SYS_KERNEL, s(10.0, 12.0));
        acc.add("", 1.0, "bytes=1", SYS_KERNEL, s(10.0, 41.0));
        acc.add("", 2.0, "bytes=2", SYS_USER, s(5.0, 14.0));
        acc.add("", 2.0, "bytes=2", "gloo", Sample::new(1.0, 1.0));
        r.rows = acc.rows();
        let k = r.rows.iter().find(|x| x.system == SYS_KERNEL).expect("kernel row");
        assert_eq!(k.worst, 41.0, "the slowest of all repeats");
        let line = report::worst_line(std::slice::from_ref(&r));
        assert!(line.contains("4.10x") && line.contains("bytes=1") && line.contains("not met"), "{line}");
        r.rows.retain(|x| x.system != SYS_KERNEL);
        let line = report::worst_line(std::slice::from_ref(&r));
        assert!(line.contains("2.80x") && line.contains(": met"), "{line}");
    }

    #[test]
    fn targets_say_not_measured_without_rows() {
        let t = targets(&[]);
        assert_eq!(t.len(), 4);
        assert!(t.iter().all(|l| l.contains("not measured")), "{t:?}");
    }
}
