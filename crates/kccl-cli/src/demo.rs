//! `kccl demo`: a 10-host virtual cluster; a broadcast from host 0 to the
//! other 9, then a reduce to host 0 and an allreduce through host 0, each
//! through the kernel path and the user-space path, every byte and element
//! checked against a reference before anything is timed; clusters torn down.
//! It ends with a verdict a newcomer can read (crate::verdict) and exits
//! non-zero when any result was wrong.  Without root it runs the user-space
//! path on loopback and says why the kernel path is off.

use std::net::Ipv4Addr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::verdict::{Collective, Outcome, Verdict};
use clap::Args;
use kccl::agg::{AggConfig, AggOp};
use kccl::error::is_root;
use kccl::group::{Group, Member};
use kccl::transport::{Path, PathChoice};
use kccl_testbed::bench::agg::{print_agg_ratio, AggHarness, AggRecord, Kind};
use kccl_testbed::bench::{BcastHarness, BcastRecord};
use kccl_testbed::cluster;

#[derive(Args)]
#[command(after_help = "Example: sudo kccl demo --hosts 4 --iters 100")]
pub struct DemoArgs {
    /// Hosts in the virtual cluster (one sender, the rest receive).
    #[arg(long, default_value_t = 10)]
    hosts: usize,
    /// Timed broadcasts per path.
    #[arg(long, default_value_t = 500)]
    iters: usize,
    /// Timed reduce and allreduce operations per size and path.
    #[arg(long, default_value_t = 5)]
    agg_iters: usize,
    /// MTU of the virtual cluster's links (the aggregation chunk follows it);
    /// default KCCL_CLUSTER_MTU, else 9000.
    #[arg(long)]
    mtu: Option<u32>,
    /// Test of the verdict: the first checking rank of every reduce and
    /// allreduce corrupts one element of its result, so they come out wrong.
    #[arg(long, hide = true)]
    corrupt_results: bool,
}

/// Bytes of each member's reduce and allreduce vector; the verdict times the last.
const AGG_SIZES: &[usize] = &[65_536, 4 << 20];

/// Message sizes checked byte for byte on each path (one packet to many).
const CHECK_SIZES: &[usize] = &[0, 1, 1432, 1433, 100_000, 4 << 20];

const NOT_ROOT: &str = "not root, so no network namespaces and no BPF programs \
                        (`sudo make demo` runs the kernel path too)";

pub fn run(a: DemoArgs) -> Result<()> {
    let peers = a.hosts.saturating_sub(1).max(1);
    let mut v = Verdict::default();
    if !is_root() {
        println!("== kccl demo: {NOT_ROOT}.");
        println!("   Running the user-space path on loopback.");
        v.user_only(NOT_ROOT.into());
    }
    let kernel = broadcast(&a, peers, &mut v);
    aggregate(&a, peers, kernel, &mut v);
    print!("\n{}", v.render());
    match v.bad() {
        0 => Ok(()),
        bad => Err(Error::DemoFailed { bad, runs: v.runs() }),
    }
}

/// The virtual cluster of one part of the demo.
fn spec(a: &DemoArgs, prefix: &str, hosts: usize) -> cluster::ClusterSpec {
    let mut s = cluster::ClusterSpec::new(&cluster::unique_name(prefix), hosts);
    s.mtu = a.mtu;
    s
}

/// Broadcast on both paths (the kernel path only if the sender could attach
/// it); records both in `v` and returns whether the kernel path is usable.
fn broadcast(a: &DemoArgs, receivers: usize, v: &mut Verdict) -> bool {
    let h = if is_root() {
        println!("== broadcast: creating a {}-host virtual cluster", receivers + 1);
        BcastHarness::on_cluster(&spec(a, "demo", receivers + 1))
    } else {
        BcastHarness::on_group(loopback_group(receivers + 1), None)
    };
    let point = format!("1472-byte packet to {receivers} receivers, until the last receiving program had it");
    let r = h.and_then(|h| {
        h.with_sender(PathChoice::Auto, |h, b| {
            println!("== sender: {}", b.path_reason());
            let mut out: Vec<(Path, Outcome)> = Vec::new();
            let paths: Vec<Path> = if b.path() == Path::Kernel {
                vec![Path::Kernel, Path::User]
            } else {
                let why = if is_root() { b.path_reason().to_string() } else { NOT_ROOT.to_string() };
                out.push((Path::Kernel, Outcome::NotRun(why)));
                vec![Path::User]
            };
            let mut checked = Vec::new();
            for &p in &paths {
                match CHECK_SIZES.iter().try_for_each(|&len| h.verify(b, p, receivers, len)) {
                    Ok(()) => {
                        println!(
                            "== {p:<6} path: {receivers} receivers got every byte of messages of {CHECK_SIZES:?} bytes"
                        );
                        checked.push(p);
                    }
                    Err(e) => out.push((p, Outcome::of(Err(e.into())))),
                }
            }
            if let Some(f) = b.fanout() {
                let s = f.stats()?;
                println!(
                    "== tc_bcast counters: {} packets fanned out into {} copies, {} left to user space, {} malformed",
                    s.fanout_pkts, s.copies, s.missed, s.malformed
                );
            }
            if checked.is_empty() {
                return Ok(out);
            }
            println!("== latency: {} broadcasts of one 1472-byte packet to {receivers} receivers per path", a.iters);
            match h.measure(b, &checked, receivers, kccl::wire::MAX_UDP_PAYLOAD_1500, a.iters) {
                Ok(rows) => {
                    println!("{}", kccl_testbed::bench::BCAST_LEGEND);
                    kccl_testbed::bench::print_rows(&rows);
                    out.extend(rows.iter().map(|r| (r.path, bcast_outcome(r, &point))));
                }
                Err(e) => out.extend(checked.iter().map(|&p| (p, Outcome::Failed(e.to_string())))),
            }
            Ok(out)
        })
    });
    if is_root() {
        println!("== cluster torn down");
    }
    match r {
        Ok(mut out) => {
            out.sort_by_key(|(p, _)| *p == Path::User);
            let kernel = out.iter().any(|(p, o)| *p == Path::Kernel && !matches!(o, Outcome::NotRun(_)));
            if let Some((_, Outcome::NotRun(why))) = out.iter().find(|(p, _)| *p == Path::Kernel) {
                v.user_only(why.clone());
            }
            for (p, o) in out {
                v.record(Collective::Broadcast, p, o);
            }
            kernel
        }
        Err(e) => {
            let o = Outcome::Failed(format!("setting up the broadcast: {e}"));
            for p in [Path::Kernel, Path::User] {
                v.record(Collective::Broadcast, p, if is_root() { o.clone() } else { not_root(p, &o) });
            }
            is_root()
        }
    }
}

fn bcast_outcome(r: &BcastRecord, point: &str) -> Outcome {
    if r.lost > 0 {
        Outcome::Failed(format!("{} of {} timed broadcasts did not reach every receiving program", r.lost, r.iters))
    } else {
        Outcome::Exact { ms: r.app_p50_us / 1e3, point: point.to_string() }
    }
}

/// Reduce to host 0, then allreduce through host 0 as the aggregator (its
/// kernel path: XDP + TC only), int32 SUM on the paths available; the other
/// hosts contribute and every member's result is checked element by element
/// before anything is timed.
fn aggregate(a: &DemoArgs, senders: usize, kernel: bool, v: &mut Verdict) {
    let h = if is_root() {
        println!(
            "== reduce and allreduce: creating a {}-host virtual cluster (host 0 is the root/aggregator)",
            senders + 1
        );
        AggHarness::on_cluster(&spec(a, "demoagg", senders + 1))
    } else {
        Ok(AggHarness::on_group(loopback_group(senders + 1)))
    };
    let paths: Vec<Path> = if kernel { vec![Path::Kernel, Path::User] } else { vec![Path::User] };
    let cfg = AggConfig { deadline: Duration::from_secs(30), ..AggConfig::default() };
    if let Ok(h) = &h {
        let g = h.group();
        println!("== links of MTU {}: aggregation chunks of {} bytes", g.mtu, g.chunk_bytes);
    }
    let mut h = match h {
        Ok(h) => h,
        Err(e) => {
            let o = Outcome::Failed(format!("setting up the cluster: {e}"));
            for c in [Collective::Reduce, Collective::Allreduce] {
                for p in [Path::Kernel, Path::User] {
                    v.record(c, p, if paths.contains(&p) { o.clone() } else { not_run(v) });
                }
            }
            return;
        }
    };
    h.corrupt_results = a.corrupt_results;
    let point = format!(
        "{} MiB int32 vector from each of {senders} senders, median of {}",
        AGG_SIZES[AGG_SIZES.len() - 1] >> 20,
        a.agg_iters
    );
    for (c, kind) in [(Collective::Reduce, Kind::Reduce), (Collective::Allreduce, Kind::Allreduce)] {
        println!(
            "== {kind} of int32 vectors from {senders} senders, {} timed operations per size and path",
            a.agg_iters
        );
        // Per path: the last size's record, or the first error (later sizes skipped).
        let mut last: Vec<Option<std::result::Result<AggRecord, Error>>> = paths.iter().map(|_| None).collect();
        for &size in AGG_SIZES {
            let mut rows = Vec::new();
            for (i, &p) in paths.iter().enumerate() {
                if matches!(last[i], Some(Err(_))) {
                    continue;
                }
                let r = h.measure(kind, AggOp::Sum, senders, &[choice(p)], &[size], a.agg_iters, &cfg);
                last[i] = Some(r.map(|mut rs| rs.remove(0)).map_err(Error::from));
                if let Some(Ok(r)) = &last[i] {
                    rows.push(r.clone());
                }
            }
            print_agg_ratio(&rows);
        }
        if !kernel {
            v.record(c, Path::Kernel, not_run(v));
        }
        for (p, r) in paths.iter().zip(last) {
            let r = r.expect("every path ran at least one size");
            v.record(c, *p, Outcome::of(r.map(|r| (r.p50_ms, point.clone()))));
        }
    }
    println!("   aggregator cpu: CPU per operation of the root's (reduce) or the aggregator service's (allreduce)");
    println!("   user-space thread; on the kernel path XDP aggregates in softirq, which it does not count.");
    drop(h);
    if is_root() {
        println!("== cluster torn down");
    }
}

fn choice(p: Path) -> PathChoice {
    match p {
        Path::Kernel => PathChoice::Kernel,
        Path::User => PathChoice::User,
    }
}

/// The kernel path's line when it did not run: why (from the verdict).
fn not_run(v: &Verdict) -> Outcome {
    Outcome::NotRun(v.user_only_reason().unwrap_or("the kernel path is not available").to_string())
}

/// Without root the kernel path is not run rather than failed.
fn not_root(p: Path, failed: &Outcome) -> Outcome {
    match p {
        Path::Kernel => Outcome::NotRun(NOT_ROOT.into()),
        Path::User => failed.clone(),
    }
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
