/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl_sg.h: the kernel scatter-gather coordinator's state shared between
 * xdp_sg (bpf/xdp_sg.bpf.c) and the runtime (crates/kccl/src/kernel/sg.rs
 * reads these layouts from the skeleton's generated types; its tests check
 * the sizes below).  Protocol: kccl_wire.h (KCCL_T_SG_REQUEST/REPLY),
 * docs/SCATTER_GATHER.md.
 *
 * One request in flight is one slot: sg_slots[id & (nslots - 1)] holds its
 * bookkeeping under a bpf_spin_lock, sg_acc[same index] its int64
 * accumulators (an mmapable array the runtime reads in place when the
 * request ends).  The runtime opens and closes slots through kccl_sg_ctl
 * (BPF_PROG_TEST_RUN with a struct kccl_sg_ctl as the packet), so every
 * change of a slot happens under its lock.
 */
#ifndef KCCL_SG_H
#define KCCL_SG_H

#include "kccl_types.h"

/* Workers one request can ask: ranks 0 .. KCCL_SG_MAX_RANKS - 1. */
#define KCCL_SG_MAX_RANKS	1024
#define KCCL_SG_MASK_WORDS	(KCCL_SG_MAX_RANKS / 64)
/* Elements of one reply the kernel combines (int32 or int64); a longer
 * reply, or one of several fragments, is the user path's (TOO_LONG). */
#define KCCL_SG_MAX_ELEMS	1024
#define KCCL_SG_MAX_PAYLOAD	(KCCL_SG_MAX_ELEMS * 8)
_Static_assert((KCCL_SG_MAX_PAYLOAD & (KCCL_SG_MAX_PAYLOAD - 1)) == 0, "xdp_sg bounds lengths with a mask");
/* Slots (requests in flight): a power of two, the loader's choice. */
#define KCCL_SG_MAX_SLOTS	65536

/* kccl_sg_slot.state */
enum kccl_sg_state {
	KCCL_SG_FREE	= 0,	/* never opened, or closed and read */
	KCCL_SG_OPEN	= 1,	/* replies are combined */
	KCCL_SG_DONE	= 2,	/* its policy was met: no more replies */
	KCCL_SG_CLOSED	= 3,	/* the runtime ended it (deadline, abandoned) */
};

/* kccl_sg_slot.flags */
enum kccl_sg_flag {
	KCCL_SGF_OVERFLOW = 1 << 0,	/* an int64 sum overflowed: see overflow_at */
};

struct kccl_sg_slot {
	struct bpf_spin_lock lock;
	__u32 state;		/* enum kccl_sg_state */
	__u32 req_id;		/* the request (msg_seq of its replies) */
	__u32 need;		/* replies that complete it (its policy) */
	__u32 answered;		/* replies combined */
	__u32 nelem;		/* elements of the longest reply so far */
	__u8  op;		/* enum kccl_agg_op: SUM, COUNT, MAX or MIN */
	__u8  dtype;		/* enum kccl_dtype: I32 or I64 */
	__u16 flags;		/* enum kccl_sg_flag */
	__u32 overflow_at;	/* first element whose sum overflowed */
	__u64 opened_ns;	/* bpf_ktime_get_ns() of the open */
	__u64 asked[KCCL_SG_MASK_WORDS];	/* bit r: rank r was asked */
	__u64 seen[KCCL_SG_MASK_WORDS];		/* bit r: rank r's reply is in */
	__u64 refused[KCCL_SG_MASK_WORDS];	/* bit r: rank r's reply could not be combined */
};
_Static_assert(sizeof(struct kccl_sg_slot) == 40 + 3 * 8 * KCCL_SG_MASK_WORDS, "slot layout");

/* sg_acc[slot]: the combined elements (int64, host order). */
struct kccl_sg_acc {
	__s64 v[KCCL_SG_MAX_ELEMS];
};

/* kccl_sg_ctl.cmd */
enum kccl_sg_cmd {
	KCCL_SG_CMD_OPEN  = 1,	/* take slot req_id & (nslots - 1) for req_id */
	KCCL_SG_CMD_CLOSE = 2,	/* end request req_id, report what it holds */
};

/* kccl_sg_ctl.result */
enum kccl_sg_ctl_result {
	KCCL_SG_CTL_OK		= 1,
	KCCL_SG_CTL_BAD		= 2,	/* malformed command (length, need, op, dtype) */
	KCCL_SG_CTL_NOT_OURS	= 3,	/* CLOSE: the slot holds another request */
};

/*
 * The packet of a kccl_sg_ctl run (data_in), written back as data_out:
 *  - OPEN: req_id, need (1 .. the number of asked ranks), op, dtype, asked.
 *    A slot that still holds an OPEN request is taken over (counted: the
 *    runtime closes every request it gives up, so this is a leak).
 *  - CLOSE: req_id.  Out: state (the slot's state before the close),
 *    answered, nelem, flags, overflow_at, asked/seen/refused; the
 *    accumulators in sg_acc are final once it returned.
 * result (out) is enum kccl_sg_ctl_result.
 */
struct kccl_sg_ctl {
	__u32 cmd;		/* enum kccl_sg_cmd */
	__u32 result;		/* out: enum kccl_sg_ctl_result */
	__u32 req_id;
	__u32 need;
	__u32 state;		/* out (CLOSE) */
	__u32 answered;		/* out (CLOSE) */
	__u32 nelem;		/* out (CLOSE) */
	__u8  op;
	__u8  dtype;
	__u16 flags;		/* out (CLOSE) */
	__u32 overflow_at;	/* out (CLOSE) */
	__u32 pad;
	__u64 asked[KCCL_SG_MASK_WORDS];
	__u64 seen[KCCL_SG_MASK_WORDS];		/* out (CLOSE) */
	__u64 refused[KCCL_SG_MASK_WORDS];	/* out (CLOSE) */
};
_Static_assert(sizeof(struct kccl_sg_ctl) == 40 + 3 * 8 * KCCL_SG_MASK_WORDS, "ctl layout");

/* sg_done ring buffer record: request req_id met its policy; its elements
 * are sg_acc[slot].v[0 .. nelem). */
struct kccl_sg_done {
	__u32 req_id;
	__u32 slot;
	__u32 answered;
	__u32 nelem;
	__u16 flags;		/* enum kccl_sg_flag */
	__u8  op;
	__u8  dtype;
	__u32 overflow_at;
	__u64 seen[KCCL_SG_MASK_WORDS];
};
_Static_assert(sizeof(struct kccl_sg_done) == 24 + 8 * KCCL_SG_MASK_WORDS, "done record layout");

/* sg_stats[i], per CPU: what became of every packet xdp_sg saw. */
enum kccl_sg_stat {
	KCCL_SGS_PASSED = 0,	/* not a scatter-gather reply to our port */
	KCCL_SGS_OTHER_JOB,	/* reply of another job: passed */
	KCCL_SGS_UNCLAIMED,	/* no kernel slot holds its request: passed to the runtime */
	KCCL_SGS_COMBINED,	/* reply combined into its request */
	KCCL_SGS_COMPLETED,	/* ... and it met the request's policy */
	KCCL_SGS_DUP,		/* the worker's reply was in already: dropped */
	KCCL_SGS_LATE,		/* request done or closed: dropped */
	KCCL_SGS_NOT_MEMBER,	/* source address is not its src_rank's: dropped */
	KCCL_SGS_NOT_ASKED,	/* the worker was not asked: dropped */
	KCCL_SGS_MISMATCH,	/* op or dtype differ from the request's: dropped, refused */
	KCCL_SGS_TOO_LONG,	/* multi-fragment or over KCCL_SG_MAX_ELEMS: dropped, refused */
	KCCL_SGS_MALFORMED,	/* lengths disagree, partial element: dropped */
	KCCL_SGS_RING_FULL,	/* done record lost: the runtime finds it at CLOSE */
	KCCL_SGS_OPENED,	/* kccl_sg_ctl OPEN */
	KCCL_SGS_TAKEN_OVER,	/* OPEN found an OPEN request in the slot */
	KCCL_SGS_CLOSED,	/* kccl_sg_ctl CLOSE */
	KCCL_SGS_NR,
};

#endif /* KCCL_SG_H */
