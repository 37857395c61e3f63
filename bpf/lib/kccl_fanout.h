/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl_fanout.h: the ONE clone-and-rewrite fan-out of kccl, shared by
 * tc_bcast.bpf.c (TCX egress, broadcast) and tc_agg_result.bpf.c (TCX ingress,
 * aggregation results and acks).
 *
 * A packet whose kccl header names destination ranks base + i (bit i of a
 * 64-bit mask) is sent once per destination: for each rank the destination
 * MAC, IPv4 address and UDP port are rewritten from members[rank] (checksums
 * through the kernel's csum helpers; a UDP checksum of 0 stays 0) and the skb
 * is bpf_clone_redirect()ed to the egress of the skb's device.  The highest
 * served rank is left to the original skb (one clone saved): fan_out_one sets
 * f->original_sent and the calling program decides what "sending the
 * original" means in its hook (TC_ACT_OK at egress, bpf_redirect at ingress).
 *
 * Destinations come from the members map (lib/kccl_members.h).  Optional
 * hook, defined by the including file before the #include:
 *   KCCL_FANOUT_ON_MISS(f, r, why) called (as a statement) for every
 *                                  destination rank r the fan-out could not
 *                                  serve, with struct fanout *f; e.g.
 *                                  kccl_fanout_ring_miss(&ring, f, r, why).
 *                                  f->misses is counted here in any case.
 */
#ifndef KCCL_FANOUT_H
#define KCCL_FANOUT_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"
#include "kccl_bcast.h"
#include "lib/kccl_members.h"

#ifndef KCCL_FANOUT_ON_MISS
#define KCCL_FANOUT_ON_MISS(f, rank, why) do { } while (0)
#endif

struct fanout {
	struct __sk_buff *skb;
	__u32 l4_off;
	__u32 cur_ip;		/* destination currently in the packet (be) */
	__u16 cur_port;		/* (be) */
	__u16 base;
	__u64 mask;
	__u32 last;		/* highest set bit: served by the original skb */
	__u32 job_id, msg_seq, frag_off;
	__u32 copies, misses;
	bool original_sent;
};

/* A KCCL_FANOUT_ON_MISS body for programs that report misses on a ring
 * buffer of struct kccl_miss_event.  If even the ring is full, the runtime
 * still sees the program's miss counter. */
static __always_inline void kccl_fanout_ring_miss(void *ring, const struct fanout *f, __u32 rank, __u16 why)
{
	struct kccl_miss_event ev = {
		.job_id = f->job_id,
		.msg_seq = f->msg_seq,
		.frag_off = f->frag_off,
		.rank = rank,
		.reason = why,
	};

	bpf_ringbuf_output(ring, &ev, sizeof(ev), 0);
}

static __always_inline void report_miss(struct fanout *f, __u32 rank, __u16 why)
{
	KCCL_FANOUT_ON_MISS(f, rank, why);
	f->misses++;
}

/* Rewrite the packet in place for member m; 0 on success. */
static __always_inline int rewrite_dest(struct fanout *f, const struct kccl_member *m)
{
	struct __sk_buff *skb = f->skb;
	__u32 csum_off = f->l4_off + offsetof(struct udphdr, check);
	__u32 ip_csum_off = sizeof(struct ethhdr) + offsetof(struct iphdr, check);
	__u32 daddr_off = sizeof(struct ethhdr) + offsetof(struct iphdr, daddr);
	__u32 dport_off = f->l4_off + offsetof(struct udphdr, dest);
	__u32 new_ip = m->ip_be;
	__u16 new_port = m->port_be;

	if (new_ip != f->cur_ip) {
		if (bpf_l4_csum_replace(skb, csum_off, f->cur_ip, new_ip,
					BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(new_ip)) ||
		    bpf_l3_csum_replace(skb, ip_csum_off, f->cur_ip, new_ip, sizeof(new_ip)) ||
		    bpf_skb_store_bytes(skb, daddr_off, &new_ip, sizeof(new_ip), 0))
			return -1;
		f->cur_ip = new_ip;
	}
	if (new_port != f->cur_port) {
		if (bpf_l4_csum_replace(skb, csum_off, f->cur_port, new_port,
					BPF_F_MARK_MANGLED_0 | sizeof(new_port)) ||
		    bpf_skb_store_bytes(skb, dport_off, &new_port, sizeof(new_port), 0))
			return -1;
		f->cur_port = new_port;
	}
	return bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), m->mac, 6, 0) ? -1 : 0;
}

static __always_inline __u32 highest_bit(__u64 v)
{
	__u32 n = 0;

	if (v >> 32) { v >>= 32; n += 32; }
	if (v >> 16) { v >>= 16; n += 16; }
	if (v >> 8)  { v >>= 8;  n += 8; }
	if (v >> 4)  { v >>= 4;  n += 4; }
	if (v >> 2)  { v >>= 2;  n += 2; }
	if (v >> 1)  { n += 1; }
	return n;
}

/* bpf_loop callback: serve destination bit i.  A callback is verified once,
 * where an open-coded 64-iteration loop with helper calls explodes the
 * verifier's state space. */
static long fan_out_one(__u64 i, struct fanout *f)
{
	__u32 rank;
	struct kccl_member *m;

	if (i > f->last)
		return 1;
	if (!((f->mask >> i) & 1))
		return 0;
	rank = f->base + (__u32)i;
	m = bpf_map_lookup_elem(&members, &rank);
	if (!m || !(m->flags & KCCL_M_PRESENT)) {
		report_miss(f, rank, KCCL_MISS_NOT_MEMBER);
		return 0;
	}
	if (!(m->flags & KCCL_M_RESOLVED)) {
		report_miss(f, rank, KCCL_MISS_UNRESOLVED);
		return 0;
	}
	if (rewrite_dest(f, m)) {
		report_miss(f, rank, KCCL_MISS_CLONE_FAILED);
		return 0;
	}
	if (i == f->last) {
		/* The original skb carries the last copy: one clone saved. */
		f->original_sent = true;
		f->copies++;
		return 1;
	}
	if (bpf_clone_redirect(f->skb, f->skb->ifindex, 0))
		report_miss(f, rank, KCCL_MISS_CLONE_FAILED);
	else
		f->copies++;
	return 0;
}

/* Fans f out to every rank of f->mask (bits above f->last are not looked at).
 * The caller fills skb, l4_off, cur_ip, cur_port, base, mask, job_id, msg_seq,
 * frag_off and has marked the skb so that re-entering clones are recognised. */
static __always_inline void kccl_fan_out(struct fanout *f)
{
	f->last = highest_bit(f->mask);
	bpf_loop(KCCL_MASK_BITS, fan_out_one, f, 0);
}

#endif /* KCCL_FANOUT_H */
