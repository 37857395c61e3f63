//! BPF_PROG_TEST_RUN fixtures of the aggregation programs: one table for
//! xdp_agg (bpf/xdp_agg.bpf.c) and one for tc_agg_result
//! (bpf/tc_agg_result.bpf.c).
//!
//! xdp_agg.  A fixture is a sequence of steps (a packet in with its verdict
//! and, for XDP_PASS, the exact bytes out; a pause; a drain of the ring
//! buffer) followed by the expected map effects: counter deltas (all 21
//! counters), the state of the fixture's slots and the ring buffer records
//! (values as int64).  Loading xdp_agg costs the verifier ~2 s, so fixtures
//! share one loaded engine per configuration (default, chunk 3432, slot
//! timeout 200 ms, a 16 KiB ring) and are kept apart by their operation ids:
//! the table allocates op ids whose slots no other fixture uses, except where
//! a collision is the point (busy slot, reclaim).  XDP test runs need no
//! network device, so these run in the test's own namespace.
//!
//! tc_agg_result.  Every fixture runs in its own network namespace with a
//! veth pair, like the tc_bcast fixtures:
//!
//! ```text
//!   netns kccl-afx-<pid>-<n>
//!   +--------------------------------------------------------------------+
//!   | BPF_PROG_TEST_RUN(kccl_tc_agg_result, data_in, ctx.ifindex = fxa)  |
//!   |     v                                                              |
//!   | bpf_clone_redirect(skb, fxa) --> fxa ===veth=== fxb --> AF_PACKET  |
//!   |     |  the original skb (copy for the highest rank) is not sent:   |
//!   |     v  verdict TC_ACT_REDIRECT, its bytes come back as data_out    |
//!   +--------------------------------------------------------------------+
//! ```
//!
//! Expected frames are built from scratch by the packet builder below
//! (checksums computed, never patched the way the programs do), and every
//! answer's IPv4 checksum is verified independently.  The expected reduction
//! is computed in Rust from the contributions.  Without root the tests print
//! `SKIP: <reason>` and return.

use std::collections::HashSet;
use std::mem::{offset_of, size_of};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use kccl::error::is_root;
use kccl::kernel::{AggMiss, MissReason, CLONE_MARK};
use kccl::kernel_agg::{AggEngine, AggEngineConfig, AggStats, SlotState};
use kccl::netns;
use kccl::skel::types::__sk_buff;
use kccl::wire::{
    Header, AGG_ABORTED_MAX, F_ACK_LATER, F_ALLREDUCE, F_FANOUT, F_LAST_FRAG, F_MISMATCH, F_OVERFLOW, F_USER_ONLY,
    HDR_LEN, T_AGG, T_AGG_ABORT, T_AGG_ACK, T_AGG_ACKS, T_AGG_PENDING, T_AGG_RECEIPT, T_AGG_RESULT, T_AGG_SYNC,
    T_AGG_SYNC_ACK, T_BCAST, VERSION,
};

mod support;
use support::{csum_add, csum_fold, inet_csum, Capture, Frame, NetnsGuard};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
/// TCX_NEXT (-1): tc_agg_result hands what it does not fan out on to the
/// next program of the TCX ingress chain.
const TCX_NEXT: u32 = u32::MAX;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const JOB: u32 = 7;
const AGG_PORT: u16 = 47100;
const AGG_RANK: u16 = 100;
const AGG_IP: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 100);
const AGG_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 100];
const CHUNK: u32 = 1432;

// enum kccl_agg_op / kccl_dtype
const SUM: u8 = 1;
const COUNT: u8 = 2;
const MAX: u8 = 3;
const MIN: u8 = 4;
const AVG: u8 = 5;
const I32: u8 = 1;
const I64: u8 = 2;
const F32Q: u8 = 3;

// Contributor rank r lives at 10.9.0.r, UDP port 47000+r, MAC 02:00:00:00:00:r.
fn ip_of(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, (rank >> 8) as u8, rank as u8)
}

fn port_of(rank: u16) -> u16 {
    47000 + rank
}

fn mac_of(rank: u16) -> [u8; 6] {
    [0x02, 0, 0, 0, (rank >> 8) as u8, rank as u8]
}

fn mask_of(ranks: &[u16]) -> u64 {
    ranks.iter().fold(0u64, |m, &r| m | 1u64 << r)
}

// ---------------------------------------------------------------------------
// Packet builder.

/// Wire bytes of `values` as `dtype` (big-endian).
fn encode(dtype: u8, values: &[i64]) -> Vec<u8> {
    let mut b = Vec::new();
    for &v in values {
        if dtype == I64 {
            b.extend_from_slice(&v.to_be_bytes());
        } else {
            b.extend_from_slice(&(v as i32).to_be_bytes());
        }
    }
    b
}

/// A contribution of rank `src` (the header fields a fixture changes).
#[derive(Clone, Debug)]
struct Contrib {
    src: u16,
    /// Source address (None: the member's own).
    saddr: Option<Ipv4Addr>,
    op_id: u32,
    op: u8,
    dtype: u8,
    flags: u16,
    mask: u64,
    mask_base: u16,
    frag_off: u32,
    msg_len: u32,
    job: u32,
    version: u8,
    msg_type: u8,
    /// payload_len field (None: the real length).
    payload_len: Option<u16>,
    payload: Vec<u8>,
    options: Vec<u8>,
    udp_len_field: Option<u16>,
}

impl Contrib {
    /// Rank `src`'s values for a one-chunk operation with contributor set `ranks`.
    fn new(src: u16, op_id: u32, op: u8, dtype: u8, ranks: &[u16], values: &[i64]) -> Contrib {
        let payload = encode(dtype, values);
        Contrib {
            src,
            saddr: None,
            op_id,
            op,
            dtype,
            flags: F_LAST_FRAG,
            mask: mask_of(ranks),
            mask_base: 0,
            frag_off: 0,
            msg_len: payload.len() as u32,
            job: JOB,
            version: VERSION,
            msg_type: T_AGG,
            payload_len: None,
            payload,
            options: vec![],
            udp_len_field: None,
        }
    }

    fn allreduce(mut self) -> Contrib {
        self.flags |= F_ALLREDUCE;
        self
    }

    fn header(&self) -> Header {
        Header {
            version: self.version,
            msg_type: self.msg_type,
            flags: self.flags,
            job_id: self.job,
            src_rank: self.src,
            mask_base: self.mask_base,
            dst_mask: self.mask,
            msg_seq: self.op_id,
            frag_off: self.frag_off,
            msg_len: self.msg_len,
            payload_len: self.payload_len.unwrap_or(self.payload.len() as u16),
            agg_op: self.op,
            dtype: self.dtype,
        }
    }

    fn frame(&self) -> Frame {
        let mut p = self.header().to_bytes().to_vec();
        p.extend_from_slice(&self.payload);
        Frame {
            eth_src: mac_of(self.src),
            eth_dst: AGG_MAC,
            saddr: self.saddr.unwrap_or(ip_of(self.src)),
            daddr: AGG_IP,
            sport: port_of(self.src),
            dport: AGG_PORT,
            options: self.options.clone(),
            udp_csum: true,
            udp_len_field: self.udp_len_field,
            payload: p,
        }
    }

    fn build(&self) -> Vec<u8> {
        self.frame().build()
    }

    /// The answer xdp_agg must make of this contribution: addresses swapped,
    /// UDP checksum 0, kccl header rewritten, `payload` after it.  A
    /// multi-buffer contribution keeps its length (xdp_agg never releases
    /// fragments): its bytes past the answer's datagram stay as a trailer.
    fn answer(&self, msg_type: u8, overflow: bool, dst_mask: u64, payload: Vec<u8>) -> Vec<u8> {
        let mut out = self.answer_datagram(msg_type, overflow, dst_mask, payload);
        let input = self.build();
        if is_multi_buffer(&input) && input.len() > out.len() {
            out.extend_from_slice(&input[out.len()..]);
        }
        out
    }

    /// The answer's frame alone, as it leaves tc_agg_result (no trailer).
    fn answer_datagram(&self, msg_type: u8, overflow: bool, dst_mask: u64, payload: Vec<u8>) -> Vec<u8> {
        let mut h = self.header();
        h.msg_type = msg_type;
        h.flags = F_FANOUT | (self.flags & F_LAST_FRAG) | if overflow { F_OVERFLOW } else { 0 };
        h.src_rank = AGG_RANK;
        h.dst_mask = dst_mask;
        h.payload_len = payload.len() as u16;
        let mut p = h.to_bytes().to_vec();
        p.extend_from_slice(&payload);
        Frame {
            eth_src: AGG_MAC,
            eth_dst: mac_of(self.src),
            saddr: AGG_IP,
            daddr: self.saddr.unwrap_or(ip_of(self.src)),
            sport: AGG_PORT,
            dport: port_of(self.src),
            options: self.options.clone(),
            udp_csum: false,
            udp_len_field: None,
            payload: p,
        }
        .build()
    }

    fn ack(&self, overflow: bool, dst_mask: u64) -> Vec<u8> {
        self.answer(T_AGG_ACK, overflow, dst_mask, vec![])
    }

    /// The PENDING answer to a counted retransmission: to its sender only,
    /// the missing contributors as an 8-byte big-endian mask.
    fn pending(&self, missing: u64) -> Vec<u8> {
        let mut a = self.clone();
        a.flags &= F_LAST_FRAG;
        a.answer(T_AGG_PENDING, false, 1 << (self.src - self.mask_base), missing.to_be_bytes().to_vec())
    }

    /// Rank src's receipt: every answer of op_id (msg_len bytes) received.
    fn receipt(src: u16, op_id: u32, msg_len: u32) -> Contrib {
        let mut c = Contrib::new(src, op_id, SUM, I32, &[src], &[]);
        c.msg_type = T_AGG_RECEIPT;
        c.flags = 0;
        c.frag_off = msg_len;
        c.msg_len = msg_len;
        c
    }
}

// ---------------------------------------------------------------------------
// The reference reduction.

/// int64 accumulators of `contribs` combined in arrival order (the first
/// stores), and whether an I64 SUM/AVG overflowed on the way.
fn reduce(op: u8, dtype: u8, contribs: &[Vec<i64>]) -> (Vec<i64>, bool) {
    let count = |v: i64| i64::from(v != 0);
    let mut acc: Vec<i64> = contribs[0].iter().map(|&v| if op == COUNT { count(v) } else { v }).collect();
    let mut ovf = false;
    for c in &contribs[1..] {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = match op {
                SUM | AVG => {
                    let (s, o) = a.overflowing_add(v);
                    ovf |= o && dtype == I64;
                    s
                }
                COUNT => *a + count(v),
                MAX => (*a).max(v),
                MIN => (*a).min(v),
                _ => unreachable!(),
            };
        }
    }
    (acc, ovf)
}

/// What an allreduce result carries: int32 saturated for I32/F32Q.
fn wire_result(dtype: u8, acc: &[i64]) -> (Vec<u8>, bool) {
    if dtype == I64 {
        return (encode(I64, acc), false);
    }
    let mut sat = false;
    let v: Vec<i64> = acc
        .iter()
        .map(|&a| {
            let c = a.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
            sat |= c != a;
            c
        })
        .collect();
    (encode(I32, &v), sat)
}

// ---------------------------------------------------------------------------
// The table.

#[derive(Clone, Debug, PartialEq, Eq)]
struct Rec {
    op_id: u32,
    frag_off: u32,
    mask_base: u16,
    msg_len: u32,
    payload_len: u16,
    agg_op: u8,
    dtype: u8,
    overflow: bool,
    contributors: u64,
    values: Vec<i64>,
}

impl Rec {
    /// The record of an int32 SUM message that is one chunk of `len` bytes.
    fn sum_i32(op_id: u32, len: usize, contributors: u64, values: Vec<i64>) -> Rec {
        Rec {
            op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: len as u32,
            payload_len: len as u16,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors,
            values,
        }
    }
}

enum Step {
    /// Packet in, verdict, bytes out when XDP_PASS (None: not checked).
    Pkt {
        input: Vec<u8>,
        verdict: u32,
        output: Option<Vec<u8>>,
    },
    Sleep(Duration),
    /// Write members[rank] before the next packets (mac None: unresolved
    /// neighbour); the runner restores every member after the fixture.
    Member {
        rank: u16,
        mac: Option<[u8; 6]>,
    },
    /// Free the ACTIVE slots of the call of this op id (AggEngine::free_call,
    /// kccl_agg_sweep with a request).
    FreeCall(u32),
    /// Read the ring buffer now (records join the fixture's list).
    Drain,
    /// Read at most `max` records now (AggEngine::poll_records_max); `want`
    /// of them must be there.
    DrainAtMost {
        max: usize,
        want: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Engine {
    Default,
    Chunk3432,
    /// A 9000-byte MTU's chunk: three sub-blocks, multi-buffer frames.
    Chunk8928,
    /// The largest chunk (19 sub-blocks, one IPv4 datagram), 64 slots.
    Chunk65208,
    ShortTimeout,
    SmallRing,
    /// A fresh engine for the slot-reuse fixtures (its agg_acks start empty).
    Acks,
}

impl Engine {
    fn config(self) -> AggEngineConfig {
        let mut c = AggEngineConfig::new(JOB, AGG_PORT, AGG_RANK);
        match self {
            Engine::Default | Engine::Acks => {}
            Engine::Chunk3432 => c.chunk_bytes = 3432,
            Engine::Chunk8928 => c.chunk_bytes = 8928,
            Engine::Chunk65208 => {
                c.chunk_bytes = 65208;
                c.nslots = 64;
                c.window = 32;
            }
            Engine::ShortTimeout => c.slot_timeout = Duration::from_millis(200),
            Engine::SmallRing => {
                c.ring_bytes = 16 << 10;
                c.wakeup_bytes = 8 << 10;
            }
        }
        c
    }
}

struct Fixture {
    name: String,
    engine: Engine,
    steps: Vec<Step>,
    stats: AggStats,
    /// (op_id, frag_off, state, seen) of slots to check afterwards.
    slots: Vec<(u32, u32, SlotState, u64)>,
    records: Vec<Rec>,
    /// (rank, next-hop MAC) of members[] to check afterwards.
    next_hops: Vec<(u16, Option<[u8; 6]>)>,
}

impl Fixture {
    fn new(name: impl Into<String>, engine: Engine) -> Fixture {
        Fixture {
            name: name.into(),
            engine,
            steps: vec![],
            stats: AggStats::default(),
            slots: vec![],
            records: vec![],
            next_hops: vec![],
        }
    }

    fn drop(&mut self, c: &Contrib) -> &mut Self {
        self.steps.push(Step::Pkt { input: c.build(), verdict: XDP_DROP, output: None });
        self
    }

    fn pass(&mut self, c: &Contrib, output: Vec<u8>) -> &mut Self {
        self.steps.push(Step::Pkt { input: c.build(), verdict: XDP_PASS, output: Some(output) });
        self
    }

    fn untouched(&mut self, input: Vec<u8>) -> &mut Self {
        self.steps.push(Step::Pkt { output: Some(input.clone()), input, verdict: XDP_PASS });
        self
    }
}

/// Op ids whose slots no other fixture uses (the program's slot hash).
struct OpIds {
    next: u32,
    used: HashSet<(Engine, u32)>,
}

impl OpIds {
    fn slot(e: Engine, op: u32, frag: u32) -> u32 {
        let c = e.config();
        op.wrapping_mul(0x9E37_79B1).wrapping_add(frag / c.chunk_bytes) & (c.nslots - 1)
    }

    /// An op id whose chunks at `frags` land in free slots of engine `e`.
    fn alloc(&mut self, e: Engine, frags: &[u32]) -> u32 {
        loop {
            let op = self.next;
            self.next += 1;
            let slots: Vec<u32> = frags.iter().map(|&f| Self::slot(e, op, f)).collect();
            let distinct: HashSet<u32> = slots.iter().copied().collect();
            if distinct.len() == slots.len() && slots.iter().all(|s| !self.used.contains(&(e, *s))) {
                for s in slots {
                    self.used.insert((e, s));
                }
                return op;
            }
        }
    }

    /// Another op id whose chunk 0 shares op's slot (a deliberate collision).
    /// Later allocations stay above it: a rank's contribution to an op
    /// proves it is done with every earlier one (docs/AGGREGATION.md, "Slot
    /// reuse"), so op ids must grow along the table as they do in real use.
    fn colliding(&mut self, e: Engine, op: u32) -> u32 {
        let want = Self::slot(e, op, 0);
        let o = (op + 1..).find(|&o| Self::slot(e, o, 0) == want).expect("some op id collides");
        self.next = self.next.max(o + 1);
        o
    }
}

fn name_op(op: u8) -> &'static str {
    ["?", "SUM", "COUNT", "MAX", "MIN", "AVG"].get(usize::from(op)).copied().unwrap_or("?")
}

fn name_dt(dt: u8) -> &'static str {
    ["?", "I32", "I64", "F32Q"].get(usize::from(dt)).copied().unwrap_or("?")
}

/// Contributions of ranks 1, 2, 3 per type: negatives, zeros, large values.
fn sample_values(dtype: u8) -> Vec<Vec<i64>> {
    if dtype == I64 {
        vec![
            vec![5, -7, 0, 1 << 40, -(1 << 50), 3, 0, -1],
            vec![-2, 9, 0, 1 << 41, 1 << 50, -3, 12, 0],
            vec![10, -100, 4, -(1 << 42), 7, 3, 0, -1],
        ]
    } else {
        vec![
            vec![5, -7, 0, 1_000_000, -2_000_000_000, 3, 0, -1],
            vec![-2, 9, 0, 2_000_000, 2_000_000_000, -3, 12, 0],
            vec![10, -100, 4, -3_000_000, 7, 3, 0, -1],
        ]
    }
}

fn stats(f: impl FnOnce(&mut AggStats)) -> AggStats {
    let mut s = AggStats::default();
    f(&mut s);
    s
}

fn fixtures() -> Vec<Fixture> {
    let mut t = Vec::new();
    let mut ids = OpIds { next: 1000, used: HashSet::new() };
    let ranks = [1u16, 2, 3];
    let d = Engine::Default;

    // 1. Every op x type, reduce and allreduce: two contributions consumed,
    //    the third completes (ACK + ring record, or RESULT), the third again
    //    is answered to its sender only (DUP_DONE).
    for allreduce in [false, true] {
        for op in [SUM, COUNT, MAX, MIN, AVG] {
            for dt in [I32, I64, F32Q] {
                let op_id = ids.alloc(d, &[0]);
                let vals = sample_values(dt);
                let c: Vec<Contrib> = ranks
                    .iter()
                    .zip(&vals)
                    .map(|(&r, v)| {
                        let c = Contrib::new(r, op_id, op, dt, &ranks, v);
                        if allreduce {
                            c.allreduce()
                        } else {
                            c
                        }
                    })
                    .collect();
                let (acc, ovf) = reduce(op, dt, &vals);
                let kind = if allreduce { "allreduce" } else { "reduce" };
                let mut f =
                    Fixture::new(format!("{kind} {} {}: 3 contributors, then a DUP_DONE", name_op(op), name_dt(dt)), d);
                f.drop(&c[0]).drop(&c[1]);
                if allreduce {
                    let (bytes, sat) = wire_result(dt, &acc);
                    f.pass(&c[2], c[2].answer(T_AGG_RESULT, sat || ovf, mask_of(&ranks), bytes.clone()));
                    f.pass(&c[2], c[2].answer(T_AGG_RESULT, sat || ovf, 1 << 3, bytes));
                    f.stats = stats(|s| {
                        s.pkts = 3;
                        s.chunks_done = 1;
                        s.results = 2;
                        s.dup_done = 1;
                        s.overflow = u64::from(sat || ovf);
                    });
                } else {
                    f.pass(&c[2], c[2].ack(ovf, mask_of(&ranks)));
                    f.pass(&c[2], c[2].ack(ovf, 1 << 3));
                    f.stats = stats(|s| {
                        s.pkts = 3;
                        s.chunks_done = 1;
                        s.acks = 2;
                        s.records = 1;
                        s.dup_done = 1;
                        s.overflow = u64::from(ovf);
                    });
                    f.records = vec![Rec {
                        op_id,
                        frag_off: 0,
                        mask_base: 0,
                        msg_len: c[0].msg_len,
                        payload_len: c[0].payload.len() as u16,
                        agg_op: op,
                        dtype: dt,
                        overflow: ovf,
                        contributors: mask_of(&ranks),
                        values: acc,
                    }];
                }
                f.slots = vec![(op_id, 0, SlotState::Done, mask_of(&ranks))];
                t.push(f);
            }
        }
    }

    // 2. Duplicates are ignored; the result is that of each once.
    {
        let op_id = ids.alloc(d, &[0]);
        let vals = sample_values(I32);
        let c: Vec<Contrib> =
            ranks.iter().zip(&vals).map(|(&r, v)| Contrib::new(r, op_id, SUM, I32, &ranks, v).allreduce()).collect();
        let (acc, _) = reduce(SUM, I32, &vals);
        let (bytes, _) = wire_result(I32, &acc);
        let mut f = Fixture::new("duplicates of ranks 1 and 2 ignored (allreduce SUM I32)", d);
        // Each counted retransmission is answered with PENDING naming the
        // contributors still missing.
        let all = mask_of(&ranks);
        let (b0, b1) = (1u64 << ranks[0], 1u64 << ranks[1]);
        f.drop(&c[0]).pass(&c[0], c[0].pending(all & !b0)).drop(&c[1]);
        f.pass(&c[0], c[0].pending(all & !b0 & !b1)).pass(&c[1], c[1].pending(all & !b0 & !b1));
        f.pass(&c[2], c[2].answer(T_AGG_RESULT, false, mask_of(&ranks), bytes));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.dup = 3;
            s.pending = 3;
            s.chunks_done = 1;
            s.results = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Done, mask_of(&ranks))];
        t.push(f);
    }
    {
        // An aborted call (KCCL_T_AGG_ABORT at the runtime): its ACTIVE slots
        // are freed at once, another call's are not.
        // op_a opens a call (op ids op_a .. op_a + 3) no other fixture uses.
        let op_a = loop {
            let op = ids.alloc(d, &[0]);
            if op % 4 == 0 {
                break op;
            }
        };
        ids.next = op_a + 4;
        let op_b = ids.alloc(d, &[0]);
        let a = Contrib::new(1, op_a, SUM, I32, &ranks, &[1, 2]);
        let b = Contrib::new(1, op_b, SUM, I32, &ranks, &[1, 2]);
        let mut f = Fixture::new(
            "free_call of an aborted call: its ACTIVE slot FREE, another call's kept; its late contributions passed",
            d,
        );
        f.drop(&a).drop(&b);
        f.steps.push(Step::FreeCall(op_a + 1));
        // Late contributions of the aborted call (any of its ops) go to user
        // space untouched, which answers them with the abort; none claims
        // a slot.  The other call still aggregates.
        f.untouched(Contrib::new(2, op_a, SUM, I32, &ranks, &[3, 4]).build());
        f.untouched(Contrib::new(3, op_a + 2, SUM, I32, &ranks, &[5, 6]).build());
        f.drop(&Contrib::new(2, op_b, SUM, I32, &ranks, &[3, 4]));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.abort_freed = 1;
            s.aborted_call = 2;
        });
        // (Freeing changes the state only, as the sweep does: the bitmap
        // is reset by the next claim.)
        f.slots = vec![(op_a, 0, SlotState::Free, 1 << 1), (op_b, 0, SlotState::Active, 1 << 1 | 1 << 2)];
        t.push(f);
    }
    {
        // agg_aborted keeps the AGG_ABORTED_MAX most recent calls: after
        // that many more aborts the oldest call aggregates again (a new
        // call of a restarted job may reuse its op ids).
        let calls: Vec<u32> = (0..=AGG_ABORTED_MAX)
            .map(|_| {
                let op = loop {
                    let op = ids.alloc(d, &[0]);
                    if op % 4 == 0 {
                        break op;
                    }
                };
                ids.next = op + 4;
                op
            })
            .collect();
        let mut f = Fixture::new("agg_aborted: the oldest of AGG_ABORTED_MAX + 1 aborted calls is forgotten", d);
        for &c in &calls {
            f.steps.push(Step::FreeCall(c));
        }
        let first = Contrib::new(1, calls[0], SUM, I32, &ranks, &[1, 2]);
        f.drop(&first);
        for &c in &calls[1..] {
            f.untouched(Contrib::new(1, c + 3, SUM, I32, &ranks, &[1, 2]).build());
        }
        f.stats = stats(|s| {
            s.pkts = 1;
            s.aborted_call = AGG_ABORTED_MAX as u64;
        });
        f.slots = vec![(calls[0], 0, SlotState::Active, 1 << 1)];
        t.push(f);
    }
    {
        // Active slot: a duplicate leaves the chunk incomplete.
        let op_id = ids.alloc(d, &[0]);
        let c = Contrib::new(1, op_id, SUM, I32, &ranks, &[1, 2]);
        let mut f = Fixture::new("duplicate while active: slot stays ACTIVE with one contributor", d);
        f.drop(&c).pass(&c, c.pending(mask_of(&ranks) & !(1 << 1)));
        f.stats = stats(|s| {
            s.pkts = 1;
            s.dup = 1;
            s.pending = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Active, 1 << 1)];
        t.push(f);
    }

    // 3. A single contributor completes at once; a two-chunk reduce writes
    //    two records (frag_off 0 and 1432, the last chunk short).
    {
        let op_id = ids.alloc(d, &[0, CHUNK]);
        let vals0: Vec<i64> = (0..358).map(|i| i * 3 - 500).collect();
        let vals1: Vec<i64> = vec![-9, 8, -7];
        let mk = |r: u16, frag: u32, v: &[i64]| {
            let mut c = Contrib::new(r, op_id, SUM, I32, &[1, 2], v);
            c.frag_off = frag;
            c.msg_len = CHUNK + 12;
            c.flags = if frag == 0 { 0 } else { F_LAST_FRAG };
            c
        };
        let twice = |v: &[i64]| v.iter().map(|x| x * 2).collect::<Vec<i64>>();
        let mut f = Fixture::new("reduce of two chunks (1432 + 12 bytes), 2 contributors: two records", d);
        let (a0, a1, b0, b1) = (mk(1, 0, &vals0), mk(1, CHUNK, &vals1), mk(2, 0, &vals0), mk(2, CHUNK, &vals1));
        f.drop(&a1).drop(&a0).pass(&b0, b0.ack(false, 0b110)).pass(&b1, b1.ack(false, 0b110));
        f.stats = stats(|s| {
            s.pkts = 4;
            s.chunks_done = 2;
            s.acks = 2;
            s.records = 2;
        });
        let rec = |frag: u32, v: &[i64]| Rec {
            op_id,
            frag_off: frag,
            mask_base: 0,
            msg_len: CHUNK + 12,
            payload_len: (v.len() * 4) as u16,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors: 0b110,
            values: twice(v),
        };
        f.records = vec![rec(0, &vals0), rec(CHUNK, &vals1)];
        f.slots = vec![(op_id, 0, SlotState::Done, 0b110), (op_id, CHUNK, SlotState::Done, 0b110)];
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let c = Contrib::new(5, op_id, MAX, I64, &[5], &[i64::MIN, i64::MAX, 0]).allreduce();
        let mut f = Fixture::new("single contributor (rank 5): RESULT at once, extremes of int64", d);
        f.pass(&c, c.answer(T_AGG_RESULT, false, 1 << 5, encode(I64, &[i64::MIN, i64::MAX, 0])));
        f.stats = stats(|s| {
            s.pkts = 1;
            s.chunks_done = 1;
            s.results = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Done, 1 << 5)];
        t.push(f);
    }
    {
        // IPv4 options: the answer keeps them, lengths and checksum fixed.
        let op_id = ids.alloc(d, &[0]);
        let mut a = Contrib::new(1, op_id, SUM, I32, &[1, 2], &[1, -1]);
        let mut b = Contrib::new(2, op_id, SUM, I32, &[1, 2], &[2, -2]);
        a.options = vec![0x94, 0x04, 0, 0];
        b.options = vec![0x94, 0x04, 0, 0];
        let mut f = Fixture::new("IPv4 options (ihl 6): ACK keeps them", d);
        f.drop(&a).pass(&b, b.ack(false, 0b110));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.acks = 1;
            s.records = 1;
        });
        f.records = vec![Rec {
            op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: 8,
            payload_len: 8,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors: 0b110,
            values: vec![3, -3],
        }];
        t.push(f);
    }

    // 4. Overflow.
    {
        let op_id = ids.alloc(d, &[0]);
        let v = [vec![i64::from(i32::MAX), i64::from(i32::MIN), 5], vec![1, -1, 6], vec![1, -1, -2]];
        let c: Vec<Contrib> =
            ranks.iter().zip(&v).map(|(&r, v)| Contrib::new(r, op_id, SUM, I32, &ranks, v).allreduce()).collect();
        let mut f = Fixture::new("allreduce I32 SUM outside int32: saturated, F_OVERFLOW", d);
        let want = encode(I32, &[i64::from(i32::MAX), i64::from(i32::MIN), 9]);
        f.drop(&c[0]).drop(&c[1]).pass(&c[2], c[2].answer(T_AGG_RESULT, true, mask_of(&ranks), want));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.chunks_done = 1;
            s.results = 1;
            s.overflow = 1;
        });
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let v = [vec![2_000_000_000, 1], vec![2_000_000_000, 1]];
        let c: Vec<Contrib> =
            [1u16, 2].iter().zip(&v).map(|(&r, v)| Contrib::new(r, op_id, AVG, F32Q, &[1, 2], v).allreduce()).collect();
        let mut f = Fixture::new("allreduce F32Q AVG sum beyond int32: saturated, F_OVERFLOW", d);
        let want = encode(I32, &[i64::from(i32::MAX), 2]);
        f.drop(&c[0]).pass(&c[1], c[1].answer(T_AGG_RESULT, true, 0b110, want));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.results = 1;
            s.overflow = 1;
        });
        t.push(f);
    }
    {
        // The element loops work on 24-byte blocks of a scratch copy of the
        // payload, zero-filled past its end: what a longer earlier packet
        // left in the scratch buffer (here int32::MAX everywhere) must not
        // leak into a short chunk's result (as a saturation or an overflow).
        let (big, short32, short64) = (ids.alloc(d, &[0]), ids.alloc(d, &[0]), ids.alloc(d, &[0]));
        let filler = Contrib::new(1, big, SUM, I32, &ranks, &[i64::from(i32::MAX); 358]).allreduce();
        let c32: Vec<Contrib> = [(1u16, 7i64), (2, -2)]
            .iter()
            .map(|&(r, v)| Contrib::new(r, short32, SUM, I32, &[1, 2], &[v]).allreduce())
            .collect();
        let c64: Vec<Contrib> = [(1u16, 1i64 << 40), (2, -3)]
            .iter()
            .map(|&(r, v)| Contrib::new(r, short64, SUM, I64, &[1, 2], &[v]).allreduce())
            .collect();
        // Rank 3 (still in the big operation) refills the scratch buffer
        // between the short chunks.
        let filler3 = Contrib::new(3, big, SUM, I32, &ranks, &[i64::from(i32::MAX); 358]).allreduce();
        let mut f = Fixture::new("short chunks after a full one: no stale scratch bytes in the result", d);
        f.drop(&filler).drop(&c32[0]).pass(&c32[1], c32[1].answer(T_AGG_RESULT, false, 0b110, encode(I32, &[5])));
        f.drop(&filler3).drop(&c64[0]);
        f.pass(&c64[1], c64[1].answer(T_AGG_RESULT, false, 0b110, encode(I64, &[(1 << 40) - 3])));
        f.stats = stats(|s| {
            s.pkts = 6;
            s.chunks_done = 2;
            s.results = 2;
        });
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let v = [vec![i64::MAX, -5], vec![1, 5]];
        let c: Vec<Contrib> =
            [1u16, 2].iter().zip(&v).map(|(&r, v)| Contrib::new(r, op_id, SUM, I64, &[1, 2], v)).collect();
        let mut f = Fixture::new("reduce I64 SUM overflow: record overflow, ACK with F_OVERFLOW", d);
        f.drop(&c[0]).pass(&c[1], c[1].ack(true, 0b110));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.acks = 1;
            s.records = 1;
            s.overflow = 1;
        });
        f.records = vec![Rec {
            op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: 16,
            payload_len: 16,
            agg_op: SUM,
            dtype: I64,
            overflow: true,
            contributors: 0b110,
            values: vec![i64::MIN, 0],
        }];
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let v = [vec![i64::MIN, 3], vec![-1, 4]];
        let c: Vec<Contrib> =
            [1u16, 2].iter().zip(&v).map(|(&r, v)| Contrib::new(r, op_id, SUM, I64, &[1, 2], v).allreduce()).collect();
        let mut f = Fixture::new("allreduce I64 SUM negative overflow: F_OVERFLOW", d);
        f.drop(&c[0]).pass(&c[1], c[1].answer(T_AGG_RESULT, true, 0b110, encode(I64, &[i64::MAX, 7])));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.results = 1;
            s.overflow = 1;
        });
        t.push(f);
    }

    // 5. Rejected contributions.
    let one = |ids: &mut OpIds| {
        let op_id = ids.alloc(d, &[0]);
        Contrib::new(1, op_id, SUM, I32, &ranks, &[1, 2, 3, 4])
    };
    {
        let mut c = one(&mut ids);
        c.mask = mask_of(&[2, 3]);
        let mut f = Fixture::new("sender rank 1 not in the contributor mask", d);
        f.drop(&c);
        f.stats = stats(|s| s.not_contrib = 1);
        f.slots = vec![(c.op_id, 0, SlotState::Free, 0)];
        t.push(f);
    }
    {
        let mut c = one(&mut ids);
        c.saddr = Some(Ipv4Addr::new(10, 9, 0, 2));
        let mut f = Fixture::new("source address is rank 2's, src_rank 1: NOT_MEMBER", d);
        f.drop(&c);
        f.stats = stats(|s| s.not_member = 1);
        t.push(f);
    }
    {
        let mut c = one(&mut ids);
        c.src = 20;
        c.mask = mask_of(&[1, 20]);
        let mut f = Fixture::new("rank 20 has no members entry: NOT_MEMBER", d);
        f.drop(&c);
        f.stats = stats(|s| s.not_member = 1);
        t.push(f);
    }
    // Next hops learned from contributions: the fan-out works however cold
    // the neighbour table was when the runtime filled members[].
    {
        let op_id = ids.alloc(d, &[0]);
        let c = Contrib::new(1, op_id, SUM, I32, &ranks, &[1, 2]);
        let mut f = Fixture::new("unresolved rank 1 contributes: its next hop is learned from the source MAC", d);
        f.steps.push(Step::Member { rank: 1, mac: None });
        f.drop(&c);
        f.stats = stats(|s| {
            s.pkts = 1;
            s.next_hop_learned = 1;
        });
        f.next_hops = vec![(1, Some(mac_of(1))), (2, Some(mac_of(2)))];
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let moved = [0x02, 0xee, 0, 0, 0, 1];
        let c = Contrib::new(1, op_id, SUM, I32, &ranks, &[1, 2]);
        let mut input = c.build();
        input[6..12].copy_from_slice(&moved);
        let r = Contrib::new(2, op_id, SUM, I32, &ranks, &[3, 4]);
        let mut f = Fixture::new("rank 1 now behind another next hop: relearned; rank 2 unchanged, not rewritten", d);
        f.steps.push(Step::Pkt { input, verdict: XDP_DROP, output: None });
        f.drop(&r);
        f.stats = stats(|s| {
            s.pkts = 2;
            s.next_hop_learned = 1;
        });
        f.next_hops = vec![(1, Some(moved)), (2, Some(mac_of(2)))];
        t.push(f);
    }
    {
        let mut c = one(&mut ids);
        c.saddr = Some(Ipv4Addr::new(10, 9, 0, 2));
        let mut input = c.build();
        input[6..12].copy_from_slice(&[0x02, 0xba, 0xd0, 0, 0, 1]);
        let mut f = Fixture::new("forged rank 1 (rank 2's address, another MAC): NOT_MEMBER, nothing learned", d);
        f.steps.push(Step::Member { rank: 1, mac: None });
        f.steps.push(Step::Pkt { input, verdict: XDP_DROP, output: None });
        f.stats = stats(|s| s.not_member = 1);
        f.next_hops = vec![(1, None)];
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let a = Contrib::new(1, op_id, SUM, I32, &ranks, &[1, 2, 3, 4]);
        let mut b = Contrib::new(2, op_id, SUM, I32, &ranks, &[1, 2]);
        b.msg_len = 8;
        let mut c = Contrib::new(3, op_id, MAX, I32, &ranks, &[1, 2, 3, 4]);
        let mut e = Contrib::new(3, op_id, SUM, I64, &ranks, &[1, 2]);
        let mut g = Contrib::new(3, op_id, SUM, I32, &[1, 3], &[1, 2, 3, 4]);
        c.op_id = op_id;
        e.op_id = op_id;
        g.op_id = op_id;
        let mut f = Fixture::new("mismatch with the slot: length, op, type, contributor mask", d);
        f.drop(&a).drop(&b).drop(&c).drop(&e).drop(&g);
        f.stats = stats(|s| {
            s.pkts = 1;
            s.mismatch = 4;
        });
        f.slots = vec![(op_id, 0, SlotState::Active, 1 << 1)];
        t.push(f);
    }

    {
        // An allreduce contribution that disagrees with its chunk's slot is
        // passed up whole with KCCL_F_MISMATCH (and no UDP checksum): the
        // runtime aborts the call for every member.  A reduce one is
        // dropped (the fixture above).
        let op_id = ids.alloc(d, &[0]);
        let a = Contrib::new(1, op_id, SUM, I32, &ranks, &[1, 2, 3, 4]).allreduce();
        let mut b = Contrib::new(2, op_id, SUM, I32, &ranks, &[1, 2]).allreduce();
        b.msg_len = 8;
        let mut flagged = b.frame();
        flagged.udp_csum = false;
        let mut h = b.header();
        h.flags |= F_MISMATCH;
        flagged.payload[..HDR_LEN].copy_from_slice(&h.to_bytes());
        let mut f = Fixture::new("allreduce mismatch: passed up flagged for the runtime's abort", d);
        f.drop(&a).pass(&b, flagged.build());
        f.stats = stats(|s| {
            s.pkts = 1;
            s.mismatch = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Active, 1 << 1)];
        t.push(f);
    }

    // 6. Malformed: dropped and counted.
    let malformed = |name: &str, input: Vec<u8>| {
        let mut f = Fixture::new(format!("malformed: {name}"), d);
        f.steps.push(Step::Pkt { input, verdict: XDP_DROP, output: None });
        f.stats = stats(|s| s.malformed = 1);
        f
    };
    {
        let mut c = one(&mut ids);
        c.udp_len_field = Some((8 + 40 + 16 + 40) as u16);
        t.push(malformed("UDP length beyond the frame", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.payload_len = Some(20);
        t.push(malformed("payload_len 20 for 16 bytes", c.build()));
    }
    {
        let c = one(&mut ids);
        let mut fr = c.frame();
        fr.payload.truncate(24);
        t.push(malformed("short header (24 bytes of it)", fr.build()));
    }
    {
        let mut c = one(&mut ids);
        c.payload.truncate(6);
        c.msg_len = 6;
        t.push(malformed("payload of 6 bytes with I32 elements", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.dtype = I64;
        c.payload.truncate(12);
        c.msg_len = 12;
        t.push(malformed("payload of 12 bytes with I64 elements", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.frag_off = 100;
        c.msg_len = 116;
        t.push(malformed("frag_off 100 not a multiple of the chunk size", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.frag_off = CHUNK;
        c.msg_len = 1000;
        t.push(malformed("chunk at 1432 beyond msg_len 1000", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.msg_len = 2000;
        c.flags = 0;
        t.push(malformed("non-last chunk of 16 bytes (chunk size 1432)", c.build()));
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let c = Contrib::new(1, op_id, SUM, I32, &ranks, &vec![1; 362]);
        t.push(malformed("payload of 1448 bytes > chunk size 1432", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.payload.clear();
        c.msg_len = 0;
        t.push(malformed("empty payload", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.version = 2;
        t.push(malformed("version 2", c.build()));
    }
    {
        let mut c = one(&mut ids);
        // The first type kccl does not define (KCCL_T_AGG_ABORT is the last).
        c.msg_type = T_AGG_ABORT + 1;
        t.push(malformed("type 12", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.mask_base = 32;
        t.push(malformed("mask_base 32", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.mask_base = 4096;
        t.push(malformed("mask_base 4096 (beyond members)", c.build()));
    }
    {
        let mut c = one(&mut ids);
        c.mask = 0;
        t.push(malformed("dst_mask 0", c.build()));
    }
    {
        let c = one(&mut ids);
        let mut b = c.build();
        b.truncate(14 + 20 + 8 + 40 + 10);
        t.push(malformed("frame cut inside the payload (IP/UDP lengths beyond it)", b));
    }

    // 7. Passed untouched.
    let passed = |name: &str, input: Vec<u8>, s: AggStats| {
        let mut f = Fixture::new(name, d);
        f.untouched(input);
        f.stats = s;
        f
    };
    {
        let mut c = one(&mut ids);
        c.job = JOB + 1;
        t.push(passed("other job", c.build(), stats(|s| s.other_job = 1)));
    }
    {
        let mut c = one(&mut ids);
        c.op = 6;
        t.push(passed("unknown op 6: to user space", c.build(), stats(|s| s.unsupported = 1)));
    }
    {
        let mut c = one(&mut ids);
        c.dtype = 4;
        t.push(passed("unknown dtype 4: to user space", c.build(), stats(|s| s.unsupported = 1)));
    }
    {
        let mut c = one(&mut ids);
        c.flags |= F_USER_ONLY;
        t.push(passed("KCCL_F_USER_ONLY: to user space", c.build(), stats(|s| s.user_only = 1)));
    }
    for (ty, label) in [(T_AGG_RESULT, "RESULT"), (T_AGG_ACK, "ACK"), (T_BCAST, "BCAST")] {
        let mut c = one(&mut ids);
        c.msg_type = ty;
        t.push(passed(&format!("{label} type to the port"), c.build(), stats(|s| s.passed = 1)));
    }
    {
        let c = one(&mut ids);
        let mut fr = c.frame();
        fr.dport = 53;
        t.push(passed("kccl contribution to another port", fr.build(), stats(|s| s.passed = 1)));
    }
    {
        let c = one(&mut ids);
        let mut fr = c.frame();
        fr.payload = (0..60u8).collect();
        t.push(passed("plain UDP to the port (no magic)", fr.build(), stats(|s| s.passed = 1)));
    }
    {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&mac_of(1));
        f.extend_from_slice(&0x0806u16.to_be_bytes());
        f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
        f.extend_from_slice(&mac_of(1));
        f.extend_from_slice(&ip_of(1).octets());
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&AGG_IP.octets());
        t.push(passed("ARP request", f, stats(|s| s.passed = 1)));
    }

    // 8. Busy slot and reclaim after the slot timeout.
    {
        let e = Engine::ShortTimeout;
        let op_a = ids.alloc(e, &[0]);
        let op_b = ids.colliding(e, op_a);
        ids.used.insert((e, OpIds::slot(e, op_b, 0)));
        let a = Contrib::new(1, op_a, SUM, I32, &ranks, &[1, 2]);
        let b1 = Contrib::new(1, op_b, SUM, I32, &[1, 2], &[10, 20]);
        let b2 = Contrib::new(2, op_b, SUM, I32, &[1, 2], &[5, 6]);
        let mut f = Fixture::new("busy slot, then reclaimed after cfg_slot_timeout_ns (200 ms)", e);
        f.drop(&a).drop(&b1);
        f.steps.push(Step::Sleep(Duration::from_millis(300)));
        f.drop(&b1).pass(&b2, b2.ack(false, 0b110));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.busy = 1;
            s.reclaimed = 1;
            s.chunks_done = 1;
            s.acks = 1;
            s.records = 1;
        });
        f.records = vec![Rec {
            op_id: op_b,
            frag_off: 0,
            mask_base: 0,
            msg_len: 8,
            payload_len: 8,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors: 0b110,
            values: vec![15, 26],
        }];
        f.slots = vec![(op_b, 0, SlotState::Done, 0b110)];
        t.push(f);
    }
    {
        // A DONE slot of another chunk whose contributor proved it has the
        // answer (its receipt) is simply taken over.
        let e = Engine::ShortTimeout;
        let op_a = ids.alloc(e, &[0]);
        let op_b = ids.colliding(e, op_a);
        ids.used.insert((e, OpIds::slot(e, op_b, 0)));
        let a = Contrib::new(1, op_a, SUM, I32, &[1], &[1]).allreduce();
        let b = Contrib::new(2, op_b, SUM, I32, &[2, 3], &[2]);
        let mut f = Fixture::new("DONE slot of another chunk claimed at once (not a reclaim)", e);
        f.pass(&a, a.answer(T_AGG_RESULT, false, 1 << 1, encode(I32, &[1])));
        let r = Contrib::receipt(1, op_a, 4);
        f.pass(&r, r.build()).drop(&b);
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.results = 1;
            s.receipts = 1;
        });
        f.slots = vec![(op_b, 0, SlotState::Active, 1 << 2)];
        t.push(f);
    }

    // 9. Full chunks.
    {
        let op_id = ids.alloc(d, &[0]);
        let v1: Vec<i64> = (0..358).map(|i| (i * 7919) % 100_003 - 50_000).collect();
        let v2: Vec<i64> = (0..358).map(|i| -(i * 104_729) % 65_537).collect();
        let a = Contrib::new(1, op_id, SUM, I32, &[1, 2], &v1).allreduce();
        let b = Contrib::new(2, op_id, SUM, I32, &[1, 2], &v2).allreduce();
        assert_eq!(b.build().len(), 1514);
        let (acc, _) = reduce(SUM, I32, &[v1, v2]);
        let mut f = Fixture::new("full 1432-byte chunk (358 x I32), allreduce SUM, 1514-byte frame", d);
        f.drop(&a).pass(&b, b.answer(T_AGG_RESULT, false, 0b110, encode(I32, &acc)));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.results = 1;
        });
        t.push(f);
    }
    {
        let op_id = ids.alloc(d, &[0]);
        let v1: Vec<i64> = (0..179).map(|i| (i << 33) - (1 << 40)).collect();
        let v2: Vec<i64> = (0..179).map(|i| i * 3 - 200).collect();
        let a = Contrib::new(1, op_id, MIN, I64, &[1, 2], &v1);
        let b = Contrib::new(2, op_id, MIN, I64, &[1, 2], &v2);
        let (acc, _) = reduce(MIN, I64, &[v1, v2]);
        let mut f = Fixture::new("full 1432-byte chunk (179 x I64), reduce MIN: record values", d);
        f.drop(&a).pass(&b, b.ack(false, 0b110));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.acks = 1;
            s.records = 1;
        });
        f.records = vec![Rec {
            op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: 1432,
            payload_len: 1432,
            agg_op: MIN,
            dtype: I64,
            overflow: false,
            contributors: 0b110,
            values: acc,
        }];
        t.push(f);
    }
    {
        let e = Engine::Chunk3432;
        let op_id = ids.alloc(e, &[0]);
        let vals: Vec<Vec<i64>> = (1..=3)
            .map(|r: i64| (0..858).map(|i| (i * 31 + r * 1_000_003) % 2_000_001 - 1_000_000).collect())
            .collect();
        let c: Vec<Contrib> =
            ranks.iter().zip(&vals).map(|(&r, v)| Contrib::new(r, op_id, SUM, I32, &ranks, v)).collect();
        assert_eq!(c[0].build().len(), 14 + 20 + 8 + 40 + 3432);
        let (acc, _) = reduce(SUM, I32, &vals);
        let mut f = Fixture::new("full 3432-byte chunk (858 x I32, cfg_chunk_bytes 3432), reduce SUM", e);
        f.drop(&c[0]).drop(&c[1]).pass(&c[2], c[2].ack(false, mask_of(&ranks)));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.chunks_done = 1;
            s.acks = 1;
            s.records = 1;
        });
        f.records = vec![Rec {
            op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: 3432,
            payload_len: 3432,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors: mask_of(&ranks),
            values: acc,
        }];
        t.push(f);
    }
    {
        let e = Engine::Chunk3432;
        let op_id = ids.alloc(e, &[0]);
        let vals: Vec<Vec<i64>> =
            (1..=2).map(|r: i64| (0..429).map(|i| (i - 200) * r * 1_000_000_007).collect()).collect();
        let c: Vec<Contrib> = [1u16, 2]
            .iter()
            .zip(&vals)
            .map(|(&r, v)| Contrib::new(r, op_id, MAX, I64, &[1, 2], v).allreduce())
            .collect();
        let (acc, _) = reduce(MAX, I64, &vals);
        let mut f = Fixture::new("full 3432-byte chunk (429 x I64), allreduce MAX", e);
        f.drop(&c[0]).pass(&c[1], c[1].answer(T_AGG_RESULT, false, 0b110, encode(I64, &acc)));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.results = 1;
        });
        t.push(f);
    }
    {
        let e = Engine::Chunk3432;
        let op_id = ids.alloc(e, &[0]);
        let c = Contrib::new(1, op_id, SUM, I32, &ranks, &[1; 358]);
        let mut f = Fixture::new("chunk 3432: a 1432-byte non-last chunk is malformed", e);
        let mut c2 = c.clone();
        c2.msg_len = 5000;
        c2.flags = 0;
        f.drop(&c2);
        f.stats = stats(|s| s.malformed = 1);
        t.push(f);
    }

    // 9b. Multi-buffer frames (xdp.frags).  BPF_PROG_TEST_RUN puts 3520
    //     bytes in the linear part and the rest in 4096-byte fragments, so the
    //     payload (from byte 82) crosses a fragment boundary inside an element
    //     (3520 - 82 = 3438 is not a multiple of 4 or 8) and every sub-block
    //     boundary (3432 bytes) falls elsewhere than a fragment's.
    {
        let e = Engine::Chunk65208;
        let op_id = ids.alloc(e, &[0]);
        let n = 65208 / 4;
        let vals: Vec<Vec<i64>> = (1..=3)
            .map(|r: i64| (0..n as i64).map(|i| (i * 7919 + r * 1_000_003) % 2_000_000_001 - 1_000_000_000).collect())
            .collect();
        let c: Vec<Contrib> =
            ranks.iter().zip(&vals).map(|(&r, v)| Contrib::new(r, op_id, SUM, I32, &ranks, v)).collect();
        assert_eq!(c[0].build().len(), 14 + 20 + 8 + 40 + 65208);
        let (acc, _) = reduce(SUM, I32, &vals);
        let mut f =
            Fixture::new("65208-byte chunk, one multi-buffer frame (19 sub-blocks, 16302 x I32), reduce SUM", e);
        f.drop(&c[0]).drop(&c[1]).pass(&c[2], c[2].ack(false, mask_of(&ranks)));
        // A retransmission of the finished chunk: the ACK again, to its sender.
        f.pass(&c[0], c[0].ack(false, mask_of(&ranks[..1])));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.chunks_done = 1;
            s.acks = 2;
            s.dup_done = 1;
            s.records = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Done, mask_of(&ranks))];
        f.records = vec![Rec::sum_i32(op_id, 65208, mask_of(&ranks), acc)];
        t.push(f);
    }
    for e in [Engine::Default, Engine::Chunk65208] {
        // KCCL_F_ACK_LATER (kccl's own senders): the completing contribution
        // only becomes the record and is dropped whole, a multi-buffer frame
        // too (no ACK, no pass to tc_agg_result: the root's runtime
        // acknowledges the chunks it read, many per datagram).  A
        // retransmission of the finished chunk is still answered, to its
        // sender only.
        let op_id = ids.alloc(e, &[0]);
        let n = if e == Engine::Default { 5 } else { 65208 / 4 };
        let vals: Vec<Vec<i64>> = (1..=3).map(|r: i64| (0..n as i64).map(|i| i * 31 - r * 1000).collect()).collect();
        let c: Vec<Contrib> = ranks
            .iter()
            .zip(&vals)
            .map(|(&r, v)| {
                let mut c = Contrib::new(r, op_id, SUM, I32, &ranks, v);
                c.flags |= F_ACK_LATER;
                c
            })
            .collect();
        let (acc, _) = reduce(SUM, I32, &vals);
        let mut f = Fixture::new(
            format!("reduce SUM of {n} x I32 with ACK_LATER: record only, no ACK; a retransmission is answered"),
            e,
        );
        f.drop(&c[0]).drop(&c[1]).drop(&c[2]).pass(&c[1], c[1].ack(false, mask_of(&ranks[1..2])));
        f.stats = stats(|s| {
            s.pkts = 3;
            s.chunks_done = 1;
            s.records = 1;
            s.acks_later = 1;
            s.acks = 1;
            s.dup_done = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Done, mask_of(&ranks))];
        f.records = vec![Rec::sum_i32(op_id, n * 4, mask_of(&ranks), acc)];
        t.push(f);
    }
    {
        let e = Engine::Chunk65208;
        let op_id = ids.alloc(e, &[0]);
        let n = 65208 / 4;
        // Sums beyond int32 in the last sub-block only: saturated there.
        let vals: Vec<Vec<i64>> = (1..=2)
            .map(|r: i64| {
                (0..n as i64).map(|i| if i >= n as i64 - 3 { 2_000_000_000 } else { (i - 8000) * r }).collect()
            })
            .collect();
        let c: Vec<Contrib> = [1u16, 2]
            .iter()
            .zip(&vals)
            .map(|(&r, v)| Contrib::new(r, op_id, SUM, I32, &[1, 2], v).allreduce())
            .collect();
        let (acc, _) = reduce(SUM, I32, &vals);
        let (want, sat) = wire_result(I32, &acc);
        assert!(sat);
        let mut f = Fixture::new("65208-byte chunk, multi-buffer allreduce SUM: RESULT written across fragments", e);
        f.drop(&c[0]).pass(&c[1], c[1].answer(T_AGG_RESULT, true, 0b110, want.clone()));
        f.pass(&c[0], c[0].answer(T_AGG_RESULT, true, 0b010, want));
        f.stats = stats(|s| {
            s.pkts = 2;
            s.chunks_done = 1;
            s.results = 2;
            s.dup_done = 1;
            s.overflow = 1;
        });
        t.push(f);
    }
    {
        // Chunk 8928, msg 8928 + 7544: the second (last) chunk's frame is
        // 82 + 7544 = 7626 bytes, its last fragment 10 bytes long.
        let e = Engine::Chunk8928;
        let op_id = ids.alloc(e, &[0, 8928]);
        let msg = 8928 + 7544;
        let vals: Vec<Vec<i64>> =
            (1..=2).map(|r: i64| (0..(msg / 8) as i64).map(|i| (i - 900) * r * 1_000_000_007).collect()).collect();
        let mut f = Fixture::new(
            "chunk 8928, I64 MIN: full chunk of 3 sub-blocks, short last chunk ending in a 10-byte fragment",
            e,
        );
        let mut recs = Vec::new();
        for (frag, len) in [(0usize, 8928usize), (8928, 7544)] {
            let part: Vec<Vec<i64>> = vals.iter().map(|v| v[frag / 8..(frag + len) / 8].to_vec()).collect();
            let c: Vec<Contrib> = [1u16, 2]
                .iter()
                .zip(&part)
                .map(|(&r, v)| {
                    let mut c = Contrib::new(r, op_id, MIN, I64, &[1, 2], v);
                    c.frag_off = frag as u32;
                    c.msg_len = msg as u32;
                    c.flags = if frag + len == msg { F_LAST_FRAG } else { 0 };
                    c
                })
                .collect();
            f.drop(&c[0]).pass(&c[1], c[1].ack(false, 0b110));
            let (acc, _) = reduce(MIN, I64, &part);
            recs.push(Rec {
                op_id,
                frag_off: frag as u32,
                mask_base: 0,
                msg_len: msg as u32,
                payload_len: len as u16,
                agg_op: MIN,
                dtype: I64,
                overflow: false,
                contributors: 0b110,
                values: acc,
            });
        }
        f.stats = stats(|s| {
            s.pkts = 4;
            s.chunks_done = 2;
            s.acks = 2;
            s.records = 2;
        });
        f.records = recs;
        t.push(f);
    }
    {
        let e = Engine::Chunk8928;
        let op_id = ids.alloc(e, &[0]);
        let mut f = Fixture::new("chunk 8928: a 8936-byte frame (longer than the slot's chunk) is malformed", e);
        let mut c = Contrib::new(1, op_id, SUM, I32, &ranks, &[1; 2234]);
        c.msg_len = 20000;
        c.flags = 0;
        f.drop(&c);
        let mut big = Contrib::new(1, op_id, SUM, I32, &ranks, &[1; 65216 / 4]);
        big.msg_len = 65216;
        f.drop(&big);
        f.stats = stats(|s| s.malformed = 2);
        t.push(f);
    }

    // 10. Ring buffer full: the chunk is kept UNDELIVERED, the packet dropped
    //     (no ACK); once the reader drained the ring, a retransmission gets
    //     the record written and the ACK to every contributor.
    {
        let e = Engine::SmallRing;
        let mut f = Fixture::new("ring buffer full: UNDELIVERED, retried on retransmission", e);
        let vals: Vec<i64> = (0..358).collect();
        // A 358-value record takes 32 + 2864 + 8 bytes: five fit in 16 KiB.
        let mut recs = Vec::new();
        let mut last = None;
        for k in 0..6 {
            let op_id = ids.alloc(e, &[0]);
            let c = Contrib::new(1, op_id, SUM, I32, &[1], &vals);
            if k < 5 {
                f.pass(&c, c.ack(false, 1 << 1));
                recs.push(Rec {
                    op_id,
                    frag_off: 0,
                    mask_base: 0,
                    msg_len: 1432,
                    payload_len: 1432,
                    agg_op: SUM,
                    dtype: I32,
                    overflow: false,
                    contributors: 1 << 1,
                    values: vals.clone(),
                });
            } else {
                f.drop(&c);
                last = Some(c);
            }
        }
        let c = last.expect("sixth chunk");
        f.steps.push(Step::Drain);
        f.pass(&c, c.ack(false, 1 << 1));
        recs.push(Rec {
            op_id: c.op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: 1432,
            payload_len: 1432,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors: 1 << 1,
            values: vals.clone(),
        });
        f.records = recs;
        f.stats = stats(|s| {
            s.pkts = 6;
            s.chunks_done = 6;
            s.acks = 6;
            s.records = 6;
            s.ring_full = 1;
        });
        f.slots = vec![(c.op_id, 0, SlotState::Done, 1 << 1)];
        t.push(f);
    }

    // 11. A reader with bounded memory (a reduce root whose stash is full)
    //     takes only some records: the others stay in the ring, in order,
    //     and once it is full the kernel answers nobody (UNDELIVERED) until
    //     the reader takes more; a retransmission then completes.
    {
        let e = Engine::SmallRing;
        let mut f = Fixture::new("bounded reader: records wait in the ring, in order; backpressure when full", e);
        let vals: Vec<i64> = (0..358).map(|v| v * 3 - 500).collect();
        let rec = |op_id| Rec {
            op_id,
            frag_off: 0,
            mask_base: 0,
            msg_len: 1432,
            payload_len: 1432,
            agg_op: SUM,
            dtype: I32,
            overflow: false,
            contributors: 1 << 1,
            values: vals.clone(),
        };
        let c: Vec<Contrib> = (0..8).map(|_| Contrib::new(1, ids.alloc(e, &[0]), SUM, I32, &[1], &vals)).collect();
        // Five 2904-byte records fill the 16 KiB ring; the reader takes two.
        for k in &c[..5] {
            f.pass(k, k.ack(false, 1 << 1));
        }
        f.steps.push(Step::DrainAtMost { max: 2, want: 2 });
        f.steps.push(Step::DrainAtMost { max: 0, want: 0 });
        // Room for two more; the third finds the ring full: no ACK.
        f.pass(&c[5], c[5].ack(false, 1 << 1));
        f.pass(&c[6], c[6].ack(false, 1 << 1));
        f.drop(&c[7]);
        // The reader takes one more: the retransmission is recorded and ACKed.
        f.steps.push(Step::DrainAtMost { max: 1, want: 1 });
        f.pass(&c[7], c[7].ack(false, 1 << 1));
        // The final drain reads the five left, still in completion order.
        f.records = c.iter().map(|c| rec(c.op_id)).collect();
        f.stats = stats(|s| {
            s.pkts = 8;
            s.chunks_done = 8;
            s.acks = 8;
            s.records = 8;
            s.ring_full = 1;
        });
        f.slots = vec![(c[7].op_id, 0, SlotState::Done, 1 << 1)];
        t.push(f);
    }

    // 9. Slot reuse (docs/AGGREGATION.md, "Slot reuse"), on a fresh engine
    //    (empty agg_acks).  A DONE chunk keeps its slot until each of its
    //    contributors proved it holds the answer (a contribution to a later
    //    operation, or a RECEIPT): a contributor whose RESULT was lost still
    //    gets it from the slot after another chunk wanted the slot.
    let a = Engine::Acks;
    {
        let op_a = ids.alloc(a, &[0]);
        let op_b = ids.colliding(a, op_a);
        let ca: Vec<Contrib> = [(1u16, 10i64), (2, 20)]
            .iter()
            .map(|&(r, v)| Contrib::new(r, op_a, SUM, I32, &[1, 2], &[v]).allreduce())
            .collect();
        let cb: Vec<Contrib> = [(1u16, 100i64), (2, 200)]
            .iter()
            .map(|&(r, v)| Contrib::new(r, op_b, SUM, I32, &[1, 2], &[v]).allreduce())
            .collect();
        let res_a = encode(I32, &[30]);
        let mut f = Fixture::new("lost RESULT: the slot is held for the contributor that lacks it, then reused", a);
        f.drop(&ca[0]).pass(&ca[1], ca[1].answer(T_AGG_RESULT, false, 0b110, res_a.clone()));
        // Rank 1 has its RESULT and starts op B in the same slot: held
        // (rank 2 proved nothing yet).
        f.drop(&cb[0]);
        // Rank 2 lost its RESULT: its retransmission is answered from the slot.
        f.pass(&ca[1], ca[1].answer(T_AGG_RESULT, false, 0b100, res_a));
        // A receipt from a source that is not rank 2's address: ignored.
        let mut forged = Contrib::receipt(2, op_a, 4);
        forged.saddr = Some(ip_of(7));
        f.drop(&forged);
        // Rank 2's receipt proves it; rank 1's retransmission of B claims.
        let r = Contrib::receipt(2, op_a, 4);
        f.pass(&r, r.build());
        f.drop(&cb[0]).pass(&cb[1], cb[1].answer(T_AGG_RESULT, false, 0b110, encode(I32, &[300])));
        // A late copy of rank 1's contribution to A (rank 1 proved it has
        // A's answer by contributing to B): stale, never added, never a slot.
        f.drop(&ca[0]);
        f.stats = stats(|s| {
            s.pkts = 4;
            s.chunks_done = 2;
            s.results = 3;
            s.dup_done = 1;
            s.held = 1;
            s.stale = 1;
            s.receipts = 1;
            s.not_member = 1;
        });
        f.slots = vec![(op_b, 0, SlotState::Done, 0b110)];
        t.push(f);
    }
    {
        // Contributions prove receipt too: one to a later operation proves
        // every earlier one (no receipt needed).
        let op_a = ids.alloc(a, &[0]);
        let op_b = ids.colliding(a, op_a);
        // An op id after A (and before B: rank 4 goes on to B after it) in a
        // slot of its own.
        let op_c = (op_a + 1..op_b)
            .find(|&o| {
                let sl = OpIds::slot(a, o, 0);
                sl != OpIds::slot(a, op_a, 0) && !ids.used.contains(&(a, sl))
            })
            .expect("a free slot");
        ids.used.insert((a, OpIds::slot(a, op_c, 0)));
        let ca: Vec<Contrib> =
            [3u16, 4].iter().map(|&r| Contrib::new(r, op_a, MAX, I32, &[3, 4], &[i64::from(r)])).collect();
        let cb: Vec<Contrib> = [3u16, 4].iter().map(|&r| Contrib::new(r, op_b, MAX, I32, &[3, 4], &[7])).collect();
        let c2 = Contrib::new(4, op_c, SUM, I32, &[4, 9], &[1]);
        let mut f = Fixture::new("a contribution to a later operation proves receipt: held slot reused", a);
        f.drop(&ca[0]).pass(&ca[1], ca[1].ack(false, 0b11000));
        f.drop(&cb[0]).drop(&c2).drop(&cb[0]).pass(&cb[1], cb[1].ack(false, 0b11000));
        f.stats = stats(|s| {
            s.pkts = 5;
            s.chunks_done = 2;
            s.acks = 2;
            s.records = 2;
            s.held = 1;
        });
        f.records = vec![
            Rec {
                op_id: op_a,
                frag_off: 0,
                mask_base: 0,
                msg_len: 4,
                payload_len: 4,
                agg_op: MAX,
                dtype: I32,
                overflow: false,
                contributors: 0b11000,
                values: vec![4],
            },
            Rec {
                op_id: op_b,
                frag_off: 0,
                mask_base: 0,
                msg_len: 4,
                payload_len: 4,
                agg_op: MAX,
                dtype: I32,
                overflow: false,
                contributors: 0b11000,
                values: vec![7],
            },
        ];
        t.push(f);
    }
    {
        // A late copy of a contribution whose sender already proved it has
        // the chunk's answer (here by its receipt, the chunk's slot since
        // reused or swept): dropped as stale; it must not claim the free
        // slot, where it would wait forever for contributors that are done.
        let op_id = ids.alloc(a, &[0]);
        let c = Contrib::new(8, op_id, SUM, I32, &[8, 9], &[5]);
        let mut f = Fixture::new("late copy of a chunk its sender proved: stale, the free slot stays free", a);
        let r = Contrib::receipt(8, op_id, 4);
        f.pass(&r, r.build()).drop(&c);
        f.stats = stats(|s| {
            s.receipts = 1;
            s.stale = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Free, 0)];
        t.push(f);
    }
    {
        // SYNC requests and answers are user space's (the aggregator's
        // runtime answers which call to start at): passed untouched.
        let mut q = Contrib::receipt(8, 0, 0);
        q.msg_type = T_AGG_SYNC;
        q.frag_off = 0;
        let mut ans = q.clone();
        ans.msg_type = T_AGG_SYNC_ACK;
        let mut f = Fixture::new("SYNC and SYNC_ACK pass to user space untouched", a);
        f.pass(&q, q.build()).pass(&ans, ans.build());
        f.stats = stats(|s| s.passed = 2);
        t.push(f);
    }
    {
        // A reduce root's batched acknowledgement reaching a contributor
        // that runs xdp_agg: user space's, passed untouched.
        let mut acks = Contrib::receipt(0, 4, 64 * 1432);
        acks.msg_type = T_AGG_ACKS;
        acks.frag_off = 2 * 1432;
        acks.payload = vec![0b1011, 0x80];
        let mut f = Fixture::new("ACKS (a root's bitmap of taken chunks) passes to user space untouched", a);
        f.pass(&acks, acks.build());
        f.stats = stats(|s| s.passed = 1);
        t.push(f);
    }
    {
        // A member's abort of a call reaching a member or the aggregator
        // that runs xdp_agg: the runtime's, passed untouched.
        let mut abort = Contrib::receipt(3, 8, 64 * 1432);
        abort.msg_type = T_AGG_ABORT;
        abort.payload = [&[1u8][..], b"rank 3: element 17 is NaN"].concat();
        let mut f = Fixture::new("ABORT (a member's reason to end a call) passes to user space untouched", a);
        f.pass(&abort, abort.build());
        f.stats = stats(|s| s.passed = 1);
        t.push(f);
    }
    {
        // A 4-byte chunk: the PENDING answer grows the packet to its 8-byte mask.
        let op_id = ids.alloc(a, &[0]);
        let c = Contrib::new(7, op_id, SUM, I32, &[7, 8, 9], &[5]);
        let mut f = Fixture::new("PENDING to a 4-byte chunk's retransmission carries the 8-byte mask", a);
        let r = Contrib::receipt(7, op_id, 4);
        f.drop(&c).pass(&c, c.pending(1 << 8 | 1 << 9)).pass(&r, r.build());
        f.stats = stats(|s| {
            s.pkts = 1;
            s.dup = 1;
            s.pending = 1;
            s.receipts = 1;
        });
        f.slots = vec![(op_id, 0, SlotState::Active, 1 << 7)];
        t.push(f);
    }
    {
        // Op ids wrap at 2^32 (serial-number order): op 0xffffffff, then an
        // op after the wrap in the same slot.  Retransmissions of either are
        // never added twice, and the old one is never added to the new one.
        let old = u32::MAX;
        let want = OpIds::slot(a, old, 0);
        let new = (0u32..).find(|&o| OpIds::slot(a, o, 0) == want).expect("some op id after the wrap collides");
        let co: Vec<Contrib> = [(5u16, 3i64), (6, 4)]
            .iter()
            .map(|&(r, v)| Contrib::new(r, old, SUM, I64, &[5, 6], &[v]).allreduce())
            .collect();
        let cn: Vec<Contrib> = [(5u16, 50i64), (6, 60)]
            .iter()
            .map(|&(r, v)| Contrib::new(r, new, SUM, I64, &[5, 6], &[v]).allreduce())
            .collect();
        let mut f = Fixture::new(format!("op ids across the 2^32 wrap ({old:#x} -> {new}): no double count"), a);
        f.drop(&co[0]).pass(&co[0], co[0].pending(1 << 6));
        f.pass(&co[1], co[1].answer(T_AGG_RESULT, false, 0b1100000, encode(I64, &[7])));
        f.pass(&co[0], co[0].answer(T_AGG_RESULT, false, 1 << 5, encode(I64, &[7])));
        // rank 1 starts the new op: held until rank 2 also moved past old
        f.drop(&cn[0]);
        f.drop(&cn[1]); // proves rank 2; both proved: claims (stores 60)
        f.pass(&cn[1], cn[1].pending(1 << 5));
        f.pass(&cn[0], cn[0].answer(T_AGG_RESULT, false, 0b1100000, encode(I64, &[110])));
        f.pass(&cn[0], cn[0].answer(T_AGG_RESULT, false, 1 << 5, encode(I64, &[110])));
        // A late copy of the pre-wrap op: rank 6 moved on to the new op,
        // so it is stale (serial-number order across the wrap), not added.
        f.drop(&co[1]);
        f.stats = stats(|s| {
            s.pkts = 4;
            s.chunks_done = 2;
            s.results = 4;
            s.dup = 2;
            s.pending = 2;
            s.dup_done = 2;
            s.held = 1;
            s.stale = 1;
        });
        f.slots = vec![(new, 0, SlotState::Done, 0b1100000)];
        t.push(f);
    }

    // 15. A sharded allreduce's owner (this host, rank 100, mask base 64)
    //     contributes to its own shard's chunks through BPF_PROG_TEST_RUN
    //     (src_rank == cfg_my_rank, its own address): a chunk a remote
    //     contribution completes is also written to the ring (the owner's
    //     copy; tc_agg_result leaves the owner out of the fan-out), one its
    //     own contribution completes is answered in the run's output only.
    {
        let owned = |src: u16, op_id: u32, v: &[i64]| {
            let mut c = Contrib::new(src, op_id, SUM, I32, &[], v).allreduce();
            c.mask_base = 64;
            c.mask = [64u16, 65, AGG_RANK].iter().fold(0, |m, r| m | 1 << (r - 64));
            c
        };
        let all: u64 = 0b11 | 1 << (AGG_RANK - 64);
        let own_bit = 1u64 << (AGG_RANK - 64);
        for e in [Engine::Default, Engine::Chunk8928] {
            let n = e.config().chunk_bytes as usize / 4;
            let vals: Vec<Vec<i64>> =
                (1..=3).map(|r: i64| (0..n as i64).map(|i| (i - 300) * r * 1_003).collect()).collect();
            let (acc, _) = reduce(SUM, I32, &vals);
            let (bytes, sat) = wire_result(I32, &acc);
            let size = if e == Engine::Default { "1432" } else { "8928 (multi-buffer)" };

            // The owner first, a remote member completes.
            let op_id = ids.alloc(e, &[0]);
            let c = [owned(AGG_RANK, op_id, &vals[0]), owned(64, op_id, &vals[1]), owned(65, op_id, &vals[2])];
            let mut f = Fixture::new(
                format!("sharded owner, chunk {size}: remote completion, RESULT fanned out + the owner's record"),
                e,
            );
            f.drop(&c[0]).drop(&c[1]);
            f.pass(&c[2], c[2].answer(T_AGG_RESULT, sat, all, bytes.clone()));
            // The owner's retransmission (the ring was full, or its record
            // was lost): its answer, addressed to itself.
            f.pass(&c[0], c[0].answer(T_AGG_RESULT, sat, own_bit, bytes.clone()));
            f.records = vec![Rec { mask_base: 64, ..Rec::sum_i32(op_id, c[0].payload.len(), all, acc.clone()) }];
            f.stats = stats(|s| {
                s.pkts = 3;
                s.chunks_done = 1;
                s.results = 2;
                s.dup_done = 1;
                s.own_records = 1;
                s.overflow = u64::from(sat);
            });
            f.slots = vec![(op_id, 0, SlotState::Done, all)];
            t.push(f);

            // The owner last: its run's output is the RESULT for everyone
            // (its runtime sends the others their copies), no record.
            let op_id = ids.alloc(e, &[0]);
            let c = [owned(AGG_RANK, op_id, &vals[0]), owned(64, op_id, &vals[1]), owned(65, op_id, &vals[2])];
            let mut f = Fixture::new(format!("sharded owner, chunk {size}: the owner's own contribution completes"), e);
            f.drop(&c[1]).drop(&c[2]);
            f.pass(&c[0], c[0].answer(T_AGG_RESULT, sat, all, bytes.clone()));
            f.stats = stats(|s| {
                s.pkts = 3;
                s.chunks_done = 1;
                s.results = 1;
                s.overflow = u64::from(sat);
            });
            f.slots = vec![(op_id, 0, SlotState::Done, all)];
            t.push(f);
        }
    }
    {
        // The ring full when a remote contribution completes an owned
        // chunk: the RESULT still goes out (the slot is DONE), the owner's
        // retransmission fetches its copy.
        let e = Engine::SmallRing;
        let mut f = Fixture::new("sharded owner, ring full: RESULT fanned out, the owner's copy by retransmission", e);
        let vals: Vec<i64> = (0..358).collect();
        let all: u64 = 0b1 | 1 << (AGG_RANK - 64);
        let own_bit = 1u64 << (AGG_RANK - 64);
        let mut recs = Vec::new();
        let mut last = None;
        // A 358-value record takes 32 + 2864 + 8 bytes: five fit in 16 KiB.
        for k in 0..6 {
            let op_id = ids.alloc(e, &[0]);
            let mut mine = Contrib::new(AGG_RANK, op_id, SUM, I32, &[], &vals).allreduce();
            mine.mask_base = 64;
            mine.mask = all;
            let mut theirs = mine.clone();
            theirs.src = 64;
            let (acc, _) = reduce(SUM, I32, &[vals.clone(), vals.clone()]);
            let (bytes, _) = wire_result(I32, &acc);
            f.drop(&mine);
            f.pass(&theirs, theirs.answer(T_AGG_RESULT, false, all, bytes.clone()));
            if k < 5 {
                recs.push(Rec { mask_base: 64, ..Rec::sum_i32(op_id, 1432, all, acc) });
            } else {
                last = Some((mine, bytes));
            }
        }
        let (mine, bytes) = last.expect("sixth chunk");
        f.pass(&mine, mine.answer(T_AGG_RESULT, false, own_bit, bytes));
        f.records = recs;
        f.stats = stats(|s| {
            s.pkts = 12;
            s.chunks_done = 6;
            s.results = 7;
            s.dup_done = 1;
            s.own_records = 5;
            s.own_ring_full = 1;
        });
        f.slots = vec![(mine.op_id, 0, SlotState::Done, all)];
        t.push(f);
    }

    t
}

// ---------------------------------------------------------------------------
// Harness.

/// "" when equal, else where `got` differs from `want`.
fn diff(want: &[u8], got: &[u8]) -> String {
    if want == got {
        return String::new();
    }
    let at = want.iter().zip(got).position(|(a, b)| a != b).unwrap_or(want.len().min(got.len()));
    format!(
        "{} bytes, want {}; first difference at byte {at} (want {:02x?}, got {:02x?})",
        got.len(),
        want.len(),
        want.get(at..(at + 8).min(want.len())).unwrap_or(&[]),
        got.get(at..(at + 8).min(got.len())).unwrap_or(&[]),
    )
}

/// What BPF_PROG_TEST_RUN puts in an XDP frame's linear part (a page less
/// headroom and skb_shared_info); longer inputs become multi-buffer frames.
const TEST_RUN_LINEAR: usize = 3520;

fn is_multi_buffer(frame: &[u8]) -> bool {
    frame.len() > TEST_RUN_LINEAR
}

/// The IPv4 header checksum of an Ethernet/IPv4 frame verifies, tot_len and
/// the UDP length match the frame (or, with `trailer_ok`, the frame's start),
/// the UDP checksum is 0.
fn verify_answer(f: &[u8], trailer_ok: bool) -> Result<(), String> {
    if f.len() < 34 {
        return Err("runt".into());
    }
    let ihl = usize::from(f[14] & 0xf) * 4;
    if csum_fold(csum_add(0, &f[14..14 + ihl])) != 0xffff {
        return Err("bad IPv4 header checksum".into());
    }
    let tot = usize::from(u16::from_be_bytes([f[16], f[17]]));
    if 14 + tot != f.len() && !(trailer_ok && 14 + tot < f.len()) {
        return Err(format!("IPv4 tot_len {tot} for a {}-byte frame", f.len()));
    }
    let u = &f[14 + ihl..14 + tot];
    if usize::from(u16::from_be_bytes([u[4], u[5]])) != u.len() || u[6] != 0 || u[7] != 0 {
        return Err("UDP length or checksum wrong".into());
    }
    Ok(())
}

fn run_xdp(e: &AggEngine, input: &[u8]) -> Result<(u32, Vec<u8>), String> {
    let mut out = vec![0u8; input.len() + 256];
    let o = e
        .xdp_skel()
        .progs
        .kccl_xdp_agg
        .test_run(libbpf_rs::ProgramInput { data_in: Some(input), data_out: Some(&mut out), ..Default::default() })
        .map_err(|err| format!("BPF_PROG_TEST_RUN: {err}"))?;
    Ok((o.return_value, o.data.map(|d| d.to_vec()).unwrap_or_default()))
}

fn drain(e: &mut AggEngine, into: &mut Vec<Rec>) -> Result<(), String> {
    drain_at_most(e, None, into).map(|_| ())
}

/// Reads every record (max None: AggEngine::poll_records) or at most `max`
/// (poll_records_max); returns how many.
fn drain_at_most(e: &mut AggEngine, max: Option<usize>, into: &mut Vec<Rec>) -> Result<usize, String> {
    let mut f = |r: kccl::kernel_agg::AggRecordView<'_>| {
        into.push(Rec {
            op_id: r.op_id,
            frag_off: r.frag_off,
            mask_base: r.mask_base,
            msg_len: r.msg_len,
            payload_len: r.payload_len,
            agg_op: r.agg_op,
            dtype: r.dtype,
            overflow: r.overflow,
            contributors: r.contributors,
            values: r.values().to_vec(),
        });
        assert_eq!(r.job_id, JOB);
    };
    match max {
        None => e.poll_records(Duration::ZERO, &mut f),
        Some(m) => e.poll_records_max(Duration::ZERO, m, &mut f),
    }
    .map_err(|err| format!("poll_records: {err}"))
}

fn run_fixture(e: &mut AggEngine, fx: &Fixture) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    let before = e.stats().map_err(|err| vec![format!("stats: {err}")])?;
    let mut records = Vec::new();
    for (i, step) in fx.steps.iter().enumerate() {
        match step {
            Step::Sleep(d) => std::thread::sleep(*d),
            Step::FreeCall(op) => {
                if let Err(err) = e.free_call(*op) {
                    errs.push(format!("step {i}: {err}"));
                }
            }
            Step::Member { rank, mac } => {
                if let Err(err) = e.set_member(*rank, ip_of(*rank), port_of(*rank), *mac) {
                    errs.push(format!("step {i}: {err}"));
                }
            }
            Step::Drain => {
                if let Err(err) = drain(e, &mut records) {
                    errs.push(err);
                }
            }
            Step::DrainAtMost { max, want } => match drain_at_most(e, Some(*max), &mut records) {
                Ok(n) if n == *want => {}
                Ok(n) => errs.push(format!("step {i}: read {n} records with max {max}, want {want}")),
                Err(err) => errs.push(format!("step {i}: {err}")),
            },
            Step::Pkt { input, verdict, output } => {
                let (v, out) = match run_xdp(e, input) {
                    Ok(x) => x,
                    Err(err) => {
                        errs.push(format!("step {i}: {err}"));
                        continue;
                    }
                };
                if v != *verdict {
                    let name = |v: u32| match v {
                        XDP_DROP => "XDP_DROP".to_string(),
                        XDP_PASS => "XDP_PASS".to_string(),
                        x => x.to_string(),
                    };
                    errs.push(format!("step {i}: verdict {} (want {})", name(v), name(*verdict)));
                }
                // Releasing an XDP frame's fragments corrupts memory on
                // veth (docs/KERNELS.md): no multi-buffer frame may shrink.
                if v == XDP_PASS && is_multi_buffer(input) && out.len() != input.len() {
                    errs.push(format!(
                        "step {i}: multi-buffer frame of {} bytes left as {} bytes (fragments released)",
                        input.len(),
                        out.len()
                    ));
                }
                if let Some(want) = output {
                    let d = diff(want, &out);
                    if !d.is_empty() {
                        errs.push(format!("step {i}: output {d}"));
                    }
                    if want != input {
                        let trailer_ok = is_multi_buffer(input);
                        if let Err(err) = verify_answer(&out, trailer_ok) {
                            errs.push(format!("step {i}: answer: {err}"));
                        }
                        if let Err(err) = verify_answer(want, trailer_ok) {
                            errs.push(format!("step {i}: fixture bug: expected answer: {err}"));
                        }
                    }
                }
            }
        }
    }
    if let Err(err) = drain(e, &mut records) {
        errs.push(err);
    }
    let got = e.stats().map_err(|err| vec![format!("stats: {err}")])?.delta(&before);
    if got != fx.stats {
        errs.push(format!("counter deltas {got:?}\n        want {:?}", fx.stats));
    }
    if records != fx.records {
        errs.push(format!("ring records {records:?}\n        want {:?}", fx.records));
    }
    for &(rank, want) in &fx.next_hops {
        match e.next_hop(rank) {
            Ok(got) if got == want => {}
            Ok(got) => errs.push(format!("next hop of rank {rank}: {got:02x?} (want {want:02x?})")),
            Err(err) => errs.push(format!("next hop of rank {rank}: {err}")),
        }
    }
    // Fixtures that change next hops (Member steps, or packets from another
    // MAC, which they check) leave members[] as every other fixture expects.
    if !fx.next_hops.is_empty() || fx.steps.iter().any(|s| matches!(s, Step::Member { .. })) {
        if let Err(err) = members(e) {
            errs.push(format!("restoring members: {err}"));
        }
    }
    for &(op, frag, state, seen) in &fx.slots {
        match e.slot(e.slot_index(op, frag)) {
            Ok(s) => {
                let key_ok =
                    state == SlotState::Free || (s.rec.op_id == op && s.rec.frag_off == frag && s.rec.job_id == JOB);
                if s.state != state || s.seen != seen || !key_ok {
                    errs.push(format!(
                        "slot of op {op} frag {frag}: {:?} seen {:#x} key ({}, {}) (want {state:?} seen {seen:#x})",
                        s.state, s.seen, s.rec.op_id, s.rec.frag_off
                    ));
                }
                if state == SlotState::Done && s.rec.contributors != seen {
                    errs.push(format!("slot contributors {:#x} (want {seen:#x})", s.rec.contributors));
                }
            }
            Err(err) => errs.push(format!("slot: {err}")),
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

fn members(e: &mut AggEngine) -> kccl::Result<()> {
    // 100: this host (AGG_RANK), a contributor of its own shard's chunks.
    for r in (1..=9).chain([64, 65, AGG_RANK]) {
        e.set_member(r, ip_of(r), port_of(r), Some(mac_of(r)))?;
    }
    Ok(())
}

#[test]
fn xdp_agg_fixture_table() {
    if !is_root() {
        println!("SKIP: xdp_agg_fixture_table needs root (BPF_PROG_TEST_RUN)");
        return;
    }
    let table = fixtures();
    let t0 = Instant::now();
    let mut failed = Vec::new();
    // Every engine some fixture names, in table order (none is left out).
    let mut engines: Vec<Engine> = Vec::new();
    for f in &table {
        if !engines.contains(&f.engine) {
            engines.push(f.engine);
        }
    }
    for engine in engines {
        let tl = Instant::now();
        let mut e = AggEngine::open(&engine.config()).expect("loading xdp_agg + tc_agg_result");
        members(&mut e).expect("members");
        let (xi, ti) = e.verified_insns().expect("program info");
        println!(
            "engine {engine:?}: loaded in {:?}; verifier processed {xi} insns (xdp_agg), {ti} (tc_agg_result)",
            tl.elapsed()
        );
        for (n, fx) in table.iter().enumerate().filter(|(_, f)| f.engine == engine) {
            match run_fixture(&mut e, fx) {
                Ok(()) => println!("ok   [{n:2}] {}", fx.name),
                Err(errs) => {
                    println!("FAIL [{n:2}] {}:", fx.name);
                    for err in &errs {
                        println!("    - {err}");
                    }
                    failed.push(format!("[{n}] {}: {}", fx.name, errs.join("; ")));
                }
            }
        }
    }
    println!("{} xdp_agg fixtures, {} failed, {:?}", table.len(), failed.len(), t0.elapsed());
    assert!(failed.is_empty(), "{} of {} fixtures failed:\n{}", failed.len(), table.len(), failed.join("\n"));
}

// ---------------------------------------------------------------------------
// Microbenchmark of the per-packet cost (not a fixture; run by hand):
//   cargo test --release -p kccl --test bpf_agg_fixtures -- --ignored --nocapture xdp_agg_ns_per_packet
// Every chunk has contributors {1, 2, 3} and goes through the three paths of
// a full chunk: rank 1 claims the slot and stores (XDP_DROP), rank 2 combines
// into the ACTIVE slot (XDP_DROP, the common case), rank 3 completes it as an
// allreduce (XDP_PASS, the RESULT written into the packet); then rank 2 again
// (a duplicate: everything but the element loop).  The 1024 consecutive op ids
// of a round cover every slot once, and DONE slots are claimed by the next
// round.  Each packet is one BPF_PROG_TEST_RUN (repeat 1; the same packet
// cannot be repeated on these paths: a second run is a duplicate), timed by
// the kernel around the program alone; the thread is pinned to one CPU.

fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

fn run_xdp_timed(e: &AggEngine, input: &[u8], out: &mut [u8]) -> (u32, usize, Duration) {
    let o = e
        .xdp_skel()
        .progs
        .kccl_xdp_agg
        .test_run(libbpf_rs::ProgramInput { data_in: Some(input), data_out: Some(out), ..Default::default() })
        .expect("BPF_PROG_TEST_RUN");
    (o.return_value, o.data.map(|d| d.len()).unwrap_or_default(), o.duration)
}

fn ns_summary(v: &mut [u64]) -> String {
    v.sort_unstable();
    let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
    format!("median {:6} ns  p10 {:6}  mean {:8.1}", v[v.len() / 2], v[v.len() / 10], mean)
}

#[test]
#[ignore = "microbenchmark, run by hand with --ignored --nocapture"]
fn xdp_agg_ns_per_packet() {
    if !is_root() {
        println!("SKIP: xdp_agg_ns_per_packet needs root (BPF_PROG_TEST_RUN)");
        return;
    }
    pin_to_cpu(1);
    let tl = Instant::now();
    let mut e = AggEngine::open(&Engine::Default.config()).expect("loading xdp_agg + tc_agg_result");
    let load = tl.elapsed();
    members(&mut e).expect("members");
    let (xi, _) = e.verified_insns().expect("program info");
    println!("xdp_agg: verifier processed {xi} insns, loaded (with tc_agg_result) in {load:?}");
    let rounds: u32 = std::env::var("KCCL_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(4);
    let mut out = vec![0u8; 4096];
    let mut base = 1_000_000u32;
    for (op, dt) in [(SUM, I32), (SUM, I64), (MAX, I32), (MIN, I64), (COUNT, I32)] {
        let n = CHUNK as usize / if dt == I64 { 8 } else { 4 };
        let (mut store, mut combine, mut complete, mut dup) = (vec![], vec![], vec![], vec![]);
        for _ in 0..rounds {
            for k in 0..1024u32 {
                let op_id = base + k;
                let vals: Vec<Vec<i64>> = (1..=3i64)
                    .map(|r| {
                        (0..n as i64)
                            .map(|i| ((i * 7919 + r * 104_729 + i64::from(op_id)) % 2_000_003 - 1_000_001) * (i % 5))
                            .collect()
                    })
                    .collect();
                let p: Vec<Vec<u8>> = (0..3)
                    .map(|r| Contrib::new(r as u16 + 1, op_id, op, dt, &[1, 2, 3], &vals[r]).allreduce().build())
                    .collect();
                let (v, _, d) = run_xdp_timed(&e, &p[0], &mut out);
                assert_eq!(v, XDP_DROP, "store");
                store.push(d.as_nanos() as u64);
                let (v, _, d) = run_xdp_timed(&e, &p[1], &mut out);
                assert_eq!(v, XDP_DROP, "combine");
                combine.push(d.as_nanos() as u64);
                let (v, _, d) = run_xdp_timed(&e, &p[1], &mut out);
                // Answered with PENDING (the frame rewritten and passed up), as in the table.
                assert_eq!(v, XDP_PASS, "duplicate");
                dup.push(d.as_nanos() as u64);
                let (v, len, d) = run_xdp_timed(&e, &p[2], &mut out);
                assert_eq!(v, XDP_PASS, "complete");
                complete.push(d.as_nanos() as u64);
                let (acc, _) = reduce(op, dt, &vals);
                let (want, _) = wire_result(dt, &acc);
                assert_eq!(&out[len - want.len()..len], &want[..], "result values");
            }
            base += 1024;
        }
        println!("{} {} ({n} elements, {} packets per path):", name_op(op), name_dt(dt), store.len());
        println!("  store (claim)      {}", ns_summary(&mut store));
        println!("  combine (ACTIVE)   {}", ns_summary(&mut combine));
        println!("  complete (RESULT)  {}", ns_summary(&mut complete));
        println!("  duplicate (no loop){}", ns_summary(&mut dup));
    }
}

// ---------------------------------------------------------------------------
// tc_agg_result fixtures (namespace + veth + AF_PACKET capture).

/// The same frame addressed to contributor `rank` (what its copy must be).
/// The UDP payload of an Ethernet/IPv4 frame (up to the IPv4 tot_len).
fn udp_payload(f: &[u8]) -> &[u8] {
    let ihl = usize::from(f[14] & 0xf) * 4;
    let tot = usize::from(u16::from_be_bytes([f[16], f[17]]));
    &f[14 + ihl + 8..14 + tot]
}

fn readdress(frame: &[u8], rank: u16) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[0..6].copy_from_slice(&mac_of(rank));
    let ihl = usize::from(f[14] & 0xf) * 4;
    f[30..34].copy_from_slice(&ip_of(rank).octets());
    f[24..26].copy_from_slice(&[0, 0]);
    let c = inet_csum(&f[14..14 + ihl]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f[14 + ihl + 2..14 + ihl + 4].copy_from_slice(&port_of(rank).to_be_bytes());
    f
}

/// An answer as tc_agg_result sends it on: a final answer with FANOUT
/// cleared (a UDP checksum of 0 stays 0).
fn without_fanout(frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    let k = 14 + usize::from(f[14] & 0xf) * 4 + 8;
    let flags = u16::from_be_bytes([f[k + 6], f[k + 7]]) & !F_FANOUT;
    f[k + 6..k + 8].copy_from_slice(&flags.to_be_bytes());
    f
}

struct TcFixture {
    name: String,
    input: Vec<u8>,
    /// Members set before the run: (rank, resolved).
    members: Vec<(u16, bool)>,
    verdict: u32,
    /// The program set skb->mark (cfg_clone_mark): it went into the fan-out.
    marked: bool,
    copies: Vec<Vec<u8>>,
    output: Vec<u8>,
    stats: AggStats,
    misses: Vec<(u16, MissReason)>,
}

fn tc_fixtures() -> Vec<TcFixture> {
    let mut t = Vec::new();
    let all: Vec<(u16, bool)> = (1..=9).map(|r| (r, true)).collect();
    let result_of = |ranks: &[u16], ty: u8, payload: Vec<u8>, flags: u16| {
        let c = Contrib::new(ranks[0], 77, SUM, I32, ranks, &[0]);
        let mut h = c.header();
        h.msg_type = ty;
        h.flags = flags;
        h.src_rank = AGG_RANK;
        h.payload_len = payload.len() as u16;
        let mut p = h.to_bytes().to_vec();
        p.extend_from_slice(&payload);
        Frame {
            eth_src: AGG_MAC,
            eth_dst: mac_of(ranks[0]),
            saddr: AGG_IP,
            daddr: ip_of(ranks[0]),
            sport: AGG_PORT,
            dport: port_of(ranks[0]),
            options: vec![],
            udp_csum: false,
            udp_len_field: None,
            payload: p,
        }
        .build()
    };
    let fan = |name: &str, input: Vec<u8>, ranks: &[u16]| {
        let (last, clones) = ranks.split_last().expect("ranks");
        let sent = without_fanout(&input);
        TcFixture {
            name: name.into(),
            copies: clones.iter().map(|&r| readdress(&sent, r)).collect(),
            output: readdress(&sent, *last),
            input,
            members: all.clone(),
            verdict: TC_ACT_REDIRECT,
            marked: true,
            stats: stats(|s| s.fanout_copies = ranks.len() as u64),
            misses: vec![],
        }
    };
    let ranks = [1u16, 2, 3, 4, 5];
    let vals = encode(I32, &[1, -2, 3, -4]);
    t.push(fan(
        "RESULT fans out to 5 contributors",
        result_of(&ranks, T_AGG_RESULT, vals.clone(), F_FANOUT | F_LAST_FRAG),
        &ranks,
    ));
    t.push(fan("ACK fans out to 3 contributors", result_of(&[2, 4, 6], T_AGG_ACK, vec![], F_FANOUT), &[2, 4, 6]));
    t.push(fan(
        "RESULT with F_OVERFLOW to 2 contributors",
        result_of(&[7, 9], T_AGG_RESULT, vals.clone(), F_FANOUT | F_OVERFLOW),
        &[7, 9],
    ));
    t.push(fan("DUP_DONE answer: one destination", result_of(&[3], T_AGG_ACK, vec![], F_FANOUT), &[3]));
    {
        // xdp_agg's own answer, fed into tc_agg_result.
        let c = Contrib::new(2, 5, SUM, I32, &[1, 2, 3], &[4, 5]).allreduce();
        let input = c.answer(T_AGG_RESULT, false, mask_of(&[1, 2, 3]), encode(I32, &[12, 15]));
        t.push(fan("an xdp_agg RESULT (from rank 2's packet) to ranks 1, 2, 3", input, &[1, 2, 3]));
    }
    {
        // An answer xdp_agg made from a multi-buffer contribution keeps the
        // contribution's bytes behind its datagram: cut before the copies.
        let vals: Vec<i64> = (0..350).collect();
        let c = Contrib::new(2, 6, SUM, I32, &[1, 2, 3], &vals);
        let datagram = c.answer_datagram(T_AGG_ACK, false, mask_of(&[1, 2, 3]), vec![]);
        let mut input = datagram.clone();
        input.extend_from_slice(&c.build()[datagram.len()..]);
        assert_eq!(input.len(), datagram.len() + 1400);
        let mut f =
            fan("ACK with 1,400 bytes of contribution behind its datagram: cut, then fanned out", datagram, &[1, 2, 3]);
        f.input = input;
        f.stats.trimmed = 1;
        t.push(f);
    }
    {
        let mut f = fan(
            "unresolved rank 2: miss event, others served",
            result_of(&[1, 2, 3], T_AGG_RESULT, vals.clone(), F_FANOUT),
            &[1, 3],
        );
        f.members = vec![(1, true), (2, false), (3, true)];
        f.stats.fanout_missed = 1;
        f.misses = vec![(2, MissReason::Unresolved)];
        t.push(f);
    }
    {
        // The miss's answer is the datagram only, not the contribution's
        // bytes behind it.
        let vals: Vec<i64> = (0..350).collect();
        let c = Contrib::new(3, 6, SUM, I32, &[1, 2, 3], &vals).allreduce();
        let datagram = c.answer_datagram(T_AGG_RESULT, false, mask_of(&[1, 2, 3]), encode(I32, &vals));
        let mut input = datagram.clone();
        input.extend_from_slice(&[0xee; 700]);
        let mut f =
            fan("RESULT with 700 bytes behind it, rank 1 unresolved: miss carries the cut datagram", datagram, &[2, 3]);
        f.input = input;
        f.members = vec![(1, false), (2, true), (3, true)];
        f.stats.trimmed = 1;
        f.stats.fanout_missed = 1;
        f.misses = vec![(1, MissReason::Unresolved)];
        t.push(f);
    }
    {
        // Nobody to serve: the original is dropped, every rank reported.
        let input = result_of(&[1, 2], T_AGG_ACK, vec![], F_FANOUT);
        t.push(TcFixture {
            name: "every destination unresolved: TC_ACT_SHOT, two miss events".into(),
            copies: vec![],
            output: without_fanout(&input),
            input,
            members: vec![(1, false), (2, false)],
            verdict: TC_ACT_SHOT,
            marked: true,
            stats: stats(|s| s.fanout_missed = 2),
            misses: vec![(1, MissReason::Unresolved), (2, MissReason::Unresolved)],
        });
    }
    {
        // A sharded allreduce's owner (this host, rank 100 of mask base 64)
        // contributes too: xdp_agg gave it its copy on the ring, so the
        // fan-out serves the other contributors only.
        let mut c = Contrib::new(64, 8, SUM, I32, &[], &[4, 5]).allreduce();
        c.mask_base = 64;
        let own = 1u64 << (AGG_RANK - 64);
        let owners = 0b11 | own;
        c.mask = owners;
        let input = c.answer(T_AGG_RESULT, false, owners, encode(I32, &[12, 15]));
        let mut f = fan("owner's own rank skipped: RESULT to ranks 64, 65 only", input, &[64, 65]);
        f.members = vec![(64, true), (65, true), (AGG_RANK, true)];
        f.stats.own_skipped = 1;
        t.push(f);
        let input = c.answer(T_AGG_RESULT, false, own, encode(I32, &[12, 15]));
        t.push(TcFixture {
            name: "an answer for the owner alone: TC_ACT_SHOT, no copy".into(),
            copies: vec![],
            output: input.clone(),
            input,
            members: vec![(64, true), (65, true), (AGG_RANK, true)],
            verdict: TC_ACT_SHOT,
            marked: false,
            stats: stats(|s| s.own_skipped = 1),
            misses: vec![],
        });
    }
    let untouched = |name: &str, input: Vec<u8>| TcFixture {
        name: name.into(),
        output: input.clone(),
        input,
        members: all.clone(),
        verdict: TCX_NEXT,
        marked: false,
        copies: vec![],
        stats: AggStats::default(),
        misses: vec![],
    };
    t.push(untouched("RESULT without FANOUT passes", result_of(&ranks, T_AGG_RESULT, vals.clone(), F_LAST_FRAG)));
    {
        let mut f = result_of(&ranks, T_AGG_RESULT, vals.clone(), F_FANOUT);
        f[14 + 20 + 8 + 8 + 3] ^= 1; // job id 7 -> 6
        t.push(untouched("RESULT of another job passes", f));
    }
    {
        // A contributor that also runs the programs receives an answer of
        // another aggregator: it must not fan it out again.
        let mut f = result_of(&ranks, T_AGG_RESULT, vals.clone(), F_FANOUT);
        f[14 + 20 + 8 + 12..14 + 20 + 8 + 14].copy_from_slice(&(AGG_RANK + 1).to_be_bytes());
        t.push(untouched("answer signed by another rank passes (no re-fan-out)", f));
    }
    t.push(untouched("T_AGG contribution passes", Contrib::new(1, 5, SUM, I32, &[1, 2], &[1]).build()));
    {
        let mut f = result_of(&ranks, T_AGG_RESULT, vals.clone(), F_FANOUT);
        f[14 + 20..14 + 22].copy_from_slice(&9999u16.to_be_bytes());
        t.push(untouched("RESULT from another source port passes", f));
    }
    t
}

struct TcObserved {
    verdict: u32,
    output: Vec<u8>,
    mark: u32,
    captured: Vec<Vec<u8>>,
    stats: AggStats,
    misses: Vec<AggMiss>,
}

fn observe_tc(members: Vec<(u16, bool)>, input: Vec<u8>) -> kccl::Result<TcObserved> {
    let fxa = netns::ifindex("fxa", None)?;
    let fxb = netns::ifindex("fxb", None)?;
    let mut e = AggEngine::open(&AggEngineConfig::new(JOB, AGG_PORT, AGG_RANK))?;
    for (r, resolved) in members {
        e.set_member(r, ip_of(r), port_of(r), resolved.then(|| mac_of(r)))?;
    }
    let cap = Capture::open(fxb)?;
    let _ = cap.drain(Duration::from_millis(20))?;
    let before = e.stats()?;
    let mut ctx_in = vec![0u8; size_of::<__sk_buff>()];
    ctx_in[offset_of!(__sk_buff, ifindex)..][..4].copy_from_slice(&fxa.to_ne_bytes());
    let mut ctx_out = vec![0u8; ctx_in.len()];
    let mut data_out = vec![0u8; input.len() + 512];
    let (verdict, output) = {
        let o = e
            .result_skel()
            .progs
            .kccl_tc_agg_result
            .test_run(libbpf_rs::ProgramInput {
                data_in: Some(&input),
                data_out: Some(&mut data_out),
                context_in: Some(&mut ctx_in),
                context_out: Some(&mut ctx_out),
                ..Default::default()
            })
            .map_err(|err| kccl::Error::Bpf { step: "BPF_PROG_TEST_RUN of kccl_tc_agg_result".into(), source: err })?;
        (o.return_value, o.data.map(|d| d.to_vec()).unwrap_or_default())
    };
    let captured = cap.drain(Duration::from_millis(150))?;
    let mark = u32::from_ne_bytes(ctx_out[offset_of!(__sk_buff, mark)..][..4].try_into().expect("4 bytes"));
    Ok(TcObserved { verdict, output, mark, captured, stats: e.stats()?.delta(&before), misses: e.drain_misses() })
}

fn run_tc_fixture(n: usize, fx: &TcFixture) -> Result<(), Vec<String>> {
    let ns = format!("kccl-afx-{}-{n}", std::process::id());
    let _guard = NetnsGuard::up(ns.clone()).map_err(|e| vec![format!("namespace setup: {e}")])?;
    let (members, input) = (fx.members.clone(), fx.input.clone());
    let o = netns::run_in(Some(&ns), move || observe_tc(members, input)).map_err(|e| vec![format!("run: {e}")])?;
    let mut errs = Vec::new();
    if o.verdict != fx.verdict {
        errs.push(format!("verdict {} (want {})", o.verdict, fx.verdict));
    }
    let d = diff(&fx.output, &o.output);
    if !d.is_empty() {
        errs.push(format!("output skb: {d}"));
    }
    let want_mark = if fx.marked { CLONE_MARK } else { 0 };
    if o.mark != want_mark {
        errs.push(format!("skb mark {:#x} (want {want_mark:#x})", o.mark));
    }
    if o.stats != fx.stats {
        errs.push(format!("counter deltas {:?} (want {:?})", o.stats, fx.stats));
    }
    let want_misses: Vec<(u16, MissReason)> = fx.misses.clone();
    let got_misses: Vec<(u16, MissReason)> = o.misses.iter().map(|m| (m.event.rank, m.event.reason)).collect();
    if got_misses != want_misses {
        errs.push(format!("miss events {got_misses:?} (want {want_misses:?})"));
    }
    // Each miss carries the answer its rank should have had: the datagram
    // the copies carry (FANOUT cleared, cut to the datagram).
    let want_answer = udp_payload(&fx.output);
    for m in &o.misses {
        // msg_seq: bytes 24..28 of the kccl header (wire.rs).
        let want_seq = u32::from_be_bytes(want_answer[24..28].try_into().expect("4 bytes"));
        if (m.event.job_id, m.event.msg_seq) != (JOB, want_seq) {
            errs.push(format!("miss event of job {} msg_seq {}", m.event.job_id, m.event.msg_seq));
        }
        let d = diff(want_answer, &m.answer);
        if !d.is_empty() {
            errs.push(format!("answer of the miss for rank {}: {d}", m.event.rank));
        }
    }
    let mut unmatched: Vec<&Vec<u8>> = o.captured.iter().collect();
    let mut missing = 0;
    for want in &fx.copies {
        match unmatched.iter().position(|g| *g == want) {
            Some(i) => {
                unmatched.remove(i);
            }
            None => missing += 1,
        }
    }
    if missing != 0 || !unmatched.is_empty() {
        errs.push(format!(
            "captured {} frame(s), want {}: {missing} missing, {} unexpected",
            o.captured.len(),
            fx.copies.len(),
            unmatched.len()
        ));
    }
    for c in fx.copies.iter().chain(if fx.verdict == TC_ACT_REDIRECT { Some(&fx.output) } else { None }) {
        if let Err(e) = verify_answer(c, false) {
            errs.push(format!("fixture bug: expected copy: {e}"));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

#[test]
fn tc_agg_result_fixture_table() {
    if !is_root() {
        println!("SKIP: tc_agg_result_fixture_table needs root (BPF_PROG_TEST_RUN, network namespaces)");
        return;
    }
    assert!(offset_of!(__sk_buff, ifindex) == 40 && offset_of!(__sk_buff, mark) == 8);
    let table = tc_fixtures();
    let t0 = Instant::now();
    let mut failed = Vec::new();
    for (n, fx) in table.iter().enumerate() {
        match run_tc_fixture(n, fx) {
            Ok(()) => println!("ok   [{n:2}] {}", fx.name),
            Err(errs) => {
                println!("FAIL [{n:2}] {}:", fx.name);
                for e in &errs {
                    println!("    - {e}");
                }
                failed.push(format!("[{n}] {}: {}", fx.name, errs.join("; ")));
            }
        }
    }
    println!("{} tc_agg_result fixtures, {} failed, {:?}", table.len(), failed.len(), t0.elapsed());
    assert!(failed.is_empty(), "{} of {} fixtures failed:\n{}", failed.len(), table.len(), failed.join("\n"));
}

/// The reference reduction and packet builder against hand-computed values
/// (no root needed).
#[test]
fn reference_helpers() {
    assert_eq!(reduce(SUM, I32, &[vec![1, -2], vec![3, 4]]), (vec![4, 2], false));
    assert_eq!(reduce(COUNT, I32, &[vec![0, -2], vec![3, 0], vec![1, 0]]), (vec![2, 1], false));
    assert_eq!(reduce(MAX, I64, &[vec![-5, 1], vec![-7, 9]]), (vec![-5, 9], false));
    assert_eq!(reduce(MIN, I64, &[vec![-5, 1], vec![-7, 9]]), (vec![-7, 1], false));
    assert_eq!(reduce(SUM, I64, &[vec![i64::MAX], vec![1]]), (vec![i64::MIN], true));
    assert_eq!(
        wire_result(I32, &[1 << 40, -(1 << 40), 5]),
        (encode(I32, &[i64::from(i32::MAX), i64::from(i32::MIN), 5]), true)
    );
    let c = Contrib::new(1, 9, SUM, I32, &[1, 2], &[1, 2]);
    let ack = c.ack(false, 0b110);
    verify_answer(&ack, false).expect("ack verifies");
    assert_eq!(ack.len(), 14 + 20 + 8 + 40);
    // Header::decode refuses payload_len 0 with msg_len != 0 (a broadcast
    // rule); an ACK is exactly that, so read the fields directly.
    let k = &ack[42..];
    assert_eq!(&k[0..4], &kccl::wire::MAGIC.to_be_bytes());
    assert_eq!((k[5], u16::from_be_bytes([k[6], k[7]])), (T_AGG_ACK, F_FANOUT | F_LAST_FRAG));
    assert_eq!(u16::from_be_bytes([k[12], k[13]]), AGG_RANK);
    assert_eq!(u64::from_be_bytes(k[16..24].try_into().unwrap()), 0b110);
    assert_eq!((u32::from_be_bytes(k[32..36].try_into().unwrap()), u16::from_be_bytes([k[36], k[37]])), (8, 0));
}
