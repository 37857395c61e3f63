/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl_skb.h: finding a kccl datagram in an skb, shared by the TC programs
 * (tc_bcast, tc_agg_result, tc_fault).
 */
#ifndef KCCL_SKB_H
#define KCCL_SKB_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"

#define ETH_P_IP	0x0800
#define IP_MF		0x2000
#define IP_OFFMASK	0x1fff

/* The UDP header and the first payload word (where the kccl magic is). */
struct kccl_l4 {
	struct udphdr udp;
	__u32 magic;
} __attribute__((packed));

/*
 * Loads the IPv4 header into *ip and the UDP header + magic into *l4.
 * Returns the UDP header's offset, or 0 unless the skb is an unfragmented
 * IPv4/UDP datagram over Ethernet whose payload starts with KCCL_MAGIC.
 */
static __always_inline __u32 kccl_skb_l4(struct __sk_buff *skb, struct iphdr *ip, struct kccl_l4 *l4)
{
	struct ethhdr eth;
	__u32 l4_off;

	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) ||
	    eth.h_proto != bpf_htons(ETH_P_IP) ||
	    bpf_skb_load_bytes(skb, sizeof(eth), ip, sizeof(*ip)) ||
	    ip->version != 4 || ip->ihl < 5 || ip->protocol != IPPROTO_UDP ||
	    (ip->frag_off & bpf_htons(IP_MF | IP_OFFMASK)))
		return 0;
	l4_off = sizeof(eth) + ip->ihl * 4;
	if (bpf_skb_load_bytes(skb, l4_off, l4, sizeof(*l4)) ||
	    l4->magic != bpf_htonl(KCCL_MAGIC))
		return 0;
	return l4_off;
}

#endif /* KCCL_SKB_H */
