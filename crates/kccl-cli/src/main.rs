//! `kccl`: the command-line tool (cluster, broadcast, receive, aggregator,
//! bench, demo).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use clap::{Args, Parser, Subcommand};
use kccl::agg::{AggConfig, Aggregator};
use kccl::bcast::{Broadcaster, Path, PathChoice, Receiver, Reliability};
use kccl::group::{parse_ranks, Group};
use kccl::netns;
use kccl_testbed::bench::agg::Kind;
use kccl_testbed::bench::{write_outputs, BcastHarness, BcastRecord};
use kccl_testbed::cluster::{self, ClusterSpec};

mod agg_cmd;
mod demo;
mod error;
mod loss_cmd;
mod peers_cmd;
mod sg_cmd;
mod signals;
mod suite_cmd;
mod verdict;

#[derive(Parser)]
#[command(name = "kccl", version, about = "In-kernel collective communication (eBPF) for ordinary Linux hosts")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A local virtual cluster of hosts in network namespaces.
    #[command(subcommand)]
    #[command(after_help = "Example: sudo kccl cluster up --hosts 10")]
    Cluster(ClusterCmd),
    /// Broadcast a file (or stdin) from one rank to others.
    #[command(
        after_help = "Example: sudo kccl cluster exec h0 -- kccl broadcast --group /run/kccl/clusters/kccl/group.toml --rank 0 --to 1-9 model.bin"
    )]
    Broadcast(BroadcastArgs),
    /// Receive broadcast messages and write them to stdout or a file.
    #[command(
        after_help = "Example: sudo kccl cluster exec h3 -- kccl receive --group /run/kccl/clusters/kccl/group.toml --rank 3 --count 1 --out model.bin"
    )]
    Receive(ReceiveArgs),
    /// Run the group's allreduce aggregator (the rank named by `aggregator = <rank>`).
    #[command(
        after_help = "Example: sudo kccl cluster exec h0 -- kccl aggregator --group /run/kccl/clusters/kccl/group.toml --rank 0 --seconds 60"
    )]
    Aggregator(AggregatorArgs),
    /// Reduce a vector (generated or from a file) across the group to a root; the root prints a checksum.
    #[command(
        after_help = "Example: sudo kccl cluster exec h2 -- kccl reduce --group /run/kccl/clusters/kccl/group.toml --rank 2 --root 0 --count 1048576"
    )]
    Reduce(agg_cmd::ReduceArgs),
    /// Allreduce a vector through the group's aggregator; every member prints a checksum.
    #[command(
        after_help = "Example: sudo kccl cluster exec h2 -- kccl allreduce --group /run/kccl/clusters/kccl/group.toml --rank 2 --dtype f32 --input grads.f32 --out sum.f32"
    )]
    Allreduce(agg_cmd::CollectiveArgs),
    /// Serve scatter-gather requests: answer each with a vector or an echo (an ordinary UDP server).
    #[command(
        after_help = "Example: sudo kccl cluster exec h3 -- kccl sg-worker --group /run/kccl/clusters/kccl/group.toml --rank 3 --reply vector:363"
    )]
    SgWorker(sg_cmd::SgWorkerArgs),
    /// Scatter a request to workers and gather one combined result (sum, min, max, count or concat).
    #[command(
        after_help = "Example: sudo kccl cluster exec h0 -- kccl scatter --group /run/kccl/clusters/kccl/group.toml --rank 0 --to 1-9 --policy n:5 --deadline 0.2 --check 363"
    )]
    Scatter(sg_cmd::ScatterArgs),
    /// Benchmarks.
    #[command(subcommand)]
    #[command(after_help = "Example: sudo kccl bench reduce --sizes 67108864")]
    Bench(BenchCmd),
    /// Builds a 10-host cluster, runs broadcast, reduce and allreduce through both paths, ends with a verdict.
    Demo(demo::DemoArgs),
    /// Inject loss, duplication and reordering of kccl packets at a host's egress
    /// (stays installed after exit; --clear removes it, --stats prints counters).
    #[command(after_help = "Example: sudo kccl fault --host h3 --loss 0.01 --seed 7")]
    Fault(FaultArgs),
}

#[derive(Args)]
struct FaultArgs {
    /// Host of the cluster (h3, 3 or the namespace name).
    #[arg(long)]
    host: String,
    #[arg(long, default_value = "kccl")]
    name: String,
    /// Probability (0..1) that a kccl packet is dropped.
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Probability (0..1) that a kccl packet is sent twice.
    #[arg(long, default_value_t = 0.0)]
    dup: f64,
    /// Probability (0..1) that a kccl packet is held and sent after the next one.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// Seed of the decision sequence (reproducible per CPU).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Remove the injector from the host.
    #[arg(long, conflicts_with_all = ["loss", "dup", "reorder", "seed", "stats"])]
    clear: bool,
    /// Print the injector's counters.
    #[arg(long, conflicts_with_all = ["loss", "dup", "reorder", "seed"])]
    stats: bool,
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Create N hosts and write a group file.
    #[command(after_help = "Example: sudo kccl cluster up --hosts 10 --name lab")]
    Up {
        #[arg(long)]
        hosts: usize,
        #[arg(long, default_value = "kccl")]
        name: String,
        #[arg(long, default_value_t = cluster::DEFAULT_PORT)]
        port: u16,
        #[arg(long, default_value_t = 1)]
        job: u32,
        /// MTU of every link; the group file names it and aggregation
        /// chunks follow it (default KCCL_CLUSTER_MTU, else 9000).
        #[arg(long)]
        mtu: Option<u32>,
        /// Queues of every link, each way (XDP runs per receive queue, on
        /// the sending CPU's queue); default KCCL_CLUSTER_QUEUES, else 1.
        /// More than one panicked the kernel VM under concurrent XDP
        /// attaches (docs/KERNELS.md): for one cluster at a time.
        #[arg(long)]
        queues: Option<u32>,
        /// Leave the hosts' neighbour tables empty (filled by ARP, as on a
        /// network kccl did not build) instead of permanent entries.
        #[arg(long)]
        cold_neighbours: bool,
    },
    /// Remove everything `cluster up` made for NAME.
    #[command(after_help = "Example: sudo kccl cluster down --name lab")]
    Down {
        #[arg(long, default_value = "kccl")]
        name: String,
    },
    /// Run a command inside a host: kccl cluster exec h3 -- CMD ARGS...
    #[command(after_help = "Example: sudo kccl cluster exec h3 --name lab -- ip -br addr")]
    Exec {
        host: String,
        #[arg(long, default_value = "kccl")]
        name: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
}

#[derive(Args)]
struct MemberArgs {
    /// Group file (TOML).
    #[arg(long)]
    group: PathBuf,
    /// This process's rank.
    #[arg(long)]
    rank: u32,
    /// kernel, user or auto (kernel if BPF can be loaded, else user).
    #[arg(long, default_value = "auto")]
    path: String,
}

#[derive(Args)]
struct BroadcastArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// Destination ranks: "1-9", "1,3,5" or "all".
    #[arg(long)]
    to: String,
    /// File to send, or - for stdin.
    input: String,
    /// Fail if a receiver has not confirmed the whole message after this many seconds.
    #[arg(long, default_value_t = 10.0)]
    deadline: f64,
    /// Retransmission timeout in milliseconds (probe of a silent receiver; doubles up to 16x).
    #[arg(long, default_value_t = 20.0)]
    rto_ms: f64,
    /// Fire-and-forget: do not wait for acknowledgments (plain UDP receivers).
    #[arg(long)]
    no_ack: bool,
}

#[derive(Args)]
struct ReceiveArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// Acknowledge every N packets (group acknowledgment), 1..=8192.
    #[arg(long, default_value_t = 1024)]
    ack_group: u32,
    /// Acknowledge every packet instead of every group.
    #[arg(long)]
    ack_per_packet: bool,
    /// Report a gap in a message after it persisted this many milliseconds.
    #[arg(long, default_value_t = 2.0)]
    nak_delay_ms: f64,
    /// Send no acknowledgments (for fire-and-forget senders).
    #[arg(long)]
    no_ack: bool,
    /// Number of messages to receive before exiting (default: run until interrupted).
    #[arg(long)]
    count: Option<u64>,
    /// Write messages here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Give up after this many seconds without a complete message.
    #[arg(long)]
    timeout: Option<f64>,
}

#[derive(Args)]
struct AggregatorArgs {
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

#[derive(Subcommand)]
enum BenchCmd {
    /// Broadcast latency and sender CPU, kernel vs user-space path, same run.
    #[command(after_help = "Example: sudo kccl bench broadcast --receivers 9 --sizes 1472 --iters 1000")]
    Broadcast(BenchBroadcastArgs),
    /// Reduce throughput (aggregated elements per second), kernel vs user path.
    #[command(after_help = "Example: sudo kccl bench reduce --senders 4 --sizes 67108864 --iters 5")]
    Reduce(agg_cmd::BenchAggArgs),
    /// Allreduce throughput, kernel vs user path.
    #[command(after_help = "Example: sudo kccl bench allreduce --sizes 1048576,16777216 --plot allreduce.png")]
    Allreduce(agg_cmd::BenchAggArgs),
    /// Aggregator CPU use vs number of senders at a paced load, kernel vs user path.
    #[command(after_help = "Example: sudo kccl bench cpu --senders 2,8,30 --period-ms 10")]
    Cpu(agg_cmd::BenchCpuArgs),
    /// Reduce and broadcast throughput under injected loss, relative to no loss, both paths.
    #[command(after_help = "Example: sudo kccl bench loss --loss 0,0.01 --seed 7")]
    Loss(loss_cmd::BenchLossArgs),
    /// Gloo or Open MPI doing the same collective on a virtual cluster (`make setup-peers` installs them).
    #[command(after_help = "Example: sudo kccl bench peers --peer gloo --op reduce --bytes 67108864 --ranks 5")]
    Peers(peers_cmd::PeersArgs),
    /// The whole suite (AggBox/sgbpf experiments, kernel vs user path vs Gloo and Open MPI): JSON, PNG, summary.md.
    #[command(after_help = "Example: sudo kccl bench all --experiments agg-throughput --max-bytes 16777216")]
    All(suite_cmd::SuiteArgs),
}

#[derive(Args)]
struct BenchBroadcastArgs {
    #[arg(long, default_value = "1,3,5,7,9", value_delimiter = ',')]
    receivers: Vec<usize>,
    /// UDP payload bytes per packet (kccl header included), 41..=1472.
    #[arg(long, default_value = "64,256,512,1024,1472", value_delimiter = ',')]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 1000)]
    iters: usize,
    #[arg(long, default_value = "bench-broadcast.json")]
    json: PathBuf,
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Fast run for CI: few iterations, a few points.
    #[arg(long)]
    smoke: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kccl: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Cluster(c) => cluster_cmd(c),
        Cmd::Broadcast(a) => broadcast(a).map(|_| ExitCode::SUCCESS),
        Cmd::Receive(a) => receive(a).map(|_| ExitCode::SUCCESS),
        Cmd::Aggregator(a) => aggregator(a).map(|_| ExitCode::SUCCESS),
        Cmd::Reduce(a) => agg_cmd::reduce(a).map(|_| ExitCode::SUCCESS),
        Cmd::Allreduce(a) => agg_cmd::allreduce(a).map(|_| ExitCode::SUCCESS),
        Cmd::SgWorker(a) => sg_cmd::worker(a).map(|_| ExitCode::SUCCESS),
        Cmd::Scatter(a) => sg_cmd::scatter(a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Broadcast(a)) => bench_broadcast(a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Reduce(a)) => agg_cmd::bench(Kind::Reduce, a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Allreduce(a)) => agg_cmd::bench(Kind::Allreduce, a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Cpu(a)) => agg_cmd::bench_cpu(a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Loss(a)) => loss_cmd::bench(a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Peers(a)) => peers_cmd::run(a),
        Cmd::Bench(BenchCmd::All(a)) => suite_cmd::run(a),
        Cmd::Demo(a) => demo::run(a).map(|_| ExitCode::SUCCESS),
        Cmd::Fault(a) => fault_cmd(a).map(|_| ExitCode::SUCCESS),
    }
}

fn cluster_cmd(c: ClusterCmd) -> Result<ExitCode> {
    match c {
        ClusterCmd::Up { hosts, name, port, job, mtu, queues, cold_neighbours } => {
            let mut spec = ClusterSpec::new(&name, hosts);
            spec.port = port;
            spec.job_id = job;
            spec.mtu = mtu;
            spec.queues = queues;
            let nqueues = spec.resolved_queues()?;
            if cold_neighbours {
                spec.neighbours = cluster::Neighbours::Learned;
            }
            let c = cluster::up(&spec)?;
            println!(
                "cluster '{}' is up: {} hosts, MTU {}, queues per link {}, group file {}",
                c.name,
                c.hosts.len(),
                c.group.mtu,
                nqueues,
                c.group_path.display()
            );
            for h in c.hosts.iter().take(4) {
                println!("  h{:<3} {:<16} {} ({})", h.index, h.addr, cluster::format_mac(&h.mac), h.netns);
            }
            if c.hosts.len() > 4 {
                println!("  ... ({} more)", c.hosts.len() - 4);
            }
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::Down { name } => {
            let n = cluster::down(&name)?;
            println!("cluster '{name}': removed {n} namespaces");
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::Exec { host, name, cmd } => {
            let st = cluster::exec(&name, &host, &cmd)?;
            Ok(ExitCode::from(st.code().unwrap_or(1).clamp(0, 255) as u8))
        }
    }
}

fn fault_cmd(a: FaultArgs) -> Result<()> {
    let (ns, iface) = cluster::host_target(&a.name, &a.host)?;
    if a.clear {
        if kccl::fault::clear(Some(&ns), &iface)? {
            println!("fault injector removed from {} ({ns} {iface})", a.host);
        } else {
            println!("no fault injector on {} ({ns} {iface})", a.host);
        }
        return Ok(());
    }
    if a.stats {
        let s = kccl::fault::pinned_stats(Some(&ns), &iface)?;
        println!(
            "{} ({ns} {iface}): seen {} dropped {} duplicated {} held {} released {} passed {}",
            a.host, s.seen, s.dropped, s.duplicated, s.held, s.released, s.passed
        );
        return Ok(());
    }
    let cfg = kccl::fault::FaultConfig::from_fractions(a.loss, a.dup, a.reorder, a.seed)?;
    let dir = kccl::fault::install(Some(&ns), &iface, &cfg)?;
    println!(
        "fault injector on {} ({ns} {iface} egress): loss {} dup {} reorder {} seed {} (pinned at {}; \
         `kccl fault --host {} --clear` removes it)",
        a.host,
        a.loss,
        a.dup,
        a.reorder,
        a.seed,
        dir.display(),
        a.host
    );
    Ok(())
}

/// Loads the group and, for a member of a local virtual cluster, enters its
/// namespace (setns keeps /sys/fs/bpf visible, unlike `ip netns exec`).
fn member_setup(m: &MemberArgs) -> Result<(Group, u16, PathChoice)> {
    let group = Group::load(&m.group)?;
    let me = group.member(m.rank)?;
    if let Some(ns) = &me.netns {
        if netns::path(ns).exists() {
            netns::enter(ns)?;
        } else {
            eprintln!("kccl: namespace {ns} of rank {} does not exist here: staying in this namespace", me.rank);
        }
    }
    Ok((group.clone(), me.rank, m.path.parse()?))
}

fn broadcast(a: BroadcastArgs) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    let ranks = parse_ranks(&a.to, &group, rank)?;
    let dests = group.destinations(rank, &ranks)?;
    let mut data = Vec::new();
    if a.input == "-" {
        std::io::stdin().read_to_end(&mut data).map_err(|e| Error::io("reading stdin", e))?;
    } else {
        data = std::fs::read(&a.input).map_err(|e| Error::io(format!("reading {}", a.input), e))?;
    }
    let mut b = Broadcaster::new(&group, rank, choice)?;
    eprintln!("kccl: {}", b.path_reason());
    let secs = |what: &str, v: f64| -> Result<Duration> {
        Duration::try_from_secs_f64(v)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| Error::Usage(format!("--{what} {v}: must be a positive number")))
    };
    let rto = secs("rto-ms", a.rto_ms / 1000.0)?;
    b.set_reliability(Reliability {
        enabled: !a.no_ack,
        rto,
        rto_max: rto * 16,
        deadline: secs("deadline", a.deadline)?,
        ..Reliability::default()
    })?;
    let r = b.broadcast(&data, &dests)?;
    eprintln!(
        "kccl: sent {} bytes as message {} to {} ranks over the {} path ({} datagrams from user space, {} fallback copies)",
        data.len(),
        r.seq,
        dests.len(),
        r.path,
        r.datagrams,
        r.fallback_copies
    );
    if !a.no_ack {
        eprintln!(
            "kccl: every receiver confirmed after {:.1} ms ({} acknowledgments, {} packet copies re-sent, {} timeouts)",
            r.confirm_time.as_secs_f64() * 1e3,
            r.acks,
            r.retransmitted,
            r.timeouts
        );
    }
    if let Some(f) = b.fanout() {
        let s = f.stats()?;
        if s.missed > 0 {
            eprintln!("kccl: the kernel fan-out left {} copies to user space (unresolved neighbours)", s.missed);
        }
    }
    Ok(())
}

fn receive(a: ReceiveArgs) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    if choice == PathChoice::Kernel {
        eprintln!("kccl: receivers use an ordinary UDP socket on both paths");
    }
    let mut r = Receiver::new(&group, rank)?;
    let nak = Duration::try_from_secs_f64(a.nak_delay_ms / 1000.0)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Error::Usage(format!("--nak-delay-ms {}: must be a positive number", a.nak_delay_ms)))?;
    r.set_reliability(Reliability {
        enabled: !a.no_ack,
        ack_group: a.ack_group,
        per_packet: a.ack_per_packet,
        nak_delay: nak,
        ..Reliability::default()
    })?;
    let mut out: Box<dyn Write> = match &a.out {
        Some(p) => Box::new(std::fs::File::create(p).map_err(|e| Error::io(format!("creating {}", p.display()), e))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let timeout = a.timeout.map(Duration::from_secs_f64);
    let mut n = 0u64;
    while a.count.is_none_or(|c| n < c) {
        let m = match r.recv(timeout) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("kccl: receive counters: {}", serde_json::to_string(&r.stats()).unwrap_or_default());
                return Err(e.into());
            }
        };
        out.write_all(&m.data).map_err(|e| Error::io("writing received data", e))?;
        out.flush().map_err(|e| Error::io("writing received data", e))?;
        eprintln!("kccl: message {} from rank {}: {} bytes", m.seq, m.src_rank, m.data.len());
        n += 1;
    }
    // Keep acknowledging for a moment: the sender may still be waiting for
    // a lost acknowledgment of the last message.
    let linger = Instant::now() + Duration::from_millis(200);
    while !a.no_ack && Instant::now() < linger {
        if let Ok(m) = r.recv(Some(linger.saturating_duration_since(Instant::now()))) {
            eprintln!("kccl: message {} from rank {} after --count: not written", m.seq, m.src_rank);
        }
    }
    let s = r.stats();
    if s.dropped() + s.evicted + s.duplicates + s.after_complete > 0 {
        eprintln!("kccl: receive counters: {}", serde_json::to_string(&s).unwrap_or_default());
    }
    Ok(())
}

fn aggregator(a: AggregatorArgs) -> Result<()> {
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

fn bench_broadcast(mut a: BenchBroadcastArgs) -> Result<()> {
    if a.smoke {
        a.receivers = vec![1, 3];
        a.sizes = vec![64, 1472];
        a.iters = 50;
    }
    if let Some(&bad) =
        a.sizes.iter().find(|&&s| !(kccl::wire::HDR_LEN + 1..=kccl::wire::MAX_UDP_PAYLOAD_1500).contains(&s))
    {
        return Err(Error::Usage(format!(
            "size {bad}: sizes are UDP payload bytes per packet, {}..={}",
            kccl::wire::HDR_LEN + 1,
            kccl::wire::MAX_UDP_PAYLOAD_1500
        )));
    }
    let max = a.receivers.iter().copied().max().unwrap_or(1).max(1);
    let h = BcastHarness::new(&cluster::unique_name("bench"), max)?;
    println!("{}", kccl_testbed::bench::BCAST_LEGEND);
    let records: Vec<BcastRecord> = h.with_sender(PathChoice::Kernel, |h, b| {
        let mut all = Vec::new();
        for &size in &a.sizes {
            for &n in &a.receivers {
                let rows = h.measure(b, &[Path::Kernel, Path::User], n, size, a.iters)?;
                kccl_testbed::bench::print_rows(&rows);
                all.extend(rows);
            }
        }
        Ok(all)
    })?;
    drop(h);
    write_outputs(&records, &a.json, a.plot.as_deref(), "broadcast")?;
    println!(
        "wrote {}{}",
        a.json.display(),
        a.plot.as_ref().map(|p| format!(" and {}", p.display())).unwrap_or_default()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::{CommandFactory, Parser};

    /// Every command below `kccl` with its full name ("kccl bench reduce") and its after-help text.
    fn commands(cmd: &clap::Command, name: &str, out: &mut Vec<(String, Option<String>)>) {
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let full = format!("{name} {}", sub.get_name());
            out.push((full.clone(), sub.get_after_help().map(|h| h.to_string())));
            commands(sub, &full, out);
        }
    }

    /// The command lines an example runs: itself without `sudo`, and the
    /// kccl command that `kccl cluster exec HOST -- kccl ...` runs inside a host.
    fn example_command_lines(example: &str) -> Vec<Vec<&str>> {
        let words: Vec<&str> = example.split_whitespace().skip_while(|w| *w == "sudo").collect();
        let mut lines = vec![words.clone()];
        if let Some(dash) = words.iter().position(|w| *w == "--") {
            if words.get(dash + 1) == Some(&"kccl") {
                lines.push(words[dash + 1..].to_vec());
            }
        }
        lines
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_subcommand_help_has_an_example_that_parses() {
        let mut all = Vec::new();
        commands(&Cli::command(), "kccl", &mut all);
        assert!(all.len() >= 18, "found only {} subcommands", all.len());
        for (name, help) in all {
            let help = help.unwrap_or_else(|| panic!("`{name} --help` has no example line"));
            let example = help
                .strip_prefix("Example: ")
                .unwrap_or_else(|| panic!("`{name} --help` ends with {help:?}, not \"Example: ...\""));
            let lines = example_command_lines(example);
            let shown = lines.last().map(|l| l.join(" ")).unwrap_or_default();
            assert!(shown.starts_with(&name), "the example of `{name}` runs another command: {example}");
            for line in lines {
                if let Err(e) = Cli::try_parse_from(&line) {
                    panic!("the example of `{name}` does not parse ({}): {e}", line.join(" "));
                }
            }
        }
    }
}
