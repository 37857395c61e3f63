/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * agg/acks.h: what each rank proved it received (the agg_acks map,
 * struct kccl_agg_acks): a contribution of chunk c proves its sender holds
 * every answer below c + 1 - cfg_window.  xdp_agg.bpf.c uses it to drop late
 * copies (ack_proves), to record proofs (ack_raise) and to free a DONE slot
 * once all its contributors proved they have the answer (check_proven).
 *
 * Uses the map agg_acks, cfg_chunk_bytes and struct contrib (agg/state.h).
 */
#ifndef KCCL_AGG_ACKS_H
#define KCCL_AGG_ACKS_H

#include "agg/state.h"

/* a after b: (op, bound) keys of struct kccl_agg_acks, op ids compared in
 * serial-number order (they wrap at 2^32). */
static __always_inline bool ack_after(__u64 a, __u64 b)
{
	__s32 d = (__s32)((__u32)(a >> 32) - (__u32)(b >> 32));

	return d > 0 || (d == 0 && (__u32)a > (__u32)b);
}

/* Whether rank src already proved it holds the answer of chunk (op_id,
 * chunk): a contribution of it is then a late copy (a retransmission that
 * crossed the answer) and must not claim a slot, where it would wait for
 * contributors that are done with the chunk. */
static __always_inline bool ack_proves(__u32 src, __u32 op_id, __u32 chunk)
{
	struct kccl_agg_acks *a;
	__u32 zero = 0;
	__u64 v;

	a = bpf_map_lookup_elem(&agg_acks, &zero);
	if (!a || src >= KCCL_MAX_MEMBERS)
		return false;
	v = *(volatile __u64 *)&a->v[src];
	return v && ack_after(v, (__u64)op_id << 32 | (chunk + 1));
}

/* Rank src proved it holds every answer before (op_id, bound). */
static __always_inline void ack_raise(__u32 src, __u32 op_id, __u32 bound)
{
	struct kccl_agg_acks *a;
	__u32 zero = 0;
	__u64 nv, ov;

	a = bpf_map_lookup_elem(&agg_acks, &zero);
	if (!a || src >= KCCL_MAX_MEMBERS || bound == 0xffffffffU)
		return;
	nv = (__u64)op_id << 32 | (bound + 1);
	ov = *(volatile __u64 *)&a->v[src];
	/* A racing update may lower it again: that only proves less. */
	if (!ov || ack_after(nv, ov))
		*(volatile __u64 *)&a->v[src] = nv;
}

/*
 * Whether every contributor of the DONE chunk that slot s held when read
 * (without the lock: the caller re-checks the key under it) has proven it
 * holds the chunk's answer.  Fills c->proven*.
 */
static __always_inline void check_proven(struct kccl_agg_slot *s, struct contrib *c)
{
	struct kccl_agg_acks *a;
	__u32 zero = 0, kop, kchunk, base, b;
	__u64 exp, v;

	c->proven = false;
	if (*(volatile __u32 *)&s->state != KCCL_SLOT_DONE)
		return;
	kop = *(volatile __u32 *)&s->rec.op_id;
	c->proven_op = kop;
	c->proven_frag = *(volatile __u32 *)&s->rec.frag_off;
	if (kop == c->op_id && c->proven_frag == c->frag)
		return;
	a = bpf_map_lookup_elem(&agg_acks, &zero);
	if (!a)
		return;
	kchunk = c->proven_frag / cfg_chunk_bytes;
	exp = *(volatile __u64 *)&s->expected;
	base = *(volatile __u16 *)&s->rec.mask_base;
#pragma clang loop unroll(disable)
	for (b = 0; b < KCCL_MASK_BITS; b++) {
		if (!((exp >> b) & 1))
			continue;
		v = a->v[(base + b) & (KCCL_MAX_MEMBERS - 1)];
		/* v proves (op, bound): after (kop, kchunk + 1), i.e. bound > kchunk */
		if (!v || !ack_after(v, (__u64)kop << 32 | (kchunk + 1)))
			return;
	}
	c->proven = true;
}

#endif /* KCCL_AGG_ACKS_H */
