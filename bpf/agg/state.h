/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * agg/state.h: xdp_agg's configuration (read-only globals the loader sets
 * before load), its maps, and what a contribution carries into the slot's
 * locked section (struct contrib): what xdp_agg.bpf.c and its pieces
 * (agg/answer.h, agg/acks.h) share.  The layouts of the map values are in
 * bpf/include/kccl_agg.h.
 */
#ifndef KCCL_AGG_STATE_H
#define KCCL_AGG_STATE_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "kccl_agg.h"
#include "lib/kccl_members.h"
#include "agg/stats.h"

#define ETH_ALEN	6

#define KCCL_ANSWER_FIXED_LEN	(sizeof(struct udphdr) + KCCL_HDR_LEN)

/* Set by the loader before load (read-only after). */
const volatile __u32 cfg_job_id = 0;
const volatile __u16 cfg_port = 0;		/* host order */
const volatile __u16 cfg_my_rank = 0;
/* The job's chunk (crates/kccl/src/chunk.rs derives it from the group's
 * MTU); the loader always sets it.  0: not configured, nothing aggregated. */
const volatile __u32 cfg_chunk_bytes = 0;
const volatile __u32 cfg_nslots = 1024;	/* == max_entries of agg_slots */
const volatile __u64 cfg_slot_timeout_ns = 2000000000ULL;
const volatile __u64 cfg_wakeup_bytes = 1 << 20;
/* The job's largest contributor window (chunks beyond the lowest unanswered
 * one): a contribution of chunk c proves its sender holds every answer below
 * c + 1 - cfg_window.  Every contributor must use at most this. */
const volatile __u32 cfg_window = 256;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);		/* set by the loader (cfg_nslots) */
	__type(key, __u32);
	__type(value, struct kccl_agg_slot);
} agg_slots SEC(".maps");

/* Sub-blocks of the slots: entry n * subs + i is sub-block i of slot n
 * (subs = ceil(cfg_chunk_bytes / KCCL_AGG_SUB_BYTES)). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);		/* set by the loader (cfg_nslots * subs) */
	__type(key, __u32);
	__type(value, struct kccl_agg_sub);
} agg_acc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 << 20);		/* set by the loader */
} agg_records SEC(".maps");

/* What each rank proved it received (struct kccl_agg_acks). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct kccl_agg_acks);
} agg_acks SEC(".maps");

/* The calls aborted most recently (struct kccl_agg_aborted, written by
 * kccl_agg_sweep). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct kccl_agg_aborted);
} agg_aborted SEC(".maps");

_Static_assert((KCCL_AGG_ABORTED_MAX & (KCCL_AGG_ABORTED_MAX - 1)) == 0, "ring index is a mask");

/* Completed wire bytes per operation, for the wake-up policy. */
struct kccl_agg_op_key {
	__u32 job_id;
	__u32 op_id;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct kccl_agg_op_key);
	__type(value, __u64);
} agg_op_progress SEC(".maps");

/* What a contribution needs in the locked section. */
struct contrib {
	__u64 mask, bit, now;
	__u32 op_id, frag, msg_len, pay_len, mask_base, op, dt;
	/* The DONE chunk (proven_op, proven_frag) the slot held before the
	 * lock: every one of its contributors proved it has the answer. */
	__u32 proven_op, proven_frag;
	bool proven;
	bool allreduce;
};

#endif /* KCCL_AGG_STATE_H */
