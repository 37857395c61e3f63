//! float32 → int32 quantization for aggregation (F32Q), as specified in
//! docs/AGGREGATION.md.
//!
//! Two modes:
//! - fixed scale `s` (AggBox uses 1e8): `q = round(x * s)`; an element with
//!   `|x * s| > 2^31 - 1` cannot be sent and is reported before anything is;
//! - automatic (SwitchML-style): per block of one chunk's elements, every
//!   member computes `e` = frexp exponent of the block's largest magnitude,
//!   the members agree on the maximum `e` (a MAX aggregation of one int32 per
//!   block), and the block's scale is `s = 2^(30 - e - h)`, where the headroom
//!   `h` is `ceil(log2 n)` when `n` contributions are summed in int32 (allreduce
//!   results travel in int32) and 0 when the sum is kept in int64 (reduce).
//!
//! Scales of the automatic mode are powers of two, so `x * s` and `q / s` are
//! exact in f64 and the only error is the rounding of `x * s` to an integer:
//! at most `1/(2s)` per contribution.

use crate::error::{Error, Result};
use crate::simd::avx2;

/// Exponent that stands for an all-zero block: lower than any finite
/// float32's (the smallest subnormal has -148), so a MAX over members picks
/// any real exponent, and small enough in magnitude that 64 of them summed
/// stay far inside int32.
pub const E_ZERO: i32 = -1000;

/// Absolute-value bits of +inf: finite floats have smaller ones.
const INF_BITS: u32 = 0x7f80_0000;

/// `frexp` exponent of a finite non-zero float32: `2^(e-1) <= |x| < 2^e`.
/// Zero gives [`E_ZERO`].
pub fn exponent(x: f32) -> i32 {
    exponent_of_abs_bits(x.to_bits() & 0x7fff_ffff)
}

fn exponent_of_abs_bits(bits: u32) -> i32 {
    if bits == 0 {
        return E_ZERO;
    }
    let biased = (bits >> 23) as i32;
    if biased == 0 {
        // Subnormal: |x| = m * 2^-149 with the top bit of m at position p.
        let p = 31 - bits.leading_zeros() as i32;
        return p - 148;
    }
    biased - 126
}

/// Index of the first NaN or infinity in `data`, if any.  Blocks of
/// elements are checked with an integer max (which vectorizes, unlike a
/// search that stops early); only a block that has one is searched.
pub fn first_non_finite(data: &[f32]) -> Option<usize> {
    const BLOCK: usize = 1024;
    avx2(
        #[inline(always)]
        || {
            data.chunks(BLOCK).enumerate().find_map(|(b, block)| {
                let max = block.iter().map(|x| x.to_bits() & 0x7fff_ffff).fold(0u32, u32::max);
                if max < INF_BITS {
                    return None;
                }
                block.iter().position(|x| x.to_bits() & 0x7fff_ffff >= INF_BITS).map(|i| b * BLOCK + i)
            })
        },
    )
}

/// Per-block exponents (blocks of `block` elements, the last one shorter):
/// the exponent of each block's largest magnitude.  Non-finite input is
/// refused with the index of the first offending element.
pub fn block_exponents(data: &[f32], block: usize, out: &mut Vec<i32>) -> Result<()> {
    out.clear();
    let block = block.max(1);
    out.reserve(data.len().div_ceil(block));
    avx2(
        #[inline(always)]
        || block_exponents_into(data, block, out),
    )
}

#[inline(always)]
fn block_exponents_into(data: &[f32], block: usize, out: &mut Vec<i32>) -> Result<()> {
    for (b, chunk) in data.chunks(block).enumerate() {
        // For non-negative floats (and the non-finite ones above them) the
        // bit patterns order like the values: an integer max, which the
        // compiler vectorizes, finds the largest magnitude.
        let max = chunk.iter().map(|x| x.to_bits() & 0x7fff_ffff).fold(0u32, u32::max);
        if max >= INF_BITS {
            let i = first_non_finite(chunk).unwrap_or(0);
            return Err(Error::NonFinite { index: b * block + i });
        }
        out.push(exponent_of_abs_bits(max));
    }
    Ok(())
}

/// `ceil(log2 n)`: the bits a sum of `n` values can grow by.
pub fn headroom(n: usize) -> u32 {
    n.max(1).next_power_of_two().trailing_zeros()
}

/// Scale of a block with agreed exponent `e` and headroom `h`:
/// `2^(30 - e - h)`, so that `n <= 2^h` contributions of magnitude
/// `< 2^e` sum to at most `2^30` after scaling.
pub fn auto_scale(e: i32, h: u32) -> f64 {
    if e <= E_ZERO {
        return 1.0; // every contribution of the block is zero
    }
    // f64 covers 2^-1074..2^1023: e is in [-148, 128], h <= 6.
    pow2(30 - e - h as i32)
}

fn pow2(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// Round-half-away-from-zero of `x * s`.  With `x` a float32 and `s` a power
/// of two, `x * s` has at most 24 significant bits, so adding ±0.5 is exact
/// and truncation rounds correctly (no libm call: this loop is hot).
#[inline]
pub fn quantize(x: f32, s: f64) -> i64 {
    let v = f64::from(x) * s;
    (v + 0.5f64.copysign(v)) as i64
}

/// Quantizes a run of one scale into big-endian int32 wire bytes
/// (`dst.len() == 4 * src.len()`).  Every `|x * s| + 0.5` is below 2^31
/// (automatic scales by construction, fixed ones by [`check_fixed`]), so
/// the rounding converts straight to int32 (which vectorizes; int64 does
/// not below AVX-512) and equals [`quantize`].  Inlined into its caller's
/// AVX2 copy (crate::simd).
#[inline(always)]
pub fn quantize_auto_be(src: &[f32], s: f64, dst: &mut [u8]) {
    for (d, &x) in dst.chunks_exact_mut(4).zip(src) {
        let v = f64::from(x) * s;
        d.copy_from_slice(&((v + 0.5f64.copysign(v)) as i32).to_be_bytes());
    }
}

/// Quantizes with a fixed scale into big-endian int32 wire bytes.  Returns
/// the index (within `src`) of the first element whose `|x * s|` exceeds
/// int32; nothing sensible can be sent for it.
pub fn quantize_fixed_be(src: &[f32], s: f64, dst: &mut [u8]) -> std::result::Result<(), usize> {
    let mut bad = false;
    for (d, &x) in dst.chunks_exact_mut(4).zip(src) {
        let q = quantize(x, s);
        bad |= q > i32::MAX as i64 || q < -(i32::MAX as i64);
        d.copy_from_slice(&(q as i32).to_be_bytes());
    }
    if bad {
        return Err(src.iter().position(|&x| quantize(x, s).unsigned_abs() > i32::MAX as u64).unwrap_or(0));
    }
    Ok(())
}

/// Checks a fixed scale before anything is sent: every `|x * s|` must fit
/// int32 (the sum may still overflow; that is detected by the aggregator).
pub fn check_fixed(data: &[f32], s: f64) -> Result<()> {
    if let Some(index) = first_non_finite(data) {
        return Err(Error::NonFinite { index });
    }
    if !(s.is_finite() && s > 0.0) {
        return Err(Error::Usage(format!("quantization scale {s} must be finite and positive")));
    }
    let limit = i32::MAX as f64;
    if let Some(i) = data.iter().position(|&x| (f64::from(x) * s).abs() + 0.5 >= limit + 1.0) {
        return Err(Error::Overflow {
            what: format!("quantizing element {i} ({}) with the fixed scale {s}", data[i]),
            detail: format!(
                "|x * s| = {:.3e} does not fit int32 (max {}); use a smaller scale or Quant::Auto",
                (f64::from(data[i]) * s).abs(),
                i32::MAX
            ),
        });
    }
    Ok(())
}

/// Worst-case absolute error of a sum of `n` contributions quantized with
/// scale `s`, before the final rounding to float32 (docs/AGGREGATION.md).
pub fn sum_error_bound(n: usize, s: f64) -> f64 {
    n as f64 / (2.0 * s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small deterministic generator (xorshift64*), no external crates.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// A finite float with any exponent (subnormals included), any sign.
        fn any_finite(&mut self) -> f32 {
            loop {
                let x = f32::from_bits(self.next() as u32);
                if x.is_finite() {
                    return x;
                }
            }
        }
    }

    fn libm_frexp_exp(x: f32) -> i32 {
        // Reference by repeated halving/doubling in f64 (exact).
        let mut v = f64::from(x).abs();
        let mut e = 0;
        while v >= 1.0 {
            v /= 2.0;
            e += 1;
        }
        while v < 0.5 {
            v *= 2.0;
            e -= 1;
        }
        e
    }

    #[test]
    fn exponent_matches_frexp() {
        let mut r = Rng(7);
        let special = [1.0f32, 0.5, 0.75, 2.0, -3.0, f32::MAX, f32::MIN_POSITIVE, 1e-45, -1e-45, 1.1754942e-38];
        for x in special.into_iter().chain((0..100_000).map(|_| r.any_finite())) {
            if x == 0.0 {
                assert_eq!(exponent(x), E_ZERO);
                continue;
            }
            let e = exponent(x);
            assert_eq!(e, libm_frexp_exp(x), "{x:e}");
            let a = f64::from(x).abs();
            assert!(a < 2f64.powi(e) && a >= 2f64.powi(e - 1), "{x:e} e={e}");
        }
        assert_eq!(exponent(0.0), E_ZERO);
        assert_eq!(exponent(-0.0), E_ZERO);
        assert_eq!(exponent(1e-45), -148); // smallest subnormal
        assert_eq!(exponent(f32::MAX), 128);
    }

    #[test]
    fn headroom_is_ceil_log2() {
        let cases = [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (16, 4), (17, 5), (63, 6), (64, 6)];
        for (n, h) in cases {
            assert_eq!(headroom(n), h, "n={n}");
        }
    }

    #[test]
    fn non_finite_is_refused_with_index() {
        let mut e = Vec::new();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
            for at in [0usize, 5, 357, 358, 1000] {
                let mut d = vec![1.5f32; 1001];
                d[at] = bad;
                match block_exponents(&d, 358, &mut e) {
                    Err(Error::NonFinite { index }) => assert_eq!(index, at, "{bad}"),
                    other => panic!("{bad} at {at}: {other:?}"),
                }
                match check_fixed(&d, 1e8) {
                    Err(Error::NonFinite { index }) => assert_eq!(index, at),
                    other => panic!("{bad} at {at}: {other:?}"),
                }
            }
        }
    }

    /// Simulates `n` members quantizing a block with the agreed exponent and
    /// the aggregator summing in int64; checks the int32 headroom and the
    /// documented error bound against an exact-enough reference.
    fn check_block(members: &[Vec<f32>], h: u32) {
        let n = members.len();
        let agreed = members.iter().map(|m| m.iter().map(|&x| exponent(x)).max().unwrap_or(E_ZERO)).max();
        let e = agreed.unwrap_or(E_ZERO);
        let s = auto_scale(e, h);
        let len = members[0].len();
        for i in 0..len {
            let mut qsum: i64 = 0;
            let mut exact = 0f64;
            let mut abs = 0f64;
            for m in members {
                let q = quantize(m[i], s);
                assert!(q.unsigned_abs() <= 1 << (30 - h), "element {i}: q={q} with e={e} h={h}");
                qsum += q;
                exact += f64::from(m[i]);
                abs += f64::from(m[i]).abs();
            }
            if h >= headroom(n) {
                assert!(qsum.unsigned_abs() <= 1 << 30, "sum {qsum} exceeds 2^30 (n={n}, h={h})");
            }
            let got = (qsum as f64 / s) as f32;
            if got.is_infinite() {
                // A float32 sum past f32::MAX is infinite, as float addition is.
                assert!(exact.abs() >= f64::from(f32::MAX), "element {i}: infinite result for {exact:e}");
                continue;
            }
            // The bound of the doc, half an ulp of the float32 output, and
            // the reference's own f64 rounding.
            let tol = sum_error_bound(n, s) + f64::from(ulp(got)) / 2.0 + abs * n as f64 * f64::EPSILON;
            let err = (f64::from(got) - exact).abs();
            assert!(
                err <= tol,
                "element {i}: got {got:e}, exact {exact:e}, err {err:e} > bound {tol:e} (e={e}, n={n})"
            );
            // Relative form of the doc: n * 2^(h - 31) of the block's 2^e.
            if e > E_ZERO {
                let rel = (f64::from(got) - exact).abs() - f64::from(ulp(got)) / 2.0 - abs * n as f64 * f64::EPSILON;
                assert!(rel <= n as f64 * 2f64.powi(e + h as i32 - 31), "element {i}");
            }
        }
    }

    fn ulp(x: f32) -> f32 {
        let a = x.abs();
        if a == 0.0 {
            return f32::from_bits(1);
        }
        f32::from_bits(a.to_bits() + 1) - a
    }

    #[test]
    fn auto_error_bound_random_and_adversarial() {
        let mut r = Rng(0x5eed);
        for round in 0..400 {
            let n = [1usize, 2, 3, 4, 8, 16, 31, 64][round % 8];
            let len = 1 + r.below(358) as usize;
            let kind = round % 6;
            let members: Vec<Vec<f32>> = (0..n)
                .map(|m| {
                    (0..len)
                        .map(|i| match kind {
                            // Uniform-ish in [-1, 1).
                            0 => (r.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0,
                            // Any finite float: huge next to subnormal.
                            1 => r.any_finite(),
                            // Zeros with one big outlier per member.
                            2 => {
                                if i == m % len {
                                    3.0e38 * if m % 2 == 0 { 1.0 } else { -1.0 }
                                } else {
                                    0.0
                                }
                            }
                            // Subnormals only.
                            3 => f32::from_bits((r.next() as u32) & 0x807f_ffff),
                            // All equal to a large block maximum: the worst case
                            // for the headroom (the sum still fits float32).
                            4 => 1.5e36,
                            // Mixed signs that cancel.
                            _ => {
                                let v = (i as f32 + 1.0) * 1e-3;
                                if m % 2 == 0 {
                                    v
                                } else {
                                    -v
                                }
                            }
                        })
                        .collect()
                })
                .collect();
            check_block(&members, headroom(n));
            // Reduce keeps the sum in int64: no headroom needed.
            check_block(&members, 0);
        }
    }

    #[test]
    fn all_zero_blocks() {
        let mut e = Vec::new();
        block_exponents(&[0.0, -0.0, 0.0], 2, &mut e).expect("finite");
        assert_eq!(e, vec![E_ZERO, E_ZERO]);
        assert_eq!(auto_scale(E_ZERO, 6), 1.0);
        assert_eq!(quantize(0.0, 1.0), 0);
    }

    #[test]
    fn block_exponents_per_block() {
        let mut e = Vec::new();
        let d = [0.25f32, -3.0, 0.0, 1e-40, 0.0, 0.0, 5.0];
        block_exponents(&d, 2, &mut e).expect("finite");
        assert_eq!(e, vec![exponent(3.0), exponent(1e-40), E_ZERO, exponent(5.0)]);
    }

    #[test]
    fn fixed_scale_overflow_detected() {
        // 21.47 * 1e8 fits int32, 21.48 * 1e8 does not.
        assert!(check_fixed(&[21.47, -21.47, 0.0], 1e8).is_ok());
        match check_fixed(&[1.0, -21.48, 0.0], 1e8) {
            Err(Error::Overflow { what, detail }) => {
                assert!(what.contains("element 1"), "{what}");
                assert!(detail.contains("Quant::Auto"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        let mut dst = [0u8; 12];
        assert_eq!(quantize_fixed_be(&[1.0, 2.0, 30.0], 1e8, &mut dst), Err(2));
        assert_eq!(quantize_fixed_be(&[1.0, 2.0, -3.0], 1e8, &mut dst), Ok(()));
        assert_eq!(i32::from_be_bytes([dst[8], dst[9], dst[10], dst[11]]), -300_000_000);
        assert!(check_fixed(&[1.0], 0.0).is_err());
        assert!(check_fixed(&[1.0], f64::NAN).is_err());
    }

    #[test]
    fn fixed_scale_error_bound() {
        let mut r = Rng(99);
        let s = 1e8;
        for _ in 0..20_000 {
            let x = ((r.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 20.0;
            let q = quantize(x, s);
            // 1/(2s) plus the f64 rounding of x * s (s is not a power of two).
            let err = (q as f64 / s - f64::from(x)).abs();
            assert!(err <= 0.5 / s + f64::from(x).abs() * f64::EPSILON, "{x}: {err:e}");
        }
    }

    #[test]
    fn wire_quantization_equals_quantize() {
        // quantize_auto_be rounds straight to int32 (and runs in an AVX2
        // copy on most CPUs, crate::simd); it must give quantize's value
        // for every scale a caller passes: automatic ones for blocks of
        // any exponent and headroom (halves and the block's maximum
        // included), and fixed ones that check_fixed accepted.
        let mut r = Rng(11);
        let mut src = Vec::new();
        let mut scales = Vec::new();
        for _ in 0..200 {
            let block: Vec<f32> = (0..97).map(|_| r.any_finite() * if r.below(2) == 0 { 1.0 } else { 1e-30 }).collect();
            let mut exps = Vec::new();
            block_exponents(&block, block.len(), &mut exps).expect("finite");
            let s = auto_scale(exps[0], r.below(7) as u32);
            src.push(block);
            scales.push(s);
        }
        let m = (1u64 << 31) as f32 / 1e8; // just inside int32 at 1e8
        src.push(vec![m * 0.999, -m * 0.999, 0.5e-8, -0.5e-8, 1.5e-8, -2.5e-8, 0.0, -0.0]);
        scales.push(1e8);
        src.push((0..64).map(|k| (k as f32 - 32.0) * 0.25).collect()); // exact halves
        scales.push(2.0);
        for (block, s) in src.iter().zip(&scales) {
            check_fixed(block, *s).expect("in range");
            let mut dst = vec![0u8; block.len() * 4];
            quantize_auto_be(block, *s, &mut dst);
            for (x, d) in block.iter().zip(dst.chunks_exact(4)) {
                let got = i32::from_be_bytes([d[0], d[1], d[2], d[3]]);
                assert_eq!(i64::from(got), quantize(*x, *s), "{x:e} x {s:e}");
            }
        }
    }

    #[test]
    fn auto_quantize_wire_bytes() {
        let src = [1.0f32, -0.5, 0.0];
        let e = exponent(1.0); // 1
        let s = auto_scale(e, 0); // 2^29
        let mut dst = [0u8; 12];
        quantize_auto_be(&src, s, &mut dst);
        assert_eq!(i32::from_be_bytes([dst[0], dst[1], dst[2], dst[3]]), 1 << 29);
        assert_eq!(i32::from_be_bytes([dst[4], dst[5], dst[6], dst[7]]), -(1 << 28));
        assert_eq!(&dst[8..], &[0, 0, 0, 0]);
    }
}
