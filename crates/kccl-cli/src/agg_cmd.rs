//! `kccl reduce`, `kccl allreduce`, `kccl aggregator` and `kccl bench reduce|allreduce|cpu`.
//!
//! reduce/allreduce run one member of a group: each member generates a
//! deterministic vector from (seed, rank), or reads one from a file, and the
//! result is summarised as a checksum (element sum and FNV-1a of the bytes)
//! that every member of an allreduce prints identically.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use clap::Args;
use kccl::agg::{AggConfig, AggOp, Aggregator, AllreduceMode, Collective, Element, Quant};
use kccl::transport::{Path, PathChoice};
use kccl_testbed::bench::agg::{AggHarness, AggRecord, CpuRecord, Kind};
use kccl_testbed::bench::cpu::measure_cpu;
use kccl_testbed::bench::{fnv1a, write_outputs};
use kccl_testbed::cluster;

use crate::member_args::{member_setup, MemberArgs};
use crate::signals;

#[derive(Args)]
pub struct CollectiveArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// sum, count, max, min or avg.
    #[arg(long, default_value = "sum")]
    op: String,
    /// Element type: i32, i64 or f32.
    #[arg(long, default_value = "i32")]
    dtype: String,
    /// Elements of the generated vector (ignored with --input).
    #[arg(long, default_value_t = 1 << 20)]
    count: usize,
    /// Seed of the generated vector (each rank's data also depends on its rank).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Read this rank's vector from a file of little-endian elements instead.
    #[arg(long)]
    input: Option<PathBuf>,
    /// Write the result (little-endian elements) here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// float32 quantization scale (e.g. 1e8); default: automatic per chunk.
    #[arg(long)]
    scale: Option<f64>,
    /// Seconds without progress before the operation fails.
    #[arg(long, default_value_t = 10.0)]
    deadline: f64,
    /// Print every counter of this member (contributor, its aggregator role
    /// and, on the kernel path, xdp_agg/tc_agg_result) as JSON on stderr.
    #[arg(long)]
    stats: bool,
    /// Send every chunk as its own datagram instead of runs of up to 16
    /// chunks per UDP GSO message (the default; docs/AGGREGATION.md).  With
    /// GSO, `kccl fault` on this host drops or duplicates whole GSO sends.
    #[arg(long)]
    no_gso: bool,
    /// allreduce: who combines: "auto" (the group's aggregator if it names
    /// one, else sharded), "aggregator" or "sharded" (every member combines
    /// a shard; user-space path only so far).
    #[arg(long, default_value = "auto")]
    allreduce: String,
}

#[derive(Args)]
pub struct ReduceArgs {
    #[command(flatten)]
    c: CollectiveArgs,
    /// The rank that receives the result.
    #[arg(long, default_value_t = 0)]
    root: u16,
}

fn config(a: &CollectiveArgs) -> Result<AggConfig> {
    let mut cfg = AggConfig::default();
    if let Some(s) = a.scale {
        if !(s.is_finite() && s > 0.0) {
            return Err(Error::Usage(format!("--scale {s}: must be a positive finite number")));
        }
        cfg.quant = Quant::Fixed(s);
    }
    if !(a.deadline.is_finite() && a.deadline > 0.0) {
        return Err(Error::Usage(format!("--deadline {}: must be positive seconds", a.deadline)));
    }
    cfg.deadline = Duration::from_secs_f64(a.deadline);
    cfg.gso = !a.no_gso;
    cfg.allreduce = a.allreduce.parse().map_err(Error::Usage)?;
    Ok(cfg)
}

/// splitmix64: cheap, deterministic, same on every machine.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

trait CliElement: Element + Copy + std::fmt::Debug {
    const SIZE: usize;
    fn gen(seed: u64, rank: u16, i: usize) -> Self;
    fn from_le(b: &[u8]) -> Self;
    fn to_le(self, out: &mut Vec<u8>);
    fn as_f64(self) -> f64;
}

impl CliElement for i32 {
    const SIZE: usize = 4;
    fn gen(seed: u64, rank: u16, i: usize) -> i32 {
        (mix(seed ^ ((rank as u64) << 40) ^ i as u64) % 2001) as i32 - 1000
    }
    fn from_le(b: &[u8]) -> i32 {
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
}

impl CliElement for i64 {
    const SIZE: usize = 8;
    fn gen(seed: u64, rank: u16, i: usize) -> i64 {
        (mix(seed ^ ((rank as u64) << 40) ^ i as u64) % 2_000_000_001) as i64 - 1_000_000_000
    }
    fn from_le(b: &[u8]) -> i64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        i64::from_le_bytes(a)
    }
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
}

impl CliElement for f32 {
    const SIZE: usize = 4;
    /// Gradient-like values: uniform in (-0.01, 0.01).
    fn gen(seed: u64, rank: u16, i: usize) -> f32 {
        let u = (mix(seed ^ ((rank as u64) << 40) ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32;
        (u * 2.0 - 1.0) * 0.01
    }
    fn from_le(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
}

fn input<T: CliElement>(a: &CollectiveArgs, rank: u16) -> Result<Vec<T>> {
    match &a.input {
        None => Ok((0..a.count).map(|i| T::gen(a.seed, rank, i)).collect()),
        Some(p) => {
            let b = std::fs::read(p).map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
            if b.len() % T::SIZE != 0 {
                return Err(Error::Usage(format!(
                    "{}: {} bytes is not a whole number of {}-byte elements",
                    p.display(),
                    b.len(),
                    T::SIZE
                )));
            }
            Ok(b.chunks_exact(T::SIZE).map(T::from_le).collect())
        }
    }
}

fn report<T: CliElement>(what: &str, a: &CollectiveArgs, r: &[T], took: Duration) -> Result<()> {
    let mut bytes = Vec::with_capacity(r.len() * T::SIZE);
    for &v in r {
        v.to_le(&mut bytes);
    }
    let sum: f64 = r.iter().map(|v| v.as_f64()).sum();
    println!(
        "{what}: {} elements, sum {sum:.6e}, fnv1a {:016x}, first {:?} ({:.1} ms)",
        r.len(),
        fnv1a(&bytes),
        &r[..r.len().min(3)],
        took.as_secs_f64() * 1e3
    );
    if let Some(p) = &a.out {
        std::fs::write(p, &bytes).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(())
}

fn run_typed<T: CliElement>(a: &CollectiveArgs, root: Option<u16>) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    let op: AggOp = a.op.parse()?;
    let data: Vec<T> = input(a, rank)?;
    let mut c = Collective::new(&group, rank, choice, config(a)?)?;
    eprintln!("kccl: {}", c.path_reason());
    let t0 = Instant::now();
    match root {
        Some(root) => match c.reduce(&data, op, root)? {
            Some(r) => {
                report(&format!("reduce {op} at root {rank}"), a, &r, t0.elapsed())?;
                // Keep answering until every contributor has its last ACK:
                // one lost in the fan-out is re-sent only while we run.
                let open = c.settle(Duration::from_secs_f64(a.deadline))?;
                if !open.is_empty() {
                    let ranks: Vec<String> = open.iter().map(|r| r.to_string()).collect();
                    eprintln!(
                        "kccl: rank {rank}: ranks {} did not confirm receipt of the reduce within {:.1} s \
                         (their receipt was lost, or they stopped); the result above is complete",
                        ranks.join(", "),
                        a.deadline
                    );
                }
            }
            None => eprintln!(
                "kccl: rank {rank}: {} elements contributed to the reduce at rank {root} ({:.1} ms)",
                data.len(),
                t0.elapsed().as_secs_f64() * 1e3
            ),
        },
        None => {
            let r = c.allreduce(&data, op)?;
            report(&format!("allreduce {op} at rank {rank}"), a, &r, t0.elapsed())?;
        }
    }
    if a.stats {
        let json =
            |v: serde_json::Result<serde_json::Value>| v.map_err(|e| Error::Usage(format!("stats as JSON: {e}")));
        let all = serde_json::json!({
            "member": json(serde_json::to_value(c.stats()))?,
            "kernel": json(serde_json::to_value(c.kernel_stats()?))?,
        });
        eprintln!("{all}");
    }
    let st = c.stats().contrib;
    if st.chunks > 0 {
        eprintln!(
            "kccl: rank {rank}: sent {} chunks in {} datagrams ({} retransmitted, {} of them fast; {} timeouts), \
             window min/max/last {}/{}/{} chunks, {} cuts",
            st.chunks,
            st.datagrams,
            st.retransmits,
            st.fast_retransmits,
            st.stalls,
            st.window_min,
            st.window_max,
            st.window_last,
            st.window_cuts
        );
    }
    Ok(())
}

fn dispatch(a: &CollectiveArgs, root: Option<u16>) -> Result<()> {
    match a.dtype.as_str() {
        "i32" => run_typed::<i32>(a, root),
        "i64" => run_typed::<i64>(a, root),
        "f32" => run_typed::<f32>(a, root),
        other => Err(Error::Usage(format!("--dtype {other}: expected i32, i64 or f32"))),
    }
}

pub fn reduce(a: ReduceArgs) -> Result<()> {
    dispatch(&a.c, Some(a.root))
}

pub fn allreduce(a: CollectiveArgs) -> Result<()> {
    dispatch(&a, None)
}

#[derive(Args)]
pub struct BenchAggArgs {
    #[arg(long, default_value_t = 4)]
    senders: usize,
    /// Bytes of each rank's int32 vector.
    #[arg(long, default_value = "65536,1048576,16777216,67108864", value_delimiter = ',')]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[arg(long, default_value = "sum")]
    op: String,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Fast run for CI: small sizes, few iterations.
    #[arg(long)]
    smoke: bool,
    /// Both paths send every chunk as its own datagram (no UDP GSO runs).
    #[arg(long)]
    no_gso: bool,
    /// allreduce: who combines: "aggregator" (host 0 runs the aggregator
    /// service) or "sharded" (every sender combines a shard, on the kernel
    /// path in its own xdp_agg).
    #[arg(long, default_value = "aggregator")]
    allreduce: String,
}

pub fn bench(kind: Kind, mut a: BenchAggArgs) -> Result<()> {
    if a.smoke {
        a.senders = a.senders.min(2);
        a.sizes = vec![4096, 262_144];
        a.iters = 3;
    }
    if let Some(bad) = a.sizes.iter().find(|&&s| s == 0 || s % 4 != 0) {
        return Err(Error::Usage(format!("size {bad}: sizes are bytes of an int32 vector (a positive multiple of 4)")));
    }
    let op: AggOp = a.op.parse()?;
    let mut h = AggHarness::new(&cluster::unique_name("bagg"), a.senders)?;
    h.show_recovery = true;
    // Large vectors: allow for the 2-core machine being slow under load.
    let allreduce: AllreduceMode = a.allreduce.parse().map_err(Error::Usage)?;
    if allreduce == AllreduceMode::Auto {
        return Err(Error::Usage("--allreduce auto: the bench needs aggregator or sharded".into()));
    }
    let sharded = kind == Kind::Allreduce && allreduce == AllreduceMode::Sharded;
    let cfg = AggConfig { deadline: Duration::from_secs(60), gso: !a.no_gso, allreduce, ..AggConfig::default() };
    println!(
        "== {kind} of int32 vectors, {} senders, {}{}",
        a.senders,
        if sharded { "sharded (every sender combines a shard), kernel vs user path" } else { "kernel vs user path" },
        if a.no_gso { " (no UDP GSO)" } else { "" }
    );
    let paths: &[PathChoice] = &[PathChoice::Kernel, PathChoice::User];
    let rows: Vec<AggRecord> = h.measure(kind, op, a.senders, paths, &a.sizes, a.iters, &cfg)?;
    drop(h);
    let json = a.json.unwrap_or_else(|| PathBuf::from(format!("bench-{kind}.json")));
    write_outputs(&rows, &json, a.plot.as_deref(), &kind.to_string())?;
    println!(
        "wrote {}{}",
        json.display(),
        a.plot.as_ref().map(|p| format!(" and {}", p.display())).unwrap_or_default()
    );
    Ok(())
}

#[derive(Args)]
pub struct BenchCpuArgs {
    #[arg(long, default_value = "2,4,8,16,30", value_delimiter = ',')]
    senders: Vec<usize>,
    /// Bytes each sender reduces per operation.
    #[arg(long, default_value_t = 65536)]
    bytes: usize,
    /// One operation every this many milliseconds (the offered load).
    #[arg(long, default_value_t = 20.0)]
    period_ms: f64,
    /// Seconds per point.
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    #[arg(long, default_value = "bench-cpu.json")]
    json: PathBuf,
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long)]
    smoke: bool,
}

pub fn bench_cpu(mut a: BenchCpuArgs) -> Result<()> {
    if a.smoke {
        a.senders = vec![2];
        a.seconds = 0.5;
    }
    if a.bytes == 0
        || a.bytes % 4 != 0
        || a.period_ms.is_nan()
        || a.period_ms <= 0.0
        || a.seconds.is_nan()
        || a.seconds <= 0.0
    {
        return Err(Error::Usage(
            "--bytes must be a positive multiple of 4, --period-ms and --seconds positive".into(),
        ));
    }
    let mut rows: Vec<CpuRecord> = Vec::new();
    let cfg = AggConfig { deadline: Duration::from_secs(30), ..AggConfig::default() };
    for &n in &a.senders {
        let mut pair = Vec::new();
        for choice in [PathChoice::Kernel, PathChoice::User] {
            let r = measure_cpu(
                &cluster::unique_name("bcpu"),
                n,
                choice,
                a.bytes,
                Duration::from_secs_f64(a.period_ms / 1e3),
                Duration::from_secs_f64(a.seconds),
                &cfg,
            )?;
            println!(
                "  {:<6} senders={:<2} offered={:>7.1} MB/s achieved={:>7.1} MB/s aggregator cpu={:>5.1}% (napi {:>5.1}% + thread {:>5.1}%)",
                r.path.to_string(),
                r.senders,
                r.offered_mb_s,
                r.achieved_mb_s,
                r.cpu_pct,
                r.napi_cpu_pct,
                r.thread_cpu_pct
            );
            pair.push(r);
        }
        if let (Some(k), Some(u)) =
            (pair.iter().find(|r| r.path == Path::Kernel), pair.iter().find(|r| r.path == Path::User))
        {
            println!("  ratio kernel/user aggregator cpu: {:.2}x", k.cpu_pct / u.cpu_pct.max(1e-9));
        }
        rows.extend(pair);
    }
    write_outputs(&rows, &a.json, a.plot.as_deref(), "cpu")?;
    println!("wrote {}", a.json.display());
    Ok(())
}

#[derive(Args)]
pub struct AggregatorArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// Stop after this many seconds (default: until SIGINT or SIGTERM; the
    /// counters are printed either way).
    #[arg(long)]
    seconds: Option<f64>,
    /// Also print the counters every this many seconds while serving.
    #[arg(long, value_name = "SECONDS")]
    stats_every: Option<f64>,
}

pub fn aggregator(a: AggregatorArgs) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    let every = match a.stats_every {
        Some(s) if !(s > 0.0 && s.is_finite()) => {
            return Err(Error::Usage(format!("--stats-every {s}: give a positive number of seconds")))
        }
        s => s.map(Duration::from_secs_f64),
    };
    let mut agg = Aggregator::new(&group, rank, choice, AggConfig::default())?;
    signals::stop_on_signals()?;
    eprintln!("kccl: {}", agg.path_reason());
    eprintln!("kccl: aggregating allreduce of group '{}' (job {}) as rank {rank}", group.name, group.job_id);
    let end = a.seconds.map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)));
    let mut next_report = every.map(|e| Instant::now() + e);
    while !signals::stop_requested() && end.is_none_or(|e| Instant::now() < e) {
        agg.serve_once(Duration::from_millis(100))?;
        if let (Some(at), Some(e)) = (next_report, every) {
            if Instant::now() >= at {
                print_aggregator_counters(&agg)?;
                next_report = Some(at + e);
            }
        }
    }
    print_aggregator_counters(&agg)
}

/// The aggregator's counters: its user-space side as JSON (for scripts), and
/// on the kernel path xdp_agg's and tc_agg_result's by name (the non-zero
/// ones: drops of non-members, other jobs, malformed packets, fan-out misses
/// need no bpftool).
fn print_aggregator_counters(agg: &Aggregator) -> Result<()> {
    let json = |v: serde_json::Result<serde_json::Value>| v.map_err(|e| Error::Usage(format!("counters as JSON: {e}")));
    eprintln!("kccl: aggregator counters: {}", json(serde_json::to_value(agg.stats()))?);
    match agg.kernel_stats()? {
        None => eprintln!("kccl: kernel counters: none (the user-space path serves this aggregator)"),
        Some(k) => eprintln!(
            "kccl: kernel counters (xdp_agg, tc_agg_result): {}",
            nonzero_fields(&json(serde_json::to_value(k))?)
        ),
    }
    Ok(())
}

/// `name=value` of the non-zero numeric fields of a JSON object, or "all zero".
fn nonzero_fields(v: &serde_json::Value) -> String {
    let parts: Vec<String> = v
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, x)| x.as_u64().is_some_and(|n| n != 0))
        .map(|(k, x)| format!("{k}={x}"))
        .collect();
    if parts.is_empty() {
        "all zero".into()
    } else {
        parts.join(" ")
    }
}
