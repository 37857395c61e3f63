//! kccl-testbed: everything kccl needs to run and measure itself, kept out of
//! the library so that the library spawns no process and sets up no network.
//!
//! - [`cluster`]: a local virtual cluster of hosts in network namespaces
//!   (`kccl cluster up|down|ls`), with group files for it;
//! - [`bench`]: the benchmark harness behind `kccl bench` and `kccl demo`
//!   (broadcast in `bench`, aggregation in [`bench::agg`], loss in [`bench::loss`]);
//! - [`peers`]: the tools a user would pick instead (Gloo through torch.distributed,
//!   Open MPI through mpi4py), launched on the same cluster;
//! - [`suite`]: `kccl bench all`, every experiment of the seeds in one run.

pub mod bench;
pub mod cluster;
pub mod error;
pub mod peers;
pub mod progress;
pub mod queues;
pub mod suite;
pub use error::{Error, Result};
