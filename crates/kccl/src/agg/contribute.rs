//! The contributor side of an aggregation, shared by reduce (reduce.rs) and
//! allreduce (allreduce.rs): a vector becomes chunk specs and encodings, goes
//! out under the AIMD window, and every chunk waits for its ACK (or its
//! RESULT, for allreduce).

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transport::Path;

use super::abort::{self, Peers};
use super::backend::OwnXdp;
use super::codec::{Enc, Src};
use super::dispatch::{pump, Decode};
use super::member::{check_deadlines, ContribStats, Contributor, Cwnd, Spec};
use super::op::{AggOp, Quant};
use super::root::RootSink;
use super::{quant, Collective, Contributors};

/// Receive batches a contributor reads without waiting after the one it
/// waited for, before its timers look at what is unanswered.
const DRAIN_BATCHES: usize = 8;

impl Collective {
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
