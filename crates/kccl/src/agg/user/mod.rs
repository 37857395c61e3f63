//! The user-space aggregator: the tuned baseline the kernel path is measured
//! against, the fallback when BPF is unavailable, and the server of the
//! packets the kernel passes up (USER_ONLY: overflow redo; op/type the
//! kernel does not do).
//!
//! Same slot rules as xdp_agg (bpf/include/kccl_agg.h): chunk `c` of
//! operation `op` lives in slot `(hash(op) + c) & (nslots - 1)`; a slot keeps
//! int64 accumulators, the bitmap of contributors seen (duplicates are never
//! counted twice) and completes when every contributor of the mask was seen.
//! A contribution whose op/type/length/mask differ from the slot's is a
//! mismatch (counted, dropped); one that finds its slot held by another live
//! chunk is dropped (busy, the sender retransmits) unless that chunk was
//! abandoned for longer than the slot timeout (reclaimed).  A finished chunk
//! stays DONE and answers retransmissions (to the retransmitting sender only)
//! until its slot is needed; then its answer moves to a ring of retired
//! answers of the same size, so an answer lost on the way can always be
//! repeated while its operation can still be waiting for it.
//!
//! Hot path: one recvmmsg of up to 1024 datagrams, no allocation per packet
//! (slots, answer arena and receive buffers are reused), accumulate loops
//! over big-endian values into int64 that the compiler vectorizes, and one
//! sendmmsg per batch for every answer (one datagram per contributor: the
//! user-space equivalent of the kernel's fan-out; reduce chunks marked
//! F_ACK_LATER are answered with one ACKS bitmap per contributor and
//! operation instead, acks.rs).
//!
//! Files: the slot table and its answers here; counters and mismatch
//! reports in stats.rs; the sink interface it hands chunks to in sink.rs;
//! the accumulate loops in combine.rs.

mod acks;
mod combine;
mod sink;
mod stats;

pub use sink::{Admit, AggSink, AllreduceOnly};
pub use stats::{AggStats, MismatchEvent};

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use crate::agg::abort;
use crate::agg::packet::{check_contribution, elem_size, Reject};
use crate::error::Result;
use crate::group::Group;
use crate::kernel_agg::{AggRecord, AggRecordView};
use crate::transport::sock::{BatchSocket, Datagram, RecvBatch};
use crate::wire::{
    AbortReason, Header, F_ACK_LATER, F_ALLREDUCE, F_LAST_FRAG, F_MISMATCH, F_OVERFLOW, F_USER_ONLY, HDR_LEN,
    MASK_BITS, T_AGG, T_AGG_ABORT, T_AGG_ACK, T_AGG_PENDING, T_AGG_RECEIPT, T_AGG_RESULT, T_AGG_SYNC, T_AGG_SYNC_ACK,
    VERSION,
};
use acks::AckBatch;
use combine::combine;
pub(in crate::agg) use combine::encode_result;

#[derive(Debug, Clone)]
pub struct UserAggConfig {
    pub job_id: u32,
    /// Rank of this aggregator (src_rank of its answers).
    pub my_rank: u16,
    pub chunk_bytes: usize,
    /// Rounded up to a power of two.
    pub nslots: usize,
    /// An ACTIVE chunk older than this may be reclaimed by another.
    pub slot_timeout: Duration,
    /// How long finished chunks answer retransmissions at least, and how
    /// long a finished operation's late packets are recognised as stale.
    pub linger: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Active,
    Done,
}

/// What every contribution to one chunk must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Meta {
    msg_len: u32,
    payload_len: u16,
    agg_op: u8,
    dtype: u8,
    /// ALLREDUCE | USER_ONLY | LAST_FRAG of the contributions.
    flags: u16,
    mask_base: u16,
    expected: u64,
}

/// What a chunk's contributions are, as mismatch messages show it.
pub fn describe_chunk(allreduce: bool, msg_len: u32, agg_op: u8, dtype: u8, expected: u64, mask_base: u16) -> String {
    format!(
        "{} of {msg_len} bytes, op {agg_op} dtype {dtype}, contributors {expected:#x}@{mask_base}",
        if allreduce { "allreduce" } else { "reduce" },
    )
}

impl Meta {
    fn of(h: &Header) -> Meta {
        Meta {
            msg_len: h.msg_len,
            payload_len: h.payload_len,
            agg_op: h.agg_op,
            dtype: h.dtype,
            flags: h.flags & (F_ALLREDUCE | F_USER_ONLY | F_LAST_FRAG),
            mask_base: h.mask_base,
            expected: h.dst_mask,
        }
    }

    fn describe(&self) -> String {
        describe_chunk(
            self.flags & F_ALLREDUCE != 0,
            self.msg_len,
            self.agg_op,
            self.dtype,
            self.expected,
            self.mask_base,
        )
    }
}

struct Slot {
    state: State,
    op_id: u32,
    frag_off: u32,
    meta: Meta,
    seen: u64,
    claimed: Instant,
    done_at: Instant,
    overflow: bool,
    acc: Box<[i64]>,
    /// The answer (header + RESULT payload, or the bare ACK header).
    answer: Box<[u8]>,
    answer_len: usize,
}

/// An answer moved out of a reused DONE slot.
struct Retired {
    key: Option<(u32, u32)>,
    meta: Meta,
    when: Instant,
    answer: Box<[u8]>,
    answer_len: usize,
}

struct OpTrack {
    nchunks: u32,
    done: u32,
    last: Instant,
}

/// Operations remembered for stale detection (bounded).
const MAX_TRACKED_OPS: usize = 256;
/// Mismatch events kept for the owner to report.
const MAX_MISMATCH_EVENTS: usize = 32;

pub struct UserAggregator {
    cfg: UserAggConfig,
    slot_mask: usize,
    slots: Vec<Slot>,
    retired: Vec<Retired>,
    retired_idx: HashMap<(u32, u32), usize>,
    /// Calls aborted by a member since AggBackend::sync_kernel last asked.
    aborted_calls: Vec<u32>,
    /// Calls known to be aborted (first op ids: by this aggregator on a
    /// mismatch, or by a member), the latest MAX_TRACKED_OPS for `linger`,
    /// each with the abort this aggregator sends to a contribution of it
    /// that arrives late (a member that started after the abort).  Empty
    /// most of the time: contributions look it up only when it is not.
    aborted: HashMap<u32, Vec<u8>>,
    aborted_order: VecDeque<(u32, Instant)>,
    /// Allreduce contributions xdp_agg found disagreeing with its slot
    /// (KCCL_F_MISMATCH), for the kernel backend, which can read the slot,
    /// to abort their calls (at most MAX_MISMATCH_EVENTS kept).
    kernel_mismatches: Vec<Header>,
    retired_next: usize,
    ops: HashMap<u32, OpTrack>,
    /// Address of each rank (index = rank).
    members: Vec<Option<SocketAddrV4>>,
    /// Answers of the current batch: bytes, then (to, start, len).
    arena: Vec<u8>,
    out: Vec<(SocketAddrV4, usize, usize)>,
    /// Reduce chunks taken this round whose contributors asked for a
    /// batched acknowledgement (F_ACK_LATER; acks.rs).
    acks: AckBatch,
    mismatches: VecDeque<MismatchEvent>,
    /// Per rank: the latest (op id, chunk bound) its receipts proved, as
    /// struct kccl_agg_acks keeps it on the kernel path.
    receipts: Vec<Option<(u32, u32)>>,
    /// The latest operation a receipt said was finished (every chunk).
    last_done: Option<u32>,
    /// A member of the group (not its aggregator service): in a sharded
    /// allreduce it is one of the contributors of the shard it combines.
    shard_owner: bool,
    stats: AggStats,
}

/// a after b in serial-number order (op ids wrap at 2^32).
fn op_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Whether `ack` (op id, bound: every answer of earlier operations and of
/// chunks below bound of this one) covers all `nchunks` chunks of `op_id`.
/// Op ids compare in serial-number order (they wrap at 2^32).
pub fn ack_covers(ack: Option<(u32, u32)>, op_id: u32, nchunks: u32) -> bool {
    ack.is_some_and(|(op, bound)| op_after(op, op_id) || (op == op_id && bound >= nchunks))
}

fn slot_hash(op_id: u32) -> usize {
    op_id.wrapping_mul(0x9e37_79b1) as usize
}

impl UserAggregator {
    pub fn new(group: &Group, cfg: UserAggConfig) -> UserAggregator {
        let nslots = cfg.nslots.clamp(2, 1 << 20).next_power_of_two();
        let answer_cap = HDR_LEN + cfg.chunk_bytes;
        let now = Instant::now();
        let empty = Meta { msg_len: 0, payload_len: 0, agg_op: 0, dtype: 0, flags: 0, mask_base: 0, expected: 0 };
        let slots = (0..nslots)
            .map(|_| Slot {
                state: State::Free,
                op_id: 0,
                frag_off: 0,
                meta: empty,
                seen: 0,
                claimed: now,
                done_at: now,
                overflow: false,
                acc: vec![0i64; cfg.chunk_bytes / 4].into_boxed_slice(),
                answer: vec![0u8; answer_cap].into_boxed_slice(),
                answer_len: 0,
            })
            .collect();
        let retired = (0..nslots)
            .map(|_| Retired {
                key: None,
                meta: empty,
                when: now,
                answer: vec![0u8; answer_cap].into_boxed_slice(),
                answer_len: 0,
            })
            .collect();
        let max_rank = group.members.iter().map(|m| m.rank as usize).max().unwrap_or(0);
        let mut members = vec![None; max_rank + 1];
        for m in &group.members {
            members[m.rank as usize] = Some(SocketAddrV4::new(m.addr, m.port));
        }
        UserAggregator {
            slot_mask: nslots - 1,
            cfg: UserAggConfig { nslots, ..cfg },
            slots,
            retired,
            retired_idx: HashMap::with_capacity(nslots),
            aborted_calls: Vec::new(),
            retired_next: 0,
            ops: HashMap::new(),
            members,
            arena: Vec::with_capacity(64 * 1024),
            out: Vec::with_capacity(1024),
            acks: AckBatch::new(cfg.chunk_bytes),
            mismatches: VecDeque::new(),
            aborted: HashMap::new(),
            aborted_order: VecDeque::new(),
            kernel_mismatches: Vec::new(),
            receipts: vec![None; max_rank + 1],
            last_done: None,
            shard_owner: group.aggregator != Some(cfg.my_rank),
            stats: AggStats::default(),
        }
    }

    /// Takes a KCCL_T_AGG_RECEIPT: rank src_rank holds every answer of
    /// operation msg_seq below byte frag_off.  Checked like a contribution
    /// (job, member address); it only ever raises what the rank proved.
    pub fn take_receipt(&mut self, h: &Header, from: SocketAddrV4) {
        if !self.control_from_member(h, from) {
            return;
        }
        let r = usize::from(h.src_rank);
        let bound = (h.frag_off as usize).div_ceil(self.cfg.chunk_bytes.max(1)) as u32;
        let new = (h.msg_seq, bound);
        if let Some(slot) = self.receipts.get_mut(r) {
            let newer = match *slot {
                None => true,
                Some((op, b)) => op_after(h.msg_seq, op) || (h.msg_seq == op && bound > b),
            };
            if newer {
                *slot = Some(new);
            }
        }
        if h.frag_off >= h.msg_len && self.last_done.is_none_or(|d| op_after(h.msg_seq, d)) {
            self.last_done = Some(h.msg_seq);
        }
        self.stats.receipts += 1;
    }

    /// The call a member starting now should begin at: the one after the
    /// latest finished operation (op ids are call * 4 + k), 0 if none; but
    /// that operation's own call if it was aborted: the members that ended
    /// it by the abort wait for this one in the next call, and the late
    /// member meets them there after its contribution to the aborted call
    /// is answered with the abort.
    pub fn next_call_hint(&self) -> u32 {
        self.last_done.map_or(0, |op| op / 4 + u32::from(!self.aborted.contains_key(&(op & !3))))
    }

    /// Answers a KCCL_T_AGG_SYNC from a member (checked like a receipt)
    /// with the op id of `call`; queued for the next flush.
    pub fn answer_sync(&mut self, h: &Header, from: SocketAddrV4, call: u32) {
        if !self.control_from_member(h, from) {
            return;
        }
        let a = Header::control(T_AGG_SYNC_ACK, self.cfg.job_id, self.cfg.my_rank, call.wrapping_mul(4));
        let mut hb = [0u8; HDR_LEN];
        a.encode(&mut hb);
        let start = self.arena.len();
        self.arena.extend_from_slice(&hb);
        self.out.push((from, start, HDR_LEN));
        self.stats.syncs += 1;
    }

    /// A control packet (RECEIPT, SYNC) of this job from its sender rank's
    /// own address; anything else is counted and ignored.
    fn control_from_member(&mut self, h: &Header, from: SocketAddrV4) -> bool {
        if h.job_id != self.cfg.job_id {
            self.stats.other_job += 1;
            return false;
        }
        if self.member_addr(h.src_rank) != Some(from) {
            self.stats.not_member += 1;
            return false;
        }
        true
    }

    /// What rank `rank` proved with its receipts: None, or (op id, bound).
    pub fn receipt_of(&self, rank: u16) -> Option<(u32, u32)> {
        self.receipts.get(usize::from(rank)).copied().flatten()
    }

    pub fn stats(&self) -> AggStats {
        self.stats
    }

    pub fn config(&self) -> &UserAggConfig {
        &self.cfg
    }

    /// Mismatching contributions seen since the last call (at most 32 kept).
    pub fn take_mismatches(&mut self) -> Vec<MismatchEvent> {
        self.mismatches.drain(..).collect()
    }

    /// Largest datagram this aggregator takes (bigger ones count as truncated).
    pub fn dgram_max(&self) -> usize {
        HDR_LEN + self.cfg.chunk_bytes
    }

    /// Counts a datagram the owner read and did not pass to [`ingest`]
    /// (truncated, not kccl, ...).
    pub fn count_datagram(&mut self) {
        self.stats.datagrams += 1;
    }

    pub fn count_truncated(&mut self) {
        self.stats.truncated += 1;
    }

    pub fn count_malformed(&mut self) {
        self.stats.malformed += 1;
    }

    pub fn count_not_contribution(&mut self) {
        self.stats.not_contribution += 1;
    }

    pub fn count_recv_call(&mut self) {
        self.stats.recv_calls += 1;
    }

    /// One contribution (already decoded by [`Header::decode`]); answers are
    /// queued for [`flush`](Self::flush), completed reduce chunks go to
    /// `deliver`.
    pub fn ingest(&mut self, h: &Header, payload: &[u8], from: SocketAddrV4, now: Instant, sink: &mut dyn AggSink) {
        let chunk = self.cfg.chunk_bytes;
        if h.job_id != self.cfg.job_id {
            self.stats.other_job += 1;
            return;
        }
        match check_contribution(h, chunk) {
            Ok(()) => {}
            Err(Reject::NotContribution) => {
                self.stats.not_contribution += 1;
                return;
            }
            Err(Reject::Unsupported) => {
                self.stats.unsupported += 1;
                self.refuse_unsupported(h, from, now, sink);
                return;
            }
            Err(Reject::Malformed) => {
                self.stats.malformed += 1;
                return;
            }
            Err(Reject::NotContributor) => {
                self.stats.not_contrib += 1;
                return;
            }
        }
        // The sender must send from its own address and port.
        if self.member_addr(h.src_rank) != Some(from) {
            self.stats.not_member += 1;
            return;
        }
        // A call already aborted: this member started late (or missed
        // the abort); it gets the abort now instead of waiting out its
        // deadline for members that moved on.
        if self.resend_abort(h, from, now) {
            return;
        }
        // The kernel found it mismatching (and counted it): its call is
        // aborted once the backend read the kernel's slot.
        if h.flags & F_MISMATCH != 0 {
            if self.kernel_mismatches.len() < MAX_MISMATCH_EVENTS {
                self.kernel_mismatches.push(*h);
            }
            return;
        }
        // This aggregator is one of the contributors it waits for only as
        // the owner of a shard of a sharded allreduce (its own contribution
        // comes from its Collective, over loopback); a reduce root folds
        // its own data in after the sum, and the aggregator service has
        // none.
        let me = self.cfg.my_rank as usize;
        let base = h.mask_base as usize;
        let own_ok = self.shard_owner && h.flags & F_ALLREDUCE != 0;
        if !own_ok && me >= base && me - base < MASK_BITS && h.dst_mask & (1u64 << (me - base)) != 0 {
            self.stats.malformed += 1;
            return;
        }
        if h.flags & F_USER_ONLY != 0 {
            self.stats.user_only += 1;
        }
        let meta = Meta::of(h);
        let key = (h.msg_seq, h.frag_off);
        let bit = 1u64 << (h.src_rank as usize - base);
        let idx = (slot_hash(h.msg_seq).wrapping_add(h.frag_off as usize / chunk)) & self.slot_mask;
        let linger = self.cfg.linger;

        let s = &self.slots[idx];
        let (state, claimed, slot_meta, seen) = (s.state, s.claimed, s.meta, s.seen);
        let same = state != State::Free && (s.op_id, s.frag_off) == key;
        if same && state == State::Done && now.duration_since(s.done_at) <= linger {
            if slot_meta != meta {
                let d = format!("sent {}, the chunk was {}", meta.describe(), slot_meta.describe());
                self.stats.mismatch += 1;
                self.abort_mismatch(h, slot_meta.mask_base, slot_meta.expected, &d);
                self.note_mismatch(h, d);
                return;
            }
            self.stats.dup_done += 1;
            self.answer_one(idx, false, h.src_rank, base);
            return;
        }
        if same && state == State::Active {
            // The owner first: a local root that runs this op names the
            // mismatch against what it expects, whichever packet came first.
            if slot_meta != meta && !self.admitted(h, sink) {
                return;
            }
            if slot_meta != meta {
                let d = format!("sent {}, the chunk is {}", meta.describe(), slot_meta.describe());
                self.stats.mismatch += 1;
                self.abort_mismatch(h, slot_meta.mask_base, slot_meta.expected, &d);
                self.note_mismatch(h, d);
                return;
            }
            if seen & bit != 0 {
                self.stats.dup += 1;
                self.answer_pending(h, base, slot_meta.expected & !seen);
                return;
            }
            if !self.admitted(h, sink) {
                return;
            }
            self.add(idx, h, payload, bit, false, now, sink);
            return;
        }
        // Not in its slot: a recycled answer, a stale packet, or a new chunk.
        if let Some(&r) = self.retired_idx.get(&key) {
            let ret = &self.retired[r];
            if now.duration_since(ret.when) <= linger && ret.meta == meta {
                self.stats.dup_done += 1;
                self.answer_one(r, true, h.src_rank, base);
                return;
            }
        }
        if let Some(t) = self.ops.get(&h.msg_seq) {
            if t.done >= t.nchunks && now.duration_since(t.last) <= linger {
                self.stats.stale += 1;
                return;
            }
        }
        if state == State::Active && now.duration_since(claimed) <= self.cfg.slot_timeout {
            self.stats.busy += 1;
            return;
        }
        if !self.admitted(h, sink) {
            return;
        }
        match state {
            State::Free => {}
            State::Done => self.retire(idx),
            State::Active => self.stats.reclaimed += 1,
        }
        let s = &mut self.slots[idx];
        s.state = State::Active;
        s.op_id = key.0;
        s.frag_off = key.1;
        s.meta = meta;
        s.seen = 0;
        s.claimed = now;
        s.overflow = false;
        self.add(idx, h, payload, bit, true, now, sink);
    }

    /// Asks the owner; counts and records refusals.
    fn admitted(&mut self, h: &Header, sink: &mut dyn AggSink) -> bool {
        match sink.admit(h) {
            Admit::Yes => true,
            Admit::Early => {
                self.stats.early += 1;
                false
            }
            Admit::Mismatch(detail) => {
                self.stats.mismatch += 1;
                self.note_mismatch(h, detail);
                false
            }
        }
    }

    /// Contributors still missing from an active chunk (for error messages).
    pub fn missing(&self, op_id: u32, frag_off: u32) -> Option<(u16, u64)> {
        let idx = (slot_hash(op_id).wrapping_add(frag_off as usize / self.cfg.chunk_bytes)) & self.slot_mask;
        let s = &self.slots[idx];
        (s.state == State::Active && (s.op_id, s.frag_off) == (op_id, frag_off))
            .then_some((s.meta.mask_base, s.meta.expected & !s.seen))
    }

    /// An allreduce chunk its members disagree on (length, type, op or
    /// contributors: `detail` says how `h` differs from `slot`): the call
    /// cannot complete, so it is aborted with reason MISMATCH (abort_call).
    /// A reduce's mismatch is the root's to announce (root.rs), which knows
    /// what it expects.
    pub fn abort_mismatch(&mut self, h: &Header, mask_base: u16, expected: u64, detail: &str) {
        let text = format!(
            "rank {} {detail}: the members of one allreduce must pass the same length, element type and op",
            h.src_rank
        );
        self.abort_call(h, mask_base, expected, AbortReason::Mismatch, &text);
    }

    /// A contribution with an op or element type this aggregator does not
    /// know (its sender runs another kccl version, or is not kccl): counted
    /// as `unsupported` and, when it really comes from a contributor of
    /// the call it names (its own address, its bit in the mask), its call
    /// fails at once for every member instead of at their deadline: an
    /// allreduce is aborted here with reason UNSUPPORTED; a reduce goes to
    /// the root (the sink), which finds it differs from the op it runs and
    /// announces the abort itself.
    fn refuse_unsupported(&mut self, h: &Header, from: SocketAddrV4, now: Instant, sink: &mut dyn AggSink) {
        let (base, r) = (h.mask_base as usize, h.src_rank as usize);
        let in_mask = base % MASK_BITS == 0 && r >= base && r - base < MASK_BITS && h.dst_mask >> (r - base) & 1 != 0;
        if !in_mask {
            return;
        }
        if self.members.get(r).copied().flatten() != Some(from) {
            self.stats.not_member += 1;
            return;
        }
        if self.resend_abort(h, from, now) {
            return;
        }
        if h.flags & F_ALLREDUCE == 0 {
            self.admitted(h, sink);
            return;
        }
        let detail = format!("sent op {} dtype {}, which this aggregator does not support", h.agg_op, h.dtype);
        let text = format!("rank {r} {detail}: every member of a job must run the same kccl version");
        self.abort_call(h, h.mask_base, h.dst_mask, AbortReason::Unsupported, &text);
        self.note_mismatch(h, detail);
    }

    /// Aborts the allreduce call of `h` (`reason`, `text` says what to
    /// fix): every member of it (contributors `expected` at `mask_base`, and
    /// the sender) is told at once, KCCL_T_AGG_ABORT from this aggregator,
    /// instead of waiting out its deadline; the call's slots here (and,
    /// through AggBackend::sync_kernel, the kernel's) are freed, and the
    /// abort is kept for late contributions.  Once per call.
    fn abort_call(&mut self, h: &Header, mask_base: u16, expected: u64, reason: AbortReason, text: &str) {
        let call = h.msg_seq & !3;
        if h.flags & F_ALLREDUCE == 0 || self.aborted.contains_key(&call) {
            return;
        }
        let d = abort::datagram(self.cfg.job_id, self.cfg.my_rank, mask_base, expected, call, reason, text);
        let base = mask_base as usize;
        let ranks = (0..MASK_BITS).filter(|b| expected >> b & 1 != 0).map(|b| base + b);
        let mut to: Vec<SocketAddrV4> =
            ranks.chain([h.src_rank as usize]).filter_map(|r| self.members.get(r).copied().flatten()).collect();
        to.sort_unstable_by_key(|a| (u32::from(*a.ip()), a.port()));
        to.dedup();
        for a in to {
            self.queue(a, &d);
        }
        self.remember_abort(call, d);
        self.free_call(call);
        self.aborted_calls.push(call);
        self.stats.aborts_sent += 1;
    }

    /// The address of `rank` in the group (None: not a member).
    pub fn member_addr(&self, rank: u16) -> Option<SocketAddrV4> {
        self.members.get(usize::from(rank)).copied().flatten()
    }

    /// Queues `answer`, one the kernel's fan-out could not send (struct
    /// kccl_agg_miss), to `rank` for the next flush; counted as relayed, or
    /// as unserved when there is nothing to send or nobody to send it to
    /// (this aggregator's own rank is never a destination).
    pub fn relay_kernel_answer(&mut self, rank: u16, answer: &[u8]) {
        match self.member_addr(rank) {
            Some(to) if !answer.is_empty() && rank != self.cfg.my_rank => {
                self.queue(to, answer);
                self.stats.misses_relayed += 1;
            }
            _ => self.stats.misses_unserved += 1,
        }
    }

    /// Queues datagram `d` to `to` for the next flush.
    fn queue(&mut self, to: SocketAddrV4, d: &[u8]) {
        let start = self.arena.len();
        self.arena.extend_from_slice(d);
        self.out.push((to, start, d.len()));
    }

    /// Answers a contribution to a call aborted here (or passed on from a
    /// member) with its abort; false if its call is not one of them.
    fn resend_abort(&mut self, h: &Header, from: SocketAddrV4, now: Instant) -> bool {
        if self.aborted.is_empty() {
            return false;
        }
        self.forget_aborts(now);
        let Some(d) = self.aborted.get(&(h.msg_seq & !3)).cloned() else { return false };
        self.queue(from, &d);
        self.stats.aborts_resent += 1;
        true
    }

    /// Keeps `d`, the abort of `call` (its first op id), for late
    /// contributions of it.
    pub fn remember_abort(&mut self, call: u32, d: Vec<u8>) {
        if self.aborted.insert(call, d).is_none() {
            self.aborted_order.push_back((call, Instant::now()));
        }
        self.forget_aborts(Instant::now());
    }

    /// Forgets aborts older than `linger`, and beyond MAX_TRACKED_OPS.
    fn forget_aborts(&mut self, now: Instant) {
        while let Some(&(call, t)) = self.aborted_order.front() {
            if self.aborted_order.len() <= MAX_TRACKED_OPS && now.duration_since(t) <= self.cfg.linger {
                break;
            }
            self.aborted_order.pop_front();
            self.aborted.remove(&call);
        }
    }

    /// The allreduce contributions xdp_agg passed up as mismatching.
    pub fn take_kernel_mismatches(&mut self) -> Vec<Header> {
        std::mem::take(&mut self.kernel_mismatches)
    }

    fn note_mismatch(&mut self, h: &Header, detail: String) {
        if self.mismatches.len() >= MAX_MISMATCH_EVENTS {
            self.mismatches.pop_front();
        }
        self.mismatches.push_back(MismatchEvent { op_id: h.msg_seq, rank: h.src_rank, detail });
    }

    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        idx: usize,
        h: &Header,
        payload: &[u8],
        bit: u64,
        first: bool,
        now: Instant,
        sink: &mut dyn AggSink,
    ) {
        let s = &mut self.slots[idx];
        let n = payload.len() / elem_size(h.dtype);
        let ovf = combine(&mut s.acc[..n], payload, h.dtype, h.agg_op, first);
        s.overflow |= ovf;
        s.seen |= bit;
        self.stats.pkts += 1;
        if s.seen == s.meta.expected {
            self.complete(idx, now, sink);
        }
    }

    fn complete(&mut self, idx: usize, now: Instant, sink: &mut dyn AggSink) {
        let me = self.cfg.my_rank;
        let chunk = self.cfg.chunk_bytes;
        let s = &mut self.slots[idx];
        let m = s.meta;
        let allreduce = m.flags & F_ALLREDUCE != 0;
        let n = m.payload_len as usize / elem_size(m.dtype);
        let mut overflow = s.overflow;
        let plen = if allreduce {
            overflow |= encode_result(&s.acc[..n], m.dtype, &mut s.answer[HDR_LEN..HDR_LEN + m.payload_len as usize]);
            m.payload_len
        } else {
            0
        };
        let h = Header {
            version: VERSION,
            msg_type: if allreduce { T_AGG_RESULT } else { T_AGG_ACK },
            flags: m.flags | if overflow { F_OVERFLOW } else { 0 },
            job_id: self.cfg.job_id,
            src_rank: me,
            mask_base: m.mask_base,
            dst_mask: m.expected,
            msg_seq: s.op_id,
            frag_off: s.frag_off,
            msg_len: m.msg_len,
            payload_len: plen,
            agg_op: m.agg_op,
            dtype: m.dtype,
        };
        let mut hb = [0u8; HDR_LEN];
        h.encode(&mut hb);
        s.answer[..HDR_LEN].copy_from_slice(&hb);
        s.answer_len = HDR_LEN + plen as usize;
        s.state = State::Done;
        s.done_at = now;
        self.stats.chunks_done += 1;
        if overflow {
            self.stats.overflow += 1;
        }
        // The chunk as a reduce root takes it (field for field the kernel
        // path's ring buffer record).
        let rec = AggRecord {
            job_id: self.cfg.job_id,
            op_id: s.op_id,
            frag_off: s.frag_off,
            msg_len: m.msg_len,
            payload_len: m.payload_len,
            mask_base: m.mask_base,
            agg_op: m.agg_op,
            dtype: m.dtype,
            overflow: s.overflow,
            contributors: m.expected,
        };
        if allreduce {
            self.stats.results += 1;
        } else {
            self.stats.acks += 1;
            sink.deliver(&AggRecordView::new(rec, &s.acc[..n]));
        }
        let op = self.slots[idx].op_id;
        if !allreduce && m.flags & F_ACK_LATER != 0 {
            // Acknowledged with the round's other chunks (acks.rs); the
            // stored answer still serves retransmissions.
            self.acks.add(&rec, rec.frag_off / chunk as u32);
            self.stats.acks_later += 1;
            self.track_op(op, m.msg_len as usize, chunk, now);
            return;
        }
        let s = &self.slots[idx];
        // The answer once into the arena, then one entry per contributor.
        let start = self.arena.len();
        self.arena.extend_from_slice(&s.answer[..s.answer_len]);
        let len = s.answer_len;
        let mut bits = m.expected;
        while bits != 0 {
            let b = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(Some(to)) = self.members.get(m.mask_base as usize + b) {
                self.out.push((*to, start, len));
            }
        }
        self.track_op(op, m.msg_len as usize, chunk, now);
    }

    fn track_op(&mut self, op: u32, msg_len: usize, chunk: usize, now: Instant) {
        if !self.ops.contains_key(&op) && self.ops.len() >= MAX_TRACKED_OPS {
            let linger = self.cfg.linger;
            self.ops.retain(|_, t| now.duration_since(t.last) <= linger);
            if self.ops.len() >= MAX_TRACKED_OPS {
                if let Some(oldest) = self.ops.iter().min_by_key(|(_, t)| t.last).map(|(k, _)| *k) {
                    self.ops.remove(&oldest);
                }
            }
        }
        let t = self.ops.entry(op).or_insert(OpTrack { nchunks: msg_len.div_ceil(chunk) as u32, done: 0, last: now });
        t.done += 1;
        t.last = now;
    }

    /// Moves a DONE slot's answer into the retired ring (swapping buffers:
    /// no copy, no allocation).
    fn retire(&mut self, idx: usize) {
        let r = self.retired_next;
        self.retired_next = (r + 1) % self.retired.len();
        if let Some(old) = self.retired[r].key.take() {
            if self.retired_idx.get(&old) == Some(&r) {
                self.retired_idx.remove(&old);
            }
        }
        let s = &mut self.slots[idx];
        let ret = &mut self.retired[r];
        std::mem::swap(&mut ret.answer, &mut s.answer);
        ret.answer_len = s.answer_len;
        ret.meta = s.meta;
        ret.when = s.done_at;
        ret.key = Some((s.op_id, s.frag_off));
        self.retired_idx.insert((s.op_id, s.frag_off), r);
        s.state = State::Free;
    }

    /// Queues the answer of a finished chunk for one retransmitting sender,
    /// addressed (dst_mask) to that sender only.
    fn answer_one(&mut self, idx: usize, retired: bool, rank: u16, base: usize) {
        let Some(to) = self.member_addr(rank) else { return };
        let (buf, len) = if retired {
            (&self.retired[idx].answer, self.retired[idx].answer_len)
        } else {
            (&self.slots[idx].answer, self.slots[idx].answer_len)
        };
        let start = self.arena.len();
        self.arena.extend_from_slice(&buf[..len]);
        let only = 1u64 << (rank as usize - base);
        self.arena[start + 16..start + 24].copy_from_slice(&only.to_be_bytes());
        self.out.push((to, start, len));
    }

    /// A PENDING answer to `h` (a retransmission of a counted contribution)
    /// naming the contributors its chunk still waits for, as xdp_agg answers:
    /// a contributor that keeps hearing the same ranks named fails with
    /// Error::MembersMissing naming them, not with a timeout that blames
    /// the aggregator.
    fn answer_pending(&mut self, h: &Header, base: usize, missing: u64) {
        let Some(to) = self.member_addr(h.src_rank) else { return };
        let p = Header {
            version: VERSION,
            msg_type: T_AGG_PENDING,
            flags: h.flags & F_LAST_FRAG,
            job_id: self.cfg.job_id,
            src_rank: self.cfg.my_rank,
            mask_base: h.mask_base,
            dst_mask: 1u64 << (h.src_rank as usize - base),
            msg_seq: h.msg_seq,
            frag_off: h.frag_off,
            msg_len: h.msg_len,
            payload_len: 8,
            agg_op: h.agg_op,
            dtype: h.dtype,
        };
        let mut hb = [0u8; HDR_LEN];
        p.encode(&mut hb);
        let start = self.arena.len();
        self.arena.extend_from_slice(&hb);
        self.arena.extend_from_slice(&missing.to_be_bytes());
        self.out.push((to, start, HDR_LEN + 8));
        self.stats.pending += 1;
    }

    /// A member's abort of a call (KCCL_T_AGG_ABORT): when it came from the
    /// named member's address in this job (else counted as `not_member`),
    /// frees the call's ACTIVE slots here and queues the call for the
    /// kernel's (AggBackend::sync_kernel).
    pub fn take_abort(&mut self, h: &Header, payload: &[u8], from: SocketAddrV4) {
        if h.job_id != self.cfg.job_id || self.member_addr(h.src_rank) != Some(from) {
            self.stats.not_member += 1;
            return;
        }
        self.stats.aborts += 1;
        let call = h.msg_seq & !3;
        self.free_call(call);
        self.aborted_calls.push(call);
        // Passed on, from this aggregator, to a member that contributes to
        // the call late (members accept aborts from the call's aggregator).
        if let (false, Some((reason, text))) = (self.aborted.contains_key(&call), abort::parse(payload)) {
            let text = format!("rank {}: {text}", h.src_rank);
            let d = abort::datagram(self.cfg.job_id, self.cfg.my_rank, h.mask_base, h.dst_mask, call, reason, &text);
            self.remember_abort(call, d);
        }
    }

    /// Calls aborted since the last call (their first op ids).
    pub fn take_aborted_calls(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.aborted_calls)
    }

    /// Frees the ACTIVE slots of the call of op id `op_id` (any op of it):
    /// it was aborted, its chunks will never complete.
    pub fn free_call(&mut self, op_id: u32) {
        let call = op_id & !3;
        for s in self.slots.iter_mut().filter(|s| s.state == State::Active && s.op_id & !3 == call) {
            s.state = State::Free;
            self.stats.abort_freed += 1;
        }
    }

    /// Answers waiting for [`flush`](Self::flush).
    pub fn pending_answers(&self) -> usize {
        self.out.len()
    }

    /// A reduce chunk the root's runtime took from the kernel (its ring
    /// buffer record): acknowledged to its contributors with the round's
    /// other chunks at the next [`flush`](Self::flush) (acks.rs).
    pub fn ack_later(&mut self, rec: &AggRecord) {
        let chunk = (rec.frag_off as usize / self.cfg.chunk_bytes) as u32;
        self.acks.add(rec, chunk);
        self.stats.acks_later += 1;
    }

    /// Sends every queued answer (sendmmsg, 1024 per call), the round's
    /// batched acknowledgements first.
    pub fn flush(&mut self, sock: &BatchSocket) -> Result<()> {
        if !self.acks.is_empty() {
            let (job, me) = (self.cfg.job_id, self.cfg.my_rank);
            self.stats.ack_batches += self.acks.encode(job, me, &self.members, &mut self.arena, &mut self.out);
        }
        if self.out.is_empty() {
            return Ok(());
        }
        let dgrams: Vec<Datagram<'_>> = self
            .out
            .iter()
            .map(|&(to, start, len)| Datagram { to, head: &self.arena[start..start + len], body: &[] })
            .collect();
        let res = sock.send_all(&dgrams);
        let n = dgrams.len() as u64;
        drop(dgrams);
        self.out.clear();
        self.arena.clear();
        self.stats.send_calls += res? as u64;
        self.stats.answers_sent += n;
        Ok(())
    }

    /// One receive batch (up to the size of `rb`) handled completely:
    /// decode, aggregate, answer.  Returns the datagrams read (0 on timeout).
    pub fn serve_batch(
        &mut self,
        sock: &BatchSocket,
        rb: &mut RecvBatch,
        timeout: Option<Duration>,
        sink: &mut dyn AggSink,
    ) -> Result<usize> {
        let n = sock.recv_batch(rb, timeout)?;
        self.stats.recv_calls += 1;
        let now = Instant::now();
        for i in 0..n {
            self.stats.datagrams += 1;
            let (d, from) = rb.get(i);
            let Ok(d) = d else {
                self.stats.truncated += 1;
                continue;
            };
            match Header::decode(d) {
                Ok((h, p)) if h.msg_type == T_AGG => self.ingest(&h, p, from, now, sink),
                Ok((h, _)) if h.msg_type == T_AGG_RECEIPT => self.take_receipt(&h, from),
                Ok((h, p)) if h.msg_type == T_AGG_ABORT => self.take_abort(&h, p, from),
                Ok((h, _)) if h.msg_type == T_AGG_SYNC => {
                    let call = self.next_call_hint();
                    self.answer_sync(&h, from, call);
                }
                Ok(_) => self.stats.not_contribution += 1,
                Err(_) => self.stats.malformed += 1,
            }
        }
        self.flush(sock)?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agg::packet::contribution_header;
    use crate::group::Member;
    use crate::wire::{DT_F32Q, DT_I32, DT_I64, OP_AVG, OP_COUNT, OP_MAX, OP_MIN, OP_SUM};
    use std::net::Ipv4Addr;

    const CHUNK: usize = 16; // 4 int32 or 2 int64 per chunk: small tables

    fn group(n: u16) -> Group {
        let members = (0..n)
            .map(|r| Member { rank: r, addr: Ipv4Addr::LOCALHOST, port: 40_000 + r, iface: "lo".into(), netns: None })
            .collect();
        Group::new("t", 5, members)
    }

    fn agg(nslots: usize) -> UserAggregator {
        UserAggregator::new(
            &group(8),
            UserAggConfig {
                job_id: 5,
                my_rank: 0,
                chunk_bytes: CHUNK,
                nslots,
                slot_timeout: Duration::from_millis(100),
                linger: Duration::from_secs(10),
            },
        )
    }

    fn from(rank: u16) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40_000 + rank)
    }

    struct Pkt {
        h: Header,
        p: Vec<u8>,
    }

    /// Contribution of `rank` to chunk `c` of op `op` (int32 values).
    fn contrib(rank: u16, op: u32, c: usize, vals: &[i32], msg_elems: usize, agg_op: u8, allreduce: bool) -> Pkt {
        let flags = if allreduce { F_ALLREDUCE } else { 0 };
        let h = contribution_header(5, rank, 0, 0b1110, op, CHUNK, c, msg_elems * 4, agg_op, DT_I32, flags);
        assert_eq!(h.payload_len as usize, vals.len() * 4);
        Pkt { h, p: vals.iter().flat_map(|v| v.to_be_bytes()).collect() }
    }

    #[derive(Default)]
    struct Out {
        done: Vec<(u32, u32, Vec<i64>, bool)>,
        admit: Option<Admit>,
        /// Like a local root: refuse other message lengths.
        expect_len: Option<u32>,
    }

    impl AggSink for Out {
        fn admit(&mut self, h: &Header) -> Admit {
            match self.expect_len {
                Some(l) if h.msg_len != l => Admit::Mismatch(format!("root expects {l} bytes")),
                _ => self.admit.clone().unwrap_or(Admit::Yes),
            }
        }
        fn deliver(&mut self, d: &AggRecordView<'_>) {
            self.done.push((d.op_id, d.frag_off, d.values().to_vec(), d.overflow))
        }
    }

    fn feed(a: &mut UserAggregator, p: &Pkt, rank: u16, out: &mut Out) {
        feed_at(a, p, rank, out, Instant::now());
    }

    fn feed_at(a: &mut UserAggregator, p: &Pkt, rank: u16, out: &mut Out, now: Instant) {
        a.ingest(&p.h, &p.p, from(rank), now, out);
    }

    /// Answers queued so far: (to-port, header, payload).
    fn answers(a: &mut UserAggregator) -> Vec<(u16, Header, Vec<u8>)> {
        let r = a
            .out
            .iter()
            .map(|&(to, s, l)| {
                let (h, p) = Header::decode(&a.arena[s..s + l]).expect("answers decode");
                (to.port() - 40_000, h, p.to_vec())
            })
            .collect();
        a.out.clear();
        a.arena.clear();
        r
    }

    fn i32s(p: &[u8]) -> Vec<i32> {
        p.chunks_exact(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    #[test]
    fn every_op_over_int32() {
        let cases: [(u8, [i64; 4]); 5] = [
            (OP_SUM, [6, 0, -6, 3]),
            (OP_AVG, [6, 0, -6, 3]), // summed on the wire
            (OP_MAX, [3, 5, -1, 3]),
            (OP_MIN, [1, -5, -3, 0]),
            (OP_COUNT, [3, 2, 3, 1]),
        ];
        for (i, (op, want)) in cases.iter().enumerate() {
            let mut a = agg(8);
            let mut out = Out::default();
            let vals = [[1, 5, -1, 0], [2, -5, -2, 0], [3, 0, -3, 3]];
            for (k, r) in [1u16, 2, 3].iter().enumerate() {
                feed(&mut a, &contrib(*r, i as u32, 0, &vals[k], 4, *op, false), *r, &mut out);
            }
            assert_eq!(out.done.len(), 1, "op {op}");
            assert_eq!(out.done[0].2, want.to_vec(), "op {op}");
            let ans = answers(&mut a);
            assert_eq!(ans.len(), 3, "one ACK per contributor");
            for (to, h, p) in &ans {
                assert_eq!((h.msg_type, h.payload_len, p.len()), (T_AGG_ACK, 0, 0));
                assert_eq!((h.src_rank, h.dst_mask, h.msg_seq, h.agg_op), (0, 0b1110, i as u32, *op));
                assert!([1, 2, 3].contains(to));
            }
            assert_eq!(a.stats().acks, 1);
        }
    }

    #[test]
    fn allreduce_result_saturates_and_flags_overflow() {
        let mut a = agg(8);
        let mut out = Out::default();
        for r in [1u16, 2, 3] {
            feed(&mut a, &contrib(r, 7, 0, &[i32::MAX, i32::MIN, 1, -1], 4, OP_SUM, true), r, &mut out);
        }
        assert!(out.done.is_empty(), "allreduce results go out as packets only");
        let ans = answers(&mut a);
        assert_eq!(ans.len(), 3);
        for (_, h, p) in &ans {
            assert_eq!(h.msg_type, T_AGG_RESULT);
            assert_ne!(h.flags & F_OVERFLOW, 0);
            assert_eq!(i32s(p), vec![i32::MAX, i32::MIN, 3, -3]);
        }
        assert_eq!(a.stats().overflow, 1);
        // In range: no flag.
        for r in [1u16, 2, 3] {
            feed(&mut a, &contrib(r, 8, 0, &[1, 2, 3, 4], 4, OP_SUM, true), r, &mut out);
        }
        let ans = answers(&mut a);
        assert_eq!(ans[0].1.flags & F_OVERFLOW, 0);
        assert_eq!(i32s(&ans[0].2), vec![3, 6, 9, 12]);
    }

    #[test]
    fn int64_sum_overflow_is_flagged() {
        let mut a = agg(8);
        let mut out = Out::default();
        for r in [1u16, 2, 3] {
            let h = contribution_header(5, r, 0, 0b1110, 1, CHUNK, 0, 16, OP_SUM, DT_I64, 0);
            let p: Vec<u8> = [i64::MAX / 2, 1i64].iter().flat_map(|v| v.to_be_bytes()).collect();
            feed(&mut a, &Pkt { h, p }, r, &mut out);
        }
        assert_eq!(out.done.len(), 1);
        assert!(out.done[0].3, "int64 overflow must be flagged");
        assert_eq!(out.done[0].2[1], 3);
    }

    #[test]
    fn kernel_answers_are_relayed_to_members_only() {
        let mut a = agg(8);
        let mut h = contrib(3, 4, 0, &[1, 2, 3, 4], 4, OP_SUM, true).h;
        h.msg_type = T_AGG_RESULT;
        h.src_rank = 0;
        let mut d = h.to_bytes().to_vec();
        d.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4]);
        a.relay_kernel_answer(3, &d);
        a.relay_kernel_answer(0, &d); // the aggregator itself
        a.relay_kernel_answer(9, &d); // not in the group
        a.relay_kernel_answer(2, &[]); // the kernel could not copy it
        let sent = answers(&mut a);
        assert_eq!(sent.len(), 1);
        assert_eq!((sent[0].0, sent[0].1.msg_type, i32s(&sent[0].2)), (3, T_AGG_RESULT, vec![1, 2, 3, 4]));
        assert_eq!((a.stats().misses_relayed, a.stats().misses_unserved), (1, 3));
    }

    #[test]
    fn free_call_frees_the_aborted_calls_slots_only() {
        let mut a = agg(8);
        let mut out = Out::default();
        // Call 2 (op 9) and call 3 (op 12), each with one contribution.
        feed(&mut a, &contrib(1, 9, 0, &[1; 4], 4, OP_SUM, true), 1, &mut out);
        feed(&mut a, &contrib(1, 12, 0, &[1; 4], 4, OP_SUM, true), 1, &mut out);
        a.free_call(8);
        assert_eq!(a.stats().abort_freed, 1);
        // Call 3 still completes with its first contribution counted.
        feed(&mut a, &contrib(2, 12, 0, &[2; 4], 4, OP_SUM, true), 2, &mut out);
        feed(&mut a, &contrib(3, 12, 0, &[3; 4], 4, OP_SUM, true), 3, &mut out);
        let ans = answers(&mut a);
        assert_eq!(ans.len(), 3, "call 3's RESULT to its 3 contributors");
        assert_eq!(i32s(&ans[0].2), vec![6; 4]);
        // Call 2's slot was freed: rank 1's copy starts it afresh (not a duplicate).
        feed(&mut a, &contrib(1, 9, 0, &[1; 4], 4, OP_SUM, true), 1, &mut out);
        assert_eq!((a.stats().dup, a.stats().pending), (0, 0));
    }

    #[test]
    fn duplicates_are_counted_once_and_done_chunks_answer_the_sender() {
        let mut a = agg(8);
        let mut out = Out::default();
        let p1 = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, true);
        feed(&mut a, &p1, 1, &mut out);
        feed(&mut a, &p1, 1, &mut out); // duplicate while active
        feed(&mut a, &contrib(2, 0, 0, &[2, 2, 2, 2], 4, OP_SUM, true), 2, &mut out);
        feed(&mut a, &contrib(3, 0, 0, &[3, 3, 3, 3], 4, OP_SUM, true), 3, &mut out);
        let ans = answers(&mut a);
        assert_eq!(ans.len(), 4, "a PENDING to the duplicate, then 3 RESULTs");
        // The duplicate is answered at once with who the chunk waits for.
        let (to, h, p) = &ans[0];
        assert_eq!((*to, h.msg_type, h.dst_mask, h.src_rank), (1, T_AGG_PENDING, 1 << 1, 0));
        assert_eq!(p, &0b1100u64.to_be_bytes().to_vec(), "PENDING names ranks 2 and 3");
        assert_eq!(i32s(&ans[1].2), vec![6; 4], "the duplicate was not added");
        assert_eq!((a.stats().dup, a.stats().pending), (1, 1));
        // Retransmission after completion: answered to rank 2 only.
        feed(&mut a, &contrib(2, 0, 0, &[2, 2, 2, 2], 4, OP_SUM, true), 2, &mut out);
        let ans = answers(&mut a);
        assert_eq!(ans.len(), 1);
        assert_eq!(ans[0].0, 2);
        assert_eq!(ans[0].1.dst_mask, 1 << 2);
        assert_eq!(i32s(&ans[0].2), vec![6; 4]);
        assert_eq!(a.stats().dup_done, 1);
        assert_eq!(a.stats().pkts, 3);
    }

    #[test]
    fn mismatch_is_dropped_and_reported() {
        let mut a = agg(8);
        let mut out = Out::default();
        feed(&mut a, &contrib(1, 0, 0, &[1, 1, 1, 1], 8, OP_SUM, false), 1, &mut out);
        // Rank 2 thinks the message has 12 elements, rank 3 uses MAX.
        feed(&mut a, &contrib(2, 0, 0, &[1, 1, 1, 1], 12, OP_SUM, false), 2, &mut out);
        feed(&mut a, &contrib(3, 0, 0, &[1, 1, 1, 1], 8, OP_MAX, false), 3, &mut out);
        assert_eq!(a.stats().mismatch, 2);
        assert!(out.done.is_empty());
        let ev = a.take_mismatches();
        assert_eq!(ev.iter().map(|e| e.rank).collect::<Vec<_>>(), vec![2, 3]);
        assert!(ev[0].detail.contains("48 bytes") && ev[0].detail.contains("32 bytes"), "{}", ev[0].detail);
        // The right contributions still complete the chunk correctly.
        feed(&mut a, &contrib(2, 0, 0, &[2, 2, 2, 2], 8, OP_SUM, false), 2, &mut out);
        feed(&mut a, &contrib(3, 0, 0, &[3, 3, 3, 3], 8, OP_SUM, false), 3, &mut out);
        assert_eq!(out.done.len(), 1);
        assert_eq!(out.done[0].2, vec![6; 4]);
    }

    /// An allreduce its members disagree on is aborted by the aggregator:
    /// one KCCL_T_AGG_ABORT (MISMATCH, naming the sender and both
    /// layouts) to every contributor of the chunk and to the sender, once
    /// per call; the call's slots are freed and queued for the kernel's.
    #[test]
    fn an_allreduce_mismatch_aborts_the_call_for_every_member() {
        let mut a = agg(8);
        let mut out = Out::default();
        feed(&mut a, &contrib(1, 8, 0, &[1; 4], 8, OP_SUM, true), 1, &mut out);
        assert!(answers(&mut a).is_empty());
        feed(&mut a, &contrib(2, 8, 0, &[1; 4], 12, OP_SUM, true), 2, &mut out);
        let sent = answers(&mut a);
        let mut to: Vec<u16> = sent.iter().map(|(r, _, _)| *r).collect();
        to.sort_unstable();
        assert_eq!(to, vec![1, 2, 3], "the chunk's contributors (mask 0b1110) and the sender");
        for (_, h, p) in &sent {
            assert_eq!((h.msg_type, h.src_rank, h.msg_seq, h.job_id), (T_AGG_ABORT, 0, 8, 5));
            let (reason, text) = abort::parse(p).expect("abort payload");
            assert_eq!(reason, AbortReason::Mismatch);
            assert!(text.contains("rank 2") && text.contains("48 bytes") && text.contains("32 bytes"), "{text}");
        }
        assert_eq!((a.stats().aborts_sent, a.stats().abort_freed), (1, 1));
        assert_eq!(a.take_aborted_calls(), vec![8]);
        // Once per call: later copies of it get the same abort back, to
        // their sender only, and take no slot.
        feed(&mut a, &contrib(3, 8, 0, &[1; 4], 12, OP_SUM, true), 3, &mut out);
        feed(&mut a, &contrib(1, 8, 0, &[1; 4], 8, OP_SUM, true), 1, &mut out);
        let again: Vec<u16> = answers(&mut a)
            .iter()
            .map(|(to, h, _)| (h.msg_type == T_AGG_ABORT).then_some(*to))
            .collect::<Option<_>>()
            .expect("aborts only");
        assert_eq!(again, vec![3, 1]);
        assert_eq!((a.stats().aborts_sent, a.stats().aborts_resent, a.stats().abort_freed), (1, 2, 1));
        // A reduce's mismatch is the root's to announce: no abort here.
        feed(&mut a, &contrib(1, 20, 0, &[1; 4], 8, OP_SUM, false), 1, &mut out);
        feed(&mut a, &contrib(2, 20, 0, &[1; 4], 12, OP_SUM, false), 2, &mut out);
        assert!(answers(&mut a).is_empty());
    }

    /// A member of another kccl version sends an op (or element type)
    /// this aggregator does not know: its allreduce fails for every member
    /// at once, naming the rank and the cause; a reduce's is the root's.
    #[test]
    fn an_unknown_op_aborts_the_call_for_every_member() {
        let mut a = agg(8);
        let mut out = Out::default();
        feed(&mut a, &contrib(1, 8, 0, &[1; 4], 4, OP_SUM, true), 1, &mut out);
        // Not from the sender's own address: counted, nothing aborted.
        let odd = contrib(2, 8, 0, &[1; 4], 4, 9, true);
        a.ingest(&odd.h, &odd.p, from(3), Instant::now(), &mut out);
        assert!(answers(&mut a).is_empty());
        assert_eq!((a.stats().unsupported, a.stats().not_member, a.stats().aborts_sent), (1, 1, 0));
        feed(&mut a, &odd, 2, &mut out);
        let sent = answers(&mut a);
        let mut to: Vec<u16> = sent.iter().map(|(r, _, _)| *r).collect();
        to.sort_unstable();
        assert_eq!(to, vec![1, 2, 3], "the call's contributors (mask 0b1110)");
        for (_, h, p) in &sent {
            assert_eq!((h.msg_type, h.src_rank, h.msg_seq), (T_AGG_ABORT, 0, 8));
            let (reason, text) = abort::parse(p).expect("abort payload");
            assert_eq!(reason, AbortReason::Unsupported);
            assert!(text.contains("rank 2 sent op 9") && text.contains("version"), "{text}");
        }
        assert_eq!((a.stats().aborts_sent, a.stats().abort_freed), (1, 1), "rank 1's slot freed");
        assert_eq!(a.take_aborted_calls(), vec![8]);
        assert_eq!(a.take_mismatches().len(), 1);
        // Its retransmission gets the same abort back, to it alone.
        feed(&mut a, &odd, 2, &mut out);
        let again = answers(&mut a);
        assert_eq!((again.len(), again[0].0, again[0].1.msg_type), (1, 2, T_AGG_ABORT));
        assert_eq!((a.stats().aborts_sent, a.stats().aborts_resent), (1, 1));
        // An unknown element type too.
        let mut bad_type = contrib(3, 12, 0, &[1; 4], 4, OP_SUM, true);
        bad_type.h.dtype = 0xee;
        feed(&mut a, &bad_type, 3, &mut out);
        let sent = answers(&mut a);
        assert_eq!(sent.len(), 3);
        assert!(abort::parse(&sent[0].2).expect("abort").1.contains("rank 3 sent op 1 dtype 238"));
        assert_eq!(a.take_mismatches().len(), 1);
        // A reduce: the root (the sink) is asked and names the mismatch.
        out.admit = Some(Admit::Mismatch("the root runs op 1".into()));
        feed(&mut a, &contrib(2, 20, 0, &[1; 4], 4, 9, false), 2, &mut out);
        assert!(answers(&mut a).is_empty(), "no abort from the aggregator for a reduce");
        let m = a.take_mismatches();
        assert_eq!((m.len(), m[0].rank, m[0].detail.as_str()), (1, 2, "the root runs op 1"));
        assert_eq!(a.stats().unsupported, 5);
    }

    /// A local root learns of a mismatch whether the bad packet comes
    /// first (no slot yet) or after good ones (slot active).
    #[test]
    fn the_owner_sees_mismatches_in_either_order() {
        for bad_first in [true, false] {
            let mut a = agg(8);
            let mut out = Out { expect_len: Some(16), ..Out::default() };
            let good = contrib(1, 0, 0, &[1; 4], 4, OP_SUM, false);
            let bad = contrib(2, 0, 0, &[1; 4], 8, OP_SUM, false);
            let order = if bad_first { [(&bad, 2), (&good, 1)] } else { [(&good, 1), (&bad, 2)] };
            for (p, r) in order {
                feed(&mut a, p, r, &mut out);
            }
            let ev = a.take_mismatches();
            assert_eq!(a.stats().mismatch, 1, "bad first: {bad_first}");
            assert_eq!((ev.len(), ev[0].rank), (1, 2));
            assert!(ev[0].detail.contains("root expects 16"), "{}", ev[0].detail);
        }
    }

    #[test]
    fn outsiders_and_malformed_are_counted() {
        let mut a = agg(8);
        let mut out = Out::default();
        // Rank 4 is a member but not in the mask 0b1110.
        let mut p = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, false);
        p.h.src_rank = 4;
        feed(&mut a, &p, 4, &mut out);
        assert_eq!(a.stats().not_contrib, 1);
        // Rank 1's packet from rank 2's address.
        let p = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, false);
        feed(&mut a, &p, 2, &mut out);
        // Rank 100 does not exist.
        let mut p = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, false);
        p.h.src_rank = 65;
        p.h.mask_base = 64;
        p.h.dst_mask = 2;
        a.ingest(&p.h, &p.p, from(1), Instant::now(), &mut out);
        assert_eq!(a.stats().not_member, 2);
        // Another job.
        let mut p = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, false);
        p.h.job_id = 6;
        feed(&mut a, &p, 1, &mut out);
        assert_eq!(a.stats().other_job, 1);
        // The aggregator's own rank in the contributor mask.
        let mut p = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, false);
        p.h.dst_mask |= 1;
        feed(&mut a, &p, 1, &mut out);
        assert_eq!(a.stats().malformed, 1);
        // Unknown op.
        let mut p = contrib(1, 0, 0, &[1, 1, 1, 1], 4, OP_SUM, false);
        p.h.agg_op = 42;
        feed(&mut a, &p, 1, &mut out);
        assert_eq!(a.stats().unsupported, 1);
        assert_eq!(a.stats().pkts, 0);
        assert!(out.done.is_empty());
    }

    #[test]
    fn busy_slot_then_reclaim_after_timeout() {
        let mut a = agg(2); // two slots: op 0 chunk c and op 0 chunk c+2 collide
        let mut out = Out::default();
        let t0 = Instant::now();
        // 12 elements = 3 chunks; chunk 0 and chunk 2 share a slot.
        feed_at(&mut a, &contrib(1, 0, 0, &[1; 4], 12, OP_SUM, false), 1, &mut out, t0);
        feed_at(&mut a, &contrib(1, 0, 2, &[1; 4], 12, OP_SUM, false), 1, &mut out, t0);
        assert_eq!(a.stats().busy, 1, "a live chunk keeps its slot");
        let later = t0 + Duration::from_millis(150);
        feed_at(&mut a, &contrib(1, 0, 2, &[1; 4], 12, OP_SUM, false), 1, &mut out, later);
        assert_eq!(a.stats().reclaimed, 1, "an abandoned chunk loses its slot after the timeout");
        for r in [2u16, 3] {
            feed_at(&mut a, &contrib(r, 0, 2, &[r as i32; 4], 12, OP_SUM, false), r, &mut out, later);
        }
        assert_eq!(out.done.len(), 1);
        assert_eq!((out.done[0].1, out.done[0].2.clone()), (32, vec![6; 4]));
    }

    #[test]
    fn done_slots_are_reused_and_retired_answers_still_served() {
        let mut a = agg(2);
        let mut out = Out::default();
        // Op 0 has 3 chunks over 2 slots: chunk 2 reuses chunk 0's DONE slot.
        for c in 0..3 {
            for r in [1u16, 2, 3] {
                feed(&mut a, &contrib(r, 0, c, &[c as i32; 4], 12, OP_SUM, true), r, &mut out);
            }
        }
        let ans = answers(&mut a);
        assert_eq!(ans.len(), 9);
        assert_eq!(a.stats().chunks_done, 3);
        assert_eq!(a.stats().busy, 0);
        // Rank 3 lost chunk 0's result and retransmits: served from the
        // retired ring, to rank 3 only.
        feed(&mut a, &contrib(3, 0, 0, &[0; 4], 12, OP_SUM, true), 3, &mut out);
        let ans = answers(&mut a);
        assert_eq!(ans.len(), 1);
        assert_eq!((ans[0].0, ans[0].1.frag_off, ans[0].1.dst_mask), (3, 0, 1 << 3));
        assert_eq!(a.stats().dup_done, 1);
    }

    #[test]
    fn receipts_only_raise_and_need_the_member_address() {
        let mut a = agg(8);
        let receipt = |rank: u16, op: u32, frag_off: u32| {
            let mut h = contrib(rank, op, 0, &[1; 4], 12, OP_SUM, false).h;
            h.msg_type = crate::wire::T_AGG_RECEIPT;
            h.frag_off = frag_off;
            h.payload_len = 0;
            h
        };
        a.take_receipt(&receipt(2, 7, 48), from(2));
        assert_eq!(a.receipt_of(2), Some((7, 3)), "48 bytes of 16-byte chunks: every chunk below 3");
        assert!(ack_covers(a.receipt_of(2), 7, 3) && !ack_covers(a.receipt_of(2), 7, 4));
        assert!(ack_covers(a.receipt_of(2), 6, 100), "a later operation covers earlier ones");
        // An older operation's late receipt does not lower it.
        a.take_receipt(&receipt(2, 6, 16), from(2));
        assert_eq!(a.receipt_of(2), Some((7, 3)));
        // Across the op-id wrap: u32::MAX is before 0.
        a.take_receipt(&receipt(3, u32::MAX, 48), from(3));
        a.take_receipt(&receipt(3, 0, 16), from(3));
        assert_eq!(a.receipt_of(3), Some((0, 1)));
        // Forged: rank 4's receipt from rank 5's address.
        let before = a.stats();
        a.take_receipt(&receipt(4, 9, 48), from(5));
        assert_eq!((a.receipt_of(4), a.stats().not_member - before.not_member), (None, 1));
        assert_eq!(a.stats().receipts, 4);
    }

    #[test]
    fn sync_answers_the_call_after_the_latest_finished_operation() {
        let mut a = agg(8);
        let mut q = contrib(1, 0, 0, &[1; 4], 12, OP_SUM, false).h;
        q.msg_type = T_AGG_SYNC;
        q.payload_len = 0;
        let call_of = |a: &mut UserAggregator| -> Vec<(u16, u32)> {
            answers(a)
                .into_iter()
                .filter(|(_, h, _)| h.msg_type == T_AGG_SYNC_ACK)
                .map(|(to, h, _)| (to, h.msg_seq / 4))
                .collect()
        };
        a.answer_sync(&q, from(1), a.next_call_hint());
        assert_eq!(call_of(&mut a), [(1, 0)], "nothing finished yet: call 0");
        // Rank 2 finished op 9 (call 2, all 48 bytes); rank 3 only part of op 13.
        let mut r = q;
        r.msg_type = T_AGG_RECEIPT;
        (r.src_rank, r.msg_seq, r.frag_off, r.msg_len) = (2, 9, 48, 48);
        a.take_receipt(&r, from(2));
        (r.src_rank, r.msg_seq, r.frag_off, r.msg_len) = (3, 13, 16, 48);
        a.take_receipt(&r, from(3));
        a.answer_sync(&q, from(1), a.next_call_hint());
        assert_eq!(call_of(&mut a), [(1, 3)], "the call after op 9");
        // A SYNC from another address than the rank's: counted, unanswered.
        let before = a.stats().not_member;
        a.answer_sync(&q, from(4), a.next_call_hint());
        assert_eq!((call_of(&mut a), a.stats().not_member - before), (vec![], 1));
    }

    /// A member that starts after its first call was aborted is told to
    /// start at that call (not the next: the others wait for it there) and
    /// its contribution to the aborted call is answered with the abort,
    /// for a mismatch this aggregator found and for a member's abort.
    #[test]
    fn late_members_meet_the_abort_of_their_first_call() {
        let mut a = agg(8);
        let mut out = Out::default();
        // Call 2 (ops 8-11): ranks 1 and 2 disagree; the aggregator aborts it.
        feed(&mut a, &contrib(1, 9, 0, &[1; 4], 8, OP_SUM, true), 1, &mut out);
        feed(&mut a, &contrib(2, 9, 0, &[1; 4], 12, OP_SUM, true), 2, &mut out);
        assert_eq!(answers(&mut a).len(), 3, "the abort to ranks 1, 2 and 3");
        // They failed the call and said so (receipts of op 9).
        let mut r = contrib(1, 9, 0, &[1; 4], 8, OP_SUM, true).h;
        r.msg_type = T_AGG_RECEIPT;
        r.payload_len = 0;
        (r.frag_off, r.msg_len) = (32, 32);
        a.take_receipt(&r, from(1));
        assert_eq!(a.next_call_hint(), 2, "the aborted call itself");
        // Rank 3 starts late and contributes to call 2: the abort, to it only.
        feed(&mut a, &contrib(3, 9, 0, &[1; 4], 8, OP_SUM, true), 3, &mut out);
        let sent = answers(&mut a);
        assert_eq!(sent.len(), 1);
        assert_eq!((sent[0].0, sent[0].1.msg_type, sent[0].1.msg_seq), (3, T_AGG_ABORT, 8));
        assert_eq!(a.stats().aborts_resent, 1);
        // A member's abort (rank 1: NaN in call 4) is passed on the same way,
        // from this aggregator, naming the rank.
        let d = abort::datagram(5, 1, 0, 0b1110, 16, AbortReason::NonFinite, "element 3 is NaN");
        let (h, p) = Header::decode(&d).expect("abort decodes");
        a.take_abort(&h, p, from(1));
        feed(&mut a, &contrib(2, 17, 0, &[1; 4], 8, OP_SUM, true), 2, &mut out);
        let sent = answers(&mut a);
        assert_eq!(sent.len(), 1);
        assert_eq!((sent[0].0, sent[0].1.src_rank, sent[0].1.msg_seq), (2, 0, 16));
        let (reason, text) = abort::parse(&sent[0].2).expect("payload");
        assert_eq!((reason, text.as_str()), (AbortReason::NonFinite, "rank 1: element 3 is NaN"));
        // Calls that were not aborted: the next call, as before.
        r.msg_seq = 21;
        a.take_receipt(&r, from(1));
        assert_eq!(a.next_call_hint(), 6);
    }

    #[test]
    fn stale_packets_of_finished_ops_take_no_slot() {
        let mut a = agg(2);
        let mut out = Out::default();
        // Op 0 (3 chunks) finishes; its chunk-0 answer gets recycled twice
        // over by op 1, then a late chunk-0 packet of op 0 arrives.
        for (op, chunks) in [(0u32, 3usize), (1, 3), (2, 3)] {
            for c in 0..chunks {
                for r in [1u16, 2, 3] {
                    feed(&mut a, &contrib(r, op, c, &[1; 4], 12, OP_SUM, false), r, &mut out);
                }
            }
        }
        assert_eq!(out.done.len(), 9);
        let before = a.stats();
        feed(&mut a, &contrib(1, 0, 0, &[1; 4], 12, OP_SUM, false), 1, &mut out);
        let s = a.stats();
        assert_eq!((s.stale - before.stale, s.pkts - before.pkts), (1, 0));
    }

    #[test]
    fn admission_controls_reduce_contributions() {
        let mut a = agg(8);
        let p = contrib(1, 0, 0, &[1; 4], 4, OP_SUM, false);
        let mut out = Out { admit: Some(Admit::Early), ..Out::default() };
        a.ingest(&p.h, &p.p, from(1), Instant::now(), &mut out);
        out.admit = Some(Admit::Mismatch("x".into()));
        a.ingest(&p.h, &p.p, from(1), Instant::now(), &mut out);
        assert_eq!((a.stats().early, a.stats().mismatch, a.stats().pkts), (1, 1, 0));
    }

    #[test]
    fn f32q_is_int32_on_the_wire() {
        let mut a = agg(8);
        let mut out = Out::default();
        for r in [1u16, 2, 3] {
            let mut p = contrib(r, 0, 0, &[1 << 29, -(1 << 29), 5, 0], 4, OP_SUM, false);
            p.h.dtype = DT_F32Q;
            feed(&mut a, &p, r, &mut out);
        }
        assert_eq!(out.done[0].2, vec![3 << 29, -(3 << 29), 15, 0], "reduce keeps int64: no saturation");
        assert!(!out.done[0].3);
    }

    /// The accumulate loops run at memory speed (ignored: timing only).
    /// `cargo test --release -p kccl --lib combine_throughput -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn combine_throughput() {
        let p: Vec<u8> = (0..358i32).flat_map(|v| v.to_be_bytes()).collect();
        let mut acc = vec![0i64; 358];
        let n = 2_000_000;
        let t = Instant::now();
        for i in 0..n {
            combine(&mut acc, &p, DT_I32, OP_SUM, i == 0);
        }
        let dt = t.elapsed();
        println!(
            "combine int32 SUM: {:.1} ns per 1432-byte chunk, {:.2} GB/s (acc[1]={})",
            dt.as_nanos() as f64 / n as f64,
            n as f64 * 1432.0 / dt.as_secs_f64() / 1e9,
            acc[1]
        );
    }
}
