// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tc_agg_result: kernel fan-out of aggregation answers (TCX ingress of the
 * aggregator's interface).  Specification: docs/AGGREGATION.md.
 *
 * What it does: xdp_agg turns the contribution that completes a chunk into a
 * KCCL_T_AGG_RESULT (allreduce) or KCCL_T_AGG_ACK (reduce) with KCCL_F_FANOUT,
 * addresses swapped, and passes it up.  This program catches such packets of
 * cfg_job_id at ingress and sends one copy to every rank in dst_mask with the
 * shared clone-and-rewrite code (bpf/lib/kccl_fanout.h): clones go to the
 * egress of the same interface, the original skb serves the highest rank via
 * bpf_redirect(ifindex, 0).  So the aggregator's user space does no work at
 * all for an allreduce, and none per packet for a reduce.
 *
 * What it assumes:
 *  - IPv4/UDP over Ethernet; the answer's UDP source port is the aggregator
 *    port (cfg_port: xdp_agg swapped the ports), which is also checked.
 *  - members[] is the SAME map instance as xdp_agg's (the loader shares it),
 *    filled by the runtime with each contributor's address and port (and MAC
 *    if the neighbour table had one); xdp_agg sets the MAC from each
 *    contributor's packets, so every destination of an answer is resolved.
 *  - Only answers signed with this host's rank (src_rank == cfg_my_rank)
 *    are fanned out, and every copy leaves with KCCL_F_FANOUT cleared: a
 *    contributor that also runs these programs (any member can be a reduce
 *    root) must not fan out an answer it receives, or answers would bounce
 *    between hosts forever.
 *  - Packets of this kind arriving from the wire are trusted like the ones
 *    xdp_agg made: both come through the same hook and look the same.  A
 *    host on the segment that can spoof the aggregator's packets can also
 *    make it fan out a forged answer to the job's contributors; the
 *    deployment trusts its L2 segment (as for broadcast).
 *  - An answer xdp_agg made from a multi-buffer contribution is as long as
 *    the contribution (releasing an XDP frame's fragments corrupts memory
 *    on veth); its bytes past the UDP datagram are cut with
 *    bpf_skb_change_tail before the fan-out (KCCL_AS_TRIMMED).
 *  - This host's own rank in dst_mask (the owner of a sharded allreduce's
 *    shard contributes to it) gets no copy: xdp_agg put its result on the
 *    ring for the owner's runtime (KCCL_AS_OWN_SKIPPED).
 *  - Copies carry skb->mark = cfg_clone_mark, so tc_bcast at TCX egress of
 *    the same interface (if loaded) passes them untouched.
 *  - A destination that cannot be served (no member, unresolved MAC, failed
 *    clone) is counted (KCCL_AS_FANOUT_MISSED) and reported on
 *    agg_miss_events with the answer's datagram (struct kccl_agg_miss), so
 *    the runtime sends that copy from user space at once; if even the ring
 *    is full, the contributor's retransmission fetches it (DUP_DONE).
 *  - Everything else passes untouched to the next program of the TCX chain
 *    (TCX_NEXT; not counted: xdp_agg counts it).
 * Counters go to agg_stats (FANOUT_COPIES, FANOUT_MISSED), shared with
 * xdp_agg by the loader.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"
#include "lib/kccl_skb.h"
#include "kccl_bcast.h"
#include "kccl_agg.h"
#include "lib/kccl_members.h"
#include "agg/stats.h"

#define TC_ACT_SHOT	2
/* TCX_NEXT (TC_ACT_UNSPEC): what this program does not fan out goes on to
 * the next program of the TCX ingress chain (and up if there is none);
 * TC_ACT_OK would end the chain for every packet of the interface. */
#define TCX_NEXT	(-1)

/* Set by the loader before load (read-only after). */
const volatile __u32 cfg_job_id = 0;
const volatile __u16 cfg_port = 0;		/* host order */
const volatile __u16 cfg_my_rank = 0;		/* the aggregator's rank */
const volatile __u32 cfg_clone_mark = 0x6b63636c;

/* struct kccl_agg_miss records: each reserves a whole maximal answer (the
 * reservation's size must be a constant), so 1 MiB holds 16; misses are
 * rare (a failed clone, a member without a next hop) and the runtime drains
 * them after every receive batch.  A miss that finds the ring full is still
 * counted (FANOUT_MISSED) and repaired by the contributor's retransmission. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1024 * 1024);
} agg_miss_events SEC(".maps");

/* Anchor: makes struct kccl_agg_miss part of the skeleton, so the runtime
 * reads the records with the generated definition (a pointer: 8 bytes of
 * .bss, not a whole record). */
struct kccl_agg_miss *kccl_agg_miss_layout;

/* The shared clone-and-rewrite fan-out, on this program's maps. */
#define KCCL_FANOUT_ON_MISS(f, rank, why) report_agg_miss((f), (rank), (why))
struct fanout;
static __always_inline void report_agg_miss(const struct fanout *f, __u32 rank, __u16 why);
#include "lib/kccl_fanout.h"

/* A destination the fan-out could not serve: its event and the answer's
 * datagram (the skb ends at the datagram: trimmed before the fan-out). */
static __always_inline void report_agg_miss(const struct fanout *f, __u32 rank, __u16 why)
{
	struct kccl_agg_miss *m;
	/* 64-bit: the bounds checks below then hold for the register passed
	 * to bpf_skb_load_bytes (with __u32, clang checks a zero-extended
	 * copy and passes the unbounded original). */
	__u64 off = f->l4_off + sizeof(struct udphdr);
	__u64 skb_len = f->skb->len;
	__u64 len;

	m = bpf_ringbuf_reserve(&agg_miss_events, sizeof(*m), 0);
	if (!m)
		return;
	m->ev.job_id = f->job_id;
	m->ev.msg_seq = f->msg_seq;
	m->ev.frag_off = f->frag_off;
	m->ev.rank = rank;
	m->ev.reason = why;
	m->pad = 0;
	len = skb_len > off ? skb_len - off : 0;
	if (len > KCCL_AGG_MISS_DGRAM_MAX)
		len = 0;
	/* Two separate branches: merged by clang into one range check, the
	 * verifier would not learn that len is at least 1. */
	barrier_var(len);
	if (len && bpf_skb_load_bytes(f->skb, off, m->dgram, len))
		len = 0;
	m->dgram_len = len;
	bpf_ringbuf_submit(m, 0);
}

SEC("tcx/ingress")
int kccl_tc_agg_result(struct __sk_buff *skb)
{
	struct iphdr ip;
	struct kccl_l4 l4;
	struct kccl_hdr h;
	struct fanout f = {};
	__u32 l4_off, udp_len, mask_base, flags_off;
	__u16 new_flags;

	l4_off = kccl_skb_l4(skb, &ip, &l4);
	if (!l4_off || l4.udp.source != bpf_htons(cfg_port))
		return TCX_NEXT;
	udp_len = bpf_ntohs(l4.udp.len);
	if (udp_len < sizeof(struct udphdr) + KCCL_HDR_LEN || l4_off + udp_len > skb->len ||
	    bpf_skb_load_bytes(skb, l4_off + sizeof(struct udphdr), &h, sizeof(h)))
		return TCX_NEXT;
	if (h.version != KCCL_VERSION ||
	    (h.type != KCCL_T_AGG_RESULT && h.type != KCCL_T_AGG_ACK && h.type != KCCL_T_AGG_PENDING) ||
	    !(h.flags & bpf_htons(KCCL_F_FANOUT)) || bpf_ntohl(h.job_id) != cfg_job_id ||
	    bpf_ntohs(h.payload_len) != udp_len - sizeof(struct udphdr) - KCCL_HDR_LEN)
		return TCX_NEXT;
	if (bpf_ntohs(h.src_rank) != cfg_my_rank)
		return TCX_NEXT;
	/* An answer made from a multi-buffer contribution still carries the
	 * contribution's bytes behind its datagram (xdp_agg never shrinks
	 * such a frame); cut them here, on the skb, before any copy. */
	if (skb->len > l4_off + udp_len) {
		if (bpf_skb_change_tail(skb, l4_off + udp_len, 0))
			return TCX_NEXT;
		stat_add(KCCL_AS_TRIMMED, 1);
	}
	mask_base = bpf_ntohs(h.mask_base);
	f.mask = bpf_be64_to_cpu(h.dst_mask);
	if (!f.mask || mask_base % KCCL_MASK_BITS || mask_base + KCCL_MASK_BITS > KCCL_MAX_MEMBERS)
		return TCX_NEXT;
	/* A sharded allreduce's owner contributes too: its copy came from
	 * xdp_agg's ring record, never from its own wire. */
	if (cfg_my_rank >= mask_base && cfg_my_rank < mask_base + KCCL_MASK_BITS &&
	    ((f.mask >> (cfg_my_rank - mask_base)) & 1)) {
		f.mask &= ~(1ULL << (cfg_my_rank - mask_base));
		stat_add(KCCL_AS_OWN_SKIPPED, 1);
		if (!f.mask)
			return TC_ACT_SHOT;
	}

	f.skb = skb;
	f.l4_off = l4_off;
	f.cur_ip = ip.daddr;
	f.cur_port = l4.udp.dest;
	f.base = mask_base;
	f.job_id = cfg_job_id;
	f.msg_seq = bpf_ntohl(h.msg_seq);
	f.frag_off = bpf_ntohl(h.frag_off);

	/* The copies are final answers: clear FANOUT (checksum kept valid, or
	 * 0 if it was 0) so that no receiver's tc_agg_result takes them up. */
	new_flags = h.flags & ~bpf_htons(KCCL_F_FANOUT);
	flags_off = l4_off + sizeof(struct udphdr) + offsetof(struct kccl_hdr, flags);
	if (bpf_l4_csum_replace(skb, l4_off + offsetof(struct udphdr, check), h.flags, new_flags,
				BPF_F_MARK_MANGLED_0 | sizeof(new_flags)) ||
	    bpf_skb_store_bytes(skb, flags_off, &new_flags, sizeof(new_flags), 0))
		return TCX_NEXT;

	skb->mark = cfg_clone_mark;
	kccl_fan_out(&f);

	stat_add(KCCL_AS_FANOUT_COPIES, f.copies);
	if (f.misses)
		stat_add(KCCL_AS_FANOUT_MISSED, f.misses);
	/* The original skb carries the highest rank's copy out of the same
	 * interface (TC_ACT_REDIRECT); with no rank left for it, it is done. */
	return f.original_sent ? bpf_redirect(skb->ifindex, 0) : TC_ACT_SHOT;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
