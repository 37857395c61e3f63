//! The reduce root's acknowledgements, many chunks per datagram
//! (KCCL_T_AGG_ACKS, bpf/include/kccl_wire.h).
//!
//! A reduce contribution with KCCL_F_ACK_LATER is not answered when its
//! chunk completes (xdp_agg drops the completing packet instead of turning
//! it into an ACK for every contributor): the root's runtime collects the
//! chunks it took in one receive round (records read off the ring buffer,
//! or chunks the user-space aggregator completed) and, when the round's
//! answers are flushed, sends each contributor one bitmap per operation
//! covering up to 8192 chunks.  Per chunk that saves an answer packet, its
//! pass up to tc_agg_result and one fan-out copy per contributor; and a
//! sender's window now advances only as fast as the root takes its chunks
//! (the root's ring cannot be outrun).  Retransmissions of a finished chunk
//! are still answered per chunk, so a lost bitmap costs a timeout, never the
//! chunk.

use std::net::SocketAddrV4;

use crate::kernel_agg::AggRecord;
use crate::wire::{Header, AGG_ACKS_MAX_BYTES, HDR_LEN, T_AGG_ACKS, VERSION};

/// What identifies an operation's chunks: (op id, msg_len, agg_op, dtype,
/// mask_base, contributors).
type OpKey = (u32, u32, u8, u8, u16, u64);

/// One operation's acknowledgement state.
#[derive(Debug)]
struct OpAcks {
    key: OpKey,
    /// Every chunk of the operation taken so far (bit per chunk).
    taken: Vec<u64>,
    nchunks: u32,
    /// Lowest and highest chunk taken this round (None: none yet).
    round: Option<(u32, u32)>,
    /// Lowest chunk taken in the previous round (None: none).
    prev_lo: Option<u32>,
    /// Flush count when this operation last had a chunk (for eviction).
    used: u64,
}

/// The chunks taken since the last flush and, per recent operation, every
/// chunk taken so far.  Each bitmap covers this round's chunks and again
/// the previous round's (every chunk taken in that span is set), so one
/// lost bitmap is repaired by the next round's: at 1% loss on every link,
/// 64 MiB at MTU 1500, bitmaps that named each chunk once cost 26 window
/// cuts and 6 timeouts per operation (the contributors saw a lost bitmap
/// as a burst of losses).
#[derive(Debug)]
pub(super) struct AckBatch {
    chunk_bytes: usize,
    ops: Vec<OpAcks>,
    flushes: u64,
}

/// Bits of the largest bitmap.
const MAX_BITS: u32 = (AGG_ACKS_MAX_BYTES * 8) as u32;
/// Operations remembered (the least recently used is forgotten).
const MAX_OPS: usize = 8;

impl AckBatch {
    pub(super) fn new(chunk_bytes: usize) -> AckBatch {
        AckBatch { chunk_bytes: chunk_bytes.max(1), ops: Vec::new(), flushes: 0 }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.ops.iter().all(|o| o.round.is_none())
    }

    fn taken(&self, o: usize, c: u32) -> bool {
        self.ops[o].taken[c as usize / 64] >> (c % 64) & 1 == 1
    }

    /// Chunk `chunk` of the operation of `rec` was taken: acknowledge it to
    /// every contributor (bit i of `rec.contributors` = rank mask_base + i).
    /// A chunk beyond the message is ignored.
    pub(super) fn add(&mut self, rec: &AggRecord, chunk: u32) {
        let key = (rec.op_id, rec.msg_len, rec.agg_op, rec.dtype, rec.mask_base, rec.contributors);
        let msg_len = rec.msg_len;
        let o = match self.ops.iter().position(|o| o.key == key) {
            Some(o) => o,
            None => {
                if self.ops.len() >= MAX_OPS {
                    if let Some(old) = (0..self.ops.len()).min_by_key(|&i| self.ops[i].used) {
                        self.ops.swap_remove(old);
                    }
                }
                let nchunks = (msg_len as usize).div_ceil(self.chunk_bytes) as u32;
                let taken = vec![0u64; (nchunks as usize).div_ceil(64)];
                self.ops.push(OpAcks { key, taken, nchunks, round: None, prev_lo: None, used: self.flushes });
                self.ops.len() - 1
            }
        };
        let op = &mut self.ops[o];
        if chunk >= op.nchunks {
            return;
        }
        op.taken[chunk as usize / 64] |= 1 << (chunk % 64);
        op.round = Some(op.round.map_or((chunk, chunk), |(lo, hi)| (lo.min(chunk), hi.max(chunk))));
        op.used = self.flushes;
    }

    /// Appends one KCCL_T_AGG_ACKS datagram per contributor and run of at
    /// most 8192 chunks to `arena` and its (address, start, length) to
    /// `out`: for every operation with chunks this round, the chunks taken
    /// from the lower of this round's and the previous round's lowest to
    /// this round's highest.  `members[rank]`: the rank's address (ranks
    /// without one are skipped).  Returns the datagrams.
    pub(super) fn encode(
        &mut self,
        job_id: u32,
        my_rank: u16,
        members: &[Option<SocketAddrV4>],
        arena: &mut Vec<u8>,
        out: &mut Vec<(SocketAddrV4, usize, usize)>,
    ) -> u64 {
        self.flushes += 1;
        let mut sent = 0;
        let mut bitmap = [0u8; AGG_ACKS_MAX_BYTES];
        for o in 0..self.ops.len() {
            let Some((lo, hi)) = self.ops[o].round.take() else {
                self.ops[o].prev_lo = None;
                continue;
            };
            let from = self.ops[o].prev_lo.map_or(lo, |p| p.min(lo));
            self.ops[o].prev_lo = Some(lo);
            let (op_id, msg_len, agg_op, dtype, mask_base, contributors) = self.ops[o].key;
            let mut first = from;
            while first <= hi {
                let last = hi.min(first + (MAX_BITS - 1));
                // Trim the run to its first and last taken chunk.
                let Some(a) = (first..=last).find(|&c| self.taken(o, c)) else {
                    first = last + 1;
                    continue;
                };
                let b = (a..=last).rev().find(|&c| self.taken(o, c)).unwrap_or(a);
                let len = (b - a) as usize / 8 + 1;
                bitmap[..len].fill(0);
                for c in a..=b {
                    if self.taken(o, c) {
                        let i = (c - a) as usize;
                        bitmap[i / 8] |= 1 << (i % 8);
                    }
                }
                let mut h = Header {
                    version: VERSION,
                    msg_type: T_AGG_ACKS,
                    flags: 0,
                    job_id,
                    src_rank: my_rank,
                    mask_base,
                    dst_mask: 0,
                    msg_seq: op_id,
                    frag_off: (a as usize * self.chunk_bytes) as u32,
                    msg_len,
                    payload_len: len as u16,
                    agg_op,
                    dtype,
                };
                let mut bits = contributors;
                while bits != 0 {
                    let k = bits.trailing_zeros();
                    bits &= bits - 1;
                    let Some(Some(to)) = members.get(usize::from(mask_base) + k as usize) else { continue };
                    h.dst_mask = 1 << k;
                    let start = arena.len();
                    let mut hb = [0u8; HDR_LEN];
                    h.encode(&mut hb);
                    arena.extend_from_slice(&hb);
                    arena.extend_from_slice(&bitmap[..len]);
                    out.push((*to, start, HDR_LEN + len));
                    sent += 1;
                }
                first = last + 1;
            }
        }
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// The record of a taken chunk, as far as acknowledging it needs.
    fn rec(op_id: u32, msg_len: u32, agg_op: u8, dtype: u8, mask_base: u16, contributors: u64) -> AggRecord {
        AggRecord { op_id, msg_len, agg_op, dtype, mask_base, contributors, ..AggRecord::default() }
    }

    fn addr(rank: u16) -> Option<SocketAddrV4> {
        Some(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, rank as u8), 7000))
    }

    /// Encodes one round and decodes every datagram: (to, header, chunks).
    fn flush(b: &mut AckBatch, members: &[Option<SocketAddrV4>]) -> Vec<(SocketAddrV4, Header, Vec<u32>)> {
        let (mut arena, mut out) = (Vec::new(), Vec::new());
        let n = b.encode(7, 0, members, &mut arena, &mut out);
        assert_eq!(n as usize, out.len());
        assert!(b.is_empty());
        out.iter()
            .map(|&(to, start, len)| {
                let (h, p) = Header::decode(&arena[start..start + len]).expect("decodes");
                assert!(!p.is_empty() && p.len() <= AGG_ACKS_MAX_BYTES);
                let first = h.frag_off as usize / b.chunk_bytes;
                let chunks =
                    (0..p.len() * 8).filter(|i| p[i / 8] >> (i % 8) & 1 == 1).map(|i| (first + i) as u32).collect();
                (to, h, chunks)
            })
            .collect()
    }

    #[test]
    fn one_bitmap_per_contributor_and_operation() {
        let mut b = AckBatch::new(1000);
        let members = [None, addr(1), addr(2), addr(3)];
        // Contributors ranks 1 and 3 (mask_base 1: bits 0 and 2), chunks out of order, one twice.
        for c in [5, 3, 9, 3] {
            b.add(&rec(12, 100 * 1000, 1, 1, 1, 0b101), c);
        }
        let s = flush(&mut b, &members);
        assert_eq!(s.len(), 2);
        for (k, (to, h, chunks)) in s.iter().enumerate() {
            assert_eq!(*to, members[1 + 2 * k].expect("member"));
            assert_eq!((h.msg_type, h.job_id, h.src_rank, h.msg_seq, h.frag_off), (T_AGG_ACKS, 7, 0, 12, 3000));
            assert_eq!((h.mask_base, h.dst_mask, h.payload_len), (1, 1 << (2 * k), 1));
            assert_eq!(chunks, &[3, 5, 9]);
        }
        assert!(flush(&mut b, &members).is_empty(), "nothing new, nothing sent");
    }

    #[test]
    fn each_bitmap_repeats_the_previous_round() {
        let mut b = AckBatch::new(8);
        let members = [addr(0)];
        let mut round = |chunks: &[u32]| -> Vec<u32> {
            for &c in chunks {
                b.add(&rec(4, 8 * 100, 1, 1, 0, 1), c);
            }
            let s = flush(&mut b, &members);
            assert!(s.len() <= 1);
            s.into_iter().flat_map(|(_, _, c)| c).collect()
        };
        assert_eq!(round(&[3, 5]), [3, 5]);
        assert_eq!(round(&[6]), [3, 5, 6], "a lost first bitmap is repaired");
        assert_eq!(round(&[8]), [6, 8]);
        assert_eq!(round(&[]), Vec::<u32>::new());
        assert_eq!(round(&[4]), [4], "an empty round repeats nothing");
        assert_eq!(round(&[100, 99]), [4, 5, 6, 8, 99], "every taken chunk in the span; beyond the message ignored");
    }

    #[test]
    fn runs_longer_than_a_bitmap_split() {
        let mut b = AckBatch::new(8);
        let members = [None, addr(1)];
        let msg_len = (3 * MAX_BITS + 1) * 8;
        for c in [0, MAX_BITS - 1, MAX_BITS, 3 * MAX_BITS] {
            b.add(&rec(4, msg_len, 2, 1, 1, 1), c);
        }
        let runs: Vec<Vec<u32>> = flush(&mut b, &members).into_iter().map(|(_, _, c)| c).collect();
        assert_eq!(runs, vec![vec![0, MAX_BITS - 1], vec![MAX_BITS], vec![3 * MAX_BITS]]);
    }

    #[test]
    fn old_operations_are_forgotten() {
        let mut b = AckBatch::new(8);
        for op in 0..(MAX_OPS as u32 + 3) {
            b.add(&rec(op, 64, 1, 1, 0, 1), 0);
        }
        assert_eq!(b.ops.len(), MAX_OPS);
    }
}
