/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl wire format: the ONE definition of every byte kccl puts on the wire.
 *
 * A kccl datagram is an ordinary UDP/IPv4 datagram whose payload starts with
 * struct kccl_hdr, followed by payload_len bytes of message data.  All
 * multi-byte fields are big-endian (network order) so that a receiver in any
 * language can parse them with a fixed format string (Python: "!IBBHIHHQIIIHBB").
 *
 * The Rust runtime (crates/kccl/src/wire.rs) encodes/decodes this layout; its
 * tests check the skeleton-generated copy of this struct (size, offsets) and
 * golden bytes, so the two cannot drift apart silently.
 */
#ifndef KCCL_WIRE_H
#define KCCL_WIRE_H

#include "kccl_types.h"

#define KCCL_MAGIC	0x4b43434cU	/* "KCCL" */
#define KCCL_VERSION	1

/* kccl_hdr.type */
enum kccl_msg_type {
	KCCL_T_BCAST	  = 1,	/* broadcast data fragment */
	KCCL_T_AGG	  = 2,	/* aggregation contribution: member -> aggregator */
	KCCL_T_AGG_RESULT = 3,	/* allreduce result of one chunk: aggregator -> contributors */
	KCCL_T_AGG_ACK	  = 4,	/* reduce: chunk aggregated (no payload): aggregator -> contributors */
	KCCL_T_BCAST_ACK  = 5,	/* broadcast acknowledgment: receiver -> broadcast sender */
	/* Aggregator -> one contributor: its retransmission of a chunk that is
	 * still aggregating was already counted.  Payload: 8 bytes, big-endian,
	 * the contributors of the chunk still missing (bit i: rank
	 * mask_base + i); dst_mask = the retransmitting contributor's bit. */
	KCCL_T_AGG_PENDING = 6,
	/* Contributor -> aggregator, no payload: "I hold the answer of every
	 * chunk I contributed to operations before msg_seq, and of every chunk
	 * of msg_seq that starts below frag_off" (cumulative).  Lets the
	 * aggregator reuse the slots of those chunks (docs/AGGREGATION.md,
	 * "Slot reuse"). */
	KCCL_T_AGG_RECEIPT = 7,
	/* Contributor -> allreduce aggregator, no payload, msg_seq 0: "which
	 * call do I start at?"  Sent once, before a member's first allreduce,
	 * so that a member process started again against a
	 * long-lived aggregator does not reuse op ids whose answers (or
	 * receipts) the aggregator still holds. */
	KCCL_T_AGG_SYNC = 8,
	/* Aggregator -> that contributor, no payload: msg_seq = the op id of
	 * the call to start at (call * 4): the call after the latest one any
	 * member's receipt said was finished. */
	KCCL_T_AGG_SYNC_ACK = 9,
	/* Reduce root -> one contributor: chunks of operation msg_seq the
	 * root's runtime has taken (read their records), in one datagram
	 * instead of an ACK per chunk.  Answers contributions that carried
	 * KCCL_F_ACK_LATER.  frag_off = byte offset of the chunk of bitmap
	 * bit 0 (a multiple of the chunk size, below msg_len); payload = the
	 * bitmap, 1 .. KCCL_AGG_ACKS_MAX_BYTES bytes: bit i (byte i / 8, bit
	 * i % 8, least significant first) set <=> chunk frag_off / chunk + i
	 * is taken.  msg_len, agg_op, dtype as in the contributions;
	 * dst_mask = the contributor's bit. */
	KCCL_T_AGG_ACKS = 10,
	/* Any member of an operation -> the others (contributors, aggregator
	 * or root), no FANOUT: the operation cannot complete and why, so
	 * nobody waits out the deadline for a contribution that will never
	 * come.  msg_seq = the op id of the call's first operation (call * 4:
	 * it covers every operation of the call), src_rank = the rank that
	 * found the problem, mask_base/dst_mask = the call's contributors;
	 * payload = one byte enum kccl_abort_reason, then UTF-8 text (at most
	 * KCCL_AGG_ABORT_MAX_TEXT bytes) saying what the user must fix. */
	KCCL_T_AGG_ABORT = 11,
	/* Scatter-gather (docs/SCATTER_GATHER.md).  Coordinator -> workers: one
	 * request, one datagram.  src_rank = the coordinator, mask_base/dst_mask
	 * = the workers asked (the user path sends each worker a copy with its
	 * own bit), msg_seq = the request id (wraps), frag_off 0, msg_len =
	 * payload_len = the request's bytes, LAST_FRAG; agg_op = how replies
	 * combine (enum kccl_agg_op: SUM, COUNT, MAX, MIN or CONCAT), dtype =
	 * the replies' elements (enum kccl_dtype: I32, I64 or BYTES).  The same
	 * id again asks again: a worker answers it with the same reply. */
	KCCL_T_SG_REQUEST = 12,
	/* Worker -> coordinator: one fragment of its reply to request msg_seq.
	 * src_rank = the worker, mask_base/dst_mask = the coordinator's bit,
	 * frag_off = the fragment's byte offset in the reply (a multiple of the
	 * group's chunk size), payload_len = min(chunk, msg_len - frag_off),
	 * msg_len = the reply's bytes, LAST_FRAG on the fragment that ends it
	 * (an empty reply is one empty fragment); agg_op, dtype as requested. */
	KCCL_T_SG_REPLY = 13,
};

/* enum kccl_abort_reason: the first payload byte of KCCL_T_AGG_ABORT. */
enum kccl_abort_reason {
	KCCL_ABORT_NON_FINITE	= 1,	/* NaN or infinity in a member's float input */
	KCCL_ABORT_OVERFLOW	= 2,	/* the result does not fit the element type */
	KCCL_ABORT_MISMATCH	= 3,	/* members passed different lengths, ops or types */
	KCCL_ABORT_UNSUPPORTED	= 4,	/* an op or element type the aggregator does not know */
};

#define KCCL_AGG_ABORT_MAX_TEXT 512

/* Largest KCCL_T_AGG_ACKS bitmap: 8192 chunks, fits a 1500-byte MTU. */
#define KCCL_AGG_ACKS_MAX_BYTES	1024

/*
 * Aggregation packets reuse the header's fields (AggBox's KEY, SEQ_NUM,
 * FRAG_OFFSET, LAST_FRAGMENT, AGGR_OP):
 *   src_rank            contributor (KEY); on RESULT/ACK the aggregator's rank
 *   mask_base/dst_mask  the operation's contributor set, identical in every
 *                       contributor's packets; on RESULT/ACK the destinations
 *   msg_seq             operation id (per job)
 *   frag_off            byte offset of this chunk in the operation's wire data;
 *                       always a multiple of the job's chunk size
 *   msg_len             the operation's wire bytes
 *   agg_op, dtype       enum kccl_agg_op, enum kccl_dtype (zero for broadcast)
 */
enum kccl_agg_op {
	KCCL_OP_SUM	= 1,
	KCCL_OP_COUNT	= 2,	/* per element: number of contributions != 0 */
	KCCL_OP_MAX	= 3,
	KCCL_OP_MIN	= 4,
	KCCL_OP_AVG	= 5,	/* summed on the wire; the runtime divides */
	KCCL_OP_CONCAT	= 6,	/* scatter-gather: replies side by side, uncombined */
};

enum kccl_dtype {
	KCCL_DT_BYTES	= 0,	/* scatter-gather CONCAT replies: opaque bytes */
	KCCL_DT_I32	= 1,	/* big-endian int32 elements */
	KCCL_DT_I64	= 2,	/* big-endian int64 elements */
	KCCL_DT_F32Q	= 3,	/* float32 quantized to int32 by the sender: the
				 * kernel treats it as I32, the runtime scales */
};

/* kccl_hdr.flags (bit values, host order; on the wire big-endian) */
enum kccl_hdr_flag {
	/* The sender asks the TC egress program to fan this packet out to
	 * every rank in dst_mask.  Packets of the user-space path never carry
	 * it, so both paths can share an interface. */
	KCCL_F_FANOUT	 = 1 << 0,
	/* This fragment ends the message. */
	KCCL_F_LAST_FRAG = 1 << 1,
	/* Contribution: deliver the chunk's result to every contributor
	 * (allreduce) instead of to the aggregator's ring buffer (reduce). */
	KCCL_F_ALLREDUCE = 1 << 2,
	/* Result: at least one element did not fit the wire type and was
	 * saturated; the runtime redoes the chunk exactly in user space. */
	KCCL_F_OVERFLOW	 = 1 << 3,
	/* Contribution the kernel must not aggregate: it passes to the
	 * aggregator's user-space path (unsupported op/type, overflow redo). */
	KCCL_F_USER_ONLY = 1 << 4,
	/* Reduce contribution: the root's runtime acknowledges the chunk with
	 * KCCL_T_AGG_ACKS once it has read the chunk's record, many chunks per
	 * datagram; xdp_agg sends no ACK of its own when the chunk completes
	 * (it still answers a retransmission of a finished chunk). */
	KCCL_F_ACK_LATER = 1 << 5,
	/* Set by xdp_agg on an allreduce contribution that disagrees with its
	 * chunk's slot (length, type, op, contributors) before it passes it
	 * up: the aggregator's runtime aborts the call for every member
	 * (KCCL_T_AGG_ABORT, reason MISMATCH) instead of aggregating it. */
	KCCL_F_MISMATCH	 = 1 << 6,
};

/* One destination mask word covers 64 ranks: [mask_base, mask_base + 64). */
#define KCCL_MASK_BITS	64

struct kccl_hdr {
	__u32 magic;		/*  0: KCCL_MAGIC */
	__u8  version;		/*  4: KCCL_VERSION */
	__u8  type;		/*  5: enum kccl_msg_type */
	__u16 flags;		/*  6: enum kccl_hdr_flag */
	__u32 job_id;		/*  8: job (group) the packet belongs to */
	__u16 src_rank;		/* 12: sender rank */
	__u16 mask_base;	/* 14: rank of bit 0 of dst_mask (multiple of 64) */
	__u64 dst_mask;		/* 16: bit i set => rank mask_base+i is a destination */
	__u32 msg_seq;		/* 24: message number, per (job, sender) */
	__u32 frag_off;		/* 28: byte offset of this fragment in the message */
	__u32 msg_len;		/* 32: total message length in bytes */
	__u16 payload_len;	/* 36: bytes of message data after this header */
	__u8  agg_op;		/* 38: enum kccl_agg_op (aggregation), else 0 */
	__u8  dtype;		/* 39: enum kccl_dtype (aggregation), else 0 */
} __attribute__((packed));

#define KCCL_HDR_LEN	40

/*
 * KCCL_T_BCAST_ACK: what one broadcast receiver holds of one message
 * (AggBox section 3.3, group acknowledgments), sent from the receiver's own
 * address and port to the source address and port the data came from (the
 * sender's socket; tc_bcast copies keep the sender's source IP and port).
 * Packets of a message are numbered by index = frag_off / pkt_bytes, where
 * pkt_bytes is the payload_len of every fragment but the last.
 *
 * Header fields of an ACK:
 *   src_rank            the acknowledging receiver
 *   mask_base/dst_mask  the broadcast sender's rank (one bit); never FANOUT:
 *                       an ACK is unicast and tc_bcast passes it untouched
 *   msg_seq, msg_len    the acknowledged message (sender's msg_seq)
 *   frag_off            0
 *   payload_len         KCCL_ACK_LEN + ceil(bm_bits / 8)
 * followed by struct kccl_bcast_ack and the bitmap (big-endian fields).
 *
 * A receiver sends one when its cumulative count crosses a multiple of its
 * group size (default 1024 packets) or the message completes (COMPLETE),
 * for every packet in per-packet mode (bitmap of that one packet), and when
 * a gap persists (GAP): then the bitmap of each group with missing packets
 * says exactly which of its packets are held; the sender re-sends the
 * others, to the receivers missing them only.  A receiver answers data of a
 * message it already completed with COMPLETE again (it never delivers twice).
 */
struct kccl_bcast_ack {
	__u32 pkt_bytes;	/*  0: payload bytes per packet as the receiver
				 *     derived it; 0 = unknown (it holds no
				 *     fragment but the last, or n == 1) */
	__u32 npkts;		/*  4: packets of the message; 0 = unknown */
	__u32 cum;		/*  8: every packet with index < cum is held */
	__u32 bm_first;		/* 12: packet index of bitmap bit 0 */
	__u16 bm_bits;		/* 16: bits in the bitmap, 0..KCCL_ACK_MAX_BITS */
	__u16 ack_flags;	/* 18: enum kccl_ack_flag */
	/* 20: bitmap, ceil(bm_bits / 8) bytes: bit i (byte i / 8, bit i % 8,
	 *     least significant first) set <=> packet bm_first + i is held */
} __attribute__((packed));

#define KCCL_ACK_LEN		20
#define KCCL_ACK_MAX_BITS	8192	/* 1 KiB bitmap: fits a 1500-byte MTU */

enum kccl_ack_flag {
	KCCL_ACK_COMPLETE = 1 << 0,	/* the whole message is held */
	KCCL_ACK_GAP	  = 1 << 1,	/* gap report: packets of the bitmap's
					 * range whose bit is clear are missing
					 * (no bitmap: everything >= cum is) */
};

/* Largest payload that keeps IPv4 + UDP + kccl_hdr inside a 1500-byte MTU. */
#define KCCL_MAX_PAYLOAD_1500	(1500 - 20 - 8 - KCCL_HDR_LEN)

#endif /* KCCL_WIRE_H */
