//! The contributor side of a reduce: a vector becomes chunk specs and
//! encodings, goes out under the AIMD window, and every chunk waits for its
//! ACK (or its RESULT, for allreduce).

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use crate::bcast::Path;
use crate::error::{Error, Result};

use super::abort::{self, Peers};
use super::allreduce::finish_of;
use super::backend::OwnXdp;
use super::codec::{Dst, Enc, Src};
use super::config::SendReport;
use super::dispatch::{pump, Decode};
use super::member::{check_deadlines, ContribStats, Contributor, Cwnd, Spec};
use super::op::{AggOp, Element, Quant};
use super::root::RootSink;
use super::{check_len, quant, Collective, Contributors};

/// Receive batches a contributor reads without waiting after the one it
/// waited for, before its timers look at what is unanswered.
const DRAIN_BATCHES: usize = 8;

impl Collective {
    /// The paper's building block of reduce, contributor side: sends `data`
    /// for the reduce to rank `to` and waits until every chunk is
    /// acknowledged.
    pub fn send_aggregated_data<T: Element>(&mut self, data: &[T], op: AggOp, to: u16) -> Result<SendReport> {
        let call = self.next_call();
        let what = format!("reduce call {call} to rank {to} ({} {op}, {} elements)", T::NAME, data.len());
        let to_addr = self.addr_of(to)?;
        if to == self.me.rank {
            return Err(Error::Usage(format!("{what}: rank {to} is this member; use get_aggregated_data or reduce")));
        }
        if self.group.aggregator == Some(to) {
            return Err(Error::Usage(format!(
                "{what}: rank {to} is the group's allreduce aggregator, which has no reduce root; reduce to a member"
            )));
        }
        let set = self.reduce_contributors(&what, to)?;
        let mut report =
            SendReport { op_id: call * 4 + 1, chunks: 0, datagrams: 0, retransmits: 0, elapsed: Duration::ZERO };
        if data.is_empty() {
            return Ok(report);
        }
        let t0 = Instant::now();
        let src = T::src(data);
        let (mut agreed, mut scales) = (Vec::new(), Vec::new());
        if let (Src::F32(f), AggOp::Sum | AggOp::Avg) = (src, op) {
            match self.cfg.quant {
                // The exponents are agreed by an allreduce MAX through the
                // root; the data message then starts with them, so that the
                // root learns the scales from its own reduce records (on the
                // kernel path it never sees that allreduce's results).  The
                // root keeps int64 sums: no headroom needed.
                Quant::Auto => {
                    let mut exps = Vec::new();
                    let r = quant::block_exponents(f, self.chunk / 4, &mut exps);
                    self.or_abort(r, call, set, to)?;
                    check_len::<T>(&what, data.len(), exps.len())?;
                    let spec = self.spec(&what, call * 4, AggOp::Max, to, to_addr, set, true, false);
                    agreed = vec![0i32; exps.len()];
                    let fin = finish_of(&Enc::I32(&exps), AggOp::Max, set.count);
                    let ovf = self.run_allreduce(vec![(spec, Enc::I32(&exps), 0)], fin, &mut Dst::I32(&mut agreed))?;
                    if ovf.iter().any(|o| !o.is_empty()) {
                        return Err(self.protocol_error(&what, "the exponent pre-pass came back with OVERFLOW"));
                    }
                    scales = agreed.iter().map(|&e| quant::auto_scale(e, 0)).collect();
                }
                Quant::Fixed(s) => {
                    self.or_abort(quant::check_fixed(f, s), call, set, to)?;
                    scales = vec![s];
                }
            }
        }
        check_len::<T>(&what, data.len(), agreed.len())?;
        let enc = self.encoding(src, op, &scales, &agreed);
        let enc = self.or_abort(enc, call, set, to)?;
        let spec = self.spec(&what, call * 4 + 1, op, to, to_addr, set, false, false);
        let (st, _) = self.contribute_all(vec![(spec, enc)], &mut |_, _, _, _| {})?.remove(0);
        report.chunks = st.chunks as usize;
        report.datagrams = st.datagrams;
        report.retransmits = st.retransmits;
        report.elapsed = t0.elapsed();
        Ok(report)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn spec(
        &self,
        what: &str,
        op_id: u32,
        op: AggOp,
        agg: u16,
        agg_addr: SocketAddrV4,
        set: Contributors,
        allreduce: bool,
        user_only: bool,
    ) -> Spec {
        Spec {
            what: format!("{what}, op id {op_id}"),
            job_id: self.group.job_id,
            my_rank: self.me.rank,
            agg_rank: agg,
            agg_addr,
            op_id,
            agg_op: op.wire(),
            chunk: self.chunk,
            allreduce,
            user_only,
            mask_base: set.base,
            mask: set.mask,
            peers: Peers::of(&self.group, op_id, set.base, set.mask, agg, self.me.rank),
        }
    }

    /// The wire encoding of `src` for `op` (codec.rs); refuses non-finite
    /// floats before anything is sent.  `scales`: per block of chunk/4
    /// elements (automatic) or one fixed scale.
    pub(super) fn encoding<'a>(
        &self,
        src: Src<'a>,
        op: AggOp,
        scales: &'a [f64],
        prefix: &'a [i32],
    ) -> Result<Enc<'a>> {
        Ok(match src {
            Src::I32(d) => Enc::I32(d),
            Src::I64(d) => Enc::I64(d),
            Src::F32(d) => {
                // SUM/AVG data was checked when its scales were found
                // (block_exponents, check_fixed): one pass over it fewer.
                if !matches!(op, AggOp::Sum | AggOp::Avg) || scales.is_empty() {
                    if let Some(index) = quant::first_non_finite(d) {
                        return Err(Error::NonFinite { index });
                    }
                }
                match op {
                    AggOp::Max | AggOp::Min => Enc::F32Ord(d),
                    AggOp::Count => Enc::F32NonZero(d),
                    AggOp::Sum | AggOp::Avg => {
                        let block = if scales.len() == 1 && self.cfg.quant != Quant::Auto {
                            d.len().max(1)
                        } else {
                            self.chunk / 4
                        };
                        Enc::F32Q { data: d, scales, block, prefix }
                    }
                }
            }
        })
    }

    /// Operations as a contributor, run at once (one per aggregating rank:
    /// a sharded allreduce sends every shard to its owner concurrently), to
    /// completion or the first error.  `decode(job, chunk, payload,
    /// overflow)` gets each newly answered RESULT chunk of `jobs[job]`.
    /// Returns each job's counters and the chunks whose RESULT carried
    /// F_OVERFLOW.
    pub(super) fn contribute_all(
        &mut self,
        jobs: Vec<(Spec, Enc<'_>)>,
        decode: Decode<'_>,
    ) -> Result<Vec<(ContribStats, Vec<usize>)>> {
        let Some(first) = jobs.first() else {
            return Ok(Vec::new());
        };
        // Another member aborted this call while this one was still in an
        // earlier call: fail before sending anything.
        let call_op = abort::call_op(first.0.op_id);
        if let Some((op, a)) = self.abort_ahead.take() {
            if op == call_op {
                self.stats.contrib.aborts += 1;
                return Err(a.error(&first.0.what));
            }
            if op.wrapping_sub(call_op) <= 8 * 4 {
                self.abort_ahead = Some((op, a)); // still ahead of this call
            }
        }
        let t = self.timing();
        let window = self.cfg.window_chunks(self.chunk);
        let mut cs: Vec<Contributor<'_>> = jobs
            .into_iter()
            .map(|(spec, enc)| {
                let cwnd = *self.cwnds.entry(spec.agg_rank).or_insert_with(|| Cwnd::new(window));
                Contributor::new(spec, enc, t, cwnd)
            })
            .collect();
        self.stats.ops += cs.len() as u64;
        // On the kernel path this member's contributions to its own shard
        // (sharded allreduce) go through its own xdp_agg: they never cross
        // its interface.
        let kernel = self.backend.path() == Path::Kernel;
        let own = |c: &Contributor<'_>| kernel && c.spec().agg_rank == c.spec().my_rank;
        for c in cs.iter().filter(|c| own(c)) {
            self.backend.own_shard(c.spec().op_id, true);
        }
        let res = loop {
            let now = Instant::now();
            let sent = cs.iter_mut().filter(|c| !c.done()).try_for_each(|c| {
                if own(c) {
                    c.send_due(&mut OwnXdp(&mut self.backend), now)
                } else {
                    c.send_due(&mut &self.sock, now)
                }
            });
            if let Err(e) = sent {
                break Err(e);
            }
            if cs.iter().all(Contributor::done) {
                break Ok(());
            }
            let mut sink = RootSink::new(&mut self.stash, self.calls.wrapping_sub(1), self.cfg.nslots, None);
            let wait = cs.iter().filter(|c| !c.done()).map(|c| c.wait(now)).min().unwrap_or(Duration::ZERO);
            // Then whatever queued meanwhile (up to DRAIN_BATCHES more
            // batches): the timers of send_due must not expire chunks whose
            // answers wait unread in the socket (a member of a sharded
            // allreduce also combines a shard between its sends, and every
            // such pass made the answers look late: 10% of its datagrams
            // were spurious retransmissions).
            let mut r = Ok(1);
            let mut rounds = 0;
            while matches!(r, Ok(n) if n > 0) && rounds <= DRAIN_BATCHES {
                let w = if rounds == 0 { wait } else { Duration::ZERO };
                r = pump(
                    &self.sock,
                    &mut self.rb,
                    &mut self.backend,
                    &mut self.stats,
                    w,
                    false,
                    Some((cs.as_mut_slice(), &mut *decode)),
                    &mut sink,
                );
                rounds += 1;
                if cs.iter().all(Contributor::done) {
                    break;
                }
            }
            sink.count_into(&mut self.stats);
            if let Err(e) = r {
                break Err(e);
            }
            if cs.iter().all(Contributor::done) {
                break Ok(());
            }
            let now = Instant::now();
            if let Err(e) = check_deadlines(&cs, now) {
                break Err(e);
            }
        };
        let mut out = Vec::with_capacity(cs.len());
        for mut c in cs {
            self.cwnds.insert(c.spec().agg_rank, c.cwnd);
            if let Some(x) = c.take_ahead() {
                self.abort_ahead = Some(x);
            }
            // Done or given up: either way this member wants no more
            // answers of the operation, so the aggregator may reuse its
            // slots.  Best effort (if lost, the slots are reused
            // cfg_slot_timeout after completion).
            if own(&c) {
                let _ = c.send_receipt(&mut OwnXdp(&mut self.backend));
                self.backend.own_shard(c.spec().op_id, false);
            } else {
                let _ = c.send_receipt(&mut &self.sock);
            }
            self.stats.contrib.add(&c.stats);
            out.push((c.stats, c.overflowed().to_vec()));
        }
        res.map(|()| out)
    }
}
