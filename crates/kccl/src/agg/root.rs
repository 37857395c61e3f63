//! The reduce root: collects every contributor's chunks (from the kernel's
//! records or the user-space aggregator), stashes those of later calls, folds
//! its own data in, and settles the receipts of its last reduce.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::wire::{Header, DT_F32Q, DT_I32, DT_I64, F_ALLREDUCE, OP_MAX};

use super::abort::{Peers, Received};
use super::codec::{Dst, FinEnc, Finish, OutOfRange, Src};
use super::config::CollectiveStats;
use super::dispatch::pump;
use super::op::{AggOp, DType, Element, Quant};
use super::user::{Admit, AggSink};
use super::{check_len, chunk_list, codec, packet, quant, Collective};
use crate::kernel_agg::{AggRecord, AggRecordView};
use crate::transport::Path;

/// Reduce chunks that completed before the local root reached their call.
///
/// On the user path the root admits only contributions of the next two
/// calls, and only while the stash has room ([`Admit::Early`] otherwise), so
/// contributors wait for a slow root.  On the kernel path nothing waits for
/// the root: xdp_agg completes and ACKs chunks on its own, so the
/// contributors can finish any number of calls before the root reads their
/// records.  The stash therefore keeps every record of a later call, and
/// the root reads no more records than the stash can hold
/// ([`AggSink::room`]): the rest wait in the ring buffer, which xdp_agg
/// fills in call order (a contributor starts call k + 1 only after every
/// chunk of call k was ACKed, i.e. recorded), and when the ring is full the
/// kernel stops ACKing, so the contributors wait after all.
#[derive(Default)]
pub(super) struct Stash {
    chunks: Vec<Stashed>,
}

/// Whether op id `op_id` belongs to call `call` or a later one (call `k`
/// uses op ids 4k..4k+3; serial-number arithmetic: the 2^31 op ids from
/// `4 * call` on are "now or later", the others past).
pub(super) fn call_or_later(op_id: u32, call: u32) -> bool {
    op_id.wrapping_sub(call.wrapping_mul(4)) < 1 << 31
}

impl Stash {
    /// At the start of call `call` (whose data op id is `op_id`): removes
    /// and returns the chunks of `op_id`, forgets those of earlier calls
    /// and keeps those of later ones.
    pub(super) fn take_call(&mut self, call: u32, op_id: u32) -> Vec<Stashed> {
        let (mut now, mut keep) = (Vec::new(), Vec::new());
        for c in std::mem::take(&mut self.chunks) {
            if c.rec.op_id == op_id {
                now.push(c);
            } else if call_or_later(c.rec.op_id, call.wrapping_add(1)) {
                keep.push(c);
            }
        }
        self.chunks = keep;
        now
    }
}

/// A completed chunk of a later call, kept until the root gets there.
pub(super) struct Stashed {
    rec: AggRecord,
    values: Vec<i64>,
}

impl Stashed {
    pub(super) fn view(&self) -> AggRecordView<'_> {
        AggRecordView::new(self.rec, &self.values)
    }
}

/// What the root expects of one of its operations' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Expect {
    op_id: u32,
    allreduce: bool,
    agg_op: u8,
    dtype: u8,
    msg_len: u32,
    mask_base: u16,
    mask: u64,
}

impl Expect {
    pub(super) fn check(&self, h: &Header) -> std::result::Result<(), String> {
        let got = (h.flags & F_ALLREDUCE != 0, h.agg_op, h.dtype, h.msg_len, h.mask_base, h.dst_mask);
        let want = (self.allreduce, self.agg_op, self.dtype, self.msg_len, self.mask_base, self.mask);
        if got == want {
            return Ok(());
        }
        Err(format!(
            "sent {} bytes of dtype {} op {} for contributors {:#x} ({}), the root expects {} bytes of dtype {} op {} \
             for contributors {:#x} ({})",
            h.msg_len,
            h.dtype,
            h.agg_op,
            h.dst_mask,
            if got.0 { "allreduce" } else { "reduce" },
            self.msg_len,
            self.dtype,
            self.agg_op,
            self.mask,
            if self.allreduce { "allreduce" } else { "reduce" }
        ))
    }
}

/// The root's state of one reduce: where finished chunks go.
pub(super) struct RootState<'a> {
    what: String,
    main: Expect,
    pre: Option<Expect>,
    chunk: usize,
    /// Wire elements before the data (agreed exponents of float32 SUM/AVG).
    prefix: usize,
    es: usize,
    contributors: usize,
    agg_op: u8,
    fin: FinKind,
    count: usize,
    own: Option<Src<'a>>,
    out: Dst<'a>,
    done: Vec<u64>,
    ndone: usize,
    nchunks: usize,
    last_progress: Instant,
    exps: Vec<i64>,
    exps_got: usize,
    scales: Vec<f64>,
    block: usize,
    pending: Vec<(usize, Vec<i64>)>,
    error: Option<Error>,
    /// The call's contributors: whom an abort of the call may come from.
    peers: Peers,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FinKind {
    Int,
    /// Quantized: `scales` per `block` data elements (fixed scale: one
    /// block; automatic: from the exponent prefix).
    F32Q,
    F32Ord,
    F32NonZero,
}

impl RootState<'_> {
    pub(super) fn on_chunk(&mut self, d: &AggRecordView<'_>) {
        if self.error.is_some() {
            return;
        }
        let e = self.main;
        if d.msg_len != e.msg_len || d.dtype != e.dtype || d.agg_op != e.agg_op || d.contributors != e.mask {
            self.error = Some(Error::Mismatch {
                what: self.what.clone(),
                rank: e.mask_base + d.contributors.trailing_zeros() as u16,
                detail: format!(
                    "(one of contributors {:#x}) made chunk {} of {} bytes dtype {} op {}, the root expects {} bytes \
                     dtype {} op {} from contributors {:#x}",
                    d.contributors, d.frag_off, d.msg_len, d.dtype, d.agg_op, e.msg_len, e.dtype, e.agg_op, e.mask
                ),
            });
            return;
        }
        let c = d.frag_off as usize / self.chunk;
        if c >= self.nchunks || self.done[c / 64] & (1 << (c % 64)) != 0 {
            return;
        }
        self.done[c / 64] |= 1 << (c % 64);
        self.ndone += 1;
        self.last_progress = Instant::now();
        if d.overflow {
            self.error = Some(Error::Overflow {
                what: self.what.clone(),
                detail: format!(
                    "an int64 sum of chunk {c} (elements from {}) overflowed; the result does not fit i64",
                    c * self.chunk / self.es
                ),
            });
            return;
        }
        let first = c * self.chunk / self.es;
        let vals = d.values();
        // Prefix part (agreed exponents, each summed over the contributors).
        let mut data_first = first;
        let mut data_vals = vals;
        if first < self.prefix {
            let k = (self.prefix - first).min(vals.len());
            self.exps[first..first + k].copy_from_slice(&vals[..k]);
            self.exps_got += k;
            data_first = self.prefix;
            data_vals = &vals[k..];
            if self.exps_got == self.prefix && self.prefix > 0 {
                self.exponents_ready();
            }
        }
        if data_vals.is_empty() {
            return;
        }
        if self.exps_got < self.prefix {
            self.pending.push((data_first, data_vals.to_vec()));
            return;
        }
        self.apply(data_first - self.prefix, data_vals);
    }

    pub(super) fn exponents_ready(&mut self) {
        let n = self.contributors.max(1) as i64;
        self.scales.clear();
        for (b, &sum) in self.exps.iter().enumerate() {
            if sum % n != 0 {
                self.error = Some(Error::Mismatch {
                    what: self.what.clone(),
                    rank: self.main.mask_base + self.main.mask.trailing_zeros() as u16,
                    detail: format!(
                        "(one of the contributors) sent a different agreed exponent for block {b} (sum {sum} over {n} \
                         contributors)"
                    ),
                });
                return;
            }
            self.scales.push(quant::auto_scale((sum / n) as i32, 0));
        }
        for (first, vals) in std::mem::take(&mut self.pending) {
            self.apply(first - self.prefix, &vals);
        }
    }

    pub(super) fn apply(&mut self, data_first: usize, vals: &[i64]) {
        let enc = match self.fin {
            FinKind::Int => FinEnc::Int,
            FinKind::F32Q => FinEnc::F32Q { scales: &self.scales, block: self.block },
            FinKind::F32Ord => FinEnc::F32Ord,
            FinKind::F32NonZero => FinEnc::F32NonZero,
        };
        let f = Finish { agg_op: self.agg_op, enc, count: self.count };
        if let Err(OutOfRange { index, value }) = f.apply(vals, data_first, self.own, &mut self.out) {
            self.error = Some(Error::Overflow {
                what: self.what.clone(),
                detail: format!("element {index} is {value}, outside the output type; use a wider element type"),
            });
        }
    }

    pub(super) fn complete(&self) -> bool {
        self.ndone == self.nchunks
    }

    pub(super) fn missing(&self) -> Vec<usize> {
        (0..self.nchunks).filter(|&c| self.done[c / 64] & (1 << (c % 64)) == 0).collect()
    }
}

/// The sink of a pump: admission and delivery for the local root.
pub(super) struct RootSink<'s, 'a> {
    stash: &'s mut Stash,
    /// Call number of the current call.
    call: u32,
    cap: usize,
    state: Option<&'s mut RootState<'a>>,
    stashed: u64,
    stale: u64,
}

impl<'s, 'a> RootSink<'s, 'a> {
    /// A sink for call `call`: with `state`, the chunks of that reduce are
    /// delivered to it; records of later calls are stashed either way.
    pub(super) fn new(stash: &'s mut Stash, call: u32, cap: usize, state: Option<&'s mut RootState<'a>>) -> Self {
        RootSink { stash, call, cap, state, stashed: 0, stale: 0 }
    }

    /// Adds what this sink stashed and dropped as stale to the counters.
    pub(super) fn count_into(&self, stats: &mut CollectiveStats) {
        stats.stashed += self.stashed;
        stats.stale_chunks += self.stale;
    }
}

impl AggSink for RootSink<'_, '_> {
    fn abort(&mut self, h: &Header, payload: &[u8], from: std::net::SocketAddrV4) {
        if let Some(st) = self.state.as_deref_mut() {
            if let Received::Abort(a) = st.peers.receive(h, payload, from) {
                st.error.get_or_insert_with(|| a.error(&st.what));
            }
        }
    }

    fn admit(&mut self, h: &Header) -> Admit {
        if let Some(st) = self.state.as_deref_mut() {
            let which =
                if h.msg_seq == st.main.op_id { Some(st.main) } else { st.pre.filter(|p| p.op_id == h.msg_seq) };
            if let Some(e) = which {
                return match e.check(h) {
                    Ok(()) => Admit::Yes,
                    Err(detail) => {
                        if st.error.is_none() {
                            st.error = Some(Error::Mismatch {
                                what: st.what.clone(),
                                rank: h.src_rank,
                                detail: detail.clone(),
                            });
                        }
                        Admit::Mismatch(detail)
                    }
                };
            }
        }
        // An allreduce through this member (the pre-pass of a reduce to it):
        // its results go out as packets, nothing to keep.
        if h.flags & F_ALLREDUCE != 0 {
            return Admit::Yes;
        }
        // A reduce to this member of one of the next calls: take it while
        // the stash has room (bounded memory), else the sender retransmits.
        let ahead = h.msg_seq.wrapping_sub(self.call.wrapping_add(1).wrapping_mul(4));
        if ahead < 8 && self.stash.chunks.len() < self.cap {
            Admit::Yes
        } else {
            Admit::Early
        }
    }

    fn deliver(&mut self, d: &AggRecordView<'_>) {
        if let Some(st) = self.state.as_deref_mut() {
            if d.op_id == st.main.op_id {
                st.on_chunk(d);
                return;
            }
        }
        // Any later call, however far ahead: on the kernel path this record
        // is the only copy of the chunk (its contributors were ACKed and
        // moved on), so dropping it would lose the chunk for good.  room()
        // bounds how many are read.
        if !call_or_later(d.op_id, self.call.wrapping_add(1)) {
            self.stale += 1;
            return;
        }
        self.stashed += 1;
        self.stash.chunks.push(Stashed { rec: d.rec, values: d.values().to_vec() });
    }

    fn room(&self) -> usize {
        self.cap.saturating_sub(self.stash.chunks.len())
    }
}

/// An operation this member combined (a reduce at this root, its shard of
/// a sharded allreduce): (op id, chunks, contributors).
#[derive(Debug, Clone, Copy)]
pub(super) struct RootDone {
    pub(super) op_id: u32,
    pub(super) nchunks: u32,
    pub(super) base: u16,
    pub(super) mask: u64,
}

impl Collective {
    /// The root of a reduce: serves the aggregation (user space) or reads
    /// the kernel's records until every chunk of the operation is in, and
    /// folds `own` in.
    pub(super) fn root_collect<T: Element>(&mut self, len: usize, op: AggOp, own: Option<&[T]>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        self.root_collect_into(op, own, &mut out)?;
        Ok(out)
    }

    /// root_collect into the caller's buffer (`out.len()` elements; on an
    /// error its contents are unspecified).  A reused buffer saves the page
    /// faults of a fresh one: 64 MiB of result is 16,384 of them, about 8%
    /// of the machine's CPU in a 64 MiB reduce.
    pub(super) fn root_collect_into<T: Element>(&mut self, op: AggOp, own: Option<&[T]>, out: &mut [T]) -> Result<()> {
        let len = out.len();
        let call = self.next_call();
        let me = self.me.rank;
        let what = format!("reduce call {call} at root {me} ({} {op}, {len} elements)", T::NAME);
        if self.group.aggregator == Some(me) {
            return Err(Error::Usage(format!("{what}: rank {me} is the allreduce aggregator")));
        }
        let set = self.reduce_contributors(&what, me)?;
        if len == 0 {
            return Ok(());
        }
        let own_src = own.map(T::src);
        if let Some(Src::F32(f)) = own_src {
            if let Some(index) = quant::first_non_finite(f) {
                return Err(self.announce(call, set, me, Error::NonFinite { index }));
            }
        }
        let block_elems = self.chunk / 4;
        // Encoding of the contributors' messages (what codec::Enc makes).
        let (fin, dtype, prefix, scales, block) = match (T::DTYPE, op, self.cfg.quant) {
            (DType::I32, _, _) => (FinKind::Int, DT_I32, 0, vec![], 1),
            (DType::I64, _, _) => (FinKind::Int, DT_I64, 0, vec![], 1),
            (DType::F32Q, AggOp::Max | AggOp::Min, _) => (FinKind::F32Ord, DT_I32, 0, vec![], 1),
            (DType::F32Q, AggOp::Count, _) => (FinKind::F32NonZero, DT_I32, 0, vec![], 1),
            (DType::F32Q, _, Quant::Auto) => (FinKind::F32Q, DT_F32Q, len.div_ceil(block_elems), vec![], block_elems),
            (DType::F32Q, _, Quant::Fixed(s)) => {
                if !(s.is_finite() && s > 0.0) {
                    return Err(Error::Usage(format!("{what}: quantization scale {s} must be finite and positive")));
                }
                (FinKind::F32Q, DT_F32Q, 0, vec![s], len)
            }
        };
        let count = set.count + usize::from(own.is_some());
        if set.count == 0 {
            let Some(o) = own_src else {
                return Err(Error::Usage(format!("{what}: no other member contributes to a reduce at rank {me}")));
            };
            let one = [1.0];
            let enc = match fin {
                FinKind::Int => FinEnc::Int,
                FinKind::F32Q => FinEnc::F32Q { scales: &one, block: usize::MAX },
                FinKind::F32Ord => FinEnc::F32Ord,
                FinKind::F32NonZero => FinEnc::F32NonZero,
            };
            let f = Finish { agg_op: op.wire(), enc, count };
            codec::own_only(&f, o, &mut T::dst(out)).map_err(|OutOfRange { index, value }| Error::Overflow {
                what: what.clone(),
                detail: format!("element {index} is {value}, outside the output type"),
            })?;
            return Ok(());
        }
        check_len::<T>(&what, len, prefix)?;
        let es = if dtype == DT_I64 { 8 } else { 4 };
        let msg_len = (prefix + len) * es;
        let main = Expect {
            op_id: call * 4 + 1,
            allreduce: false,
            agg_op: op.wire(),
            dtype,
            msg_len: msg_len as u32,
            mask_base: set.base,
            mask: set.mask,
        };
        let pre = (prefix > 0).then_some(Expect {
            op_id: call * 4,
            allreduce: true,
            agg_op: OP_MAX,
            dtype: DT_I32,
            msg_len: (prefix * 4) as u32,
            mask_base: set.base,
            mask: set.mask,
        });
        let nchunks = packet::chunk_count(msg_len, self.chunk);
        let mut st = RootState {
            what: what.clone(),
            main,
            pre,
            chunk: self.chunk,
            prefix,
            es,
            contributors: set.count,
            agg_op: op.wire(),
            fin,
            count,
            own: own_src,
            out: T::dst(out),
            done: vec![0u64; nchunks.div_ceil(64)],
            ndone: 0,
            nchunks,
            last_progress: Instant::now(),
            exps: vec![0i64; prefix],
            exps_got: 0,
            scales,
            block,
            pending: Vec::new(),
            error: None,
            peers: Peers::of(&self.group, main.op_id, set.base, set.mask, self.me.rank, self.me.rank),
        };
        // Chunks that completed before this call; forget older ones.
        let early = self.stash.take_call(call, main.op_id);
        for c in &early {
            st.on_chunk(&c.view());
        }
        loop {
            if let Some(e) = st.error.take() {
                return Err(self.announce(call, set, me, e));
            }
            if st.complete() {
                break;
            }
            let since = st.last_progress.elapsed();
            if since >= self.cfg.deadline {
                return Err(self.root_timeout(&st, since));
            }
            let wait = (self.cfg.deadline - since).min(Duration::from_millis(50));
            let mut sink = RootSink::new(&mut self.stash, call, self.cfg.nslots, Some(&mut st));
            let r = pump(&self.sock, &mut self.rb, &mut self.backend, &mut self.stats, wait, true, None, &mut sink);
            sink.count_into(&mut self.stats);
            r?;
        }
        self.stats.root_chunks += nchunks as u64;
        drop(st);
        self.last_served =
            Some(RootDone { op_id: main.op_id, nchunks: nchunks as u32, base: set.base, mask: set.mask });
        Ok(())
    }

    pub(super) fn root_timeout(&self, st: &RootState<'_>, since: Duration) -> Error {
        let missing = st.missing();
        let mut why = String::new();
        if let Some(&c) = missing.first() {
            let off = (c * self.chunk) as u32;
            match self
                .backend
                .user()
                .missing(st.main.op_id, off)
                .or_else(|| self.backend.kernel_missing(st.main.op_id, off))
            {
                Some((base, m)) => {
                    let ranks: Vec<String> =
                        (0..64).filter(|b| m & (1u64 << b) != 0).map(|b| (base as usize + b).to_string()).collect();
                    why = format!("; chunk {c} still waits for ranks {}", ranks.join(", "));
                }
                None if self.backend.path() == Path::User => {
                    why = format!("; no contribution to chunk {c} arrived");
                }
                None => {}
            }
            if st.prefix > 0 && st.exps_got < st.prefix {
                why += "; the exponent prefix is incomplete";
            }
            if self.backend.path() == Path::Kernel && self.stash.chunks.len() >= self.cfg.nslots {
                why += &format!(
                    "; the stash is full ({} chunks of later calls; more records wait in the ring buffer)",
                    self.stash.chunks.len()
                );
            }
        }
        Error::Timeout {
            ms: since.as_millis() as u64,
            what: format!(
                "{}: no chunk completed for {} ms; {} of {} chunks missing (chunks {}){why}. Check that every \
                 contributor runs this reduce with the same length, op and type",
                st.what,
                since.as_millis(),
                missing.len(),
                st.nchunks,
                chunk_list(&missing)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::OP_SUM;

    /// Regression: on the kernel path the root's kernel ACKs every chunk
    /// itself, so contributors can finish any number of calls before the
    /// root reads their ring buffer records.  The root used to keep only
    /// records of the next two calls and dropped the others, which were then
    /// lost for good (the root timed out on that call).  Records of every
    /// later call are kept; those of past calls are dropped; room() bounds
    /// how many are read off the ring.
    #[test]
    fn root_keeps_records_of_every_later_call() {
        let vals = [7i64, -3];
        let rec = |op_id: u32| {
            let r = AggRecord {
                op_id,
                msg_len: 16,
                payload_len: 16,
                agg_op: OP_SUM,
                dtype: DT_I64,
                contributors: 0b11,
                ..AggRecord::default()
            };
            AggRecordView::new(r, &vals)
        };
        let mut stash = Stash::default();
        let mut sink = RootSink { stash: &mut stash, call: 5, cap: 8, state: None, stashed: 0, stale: 0 };
        assert_eq!(sink.room(), 8);
        // Calls 6 and 7 (what used to be kept), then 8, 9 and 30.
        for call in [6u32, 7, 8, 9, 30] {
            sink.deliver(&rec(call * 4 + 1));
        }
        assert_eq!(sink.room(), 3, "5 of 8 stash places used");
        // Calls 5 (the current one: no state, so a contributor call) and 2.
        for call in [5u32, 2] {
            sink.deliver(&rec(call * 4 + 1));
        }
        assert_eq!((sink.stashed, sink.stale), (5, 2));
        // The root reaches call 9: its chunk comes out of the stash, call
        // 30's stays, calls 6..=8 are past (that root skipped them).
        let got = stash.take_call(9, 37);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].rec.op_id, got[0].values.as_slice()), (37, &vals[..]));
        assert_eq!(stash.chunks.iter().map(|c| c.rec.op_id).collect::<Vec<_>>(), [121]);
        // Op ids wrap: call 2^30 - 1 uses op ids from 2^32 - 4, the next
        // call from 0.
        let last = (1u32 << 30) - 1;
        assert!(call_or_later(1, last.wrapping_add(1)) && call_or_later(1, last));
        assert!(!call_or_later(last.wrapping_mul(4) + 1, 0));
        let mut sink = RootSink { stash: &mut stash, call: last, cap: 8, state: None, stashed: 0, stale: 0 };
        sink.deliver(&rec(1));
        assert_eq!((sink.stashed, sink.stale), (1, 0));
    }
}
