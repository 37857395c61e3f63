//! Scatter-gather's user-space path over loopback (no root needed): a
//! coordinator and worker threads of one group on 127.0.0.1, and a
//! hand-written worker that loses, duplicates and forges packets.
//!
//! ```text
//!   coordinator (rank 0) ──request──▶ worker 1..N (threads, 127.0.0.1:port)
//!            ▲                                │
//!            └──────── reply fragments ───────┘
//! ```

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kccl::group::{Group, Member};
use kccl::sg::{
    encode_i32, encode_i64, sample_vector as vector, Combine, Coordinator, Elem, Outcome, Policy, Request, Spec, Value,
    Worker,
};
use kccl::transport::PathChoice;
use kccl::wire::{self, Header, F_LAST_FRAG, HDR_LEN, T_SG_REPLY};

const JOB: u32 = 77;

/// A group of `n` members on free loopback ports; rank 0 coordinates.
fn group(n: u16, mtu: u32) -> Group {
    let members = (0..n)
        .map(|rank| {
            let s = UdpSocket::bind("127.0.0.1:0").expect("a free loopback port");
            let port = s.local_addr().expect("bound").port();
            Member { rank, addr: Ipv4Addr::LOCALHOST, port, iface: "lo".into(), netns: None }
        })
        .collect();
    Group::new("sg-loopback", JOB, members).with_mtu(mtu).expect("a valid MTU")
}

/// Worker threads serving `handler` for ranks `ranks` until dropped.
struct Workers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<kccl::sg::WorkerStats>>,
}

impl Workers {
    fn start<H>(g: &Group, ranks: &[u16], handler: H) -> Workers
    where
        H: Fn(u16, &Request<'_>) -> Vec<u8> + Send + Sync + Clone + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = ranks
            .iter()
            .map(|&r| {
                // Bound before the thread starts: no request can come first.
                let mut w = Worker::new(g, r).expect("worker binds");
                let (stop, h) = (stop.clone(), handler.clone());
                std::thread::spawn(move || {
                    w.serve(|req| h(r, req), &stop, None).expect("worker serves");
                    w.stats()
                })
            })
            .collect();
        Workers { stop, threads }
    }

    fn stop(mut self) -> Vec<kccl::sg::WorkerStats> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads.drain(..).map(|t| t.join().expect("worker thread")).collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The reference sum (in i32: the sample vectors are small), independent
/// of the coordinator's combine.
fn sum_of(ranks: &[u16], body: &[u8], len: impl Fn(u16) -> usize) -> Vec<i32> {
    let mut out = Vec::new();
    for &r in ranks {
        let v = vector(r, body, len(r));
        if v.len() > out.len() {
            out.resize(v.len(), 0);
        }
        for (o, x) in out.iter_mut().zip(v) {
            *o += x;
        }
    }
    out
}

fn coordinator(g: &Group) -> Coordinator {
    let c = Coordinator::new(g, 0, PathChoice::Auto).expect("coordinator binds");
    assert!(c.path_reason().contains("user path"), "{}", c.path_reason());
    c
}

#[test]
fn all_policy_sums_every_worker_exactly() {
    let g = group(5, 1500);
    let workers = Workers::start(&g, &[1, 2, 3, 4], |r, req| encode_i32(&vector(r, req.body, 363)));
    let mut c = coordinator(&g);
    for k in 0..50u32 {
        let body = format!("query {k}");
        let got = c.scatter(body.as_bytes(), &[], Spec::new(Combine::Sum, Elem::I32)).expect("request ends");
        assert_eq!(got.outcome, Outcome::Complete);
        assert_eq!(got.answered, vec![1, 2, 3, 4]);
        assert!(got.missing.is_empty() && got.refused.is_empty());
        assert_eq!(got.value, Value::I32(sum_of(&[1, 2, 3, 4], body.as_bytes(), |_| 363)), "request {k}");
    }
    let s = c.stats();
    assert_eq!((s.requests, s.complete, s.by_deadline), (50, 50, 0));
    assert_eq!((s.foreign, s.malformed, s.unknown), (0, 0, 0));
    let ws = workers.stop();
    assert!(ws.iter().all(|w| w.requests == 50), "{ws:?}");
}

#[test]
fn multi_packet_replies_of_different_sizes_combine() {
    // MTU 576: 504-byte chunks, so worker r's reply of 400 * r int32 is 4-13
    // datagrams, each reply a different length.
    let g = group(4, 576);
    let len = |r: u16| 400 * usize::from(r);
    let workers = Workers::start(&g, &[1, 2, 3], move |r, req| encode_i32(&vector(r, req.body, len(r))));
    let mut c = coordinator(&g);
    for op in [Combine::Sum, Combine::Max, Combine::Count] {
        let got = c.scatter(b"big", &[], Spec::new(op, Elem::I32)).expect("request ends");
        assert_eq!(got.outcome, Outcome::Complete, "{op}");
        let Value::I32(v) = &got.value else { panic!("{op}: int32 result") };
        assert_eq!(v.len(), 1200, "{op}: as long as the longest reply");
        if op == Combine::Sum {
            assert_eq!(v, &sum_of(&[1, 2, 3], b"big", len));
        }
        if op == Combine::Count {
            let want: Vec<i32> = (0..1200)
                .map(|i| {
                    [1u16, 2, 3].iter().filter(|&&r| i < len(r) && vector(r, b"big", len(r))[i] != 0).count() as i32
                })
                .collect();
            assert_eq!(v, &want);
        }
    }
    assert!(c.stats().fragments >= 3 * (1 + 2 + 3) * 400 * 4 / 504);
    drop(workers);
}

#[test]
fn any_and_first_n_complete_without_the_slow_workers() {
    let g = group(5, 1500);
    // Ranks 3 and 4 answer after 400 ms.
    let workers = Workers::start(&g, &[1, 2, 3, 4], |r, req| {
        if r >= 3 {
            std::thread::sleep(Duration::from_millis(400));
        }
        encode_i64(&[i64::from(r), req.body.len() as i64])
    });
    let mut c = coordinator(&g);
    let spec =
        Spec { policy: Policy::AtLeast(2), deadline: Duration::from_secs(10), ..Spec::new(Combine::Sum, Elem::I64) };
    let got = c.scatter(b"xy", &[], spec).expect("request ends");
    assert_eq!(got.outcome, Outcome::Complete);
    assert_eq!(got.answered, vec![1, 2]);
    assert_eq!(got.missing, vec![3, 4], "asked, not combined");
    assert_eq!(got.value, Value::I64(vec![3, 4]));
    let got = c.scatter(b"z", &[3, 4], Spec { policy: Policy::Any, ..spec }).expect("request ends");
    assert_eq!(got.outcome, Outcome::Complete);
    assert_eq!(got.answered.len(), 1);
    let r = got.answered[0];
    assert_eq!(got.value, Value::I64(vec![i64::from(r), 1]));
    drop(workers);
}

#[test]
fn deadline_returns_the_partial_result_and_names_the_dead_worker() {
    let g = group(4, 1500);
    // Rank 3 never answers: no worker runs there.
    let workers = Workers::start(&g, &[1, 2], |r, req| encode_i32(&vector(r, req.body, 10)));
    let mut c = coordinator(&g);
    let spec = Spec { deadline: Duration::from_millis(300), ..Spec::new(Combine::Sum, Elem::I32) };
    let got = c.scatter(b"q", &[], spec).expect("request ends");
    assert_eq!(got.outcome, Outcome::Deadline);
    assert_eq!(got.answered, vec![1, 2]);
    assert_eq!(got.missing, vec![3]);
    assert_eq!(got.value, Value::I32(sum_of(&[1, 2], b"q", |_| 10)));
    assert!(got.re_requests >= 2, "rank 3 was asked again: {}", got.re_requests);
    assert!(got.elapsed >= Duration::from_millis(300));
    // The handler ran once per worker, whatever was asked again.
    let ws = workers.stop();
    assert!(ws.iter().all(|w| w.requests == 1), "{ws:?}");
}

/// A worker written by hand: answers as `plan` says, packet by packet.
fn reply_packets(g: &Group, rank: u16, req: &Header, reply: &[u8]) -> Vec<Vec<u8>> {
    let chunk = g.chunk_bytes as usize;
    let mut out = Vec::new();
    let mut off = 0;
    loop {
        let end = (off + chunk).min(reply.len());
        let h = Header {
            version: wire::VERSION,
            msg_type: T_SG_REPLY,
            flags: if end == reply.len() { F_LAST_FRAG } else { 0 },
            job_id: g.job_id,
            src_rank: rank,
            mask_base: 0,
            dst_mask: 1,
            msg_seq: req.msg_seq,
            frag_off: off as u32,
            msg_len: reply.len() as u32,
            payload_len: (end - off) as u16,
            agg_op: req.agg_op,
            dtype: req.dtype,
        };
        let mut d = h.to_bytes().to_vec();
        d.extend_from_slice(&reply[off..end]);
        out.push(d);
        off = end;
        if off >= reply.len() {
            return out;
        }
    }
}

#[test]
fn loss_duplicates_and_forged_packets_are_recovered_and_never_counted() {
    let g = group(3, 576);
    let workers = Workers::start(&g, &[1], |r, req| encode_i32(&vector(r, req.body, 600)));
    let me = &g.members[2];
    let sock = UdpSocket::bind(SocketAddrV4::new(me.addr, me.port)).expect("hand worker binds");
    let coord = SocketAddrV4::new(g.members[0].addr, g.members[0].port);
    let (g2, stop) = (g.clone(), Arc::new(AtomicBool::new(false)));
    let stop2 = stop.clone();
    let hand = std::thread::spawn(move || {
        sock.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut buf = vec![0u8; 2048];
        let mut seen = 0;
        while !stop2.load(Ordering::Relaxed) {
            let Ok((n, _)) = sock.recv_from(&mut buf) else { continue };
            let (h, body) = Header::decode(&buf[..n]).expect("a well-formed request");
            seen += 1;
            let pkts = reply_packets(&g2, 2, &h, &encode_i32(&vector(2, body, 600)));
            if seen % 2 == 1 {
                // First copy of each request: lose the middle fragment, and
                // send the others twice.
                for (k, p) in pkts.iter().enumerate() {
                    if k != 2 {
                        sock.send_to(p, coord).unwrap();
                        sock.send_to(p, coord).unwrap();
                    }
                }
                // Forgeries: another job, a stranger's address, an id never
                // issued, a truncated fragment.
                let mut other_job = pkts[2].clone();
                other_job[8..12].copy_from_slice(&(JOB + 1).to_be_bytes());
                sock.send_to(&other_job, coord).unwrap();
                stranger.send_to(&pkts[2], coord).unwrap();
                let mut unknown = pkts[2].clone();
                unknown[24..28].copy_from_slice(&h.msg_seq.wrapping_add(1000).to_be_bytes());
                sock.send_to(&unknown, coord).unwrap();
                sock.send_to(&pkts[2][..HDR_LEN + 10], coord).unwrap();
            } else {
                // The repeated request: the whole reply again.
                for p in &pkts {
                    sock.send_to(p, coord).unwrap();
                }
            }
        }
        seen
    });
    let mut c = coordinator(&g);
    // An rto far above a loopback round trip: exactly one repeated request
    // per request, so every counter below is exact.
    c.set_config(kccl::sg::SgConfig {
        rto: Duration::from_millis(200),
        rto_max: Duration::from_secs(1),
        ..Default::default()
    })
    .unwrap();
    for k in 0..10u32 {
        let body = format!("k{k}");
        let got = c.scatter(body.as_bytes(), &[], Spec::new(Combine::Sum, Elem::I32)).expect("request ends");
        assert_eq!(got.outcome, Outcome::Complete, "request {k}");
        assert_eq!(got.value, Value::I32(sum_of(&[1, 2], body.as_bytes(), |_| 600)), "request {k}");
        assert_eq!(got.re_requests, 1, "only the lossy worker is asked again");
    }
    stop.store(true, Ordering::Relaxed);
    assert_eq!(hand.join().unwrap(), 20, "each request reached the hand worker twice");
    let s = c.stats();
    assert_eq!(s.foreign, 20, "other job + stranger, per request: {s:?}");
    assert_eq!(s.unknown, 10, "{s:?}");
    assert_eq!(s.malformed, 10, "{s:?}");
    // Per request: the 4 doubled fragments of the first copy, then 0 and 1
    // of the repeated reply (held already); 2 completes the reply and the
    // request, so 3 and 4 come after it ended (the last request's may still
    // be unread).
    assert_eq!(s.duplicates, 60, "{s:?}");
    assert!((18..=20).contains(&s.stale), "{s:?}");
    assert_eq!(s.fragments, 10 * 2 * 5, "{s:?}");
    drop(workers);
}

#[test]
fn thousands_in_flight_with_ids_that_wrap() {
    let g = group(3, 1500);
    let workers = Workers::start(&g, &[1, 2], |r, req| {
        let k = u32::from_be_bytes(req.body.try_into().expect("4-byte body"));
        encode_i64(&[i64::from(k) * i64::from(r)])
    });
    let mut c = coordinator(&g);
    c.set_next_id(u32::MAX - 1000);
    let spec = Spec { deadline: Duration::from_secs(20), ..Spec::new(Combine::Sum, Elem::I64) };
    let mut ids = std::collections::HashMap::new();
    for k in 0..4096u32 {
        ids.insert(c.submit(&k.to_be_bytes(), &[], spec).expect("a slot is free"), k);
    }
    assert!(c.submit(b"", &[], spec).is_err(), "max_in_flight is 4096");
    assert!(ids.contains_key(&u32::MAX) && ids.contains_key(&0), "ids wrapped");
    let mut ended = 0;
    while ended < 4096 {
        for (id, r) in c.poll(Some(Duration::from_secs(20))).expect("progress") {
            let got = r.expect("exact");
            assert_eq!(got.outcome, Outcome::Complete, "request {id}");
            assert_eq!(got.value, Value::I64(vec![3 * i64::from(ids[&id])]), "request {id}");
            ended += 1;
        }
    }
    assert_eq!(c.in_flight(), 0);
    drop(workers);
}

#[test]
fn concat_gathers_echo_replies_by_rank() {
    let g = group(4, 1500);
    let workers = Workers::start(&g, &[1, 2, 3], |r, req| [req.body, &[b'0' + r as u8]].concat());
    let mut c = coordinator(&g);
    let got = c.scatter(b"hi", &[3, 1], Spec::new(Combine::Concat, Elem::Bytes)).expect("request ends");
    assert_eq!(got.value, Value::Replies(vec![(1, b"hi1".to_vec()), (3, b"hi3".to_vec())]));
    drop(workers);
}

#[test]
fn a_ragged_reply_is_refused_by_name() {
    let g = group(3, 1500);
    let workers = Workers::start(&g, &[1, 2], |r, _| if r == 2 { vec![1, 2, 3] } else { encode_i32(&[5]) });
    let mut c = coordinator(&g);
    let got = c.scatter(b"", &[], Spec::new(Combine::Sum, Elem::I32)).expect("request ends");
    assert_eq!(got.outcome, Outcome::Exhausted);
    assert_eq!(got.value, Value::I32(vec![5]));
    assert_eq!(got.refused.len(), 1);
    assert_eq!(got.refused[0].0, 2);
    assert!(got.refused[0].1.contains("3 bytes"), "{}", got.refused[0].1);
    drop(workers);
}

#[test]
fn bad_requests_get_clear_errors() {
    let g = group(3, 1500);
    let mut c = coordinator(&g);
    let spec = Spec::new(Combine::Sum, Elem::I32);
    let err = |r: kccl::Result<u32>| r.expect_err("refused").to_string();
    assert!(err(c.submit(b"", &[], Spec::new(Combine::Sum, Elem::Bytes))).contains("concat"));
    assert!(err(c.submit(b"", &[], Spec { policy: Policy::AtLeast(3), ..spec })).contains("n:3"));
    assert!(err(c.submit(b"", &[9], spec)).contains("rank 9"));
    assert!(err(c.submit(b"", &[0], spec)).contains("destination"));
    assert!(err(c.submit(&vec![0; c.max_request() + 1], &[], spec)).contains("larger than"));
    assert!(err(c.submit(b"", &[], Spec { deadline: Duration::ZERO, ..spec })).contains("deadline"));
    assert_eq!(c.in_flight(), 0);
    assert!("n:0".parse::<Policy>().is_err() && "some".parse::<Policy>().is_err());
    assert_eq!("n:4".parse::<Policy>().unwrap(), Policy::AtLeast(4));
    // The kernel path never attaches to loopback (nor to this machine's own
    // namespace in a test): refused before anything is loaded.
    let e = Coordinator::new(&g, 1, PathChoice::Kernel).err().expect("no kernel path on lo").to_string();
    assert!(e.contains("loopback interface"), "{e}");
}

#[test]
fn a_coordinator_started_again_gets_fresh_answers_for_reused_ids() {
    let g = group(2, 1500);
    let workers = Workers::start(&g, &[1], |r, req| encode_i32(&vector(r, req.body, 4)));
    for body in [b"first".as_slice(), b"second"] {
        // A new process, the same rank and (here forced) the same id: the
        // worker's cache must not answer "second" with the reply to "first".
        let mut c = coordinator(&g);
        c.set_next_id(42);
        let got = c.scatter(body, &[], Spec::new(Combine::Sum, Elem::I32)).expect("request ends");
        assert_eq!(got.id, 42);
        assert_eq!(got.value, Value::I32(vector(1, body, 4)));
    }
    let ws = workers.stop();
    assert_eq!((ws[0].requests, ws[0].repeats), (2, 0), "{ws:?}");
}
