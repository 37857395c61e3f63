/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * agg/answer.h: what xdp_agg.bpf.c sends back for a completed chunk:
 * the ACK or RESULT frame rebuilt in place from the contribution
 * (make_answer), and a reduce chunk's record on the ring buffer with the
 * wake-up policy (deliver).
 *
 * Uses xdp_agg's configuration and maps (agg/state.h).
 */
#ifndef KCCL_AGG_ANSWER_H
#define KCCL_AGG_ANSWER_H

#include <bpf/bpf_endian.h>
#include "agg/state.h"
#include "agg/combine.h"	/* OPAQUE */

/* Ones' complement update of a checksum for a 16-bit field change (RFC 1624);
 * all values as stored (network order). */
static __always_inline void csum_replace2(__u16 *sum, __u16 old, __u16 new)
{
	__u32 c = (__u16)~*sum;

	c += (__u16)~old;
	c += new;
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	*sum = ~c;
}

/*
 * Turns the contribution in ctx into the answer: ACK (out_len 0: the payload
 * is trimmed), RESULT (out_len bytes, already written into the payload in
 * place: word NULL) or PENDING (out_len 8: *word becomes the payload).
 * Works on multi-buffer frames: lengths from bpf_xdp_get_buff_len, the
 * headers are in the linear part, and such a frame keeps its length (its
 * bytes past the answer are a trailer; see below).
 * Addresses and ports swapped, UDP checksum 0, lengths and IP checksum fixed.
 * Returns XDP_PASS, or XDP_DROP if the frame could not be rebuilt.
 */
static __always_inline int make_answer(struct xdp_md *ctx, __u8 type, __u16 in_flags, bool ovf,
				       __u64 dst_mask, __u32 out_len, const __u64 *word)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp;
	struct kccl_hdr *h;
	__u32 ihl_len, want, have;
	__u16 flags, new_tot, new_udp;
	__u8 mac[ETH_ALEN];
	__be32 addr;
	__be16 port;

	if ((void *)(ip + 1) > end)
		return XDP_DROP;
	ihl_len = ip->ihl * 4;
	want = sizeof(*eth) + ihl_len + KCCL_ANSWER_FIXED_LEN + out_len;
	have = bpf_xdp_get_buff_len(ctx);
	if (have > (__u32)(end - data)) {
		/* Multi-buffer: never release fragments.  Shrinking such a
		 * frame (bpf_xdp_adjust_tail) frees page_pool pages as
		 * ordinary pages on veth and corrupts the kernel's memory
		 * (docs/KERNELS.md).  The headers below describe the answer;
		 * the rest of the contribution stays behind the datagram as a
		 * trailer, which tc_agg_result cuts off the skb
		 * (bpf_skb_change_tail) and the IP stack ignores. */
		if (want > have)
			return XDP_DROP;
	} else if (want != have) {
		/* Single buffer: ACK/PENDING trims the payload (and any
		 * trailer after the datagram); a PENDING for a 4-byte chunk
		 * grows by 4 bytes. */
		if (bpf_xdp_adjust_tail(ctx, (int)want - (int)have))
			return XDP_DROP;
		data = (void *)(long)ctx->data;
		end = (void *)(long)ctx->data_end;
		eth = data;
		ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return XDP_DROP;
		ihl_len = ip->ihl * 4;
	}
	if (ihl_len < sizeof(*ip) || out_len > KCCL_AGG_MAX_PAYLOAD)
		return XDP_DROP;
	if (word) {
		if (out_len != sizeof(*word) ||
		    bpf_xdp_store_bytes(ctx, sizeof(*eth) + ihl_len + KCCL_ANSWER_FIXED_LEN,
					(void *)word, sizeof(*word)))
			return XDP_DROP;
		data = (void *)(long)ctx->data;
		end = (void *)(long)ctx->data_end;
		eth = data;
		ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl * 4 != ihl_len)
			return XDP_DROP;
	}
	udp = (void *)ip + ihl_len;
	h = (void *)(udp + 1);
	if ((void *)(h + 1) > end)
		return XDP_DROP;

	__builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, mac, ETH_ALEN);

	/* A swap leaves the IP checksum as it is; the length change does not. */
	addr = ip->saddr;
	ip->saddr = ip->daddr;
	ip->daddr = addr;
	new_tot = bpf_htons(ihl_len + KCCL_ANSWER_FIXED_LEN + out_len);
	if (new_tot != ip->tot_len) {
		csum_replace2(&ip->check, ip->tot_len, new_tot);
		ip->tot_len = new_tot;
	}

	port = udp->source;
	udp->source = udp->dest;
	udp->dest = port;
	new_udp = KCCL_ANSWER_FIXED_LEN + out_len;
	udp->len = bpf_htons(new_udp);
	udp->check = 0;

	flags = KCCL_F_FANOUT | (in_flags & KCCL_F_LAST_FRAG) | (ovf ? KCCL_F_OVERFLOW : 0);
	h->type = type;
	h->flags = bpf_htons(flags);
	h->src_rank = bpf_htons(cfg_my_rank);
	h->dst_mask = bpf_cpu_to_be64(dst_mask);
	h->payload_len = bpf_htons(out_len);
	return XDP_PASS;
}

/*
 * The slot's record (its header, then the values of sub-blocks 0 .. nsub-1
 * of agg_acc from entry `base`) to the ring buffer in one record: a reduce
 * chunk's (the slot is DELIVERING, so nobody else writes it or its
 * sub-blocks), or (`own`) the owner's copy of a sharded allreduce chunk
 * (DONE: nobody adds to it).  A reduce record wakes the reader when the
 * ring holds more than cfg_wakeup_bytes or this was the operation's last
 * missing chunk; an owner's copy wakes it when the reader had caught up
 * (the ring's adaptive wake-up): its runtime waits on the ring and its
 * socket at once, and its op's progress cannot be counted here (the chunks
 * its own contribution completed never come this way).
 */
static __always_inline int deliver(struct kccl_agg_slot *s, __u32 base, __u32 op_id, __u32 pay_len,
				   __u32 msg_len, __u32 esize, bool own)
{
	struct kccl_agg_op_key k = { .job_id = cfg_job_id, .op_id = op_id };
	__u64 zero = 0, flags = BPF_RB_NO_WAKEUP, size, sub_vals, off, n;
	struct kccl_agg_sub *u;
	struct bpf_dynptr rec;
	__u64 *done = NULL;
	bool last = true;
	__u32 i, idx;

	if (pay_len == 0 || pay_len > KCCL_AGG_MAX_PAYLOAD || (esize != 4 && esize != 8))
		return -1;
	size = KCCL_AGG_RECORD_HDR_LEN + (__u64)(pay_len / esize) * 8;
	sub_vals = KCCL_AGG_SUB_BYTES / esize;	/* values per sub-block */
	if (own) {
		flags = 0;
	} else {
		done = bpf_map_lookup_elem(&agg_op_progress, &k);
		if (!done) {
			bpf_map_update_elem(&agg_op_progress, &k, &zero, BPF_NOEXIST);
			done = bpf_map_lookup_elem(&agg_op_progress, &k);
		}
		/* Without a progress entry (cannot happen short of memory) wake always. */
		if (done)
			last = __sync_fetch_and_add(done, pay_len) + pay_len >= msg_len;
		if (last || bpf_ringbuf_query(&agg_records, BPF_RB_AVAIL_DATA) + size > cfg_wakeup_bytes)
			flags = BPF_RB_FORCE_WAKEUP;
	}
	if (bpf_ringbuf_reserve_dynptr(&agg_records, size, 0, &rec))
		goto fail;
	if (bpf_dynptr_write(&rec, 0, &s->rec, sizeof(s->rec), 0))
		goto fail;
	for (i = 0; i < KCCL_AGG_MAX_SUBS; i++) {
		off = (__u64)i * sub_vals * 8;
		if (KCCL_AGG_RECORD_HDR_LEN + off >= size)
			break;
		n = size - KCCL_AGG_RECORD_HDR_LEN - off;
		if (n > sub_vals * 8)
			n = sub_vals * 8;
		/* Again on an opaque copy: the verifier needs both bounds. */
		OPAQUE(n);
		if (n == 0 || n > sizeof(u->acc))
			goto fail;
		idx = base + i;
		u = bpf_map_lookup_elem(&agg_acc, &idx);
		if (!u || bpf_dynptr_write(&rec, KCCL_AGG_RECORD_HDR_LEN + off, u->acc, n, 0))
			goto fail;
	}
	bpf_ringbuf_submit_dynptr(&rec, flags);
	if (done && last)
		bpf_map_delete_elem(&agg_op_progress, &k);
	return 0;
fail:
	bpf_ringbuf_discard_dynptr(&rec, 0);
	if (done)
		__sync_fetch_and_add(done, -(__s64)pay_len);
	return -1;
}

#endif /* KCCL_AGG_ANSWER_H */
