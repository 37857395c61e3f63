//! Scatter-gather (sgbpf, docs/SCATTER_GATHER.md): a coordinator sends one
//! request to N workers and gets back one result, the workers' replies
//! combined (SUM, MIN, MAX, COUNT over int32/int64 vectors) or gathered side
//! by side (CONCAT), when its completion policy is met (all, any, the first
//! n) or at its deadline, with the workers that did not answer named.
//!
//! Wire (bpf/include/kccl_wire.h): KCCL_T_SG_REQUEST from the coordinator,
//! one datagram; KCCL_T_SG_REPLY fragments from each worker, cut at the
//! group's chunk size.  Workers are plain UDP servers on both paths.
//!
//! On the user-space path the coordinator sends a copy of the request to
//! each worker (sendmmsg) and combines the replies it receives (recvmmsg).
//! On the kernel path xdp_sg on the coordinator's interface combines them
//! (kernel_gather.rs) and only the result reaches the coordinator; the
//! request still goes out from user space (its TC fan-out is not built).

mod combine;
mod coordinator;
mod kernel_gather;
mod worker;

pub use combine::{encode_i32, encode_i64, Combine, Elem, Value};
pub use coordinator::{CoordStats, Coordinator, Gathered, Outcome, Policy, SgConfig, Spec};
pub use worker::{sample_sum, sample_vector, Request, Worker, WorkerStats};
