/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl_members.h: the members map, rank -> struct kccl_member (address,
 * port, next-hop MAC), filled by the runtime (crates/kccl/src/kernel/
 * members.rs).  Declared once here for every program that answers or
 * checks members: tc_bcast, xdp_agg and tc_agg_result (one map for both:
 * the loader reuses xdp_agg's), xdp_sg.  KCCL_MAX_MEMBERS entries, unless
 * the program defines KCCL_MEMBERS_MAX before including this (xdp_sg: its
 * KCCL_SG_MAX_RANKS workers).
 */
#ifndef KCCL_MEMBERS_H
#define KCCL_MEMBERS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "kccl_bcast.h"

#ifndef KCCL_MEMBERS_MAX
#define KCCL_MEMBERS_MAX	KCCL_MAX_MEMBERS
#endif

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, KCCL_MEMBERS_MAX);
	__type(key, __u32);
	__type(value, struct kccl_member);
} members SEC(".maps");

#endif /* KCCL_MEMBERS_H */
