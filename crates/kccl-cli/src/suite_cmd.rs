//! `kccl bench all`: the benchmark suite (kccl_testbed::suite), with its
//! arguments checked before anything is built.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::error::{Error, Result};
use clap::Args;
use kccl::error::is_root;
use kccl_testbed::suite::{self, SuiteSpec};

#[derive(Args)]
pub struct SuiteArgs {
    /// Fast run for CI: every experiment at one or two small points, few iterations (under 5 minutes).
    #[arg(long)]
    smoke: bool,
    /// Directory for one JSON and one PNG per experiment and summary.md (created).
    #[arg(long, default_value = "bench-out/suite")]
    out: PathBuf,
    /// Experiments to run: all, or a comma list of bcast-receivers, bcast-size, agg-throughput,
    /// agg-gemm, agg-cpu, param-server, scatter-gather.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    experiments: Vec<String>,
    /// Skip data sizes above this many bytes per rank (the skip is recorded in summary.md).
    #[arg(long)]
    max_bytes: Option<usize>,
    /// Do not run Gloo and Open MPI (without this, they must be installed: `make setup-peers`).
    #[arg(long)]
    no_peers: bool,
    /// param-server's worker counts (default 2,4 for time; 2,4,6,8,10 is all of table 3; --smoke: 2).
    #[arg(long, value_delimiter = ',')]
    workers: Option<Vec<usize>>,
}

pub fn run(a: SuiteArgs) -> Result<ExitCode> {
    let experiments = suite::parse_experiments(&a.experiments)?;
    if a.max_bytes == Some(0) {
        return Err(Error::Usage("--max-bytes 0: must be a positive number of bytes per rank".into()));
    }
    let spec = SuiteSpec {
        smoke: a.smoke,
        out: a.out,
        experiments,
        peers: !a.no_peers,
        max_bytes: a.max_bytes.unwrap_or(usize::MAX),
        workers: a.workers,
        // Test of the suite's failure path only (docs/BENCHMARKS.md).
        corrupt: match std::env::var(suite::CORRUPT_ENV) {
            Ok(v) if !v.is_empty() => Some(v.parse()?),
            _ => None,
        },
    };
    spec.validate()?;
    if spec.experiments.iter().any(|e| e.needs_root()) && !is_root() {
        return Err(Error::NotRoot { what: "kccl bench all (virtual cluster and BPF programs)".into() });
    }
    let outcome = suite::run(&spec)?;
    println!("wrote {} (and one JSON/PNG per experiment in {})", outcome.summary.display(), spec.out.display());
    if outcome.exit_status() != 0 {
        eprintln!(
            "kccl: error: {} of {} experiments failed (result check or run error); see {}",
            outcome.failed,
            outcome.results.len(),
            outcome.summary.display()
        );
    }
    Ok(ExitCode::from(outcome.exit_status()))
}
