//! The accumulate loops of the user-space aggregator: big-endian values of
//! a contribution into int64 accumulators, and the accumulators back into
//! the wire type of the answer.

use crate::wire::{DT_I64, OP_AVG, OP_COUNT, OP_MAX, OP_MIN, OP_SUM};

/// Adds one contribution's big-endian values into the int64 accumulators
/// (`first`: the slot's first contribution initialises them).  Returns
/// whether an int64 sum overflowed.
pub(super) fn combine(acc: &mut [i64], payload: &[u8], dtype: u8, op: u8, first: bool) -> bool {
    if dtype == DT_I64 {
        let vals =
            payload.chunks_exact(8).map(|b| i64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]));
        combine_vals(acc, vals, op, first)
    } else {
        let vals = payload.chunks_exact(4).map(|b| i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]])));
        combine_vals(acc, vals, op, first)
    }
}

/// The op dispatch is outside the loops so that each loop is a plain
/// element-wise kernel the compiler vectorizes.
#[inline(always)]
fn combine_vals(acc: &mut [i64], vals: impl Iterator<Item = i64>, op: u8, first: bool) -> bool {
    let pairs = acc.iter_mut().zip(vals);
    match (first, op) {
        (true, OP_COUNT) => pairs.for_each(|(a, v)| *a = i64::from(v != 0)),
        (true, _) => pairs.for_each(|(a, v)| *a = v),
        (false, OP_SUM | OP_AVG) => {
            // Signed overflow iff both operands' signs differ from the
            // result's; OR the indicator over the chunk, test once.
            let mut ovf = 0i64;
            pairs.for_each(|(a, v)| {
                let r = a.wrapping_add(v);
                ovf |= (*a ^ r) & (v ^ r);
                *a = r;
            });
            return ovf < 0;
        }
        (false, OP_MAX) => pairs.for_each(|(a, v)| *a = (*a).max(v)),
        (false, OP_MIN) => pairs.for_each(|(a, v)| *a = (*a).min(v)),
        (false, OP_COUNT) => pairs.for_each(|(a, v)| *a += i64::from(v != 0)),
        // check_contribution admits no other op.
        (false, _) => {}
    }
    false
}

/// Writes the accumulators in the wire width: int32 types saturate.
/// Returns whether any element was saturated.
pub(in crate::agg) fn encode_result(acc: &[i64], dtype: u8, out: &mut [u8]) -> bool {
    if dtype == DT_I64 {
        for (o, a) in out.chunks_exact_mut(8).zip(acc) {
            o.copy_from_slice(&a.to_be_bytes());
        }
        return false;
    }
    let mut sat = false;
    for (o, &a) in out.chunks_exact_mut(4).zip(acc) {
        let v = a.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
        sat |= v != a;
        o.copy_from_slice(&(v as i32).to_be_bytes());
    }
    sat
}
