//! allreduce: the first call's number agreed with the aggregator, RESULT
//! chunks decoded into the output, and the int64 redo of chunks whose int32
//! result overflowed.

use std::net::SocketAddrV4;
use std::ops::Range;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::wire::{Header, DT_I64, HDR_LEN, MASK_BITS, T_AGG_SYNC, T_AGG_SYNC_ACK};

use super::codec::{Dst, Enc, FinEnc, Finish, OutOfRange, Src};
use super::config::AllreduceMode;
use super::member::Spec;
use super::op::{AggOp, Element, Quant};
use super::root::RootDone;
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

/// One shard of an allreduce: elements `elems` of the vector, combined by
/// rank `owner` (the group's aggregator, which has them all, or in a
/// sharded allreduce the member that owns them).
#[derive(Debug, Clone)]
pub(super) struct Shard {
    pub owner: u16,
    pub addr: SocketAddrV4,
    pub elems: Range<usize>,
}

/// Splits `n` elements into one run of whole chunks (`epc` elements each)
/// per owner, as even as whole chunks allow, in the owners' order; an
/// owner left without a chunk (fewer chunks than owners) gets no shard.
pub(super) fn split(n: usize, epc: usize, owners: &[(u16, SocketAddrV4)]) -> Vec<Shard> {
    let chunks = n.div_ceil(epc.max(1));
    owners
        .iter()
        .enumerate()
        .filter_map(|(i, &(owner, addr))| {
            let c = shard_chunks(chunks, owners.len(), i);
            (!c.is_empty()).then(|| Shard { owner, addr, elems: c.start * epc..(c.end * epc).min(n) })
        })
        .collect()
}

/// The chunk numbers the `i`-th of `owners` owners combines in a sharded
/// allreduce of `chunks` chunks (whole chunks, as even as they allow; empty
/// when there are fewer chunks than owners).  Public for the benchmarks'
/// per-host byte model.
pub fn shard_chunks(chunks: usize, owners: usize, i: usize) -> Range<usize> {
    let k = owners.max(1);
    i * chunks / k..(i + 1) * chunks / k
}

/// The chunks `shard` covers, as a range of chunk numbers of the vector
/// (`epc` elements per chunk).
fn chunk_range(shard: &Shard, epc: usize) -> Range<usize> {
    shard.elems.start / epc..shard.elems.end.div_ceil(epc)
}

impl Collective {
    /// allreduce: every member (all ranks but the group's aggregator, if it
    /// names one) gets `op` over every member's `data`, combined by the
    /// aggregator rank or, sharded, by every member for its shard
    /// (AggConfig::allreduce).
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
        let mode = self.allreduce_mode();
        if let (AllreduceMode::Aggregator, Some(agg)) = (mode, self.group.aggregator) {
            self.sync_start(agg)?;
        }
        let call = self.next_call();
        let what = format!("allreduce call {call} ({} {op}, {} elements)", T::NAME, data.len());
        let (set, owners) = self.allreduce_plan(&what, mode)?;
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
        let agg = owners[0].0; // whom an abort names besides `set`
        let src = T::src(data);
        let wire_es = if matches!(src, Src::I64(_)) { 8 } else { 4 };
        let epc = self.chunk / wire_es;
        let shards = split(data.len(), epc, &owners);
        let mut scales = Vec::new();
        let quant = self.cfg.quant;
        if let (Src::F32(f), AggOp::Sum | AggOp::Avg) = (src, op) {
            match quant {
                // Agree on the per-chunk exponents first (MAX of one int32
                // per chunk, each at its chunk's owner); the int32 result
                // needs ceil(log2 n) headroom.
                Quant::Auto => {
                    let mut exps = Vec::new();
                    let r = quant::block_exponents(f, epc, &mut exps);
                    self.or_abort(r, call, set, agg)?;
                    let jobs = shards
                        .iter()
                        .map(|s| {
                            let r = chunk_range(s, epc);
                            let spec = self.spec(&what, call * 4, AggOp::Max, s.owner, s.addr, set, true, false);
                            (spec, Enc::I32(&exps[r.clone()]), r.start)
                        })
                        .collect();
                    let mut agreed = vec![0i32; exps.len()];
                    let fin = finish_of(&Enc::I32(&exps), AggOp::Max, set.count);
                    let ovf = self.run_allreduce(jobs, fin, &mut Dst::I32(&mut agreed))?;
                    if ovf.iter().any(|o| !o.is_empty()) {
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
        let jobs = shards
            .iter()
            .map(|s| {
                let spec = self.spec(&what, call * 4 + 1, op, s.owner, s.addr, set, true, false);
                (spec, enc.slice(s.elems.clone()), s.elems.start)
            })
            .collect();
        let overflowed = self.run_allreduce(jobs, fin, &mut T::dst(out))?;
        if overflowed.iter().any(|o| !o.is_empty()) {
            // Chunk numbers of the whole vector, per shard.
            let redo: Vec<(&Shard, Vec<usize>)> = shards
                .iter()
                .zip(&overflowed)
                .filter(|(_, o)| !o.is_empty())
                .map(|(s, o)| (s, o.iter().map(|c| s.elems.start / epc + c).collect()))
                .collect();
            self.redo(&what, call, op, set, &enc, &redo, &mut T::dst(out))?;
        }
        // Sharded: this member answers its shard's retransmissions until
        // the others confirm (settle), as a reduce root does.
        if mode == AllreduceMode::Sharded {
            if let Some((i, s)) = shards.iter().enumerate().find(|(_, s)| s.owner == self.me.rank) {
                let first = s.elems.start / epc;
                // The redo message: each overflowed chunk's elements as int64.
                let wide: usize = overflowed[i].iter().map(|&c| epc.min(data.len() - (first + c) * epc)).sum();
                let (op_id, nchunks) = match wide {
                    0 => (call * 4 + 1, chunk_range(s, epc).len()),
                    _ => (call * 4 + 2, (wide * 8).div_ceil(self.chunk)),
                };
                self.last_served = Some(RootDone { op_id, nchunks: nchunks as u32, base: set.base, mask: set.mask });
            }
        }
        Ok(())
    }

    /// AggConfig::allreduce with Auto resolved: the group's aggregator if
    /// the group file names one, else sharded.
    pub(super) fn allreduce_mode(&self) -> AllreduceMode {
        match self.cfg.allreduce {
            AllreduceMode::Auto if self.group.aggregator.is_some() => AllreduceMode::Aggregator,
            AllreduceMode::Auto => AllreduceMode::Sharded,
            m => m,
        }
    }

    /// An allreduce's contributors and the ranks that combine it, in the
    /// order of their shards: the aggregator alone, or every contributor.
    fn allreduce_plan(&self, what: &str, mode: AllreduceMode) -> Result<(Contributors, Vec<(u16, SocketAddrV4)>)> {
        let mut exclude: Vec<u16> = self.group.aggregator.into_iter().collect();
        exclude.extend(&self.excluded);
        let set = contributors(&self.group, what, &exclude)?;
        let owners = if mode == AllreduceMode::Aggregator {
            let Some(agg) = self.group.aggregator else {
                return Err(Error::Usage(format!(
                    "{what}: the group file names no allreduce aggregator; add `aggregator = <rank>` (a rank that \
                     runs `kccl aggregator`), or use the sharded allreduce (every member combines a shard)"
                )));
            };
            vec![(agg, self.addr_of(agg)?)]
        } else {
            self.backend.own_shard_supported().map_err(|why| {
                Error::Usage(format!(
                    "{what}: the sharded allreduce on the kernel path needs this member's own contributions in \
                     its xdp_agg, but {why}; use the user-space path (`--path user`) or name an aggregator in \
                     the group file"
                ))
            })?;
            let off = self.me.rank.wrapping_sub(set.base);
            if off >= MASK_BITS as u16 || set.mask >> off & 1 == 0 {
                return Err(Error::Usage(format!(
                    "{what}: rank {} is not one of the allreduce's members (it is the group's aggregator or was \
                     excluded), so it owns no shard",
                    self.me.rank
                )));
            }
            let ranks = (0..MASK_BITS as u16).filter(|i| set.mask >> i & 1 == 1).map(|i| set.base + i);
            ranks.map(|r| Ok((r, self.addr_of(r)?))).collect::<Result<Vec<_>>>()?
        };
        Ok((set, owners))
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
            self.sock.send_all(&[crate::transport::sock::Datagram { to: agg, head: &hb, body: &[] }])?;
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

    /// Allreduce-type operations (RESULT answers), one per job (spec, the
    /// job's message, the vector element its first element is), run at
    /// once and decoded into `out`.  Returns each job's chunks whose RESULT
    /// carried F_OVERFLOW (left for the redo).
    pub(super) fn run_allreduce(
        &mut self,
        jobs: Vec<(Spec, Enc<'_>, usize)>,
        fin: Finish<'_>,
        out: &mut Dst<'_>,
    ) -> Result<Vec<Vec<usize>>> {
        let Some((spec, enc, _)) = jobs.first() else {
            return Ok(Vec::new());
        };
        let what = spec.what.clone();
        let es = enc.elem_size();
        let dtype = enc.dtype();
        let chunk = self.chunk;
        let firsts: Vec<usize> = jobs.iter().map(|j| j.2).collect();
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut err: Option<OutOfRange> = None;
        let jobs = jobs.into_iter().map(|(s, e, _)| (s, e)).collect();
        let res = self.contribute_all(jobs, &mut |j, c, payload, overflow| {
            if overflow || err.is_some() {
                return;
            }
            if let Err(e) = fin.apply_wire(payload, dtype, firsts[j] + c * chunk / es, out, &mut scratch) {
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
        Ok(r.into_iter().map(|(_, ovf)| ovf).collect())
    }

    /// The exact redo of allreduce chunks whose int32 result overflowed:
    /// their int32 wire values (as sent: quantized for F32Q) are resent
    /// widened to I64, with USER_ONLY (the kernel passes them to the
    /// aggregator's user space, which sums in int64 and answers in int64),
    /// under op id 4k + 2, to the owner of each chunk's shard (all at
    /// once).  A shard's redo message is its overflowed chunks (chunk
    /// numbers of the whole vector, ascending) concatenated; a chunk of C
    /// bytes holds C/8 int64 elements, so overflowed chunk j of a shard is
    /// redo chunks 2j and 2j + 1 (the vector's last chunk may be shorter,
    /// and is last).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn redo(
        &mut self,
        what: &str,
        call: u32,
        op: AggOp,
        set: Contributors,
        enc: &Enc<'_>,
        overflowed: &[(&Shard, Vec<usize>)],
        out: &mut Dst<'_>,
    ) -> Result<()> {
        if enc.dtype() == DT_I64 {
            let all: Vec<usize> = overflowed.iter().flat_map(|(_, o)| o.iter().copied()).collect();
            return Err(Error::Overflow {
                what: what.into(),
                detail: format!(
                    "the int64 sum overflowed in chunks {} (elements from {}); the result does not fit i64",
                    chunk_list(&all),
                    all[0] * self.chunk / 8
                ),
            });
        }
        let epc = self.chunk / 4;
        let total = enc.elems();
        let mut buf = vec![0u8; self.chunk];
        let wides: Vec<Vec<i64>> = overflowed
            .iter()
            .map(|(_, chunks)| {
                let mut wide: Vec<i64> = Vec::with_capacity(chunks.len() * epc);
                for &c in chunks {
                    let first = c * epc;
                    let n = epc.min(total - first);
                    enc.encode(first, &mut buf[..n * 4]);
                    wide.extend(
                        buf[..n * 4].chunks_exact(4).map(|b| i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))),
                    );
                }
                wide
            })
            .collect();
        self.stats.redo_ops += 1;
        let fin = finish_of(enc, op, set.count);
        let half = self.chunk / 8;
        let jobs = overflowed
            .iter()
            .zip(&wides)
            .map(|((s, _), wide)| (self.spec(what, call * 4 + 2, op, s.owner, s.addr, set, true, true), Enc::I64(wide)))
            .collect();
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut err: Option<Error> = None;
        let res = self.contribute_all(jobs, &mut |j, k, payload, overflow| {
            if err.is_some() {
                return;
            }
            let chunk = overflowed[j].1[k / 2];
            if overflow {
                err = Some(Error::Overflow {
                    what: what.into(),
                    detail: format!("the int64 redo of chunk {chunk} overflowed"),
                });
                return;
            }
            codec::read_wire(payload, DT_I64, &mut scratch);
            let first = chunk * epc + (k % 2) * half;
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
