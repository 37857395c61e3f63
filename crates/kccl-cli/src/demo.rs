//! `kccl demo`: a 10-host virtual cluster, broadcast from host 0 to the other
//! 9 through the kernel path and the user-space path, every byte checked,
//! latency and sender CPU compared, cluster torn down; then an allreduce
//! across a fresh cluster through both paths, every element checked.  Without root it runs
//! the user-space path on loopback and says why the kernel path is off.

use std::net::Ipv4Addr;
use std::time::Duration;

use crate::error::Result;
use clap::Args;
use kccl::agg::{AggConfig, AggOp};
use kccl::bcast::{Path, PathChoice};
use kccl::error::is_root;
use kccl::group::{Group, Member};
use kccl_testbed::bench::agg::{AggHarness, Kind};
use kccl_testbed::bench::{BcastHarness, BcastRecord};
use kccl_testbed::cluster;

#[derive(Args)]
pub struct DemoArgs {
    /// Hosts in the virtual cluster (one sender, the rest receive).
    #[arg(long, default_value_t = 10)]
    hosts: usize,
    /// Timed broadcasts per path.
    #[arg(long, default_value_t = 500)]
    iters: usize,
    /// Timed allreduce operations per size and path.
    #[arg(long, default_value_t = 5)]
    agg_iters: usize,
}

/// Bytes of each member's allreduce vector.
const AGG_SIZES: &[usize] = &[65_536, 4 << 20];

/// Message sizes checked byte for byte on each path (one packet to many).
const CHECK_SIZES: &[usize] = &[0, 1, 1432, 1433, 100_000, 4 << 20];

pub fn run(a: DemoArgs) -> Result<()> {
    let receivers = a.hosts.saturating_sub(1).max(1);
    let h = if is_root() {
        println!("== kccl demo: creating a {}-host virtual cluster", receivers + 1);
        BcastHarness::new(&cluster::unique_name("demo"), receivers)?
    } else {
        println!("== kccl demo: not root, so no namespaces and no BPF: the kernel path is off.");
        println!("   Running the user-space path on loopback (run `sudo make demo` for both paths).");
        BcastHarness::on_group(loopback_group(receivers + 1), None)?
    };
    let rows: Vec<BcastRecord> = h.with_sender(PathChoice::Auto, |h, b| {
        println!("== sender: {}", b.path_reason());
        let paths: Vec<Path> = if b.path() == Path::Kernel { vec![Path::Kernel, Path::User] } else { vec![Path::User] };
        for &p in &paths {
            for &len in CHECK_SIZES {
                h.verify(b, p, receivers, len)?;
            }
            println!("== {p:<6} path: {} receivers got every byte of messages of {:?} bytes", receivers, CHECK_SIZES);
        }
        if let Some(f) = b.fanout() {
            let s = f.stats()?;
            println!(
                "== tc_bcast counters: {} packets fanned out into {} copies, {} left to user space, {} malformed",
                s.fanout_pkts, s.copies, s.missed, s.malformed
            );
        }
        println!("== latency: {} broadcasts of one 1472-byte packet to {receivers} receivers per path", a.iters);
        h.measure(b, &paths, receivers, kccl::wire::MAX_UDP_PAYLOAD_1500, a.iters)
    })?;
    kccl_testbed::bench::print_rows(&rows);
    drop(h);
    if is_root() {
        println!("== cluster torn down");
    }
    allreduce(receivers, a.agg_iters)
}

/// An allreduce (int32 SUM) of every sender's vector through an aggregator
/// host, on both paths: host 0 aggregates (its kernel path: XDP + TC only),
/// the other hosts contribute; every member's result is checked element by
/// element before anything is timed.
fn allreduce(senders: usize, iters: usize) -> Result<()> {
    let (h, paths) = if is_root() {
        println!("== allreduce: creating a {}-host virtual cluster (host 0 aggregates)", senders + 1);
        (AggHarness::new(&cluster::unique_name("demoagg"), senders)?, vec![PathChoice::Kernel, PathChoice::User])
    } else {
        println!("== allreduce on loopback, user-space path only (not root)");
        (AggHarness::on_group(loopback_group(senders + 1)), vec![PathChoice::User])
    };
    println!("== allreduce of int32 vectors across {senders} senders, {iters} timed operations per size and path");
    let cfg = AggConfig { deadline: Duration::from_secs(30), ..AggConfig::default() };
    h.measure(Kind::Allreduce, AggOp::Sum, senders, &paths, AGG_SIZES, iters, &cfg)?;
    drop(h);
    if is_root() {
        println!("== cluster torn down");
    }
    Ok(())
}

fn loopback_group(n: usize) -> Group {
    Group::new(
        "loopback-demo",
        1,
        (0..n)
            .map(|i| Member {
                rank: i as u16,
                addr: Ipv4Addr::LOCALHOST,
                port: 47100 + i as u16,
                iface: "lo".into(),
                netns: None,
            })
            .collect(),
    )
}
