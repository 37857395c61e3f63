/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types shared between the aggregation programs (xdp_agg.bpf.c,
 * tc_agg_result.bpf.c) and the Rust runtime: slot layout, ring buffer record,
 * counters.  The runtime uses the skeleton-generated copies of these types.
 *
 * Model: an operation (job_id, op id = msg_seq) is cut into chunks of the
 * job's chunk size (cfg_chunk_bytes, every contributor uses the same).  Chunk
 * c of an operation lives in slot (hash(op id) + c) & (nslots - 1) while it is
 * being aggregated.  A slot (with its sub-blocks, struct kccl_agg_sub)
 * accumulates in 64-bit integers, remembers which
 * contributors it has seen (one bit each, so a retransmission is never counted
 * twice) and completes when seen == expected.  Senders keep at most a window
 * of chunks in flight, smaller than nslots, so two chunks of one operation
 * never need the same slot at once; a chunk that finds its slot taken by
 * another live chunk is dropped and counted (the sender retransmits).
 */
#ifndef KCCL_AGG_H
#define KCCL_AGG_H

#include "kccl_wire.h"
#include "kccl_bcast.h"	/* KCCL_MAX_MEMBERS */

/*
 * A chunk is combined in sub-blocks of KCCL_AGG_SUB_BYTES: sub-block i of the
 * chunk in slot n has its own accumulators and lock (struct kccl_agg_sub,
 * entry n * subs + i of agg_acc, subs = ceil(chunk / KCCL_AGG_SUB_BYTES)), so
 * a chunk of up to KCCL_AGG_MAX_PAYLOAD bytes (one multi-buffer XDP frame on
 * a large MTU) is added one sub-block at a time, each under a short lock, and
 * a job of small chunks (1432 bytes for a 1500-byte MTU) pays for one
 * sub-block per slot.  3432 is a multiple of 24 (the loops' block) and of 8;
 * 19 of them (65208 bytes) plus the headers fit one IPv4 datagram.
 */
#define KCCL_AGG_SUB_BYTES	3432
#define KCCL_AGG_SUB_ELEMS	(KCCL_AGG_SUB_BYTES / 4)	/* 858 */
#define KCCL_AGG_MAX_SUBS	19
#define KCCL_AGG_MAX_PAYLOAD	(KCCL_AGG_SUB_BYTES * KCCL_AGG_MAX_SUBS)	/* 65208 */
#define KCCL_AGG_MAX_ELEMS	(KCCL_AGG_MAX_PAYLOAD / 4)

_Static_assert(KCCL_AGG_MAX_PAYLOAD + 20 + 8 + KCCL_HDR_LEN <= 65535, "a chunk fits one IPv4 datagram");

/* kccl_agg_slot.state */
enum kccl_slot_state {
	KCCL_SLOT_FREE		= 0,
	KCCL_SLOT_ACTIVE	= 1,	/* accumulating */
	KCCL_SLOT_DELIVERING	= 2,	/* complete; the completer is emitting the result */
	KCCL_SLOT_DONE		= 3,	/* result emitted; kept to answer retransmissions */
	KCCL_SLOT_UNDELIVERED	= 4,	/* complete, ring buffer was full: retried on the
					 * next retransmission of the chunk */
};

/* Ring buffer record of one completed reduce chunk: this header, then
 * payload_len / element size int64 values (the chunk's sub-blocks in order).
 * Also the header part of a slot. */
struct kccl_agg_record {
	__u32 job_id;
	__u32 op_id;
	__u32 frag_off;		/* byte offset of the chunk in the wire data */
	__u32 msg_len;		/* the operation's wire bytes */
	__u16 payload_len;	/* wire bytes of this chunk */
	__u16 mask_base;
	__u8  agg_op;		/* enum kccl_agg_op */
	__u8  dtype;		/* enum kccl_dtype */
	__u8  overflow;		/* an int64 sum overflowed (I64 only) */
	__u8  pad;
	__u64 contributors;	/* the seen mask (== expected) */
};

#define KCCL_AGG_RECORD_HDR_LEN	32	/* sizeof(struct kccl_agg_record) */
_Static_assert(sizeof(struct kccl_agg_record) == KCCL_AGG_RECORD_HDR_LEN, "record header");

/*
 * What each rank has proven it received (index: rank): 0 = nothing, else
 * (op_id << 32) | (bound + 1): the rank holds the answer of every chunk it
 * contributed to operations before op_id (serial-number order) and of every
 * chunk of op_id below `bound`.  Raised by its contributions (chunk c of op
 * proves bound c + 1 - cfg_window: a contributor sends chunk c only when
 * every chunk below c + 1 - window is answered) and by KCCL_T_AGG_RECEIPT.
 * One 64-bit store per update: readers never see a torn value.
 */
struct kccl_agg_acks {
	__u64 v[KCCL_MAX_MEMBERS];
};

struct kccl_agg_slot {
	struct bpf_spin_lock lock;
	__u32 state;		/* enum kccl_slot_state */
	__u64 expected;		/* contributor mask of the operation */
	__u64 seen;		/* contributors added (every sub-block) */
	__u64 busy;		/* contributors being added right now (their
				 * sub-blocks are combined outside this lock) */
	__u64 claimed_ns;	/* bpf_ktime_get_ns() when the chunk took the slot;
				 * DONE: when it completed */
	__u64 gen;		/* claim generation (increases): sub-blocks of an
				 * older generation are stale */
	struct kccl_agg_record rec;
};

_Static_assert(sizeof(struct kccl_agg_slot) == 48 + KCCL_AGG_RECORD_HDR_LEN, "slot layout");

/* The BPF_PROG_TEST_RUN input of kccl_agg_sweep (the first bytes of its
 * data; all zero: the timeout sweep only).  With KCCL_SWEEP_CALL it also
 * frees every ACTIVE slot of one call of the job at once (op ids call_op ..
 * call_op + 3): a member aborted it (KCCL_T_AGG_ABORT), so no contribution
 * of it will complete. */
struct kccl_agg_sweep_req {
	__u32 flags;		/* KCCL_SWEEP_CALL */
	__u32 call_op;		/* the call's first op id (call * 4) */
};

#define KCCL_SWEEP_CALL 1

_Static_assert(sizeof(struct kccl_agg_sweep_req) == 8, "sweep request layout");

/* The calls of the job aborted most recently (agg_aborted, one entry):
 * kccl_agg_sweep with KCCL_SWEEP_CALL records the call in calls[next %
 * KCCL_AGG_ABORTED_MAX] (KCCL_AGG_ABORTED_VALID | call_op) before it frees
 * its slots, and xdp_agg passes a later contribution of such a call up
 * untouched (KCCL_AS_ABORTED_CALL): a member that contributes late gets the
 * call's abort from user space (UserAggregator::resend_abort) instead of
 * claiming a slot that can never complete.  Only the runtime writes it
 * (one writer); xdp_agg reads whole aligned 8-byte words. */
#define KCCL_AGG_ABORTED_MAX	8
#define KCCL_AGG_ABORTED_VALID	(1ULL << 32)

struct kccl_agg_aborted {
	__u64 next;
	__u64 calls[KCCL_AGG_ABORTED_MAX];
};

_Static_assert(sizeof(struct kccl_agg_aborted) == 8 + 8 * KCCL_AGG_ABORTED_MAX, "aborted calls layout");

/* One sub-block's accumulators (agg_acc).  `gen` is the slot generation they
 * belong to: the first contribution of a newer generation resets `count` and
 * STORES its values (no initialisation pass at the claim); one of an older
 * generation is stale and adds nothing. */
struct kccl_agg_sub {
	struct bpf_spin_lock lock;
	__u32 count;		/* contributions added in generation gen */
	__u64 gen;
	__s64 acc[KCCL_AGG_SUB_ELEMS];	/* sub-block bytes / element size used */
};

_Static_assert(sizeof(struct kccl_agg_sub) == 16 + KCCL_AGG_SUB_ELEMS * 8, "sub-block layout");

/* A record of agg_miss_events (tc_agg_result): a destination its fan-out
 * could not serve, with the answer itself, so that the runtime sends that
 * copy from user space at once (the kernel's slot may be reused, and a
 * reduce's ACK or an allreduce's RESULT is not rebuilt there).  dgram is the
 * answer's UDP payload (kccl header and payload, FANOUT already cleared);
 * dgram_len 0 if it could not be copied (the event still names the rank). */
#define KCCL_AGG_MISS_DGRAM_MAX	(KCCL_HDR_LEN + KCCL_AGG_MAX_PAYLOAD)

struct kccl_agg_miss {
	struct kccl_miss_event ev;
	__u32 dgram_len;
	__u32 pad;
	__u8  dgram[KCCL_AGG_MISS_DGRAM_MAX];
};

_Static_assert(sizeof(struct kccl_agg_miss) == 24 + KCCL_AGG_MISS_DGRAM_MAX, "miss record layout");

/* Per-CPU counters of the aggregation programs (index into agg_stats). */
enum kccl_agg_stat {
	KCCL_AS_PKTS = 0,	/* contributions added to a slot */
	KCCL_AS_CHUNKS_DONE,	/* chunks completed */
	KCCL_AS_RESULTS,	/* allreduce result packets emitted (before fan-out) */
	KCCL_AS_ACKS,		/* reduce ack packets emitted (before fan-out) */
	KCCL_AS_RECORDS,	/* ring buffer records written */
	KCCL_AS_DUP,		/* contribution already counted (slot still active) */
	KCCL_AS_DUP_DONE,	/* contribution for a finished chunk: result re-sent */
	KCCL_AS_BUSY,		/* slot held by another live chunk: dropped */
	KCCL_AS_RECLAIMED,	/* abandoned chunk's slot taken after the deadline */
	KCCL_AS_MISMATCH,	/* op/type/length/contributors differ from the slot's */
	KCCL_AS_NOT_CONTRIB,	/* sender not in the contributor mask */
	KCCL_AS_NOT_MEMBER,	/* source address is not the sender rank's */
	KCCL_AS_MALFORMED,	/* kccl magic but bad header: dropped */
	KCCL_AS_UNSUPPORTED,	/* op/type the kernel does not do: passed to user space */
	KCCL_AS_USER_ONLY,	/* KCCL_F_USER_ONLY: passed to user space */
	KCCL_AS_OTHER_JOB,	/* kccl packet of another job: passed */
	KCCL_AS_RING_FULL,	/* ring buffer full: result kept, retried */
	KCCL_AS_OVERFLOW,	/* result chunks with a saturated or overflowed element */
	KCCL_AS_PASSED,		/* not kccl aggregation traffic: passed */
	KCCL_AS_FANOUT_COPIES,	/* tc_agg_result: copies sent */
	KCCL_AS_FANOUT_MISSED,	/* tc_agg_result: destinations it could not serve */
	KCCL_AS_HELD,		/* slot DONE and not yet proven delivered: dropped */
	KCCL_AS_PENDING,	/* PENDING answers to counted retransmissions */
	KCCL_AS_RECEIPTS,	/* KCCL_T_AGG_RECEIPT packets taken */
	KCCL_AS_SWEPT,		/* ACTIVE slots freed by kccl_agg_sweep */
	KCCL_AS_STALE,		/* contribution its sender proved it has the answer of: dropped */
	KCCL_AS_TRIMMED,	/* tc_agg_result: answers cut to their datagram */
	KCCL_AS_ACKS_LATER,	/* reduce chunks recorded without an ACK (KCCL_F_ACK_LATER) */
	KCCL_AS_NEXT_HOP_LEARNED, /* members[rank].mac set from a packet's source MAC */
	KCCL_AS_ABORT_FREED,	/* ACTIVE slots of an aborted call freed (kccl_agg_sweep) */
	KCCL_AS_ABORTED_CALL,	/* contribution of a recently aborted call: passed */
	KCCL_AS_OWN_RECORDS,	/* allreduce results recorded for this host's own contributor */
	KCCL_AS_OWN_RING_FULL,	/* ... ring full: the owner's retransmission fetches it */
	KCCL_AS_OWN_SKIPPED,	/* tc_agg_result: answers not sent back to this host itself */
	KCCL_AS_NR,
};

#endif /* KCCL_AGG_H */
