//! BPF_PROG_TEST_RUN fixtures of the kernel scatter-gather coordinator
//! (bpf/xdp_sg.bpf.c): one table of scenarios, each a sequence of slot
//! commands (kccl_sg_ctl OPEN/CLOSE), reply frames in with the verdict and
//! the one counter each must move, and the done records and accumulators
//! that must come out.
//!
//! ```text
//!   test process                          xdp_sg (loaded, NOT attached)
//!   open_request(id, need, op, asked) --> kccl_sg_ctl: sg_slots[id & 15]
//!   reply frame (Frame + kccl header) --> kccl_xdp_sg: verdict, sg_stats
//!   poll_done / values(slot)          <-- sg_done ring, sg_acc (mmap)
//!   close_request(id)                 --> kccl_sg_ctl: state, seen, refused
//! ```
//!
//! Every scenario gets a fresh engine (16 slots, a 4 KiB done ring), so no
//! state leaks between them.  Expected results are computed here from the
//! values the frames carry, not read back from the program.  Every frame
//! must come out byte for byte as it went in (xdp_sg never writes a packet),
//! and after each scenario no done record may be left unexpected.  Without
//! root the test prints `SKIPPED ...` (a failure under KCCL_REQUIRE_ROOT=1).

use std::net::Ipv4Addr;
use std::time::Duration;

use kccl::kernel::{SgEngine, SgEngineConfig, SgSlotState, SgStats};
use kccl::wire::{
    Header, DT_BYTES, DT_I32, DT_I64, F_LAST_FRAG, HDR_LEN, OP_CONCAT, OP_COUNT, OP_MAX, OP_MIN, OP_SUM, T_SG_REPLY,
    T_SG_REQUEST, VERSION,
};

mod support;
use support::{root_or_skip, Frame};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;

const JOB: u32 = 9;
const SG_PORT: u16 = 47200;
const SG_IP: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 200);
const NSLOTS: u32 = 16;
/// Workers in members[]: rank r at 10.9.(r >> 8).(r & 255), port 47000 + r.
const MEMBERS: &[u16] = &[1, 2, 3, 4, 5, 64, 1023];

fn ip_of(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, (rank >> 8) as u8, rank as u8)
}

fn port_of(rank: u16) -> u16 {
    47000 + rank
}

/// A reply of worker `src` to request `id`, single fragment, as a worker
/// sends it; fields are changed by the fixtures that need them broken.
#[derive(Clone)]
struct Reply {
    src: u16,
    id: u32,
    op: u8,
    dt: u8,
    values: Vec<i64>,
    job: u32,
    frag_off: u32,
    msg_len: Option<u32>,
    flags: u16,
    msg_type: u8,
    payload: Option<Vec<u8>>,
    saddr: Option<Ipv4Addr>,
    sport: Option<u16>,
    dport: u16,
    udp_len_field: Option<u16>,
}

fn reply(src: u16, id: u32, op: u8, dt: u8, values: &[i64]) -> Reply {
    Reply {
        src,
        id,
        op,
        dt,
        values: values.to_vec(),
        job: JOB,
        frag_off: 0,
        msg_len: None,
        flags: F_LAST_FRAG,
        msg_type: T_SG_REPLY,
        payload: None,
        saddr: None,
        sport: None,
        dport: SG_PORT,
        udp_len_field: None,
    }
}

fn encode(dt: u8, values: &[i64]) -> Vec<u8> {
    let mut b = Vec::new();
    for &v in values {
        if dt == DT_I64 {
            b.extend_from_slice(&v.to_be_bytes());
        } else {
            b.extend_from_slice(&(v as i32).to_be_bytes());
        }
    }
    b
}

impl Reply {
    fn frame(&self) -> Vec<u8> {
        let body = self.payload.clone().unwrap_or_else(|| encode(self.dt, &self.values));
        let h = Header {
            version: VERSION,
            msg_type: self.msg_type,
            flags: self.flags,
            job_id: self.job,
            src_rank: self.src,
            mask_base: 0,
            dst_mask: 1,
            msg_seq: self.id,
            frag_off: self.frag_off,
            msg_len: self.msg_len.unwrap_or(body.len() as u32),
            payload_len: body.len() as u16,
            agg_op: self.op,
            dtype: self.dt,
        };
        let mut hdr = [0u8; HDR_LEN];
        h.encode(&mut hdr);
        let mut payload = hdr.to_vec();
        payload.extend_from_slice(&body);
        Frame {
            eth_src: [0x02, 0, 0, 0, (self.src >> 8) as u8, self.src as u8],
            eth_dst: [0x02, 0, 0, 0, 0, 200],
            saddr: self.saddr.unwrap_or(ip_of(self.src)),
            daddr: SG_IP,
            sport: self.sport.unwrap_or(port_of(self.src)),
            dport: self.dport,
            options: Vec::new(),
            udp_csum: true,
            udp_len_field: self.udp_len_field,
            payload,
        }
        .build()
    }
    fn with(mut self, f: impl FnOnce(&mut Reply)) -> Reply {
        f(&mut self);
        self
    }
}

type Counter = fn(&mut SgStats);

enum Step {
    /// kccl_sg_ctl OPEN must succeed (`ok`) or be refused.
    Open { id: u32, need: u32, op: u8, dt: u8, asked: Vec<u16>, ok: bool },
    /// The frame's verdict, and the counters it must move (by one each).
    Send { what: &'static str, reply: Reply, verdict: u32, counters: Vec<Counter> },
    /// The next done record is request `id`'s with these workers and elements.
    Done { id: u32, seen: Vec<u16>, values: Vec<i64>, overflow_at: Option<u32> },
    /// What CLOSE reports (None: the slot is not request `id`'s).
    Close { id: u32, want: Option<Closed> },
}

struct Closed {
    state: SgSlotState,
    seen: Vec<u16>,
    refused: Vec<u16>,
    values: Vec<i64>,
}

struct Fixture {
    name: &'static str,
    steps: Vec<Step>,
}

fn open(id: u32, need: u32, op: u8, dt: u8, asked: &[u16]) -> Step {
    Step::Open { id, need, op, dt, asked: asked.to_vec(), ok: true }
}

fn refused_open(id: u32, need: u32, op: u8, dt: u8, asked: &[u16]) -> Step {
    Step::Open { id, need, op, dt, asked: asked.to_vec(), ok: false }
}

fn send(what: &'static str, reply: Reply, verdict: u32, counters: &[Counter]) -> Step {
    Step::Send { what, reply, verdict, counters: counters.to_vec() }
}

fn done(id: u32, seen: &[u16], values: &[i64]) -> Step {
    Step::Done { id, seen: seen.to_vec(), values: values.to_vec(), overflow_at: None }
}

fn close(id: u32, state: SgSlotState, seen: &[u16], refused: &[u16], values: &[i64]) -> Step {
    Step::Close {
        id,
        want: Some(Closed { state, seen: seen.to_vec(), refused: refused.to_vec(), values: values.to_vec() }),
    }
}

const PASSED: Counter = |s| s.passed += 1;
const OTHER_JOB: Counter = |s| s.other_job += 1;
const UNCLAIMED: Counter = |s| s.unclaimed += 1;
const COMBINED: Counter = |s| s.combined += 1;
const COMPLETED: Counter = |s| s.completed += 1;
const DUP: Counter = |s| s.dup += 1;
const LATE: Counter = |s| s.late += 1;
const NOT_MEMBER: Counter = |s| s.not_member += 1;
const NOT_ASKED: Counter = |s| s.not_asked += 1;
const MISMATCH: Counter = |s| s.mismatch += 1;
const TOO_LONG: Counter = |s| s.too_long += 1;
const MALFORMED: Counter = |s| s.malformed += 1;
const RING_FULL: Counter = |s| s.ring_full += 1;

fn fixtures() -> Vec<Fixture> {
    use SgSlotState::{Closed as ClosedState, Done as DoneState, Open as OpenState};
    let m = i32::MAX as i64;
    // A 4 KiB ring holds 25 done records (8-byte header + 152 bytes each):
    // 30 requests completed and closed without reading it, the last 5 find
    // it full; CLOSE still finds each DONE.  Same value everywhere, so the
    // slots' reuse does not matter to the check.
    let mut ring_full = vec![];
    for id in 0..30 {
        let counters: &[Counter] = if id < 25 { &[COMBINED, COMPLETED] } else { &[COMBINED, COMPLETED, RING_FULL] };
        ring_full.push(open(id, 1, OP_SUM, DT_I32, &[1]));
        ring_full.push(send("completes", reply(1, id, OP_SUM, DT_I32, &[7]), XDP_DROP, counters));
        ring_full.push(close(id, DoneState, &[1], &[], &[7]));
    }
    for id in 0..25 {
        ring_full.push(done(id, &[1], &[7]));
    }
    vec![
        Fixture {
            name: "not a reply of ours: passed untouched",
            steps: vec![
                send("another UDP port", reply(1, 5, OP_SUM, DT_I32, &[1]).with(|r| r.dport = 9), XDP_PASS, &[PASSED]),
                send(
                    "a request, not a reply",
                    reply(1, 5, OP_SUM, DT_I32, &[1]).with(|r| r.msg_type = T_SG_REQUEST),
                    XDP_PASS,
                    &[PASSED],
                ),
                send(
                    "another job",
                    reply(1, 5, OP_SUM, DT_I32, &[1]).with(|r| r.job = JOB + 1),
                    XDP_PASS,
                    &[OTHER_JOB],
                ),
                send("no slot holds request 5", reply(1, 5, OP_SUM, DT_I32, &[1]), XDP_PASS, &[UNCLAIMED]),
            ],
        },
        Fixture {
            name: "SUM of int32 over three workers, replies of different lengths; duplicate, stranger, late",
            steps: vec![
                open(5, 3, OP_SUM, DT_I32, &[1, 2, 3]),
                send("worker 1", reply(1, 5, OP_SUM, DT_I32, &[1, 2, 3]), XDP_DROP, &[COMBINED]),
                send("worker 1 again", reply(1, 5, OP_SUM, DT_I32, &[1, 2, 3]), XDP_DROP, &[DUP]),
                send("worker 4, not asked", reply(4, 5, OP_SUM, DT_I32, &[9]), XDP_DROP, &[NOT_ASKED]),
                send("worker 2, shorter", reply(2, 5, OP_SUM, DT_I32, &[10, -20]), XDP_DROP, &[COMBINED]),
                send("worker 3, longer", reply(3, 5, OP_SUM, DT_I32, &[m, m, m, 7]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(5, &[1, 2, 3], &[1 + 10 + m, 2 - 20 + m, 3 + m, 7]),
                send("worker 2 after the end", reply(2, 5, OP_SUM, DT_I32, &[10, -20]), XDP_DROP, &[LATE]),
                close(5, DoneState, &[1, 2, 3], &[], &[1 + 10 + m, 2 - 20 + m, 3 + m, 7]),
                send("after the close", reply(3, 5, OP_SUM, DT_I32, &[1]), XDP_DROP, &[LATE]),
            ],
        },
        Fixture {
            name: "wait for any: the first reply completes it, MAX of int64",
            steps: vec![
                open(6, 1, OP_MAX, DT_I64, &[1, 2, 3]),
                send("worker 2", reply(2, 6, OP_MAX, DT_I64, &[-5, 1 << 40]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(6, &[2], &[-5, 1 << 40]),
                send("worker 1, late", reply(1, 6, OP_MAX, DT_I64, &[7, 7]), XDP_DROP, &[LATE]),
                close(6, DoneState, &[2], &[], &[-5, 1 << 40]),
            ],
        },
        Fixture {
            name: "wait for 2 of 3: MIN and COUNT of int64",
            steps: vec![
                open(7, 2, OP_MIN, DT_I64, &[1, 2, 3]),
                send("worker 3", reply(3, 7, OP_MIN, DT_I64, &[4, -9, i64::MIN]), XDP_DROP, &[COMBINED]),
                send("worker 1", reply(1, 7, OP_MIN, DT_I64, &[-4, 9, i64::MAX]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(7, &[1, 3], &[-4, -9, i64::MIN]),
                close(7, DoneState, &[1, 3], &[], &[-4, -9, i64::MIN]),
                open(8, 2, OP_COUNT, DT_I64, &[1, 2]),
                send("worker 1", reply(1, 8, OP_COUNT, DT_I64, &[0, 1, -1]), XDP_DROP, &[COMBINED]),
                send("worker 2", reply(2, 8, OP_COUNT, DT_I64, &[0, 0, 5, 3]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(8, &[1, 2], &[0, 1, 2, 1]),
                close(8, DoneState, &[1, 2], &[], &[0, 1, 2, 1]),
            ],
        },
        Fixture {
            name: "an int64 sum that overflows is flagged at its first element",
            steps: vec![
                open(9, 2, OP_SUM, DT_I64, &[1, 2]),
                send("worker 1", reply(1, 9, OP_SUM, DT_I64, &[5, i64::MAX, i64::MIN]), XDP_DROP, &[COMBINED]),
                send("worker 2", reply(2, 9, OP_SUM, DT_I64, &[5, 1, -1]), XDP_DROP, &[COMBINED, COMPLETED]),
                Step::Done { id: 9, seen: vec![1, 2], values: vec![10, i64::MIN, i64::MAX], overflow_at: Some(1) },
                close(9, DoneState, &[1, 2], &[], &[10, i64::MIN, i64::MAX]),
            ],
        },
        Fixture {
            name: "a source address or port that is not the worker's is dropped",
            steps: vec![
                open(10, 1, OP_SUM, DT_I32, &[1]),
                send(
                    "spoofed address",
                    reply(1, 10, OP_SUM, DT_I32, &[1]).with(|r| r.saddr = Some(ip_of(2))),
                    XDP_DROP,
                    &[NOT_MEMBER],
                ),
                send(
                    "wrong port",
                    reply(1, 10, OP_SUM, DT_I32, &[1]).with(|r| r.sport = Some(9)),
                    XDP_DROP,
                    &[NOT_MEMBER],
                ),
                send("rank not in members", reply(7, 10, OP_SUM, DT_I32, &[1]), XDP_DROP, &[NOT_MEMBER]),
                close(10, OpenState, &[], &[], &[]),
            ],
        },
        Fixture {
            name: "replies the kernel cannot combine: the worker is refused, a later good reply still counts",
            steps: vec![
                open(11, 3, OP_SUM, DT_I32, &[1, 2, 3, 4, 5]),
                send(
                    "second fragment",
                    reply(1, 11, OP_SUM, DT_I32, &[1]).with(|r| {
                        r.frag_off = 1432;
                        r.msg_len = Some(1436)
                    }),
                    XDP_DROP,
                    &[TOO_LONG],
                ),
                send(
                    "first of two fragments",
                    reply(2, 11, OP_SUM, DT_I32, &[1]).with(|r| {
                        r.msg_len = Some(3000);
                        r.flags = 0
                    }),
                    XDP_DROP,
                    &[TOO_LONG],
                ),
                send("1025 elements", reply(3, 11, OP_SUM, DT_I32, &vec![1; 1025]), XDP_DROP, &[TOO_LONG]),
                send("another op", reply(4, 11, OP_MAX, DT_I32, &[1]), XDP_DROP, &[MISMATCH]),
                send(
                    "bytes to concatenate",
                    reply(5, 11, OP_CONCAT, DT_BYTES, &[]).with(|r| r.payload = Some(b"abc".to_vec())),
                    XDP_DROP,
                    &[MISMATCH],
                ),
                send("worker 1 resends it whole", reply(1, 11, OP_SUM, DT_I32, &[6]), XDP_DROP, &[COMBINED]),
                send("int64 where int32 was asked", reply(4, 11, OP_SUM, DT_I64, &[2]), XDP_DROP, &[MISMATCH]),
                close(11, OpenState, &[1], &[2, 3, 4, 5], &[6]),
            ],
        },
        Fixture {
            name: "the largest reply the kernel combines: 1024 int64 elements, rank 1023",
            steps: vec![
                open(12, 2, OP_SUM, DT_I64, &[64, 1023]),
                send(
                    "rank 1023",
                    reply(1023, 12, OP_SUM, DT_I64, &(0..1024).collect::<Vec<_>>()),
                    XDP_DROP,
                    &[COMBINED],
                ),
                send("rank 64", reply(64, 12, OP_SUM, DT_I64, &vec![-1; 1024]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(12, &[64, 1023], &(-1..1023).collect::<Vec<_>>()),
                close(12, DoneState, &[64, 1023], &[], &(-1..1023).collect::<Vec<_>>()),
            ],
        },
        Fixture {
            name: "malformed replies are dropped without refusing the worker",
            steps: vec![
                open(13, 1, OP_SUM, DT_I32, &[1]),
                send(
                    "UDP length disagrees",
                    reply(1, 13, OP_SUM, DT_I32, &[1, 2]).with(|r| r.udp_len_field = Some(8 + HDR_LEN as u16 + 4)),
                    XDP_DROP,
                    &[MALFORMED],
                ),
                send(
                    "half an element",
                    reply(1, 13, OP_SUM, DT_I32, &[]).with(|r| r.payload = Some(vec![0, 0, 0, 1, 0, 0])),
                    XDP_DROP,
                    &[MALFORMED],
                ),
                send("then the good one", reply(1, 13, OP_SUM, DT_I32, &[-3]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(13, &[1], &[-3]),
                close(13, DoneState, &[1], &[], &[-3]),
            ],
        },
        Fixture {
            name: "closed before its policy was met: the partial result and who answered",
            steps: vec![
                open(14, 3, OP_SUM, DT_I32, &[1, 2, 3]),
                send("worker 1", reply(1, 14, OP_SUM, DT_I32, &[1, 1]), XDP_DROP, &[COMBINED]),
                send("worker 2", reply(2, 14, OP_SUM, DT_I32, &[2, 2]), XDP_DROP, &[COMBINED]),
                close(14, OpenState, &[1, 2], &[], &[3, 3]),
                send("worker 3 after the deadline", reply(3, 14, OP_SUM, DT_I32, &[4, 4]), XDP_DROP, &[LATE]),
                close(14, ClosedState, &[1, 2], &[], &[3, 3]),
            ],
        },
        Fixture {
            name: "ids that share a slot, and ids that wrap",
            steps: vec![
                open(3, 1, OP_SUM, DT_I32, &[1]),
                send(
                    "request 19, same slot, not open",
                    reply(1, 3 + NSLOTS, OP_SUM, DT_I32, &[1]),
                    XDP_PASS,
                    &[UNCLAIMED],
                ),
                Step::Close { id: 3 + NSLOTS, want: None },
                open(u32::MAX, 1, OP_SUM, DT_I32, &[2]),
                open(0, 1, OP_SUM, DT_I32, &[2]),
                send("request 0", reply(2, 0, OP_SUM, DT_I32, &[8]), XDP_DROP, &[COMBINED, COMPLETED]),
                send("request 2^32 - 1", reply(2, u32::MAX, OP_SUM, DT_I32, &[9]), XDP_DROP, &[COMBINED, COMPLETED]),
                done(0, &[2], &[8]),
                done(u32::MAX, &[2], &[9]),
                close(3, OpenState, &[], &[], &[]),
                close(0, DoneState, &[2], &[], &[8]),
                close(u32::MAX, DoneState, &[2], &[], &[9]),
            ],
        },
        Fixture {
            name: "open refuses what the kernel cannot combine, and takes over a leaked slot",
            steps: vec![
                refused_open(20, 0, OP_SUM, DT_I32, &[1]),
                refused_open(20, 3, OP_SUM, DT_I32, &[1, 2]),
                refused_open(20, 1, OP_CONCAT, DT_BYTES, &[1]),
                refused_open(20, 1, OP_SUM, DT_BYTES, &[1]),
                open(20, 2, OP_SUM, DT_I32, &[1, 2]),
                send("worker 1 of the old request", reply(1, 20, OP_SUM, DT_I32, &[5]), XDP_DROP, &[COMBINED]),
                open(20 + NSLOTS, 1, OP_SUM, DT_I32, &[1]),
                send("the old request's worker 2", reply(2, 20, OP_SUM, DT_I32, &[5]), XDP_PASS, &[UNCLAIMED]),
                send(
                    "the new one's worker 1",
                    reply(1, 20 + NSLOTS, OP_SUM, DT_I32, &[4]),
                    XDP_DROP,
                    &[COMBINED, COMPLETED],
                ),
                done(20 + NSLOTS, &[1], &[4]),
                close(20 + NSLOTS, DoneState, &[1], &[], &[4]),
            ],
        },
        Fixture { name: "a full done ring: the requests are still found DONE by CLOSE", steps: ring_full },
    ]
}

fn run_fixture(e: &mut SgEngine, fx: &Fixture) -> Result<(), String> {
    let mut pending = std::collections::VecDeque::new();
    for (n, step) in fx.steps.iter().enumerate() {
        let at = |msg: String| format!("step {n}: {msg}");
        match step {
            Step::Open { id, need, op, dt, asked, ok } => {
                let r = e.open_request(*id, *need, *op, *dt, asked);
                if r.is_ok() != *ok {
                    return Err(at(format!("open of request {id}: {r:?}, want ok = {ok}")));
                }
            }
            Step::Send { what, reply, verdict, counters } => {
                let before = e.stats().map_err(|x| at(x.to_string()))?;
                let frame = reply.frame();
                let (v, out) = e.run_xdp_sg(&frame).map_err(|x| at(x.to_string()))?;
                let after = e.stats().map_err(|x| at(x.to_string()))?;
                let mut want = before;
                for c in counters {
                    c(&mut want);
                }
                if v != *verdict {
                    return Err(at(format!(
                        "{what}: verdict {v}, want {verdict}; counters moved {before:?} -> {after:?}"
                    )));
                }
                if out != frame {
                    return Err(at(format!("{what}: the frame came out changed")));
                }
                if after != want {
                    return Err(at(format!("{what}: counters {after:?}, want {want:?}")));
                }
            }
            Step::Done { id, seen, values, overflow_at } => {
                if pending.is_empty() {
                    pending.extend(e.poll_done(Duration::ZERO).map_err(|x| at(x.to_string()))?);
                }
                let d = pending.pop_front().ok_or_else(|| at(format!("no done record for request {id}")))?;
                if d.req_id != *id || d.seen != *seen || d.overflow_at != *overflow_at || d.slot != id % NSLOTS {
                    return Err(at(format!(
                        "done record {d:?}, want request {id} seen {seen:?} overflow {overflow_at:?}"
                    )));
                }
                let got = e.values(d.slot, d.nelem);
                if got != values.as_slice() {
                    return Err(at(format!("request {id}: values {:?}, want {:?}", head(got), head(values))));
                }
            }
            Step::Close { id, want } => {
                let got = e.close_request(*id).map_err(|x| at(x.to_string()))?;
                match (got, want) {
                    (None, None) => {}
                    (Some(c), Some(w)) => {
                        if c.state != w.state || c.seen != w.seen || c.refused != w.refused {
                            return Err(at(format!(
                                "close of {id}: {:?} seen {:?} refused {:?}, want {:?} {:?} {:?}",
                                c.state, c.seen, c.refused, w.state, w.seen, w.refused
                            )));
                        }
                        let vals = e.values(e.slot_of(*id), c.nelem);
                        if vals != w.values.as_slice() {
                            return Err(at(format!(
                                "close of {id}: values {:?}, want {:?}",
                                head(vals),
                                head(&w.values)
                            )));
                        }
                    }
                    (got, _) => {
                        return Err(at(format!(
                            "close of {id}: {got:?}, want {}",
                            if want.is_some() { "the request" } else { "not ours" }
                        )))
                    }
                }
            }
        }
    }
    pending.extend(e.poll_done(Duration::ZERO).map_err(|x| x.to_string())?);
    if let Some(d) = pending.front() {
        return Err(format!("a done record nobody expected: {d:?}"));
    }
    Ok(())
}

fn head(v: &[i64]) -> String {
    if v.len() <= 8 {
        format!("{v:?}")
    } else {
        format!("{:?}.. ({} elements)", &v[..8], v.len())
    }
}

#[test]
fn xdp_sg_fixture_table() {
    if !root_or_skip("xdp_sg_fixture_table", "BPF_PROG_TEST_RUN") {
        return;
    }
    let cfg = SgEngineConfig { nslots: NSLOTS, ring_bytes: 4096, ..SgEngineConfig::new(JOB, SG_PORT) };
    let mut failed = Vec::new();
    for fx in fixtures() {
        let mut e = SgEngine::open(&cfg).expect("loading xdp_sg");
        for &r in MEMBERS {
            e.set_member(r, ip_of(r), port_of(r)).expect("members");
        }
        match run_fixture(&mut e, &fx) {
            Ok(()) => println!("ok    {}", fx.name),
            Err(why) => {
                println!("FAIL  {}: {why}", fx.name);
                failed.push(format!("{}: {why}", fx.name));
            }
        }
    }
    let e = SgEngine::open(&cfg).expect("loading xdp_sg");
    let (x, c) = e.verified_insns().expect("program info");
    println!("verifier processed {x} insns (kccl_xdp_sg), {c} (kccl_sg_ctl)");
    assert!(failed.is_empty(), "{} fixture(s) failed:\n{}", failed.len(), failed.join("\n"));
}

#[test]
fn engine_config_is_validated() {
    let bad = |f: fn(&mut SgEngineConfig)| {
        let mut c = SgEngineConfig::new(JOB, SG_PORT);
        f(&mut c);
        c.validate().is_err()
    };
    assert!(bad(|c| c.nslots = 3000));
    assert!(bad(|c| c.nslots = 1 << 17));
    assert!(bad(|c| c.port = 0));
    assert!(bad(|c| c.ring_bytes = 1000));
    assert!(SgEngineConfig::new(JOB, SG_PORT).validate().is_ok());
}
