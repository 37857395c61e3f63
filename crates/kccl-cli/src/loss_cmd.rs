//! `kccl bench loss`: reduce and broadcast throughput under injected loss,
//! relative to no loss, both paths in one run.

use std::path::PathBuf;

use crate::error::Result;
use clap::Args;
use kccl::transport::Path;
use kccl_testbed::bench::loss::{self, LossRecord, LossSpec};
use kccl_testbed::bench::write_outputs;
use kccl_testbed::progress::Progress;

#[derive(Args)]
pub struct BenchLossArgs {
    /// Drop probabilities, each on every host's link; the first must be 0.
    #[arg(long, default_value = "0,0.0001,0.001,0.01,0.05", value_delimiter = ',')]
    loss: Vec<f64>,
    /// Base seed of the injectors (host i uses seed + i); printed and recorded.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bytes of each rank's int32 vector in the reduce.
    #[arg(long, default_value_t = 16 << 20)]
    reduce_bytes: usize,
    #[arg(long, default_value_t = 4)]
    senders: usize,
    /// Bytes of the broadcast message.
    #[arg(long, default_value_t = 4 << 20)]
    bcast_bytes: usize,
    #[arg(long, default_value_t = 4)]
    receivers: usize,
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[arg(long, default_value = "bench-loss.json")]
    json: PathBuf,
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Fast run for CI: small vectors, two loss rates, two iterations.
    #[arg(long)]
    smoke: bool,
}

pub fn bench(mut a: BenchLossArgs) -> Result<()> {
    if a.smoke {
        a.loss = vec![0.0, 0.01];
        a.reduce_bytes = 1 << 20;
        a.bcast_bytes = 256 << 10;
        a.senders = a.senders.min(2);
        a.receivers = a.receivers.min(2);
        a.iters = 2;
    }
    let spec = LossSpec {
        losses: a.loss,
        seed: a.seed,
        reduce_bytes: a.reduce_bytes,
        senders: a.senders,
        bcast_bytes: a.bcast_bytes,
        receivers: a.receivers,
        iters: a.iters,
    };
    println!(
        "== throughput under loss on every link (seed {}): reduce {} B x {} senders, broadcast {} B to {} receivers",
        spec.seed, spec.reduce_bytes, spec.senders, spec.bcast_bytes, spec.receivers
    );
    let rows: Vec<LossRecord> = loss::run(&spec, &Progress::new("kccl bench loss"))?;
    // A smoke run checks that the benchmark works (small vectors, two
    // iterations: its ratios are noise); targets are judged on full runs.
    for r in rows.iter().filter(|r| r.path == Path::Kernel && r.loss == 0.01) {
        if a.smoke {
            println!(
                "  {} kernel path at 1% loss: {:.2}x of no loss (smoke run: not a measurement)",
                r.collective, r.relative
            );
        } else {
            println!(
                "  {} kernel path at 1% loss: {:.2}x of no loss (target >= 0.8x): {}",
                r.collective,
                r.relative,
                if r.relative >= 0.8 { "met" } else { "NOT met" }
            );
        }
    }
    write_outputs(&rows, &a.json, a.plot.as_deref(), "loss")?;
    println!(
        "wrote {}{}",
        a.json.display(),
        a.plot.as_ref().map(|p| format!(" and {}", p.display())).unwrap_or_default()
    );
    Ok(())
}
