//! Aggregation-specific checks on top of [`Header::decode`]: what makes a
//! contribution or an answer well-formed (docs/AGGREGATION.md, "Packets").
//! Both the user-space aggregator and the contributors use these, so the two
//! ends agree on what is malformed.

use crate::wire::{Header, DT_F32Q, DT_I32, DT_I64, F_LAST_FRAG, HDR_LEN, MASK_BITS, OP_AVG, OP_SUM, T_AGG, VERSION};

/// Wire bytes of one element of `dtype` (0 for an unknown type).
pub fn elem_size(dtype: u8) -> usize {
    match dtype {
        DT_I32 | DT_F32Q => 4,
        DT_I64 => 8,
        _ => 0,
    }
}

/// Why a contribution was refused (each is a counter of the aggregator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// Not a T_AGG packet.
    NotContribution,
    /// Op or dtype outside the enums of kccl_wire.h.
    Unsupported,
    /// Chunk geometry or sizes inconsistent (see [`check_contribution`]).
    Malformed,
    /// The sender is not in the packet's contributor mask, or the mask is
    /// not a 64-aligned window.
    NotContributor,
}

/// Checks a decoded T_AGG packet against the job's chunk size `chunk`
/// (bytes).  A contribution is well-formed when: op and dtype are known; the
/// contributor mask is a 64-aligned window holding the sender; `frag_off` is
/// a multiple of `chunk`; the payload is non-empty, a whole number of
/// elements and at most `chunk` bytes; a non-last chunk is exactly `chunk`
/// bytes and the last one ends the message (and carries LAST_FRAG);
/// `msg_len` is a whole number of elements.
pub fn check_contribution(h: &Header, chunk: usize) -> Result<(), Reject> {
    if h.msg_type != T_AGG {
        return Err(Reject::NotContribution);
    }
    if !(OP_SUM..=OP_AVG).contains(&h.agg_op) {
        return Err(Reject::Unsupported);
    }
    let es = elem_size(h.dtype);
    if es == 0 {
        return Err(Reject::Unsupported);
    }
    check_geometry(h, chunk, es)?;
    let base = h.mask_base as usize;
    if base % MASK_BITS != 0 {
        return Err(Reject::Malformed);
    }
    let r = h.src_rank as usize;
    if r < base || r - base >= MASK_BITS || h.dst_mask & (1u64 << (r - base)) == 0 {
        return Err(Reject::NotContributor);
    }
    Ok(())
}

/// Chunk geometry shared by contributions and RESULT answers.
fn check_geometry(h: &Header, chunk: usize, es: usize) -> Result<(), Reject> {
    let plen = h.payload_len as usize;
    let off = h.frag_off as usize;
    let len = h.msg_len as usize;
    if chunk == 0 || plen == 0 || plen > chunk || plen % es != 0 || len % es != 0 || off % chunk != 0 {
        return Err(Reject::Malformed);
    }
    let end = off + plen;
    let last = end == len;
    if end > len || (!last && plen != chunk) || last != (h.flags & F_LAST_FRAG != 0) {
        return Err(Reject::Malformed);
    }
    Ok(())
}

/// Wire bytes of chunk `c` of a message of `msg_len` bytes.
pub fn chunk_len(msg_len: usize, chunk: usize, c: usize) -> usize {
    msg_len.saturating_sub(c * chunk).min(chunk)
}

/// Number of chunks of a message (0 for an empty one).
pub fn chunk_count(msg_len: usize, chunk: usize) -> usize {
    msg_len.div_ceil(chunk)
}

/// Header of chunk `c` of a contribution.
#[allow(clippy::too_many_arguments)]
pub fn contribution_header(
    job_id: u32,
    src_rank: u16,
    mask_base: u16,
    mask: u64,
    op_id: u32,
    chunk: usize,
    c: usize,
    msg_len: usize,
    agg_op: u8,
    dtype: u8,
    flags: u16,
) -> Header {
    let plen = chunk_len(msg_len, chunk, c);
    let last = (c + 1) * chunk >= msg_len;
    Header {
        version: VERSION,
        msg_type: T_AGG,
        flags: flags | if last { F_LAST_FRAG } else { 0 },
        job_id,
        src_rank,
        mask_base,
        dst_mask: mask,
        msg_seq: op_id,
        frag_off: (c * chunk) as u32,
        msg_len: msg_len as u32,
        payload_len: plen as u16,
        agg_op,
        dtype,
    }
}

/// Largest datagram of aggregation traffic for chunk size `chunk`.
pub fn max_dgram(chunk: usize) -> usize {
    HDR_LEN + chunk
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{F_ALLREDUCE, OP_COUNT};

    fn h(c: usize, msg_len: usize, dtype: u8) -> Header {
        contribution_header(1, 2, 0, 0b110, 9, 1432, c, msg_len, OP_SUM, dtype, F_ALLREDUCE)
    }

    #[test]
    fn well_formed_contributions() {
        // 1000 int32 = 4000 bytes = 1432 + 1432 + 1136.
        for c in 0..3 {
            assert_eq!(check_contribution(&h(c, 4000, DT_I32), 1432), Ok(()), "chunk {c}");
        }
        assert_eq!(h(2, 4000, DT_I32).payload_len, 1136);
        assert_eq!(h(2, 4000, DT_I32).flags & F_LAST_FRAG, F_LAST_FRAG);
        assert_eq!(h(1, 4000, DT_I32).flags & F_LAST_FRAG, 0);
        assert_eq!(chunk_count(4000, 1432), 3);
        assert_eq!(chunk_count(0, 1432), 0);
        assert_eq!(check_contribution(&h(0, 8, DT_I64), 1432), Ok(()));
    }

    #[test]
    fn malformed_contributions() {
        let chunk = 1432;
        let mut x = h(0, 4000, DT_I32);
        x.frag_off = 4; // not a chunk boundary
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let mut x = h(0, 4000, DT_I32);
        x.payload_len = 1428; // non-last chunk shorter than the chunk size
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let mut x = h(2, 4002, DT_I32);
        x.payload_len = 1138; // not whole int32 elements
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let x = h(0, 12, DT_I64); // 12 bytes is not whole int64 elements
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let mut x = h(2, 4000, DT_I32);
        x.flags &= !F_LAST_FRAG; // last chunk without LAST_FRAG
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let mut x = h(0, 4000, DT_I32);
        x.flags |= F_LAST_FRAG; // LAST_FRAG on a middle chunk
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let mut x = h(0, 4000, DT_I32);
        x.agg_op = 0;
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Unsupported));
        x.agg_op = OP_COUNT;
        x.dtype = 9;
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Unsupported));
        let mut x = h(0, 4000, DT_I32);
        x.src_rank = 3; // bit 3 not in 0b110
        assert_eq!(check_contribution(&x, chunk), Err(Reject::NotContributor));
        let mut x = h(0, 4000, DT_I32);
        x.mask_base = 3;
        assert_eq!(check_contribution(&x, chunk), Err(Reject::Malformed));
        let mut x = h(0, 4000, DT_F32Q);
        x.msg_type = crate::wire::T_BCAST;
        assert_eq!(check_contribution(&x, chunk), Err(Reject::NotContribution));
        // Chunk larger than the job's chunk size.
        assert_eq!(check_contribution(&h(0, 4000, DT_I32), 1000), Err(Reject::Malformed));
    }
}
