//! reduce: every contributor's vector combined at one root.  The
//! contributor side sends (contribute.rs), the root collects (root.rs) and
//! folds its own data in; the paper's two building blocks,
//! `send_aggregated_data` and `get_aggregated_data`, are public too.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

use super::allreduce::finish_of;
use super::codec::{Dst, Enc, Src};
use super::config::SendReport;
use super::op::{AggOp, Element, Quant};
use super::{check_len, quant, Collective};

impl Collective {
    /// reduce: combines every member's `data` with `op` at `root`.  Returns
    /// Some(result) on the root (its own data folded in), None elsewhere.
    /// Members: every rank of the group but the allreduce aggregator.
    pub fn reduce<T: Element>(&mut self, data: &[T], op: AggOp, root: u16) -> Result<Option<Vec<T>>> {
        if root == self.me.rank {
            self.root_collect(data.len(), op, Some(data)).map(Some)
        } else {
            self.send_aggregated_data(data, op, root).map(|_| None)
        }
    }

    /// reduce into the caller's buffer, as torch.distributed's reduce
    /// writes into its tensor: on the root, `out` (as long as `data`)
    /// receives the result and the call returns true; elsewhere `out` is
    /// left alone and the call returns false.  Reusing `out` across calls
    /// saves a fresh result's page faults.
    pub fn reduce_into<T: Element>(&mut self, data: &[T], op: AggOp, root: u16, out: &mut [T]) -> Result<bool> {
        if root != self.me.rank {
            return self.send_aggregated_data(data, op, root).map(|_| false);
        }
        if out.len() != data.len() {
            return Err(Error::Usage(format!(
                "reduce_into at root {root}: the output holds {} elements, the input {}; they must match",
                out.len(),
                data.len()
            )));
        }
        self.root_collect_into(op, Some(data), out).map(|()| true)
    }

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

    /// The paper's building block of reduce, root side: the aggregate of
    /// the contributors' data (`len` elements each; this member's own data
    /// is not included: see [`reduce`](Self::reduce)).  AVG divides by the
    /// number of contributors.
    pub fn get_aggregated_data<T: Element>(&mut self, len: usize, op: AggOp) -> Result<Vec<T>> {
        self.root_collect::<T>(len, op, None)
    }
}
