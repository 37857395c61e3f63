//! From member data to wire elements and from aggregated int64 (or wire
//! width) values back to the caller's element type.
//!
//! Encodings (chosen per element type and op; docs/AGGREGATION.md):
//! - i32 → I32, i64 → I64: as is;
//! - f32 SUM/AVG → F32Q: quantized with per-block scales (or one fixed
//!   scale); a reduce message starts with a prefix of int32 elements (the
//!   agreed block exponents, see mod.rs);
//! - f32 MAX/MIN → I32: the order-preserving integer image of the float
//!   bits, so MAX/MIN of floats is exact and needs no scale;
//! - f32 COUNT → I32: 1 for a non-zero element, else 0.

use crate::agg::quant;
use crate::simd::avx2;
use crate::wire::{DT_F32Q, DT_I32, DT_I64, OP_AVG, OP_COUNT, OP_MAX, OP_MIN, OP_SUM};

/// A member's data, by element type.
#[derive(Debug, Clone, Copy)]
pub enum Src<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
    F32(&'a [f32]),
}

/// The caller's output, by element type.
#[derive(Debug)]
pub enum Dst<'a> {
    I32(&'a mut [i32]),
    I64(&'a mut [i64]),
    F32(&'a mut [f32]),
}

impl Src<'_> {
    pub fn len(&self) -> usize {
        match self {
            Src::I32(d) => d.len(),
            Src::I64(d) => d.len(),
            Src::F32(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Order-preserving map of float32 bits to int32 (an involution): negative
/// floats have their magnitude bits flipped, so integer order is float order.
#[inline]
pub fn f32_ordered(x: f32) -> i32 {
    let b = x.to_bits() as i32;
    if b < 0 {
        b ^ 0x7fff_ffff
    } else {
        b
    }
}

#[inline]
pub fn f32_from_ordered(v: i32) -> f32 {
    let b = if v < 0 { v ^ 0x7fff_ffff } else { v };
    f32::from_bits(b as u32)
}

/// How one member's data becomes the message's wire elements.
#[derive(Debug, Clone, Copy)]
pub enum Enc<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
    /// Quantized float32: element `i` of `data` uses `scales[i / block]`;
    /// the message is `prefix` followed by the quantized data.
    F32Q {
        data: &'a [f32],
        scales: &'a [f64],
        block: usize,
        prefix: &'a [i32],
    },
    F32Ord(&'a [f32]),
    F32NonZero(&'a [f32]),
}

impl Enc<'_> {
    pub fn dtype(&self) -> u8 {
        match self {
            Enc::I64(_) => DT_I64,
            Enc::F32Q { .. } => DT_F32Q,
            _ => DT_I32,
        }
    }

    pub fn elem_size(&self) -> usize {
        if self.dtype() == DT_I64 {
            8
        } else {
            4
        }
    }

    /// Elements of the message (prefix included).
    pub fn elems(&self) -> usize {
        match self {
            Enc::I32(d) => d.len(),
            Enc::I64(d) => d.len(),
            Enc::F32Q { data, prefix, .. } => prefix.len() + data.len(),
            Enc::F32Ord(d) | Enc::F32NonZero(d) => d.len(),
        }
    }

    pub fn msg_len(&self) -> usize {
        self.elems() * self.elem_size()
    }

    /// The message of elements `r` alone (a shard of a sharded allreduce).
    /// For F32Q, `r.start` is a multiple of the block (shards are whole
    /// chunks) and there is no prefix (allreduce messages have none).
    pub fn slice(&self, r: std::ops::Range<usize>) -> Self {
        match *self {
            Enc::I32(d) => Enc::I32(&d[r]),
            Enc::I64(d) => Enc::I64(&d[r]),
            Enc::F32Ord(d) => Enc::F32Ord(&d[r]),
            Enc::F32NonZero(d) => Enc::F32NonZero(&d[r]),
            Enc::F32Q { data, scales, block, prefix } => {
                debug_assert!(
                    prefix.is_empty() && (scales.len() == 1 || r.start % block == 0),
                    "F32Q slice {r:?} of block {block}"
                );
                // A fixed scale is one block as long as the whole vector.
                let b = (r.start / block).min(scales.len().saturating_sub(1));
                Enc::F32Q { data: &data[r], scales: &scales[b..], block, prefix }
            }
        }
    }

    /// Writes message elements `[first, first + dst.len() / elem_size)` as
    /// big-endian wire bytes (in an AVX2 copy where the CPU has it).
    pub fn encode(&self, first: usize, dst: &mut [u8]) {
        avx2(
            #[inline(always)]
            || {
                let n = dst.len() / self.elem_size();
                match *self {
                    Enc::I32(d) => {
                        for (o, v) in dst.chunks_exact_mut(4).zip(&d[first..first + n]) {
                            o.copy_from_slice(&v.to_be_bytes());
                        }
                    }
                    Enc::I64(d) => {
                        for (o, v) in dst.chunks_exact_mut(8).zip(&d[first..first + n]) {
                            o.copy_from_slice(&v.to_be_bytes());
                        }
                    }
                    Enc::F32Ord(d) => {
                        for (o, &v) in dst.chunks_exact_mut(4).zip(&d[first..first + n]) {
                            o.copy_from_slice(&f32_ordered(v).to_be_bytes());
                        }
                    }
                    Enc::F32NonZero(d) => {
                        for (o, &v) in dst.chunks_exact_mut(4).zip(&d[first..first + n]) {
                            o.copy_from_slice(&i32::from(v != 0.0).to_be_bytes());
                        }
                    }
                    Enc::F32Q { data, scales, block, prefix } => {
                        let mut m = first;
                        let end = first + n;
                        let mut out = &mut dst[..];
                        // Prefix elements, then data split at block boundaries so
                        // every run has one scale.
                        while m < end && m < prefix.len() {
                            out[..4].copy_from_slice(&prefix[m].to_be_bytes());
                            out = &mut out[4..];
                            m += 1;
                        }
                        while m < end {
                            let i = m - prefix.len();
                            let b = i / block;
                            let run_end = ((b + 1) * block).min(end - prefix.len());
                            let run = &data[i..run_end];
                            let (head, rest) = out.split_at_mut(run.len() * 4);
                            quant::quantize_auto_be(run, scales[b], head);
                            out = rest;
                            m += run.len();
                        }
                    }
                }
            },
        )
    }
}

/// How aggregated values become the caller's elements.
#[derive(Debug, Clone, Copy)]
pub struct Finish<'a> {
    pub agg_op: u8,
    pub enc: FinEnc<'a>,
    /// Divisor of AVG: every contribution, the root's own included.
    pub count: usize,
}

#[derive(Debug, Clone, Copy)]
pub enum FinEnc<'a> {
    /// Integer data (i32/i64 outputs).
    Int,
    /// Quantized float32: scales per block of data elements.
    F32Q {
        scales: &'a [f64],
        block: usize,
    },
    F32Ord,
    F32NonZero,
}

/// Element `index` of the result does not fit the output type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfRange {
    pub index: usize,
    pub value: i128,
}

impl Finish<'_> {
    /// Turns aggregated values of data elements `[first, first + vals.len())`
    /// into output elements, folding in the local member's own element when
    /// `own` is given (the reduce root's data).
    pub fn apply(&self, vals: &[i64], first: usize, own: Option<Src<'_>>, dst: &mut Dst<'_>) -> Result<(), OutOfRange> {
        let n = vals.len();
        let op = self.agg_op;
        match (&self.enc, dst) {
            (FinEnc::Int, Dst::I32(out)) => {
                let own = match own {
                    Some(Src::I32(o)) => Some(&o[first..first + n]),
                    _ => None,
                };
                // The common case (a SUM, or any op but AVG without own
                // data) in one branch-free pass the compiler vectorizes; the
                // general loop below runs only to name an out-of-range
                // element.
                if op == OP_SUM || (own.is_none() && op != OP_AVG) {
                    let out = &mut out[first..first + n];
                    let mut bad = false;
                    match own {
                        Some(x) => {
                            for ((o, &v), &x) in out.iter_mut().zip(vals).zip(x) {
                                let r = v.saturating_add(i64::from(x));
                                bad |= r != i64::from(r as i32);
                                *o = r as i32;
                            }
                        }
                        None => {
                            for (o, &v) in out.iter_mut().zip(vals) {
                                bad |= v != i64::from(v as i32);
                                *o = v as i32;
                            }
                        }
                    }
                    if !bad {
                        return Ok(());
                    }
                }
                for (k, (&v, o)) in vals.iter().zip(out[first..first + n].iter_mut()).enumerate() {
                    let r = fold_int(op, v, own.map(|s| i64::from(s[k])), self.count);
                    *o = i32::try_from(r).map_err(|_| OutOfRange { index: first + k, value: r })?;
                }
            }
            (FinEnc::Int, Dst::I64(out)) => {
                let own = match own {
                    Some(Src::I64(o)) => Some(&o[first..first + n]),
                    _ => None,
                };
                for (k, (&v, o)) in vals.iter().zip(out[first..first + n].iter_mut()).enumerate() {
                    let r = fold_int(op, v, own.map(|s| s[k]), self.count);
                    *o = i64::try_from(r).map_err(|_| OutOfRange { index: first + k, value: r })?;
                }
            }
            (enc, Dst::F32(out)) => {
                let own = match own {
                    Some(Src::F32(o)) => Some(&o[first..first + n]),
                    _ => None,
                };
                let out = &mut out[first..first + n];
                match *enc {
                    FinEnc::F32Q { scales, block } => {
                        let div = if op == OP_AVG { self.count.max(1) as f64 } else { 1.0 };
                        for (k, end, b) in scale_runs(first, n, block) {
                            let d = scales[b] * div;
                            let (v, o) = (&vals[k..end], &mut out[k..end]);
                            match own {
                                Some(x) => {
                                    let x = &x[k..end];
                                    for ((o, &v), &x) in o.iter_mut().zip(v).zip(x) {
                                        *o = ((v as f64 / scales[b] + f64::from(x)) / div) as f32;
                                    }
                                }
                                None => {
                                    for (o, &v) in o.iter_mut().zip(v) {
                                        *o = (v as f64 / d) as f32;
                                    }
                                }
                            }
                        }
                    }
                    FinEnc::F32Ord => {
                        for (k, (&v, o)) in vals.iter().zip(out.iter_mut()).enumerate() {
                            let x = f32_from_ordered(v as i32);
                            *o = match own.map(|s| s[k]) {
                                Some(m) if op == OP_MAX => x.max(m),
                                Some(m) if op == OP_MIN => x.min(m),
                                _ => x,
                            };
                        }
                    }
                    FinEnc::F32NonZero | FinEnc::Int => {
                        for (k, (&v, o)) in vals.iter().zip(out.iter_mut()).enumerate() {
                            let mine = own.map_or(0, |x| i64::from(x[k] != 0.0));
                            *o = (v + mine) as f32;
                        }
                    }
                }
            }
            // Element type and encoding are chosen together in mod.rs.
            (_, _) => {}
        }
        Ok(())
    }
}

impl Finish<'_> {
    /// [`Finish::apply`] without own data, of wire values (`payload`: the
    /// big-endian elements of `dtype`), as an allreduce member finishes a
    /// RESULT chunk.  The common cases (int32 results of any op but AVG,
    /// quantized float32 SUM/AVG) go from the wire bytes into the output in
    /// one pass (in an AVX2 copy where the CPU has it); the others are read
    /// into `scratch` as int64 first.
    pub fn apply_wire(
        &self,
        payload: &[u8],
        dtype: u8,
        first: usize,
        dst: &mut Dst<'_>,
        scratch: &mut Vec<i64>,
    ) -> Result<(), OutOfRange> {
        avx2(
            #[inline(always)]
            || {
                let n = payload.len() / 4;
                let wire = |k: usize, end: usize| {
                    payload[k * 4..end * 4].chunks_exact(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                };
                match (&self.enc, &mut *dst) {
                    (FinEnc::Int, Dst::I32(out)) if dtype != DT_I64 && self.agg_op != OP_AVG => {
                        for (o, v) in out[first..first + n].iter_mut().zip(wire(0, n)) {
                            *o = v;
                        }
                        Ok(())
                    }
                    (&FinEnc::F32Q { scales, block }, Dst::F32(out)) if matches!(self.agg_op, OP_SUM | OP_AVG) => {
                        let div = if self.agg_op == OP_AVG { self.count.max(1) as f64 } else { 1.0 };
                        let out = &mut out[first..first + n];
                        for (k, end, b) in scale_runs(first, n, block) {
                            let d = scales[b] * div;
                            match exact_reciprocal(d) {
                                // Every automatic scale of a SUM: multiplying is
                                // several times cheaper than dividing, same result.
                                Some(r) => {
                                    for (o, v) in out[k..end].iter_mut().zip(wire(k, end)) {
                                        *o = (f64::from(v) * r) as f32;
                                    }
                                }
                                None => {
                                    for (o, v) in out[k..end].iter_mut().zip(wire(k, end)) {
                                        *o = (f64::from(v) / d) as f32;
                                    }
                                }
                            }
                        }
                        Ok(())
                    }
                    _ => {
                        read_wire(payload, dtype, scratch);
                        self.apply(scratch, first, None, dst)
                    }
                }
            },
        )
    }
}

/// `1 / d` when it is exact (`d` a normal power of two whose reciprocal is
/// normal too): then `v * (1 / d) == v / d` for every `v`.
#[inline]
fn exact_reciprocal(d: f64) -> Option<f64> {
    let r = 1.0 / d;
    let mantissa = (1u64 << 52) - 1;
    (d.is_normal() && r.is_normal() && d.to_bits() & mantissa == 0).then_some(r)
}

/// The runs of one scale among elements `[first, first + n)` with a scale
/// per `block` elements: (start, end) relative to `first`, and the block.
/// Finishing a run at a time needs no per-element index arithmetic.
fn scale_runs(first: usize, n: usize, block: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let mut k = 0;
    std::iter::from_fn(move || {
        if k >= n {
            return None;
        }
        let b = (first + k) / block;
        let end = (b.saturating_add(1).saturating_mul(block) - first).min(n);
        let run = (k, end, b);
        k = end;
        Some(run)
    })
}

/// Combines a contributors' aggregate with the root's own value (if any)
/// and applies AVG's division (truncating toward zero).
#[inline]
fn fold_int(op: u8, v: i64, own: Option<i64>, count: usize) -> i128 {
    let v = i128::from(v);
    let r = match (op, own) {
        (_, None) => v,
        (OP_SUM | OP_AVG, Some(o)) => v + i128::from(o),
        (OP_MAX, Some(o)) => v.max(i128::from(o)),
        (OP_MIN, Some(o)) => v.min(i128::from(o)),
        (OP_COUNT, Some(o)) => v + i128::from(o != 0),
        (_, Some(_)) => v,
    };
    if op == OP_AVG {
        r / count.max(1) as i128
    } else {
        r
    }
}

/// Finalizes a result that has no contributions but the local member's own
/// data (a reduce root without contributors).
pub fn own_only(f: &Finish<'_>, own: Src<'_>, dst: &mut Dst<'_>) -> Result<(), OutOfRange> {
    match f.agg_op {
        // Folding own data into an empty sum/count leaves own data.
        OP_SUM | OP_AVG | OP_COUNT => f.apply(&vec![0i64; own.len()], 0, Some(own), dst),
        // MAX/MIN: the aggregate is own data itself, in its wire image.
        _ => {
            let vals: Vec<i64> = match own {
                Src::I32(d) => d.iter().map(|&x| i64::from(x)).collect(),
                Src::I64(d) => d.to_vec(),
                Src::F32(d) => d.iter().map(|&x| i64::from(f32_ordered(x))).collect(),
            };
            f.apply(&vals, 0, None, dst)
        }
    }
}

/// Reads `n` big-endian wire values of `dtype` into `out` as int64.
pub fn read_wire(payload: &[u8], dtype: u8, out: &mut Vec<i64>) {
    out.clear();
    if dtype == DT_I64 {
        out.extend(
            payload.chunks_exact(8).map(|b| i64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])),
        );
    } else {
        out.extend(payload.chunks_exact(4).map(|b| i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_floats_sort_like_floats() {
        let xs = [-f32::MAX, -3.5, -1e-40, -0.0, 0.0, 1e-45, 2.0, f32::MAX];
        for w in xs.windows(2) {
            assert!(f32_ordered(w[0]) < f32_ordered(w[1]), "{} < {}", w[0], w[1]);
        }
        for x in xs {
            assert_eq!(f32_from_ordered(f32_ordered(x)).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn encode_f32q_with_prefix_splits_blocks() {
        let data = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        let scales = [2.0, 4.0, 8.0];
        let prefix = [7, 8];
        let e = Enc::F32Q { data: &data, scales: &scales, block: 2, prefix: &prefix };
        assert_eq!((e.elems(), e.msg_len(), e.dtype()), (7, 28, DT_F32Q));
        let mut all = vec![0u8; 28];
        e.encode(0, &mut all);
        let vals: Vec<i32> = all.chunks_exact(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(vals, vec![7, 8, 2, 4, 12, 16, 40]);
        // An arbitrary window gives the same bytes.
        let mut part = vec![0u8; 12];
        e.encode(1, &mut part);
        assert_eq!(part, all[4..16]);
    }

    #[test]
    fn finish_folds_own_and_averages() {
        let f = Finish { agg_op: OP_AVG, enc: FinEnc::Int, count: 3 };
        let mut out = vec![0i32; 2];
        f.apply(&[10, -10], 0, Some(Src::I32(&[2, -1])), &mut Dst::I32(&mut out)).expect("fits");
        assert_eq!(out, vec![4, -3], "truncating toward zero");
        let f = Finish { agg_op: OP_SUM, enc: FinEnc::Int, count: 2 };
        let e = f.apply(&[i32::MAX as i64], 0, Some(Src::I32(&[1])), &mut Dst::I32(&mut out[..1]));
        assert_eq!(e, Err(OutOfRange { index: 0, value: i32::MAX as i128 + 1 }));
        // The one-pass SUM and no-own paths: exact values, and the first
        // element out of range named.
        let mut out = vec![0i32; 5];
        let vals = [1, -2, i32::MIN as i64, 7, i32::MAX as i64 - 5];
        f.apply(&vals, 0, Some(Src::I32(&[1, 2, 0, -7, 5])), &mut Dst::I32(&mut out)).expect("fits");
        assert_eq!(out, vec![2, 0, i32::MIN, 0, i32::MAX]);
        let e = f.apply(&vals, 0, Some(Src::I32(&[0, 0, -1, 0, 9])), &mut Dst::I32(&mut out));
        assert_eq!(e, Err(OutOfRange { index: 2, value: i32::MIN as i128 - 1 }));
        let f = Finish { agg_op: OP_MIN, enc: FinEnc::Int, count: 2 };
        let e = f.apply(&[0, 1 << 40], 10, None, &mut Dst::I32(&mut [0i32; 12]));
        assert_eq!(e, Err(OutOfRange { index: 11, value: 1 << 40 }));
        let f = Finish { agg_op: OP_MAX, enc: FinEnc::F32Ord, count: 2 };
        let mut fo = vec![0f32; 2];
        let agg = [i64::from(f32_ordered(-1.0)), i64::from(f32_ordered(3.0))];
        f.apply(&agg, 0, Some(Src::F32(&[0.5, 2.0])), &mut Dst::F32(&mut fo)).expect("ok");
        assert_eq!(fo, vec![0.5, 3.0]);
        let f = Finish { agg_op: OP_SUM, enc: FinEnc::F32Q { scales: &[4.0], block: 8 }, count: 2 };
        f.apply(&[6], 0, Some(Src::F32(&[0.25])), &mut Dst::F32(&mut fo[..1])).expect("ok");
        assert_eq!(fo[0], 1.75);
    }

    /// apply_wire's one-pass cases give exactly what reading the wire into
    /// int64 and apply give, and the other cases go through that path.
    #[test]
    fn reciprocals_are_exact_only_for_powers_of_two() {
        for k in [-1022, -1000, -104, -1, 0, 1, 29, 184, 1022] {
            let d = 2f64.powi(k);
            assert_eq!(exact_reciprocal(d), Some(2f64.powi(-k)), "2^{k}");
        }
        for d in [3.0, 1e8, 2f64.powi(1023), 2f64.powi(-1023), 0.0, f64::INFINITY, f64::NAN, -0.0] {
            assert_eq!(exact_reciprocal(d), None, "{d:e}");
        }
    }

    #[test]
    fn apply_wire_matches_read_then_apply() {
        let vals: Vec<i32> = (0..37).map(|i| (i * 7919 - 120_000) * if i % 3 == 0 { -1 } else { 1 }).collect();
        let wire: Vec<u8> = vals.iter().flat_map(|v| v.to_be_bytes()).collect();
        let scales = [4.0, 0.5, 1024.0, 3.0];
        let ints = [OP_SUM, OP_MAX, OP_MIN, OP_COUNT, OP_AVG];
        for (agg_op, enc) in ints
            .iter()
            .map(|&o| (o, FinEnc::Int))
            .chain([OP_SUM, OP_AVG].iter().map(|&o| (o, FinEnc::F32Q { scales: &scales, block: 11 })))
            .chain([(OP_MAX, FinEnc::F32Ord), (OP_COUNT, FinEnc::F32NonZero)])
        {
            let f = Finish { agg_op, enc, count: 3 };
            let first = 5;
            let mut scratch = Vec::new();
            let mut v64 = Vec::new();
            read_wire(&wire, DT_I32, &mut v64);
            if matches!(enc, FinEnc::Int) {
                let (mut a, mut b) = (vec![0i32; 42], vec![0i32; 42]);
                f.apply_wire(&wire, DT_I32, first, &mut Dst::I32(&mut a), &mut scratch).expect("fits");
                f.apply(&v64, first, None, &mut Dst::I32(&mut b)).expect("fits");
                assert_eq!(a, b, "op {agg_op}");
            } else {
                let (mut a, mut b) = (vec![0f32; 42], vec![0f32; 42]);
                f.apply_wire(&wire, DT_F32Q, first, &mut Dst::F32(&mut a), &mut scratch).expect("fits");
                f.apply(&v64, first, None, &mut Dst::F32(&mut b)).expect("fits");
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "op {agg_op} {enc:?}");
            }
        }
        // int64 wire values go through the general path, range check included.
        let big: Vec<u8> = [5i64, 1 << 40].iter().flat_map(|v| v.to_be_bytes()).collect();
        let f = Finish { agg_op: OP_SUM, enc: FinEnc::Int, count: 2 };
        let e = f.apply_wire(&big, DT_I64, 0, &mut Dst::I32(&mut [0i32; 2]), &mut Vec::new());
        assert_eq!(e, Err(OutOfRange { index: 1, value: 1 << 40 }));
    }

    #[test]
    fn own_only_results() {
        let mut out = vec![0i32; 3];
        let f = Finish { agg_op: OP_COUNT, enc: FinEnc::Int, count: 1 };
        own_only(&f, Src::I32(&[0, 5, -1]), &mut Dst::I32(&mut out)).expect("ok");
        assert_eq!(out, vec![0, 1, 1]);
        let f = Finish { agg_op: OP_MIN, enc: FinEnc::F32Ord, count: 1 };
        let mut fo = vec![0f32; 2];
        own_only(&f, Src::F32(&[-2.5, 1.0]), &mut Dst::F32(&mut fo)).expect("ok");
        assert_eq!(fo, vec![-2.5, 1.0]);
    }
}
