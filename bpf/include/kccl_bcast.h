/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types shared between tc_bcast.bpf.c and the Rust runtime (maps, ring buffer
 * events, counters).  The runtime uses the skeleton-generated copies of these
 * types, never a hand-written mirror.
 */
#ifndef KCCL_BCAST_H
#define KCCL_BCAST_H

#include "kccl_types.h"

/* Rank capacity of the members map; also bounds mask_base + 63. */
#define KCCL_MAX_MEMBERS 4096

/* kccl_member.flags */
enum kccl_member_flag {
	KCCL_M_PRESENT	= 1 << 0,	/* slot holds a member */
	KCCL_M_RESOLVED	= 1 << 1,	/* mac is a complete neighbour entry */
};

/* members[rank]: where the fan-out sends rank's copy. */
struct kccl_member {
	__u32 ip_be;		/* IPv4 address, network order */
	__u16 port_be;		/* UDP port, network order */
	__u8  mac[6];		/* next-hop MAC from the kernel's neighbour table */
	__u32 flags;		/* enum kccl_member_flag */
};

/* Why a destination was not served by the kernel fan-out. */
enum kccl_miss_reason {
	KCCL_MISS_UNRESOLVED	= 1,	/* no neighbour entry: runtime resolves it */
	KCCL_MISS_NOT_MEMBER	= 2,	/* bit set for a rank not in members */
	KCCL_MISS_CLONE_FAILED	= 3,	/* bpf_clone_redirect returned an error */
};

/* Ring buffer record: the runtime re-sends this fragment to this rank. */
struct kccl_miss_event {
	__u32 job_id;
	__u32 msg_seq;
	__u32 frag_off;
	__u16 rank;
	__u16 reason;		/* enum kccl_miss_reason */
};

/* Per-CPU counters of the broadcast program (index into bcast_stats). */
enum kccl_bcast_stat {
	KCCL_BS_FANOUT_PKTS = 0,	/* kccl packets fanned out */
	KCCL_BS_COPIES,			/* copies sent (clones + the original) */
	KCCL_BS_MISSED,			/* destinations left to user space */
	KCCL_BS_MALFORMED,		/* kccl magic but bad header: passed untouched */
	KCCL_BS_OTHER_JOB,		/* kccl packet of another job: passed */
	KCCL_BS_PASSED,			/* not kccl: passed untouched */
	KCCL_BS_NR,
};

#endif /* KCCL_BCAST_H */
