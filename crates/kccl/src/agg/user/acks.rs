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

use crate::wire::{Header, AGG_ACKS_MAX_BYTES, HDR_LEN, T_AGG_ACKS, VERSION};

/// Chunks of one operation (and contributor set) taken in this round.
#[derive(Debug)]
struct OpAcks {
    op_id: u32,
    msg_len: u32,
    agg_op: u8,
    dtype: u8,
    mask_base: u16,
    contributors: u64,
    chunks: Vec<u32>,
}

/// The chunks taken since the last flush, grouped by operation.
#[derive(Debug, Default)]
pub(super) struct AckBatch {
    ops: Vec<OpAcks>,
    /// Spare chunk lists (kept to avoid allocating every round).
    spare: Vec<Vec<u32>>,
}

/// Bits of the largest bitmap.
const MAX_BITS: u32 = (AGG_ACKS_MAX_BYTES * 8) as u32;

impl AckBatch {
    pub(super) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Chunk `chunk` of operation `op_id` was taken: acknowledge it to
    /// every contributor (bit i of `contributors` = rank mask_base + i).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add(
        &mut self,
        op_id: u32,
        chunk: u32,
        msg_len: u32,
        agg_op: u8,
        dtype: u8,
        mask_base: u16,
        contributors: u64,
    ) {
        let same = |o: &&mut OpAcks| {
            (o.op_id, o.msg_len, o.agg_op, o.dtype, o.mask_base, o.contributors)
                == (op_id, msg_len, agg_op, dtype, mask_base, contributors)
        };
        if let Some(o) = self.ops.iter_mut().find(same) {
            o.chunks.push(chunk);
            return;
        }
        let mut chunks = self.spare.pop().unwrap_or_default();
        chunks.push(chunk);
        self.ops.push(OpAcks { op_id, msg_len, agg_op, dtype, mask_base, contributors, chunks });
    }

    /// Appends one KCCL_T_AGG_ACKS datagram per contributor and run of at
    /// most 8192 chunks to `arena` and its (address, start, length) to
    /// `out`, then forgets the chunks.  `members[rank]`: the rank's
    /// address (ranks without one are skipped).  Returns the chunks
    /// acknowledged.
    pub(super) fn encode(
        &mut self,
        job_id: u32,
        my_rank: u16,
        chunk_bytes: usize,
        members: &[Option<SocketAddrV4>],
        arena: &mut Vec<u8>,
        out: &mut Vec<(SocketAddrV4, usize, usize)>,
    ) -> u64 {
        let mut taken = 0;
        let mut bitmap = [0u8; AGG_ACKS_MAX_BYTES];
        for mut o in self.ops.drain(..) {
            o.chunks.sort_unstable();
            o.chunks.dedup();
            taken += o.chunks.len() as u64;
            let mut rest = &o.chunks[..];
            while let Some(&first) = rest.first() {
                let n = rest.iter().take_while(|&&c| c - first < MAX_BITS).count();
                let (run, tail) = rest.split_at(n);
                rest = tail;
                let last = run[n - 1] - first;
                let len = last as usize / 8 + 1;
                bitmap[..len].fill(0);
                for &c in run {
                    let i = (c - first) as usize;
                    bitmap[i / 8] |= 1 << (i % 8);
                }
                let mut h = Header {
                    version: VERSION,
                    msg_type: T_AGG_ACKS,
                    flags: 0,
                    job_id,
                    src_rank: my_rank,
                    mask_base: o.mask_base,
                    dst_mask: 0,
                    msg_seq: o.op_id,
                    frag_off: (first as usize * chunk_bytes) as u32,
                    msg_len: o.msg_len,
                    payload_len: len as u16,
                    agg_op: o.agg_op,
                    dtype: o.dtype,
                };
                let mut bits = o.contributors;
                while bits != 0 {
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    let Some(Some(to)) = members.get(usize::from(o.mask_base) + b as usize) else { continue };
                    h.dst_mask = 1 << b;
                    let start = arena.len();
                    let mut hb = [0u8; HDR_LEN];
                    h.encode(&mut hb);
                    arena.extend_from_slice(&hb);
                    arena.extend_from_slice(&bitmap[..len]);
                    out.push((*to, start, HDR_LEN + len));
                }
            }
            o.chunks.clear();
            self.spare.push(o.chunks);
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn addr(rank: u16) -> Option<SocketAddrV4> {
        Some(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, rank as u8), 7000))
    }

    /// Decodes every datagram: (to, header, chunks acknowledged).
    fn sent(arena: &[u8], out: &[(SocketAddrV4, usize, usize)], chunk: usize) -> Vec<(SocketAddrV4, Header, Vec<u32>)> {
        out.iter()
            .map(|&(to, start, len)| {
                let (h, p) = Header::decode(&arena[start..start + len]).expect("decodes");
                let first = h.frag_off as usize / chunk;
                let chunks =
                    (0..p.len() * 8).filter(|i| p[i / 8] >> (i % 8) & 1 == 1).map(|i| (first + i) as u32).collect();
                (to, h, chunks)
            })
            .collect()
    }

    #[test]
    fn one_bitmap_per_contributor_and_operation() {
        let mut b = AckBatch::default();
        let members = [None, addr(1), addr(2), addr(3)];
        // Contributors ranks 1 and 3 (mask_base 1: bits 0 and 2), chunks out of order, one twice.
        for c in [5, 3, 9, 3] {
            b.add(12, c, 100 * 1000, 1, 1, 1, 0b101);
        }
        let (mut arena, mut out) = (Vec::new(), Vec::new());
        assert_eq!(b.encode(7, 0, 1000, &members, &mut arena, &mut out), 3);
        assert!(b.is_empty());
        let s = sent(&arena, &out, 1000);
        assert_eq!(s.len(), 2);
        for (k, (to, h, chunks)) in s.iter().enumerate() {
            assert_eq!(*to, members[1 + 2 * k].expect("member"));
            assert_eq!((h.msg_type, h.job_id, h.src_rank, h.msg_seq, h.frag_off), (T_AGG_ACKS, 7, 0, 12, 3000));
            assert_eq!((h.mask_base, h.dst_mask, h.payload_len), (1, 1 << (2 * k), 1));
            assert_eq!(chunks, &[3, 5, 9]);
        }
    }

    #[test]
    fn runs_longer_than_a_bitmap_split() {
        let mut b = AckBatch::default();
        let members = [None, addr(1)];
        for c in [0, MAX_BITS - 1, MAX_BITS, 3 * MAX_BITS] {
            b.add(4, c, u32::MAX, 2, 1, 1, 1);
        }
        let (mut arena, mut out) = (Vec::new(), Vec::new());
        b.encode(7, 0, 8, &members, &mut arena, &mut out);
        let s = sent(&arena, &out, 8);
        let runs: Vec<Vec<u32>> = s
            .into_iter()
            .map(|(_, h, c)| {
                assert!(h.payload_len as usize <= AGG_ACKS_MAX_BYTES);
                c
            })
            .collect();
        assert_eq!(runs, vec![vec![0, MAX_BITS - 1], vec![MAX_BITS], vec![3 * MAX_BITS]]);
    }
}
