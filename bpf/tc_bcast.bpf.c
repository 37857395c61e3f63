// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tc_bcast: kernel fan-out of kccl broadcast packets (TCX egress).
 *
 * What it does: for every UDP datagram leaving the interface whose payload is
 * a kccl broadcast header of our job with KCCL_F_FANOUT set, it sends one copy
 * to every rank whose bit is set in dst_mask: it rewrites destination MAC, IPv4
 * address and UDP port (checksums through the kernel's csum helpers) and
 * bpf_clone_redirect()s the packet out of the same interface; the original
 * skb becomes the copy for the highest rank.  So the sender's user space pays
 * one send per fragment instead of one per destination.  The clone-and-rewrite
 * code is bpf/lib/kccl_fanout.h, shared with tc_agg_result.bpf.c.
 *
 * What it assumes:
 *  - IPv4/UDP over Ethernet, attached at TCX egress of the sender's interface;
 *    every destination is reachable through that interface (same L2 segment or
 *    a gateway whose MAC the runtime stored as the member's next hop).
 *  - members[rank] is filled by the runtime from the neighbour table; a rank
 *    without a resolved MAC, or a failed clone, is not dropped silently: it is
 *    reported on miss_events and counted, and the runtime sends that copy from
 *    user space.
 *  - Copies are marked with cfg_clone_mark: a clone redirected to this
 *    device's egress re-enters this hook and must pass untouched.
 *  - One packet fans out to at most 64 ranks (one mask word); the runtime
 *    sends one packet per 64-rank window for larger groups.  The bound keeps
 *    the loop verifiable and the softirq time one packet holds the CPU short.
 *  - Every other packet (non-UDP, other ports, other jobs, no FANOUT flag,
 *    malformed kccl headers) passes untouched; malformed ones are counted.
 *    kccl packets of the other types (aggregation, KCCL_T_BCAST_ACK) are
 *    unicast and pass untouched (counted as passed) even with FANOUT set.
 *  - Copies keep the sender's source MAC, IP and UDP port: receivers send
 *    their KCCL_T_BCAST_ACKs back to that address.  Copies leave without
 *    KCCL_F_FANOUT (cleared once, before cloning), so no copy is ever fanned
 *    out again, whatever mark it carries when it re-enters this hook.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"
#include "lib/kccl_skb.h"
#include "kccl_bcast.h"
#include "lib/kccl_members.h"

#define TC_ACT_SHOT	2
/* TCX_NEXT (TC_ACT_UNSPEC): the packet goes on to the next program of the
 * TCX chain (e.g. tc_fault behind us), and out if there is none.  TC_ACT_OK
 * would end the chain: a fault injector attached after tc_bcast would then
 * never see a broadcast packet.  The runtime attaches tc_bcast at the head. */
#define TCX_NEXT	(-1)

/* Set by the runtime before load (read-only after). */
const volatile __u32 cfg_job_id = 0;
const volatile __u32 cfg_clone_mark = 0x6b63636c;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, KCCL_BS_NR);
	__type(key, __u32);
	__type(value, __u64);
} bcast_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 * 1024 * 1024);
} miss_events SEC(".maps");

/* 4 MiB: one sendmmsg batch (1024 fragments x 64 ranks) of 16-byte events
 * plus ring headers fits, so a batch never loses a miss report. */
/* Anchors: make the shared types part of the skeleton so the runtime uses
 * generated definitions (checked by its tests), not hand copies. */
struct kccl_hdr kccl_hdr_layout;
struct kccl_miss_event kccl_miss_event_layout;
struct kccl_bcast_ack kccl_bcast_ack_layout;

static __always_inline void stat_add(__u32 idx, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&bcast_stats, &idx);

	if (v)
		*v += n;
}

/* The shared clone-and-rewrite fan-out, on this program's maps. */
#define KCCL_FANOUT_ON_MISS(f, rank, why) kccl_fanout_ring_miss(&miss_events, (f), (rank), (why))
#include "lib/kccl_fanout.h"

SEC("tcx/egress")
int kccl_tc_bcast(struct __sk_buff *skb)
{
	struct iphdr ip;
	struct kccl_l4 l4;
	struct kccl_hdr h;
	struct fanout f = {};
	__u32 l4_off, udp_len, pay_len, mask_base, flags_off;
	__u16 new_flags;

	/* Our own copies re-enter this hook after bpf_clone_redirect(). */
	if (skb->mark == cfg_clone_mark)
		return TCX_NEXT;

	l4_off = kccl_skb_l4(skb, &ip, &l4);
	if (!l4_off)
		goto pass;

	/* From here on the packet claims to be kccl: anything wrong is malformed. */
	udp_len = bpf_ntohs(l4.udp.len);
	if (udp_len < sizeof(struct udphdr) + KCCL_HDR_LEN ||
	    l4_off + udp_len > skb->len ||
	    bpf_skb_load_bytes(skb, l4_off + sizeof(struct udphdr), &h, sizeof(h)))
		goto malformed;
	pay_len = udp_len - sizeof(struct udphdr) - KCCL_HDR_LEN;
	if (h.version != KCCL_VERSION)
		goto malformed;
	/* Other kccl packets leaving this host (a receiver's broadcast ACKs,
	 * aggregation traffic of every type) are unicast: never fanned out,
	 * whatever their flags say. */
	if (h.type >= KCCL_T_AGG && h.type <= KCCL_T_AGG_ABORT)
		goto pass;
	if (h.type != KCCL_T_BCAST || bpf_ntohs(h.payload_len) != pay_len)
		goto malformed;
	if (!(h.flags & bpf_htons(KCCL_F_FANOUT)))
		goto pass;
	if (bpf_ntohl(h.job_id) != cfg_job_id) {
		stat_add(KCCL_BS_OTHER_JOB, 1);
		return TCX_NEXT;
	}
	mask_base = bpf_ntohs(h.mask_base);
	f.mask = bpf_be64_to_cpu(h.dst_mask);
	if (!f.mask || mask_base % KCCL_MASK_BITS ||
	    mask_base + KCCL_MASK_BITS > KCCL_MAX_MEMBERS)
		goto malformed;

	/* Copies leave as plain unicast: without FANOUT, a copy that comes
	 * back through this hook (a fault injector's duplicate carries its own
	 * mark, not ours) passes instead of fanning out again, which would
	 * multiply every duplicate by the group size. */
	new_flags = h.flags & ~bpf_htons(KCCL_F_FANOUT);
	flags_off = l4_off + sizeof(struct udphdr) + offsetof(struct kccl_hdr, flags);
	if (bpf_l4_csum_replace(skb, l4_off + offsetof(struct udphdr, check), h.flags, new_flags,
				BPF_F_MARK_MANGLED_0 | sizeof(new_flags)) ||
	    bpf_skb_store_bytes(skb, flags_off, &new_flags, sizeof(new_flags), 0))
		goto malformed;

	f.skb = skb;
	f.l4_off = l4_off;
	f.cur_ip = ip.daddr;
	f.cur_port = l4.udp.dest;
	f.base = mask_base;
	f.job_id = cfg_job_id;
	f.msg_seq = bpf_ntohl(h.msg_seq);
	f.frag_off = bpf_ntohl(h.frag_off);

	skb->mark = cfg_clone_mark;
	kccl_fan_out(&f);

	stat_add(KCCL_BS_FANOUT_PKTS, 1);
	stat_add(KCCL_BS_COPIES, f.copies);
	if (f.misses)
		stat_add(KCCL_BS_MISSED, f.misses);
	return f.original_sent ? TCX_NEXT : TC_ACT_SHOT;

malformed:
	stat_add(KCCL_BS_MALFORMED, 1);
	return TCX_NEXT;
pass:
	stat_add(KCCL_BS_PASSED, 1);
	return TCX_NEXT;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
