//! Aggregation: reduce and allreduce over both paths with one protocol
//! (docs/AGGREGATION.md).
//!
//! - [`Collective`]: one per member process.  `reduce` (contributors send
//!   with [`Collective::send_aggregated_data`], the root collects with
//!   [`Collective::get_aggregated_data`] and folds its own data in) and
//!   `allreduce` (every member contributes to the group's aggregator rank
//!   and gets the result back).
//! - [`Aggregator`]: the allreduce aggregator service, a rank that does not
//!   contribute (`aggregator = <rank>` in the group file).
//!
//! The aggregation itself runs in a backend: the user-space aggregator
//! ([`user::UserAggregator`], always present: it also serves the packets
//! the kernel passes up) or, with the cargo feature `kernel-agg`, the XDP/TC
//! programs of `crate::kernel_agg` (agg/kernel_backend.rs).
//!
//! Operation ids: every API call of a Collective takes the next call number
//! `k` and uses op ids `4k` (exponent pre-pass of float32 SUM/AVG), `4k + 1`
//! (the data) and `4k + 2` (the int64 redo of chunks whose int32 result
//! overflowed).  Members must make the same sequence of calls (as in MPI);
//! a failed call does not shift the ids of later ones.
//!
//! Files by role: the member handle (collective.rs) and the one constructor
//! of a member process (endpoint.rs); the operations, one file each
//! (reduce.rs, allreduce.rs, serving between and after calls in serve.rs);
//! what is reduced (op.rs) and configured (config.rs); how a vector becomes
//! chunks (codec.rs, quant.rs); the contributor side (contribute.rs, with its
//! window, retransmission and deadlines in member.rs); the reduce root
//! (root.rs); one receive batch dispatched by role (dispatch.rs); the
//! backends (backend.rs: user space in user/, the kernel in
//! kernel_backend.rs); the aggregator service (aggregator.rs).

pub mod abort;
pub mod codec;
pub mod member;
pub mod packet;
pub mod quant;
pub mod user;

mod aggregator;
mod allreduce;
mod backend;
mod collective;
mod config;
mod contribute;
mod dispatch;
mod endpoint;
mod op;
mod reduce;
mod root;
mod serve;

#[cfg(feature = "kernel-agg")]
mod kernel_backend;
#[cfg(feature = "kernel-agg")]
mod own_shard;

pub use aggregator::Aggregator;
pub use allreduce::shard_chunks;
pub use collective::Collective;
pub use config::{AggConfig, AllreduceMode, CollectiveStats, OwnShardStats, SendReport};
pub use op::{AggOp, DType, Element, Quant};

use collective::{check_len, chunk_list, contributors, Contributors};

#[cfg(test)]
mod tests {
    use super::backend::resolve_config;
    use super::*;
    use crate::error::Error;
    use crate::group::{Group, Member};
    use crate::transport::PathChoice;
    use std::net::{Ipv4Addr, SocketAddrV4};
    use std::time::Duration;

    fn g(ranks: &[u16]) -> Group {
        let members = ranks
            .iter()
            .map(|&r| Member {
                rank: r,
                addr: Ipv4Addr::new(10, 0, (r / 256) as u8, (r % 256) as u8 + 1),
                port: 4000,
                iface: "lo".into(),
                netns: None,
            })
            .collect();
        Group::new("t", 1, members)
    }

    #[test]
    fn contributor_masks() {
        let grp = g(&[0, 1, 2, 5]);
        let c = contributors(&grp, "x", &[0]).expect("fits");
        assert_eq!((c.base, c.mask, c.count), (0, 0b100110, 3));
        let grp = g(&(64..=128).collect::<Vec<_>>());
        let c = contributors(&grp, "x", &[128]).expect("64 ranks in [64, 128)");
        assert_eq!((c.base, c.count, c.mask), (64, 64, u64::MAX));
        let e = contributors(&grp, "x", &[64]).expect_err("65..=128 leaves the block");
        assert!(matches!(e, Error::TooManyContributors { count: 64, first: 65, last: 128, .. }), "{e}");
        let grp = g(&(0..=64).collect::<Vec<_>>());
        let e = contributors(&grp, "allreduce", &[]).expect_err("65 ranks");
        assert!(matches!(e, Error::TooManyContributors { count: 65, .. }), "{e}");
        assert!(e.to_string().contains("hierarchical"), "{e}");
        // 3 ranks spanning two 64-rank blocks.
        let grp = g(&[0, 63, 64, 200]);
        let e = contributors(&grp, "reduce", &[200]).expect_err("spans two blocks");
        assert!(e.to_string().contains("0..=64"), "{e}");
    }

    #[test]
    fn ops_and_types_match_the_wire() {
        for op in [AggOp::Sum, AggOp::Count, AggOp::Max, AggOp::Min, AggOp::Avg] {
            assert_eq!(AggOp::from_wire(op.wire()), Some(op));
            assert_eq!(op.to_string().to_lowercase().parse::<AggOp>().expect("parses"), op);
        }
        for t in [DType::I32, DType::I64, DType::F32Q] {
            assert_eq!(DType::from_wire(t.wire()), Some(t));
        }
        assert_eq!((AggOp::Sum.wire(), AggOp::Avg.wire(), DType::F32Q.wire()), (1, 5, 3));
        assert!(AggOp::from_wire(0).is_none() && DType::from_wire(4).is_none());
    }

    #[test]
    fn config_is_checked() {
        let grp = g(&[0, 1]);
        let me = grp.members[0].clone();
        assert_eq!(resolve_config(&grp, &me, &AggConfig::default()).expect("defaults"), 1432);
        let bad = AggConfig { window: 1024, ..AggConfig::default() };
        assert!(resolve_config(&grp, &me, &bad).expect_err("window").to_string().contains("nslots"));
        // The chunk is the group's, following its MTU.
        let big = grp.clone().with_mtu(9000).expect("mtu");
        assert_eq!(resolve_config(&big, &me, &AggConfig::default()).expect("9000"), 8928);
    }

    /// `n` ranks on 127.0.0.1, each with a free port (picked by binding to
    /// port 0 first).
    fn loopback_group(name: &str, job_id: u32, n: usize) -> Group {
        let socks: Vec<std::net::UdpSocket> =
            (0..n).map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind")).collect();
        let ports: Vec<u16> = socks.iter().map(|s| s.local_addr().expect("addr").port()).collect();
        drop(socks);
        let members = ports
            .iter()
            .enumerate()
            .map(|(r, &port)| Member {
                rank: r as u16,
                addr: Ipv4Addr::LOCALHOST,
                port,
                iface: "lo".into(),
                netns: None,
            })
            .collect();
        Group::new(name, job_id, members)
    }

    /// Members on 127.0.0.1 with their own ports: the whole API without
    /// namespaces or root (ranks 0..=2 members, rank 3 the aggregator).
    #[test]
    fn loopback_reduce_and_allreduce() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let mut grp = loopback_group("loop", 9, 4);
        grp.aggregator = Some(3);
        let cfg = AggConfig { deadline: Duration::from_secs(10), ..AggConfig::default() };
        let stop = Arc::new(AtomicBool::new(false));
        let mut agg = Aggregator::new(&grp, 3, PathChoice::User, cfg.clone()).expect("aggregator");
        let agg_thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                agg.serve(&stop).expect("serve");
                agg.stats()
            })
        };
        const LEN: usize = 3000;
        let len = LEN;
        let data = |r: u16| -> Vec<f32> { (0..LEN).map(|i| (i as f32 - 1500.0) * 0.01 + f32::from(r)).collect() };
        let ints = |r: u16| -> Vec<i64> { (0..LEN as i64).map(|i| i * (i64::from(r) + 1) - 7).collect() };
        let threads: Vec<_> = (0..3u16)
            .map(|r| {
                let (g, c) = (grp.clone(), cfg.clone());
                std::thread::spawn(move || {
                    let mut col = Collective::new(&g, r, PathChoice::User, c).expect("collective");
                    let sum = col.allreduce(&data(r), AggOp::Sum).expect("allreduce");
                    let max = col.allreduce(&ints(r), AggOp::Max).expect("allreduce max");
                    let red = col.reduce(&ints(r), AggOp::Sum, 1).expect("reduce");
                    let avg = col.reduce(&data(r), AggOp::Avg, 0).expect("reduce avg");
                    // Into a reused buffer at root 2 (a wrong length is refused
                    // before anything is sent or taken).
                    let mut into = vec![-1i64; LEN];
                    if r == 2 {
                        assert!(col.reduce_into(&ints(r), AggOp::Sum, 2, &mut into[1..]).is_err());
                    }
                    let took = col.reduce_into(&ints(r), AggOp::Sum, 2, &mut into).expect("reduce_into");
                    assert_eq!(took, r == 2, "rank {r}");
                    let want = if r == 2 { (0..len as i64).map(|i| i * 6 - 21).collect() } else { vec![-1i64; LEN] };
                    assert_eq!(into, want, "rank {r}: reduce_into");
                    (r, sum, max, red, avg)
                })
            })
            .collect();
        for t in threads {
            let (r, sum, max, red, avg) = t.join().expect("member");
            for i in 0..len {
                let want: f64 = (0..3u16).map(|k| f64::from(data(k)[i])).sum();
                // e <= 5 here (|x| < 18), n = 3, h = 2: bound 3 * 2^(5+2-31).
                assert!((f64::from(sum[i]) - want).abs() <= 3.0 * 2f64.powi(-24) + 1e-5, "rank {r} [{i}]");
                assert_eq!(max[i], ints(2)[i].max(ints(0)[i]), "rank {r} [{i}]");
            }
            match (r, red, avg) {
                (1, Some(v), None) => {
                    assert_eq!(v, (0..len as i64).map(|i| i * 6 - 21).collect::<Vec<_>>());
                }
                (0, None, Some(v)) => {
                    for (i, x) in v.iter().enumerate() {
                        let want: f64 = (0..3u16).map(|k| f64::from(data(k)[i])).sum::<f64>() / 3.0;
                        assert!((f64::from(*x) - want).abs() <= 1e-5, "avg [{i}] = {x}, want {want}");
                    }
                }
                (2, None, None) => {}
                other => panic!("rank {r}: unexpected roles {other:?}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let st = agg_thread.join().expect("aggregator");
        assert_eq!(st.rejected(), 0, "{st:?}");
        assert!(st.results > 0);
    }

    /// The sharded allreduce over loopback: no aggregator in the group
    /// file, so every member combines a shard (AllreduceMode::Auto).
    /// Exact sums and maxima, the float32 exponent pre-pass, the int64
    /// redo of an int32 overflow (AVG of values near 2^31), a vector of
    /// fewer chunks than members; every member served its shard and
    /// settle() finds every receipt.
    #[test]
    fn loopback_sharded_allreduce() {
        const N: u16 = 4;
        const LEN: usize = 5000;
        let grp = loopback_group("shard", 11, N.into());
        let cfg = AggConfig { deadline: Duration::from_secs(10), ..AggConfig::default() };
        let floats = |r: u16| -> Vec<f32> { (0..LEN).map(|i| (i as f32 - 1500.0) * 0.01 + f32::from(r)).collect() };
        let ints =
            |r: u16| -> Vec<i64> { (0..LEN as i64).map(|i| (i * 7919 + i64::from(r) * 104_729) % 10_007).collect() };
        let big = |r: u16| -> Vec<i32> { (0..LEN as i32).map(|i| 2_000_000_000 - i * 1000 - i32::from(r)).collect() };
        let threads: Vec<_> = (0..N)
            .map(|r| {
                let (g, c) = (grp.clone(), cfg.clone());
                std::thread::spawn(move || {
                    let mut col = Collective::new(&g, r, PathChoice::User, c).expect("collective");
                    let sum = col.allreduce(&floats(r), AggOp::Sum).expect("f32 sum");
                    let max = col.allreduce(&ints(r), AggOp::Max).expect("i64 max");
                    let avg = col.allreduce(&big(r), AggOp::Avg).expect("i32 avg (int64 redo)");
                    let one = col.allreduce(&[i32::from(r) + 1], AggOp::Sum).expect("one element");
                    let open = col.settle(Duration::from_secs(5)).expect("settle");
                    (r, sum, max, avg, one, open, col.stats())
                })
            })
            .collect();
        let (fs, is, bs): (Vec<_>, Vec<_>, Vec<_>) = (0..N).map(|k| (floats(k), ints(k), big(k))).fold(
            (Vec::new(), Vec::new(), Vec::new()),
            |(mut a, mut b, mut c), (x, y, z)| {
                a.push(x);
                b.push(y);
                c.push(z);
                (a, b, c)
            },
        );
        for t in threads {
            let (r, sum, max, avg, one, open, st) = t.join().expect("member");
            for i in 0..LEN {
                let want: f64 = fs.iter().map(|v| f64::from(v[i])).sum();
                // e <= 6 (|x| < 40), n = 4, h = 2: bound 4 * 2^(6+2-31).
                assert!((f64::from(sum[i]) - want).abs() <= 4.0 * 2f64.powi(-23) + 2e-5, "rank {r} sum [{i}]");
                assert_eq!(max[i], is.iter().map(|v| v[i]).max().expect("ranks"), "rank {r} max [{i}]");
                let total: i128 = bs.iter().map(|v| i128::from(v[i])).sum();
                assert_eq!(i128::from(avg[i]), total / i128::from(N), "rank {r} avg [{i}]");
            }
            assert_eq!(one, vec![(1..=i32::from(N)).sum::<i32>()], "rank {r}");
            assert!(open.is_empty(), "rank {r}: no receipt from {open:?}");
            assert!(st.redo_ops >= 1, "rank {r}: the AVG of values near 2^31 overflows int32: {st:?}");
            // Rank 0 owns the one-element call's only shard; every rank
            // owns a shard of the others.
            assert!(st.agg.results > 0, "rank {r} combined nothing: {:?}", st.agg);
            assert_eq!(st.agg.rejected(), 0, "rank {r}: {:?}", st.agg);
        }
    }

    /// AllreduceMode::Aggregator without an aggregator in the group file
    /// is refused with what to do.
    #[test]
    fn aggregator_mode_needs_an_aggregator() {
        let grp = loopback_group("no-agg", 12, 2);
        let forced = AggConfig { allreduce: AllreduceMode::Aggregator, ..AggConfig::default() };
        let mut col = Collective::new(&grp, 0, PathChoice::User, forced).expect("collective");
        let e = col.allreduce(&[1i32], AggOp::Sum).expect_err("no aggregator named");
        assert!(e.to_string().contains("names no allreduce aggregator"), "{e}");
    }

    #[test]
    fn shards_are_whole_chunks_in_owner_order() {
        let a = |r: u16| (r, SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1000 + r));
        let owners = [a(0), a(1), a(2), a(3)];
        let cut =
            |n, epc| allreduce::split(n, epc, &owners).into_iter().map(|s| (s.owner, s.elems)).collect::<Vec<_>>();
        // 14 chunks of 10 (the last 5 elements short): 3, 4, 3, 4 chunks.
        assert_eq!(cut(135, 10), vec![(0, 0..30), (1, 30..70), (2, 70..100), (3, 100..135)]);
        // Fewer chunks than owners: the chunks go to spread owners, the
        // others own nothing.
        assert_eq!(cut(25, 10), vec![(1, 0..10), (2, 10..20), (3, 20..25)]);
        assert_eq!(cut(1, 10), vec![(3, 0..1)]);
        assert!(cut(0, 10).is_empty());
    }

    #[cfg(not(feature = "kernel-agg"))]
    #[test]
    fn kernel_path_needs_the_feature() {
        let grp = g(&[0, 1]);
        let me = grp.members[0].clone();
        let err = make_backend(&grp, &me, &AggConfig::default(), 1432, PathChoice::Kernel)
            .err()
            .expect("no kernel backend in this build");
        assert!(matches!(err, Error::KernelPathUnavailable { .. }));
        assert!(err.to_string().contains("kernel-agg"), "{err}");
        let (b, why) = make_backend(&grp, &me, &AggConfig::default(), 1432, PathChoice::Auto).expect("falls back");
        assert_eq!(b.path(), Path::User);
        assert!(why.contains("kernel-agg"), "{why}");
    }
}
