//! `kccl bench peers`: one peer (Gloo or Open MPI) doing one collective on a
//! virtual cluster, checked and timed by kccl_testbed::peers.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::error::{Error, Result};
use clap::Args;
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};
use kccl_testbed::peers::{self, DType, Peer, PeerOp, PeerSpec};
use kccl_testbed::progress::Progress;

#[derive(Args)]
pub struct PeersArgs {
    /// gloo (torch.distributed) or mpi (Open MPI + mpi4py).
    #[arg(long)]
    peer: String,
    /// broadcast, reduce or allreduce (root: rank 0).
    #[arg(long)]
    op: String,
    /// Bytes per rank (a multiple of 4).
    #[arg(long)]
    bytes: usize,
    /// Ranks, one per host.
    #[arg(long)]
    ranks: usize,
    /// int32 or float32.
    #[arg(long, default_value = "int32")]
    dtype: String,
    /// Timed iterations (default: by size, 200 down to 10).
    #[arg(long)]
    iters: Option<usize>,
    /// Untimed (but checked) iterations before the timed ones.
    #[arg(long)]
    warmup: Option<usize>,
    /// Run on this existing cluster (`kccl cluster up`) instead of a temporary one.
    #[arg(long)]
    name: Option<String>,
    /// Fast run for CI: 1 warm-up and 5 timed iterations.
    #[arg(long)]
    smoke: bool,
    #[arg(long, default_value = "bench-peers.json")]
    json: PathBuf,
}

pub fn run(a: PeersArgs) -> Result<ExitCode> {
    measure(a).map(|_| ExitCode::SUCCESS)
}

fn measure(a: PeersArgs) -> Result<()> {
    let peer: Peer = a.peer.parse()?;
    let op: PeerOp = a.op.parse()?;
    let dtype: DType = a.dtype.parse()?;
    let mut spec = PeerSpec::new(peer, op, dtype, a.bytes, a.ranks)?;
    if a.smoke {
        spec = spec.smoke();
    }
    if let Some(n) = a.iters {
        spec.iters = n;
    }
    if let Some(n) = a.warmup {
        spec.warmup = n;
    }
    // Before building a cluster: a missing peer is the likeliest failure.
    peers::check_installed(peer)?;
    let (cluster, _guard) = match &a.name {
        Some(name) => (cluster::load(name)?, None),
        None => {
            let g = ClusterGuard::up(&ClusterSpec::new(&cluster::unique_name("peers"), a.ranks))?;
            (g.cluster.clone(), Some(g))
        }
    };
    let progress = Progress::new("kccl bench peers");
    progress.stage(format!("{peer} {op} of {} B, {} ranks", spec.bytes(), spec.ranks));
    progress.plan(&[1]);
    progress.point(format!("{} warm-up + {} timed iterations", spec.warmup, spec.iters));
    let mut on_iteration = |done, total| {
        progress.detail(format!("iteration {done}/{total}"));
        progress.fraction(done, total);
    };
    let r = peers::run_reporting(&cluster, &spec, Some(&mut on_iteration))?;
    progress.finish();
    drop(progress);
    println!("{}", r.summary());
    let text = serde_json::to_string_pretty(&r)
        .map_err(|e| Error::io("serializing results as JSON", std::io::Error::other(e)))?;
    std::fs::write(&a.json, text).map_err(|e| Error::io(format!("writing {}", a.json.display()), e))?;
    println!("wrote {}", a.json.display());
    Ok(())
}
