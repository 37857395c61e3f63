/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * agg/combine.h: the element loops of xdp_agg.bpf.c: store or combine
 * one sub-block of a chunk's payload (int32/int64, SUM/AVG/COUNT/MAX/MIN)
 * into its accumulators (struct kccl_agg_sub) and write the answer back, branch-free, in blocks of
 * BLK_BYTES, with their per-CPU scratch memory (struct agg_scratch).
 *
 * Pure functions of the sub-block and the scratch buffer: no maps, no
 * configuration, no helper calls.  Why the loops are shaped the way they are
 * (verifier state counts) is in the comment on top of xdp_agg.bpf.c.
 */
#ifndef KCCL_AGG_COMBINE_H
#define KCCL_AGG_COMBINE_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_agg.h"

/* Loop modes. */
#define ELEM_NONE	0	/* read the accumulators only */
#define ELEM_STORE	1	/* first contribution: acc = v */
#define ELEM_COMBINE	2	/* acc = acc (op) v */

/* Loop results. */
#define ELEM_OVF	1	/* an int64 sum overflowed */
#define ELEM_SAT	2	/* an int32 write-back saturated */

#define S32_MAX		2147483647LL
#define S32_MIN		(-2147483647LL - 1)

/*
 * Hides a value from the optimizer.  The loop bodies below are branch-free
 * (MAX/MIN, (v != 0) and saturation are computed with 0 / ~0 masks): the BPF
 * backend turns selects into jumps, and every jump inside a loop body
 * multiplies the states the verifier explores per iterator step; clang would rebuild
 * selects from mask arithmetic whose operands it can see are 0 or ~0.
 */
#define OPAQUE(x)	asm volatile("" : "+r"(x))

/*
 * The loops work on blocks of BLK_BYTES payload bytes (26 int32 or 13 int64
 * elements), one open-coded iterator step (bpf_for) each: the verifier checks
 * an iterator's body until its state repeats (the index is an unknown scalar
 * every step), not once per iteration as it walks a bounded for loop, so the
 * cost of verifying a loop no longer grows with the sub-block size.  The
 * iterator kfuncs are the only calls allowed under a bpf_spin_lock.
 * 26 and 13 divide KCCL_AGG_SUB_ELEMS (858) and 429, so the last
 * block of any sub-block ends inside its acc[] and the scratch buffer.
 * The scratch copy of the sub-block is zero-filled up to the end of its last
 * block, so the elements past the payload (up to 25) are zeros: every
 * contribution of a chunk has the same length (else MISMATCH), so the
 * accumulators past it hold 0 after the store and keep it (0 + 0, 0 != 0 is
 * 0, MAX/MIN(0, 0)): no saturation or overflow comes from them, and nothing
 * reads them (records and answers carry payload_len bytes).
 */
#define BLK_BYTES	104
#define BLK_W4		(BLK_BYTES / 4)
#define BLK_W8		(BLK_BYTES / 8)
#define NBLK		(KCCL_AGG_SUB_BYTES / BLK_BYTES)	/* 33 */

_Static_assert(KCCL_AGG_SUB_BYTES % BLK_BYTES == 0, "blocks tile a sub-block");
_Static_assert(BLK_W4 % 2 == 0 && BLK_BYTES % 8 == 0, "int32 pairs and int64 fill a block");

/*
 * Per-CPU scratch memory of the program.  The loops load their block count
 * and the dispatch its selectors from here (volatile): the verifier knows
 * nothing about map contents, so every path reaches a loop in the same state
 * and each loop is walked about once, not once per combination of the
 * path-dependent constants the values would otherwise be.
 */
struct agg_scratch {
	/* What the locked section decided (enum below, ACT_*): kept here, not
	 * in locals, for the same reason: path-dependent constants live across
	 * a loop make the verifier walk it once per combination. */
	__u32 act, why, mode, write, reclaimed, ovf;
	/* PENDING: the chunk's contributors still missing (expected & ~seen). */
	__u64 missing;
	__u32 op, esize;	/* the loop selectors */
	__u32 res;		/* ELEM_OVF | ELEM_SAT of the loops */
	/* The loops' sign-bit accumulators (saturation, overflow), in memory
	 * per block: in a register, the verifier tracks them (0 or ~0 after
	 * some iteration) and walks a loop once per combination. */
	__s64 flag;
	/* Blocks of the loops: loaded from here so that the loop's bound
	 * checks narrow a copy the verifier does not link to anything used
	 * after the loop (else every exit iteration is a new state). */
	__u32 nblk;
	/* The claim generation of the slot (kccl_agg_slot.gen) the
	 * sub-block passes must find in each kccl_agg_sub. */
	__u64 gen;
	/* One sub-block of the payload, big-endian, zero-filled to a block
	 * boundary (the fill writes BLK_BYTES at its length). */
	__u8 buf[KCCL_AGG_SUB_BYTES + BLK_BYTES] __attribute__((aligned(8)));
};

#define PUT(sc, f, v)	(*(volatile __u32 *)&(sc)->f = (v))
#define GET(sc, f)	(*(volatile __u32 *)&(sc)->f)

/* x if m == ~0, y if m == 0 */
#define SEL(m, x, y)	((y) ^ (((x) ^ (y)) & (m)))

/* What a loop does to an accumulator a with the element v (compile-time
 * constants: every loop is specialised). */
#define K_STORE		0	/* a = v */
#define K_STORE_COUNT	1	/* a = (v != 0) */
#define K_ADD		2	/* SUM, AVG: a + v */
#define K_COUNT		3	/* a + (v != 0) */
#define K_MAX		4
#define K_MIN		5

/* 1 if x != 0 for x < 2^32 (OPAQUE: clang would make a compare of it). */
static __always_inline __s64 nz32(__u64 x)
{
	OPAQUE(x);
	return (x + 0xffffffffULL) >> 32;
}

/* 1 if x != 0 */
static __always_inline __s64 nz64(__u64 x)
{
	__u64 t = x | -x;

	OPAQUE(t);
	return t >> 63;
}

/* Int32 operands (sums of at most 64 int32: |x| < 2^37): v - a cannot
 * overflow, MAX/MIN use its sign. */
static __always_inline __s64 comb_w4(const int k, __s64 a, __s64 v)
{
	__s64 d = v - a, m = d >> 63;	/* ~0 if v < a */

	if (k == K_STORE || k == K_STORE_COUNT)
		return v;
	if (k == K_ADD || k == K_COUNT)
		return a + v;
	OPAQUE(m);
	if (k == K_MAX)
		return a + (d & ~m);
	return a + (d & m);
}

/*
 * Block b of the sub-block: its payload words in sc->buf (*q) and its
 * accumulators in u->acc (*a, w elements a block).  0 past NBLK: the bound
 * the verifier needs, since the iterator's own end (nblk) is unknown to it.
 */
static __always_inline int block_at(struct kccl_agg_sub *u, struct agg_scratch *sc, int b,
				    const int w, __u64 **q, __s64 **a)
{
	if ((__u32)b >= NBLK)
		return 0;
	*q = (__u64 *)(sc->buf + b * BLK_BYTES);
	*a = u->acc + b * w;
	return 1;
}

/*
 * Width-4 elements (I32, F32Q): combines the nblk blocks of big-endian int32
 * in sc->buf into u->acc (k: the op and mode).  Two elements are loaded
 * at a time: one 64-bit load and byte swap, the high half is the first.
 * Runs under the sub-block's lock: no helper calls.
 */
static __always_inline void w4_loop(struct kccl_agg_sub *u, struct agg_scratch *sc, const int k)
{
	__u32 nb = GET(sc, nblk);
	int b;

	bpf_for(b, 0, nb) {
		__u64 *q;
		__s64 *a;

		if (!block_at(u, sc, b, BLK_W4, &q, &a))
			break;
#pragma unroll
		for (int j = 0; j < BLK_W4 / 2; j++) {
			__u64 w = q[j];
			__s64 x0, x1;

			if (k == K_STORE_COUNT || k == K_COUNT) {
				/* (v != 0) needs no byte swap: the first
				 * element is the low half of the LE load */
				x0 = nz32(w & 0xffffffffULL);
				x1 = nz32(w >> 32);
			} else {
				w = __builtin_bswap64(w);
				x0 = (__s64)w >> 32;
				x1 = (__s64)(w << 32) >> 32;
			}
			a[2 * j] = comb_w4(k, a[2 * j], x0);
			a[2 * j + 1] = comb_w4(k, a[2 * j + 1], x1);
		}
	}
}

/* r saturated to int32 */
static __always_inline __s64 sat32(__s64 r)
{
	__s64 hi, hm, lo, lm;

	hi = S32_MAX - r;
	hm = hi >> 63;			/* ~0 if r > S32_MAX */
	OPAQUE(hm);
	r += hi & hm;
	lo = r - S32_MIN;
	lm = lo >> 63;			/* ~0 if r < S32_MIN */
	OPAQUE(lm);
	return r - (lo & lm);
}

/* Width-4 write-back: the accumulators saturated to int32, big-endian, into
 * sc->buf (what an allreduce result carries); ELEM_SAT into sc->res.  A
 * block is clamped only if one of its values is out of range. */
static __always_inline void w4_write(struct kccl_agg_sub *u, struct agg_scratch *sc)
{
	__u32 nb = GET(sc, nblk);
	int b;

	*(volatile __s64 *)&sc->flag = 0;
	bpf_for(b, 0, nb) {
		__u64 *q, out = 0;
		__s64 *a;

		if (!block_at(u, sc, b, BLK_W4, &q, &a))
			break;
#pragma unroll
		for (int j = 0; j < BLK_W4; j++)
			out |= ((__u64)a[j] + 0x80000000ULL) >> 32;	/* != 0: out of range */
		if (out) {
			*(volatile __s64 *)&sc->flag = 1;
#pragma unroll
			for (int j = 0; j < BLK_W4 / 2; j++)
				q[j] = __builtin_bswap64((__u64)sat32(a[2 * j]) << 32 |
							 (__u32)sat32(a[2 * j + 1]));
		} else {
#pragma unroll
			for (int j = 0; j < BLK_W4 / 2; j++)
				q[j] = __builtin_bswap64((__u64)a[2 * j] << 32 | (__u32)a[2 * j + 1]);
		}
	}
	if (*(volatile __s64 *)&sc->flag)
		PUT(sc, res, GET(sc, res) | ELEM_SAT);
}

/*
 * Width-8 elements (I64): the same over the full int64 range; signed
 * comparison and SUM/AVG overflow (ELEM_OVF into sc->res) from sign bits
 * (Hacker's Delight 2-12/2-13).
 */
static __always_inline void w8_loop(struct kccl_agg_sub *u, struct agg_scratch *sc, const int k)
{
	__u32 nb = GET(sc, nblk);
	int b;

	if (k == K_ADD)
		*(volatile __s64 *)&sc->flag = 0;
	bpf_for(b, 0, nb) {
		__u64 *q;
		__s64 *a;
		__s64 ovf = 0;

		if (!block_at(u, sc, b, BLK_W8, &q, &a))
			break;
#pragma unroll
		for (int j = 0; j < BLK_W8; j++) {
			__s64 v, x = a[j], sum, d, lt;

			if (k == K_STORE_COUNT || k == K_COUNT) {
				v = nz64(q[j]);
			} else {
				v = (__s64)__builtin_bswap64(q[j]);
			}
			if (k == K_STORE || k == K_STORE_COUNT) {
				a[j] = v;
			} else if (k == K_ADD) {
				sum = (__s64)((__u64)x + (__u64)v);
				ovf |= (x ^ sum) & (v ^ sum);
				a[j] = sum;
			} else if (k == K_COUNT) {
				a[j] = x + v;	/* at most 64: no overflow */
			} else {
				d = (__s64)((__u64)v - (__u64)x);
				lt = (d ^ ((v ^ x) & (d ^ v))) >> 63;	/* ~0 if v < a */
				OPAQUE(lt);
				a[j] = k == K_MAX ? SEL(lt, x, v) : SEL(lt, v, x);
			}
		}
		if (k == K_ADD)
			*(volatile __s64 *)&sc->flag |= ovf;
	}
	if (k == K_ADD && *(volatile __s64 *)&sc->flag < 0)
		PUT(sc, res, GET(sc, res) | ELEM_OVF);
}

/* Width-8 write-back: the accumulators, big-endian, into sc->buf. */
static __always_inline void w8_write(struct kccl_agg_sub *u, struct agg_scratch *sc)
{
	__u32 nb = GET(sc, nblk);
	int b;

	bpf_for(b, 0, nb) {
		__u64 *q;
		__s64 *a;

		if (!block_at(u, sc, b, BLK_W8, &q, &a))
			break;
#pragma unroll
		for (int j = 0; j < BLK_W8; j++)
			q[j] = __builtin_bswap64(a[j]);
	}
}

/*
 * One pass over a sub-block's elements as sc says (mode, write, op, esize):
 * the first contribution (ELEM_STORE) stores, later ones (ELEM_COMBINE)
 * combine, and with write the results go into sc->buf (a separate pass: only
 * allreduce answers need it).  sc->res gets ELEM_OVF / ELEM_SAT.
 */
static __always_inline void elems(struct kccl_agg_sub *u, struct agg_scratch *sc)
{
	__u32 mode = GET(sc, mode), op = GET(sc, op);

	if (GET(sc, esize) == 8) {
		if (mode == ELEM_STORE) {
			if (op == KCCL_OP_COUNT)
				w8_loop(u, sc, K_STORE_COUNT);
			else
				w8_loop(u, sc, K_STORE);
		} else if (mode == ELEM_COMBINE) {
			if (op == KCCL_OP_COUNT)
				w8_loop(u, sc, K_COUNT);
			else if (op == KCCL_OP_MAX)
				w8_loop(u, sc, K_MAX);
			else if (op == KCCL_OP_MIN)
				w8_loop(u, sc, K_MIN);
			else
				w8_loop(u, sc, K_ADD);
		}
		if (GET(sc, write))
			w8_write(u, sc);
	} else {
		if (mode == ELEM_STORE) {
			if (op == KCCL_OP_COUNT)
				w4_loop(u, sc, K_STORE_COUNT);
			else
				w4_loop(u, sc, K_STORE);
		} else if (mode == ELEM_COMBINE) {
			if (op == KCCL_OP_COUNT)
				w4_loop(u, sc, K_COUNT);
			else if (op == KCCL_OP_MAX)
				w4_loop(u, sc, K_MAX);
			else if (op == KCCL_OP_MIN)
				w4_loop(u, sc, K_MIN);
			else
				w4_loop(u, sc, K_ADD);
		}
		if (GET(sc, write))
			w4_write(u, sc);
	}
}

#endif /* KCCL_AGG_COMBINE_H */
