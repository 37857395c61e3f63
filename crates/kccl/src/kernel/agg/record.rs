//! Completed reduce chunks as xdp_agg writes them to its ring buffer
//! (struct kccl_agg_record): bounds-checked parsing of the header and the
//! int64 accumulators.

use std::mem::offset_of;

use super::{MAX_ELEMS, RECORD_HDR_LEN};
use crate::error::{Error, Result};
use crate::skel_agg::types::kccl_agg_record;

// enum kccl_dtype
pub(super) const DT_I32: u8 = 1;
pub(super) const DT_I64: u8 = 2;
pub(super) const DT_F32Q: u8 = 3;

/// The header of a completed reduce chunk (struct kccl_agg_record without
/// its values): what xdp_agg writes to its ring buffer and keeps in a slot's
/// `rec`, and what the user-space aggregator delivers in the same form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AggRecord {
    pub job_id: u32,
    pub op_id: u32,
    pub frag_off: u32,
    pub msg_len: u32,
    pub payload_len: u16,
    pub mask_base: u16,
    pub agg_op: u8,
    pub dtype: u8,
    /// An int64 sum overflowed (I64 only): the values are not the true sums.
    pub overflow: bool,
    /// The contributor set (bit i = rank mask_base + i).
    pub contributors: u64,
}

/// A completed reduce chunk: its header and its combined values as int64
/// (payload_len / element size of them), borrowed from the ring buffer or
/// from whoever holds them.  Derefs to the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggRecordView<'a> {
    pub rec: AggRecord,
    values: &'a [i64],
}

impl<'a> AggRecordView<'a> {
    pub fn new(rec: AggRecord, values: &'a [i64]) -> Self {
        AggRecordView { rec, values }
    }

    /// The chunk's combined values as int64.
    pub fn values(&self) -> &'a [i64] {
        self.values
    }
}

impl std::ops::Deref for AggRecordView<'_> {
    type Target = AggRecord;
    fn deref(&self) -> &AggRecord {
        &self.rec
    }
}

/// Wire element size of `dtype`, None for a type the kernel does not know.
pub fn dtype_size(dtype: u8) -> Option<usize> {
    match dtype {
        DT_I32 | DT_F32Q => Some(4),
        DT_I64 => Some(8),
        _ => None,
    }
}

pub(super) fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([b[off], b[off + 1]])
}

pub(super) fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

pub(super) fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_ne_bytes(a)
}

/// The header fields at the start of `b` as they lie, unchecked: the one
/// place that knows where each field of struct kccl_agg_record is.
pub(super) fn record_fields(b: &[u8]) -> Result<AggRecord> {
    type R = kccl_agg_record;
    if b.len() < RECORD_HDR_LEN {
        return Err(Error::AggRecord(format!("{} bytes, shorter than the {RECORD_HDR_LEN}-byte header", b.len())));
    }
    Ok(AggRecord {
        job_id: u32_at(b, offset_of!(R, job_id)),
        op_id: u32_at(b, offset_of!(R, op_id)),
        frag_off: u32_at(b, offset_of!(R, frag_off)),
        msg_len: u32_at(b, offset_of!(R, msg_len)),
        payload_len: u16_at(b, offset_of!(R, payload_len)),
        mask_base: u16_at(b, offset_of!(R, mask_base)),
        agg_op: b[offset_of!(R, agg_op)],
        dtype: b[offset_of!(R, dtype)],
        overflow: b[offset_of!(R, overflow)] != 0,
        contributors: u64_at(b, offset_of!(R, contributors)),
    })
}

/// The header of a record (or of a slot's `rec`) at the start of `b`,
/// checked: a known dtype and a whole number of elements, at most
/// MAX_ELEMS.  Returns it and the number of values.
pub(super) fn parse_record_header(b: &[u8]) -> Result<(AggRecord, usize)> {
    let rec = record_fields(b)?;
    let (payload_len, dtype) = (rec.payload_len, rec.dtype);
    let size = dtype_size(dtype).ok_or_else(|| Error::AggRecord(format!("unknown dtype {dtype}")))?;
    let nvalues = usize::from(payload_len) / size;
    if usize::from(payload_len) % size != 0 || nvalues > MAX_ELEMS {
        return Err(Error::AggRecord(format!(
            "payload_len {payload_len} is not a whole number of dtype {dtype} elements"
        )));
    }
    Ok((rec, nvalues))
}

/// The record `b` (as it lies in the ring buffer) as a view: its header
/// parsed, its int64 values borrowed in place.  The ring buffer keeps
/// records 8-byte aligned (BPF_RINGBUF_HDR_SZ, lengths rounded up to 8) and
/// the header is 32 bytes, so the values are aligned; a record that is not
/// is refused rather than copied.
pub(super) fn view(b: &[u8]) -> Result<AggRecordView<'_>> {
    let (rec, nvalues) = parse_record_header(b)?;
    let need = RECORD_HDR_LEN + nvalues * 8;
    let raw = b
        .get(RECORD_HDR_LEN..need)
        .ok_or_else(|| Error::AggRecord(format!("{} bytes, {need} needed for {nvalues} values", b.len())))?;
    // SAFETY: every bit pattern is a valid i64; align_to puts only whole,
    // aligned i64 in the middle part.
    let (head, values, tail) = unsafe { raw.align_to::<i64>() };
    if !head.is_empty() || !tail.is_empty() {
        return Err(Error::AggRecord(format!(
            "values at {:p} are not 8-byte aligned (the ring buffer aligns every record)",
            raw.as_ptr()
        )));
    }
    Ok(AggRecordView { rec, values })
}
