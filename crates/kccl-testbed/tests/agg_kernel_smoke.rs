//! End-to-end smoke test of the kernel aggregation engine on real veths:
//! AggEngine (xdp_agg + tc_agg_result) on the aggregator's interface, two
//! contributors sending T_AGG packets from plain UDP sockets.
//!
//! ```text
//!   kccl-<name>-h0 (aggregator, rank 0)   kccl-<name>-h1 (rank 1)   kccl-<name>-h2 (rank 2)
//!   eth0 10.77.0.1  xdp_agg (XDP)          eth0 10.77.0.2            eth0 10.77.0.3
//!                   tc_agg_result (TCX in) UDP socket :47000         UDP socket :47000
//!        |  veth                                |  veth                   |  veth
//!   +----h0-------------------------------------h1------------------------h2----+
//!   |                                   br0                                     |
//!   |                             kccl-<name>-sw                                |
//!   +---------------------------------------------------------------------------+
//! ```
//!
//! The cluster (kccl_testbed::cluster, unique name) is removed by its guard, also
//! when an assertion fails.  Reduce: the records on the ring buffer carry the
//! exact sums and both contributors' sockets receive the ACK of every chunk.
//! Allreduce: both sockets receive the RESULT of every chunk with the exact
//! values.  Without root the test prints `SKIPPED agg_kernel_smoke: needs root (...)` and returns (it fails under KCCL_REQUIRE_ROOT=1).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use kccl::agg::{AggConfig, Aggregator};

use kccl::kernel_agg::{AggEngine, AggEngineConfig, AggStats};
use kccl::netns;
use kccl::transport::{Path, PathChoice};
use kccl::wire::{Header, F_ALLREDUCE, F_FANOUT, F_LAST_FRAG, MAGIC, T_AGG, T_AGG_ACK, T_AGG_RESULT, VERSION};
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

const PORT: u16 = cluster::DEFAULT_PORT;
const CHUNK: usize = 1432;
const SUM: u8 = 1;
const I32: u8 = 1;
const I64: u8 = 2;

/// Values of rank `r` (1 or 2) for an operation of `n` elements.
fn values(r: i64, n: usize) -> Vec<i64> {
    (0..n as i64).map(|i| (i * 7 + r * 1_000_003) % 65_521 * if i % 3 == 0 { -1 } else { 1 } + r).collect()
}

fn encode(dtype: u8, v: &[i64]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| if dtype == I64 { x.to_be_bytes().to_vec() } else { (x as i32).to_be_bytes().to_vec() })
        .collect()
}

fn decode(dtype: u8, b: &[u8]) -> Vec<i64> {
    if dtype == I64 {
        b.chunks_exact(8).map(|c| i64::from_be_bytes(c.try_into().unwrap())).collect()
    } else {
        b.chunks_exact(4).map(|c| i64::from(i32::from_be_bytes(c.try_into().unwrap()))).collect()
    }
}

/// The T_AGG packets (UDP payloads) of rank `rank` for one operation.
fn contributions(rank: u16, op_id: u32, dtype: u8, allreduce: bool, data: &[u8]) -> Vec<Vec<u8>> {
    data.chunks(CHUNK)
        .enumerate()
        .map(|(c, chunk)| {
            let last = (c + 1) * CHUNK >= data.len();
            let h = Header {
                version: VERSION,
                msg_type: T_AGG,
                flags: if last { F_LAST_FRAG } else { 0 } | if allreduce { F_ALLREDUCE } else { 0 },
                job_id: 1,
                src_rank: rank,
                mask_base: 0,
                dst_mask: 0b110,
                msg_seq: op_id,
                frag_off: (c * CHUNK) as u32,
                msg_len: data.len() as u32,
                payload_len: chunk.len() as u16,
                agg_op: SUM,
                dtype,
            };
            let mut p = h.to_bytes().to_vec();
            p.extend_from_slice(chunk);
            p
        })
        .collect()
}

/// An answer as a contributor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    msg_type: u8,
    flags: u16,
    src_rank: u16,
    dst_mask: u64,
    op_id: u32,
    frag_off: u32,
    payload: Vec<u8>,
}

/// Parses an ACK/RESULT datagram (Header::decode refuses payload-less
/// packets with a msg_len, which an ACK is, so the fields are read here).
fn parse_answer(d: &[u8]) -> Option<Answer> {
    if d.len() < 40 || d[0..4] != MAGIC.to_be_bytes() {
        return None;
    }
    let plen = usize::from(u16::from_be_bytes([d[36], d[37]]));
    if d.len() != 40 + plen {
        return None;
    }
    Some(Answer {
        msg_type: d[5],
        flags: u16::from_be_bytes([d[6], d[7]]),
        src_rank: u16::from_be_bytes([d[12], d[13]]),
        dst_mask: u64::from_be_bytes(d[16..24].try_into().ok()?),
        op_id: u32::from_be_bytes(d[24..28].try_into().ok()?),
        frag_off: u32::from_be_bytes(d[28..32].try_into().ok()?),
        payload: d[40..].to_vec(),
    })
}

/// Contributor `rank` in its namespace: sends its packets to the
/// aggregator and collects `want` answers (or gives up after 5 s).
fn contributor(
    ns: String,
    addr: Ipv4Addr,
    agg: Ipv4Addr,
    pkts: Vec<Vec<u8>>,
    want: usize,
) -> kccl::Result<Vec<Answer>> {
    netns::run_in(Some(&ns), move || {
        let sock = UdpSocket::bind(SocketAddrV4::new(addr, PORT)).map_err(|e| kccl::Error::io("bind", e))?;
        sock.set_read_timeout(Some(Duration::from_millis(200))).map_err(|e| kccl::Error::io("timeout", e))?;
        for p in &pkts {
            sock.send_to(p, SocketAddrV4::new(agg, PORT)).map_err(|e| kccl::Error::io("send_to", e))?;
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let t0 = Instant::now();
        while got.len() < want && t0.elapsed() < Duration::from_secs(5) {
            if let Ok((n, from)) = sock.recv_from(&mut buf) {
                assert_eq!(from, SocketAddrV4::new(agg, PORT).into(), "answers come from the aggregator's port");
                if let Some(a) = parse_answer(&buf[..n]) {
                    got.push(a);
                }
            }
        }
        Ok(got)
    })
}

/// Everything on the aggregator side happens on one thread inside h0 (the
/// engine's links and ring buffer belong to it).
fn run(c: &cluster::Cluster) -> kccl::Result<()> {
    let group = c.group.clone();
    let hosts = c.hosts.clone();
    netns::run_in(Some(&hosts[0].netns.clone()), move || {
        let ifindex = netns::ifindex(&hosts[0].iface, Some(&hosts[0].netns))?;
        let mut e = AggEngine::load(&AggEngineConfig::new(1, PORT, 0), ifindex)?;
        e.sync_members(&group)?;
        assert!(e.unresolved_members().is_empty(), "neighbours unresolved: {:?}", e.unresolved_members());
        let (xi, ti) = e.verified_insns()?;
        println!("xdp_agg attached in {:?} mode; verifier: {xi} insns (xdp_agg), {ti} (tc_agg_result)", e.xdp_mode());
        let agg = hosts[0].addr;

        // ---- reduce: op 1, I32 SUM, 2000 elements = 8000 bytes = 6 chunks.
        let n = 2000;
        let (v1, v2) = (values(1, n), values(2, n));
        let before = e.stats()?;
        let chunks = (n * 4).div_ceil(CHUNK);
        let t1 = {
            let (ns, a, p) =
                (hosts[1].netns.clone(), hosts[1].addr, contributions(1, 1, I32, false, &encode(I32, &v1)));
            std::thread::spawn(move || contributor(ns, a, agg, p, chunks))
        };
        let t2 = {
            let (ns, a, p) =
                (hosts[2].netns.clone(), hosts[2].addr, contributions(2, 1, I32, false, &encode(I32, &v2)));
            std::thread::spawn(move || contributor(ns, a, agg, p, chunks))
        };
        let mut sums: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        let t0 = Instant::now();
        while sums.len() < chunks && t0.elapsed() < Duration::from_secs(5) {
            e.poll_records(Duration::from_millis(100), &mut |r| {
                assert_eq!((r.job_id, r.op_id, r.msg_len, r.contributors, r.overflow), (1, 1, 8000, 0b110, false));
                sums.insert(r.frag_off, r.values().to_vec());
            })?;
        }
        let a1 = t1.join().expect("contributor 1")?;
        let a2 = t2.join().expect("contributor 2")?;
        let mut all: Vec<i64> = Vec::new();
        for (off, v) in &sums {
            assert_eq!(*off as usize, all.len() * 4, "records of consecutive chunks");
            all.extend(v);
        }
        let want: Vec<i64> = v1.iter().zip(&v2).map(|(a, b)| a + b).collect();
        assert_eq!(all, want, "reduce: the ring buffer records carry the exact sums");
        for (r, got) in [(1, &a1), (2, &a2)] {
            let mut offs: Vec<u32> = got.iter().map(|a| a.frag_off).collect();
            offs.sort();
            assert_eq!(
                offs,
                (0..chunks as u32).map(|c| c * CHUNK as u32).collect::<Vec<_>>(),
                "rank {r}: ACK per chunk"
            );
            for a in got.iter() {
                assert_eq!((a.msg_type, a.src_rank, a.dst_mask, a.op_id), (T_AGG_ACK, 0, 0b110, 1), "rank {r}: {a:?}");
                assert!(a.flags & F_FANOUT == 0 && a.payload.is_empty(), "rank {r}: {a:?}");
            }
        }
        let d = e.stats()?.delta(&before);
        println!("reduce counters: {d:?}");
        assert_eq!(
            d,
            AggStats {
                pkts: 2 * chunks as u64,
                chunks_done: chunks as u64,
                acks: chunks as u64,
                records: chunks as u64,
                fanout_copies: 2 * chunks as u64,
                ..Default::default()
            }
        );

        // ---- allreduce: op 2, I64 SUM, 500 elements = 4000 bytes = 3 chunks.
        let n = 500;
        let (w1, w2) = (values(1, n).iter().map(|x| x << 30).collect::<Vec<_>>(), values(2, n));
        let before = e.stats()?;
        let chunks = (n * 8).div_ceil(CHUNK);
        let t1 = {
            let (ns, a, p) = (hosts[1].netns.clone(), hosts[1].addr, contributions(1, 2, I64, true, &encode(I64, &w1)));
            std::thread::spawn(move || contributor(ns, a, agg, p, chunks))
        };
        let t2 = {
            let (ns, a, p) = (hosts[2].netns.clone(), hosts[2].addr, contributions(2, 2, I64, true, &encode(I64, &w2)));
            std::thread::spawn(move || contributor(ns, a, agg, p, chunks))
        };
        let a1 = t1.join().expect("contributor 1")?;
        let a2 = t2.join().expect("contributor 2")?;
        let want: Vec<i64> = w1.iter().zip(&w2).map(|(a, b)| a + b).collect();
        for (r, got) in [(1, &a1), (2, &a2)] {
            assert_eq!(got.len(), chunks, "rank {r}: one RESULT per chunk, got {got:?}");
            let mut by_off: Vec<&Answer> = got.iter().collect();
            by_off.sort_by_key(|a| a.frag_off);
            let mut vals = Vec::new();
            for a in by_off {
                assert_eq!((a.msg_type, a.src_rank, a.dst_mask, a.op_id), (T_AGG_RESULT, 0, 0b110, 2), "rank {r}");
                assert_eq!(a.frag_off as usize, vals.len() * 8, "rank {r}: consecutive chunks");
                vals.extend(decode(I64, &a.payload));
            }
            assert_eq!(vals, want, "allreduce: rank {r} received the exact sums");
        }
        let d = e.stats()?.delta(&before);
        println!("allreduce counters: {d:?}");
        assert_eq!(
            d,
            AggStats {
                pkts: 2 * chunks as u64,
                chunks_done: chunks as u64,
                results: chunks as u64,
                fanout_copies: 2 * chunks as u64,
                ..Default::default()
            }
        );
        assert!(e.drain_misses().is_empty());
        let s = e.slots()?;
        println!("slots: {s:?}");
        assert_eq!((s.active, s.delivering, s.undelivered, s.done), (0, 0, 0, 6 + 3));
        Ok(())
    })
}

/// A fan-out miss served from user space: the Aggregator service (kernel
/// path) forgets rank 2's next hop after rank 2 contributed, so
/// tc_agg_result cannot send rank 2 its RESULT copies when rank 1 completes
/// the chunks; the service relays the answers the miss records carry, from
/// its own port, and gives rank 2 its next hop back from the neighbour table.
fn run_miss_relay(c: &cluster::Cluster) -> kccl::Result<()> {
    let mut group = c.group.clone();
    group.aggregator = Some(0);
    group.chunk_bytes = CHUNK as u32; // the chunk of contributions()
    assert_eq!(group.job_id, 1, "contributions() sends for job 1");
    let hosts = c.hosts.clone();
    netns::run_in(Some(&hosts[0].netns.clone()), move || {
        let mut svc = Aggregator::new(&group, 0, PathChoice::Kernel, AggConfig::default())?;
        assert_eq!(svc.path(), Path::Kernel, "{}", svc.path_reason());
        let agg = hosts[0].addr;
        let n = 500;
        let (w1, w2) = (values(1, n), values(2, n).iter().map(|x| x << 20).collect::<Vec<_>>());
        let chunks = (n * 8).div_ceil(CHUNK);
        let t2 = {
            let (ns, a, p) = (hosts[2].netns.clone(), hosts[2].addr, contributions(2, 3, I64, true, &encode(I64, &w2)));
            std::thread::spawn(move || contributor(ns, a, agg, p, chunks))
        };
        let pkts = |svc: &mut Aggregator| svc.kernel_stats().map(|s| s.map_or(0, |s| s.pkts));
        let t0 = Instant::now();
        while pkts(&mut svc)? < chunks as u64 && t0.elapsed() < Duration::from_secs(5) {
            svc.serve_once(Duration::from_millis(10))?;
        }
        assert_eq!(pkts(&mut svc)?, chunks as u64, "rank 2's contributions reached xdp_agg");
        let engine = svc.kernel_engine_mut().expect("kernel path");
        let mac2 = engine.next_hop(2)?.expect("rank 2's next hop, learned from its contributions");
        engine.set_member(2, hosts[2].addr, PORT, None)?;
        let t1 = {
            let (ns, a, p) = (hosts[1].netns.clone(), hosts[1].addr, contributions(1, 3, I64, true, &encode(I64, &w1)));
            std::thread::spawn(move || contributor(ns, a, agg, p, chunks))
        };
        let t0 = Instant::now();
        while svc.stats().misses_relayed < chunks as u64 && t0.elapsed() < Duration::from_secs(5) {
            svc.serve_once(Duration::from_millis(10))?;
        }
        let a1 = t1.join().expect("contributor 1")?;
        let a2 = t2.join().expect("contributor 2")?;
        let want: Vec<i64> = w1.iter().zip(&w2).map(|(a, b)| a + b).collect();
        for (r, got) in [(1, &a1), (2, &a2)] {
            let mut by_off: Vec<&Answer> = got.iter().collect();
            by_off.sort_by_key(|a| a.frag_off);
            let mut vals = Vec::new();
            for a in by_off {
                assert_eq!((a.msg_type, a.src_rank, a.dst_mask, a.op_id), (T_AGG_RESULT, 0, 0b110, 3), "rank {r}");
                assert!(a.flags & F_FANOUT == 0, "rank {r}: a final answer: {a:?}");
                vals.extend(decode(I64, &a.payload));
            }
            assert_eq!(vals, want, "rank {r}: every RESULT, exact (rank 2's relayed from user space)");
        }
        let (user, kernel) = (svc.stats(), svc.kernel_stats()?.expect("kernel counters"));
        println!("miss relay: user {user:?}\nkernel {kernel:?}");
        assert_eq!((kernel.fanout_missed, kernel.fanout_copies), (chunks as u64, chunks as u64));
        assert_eq!((user.misses_relayed, user.misses_unserved), (chunks as u64, 0));
        let engine = svc.kernel_engine_mut().expect("kernel path");
        assert_eq!(engine.next_hop(2)?, Some(mac2), "rank 2's next hop taken back from the neighbour table");
        Ok(())
    })
}

#[test]
fn agg_kernel_smoke() {
    if !root_or_skip("agg_kernel_smoke", "network namespaces, BPF") {
        return;
    }
    let name = cluster::unique_name("aggsm");
    let guard = ClusterGuard::up(&ClusterSpec::new(&name, 3)).expect("cluster up");
    let r = run(&guard.cluster).and_then(|()| run_miss_relay(&guard.cluster));
    drop(guard);
    let left: Vec<String> = std::fs::read_dir(netns::NETNS_RUN_DIR)
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.contains(&name)).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    r.expect("aggregation over veths");
}
