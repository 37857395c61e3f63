//! Runs the element loops of the edge (quantize/encode, decode/dequantize,
//! the float checks) compiled for AVX2 when the CPU has it.
//!
//! kccl is built for the x86-64 baseline (SSE2), so that one binary runs on
//! every host of a cluster; at that baseline the float32 loops are 2-4
//! elements wide at best, and the byte swaps of the big-endian wire format
//! have no shuffle instruction.  Those loops touch every element of every
//! operation (docs/BENCHMARKS.md: the float32 edge was ~20% of a ResNet-34
//! allreduce), so they are compiled twice: `avx2(|| loop)` inlines the
//! closure into a function built with AVX2 and calls it when the CPU
//! reports AVX2 at run time (the answer is cached after the first call),
//! else runs the baseline copy.  Results are identical: the loops use only
//! exact or IEEE-rounded operations, whatever their width.

/// Calls `f`, compiled with AVX2 where the CPU has it (module comment).
/// `f` must be an `#[inline(always)]` closure around the loop, and the
/// functions it calls `#[inline(always)]`: the closure is called from two
/// places (both copies), and LLVM inlines such a closure only when told to;
/// a call out of `wide` would run the loop at the baseline after all.
#[inline(always)]
pub fn avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn wide<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above), the only
            // requirement of calling a function built for it.
            return unsafe { wide(f) };
        }
    }
    f()
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_the_closure_once_either_way() {
        let mut calls = 0;
        let r = super::avx2(
            #[inline(always)]
            || {
                calls += 1;
                (0..1000u32).map(|x| x.swap_bytes()).fold(0u32, u32::wrapping_add)
            },
        );
        assert_eq!(calls, 1);
        assert_eq!(r, (0..1000u32).map(|x| x.swap_bytes()).fold(0u32, u32::wrapping_add));
    }
}
