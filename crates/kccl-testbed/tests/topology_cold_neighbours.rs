//! The kernel paths on a network kccl did not prepare: hosts whose neighbour
//! tables start empty and fill by ARP (`Neighbours::Learned`), as on a
//! hand-built or real L2 network.  Before xdp_agg learned next hops from
//! contributions, the aggregator's members map stayed unresolved (it is
//! filled from the neighbour table once, at load) and every answer copy of
//! the kernel fan-out was missed: allreduce members timed out, on every
//! later call too.
//!
//! ```text
//!  rank 0: aggregator (allreduce) / root (reduce) / sender (broadcast)
//!  netns kccl-<name>-h0          h1            h2            h3
//!  eth0 xdp_agg, tc_agg_result   eth0          eth0          eth0
//!  (tc_bcast at egress)          contributor   contributor   contributor
//!    |  veth                       |             |             |
//!  +-h0----------------------------h1------------h2------------h3--+
//!  |                 br0 (netns kccl-<name>-sw)                    |
//!  +---------------------------------------------------------------+
//!  no permanent neighbour entries: every host learns the others by ARP
//! ```
//!
//! Each test builds its own cluster (unique name; the guard removes it, also
//! when an assertion fails), checks that the tables really start empty, and
//! asserts exact results on the kernel path within a short deadline (a
//! missed answer shows as a timeout, not as a slow pass).  Without root they
//! print SKIPPED (failing under KCCL_REQUIRE_ROOT=1).
//!
//! Run: `cargo test --release -p kccl-testbed --test topology_cold_neighbours -- --test-threads=1 --nocapture`

use std::time::Duration;

use kccl::agg::{AggConfig, AggOp};

use kccl::group::Group;
use kccl::netns;
use kccl::transport::Path;
use kccl::transport::PathChoice;
use kccl_testbed::bench::agg::{AggHarness, Kind};
use kccl_testbed::bench::BcastHarness;
use kccl_testbed::cluster::{self, ClusterSpec, Neighbours};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

const HOSTS: usize = 4;

fn cold_spec(prefix: &str) -> ClusterSpec {
    let mut spec = ClusterSpec::new(&cluster::unique_name(prefix), HOSTS);
    spec.neighbours = Neighbours::Learned;
    spec
}

/// Every member's neighbour table is empty: the test runs on cold tables,
/// not on entries the cluster installed.
fn assert_cold(test: &str, group: &Group) {
    for m in &group.members {
        let iface = m.iface.clone();
        let n = netns::run_in(m.netns.as_deref(), move || Ok(kccl::kernel::neighbours(&iface)))
            .unwrap_or_else(|e| panic!("{test}: reading rank {}'s neighbour table: {e}", m.rank));
        assert!(n.is_empty(), "{test}: rank {} starts with neighbour entries {n:?}", m.rank);
    }
}

#[test]
fn kernel_allreduce_and_reduce_with_cold_neighbour_tables() {
    let test = "kernel_allreduce_and_reduce_with_cold_neighbour_tables";
    if !root_or_skip(test, "network namespaces, XDP and TC programs") {
        return;
    }
    let h = AggHarness::on_cluster(&cold_spec("tcna")).expect("cluster with cold neighbour tables");
    assert_cold(test, h.group());
    // A missed answer costs the contributors this deadline, then an error.
    let cfg = AggConfig { deadline: Duration::from_secs(3), ..AggConfig::default() };
    // Several calls each: the old failure stayed on every later call.
    for kind in [Kind::Allreduce, Kind::Reduce] {
        let rows = h
            .measure(kind, AggOp::Sum, HOSTS - 1, &[PathChoice::Kernel], &[1 << 20], 3, &cfg)
            .unwrap_or_else(|e| panic!("{test}: kernel-path {kind} on cold neighbour tables: {e}"));
        assert_eq!(rows.len(), 1, "{test}: {kind}: one row");
        assert_eq!(rows[0].path, Path::Kernel, "{test}: {kind} ran on the {:?} path", rows[0].path);
    }
}

#[test]
fn kernel_broadcast_with_cold_neighbour_tables() {
    let test = "kernel_broadcast_with_cold_neighbour_tables";
    if !root_or_skip(test, "network namespaces and TC programs") {
        return;
    }
    let h = BcastHarness::on_cluster(&cold_spec("tcnb")).expect("cluster with cold neighbour tables");
    assert_cold(test, h.group());
    let iters = 20;
    let rows = h
        .with_sender(PathChoice::Kernel, |h, b| h.measure(b, &[Path::Kernel], HOSTS - 1, 1472, iters))
        .unwrap_or_else(|e| panic!("{test}: kernel-path broadcast on cold neighbour tables: {e}"));
    assert_eq!(rows.len(), 1, "{test}: one row");
    // The first broadcast finds no neighbour entries: user space sends those
    // copies (which makes the kernel resolve them) and refreshes the members
    // map; from then on the kernel fans out, one datagram per broadcast.
    let per_op = rows[0].datagrams_per_op;
    assert!(
        per_op < 1.5,
        "{test}: user space sent {per_op:.2} datagrams per broadcast over {iters}: the kernel fan-out \
         did not take over after the first broadcast resolved the neighbours"
    );
}
