// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tc_fault: a fault injector for kccl packets (TCX egress), because the test
 * kernel has no netem.
 *
 * What it does: for every UDP/IPv4 datagram leaving the interface whose
 * payload starts with KCCL_MAGIC it draws one pseudo-random number u in
 * [0, 1e6) and, with the probabilities of fault_cfg (parts per million,
 * mutually exclusive outcomes, loss + dup + reorder <= 1e6):
 *   u < loss                      drop (TC_ACT_SHOT);
 *   u < loss + dup                duplicate: one clone (cfg_pass_mark) is
 *                                 bpf_clone_redirect()ed to the same interface,
 *                                 the original passes too;
 *   u < loss + dup + reorder      hold: the packet's bytes are copied into this
 *                                 CPU's hold slot and the packet is dropped
 *                                 (if the slot is already full: "pass", below);
 *   otherwise                     pass; if this CPU holds a packet it is
 *                                 released AFTER the current one: the current
 *                                 packet goes out as a clone (cfg_pass_mark),
 *                                 then a second clone (cfg_release_mark) which,
 *                                 when it re-enters this hook, is rewritten to
 *                                 the held bytes (bpf_skb_change_tail +
 *                                 bpf_skb_store_bytes); the original skb is
 *                                 dropped.  So the held packet leaves after a
 *                                 later one: reordering.
 * A GSO packet (one UDP_SEGMENT send of several datagrams, cut apart after
 * this hook) gets one decision for all its datagrams: dropped or duplicated
 * whole, so its loss comes as a burst; it is never held and never releases
 * a held packet (a held packet's bytes replayed into a GSO clone would be
 * segmented by the clone's GSO state).
 * Every other packet (non-IP, non-UDP, fragments, no kccl magic) passes
 * (TCX_NEXT) untouched and is not counted.  Counters (per CPU, enum kccl_fault_stat):
 * seen, dropped, duplicated, held, released, passed (kccl packets that went
 * out unharmed, including the ones that released a held packet).
 *
 * Configuration lives in a map (fault_cfg, one entry), not in rodata: `kccl
 * fault` changes probabilities and seed of an installed (pinned) injector
 * without reloading or re-attaching it, and tests re-seed between runs.
 *
 * Randomness: splitmix64, per-CPU state.  Whenever fault_cfg.epoch differs
 * from the epoch a CPU's state was seeded at (user space bumps the epoch on
 * every configuration write), that CPU re-seeds with
 * seed ^ (cpu * 0x9e3779b97f4a7c15).  One CPU therefore makes a reproducible
 * decision sequence from the seed; with several CPUs the overall sequence
 * depends on which CPU handles which packet (the reference model in
 * crates/kccl/src/fault.rs, FaultRng, is exact for one CPU).
 *
 * What it assumes:
 *  - Attached at TCX EGRESS.  At ingress, drop and hold would work, but the
 *    duplicate and release copies are clone-redirected to the device's egress
 *    (flags 0), i.e. sent back out of the interface, so the loader attaches
 *    at egress only.
 *  - bpf_clone_redirect() to egress transmits synchronously on the same CPU:
 *    the marked clones re-enter this hook before it returns, which is what
 *    makes the per-CPU hold slot safe (no other user on this CPU meanwhile).
 *  - It is appended LAST to the interface's TCX egress chain and passes with
 *    TCX_NEXT, never TC_ACT_OK (which ends a TCX chain): the kccl programs
 *    before it (tc_bcast's fan-out) run first, so the injector acts on the
 *    copies that really leave the host, one decision per copy.
 *  - A held packet is released only by a later kccl packet passing on the
 *    same CPU; removing the injector loses it.  Packets longer than
 *    KCCL_FAULT_SLOT bytes are never held (they pass).
 *  - The held bytes are replayed exactly; checksums are whatever the held
 *    skb carried.  With checksum offload (CHECKSUM_PARTIAL, e.g. UDP sockets
 *    on veth) the replayed packet's checksum is completed at the same offset
 *    as the releasing packet's, which is right because both are UDP/IPv4
 *    kccl packets with the same IP header length.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"
#include "lib/kccl_skb.h"

#define TC_ACT_SHOT	2
/* "Not mine, or passed unharmed": let the next program of the TCX chain run
 * (TC_ACT_OK would end the chain; see "What it assumes"). */
#define TCX_NEXT	-1

#define KCCL_FAULT_SLOT	2048	/* largest packet that can be held, bytes */
#define PPM		1000000ULL
#define GOLDEN		0x9e3779b97f4a7c15ULL

/* n in [1, KCCL_FAULT_SLOT] for the verifier; equal to n when it already is. */
#define SLOT_BOUND(n)	((((n) - 1) & (KCCL_FAULT_SLOT - 1)) + 1)

/* Marks of our own copies (set before load; read-only after). */
const volatile __u32 cfg_pass_mark = 0x6b636670;	/* "kcfp" */
const volatile __u32 cfg_release_mark = 0x6b636672;	/* "kcfr" */

struct kccl_fault_cfg {
	__u32 loss_ppm;
	__u32 dup_ppm;
	__u32 reorder_ppm;
	__u32 pad;
	__u64 seed;
	__u64 epoch;	/* bumped by user space on every write: re-seeds */
};

struct kccl_fault_rng {
	__u64 state;
	__u64 epoch;
};

struct kccl_fault_slot {
	__u32 len;	/* 0: empty */
	__u32 pad;
	__u8 data[KCCL_FAULT_SLOT];
};

enum kccl_fault_stat {
	KCCL_FS_SEEN,
	KCCL_FS_DROPPED,
	KCCL_FS_DUPLICATED,
	KCCL_FS_HELD,
	KCCL_FS_RELEASED,
	KCCL_FS_PASSED,
	KCCL_FS_NR,
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct kccl_fault_cfg);
} fault_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct kccl_fault_rng);
} fault_rng SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct kccl_fault_slot);
} fault_hold SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, KCCL_FS_NR);
	__type(key, __u32);
	__type(value, __u64);
} fault_stats SEC(".maps");

/* Anchor: the config layout comes to user space through the skeleton. */
struct kccl_fault_cfg kccl_fault_cfg_layout;

static __always_inline void stat_add(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&fault_stats, &idx);

	if (v)
		*v += 1;
}

/* Rewrites a release clone into the held packet of this CPU. */
static __always_inline int replay_held(struct __sk_buff *skb)
{
	__u32 zero = 0, len;
	struct kccl_fault_slot *slot = bpf_map_lookup_elem(&fault_hold, &zero);

	if (!slot)
		return TC_ACT_SHOT;
	len = slot->len;
	if (len < 14 || len > KCCL_FAULT_SLOT)
		return TC_ACT_SHOT;	/* nothing held: nothing to send */
	if (bpf_skb_change_tail(skb, len, 0) ||
	    bpf_skb_store_bytes(skb, 0, slot->data, SLOT_BOUND(len), 0))
		return TC_ACT_SHOT;
	slot->len = 0;
	skb->mark = 0;
	stat_add(KCCL_FS_RELEASED);
	return TCX_NEXT;
}

SEC("tcx/egress")
int kccl_tc_fault(struct __sk_buff *skb)
{
	struct iphdr ip;
	struct kccl_l4 l4;
	struct kccl_fault_cfg *cfg;
	struct kccl_fault_rng *rng;
	struct kccl_fault_slot *slot;
	__u32 zero = 0, l4_off, len, mark;
	__u64 z, u;

	if (skb->mark == cfg_pass_mark)
		return TCX_NEXT;
	if (skb->mark == cfg_release_mark)
		return replay_held(skb);

	l4_off = kccl_skb_l4(skb, &ip, &l4);
	if (!l4_off)
		return TCX_NEXT;

	cfg = bpf_map_lookup_elem(&fault_cfg, &zero);
	rng = bpf_map_lookup_elem(&fault_rng, &zero);
	slot = bpf_map_lookup_elem(&fault_hold, &zero);
	if (!cfg || !rng || !slot)
		return TCX_NEXT;
	stat_add(KCCL_FS_SEEN);

	if (rng->epoch != cfg->epoch) {
		rng->state = cfg->seed ^ ((__u64)bpf_get_smp_processor_id() * GOLDEN);
		rng->epoch = cfg->epoch;
	}
	/* splitmix64 */
	rng->state += GOLDEN;
	z = rng->state;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	z ^= z >> 31;
	u = ((z >> 32) * PPM) >> 32;	/* uniform in [0, 1e6) */

	if (u < cfg->loss_ppm) {
		stat_add(KCCL_FS_DROPPED);
		return TC_ACT_SHOT;
	}
	u -= cfg->loss_ppm;
	mark = skb->mark;
	if (u < cfg->dup_ppm) {
		skb->mark = cfg_pass_mark;
		if (!bpf_clone_redirect(skb, skb->ifindex, 0))
			stat_add(KCCL_FS_DUPLICATED);
		skb->mark = mark;
		stat_add(KCCL_FS_PASSED);
		return TCX_NEXT;
	}
	u -= cfg->dup_ppm;
	len = skb->len;
	if (u < cfg->reorder_ppm && slot->len == 0 && !skb->gso_size && len >= 14 && len <= KCCL_FAULT_SLOT) {
		if (bpf_skb_load_bytes(skb, 0, slot->data, SLOT_BOUND(len)))
			goto pass;
		slot->len = len;
		stat_add(KCCL_FS_HELD);
		return TC_ACT_SHOT;
	}
pass:
	stat_add(KCCL_FS_PASSED);
	if (slot->len == 0 || skb->gso_size)
		return TCX_NEXT;
	/* Release after this packet: this one first (as a clone), then the
	 * held one (a clone rewritten on re-entry), then drop the original. */
	skb->mark = cfg_pass_mark;
	if (bpf_clone_redirect(skb, skb->ifindex, 0)) {
		skb->mark = mark;
		return TCX_NEXT;	/* could not send it first: send it normally */
	}
	skb->mark = cfg_release_mark;
	bpf_clone_redirect(skb, skb->ifindex, 0);
	skb->mark = mark;
	return TC_ACT_SHOT;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
