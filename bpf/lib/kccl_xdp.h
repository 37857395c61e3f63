/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl_xdp.h: finding a kccl datagram in an XDP frame, shared by the XDP
 * programs (xdp_agg, xdp_sg).
 */
#ifndef KCCL_XDP_H
#define KCCL_XDP_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"

#define ETH_P_IP	0x0800
#define IP_MF		0x2000
#define IP_OFFMASK	0x1fff

/*
 * The UDP header of an IPv4 datagram to port `port_be` (network order) in
 * the linear part of the frame [data, end), and its IP header in *ipp; NULL
 * for anything else: not IPv4/UDP, an IP fragment (kccl never sends one),
 * another port, or headers cut short.  Any IHL.
 */
static __always_inline struct udphdr *kccl_xdp_udp(void *data, void *end, __u16 port_be, struct iphdr **ipp)
{
	struct ethhdr *eth = data;
	struct iphdr *ip;
	struct udphdr *udp;

	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return NULL;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5 ||
	    ip->protocol != IPPROTO_UDP || (ip->frag_off & bpf_htons(IP_MF | IP_OFFMASK)))
		return NULL;
	udp = (void *)ip + ip->ihl * 4;
	if ((void *)(udp + 1) > end || udp->dest != port_be)
		return NULL;
	*ipp = ip;
	return udp;
}

#endif /* KCCL_XDP_H */
