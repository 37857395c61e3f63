//! allreduce: the first call's number agreed with the aggregator, RESULT
//! chunks decoded into the output, and the int64 redo of chunks whose int32
//! result overflowed.

use std::net::SocketAddrV4;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::wire::{Header, DT_I64, HDR_LEN, T_AGG_SYNC, T_AGG_SYNC_ACK};

use super::codec::{Dst, Enc, FinEnc, Finish, OutOfRange, Src};
use super::member::{ContribStats, Spec};
use super::op::{AggOp, Element, Quant};
use super::{check_len, chunk_list, codec, contributors, quant, Collective, Contributors};

/// How a member's aggregated chunks become output elements (allreduce).
pub(super) fn finish_of<'a>(enc: &Enc<'a>, op: AggOp, count: usize) -> Finish<'a> {
    let fe = match *enc {
        Enc::F32Q { scales, block, .. } => FinEnc::F32Q { scales, block },
        Enc::F32Ord(_) => FinEnc::F32Ord,
        Enc::F32NonZero(_) => FinEnc::F32NonZero,
        Enc::I32(_) | Enc::I64(_) => FinEnc::Int,
    };
    Finish { agg_op: op.wire(), enc: fe, count }
}

impl Collective {
    /// allreduce: every member (all ranks but the group's aggregator) gets
    /// `op` over every member's `data`, combined by the aggregator rank.
    pub fn allreduce<T: Element>(&mut self, data: &[T], op: AggOp) -> Result<Vec<T>> {
        let mut out = vec![T::default(); data.len()];
        self.allreduce_into(data, op, &mut out)?;
        Ok(out)
    }

    /// allreduce into the caller's buffer (as long as `data`), as
    /// torch.distributed's allreduce writes into its tensor: a buffer reused
    /// from call to call saves the page faults of a fresh result (a 64 MiB
    /// result is 16,384 of them per member, about a tenth of the machine's
    /// CPU in a 64 MiB allreduce).  On an error its contents are unspecified.
    pub fn allreduce_into<T: Element>(&mut self, data: &[T], op: AggOp, out: &mut [T]) -> Result<()> {
        if let Some(agg) = self.group.aggregator {
            self.sync_start(agg)?;
        }
        let call = self.next_call();
        let what = format!("allreduce call {call} ({} {op}, {} elements)", T::NAME, data.len());
        let Some(agg) = self.group.aggregator else {
            return Err(Error::Usage(format!(
                "{what}: the group file names no allreduce aggregator; add `aggregator = <rank>` (a rank that runs \
                 `kccl aggregator`)"
            )));
        };
        let mut exclude = vec![agg];
        exclude.extend(&self.excluded);
        let set = contributors(&self.group, &what, &exclude)?;
        if out.len() != data.len() {
            return Err(Error::Usage(format!(
                "{what}: the output holds {} elements, the input {}; they must match",
                out.len(),
                data.len()
            )));
        }
        if data.is_empty() {
            return Ok(());
        }
        check_len::<T>(&what, data.len(), 0)?;
        let agg_addr = self.addr_of(agg)?;
        let src = T::src(data);
        let mut scales = Vec::new();
        let quant = self.cfg.quant;
        if let (Src::F32(f), AggOp::Sum | AggOp::Avg) = (src, op) {
            match quant {
                // Agree on the per-chunk exponents first (MAX of one int32
                // per chunk); the int32 result needs ceil(log2 n) headroom.
                Quant::Auto => {
                    let mut exps = Vec::new();
                    let r = quant::block_exponents(f, self.chunk / 4, &mut exps);
                    self.or_abort(r, call, set, agg)?;
                    let spec = self.spec(&what, call * 4, AggOp::Max, agg, agg_addr, set, true, false);
                    let mut agreed = vec![0i32; exps.len()];
                    let fin = finish_of(&Enc::I32(&exps), AggOp::Max, set.count);
                    let (_, ovf) = self.run_allreduce(spec, Enc::I32(&exps), fin, &mut Dst::I32(&mut agreed))?;
                    if !ovf.is_empty() {
                        return Err(self.protocol_error(&what, "the exponent pre-pass came back with OVERFLOW"));
                    }
                    let h = quant::headroom(set.count);
                    scales = agreed.iter().map(|&e| quant::auto_scale(e, h)).collect();
                }
                Quant::Fixed(s) => {
                    self.or_abort(quant::check_fixed(f, s), call, set, agg)?;
                    scales = vec![s];
                }
            }
        }
        let enc = self.encoding(src, op, &scales, &[]);
        let enc = self.or_abort(enc, call, set, agg)?;
        let fin = finish_of(&enc, op, set.count);
        let spec = self.spec(&what, call * 4 + 1, op, agg, agg_addr, set, true, false);
        let (_, overflowed) = self.run_allreduce(spec, enc, fin, &mut T::dst(out))?;
        if !overflowed.is_empty() {
            self.redo(&what, call, op, agg, agg_addr, set, &enc, &overflowed, &mut T::dst(out))?;
        }
        Ok(())
    }

    /// Before this member's first allreduce: asks the group's aggregator
    /// service which call to start at (KCCL_T_AGG_SYNC), so that a member
    /// process started again against a long-lived aggregator does not reuse
    /// op ids whose answers or receipts it still holds: a reused op id would
    /// be answered from the old operation's slot, or dropped as a late
    /// copy.  Every member of a run asks before the run's first operation
    /// can finish, so all get the same call.  Retried every rto (doubling)
    /// until the deadline.  Not for reduce: a root may start reading only
    /// after its contributors finished (the kernel aggregates meanwhile),
    /// and a root is normally a process of the job itself.
    pub(super) fn sync_start(&mut self, agg_rank: u16) -> Result<()> {
        if self.synced {
            return Ok(());
        }
        let agg = self.addr_of(agg_rank)?;
        let h = Header::control(T_AGG_SYNC, self.group.job_id, self.me.rank, 0);
        let mut hb = [0u8; HDR_LEN];
        h.encode(&mut hb);
        let t0 = Instant::now();
        let mut rto = self.cfg.rto;
        loop {
            self.sock.send_all(&[crate::sock::Datagram { to: agg, head: &hb, body: &[] }])?;
            let until = Instant::now() + rto;
            while let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) {
                let n = self.sock.recv_batch(&mut self.rb, Some(left))?;
                for i in 0..n {
                    let (d, from) = self.rb.get(i);
                    match d.ok().and_then(|d| Header::decode(d).ok()) {
                        Some((a, _))
                            if a.msg_type == T_AGG_SYNC_ACK
                                && from == agg
                                && a.src_rank == agg_rank
                                && a.job_id == self.group.job_id =>
                        {
                            let call = a.msg_seq / 4;
                            // Only forward: a call already made keeps its number.
                            if (call.wrapping_sub(self.calls) as i32) > 0 {
                                self.calls = call;
                            }
                            self.synced = true;
                            return Ok(());
                        }
                        // Nothing else is due before the first operation;
                        // senders of anything else retransmit.
                        _ => self.stats.other_datagrams += 1,
                    }
                }
            }
            if t0.elapsed() >= self.cfg.deadline {
                return Err(Error::Timeout {
                    ms: t0.elapsed().as_millis() as u64,
                    what: format!(
                        "rank {}: no answer from aggregator rank {agg_rank} ({agg}) to which call to start at \
                         (KCCL_T_AGG_SYNC); check that it runs (`kccl aggregator`, or the reduce root) with the \
                         same kccl version and group file",
                        self.me.rank
                    ),
                });
            }
            rto = rto.saturating_mul(2).min(self.cfg.rto.saturating_mul(16));
        }
    }

    /// An allreduce-type operation (RESULT answers) decoded into `out`;
    /// chunks with F_OVERFLOW are left for the redo.
    pub(super) fn run_allreduce(
        &mut self,
        spec: Spec,
        enc: Enc<'_>,
        fin: Finish<'_>,
        out: &mut Dst<'_>,
    ) -> Result<(ContribStats, Vec<usize>)> {
        let what = spec.what.clone();
        let es = enc.elem_size();
        let dtype = enc.dtype();
        let chunk = self.chunk;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut err: Option<OutOfRange> = None;
        let res = self.contribute(spec, enc, &mut |c, payload, overflow| {
            if overflow || err.is_some() {
                return;
            }
            if let Err(e) = fin.apply_wire(payload, dtype, c * chunk / es, out, &mut scratch) {
                err = Some(e);
            }
        });
        self.scratch = scratch;
        let r = res?;
        if let Some(OutOfRange { index, value }) = err {
            return Err(Error::Overflow {
                what,
                detail: format!("element {index} is {value}, outside the output type; use a wider element type"),
            });
        }
        Ok(r)
    }

    /// The exact redo of allreduce chunks whose int32 result overflowed:
    /// their int32 wire values (as sent: quantized for F32Q) are resent
    /// widened to I64, with USER_ONLY (the kernel passes them to the
    /// aggregator's user space, which sums in int64 and answers in int64),
    /// under op id 4k + 2.  The redo message is the overflowed chunks
    /// concatenated in chunk order; a chunk of C bytes holds C/8 int64
    /// elements, so original chunk `overflowed[j]` is redo chunks 2j and
    /// 2j + 1 (the last original chunk may be shorter, and is last).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn redo(
        &mut self,
        what: &str,
        call: u32,
        op: AggOp,
        agg: u16,
        agg_addr: SocketAddrV4,
        set: Contributors,
        enc: &Enc<'_>,
        overflowed: &[usize],
        out: &mut Dst<'_>,
    ) -> Result<()> {
        if enc.dtype() == DT_I64 {
            return Err(Error::Overflow {
                what: what.into(),
                detail: format!(
                    "the int64 sum overflowed in chunks {} (elements from {}); the result does not fit i64",
                    chunk_list(overflowed),
                    overflowed[0] * self.chunk / 8
                ),
            });
        }
        let epc = self.chunk / 4;
        let total = enc.elems();
        let mut wide: Vec<i64> = Vec::with_capacity(overflowed.len() * epc);
        let mut buf = vec![0u8; self.chunk];
        for &c in overflowed {
            let first = c * epc;
            let n = epc.min(total - first);
            enc.encode(first, &mut buf[..n * 4]);
            wide.extend(buf[..n * 4].chunks_exact(4).map(|b| i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))));
        }
        self.stats.redo_ops += 1;
        let fin = finish_of(enc, op, set.count);
        let half = self.chunk / 8;
        let spec = self.spec(what, call * 4 + 2, op, agg, agg_addr, set, true, true);
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut err: Option<Error> = None;
        let res = self.contribute(spec, Enc::I64(&wide), &mut |k, payload, overflow| {
            if err.is_some() {
                return;
            }
            if overflow {
                err = Some(Error::Overflow {
                    what: what.into(),
                    detail: format!("the int64 redo of chunk {} overflowed", overflowed[k / 2]),
                });
                return;
            }
            codec::read_wire(payload, DT_I64, &mut scratch);
            let first = overflowed[k / 2] * epc + (k % 2) * half;
            if let Err(OutOfRange { index, value }) = fin.apply(&scratch, first, None, out) {
                err = Some(Error::Overflow {
                    what: what.into(),
                    detail: format!(
                        "element {index} sums to {value}, which does not fit the output type (computed exactly by \
                         the int64 redo); use i64 data"
                    ),
                });
            }
        });
        self.scratch = scratch;
        res?;
        err.map_or(Ok(()), Err)
    }
}
