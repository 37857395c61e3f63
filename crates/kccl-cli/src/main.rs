//! `kccl`: the command-line tool.  This file holds the command tree, its
//! dispatch and the testbed commands (`cluster`, `fault`); each family of
//! member commands has its own file (bcast_cmd.rs, agg_cmd.rs, sg_cmd.rs,
//! the shared member arguments in member_args.rs), as do the demo and the
//! benchmarks (loss_cmd.rs, peers_cmd.rs, suite_cmd.rs).

use std::process::ExitCode;

use crate::error::Result;
use clap::{Args, Parser, Subcommand};
use kccl_testbed::bench::agg::Kind;
use kccl_testbed::cluster::{self, ClusterSpec};

mod agg_cmd;
mod bcast_cmd;
mod demo;
mod error;
mod loss_cmd;
mod member_args;
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
    Broadcast(bcast_cmd::BroadcastArgs),
    /// Receive broadcast messages and write them to stdout or a file.
    #[command(
        after_help = "Example: sudo kccl cluster exec h3 -- kccl receive --group /run/kccl/clusters/kccl/group.toml --rank 3 --count 1 --out model.bin"
    )]
    Receive(bcast_cmd::ReceiveArgs),
    /// Run the group's allreduce aggregator (the rank named by `aggregator = <rank>`).
    #[command(
        after_help = "Example: sudo kccl cluster exec h0 -- kccl aggregator --group /run/kccl/clusters/kccl/group.toml --rank 0 --seconds 60"
    )]
    Aggregator(agg_cmd::AggregatorArgs),
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

#[derive(Subcommand)]
enum BenchCmd {
    /// Broadcast latency and sender CPU, kernel vs user-space path, same run.
    #[command(after_help = "Example: sudo kccl bench broadcast --receivers 9 --sizes 1472 --iters 1000")]
    Broadcast(bcast_cmd::BenchBroadcastArgs),
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
        Cmd::Broadcast(a) => bcast_cmd::broadcast(a).map(|_| ExitCode::SUCCESS),
        Cmd::Receive(a) => bcast_cmd::receive(a).map(|_| ExitCode::SUCCESS),
        Cmd::Aggregator(a) => agg_cmd::aggregator(a).map(|_| ExitCode::SUCCESS),
        Cmd::Reduce(a) => agg_cmd::reduce(a).map(|_| ExitCode::SUCCESS),
        Cmd::Allreduce(a) => agg_cmd::allreduce(a).map(|_| ExitCode::SUCCESS),
        Cmd::SgWorker(a) => sg_cmd::worker(a).map(|_| ExitCode::SUCCESS),
        Cmd::Scatter(a) => sg_cmd::scatter(a).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Broadcast(a)) => bcast_cmd::bench_broadcast(a).map(|_| ExitCode::SUCCESS),
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
