//! The peers (Gloo via torch.distributed, Open MPI via mpi4py) on a 4-host
//! virtual cluster: each collective runs, is checked on every iteration
//! against the reference, and comes back with one timing per iteration.
//!
//! ```text
//!   kccl-<name>-h0      kccl-<name>-h1      kccl-<name>-h2      kccl-<name>-h3
//!   rank 0 (root)       rank 1              rank 2              rank 3
//!   eth0 10.77.0.1      eth0 10.77.0.2      eth0 10.77.0.3      eth0 10.77.0.4
//!   [mpirun, TCP store]      |                   |                   |
//!        |  veth             |  veth             |  veth             |  veth
//!   +----h0------------------h1------------------h2------------------h3----+
//!   |                          br0  (kccl-<name>-sw)                      |
//!   +---------------------------------------------------------------------+
//! ```
//!
//! The peers must be installed (`make setup-peers`; `make test` does it):
//! when they are not, these tests fail and say so. Without root each test
//! prints `SKIPPED <test>: needs root (network namespaces)` and returns.

use kccl_testbed::cluster::{unique_name, ClusterGuard, ClusterSpec};
use kccl_testbed::peers::{self, DType, Peer, PeerError, PeerOp, PeerResult, PeerSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

const HOSTS: usize = 4;

fn smoke(peer: Peer, op: PeerOp, dtype: DType, bytes: usize) -> PeerSpec {
    PeerSpec::new(peer, op, dtype, bytes, HOSTS).expect("valid spec").smoke()
}

fn check_result(r: &PeerResult, spec: &PeerSpec) {
    let what = format!("{} {} {}", r.peer, r.op, r.dtype);
    // Reduce leaves the result on the root only; the others hold it everywhere.
    let want: Vec<usize> = if spec.op == PeerOp::Reduce { vec![0] } else { (0..HOSTS).collect() };
    assert_eq!(r.verified_ranks, want, "{what}: ranks whose results were checked");
    assert_eq!((r.peer, r.op, r.dtype, r.ranks, r.bytes), (spec.peer, spec.op, spec.dtype, HOSTS, spec.bytes()));
    assert_eq!(r.samples_us.len(), spec.iters, "{what}: one latency per timed iteration");
    assert_eq!(r.cpu_samples_us.len(), spec.iters, "{what}: one CPU time per timed iteration");
    assert!(r.samples_us.iter().all(|&s| s.is_finite() && s > 0.0), "{what}: latencies {:?}", r.samples_us);
    assert!(r.cpu_samples_us.iter().all(|&c| c.is_finite() && c > 0.0), "{what}: cpu {:?}", r.cpu_samples_us);
    assert!(r.min_us <= r.median_us && r.median_us <= r.p99_us && r.p99_us <= r.max_us, "{what}: {r:?}");
}

#[test]
fn peers_run_checked_collectives_on_four_hosts() {
    if !root_or_skip("peers_run_checked_collectives_on_four_hosts", "network namespaces") {
        return;
    }
    let g = ClusterGuard::up(&ClusterSpec::new(&unique_name("peers"), HOSTS)).expect("cluster up");
    for peer in [Peer::Gloo, Peer::Mpi] {
        let runs = [
            (PeerOp::Broadcast, DType::Int32, 1472),
            (PeerOp::Reduce, DType::Int32, 16_384),
            (PeerOp::Allreduce, DType::Int32, 16_384),
            (PeerOp::Allreduce, DType::Float32, 65_536),
        ];
        for (op, dtype, bytes) in runs {
            let spec = smoke(peer, op, dtype, bytes);
            let r = peers::run(&g.cluster, &spec).unwrap_or_else(|e| panic!("{peer} {op} {dtype}: {e}"));
            println!("{}", r.summary());
            check_result(&r, &spec);
        }
    }
}

#[test]
fn peers_report_a_wrong_result_as_a_mismatch() {
    if !root_or_skip("peers_report_a_wrong_result_as_a_mismatch", "network namespaces") {
        return;
    }
    let g = ClusterGuard::up(&ClusterSpec::new(&unique_name("peersbad"), HOSTS)).expect("cluster up");
    // Rank 0 corrupts one input element: broadcast receivers and the
    // allreduce/reduce results must all notice.
    for (peer, op) in [(Peer::Gloo, PeerOp::Broadcast), (Peer::Mpi, PeerOp::Allreduce), (Peer::Mpi, PeerOp::Reduce)] {
        let mut spec = smoke(peer, op, DType::Int32, 4096);
        spec.inject_mismatch = true;
        match peers::run(&g.cluster, &spec) {
            Err(PeerError::Mismatch { peer: p, op: o, detail }) => {
                assert_eq!((p, o), (peer, op));
                assert!(detail.contains("index 0"), "{peer} {op}: mismatch names the element: {detail}");
                println!("{peer} {op}: detected: {detail}");
            }
            Err(e) => panic!("{peer} {op}: expected a result mismatch, got: {e}"),
            Ok(r) => panic!("{peer} {op}: a corrupted input passed the check: {}", r.summary()),
        }
    }
}

#[test]
fn peers_reject_more_ranks_than_hosts() {
    if !root_or_skip("peers_reject_more_ranks_than_hosts", "network namespaces") {
        return;
    }
    let g = ClusterGuard::up(&ClusterSpec::new(&unique_name("peersn"), 2)).expect("cluster up");
    let spec = PeerSpec::new(Peer::Gloo, PeerOp::Broadcast, DType::Int32, 64, 3).expect("valid spec");
    match peers::run(&g.cluster, &spec) {
        Err(PeerError::Usage(m)) => assert!(m.contains("has 2 hosts"), "{m}"),
        other => panic!("expected a usage error, got {other:?}"),
    }
}
