//! Bytes on the wire per host: what each virtual host's interfaces counted
//! during the timed operations of an aggregation benchmark, and the byte
//! model they are checked against (docs/BENCHMARKS.md, "Bytes per link").
//!
//! The counters are the kernel's (`/proc/thread-self/net/dev` read inside
//! the host's network namespace, every interface but `lo`): a host's link
//! to the switch counts every frame with its Ethernet header.  With UDP GSO a
//! run of segments leaves a host as one skb, so `tx` counts its Ethernet, IP
//! and UDP headers once per run, not per datagram (0.5% of a 9000-byte frame).

use std::ops::Range;

use kccl::agg::{shard_chunks, AllreduceMode};
use kccl::group::Group;
use kccl::wire::HDR_LEN;

use super::agg::{enter_host, Kind};
use crate::error::{Error, Result};

/// Ethernet (14), IPv4 (20) and UDP (8) headers of one datagram.
pub const L2_L4_HEADERS: usize = 14 + 20 + 8;

/// Bytes a host's interfaces received and sent (counters, not a rate).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct WireBytes {
    pub rx: u64,
    pub tx: u64,
}

/// One host's bytes per timed operation, and what the model expects.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct HostWire {
    pub rank: u16,
    pub rx_per_op: f64,
    pub tx_per_op: f64,
    /// The model's bytes each way (both directions carry the same amount in
    /// every mode modelled here but the reduce; see [`model`]).
    pub model_rx: f64,
    pub model_tx: f64,
}

/// Sums the receive and transmit byte counters of every interface but
/// `lo` in the text of a `/proc/net/dev`.
pub fn parse_net_dev(text: &str) -> Result<WireBytes> {
    let bad =
        |line: &str| Error::Host { what: "parsing /proc/net/dev".into(), detail: format!("unexpected line {line:?}") };
    let mut w = WireBytes::default();
    // Two header lines, then "  name: rx_bytes packets ... tx_bytes ...".
    for line in text.lines().skip(2) {
        let (name, rest) = line.split_once(':').ok_or_else(|| bad(line))?;
        if name.trim() == "lo" {
            continue;
        }
        let f: Vec<u64> =
            rest.split_whitespace().map(str::parse).collect::<std::result::Result<_, _>>().map_err(|_| bad(line))?;
        if f.len() < 16 {
            return Err(bad(line));
        }
        w.rx += f[0];
        w.tx += f[8];
    }
    Ok(w)
}

/// The byte counters of the hosts `ranks` of `group`, read now, each inside
/// its network namespace (by a thread of its own: entering a namespace is
/// for the thread's life).
pub fn read_hosts(group: &Group, ranks: &[u16]) -> Result<Vec<WireBytes>> {
    std::thread::scope(|s| {
        s.spawn(|| {
            ranks
                .iter()
                .map(|&r| {
                    enter_host(group, r)?;
                    let text = std::fs::read_to_string("/proc/thread-self/net/dev")
                        .map_err(|e| Error::io("reading /proc/thread-self/net/dev", e))?;
                    parse_net_dev(&text)
                })
                .collect()
        })
        .join()
        .map_err(|_| Error::panicked("the thread reading the hosts' byte counters"))?
    })
}

/// Bytes on the wire of `payload` bytes sent as datagrams of at most
/// `chunk` payload bytes, each with kccl's and the L2-L4 headers.
pub fn frames(payload: usize, chunk: usize) -> f64 {
    (payload + payload.div_ceil(chunk.max(1)) * (HDR_LEN + L2_L4_HEADERS)) as f64
}

/// What one timed operation should put on each host's link, per host in the
/// order of `hosts` (host 0 first: the reduce root, or the allreduce
/// aggregator, which idles in a sharded allreduce), as (rx, tx) bytes: the
/// data and its headers only (acknowledgements, probes and retransmissions
/// are what the measurement adds).  `members` are the contributing hosts
/// after host 0; `bytes` is each one's vector and `chunk` the payload bytes
/// of one datagram.
///
/// - reduce, root + N senders: each sender sends its vector once, the root
///   receives N vectors.
/// - allreduce with an aggregator: each member sends and receives one
///   vector, the aggregator receives and sends N.
/// - sharded allreduce: member i owns the chunks `shard_chunks(C, N, i)`
///   (s_i bytes); it sends the rest of its vector (S - s_i) to their owners
///   and its combined shard to the N - 1 others, and receives as much:
///   2 (N - 1) / N x S each way for even shards, the same as a ring
///   allreduce, where a dedicated aggregator's link carries N x S.
pub fn model(kind: Kind, mode: AllreduceMode, members: usize, bytes: usize, chunk: usize) -> Vec<(f64, f64)> {
    let n = members;
    let whole = frames(bytes, chunk);
    match (kind, mode) {
        (Kind::Reduce, _) => std::iter::once((n as f64 * whole, 0.0)).chain((0..n).map(|_| (0.0, whole))).collect(),
        (Kind::Allreduce, AllreduceMode::Sharded) => {
            let nchunks = bytes.div_ceil(chunk.max(1));
            let shard_bytes = |r: Range<usize>| (r.end * chunk).min(bytes) - (r.start * chunk).min(bytes);
            std::iter::once((0.0, 0.0))
                .chain((0..n).map(|i| {
                    let own = shard_bytes(shard_chunks(nchunks, n, i));
                    // Out: the others' shards of my vector, then my result
                    // to each other member; in: the mirror image.
                    let others: f64 = (0..n)
                        .filter(|&j| j != i)
                        .map(|j| frames(shard_bytes(shard_chunks(nchunks, n, j)), chunk))
                        .sum();
                    let v = others + (n - 1) as f64 * frames(own, chunk);
                    (v, v)
                }))
                .collect()
        }
        (Kind::Allreduce, _) => {
            std::iter::once((n as f64 * whole, n as f64 * whole)).chain((0..n).map(|_| (whole, whole))).collect()
        }
    }
}

/// Per-host bytes per operation from counters taken before the first and
/// after the last of `iters` timed operations, next to the model.
pub fn per_op(
    ranks: &[u16],
    before: &[WireBytes],
    after: &[WireBytes],
    iters: usize,
    model: &[(f64, f64)],
) -> Vec<HostWire> {
    let n = iters.max(1) as f64;
    ranks
        .iter()
        .zip(before.iter().zip(after))
        .zip(model)
        .map(|((&rank, (b, a)), &(mrx, mtx))| HostWire {
            rank,
            rx_per_op: a.rx.saturating_sub(b.rx) as f64 / n,
            tx_per_op: a.tx.saturating_sub(b.tx) as f64 / n,
            model_rx: mrx,
            model_tx: mtx,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NET_DEV: &str = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1000      10    0    0    0     0          0         0     1000      10    0    0    0     0       0          0
  eth0: 5000000    600    0    0    0     0          0         0  7000000     800    0    0    0     0       0          0
";

    #[test]
    fn net_dev_sums_every_interface_but_lo() {
        assert_eq!(parse_net_dev(NET_DEV).expect("parse"), WireBytes { rx: 5_000_000, tx: 7_000_000 });
        let bad = NET_DEV.replace("7000000", "seven");
        assert!(parse_net_dev(&bad).is_err(), "a field that is no number is an error, not a zero");
    }

    #[test]
    fn sharded_links_carry_two_n_minus_one_over_n_of_the_vector() {
        let (bytes, chunk) = (64 << 20, 8928);
        let per_dgram = 1.0 + (HDR_LEN + L2_L4_HEADERS) as f64 / chunk as f64;
        for n in [4usize, 8, 64] {
            let m = model(Kind::Allreduce, AllreduceMode::Sharded, n, bytes, chunk);
            assert_eq!(m.len(), n + 1);
            assert_eq!(m[0], (0.0, 0.0), "host 0 idles");
            let even = 2.0 * (n - 1) as f64 / n as f64 * bytes as f64 * per_dgram;
            for &(rx, tx) in &m[1..] {
                assert_eq!(rx, tx);
                assert!((rx / even - 1.0).abs() < 0.01, "n={n}: {rx} vs {even}");
            }
            let agg = model(Kind::Allreduce, AllreduceMode::Aggregator, n, bytes, chunk);
            assert!((agg[0].0 / (n as f64 * bytes as f64 * per_dgram) - 1.0).abs() < 1e-3);
            // The busiest link: the aggregator's N x S against 2 (N-1)/N x S.
            let ratio = agg[0].0 / m[1].0;
            let want = n as f64 * n as f64 / (2.0 * (n - 1) as f64);
            assert!((ratio / want - 1.0).abs() < 0.01, "n={n}: {ratio} vs {want} (shards even to a chunk)");
        }
        let r = model(Kind::Reduce, AllreduceMode::Auto, 4, 1000, 100);
        assert_eq!(r[0], (4.0 * 1820.0, 0.0), "10 datagrams of 100 + 40 + 42 bytes");
        assert_eq!(r[1], (0.0, 1820.0));
    }
}
