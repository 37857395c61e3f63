/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * agg/stats.h: the aggregation engine's counters (enum kccl_agg_stat, one
 * per-CPU array), declared once for its two programs: xdp_agg counts
 * what it aggregates and drops, tc_agg_result its fan-out (FANOUT_COPIES,
 * FANOUT_MISSED); the loader gives both one map.
 */
#ifndef KCCL_AGG_STATS_H
#define KCCL_AGG_STATS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "kccl_agg.h"

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, KCCL_AS_NR);
	__type(key, __u32);
	__type(value, __u64);
} agg_stats SEC(".maps");

static __always_inline void stat_add(__u32 idx, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&agg_stats, &idx);

	if (v)
		*v += n;
}

#endif /* KCCL_AGG_STATS_H */
