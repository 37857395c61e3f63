// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * xdp_agg: the kernel aggregation engine of kccl (reduce, allreduce), XDP on
 * the aggregator's interface.  Specification: docs/AGGREGATION.md, "Kernel
 * data plane"; layouts: kccl_wire.h (packets), kccl_agg.h (slots, records,
 * counters).
 *
 * What it does: every contribution (KCCL_T_AGG of cfg_job_id to UDP port
 * cfg_port) is validated, claimed in its slot under the slot's
 * bpf_spin_lock (the sender is marked busy), added sub-block by sub-block
 * (KCCL_AGG_SUB_BYTES, each under its own lock, struct kccl_agg_sub) to the
 * int64 accumulators, and then counted in the slot's `seen` bitmap, which
 * makes retransmissions harmless.  The packet that completes a chunk (seen == expected) is turned
 * into the answer in place and passed up (XDP_PASS) to tc_agg_result, which
 * fans it out to the contributors:
 *  - reduce: the slot's record (header + int64 values) goes to the agg_records
 *    ring buffer for the root's runtime, and the packet becomes a payload-less
 *    KCCL_T_AGG_ACK, or, when the contribution carries KCCL_F_ACK_LATER
 *    (kccl's own senders do), is dropped: the root's runtime acknowledges
 *    the chunks it read, many per KCCL_T_AGG_ACKS datagram;
 *  - allreduce (KCCL_F_ALLREDUCE): the result is written into the packet's
 *    payload in the contributed width (I32/F32Q saturated to int32 with
 *    KCCL_F_OVERFLOW) and it becomes KCCL_T_AGG_RESULT.  A sharded
 *    allreduce's owner contributes to the chunks of its shard
 *    through BPF_PROG_TEST_RUN of this program (same maps, src_rank ==
 *    cfg_my_rank; the run's output frame is its answer); when another
 *    member's contribution completes such a chunk, the owner's copy goes
 *    to agg_records (adaptive wake-up) and tc_agg_result leaves the owner
 *    out of the fan-out.
 * Every other contribution is consumed (XDP_DROP) after it was added.  A
 * retransmission of a finished chunk gets the answer again, addressed to its
 * sender only.  Every outcome is counted in agg_stats (enum kccl_agg_stat).
 *
 * What it assumes:
 *  - IPv4/UDP over Ethernet (any IHL, no IP fragments).  The program is
 *    xdp.frags: a chunk of up to KCCL_AGG_MAX_PAYLOAD (65208) bytes arrives
 *    as one multi-buffer frame (the veth's MTU may then exceed a page); the
 *    headers must be in the linear part, the payload is read and written
 *    with bpf_xdp_load_bytes/store_bytes across fragments.  Such a frame is
 *    never shrunk (bpf_xdp_adjust_tail releasing fragments corrupts memory
 *    on veth): its ACK/PENDING keeps the contribution's bytes as a trailer
 *    behind the datagram, which tc_agg_result cuts from the skb.
 *  - Configuration (const volatile, set before load): cfg_job_id, cfg_port
 *    (host order), cfg_my_rank (src_rank of answers), cfg_chunk_bytes (the
 *    job's chunk size C, <= KCCL_AGG_MAX_PAYLOAD, every contributor uses it),
 *    cfg_nslots (== max_entries of agg_slots, a power of two; agg_acc has
 *    cfg_nslots * ceil(C / KCCL_AGG_SUB_BYTES) entries), cfg_slot_timeout_ns
 *    (an ACTIVE/UNDELIVERED chunk older than this may lose its slot),
 *    cfg_wakeup_bytes (ring buffer wake-up batching).
 *  - members[rank] is filled by the runtime (address, port, and the MAC if
 *    the neighbour table had one); a contribution or receipt whose source
 *    address is not its src_rank's is dropped (NOT_MEMBER), one that passes
 *    sets the rank's next-hop MAC to the frame's source MAC (learn_next_hop:
 *    answers go only to contributors, so every destination was learned).
 *  - Contributors keep a window of chunks smaller than nslots (docs), so a
 *    chunk that finds its slot held by another live chunk is dropped (BUSY)
 *    and retransmitted by its sender.
 *  - Packets the kernel does not aggregate pass untouched: not kccl or not
 *    our port (PASSED), another job (OTHER_JOB), KCCL_F_USER_ONLY (USER_ONLY),
 *    an unknown op/type (UNSUPPORTED), and RESULT/ACK/BCAST types (PASSED):
 *    the user-space aggregator's socket gets them; so does a contribution
 *    of a call aborted recently (agg_aborted, ABORTED_CALL), which the
 *    runtime answers with the abort.
 *  - A contributor does not mix reduce and allreduce contributions for one
 *    chunk: the slot does not record the ALLREDUCE flag (the layout of
 *    kccl_agg.h has no field for it), the completing packet's flag decides.
 *
 * Slot rules (all under the slot's lock; the key is job, op id, frag_off):
 *  - same key: op, type, payload_len, msg_len, mask_base and contributor mask
 *    must equal the slot's (else MISMATCH: a reduce contribution is dropped,
 *    an allreduce one passed up with KCCL_F_MISMATCH for the runtime to
 *    abort the call); ACTIVE: counted already
 *    (PENDING answer), being added on another CPU (busy: DUP, dropped) or
 *    added (busy until finish() counts it in seen); DELIVERING (another CPU emits the result right now):
 *    DUP; DONE: answer again (DUP_DONE); UNDELIVERED (the ring buffer was
 *    full when it completed): the ring output is retried and on success the
 *    ACK goes to every contributor (none got one yet).
 *  - other key: FREE or DONE slots are claimed; ACTIVE/UNDELIVERED ones are
 *    taken over after cfg_slot_timeout_ns since their claim (RECLAIMED), else
 *    BUSY (dropped); DELIVERING is BUSY.
 *  - A claim starts a new generation (slot gen).  Per sub-block, the first
 *    contribution of the generation STORES its values (COUNT: v != 0), so a
 *    claim needs no identity initialisation pass; later ones combine: SUM
 *    and AVG add, COUNT adds (v != 0), MAX/MIN; I64 SUM/AVG detect signed
 *    overflow (rec.overflow, sticky).  I32 and F32Q are the same to the
 *    kernel.  A sub-block of a newer generation than the contribution's
 *    means the slot was taken over meanwhile: the pass stops and finish()
 *    drops the contribution (its sender retransmits).
 *
 * Loops: the sub-blocks of a chunk go through bpf_loop (sub_pass, called by
 * the global function sub_passes, so the verifier checks it once for both
 * of its call sites); within a sub-block, open-coded bounded loops.  The
 * combine runs under the sub-block's bpf_spin_lock, where no helper may be
 * called (so no bpf_loop inside it).  The
 * loops are specialised per element width (4 bytes: I32/F32Q, up to
 * KCCL_AGG_SUB_ELEMS = 858; 8 bytes: I64, up to 429) and per op and mode
 * (store, store (v != 0), add, count, max, min), so the common SUM combine is
 * a plain load, byte swap, add; the int32-saturated / int64 results are
 * written back by a separate pass that only allreduce answers run (also the
 * read-only answer of a finished chunk).  An iteration handles a block of 104
 * payload bytes (26 int32, loaded two at a time, or 13 int64) and is one step
 * of an open-coded iterator (bpf_for; its kfuncs are allowed under the lock).
 * The verifier checks an iterator body until its state repeats instead of
 * walking every iteration as it does for a bounded for loop, so its work no
 * longer grows with the sub-block size: 122k processed instructions (printed
 * by the fixtures: AggEngine::verified_insns); the same loops as bounded for
 * loops of 24-byte blocks went over the 1M limit once they ran in the
 * bpf_loop callback, which the verifier walks more than once.  What still
 * keeps the iterator states few:
 *  - each sub-block is copied (bpf_xdp_load_bytes, before the lock) into a
 *    per-CPU scratch buffer and written back with bpf_xdp_store_bytes: a
 *    per-element packet bounds check would grow the packet range with every
 *    iteration, so no two loop exits would be equivalent states;
 *  - the loop bodies have no jumps but the block bound checks and one
 *    per-block range check in the int32 write-back (MAX/MIN and saturation
 *    use 0/~0 masks; OPAQUE keeps clang from turning them into jumps), and
 *    the saturation/overflow masks accumulate in scratch memory, not in a
 *    register the verifier would track;
 *  - the op, width, block and element counts and the locked section's
 *    decision live in the scratch map and are loaded (volatile) from there:
 *    the verifier knows nothing about map contents, so the paths reach each
 *    loop in equivalent states and it is walked a couple of times (measured)
 *    instead of once per combination of op, mode and decision constants;
 *  - the block count a loop compares against is such a fresh load, not a
 *    count used after the loop, so the bound checks do not make every exit
 *    iteration a distinct state for the code after the loop.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"
#include "lib/kccl_xdp.h"
#include "kccl_bcast.h"
#include "kccl_agg.h"
#include "lib/kccl_members.h"
#include "agg/stats.h"
#include "agg/state.h"	/* configuration, maps, struct contrib */
#include "agg/combine.h"	/* struct agg_scratch, the element loops */
#include "agg/answer.h"	/* ACK/RESULT frames, ring-buffer delivery */
#include "agg/acks.h"	/* proofs of received answers */

/* Whether the call of op id `op_id` is one of the recently aborted ones. */
static __always_inline bool call_aborted(const struct kccl_agg_aborted *ab, __u32 op_id)
{
	__u64 v = KCCL_AGG_ABORTED_VALID | (op_id & ~3U);
	int i;

	for (i = 0; i < KCCL_AGG_ABORTED_MAX; i++)
		if (ab->calls[i] == v)
			return true;
	return false;
}

/*
 * members[rank]'s next hop learned from a packet of that rank (its source
 * address already checked): the frame's source MAC is where the rank's
 * answers go (the member itself on this segment, or the router in front of
 * it).  So the fan-out works however cold the neighbour table was when the
 * runtime filled members[], and follows a member that moved.  Written only
 * when it differs, the MAC before the RESOLVED bit; a fan-out reading the
 * entry during a change may address one copy to a torn MAC, which the
 * contributor's retransmission repairs.
 */
static __always_inline void learn_next_hop(struct kccl_member *m, const struct ethhdr *eth)
{
	bool same = true;
	int i;

#pragma unroll
	for (i = 0; i < ETH_ALEN; i++)
		same &= m->mac[i] == eth->h_source[i];
	if (same && (m->flags & KCCL_M_RESOLVED))
		return;
	__builtin_memcpy(m->mac, eth->h_source, ETH_ALEN);
	/* The MAC before the bit, and a plain store of the bit: the only
	 * concurrent writers (xdp_agg on other CPUs) set the same bit. */
	asm volatile("" ::: "memory");
	*(volatile __u32 *)&m->flags = m->flags | KCCL_M_RESOLVED;
	stat_add(KCCL_AS_NEXT_HOP_LEARNED, 1);
}

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct agg_scratch);
} agg_scratch SEC(".maps");

/* What the locked section decided (agg_scratch.act). */
#define ACT_DROP	0	/* dropped; agg_scratch.why is the counter */
#define ACT_ADDED	1	/* added, chunk not complete: consumed */
#define ACT_DONE_RED	2	/* completed a reduce chunk: deliver + ACK */
#define ACT_DONE_ALL	3	/* completed an allreduce chunk: RESULT */
#define ACT_ANSWER	4	/* DONE chunk: answer this sender again */
#define ACT_RETRY	5	/* UNDELIVERED chunk: retry the ring output */
#define ACT_PENDING	6	/* counted retransmission: tell the sender who is missing */


/*
 * Under the slot's lock: the slot state machine (see the header comment).
 * Writes the decision into sc (act, why, mode, write, reclaimed, ovf, gen)
 * and, on a claim, initialises the slot (a new generation: its sub-blocks
 * reset themselves on first use).  ACT_ADDED marks the sender busy: its
 * sub-blocks are added after the unlock (sub_passes), then finish() counts
 * it.  No helper calls.
 */
static __always_inline void decide(struct kccl_agg_slot *s, struct agg_scratch *sc,
				   const struct contrib *c)
{
	__u32 act = ACT_DROP, why = KCCL_AS_NR, mode = ELEM_NONE, write = 0, reclaimed = 0;

	if (s->state != KCCL_SLOT_FREE && s->rec.job_id == cfg_job_id &&
	    s->rec.op_id == c->op_id && s->rec.frag_off == c->frag) {
		if (s->rec.agg_op != c->op || s->rec.dtype != c->dt ||
		    s->rec.payload_len != c->pay_len || s->rec.msg_len != c->msg_len ||
		    s->rec.mask_base != c->mask_base || s->expected != c->mask) {
			why = KCCL_AS_MISMATCH;
		} else if (s->state == KCCL_SLOT_ACTIVE) {
			if (s->seen & c->bit) {
				act = ACT_PENDING;
				*(volatile __u64 *)&sc->missing = s->expected & ~s->seen;
			} else if (s->busy & c->bit) {
				/* A copy of it is being added on another CPU. */
				why = KCCL_AS_DUP;
			} else
				mode = ELEM_COMBINE;
		} else if (s->state == KCCL_SLOT_DONE) {
			act = ACT_ANSWER;
			write = c->allreduce;	/* the values go into this packet again */
		} else if (s->state == KCCL_SLOT_UNDELIVERED) {
			s->state = KCCL_SLOT_DELIVERING;
			act = ACT_RETRY;
		} else {
			/* DELIVERING: the completer is emitting the answer now. */
			why = KCCL_AS_DUP;
		}
	} else if (s->state == KCCL_SLOT_DELIVERING ||
		   ((s->state == KCCL_SLOT_ACTIVE || s->state == KCCL_SLOT_UNDELIVERED) &&
		    c->now - s->claimed_ns <= cfg_slot_timeout_ns)) {
		why = KCCL_AS_BUSY;
	} else if (s->state == KCCL_SLOT_DONE && c->now - s->claimed_ns <= cfg_slot_timeout_ns &&
		   !(c->proven && c->proven_op == s->rec.op_id && c->proven_frag == s->rec.frag_off)) {
		/* Kept until every contributor proved it has the answer (or
		 * for cfg_slot_timeout_ns after completion: liveness when a
		 * contributor went silent). */
		why = KCCL_AS_HELD;
	} else {
		reclaimed = s->state == KCCL_SLOT_ACTIVE || s->state == KCCL_SLOT_UNDELIVERED;
		s->state = KCCL_SLOT_ACTIVE;
		s->expected = c->mask;
		s->seen = 0;
		s->busy = 0;
		s->claimed_ns = c->now;
		s->gen = c->now > s->gen ? c->now : s->gen + 1;
		s->rec.job_id = cfg_job_id;
		s->rec.op_id = c->op_id;
		s->rec.frag_off = c->frag;
		s->rec.msg_len = c->msg_len;
		s->rec.payload_len = c->pay_len;
		s->rec.mask_base = c->mask_base;
		s->rec.agg_op = c->op;
		s->rec.dtype = c->dt;
		s->rec.overflow = 0;
		s->rec.pad = 0;
		s->rec.contributors = 0;
		mode = ELEM_STORE;
	}
	if (mode != ELEM_NONE) {
		/* Added outside this lock, sub-block by sub-block; seen and
		 * completion afterwards (finish). */
		act = ACT_ADDED;
		s->busy |= c->bit;
	}
	*(volatile __u64 *)&sc->gen = s->gen;
	PUT(sc, act, act);
	PUT(sc, why, why);
	PUT(sc, mode, mode);
	PUT(sc, write, write);
	PUT(sc, reclaimed, reclaimed);
	PUT(sc, ovf, s->rec.overflow);
}

/* What one sub-block pass needs (bpf_loop context). */
struct sub_pass_ctx {
	struct xdp_md *ctx;
	struct agg_scratch *sc;
	__u32 base;		/* agg_acc entry of sub-block 0 */
	__u32 pay_off;		/* payload offset in the frame */
	__u32 pay_len;
	__u32 write;		/* 0: add the payload; 1: write the results into it */
	__u32 stop;		/* set when a pass found its sub-block taken over */
};

/*
 * Sub-block i: add it (load from the frame, then under the sub-block's lock
 * store if it is the generation's first contribution there, else combine),
 * or write its results into the frame (under the lock: read only).  A
 * sub-block of a newer generation means the slot was taken over: stop.
 */
static long sub_pass(__u32 i, void *p)
{
	struct sub_pass_ctx *k = p;
	struct agg_scratch *sc = k->sc;
	struct kccl_agg_sub *u;
	__u32 idx = k->base + i, off, stale = 0, write = k->write;
	__u64 len, gen;

	if (i >= KCCL_AGG_MAX_SUBS)
		return 1;
	off = i * KCCL_AGG_SUB_BYTES;
	if (off >= k->pay_len)
		return 1;
	len = k->pay_len - off;
	if (len > KCCL_AGG_SUB_BYTES)
		len = KCCL_AGG_SUB_BYTES;
	OPAQUE(len);
	if (len == 0 || len > KCCL_AGG_SUB_BYTES)
		goto stop;
	u = bpf_map_lookup_elem(&agg_acc, &idx);
	if (!u)
		goto stop;
	if (!write) {
		if (bpf_xdp_load_bytes(k->ctx, k->pay_off + off, sc->buf, len))
			goto stop;
		/* Zeros from the sub-block's end to its last block's (BLK_BYTES). */
#pragma unroll
		for (int j = 0; j < BLK_BYTES / 8; j++)
			*(__u64 *)(sc->buf + len + 8 * j) = 0;
	}
	PUT(sc, nblk, (len + BLK_BYTES - 1) / BLK_BYTES);
	PUT(sc, write, write);
	gen = *(volatile __u64 *)&sc->gen;

	bpf_spin_lock(&u->lock);
	if (u->gen != gen) {
		if (u->gen > gen || write) {
			stale = 1;
		} else {
			u->gen = gen;
			u->count = 0;
		}
	}
	if (!stale) {
		PUT(sc, mode, write ? ELEM_NONE : u->count ? ELEM_COMBINE : ELEM_STORE);
		if (!write)
			u->count++;
		elems(u, sc);
	}
	bpf_spin_unlock(&u->lock);

	if (stale)
		goto stop;
	if (write && bpf_xdp_store_bytes(k->ctx, k->pay_off + off, sc->buf, len))
		goto stop;
	return 0;
stop:
	k->stop = 1;
	return 1;
}

/*
 * Every sub-block of the payload through sub_pass (write: 0 add, 1 write the
 * results).  A global function: the verifier checks it (and the loops in it)
 * once, not once per call site.  Returns nonzero if a pass stopped.
 */
__noinline int sub_passes(struct xdp_md *ctx, __u32 base, __u32 pay_off, __u32 pay_len, __u32 write)
{
	__u32 zero = 0;
	struct sub_pass_ctx k = {
		.ctx = ctx, .base = base, .pay_off = pay_off, .pay_len = pay_len, .write = write,
	};

	k.sc = bpf_map_lookup_elem(&agg_scratch, &zero);
	if (!k.sc || pay_len == 0 || pay_len > KCCL_AGG_MAX_PAYLOAD)
		return 1;
	bpf_loop((pay_len + KCCL_AGG_SUB_BYTES - 1) / KCCL_AGG_SUB_BYTES, sub_pass, &k, 0);
	return k.stop;
}

/*
 * Under the slot's lock, after the sub-block passes of an ACT_ADDED
 * contribution: it counts (seen) if the slot still holds the generation it
 * was added to; the chunk completes when every contributor is seen.
 * Writes act (ACT_ADDED, ACT_DONE_RED, ACT_DONE_ALL or ACT_DROP with why),
 * write and ovf into sc.
 */
static __always_inline void finish(struct kccl_agg_slot *s, struct agg_scratch *sc,
				   const struct contrib *c, long stopped)
{
	__u32 act = ACT_ADDED;

	if (s->gen != *(volatile __u64 *)&sc->gen || s->state != KCCL_SLOT_ACTIVE) {
		/* Taken over while it was being added: the sender resends. */
		PUT(sc, why, KCCL_AS_BUSY);
		act = ACT_DROP;
	} else {
		s->busy &= ~c->bit;
		if (stopped) {
			/* Part of it was added (cannot happen once the frame
			 * passed the length checks): the sums are unusable, the
			 * chunk starts over from its senders' retransmissions. */
			s->state = KCCL_SLOT_FREE;
			PUT(sc, why, KCCL_AS_BUSY);
			act = ACT_DROP;
		} else {
			s->seen |= c->bit;
			if (GET(sc, res) & ELEM_OVF)
				s->rec.overflow = 1;
			if (s->seen == s->expected) {
				act = c->allreduce ? ACT_DONE_ALL : ACT_DONE_RED;
				s->rec.contributors = s->seen;
				s->state = c->allreduce ? KCCL_SLOT_DONE : KCCL_SLOT_DELIVERING;
				s->claimed_ns = c->now;	/* DONE: kept from now on */
			}
		}
	}
	PUT(sc, act, act);
	PUT(sc, write, act == ACT_DONE_ALL);
	PUT(sc, ovf, s->rec.overflow);
}

SEC("xdp.frags")
int kccl_xdp_agg(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip;
	struct udphdr *udp;
	struct kccl_hdr *h;
	struct kccl_member *m;
	struct kccl_agg_slot *s;
	struct kccl_agg_aborted *ab;
	struct agg_scratch *sc;
	struct contrib c;
	__u32 ihl_len, udp_len, tot_len, esize, chunk, idx, base, src, act, r, zero = 0, pay_off;
	long stopped;
	__u16 flags;
	bool ovf, own;

	if (!cfg_chunk_bytes)
		return XDP_PASS;
	udp = kccl_xdp_udp(data, end, bpf_htons(cfg_port), &ip);
	if (!udp)
		goto pass;
	ihl_len = ip->ihl * 4;
	h = (void *)(udp + 1);
	if ((void *)&h->version > end || h->magic != bpf_htonl(KCCL_MAGIC))
		goto pass;

	/* From here on the packet claims to be kccl on our port. */
	if ((void *)(h + 1) > end)
		goto malformed;
	udp_len = bpf_ntohs(udp->len);
	tot_len = bpf_ntohs(ip->tot_len);
	if (udp_len < KCCL_ANSWER_FIXED_LEN || tot_len < ihl_len + udp_len ||
	    sizeof(*eth) + tot_len > (__u64)bpf_xdp_get_buff_len(ctx) || h->version != KCCL_VERSION)
		goto malformed;
	if (bpf_ntohl(h->job_id) != cfg_job_id) {
		stat_add(KCCL_AS_OTHER_JOB, 1);
		return XDP_PASS;
	}
	if (h->type == KCCL_T_AGG_RECEIPT) {
		src = bpf_ntohs(h->src_rank);
		m = bpf_map_lookup_elem(&members, &src);
		if (!m || !(m->flags & KCCL_M_PRESENT) || m->ip_be != ip->saddr) {
			stat_add(KCCL_AS_NOT_MEMBER, 1);
			return XDP_DROP;
		}
		learn_next_hop(m, eth);
		if (h->payload_len)
			goto malformed;
		c.frag = bpf_ntohl(h->frag_off);
		ack_raise(src, bpf_ntohl(h->msg_seq),
			  (__u32)(((__u64)c.frag + cfg_chunk_bytes - 1) / cfg_chunk_bytes));
		stat_add(KCCL_AS_RECEIPTS, 1);
		/* Also to user space: the runtime learns from receipts which
		 * operations finished (its KCCL_T_AGG_SYNC answers). */
		return XDP_PASS;
	}
	if (h->type != KCCL_T_AGG) {
		if (h->type == KCCL_T_BCAST || h->type == KCCL_T_AGG_RESULT || h->type == KCCL_T_AGG_ACK ||
		    h->type == KCCL_T_AGG_PENDING || h->type == KCCL_T_BCAST_ACK ||
		    h->type == KCCL_T_AGG_SYNC || h->type == KCCL_T_AGG_SYNC_ACK || h->type == KCCL_T_AGG_ACKS ||
		    h->type == KCCL_T_AGG_ABORT)
			goto pass;
		goto malformed;
	}
	flags = bpf_ntohs(h->flags);
	if (flags & KCCL_F_USER_ONLY) {
		stat_add(KCCL_AS_USER_ONLY, 1);
		return XDP_PASS;
	}
	c.op = h->agg_op;
	c.dt = h->dtype;
	if (c.op < KCCL_OP_SUM || c.op > KCCL_OP_AVG || c.dt < KCCL_DT_I32 || c.dt > KCCL_DT_F32Q) {
		stat_add(KCCL_AS_UNSUPPORTED, 1);
		return XDP_PASS;
	}
	esize = c.dt == KCCL_DT_I64 ? 8 : 4;
	c.pay_len = bpf_ntohs(h->payload_len);
	c.frag = bpf_ntohl(h->frag_off);
	c.msg_len = bpf_ntohl(h->msg_len);
	if (c.pay_len != udp_len - KCCL_ANSWER_FIXED_LEN || c.pay_len == 0 || c.pay_len % esize ||
	    c.pay_len > KCCL_AGG_MAX_PAYLOAD || c.pay_len > cfg_chunk_bytes ||
	    c.frag % cfg_chunk_bytes || (__u64)c.frag + c.pay_len > c.msg_len ||
	    ((__u64)c.frag + c.pay_len < c.msg_len && c.pay_len != cfg_chunk_bytes))
		goto malformed;
	c.mask_base = bpf_ntohs(h->mask_base);
	c.mask = bpf_be64_to_cpu(h->dst_mask);
	if (!c.mask || c.mask_base % KCCL_MASK_BITS || c.mask_base + KCCL_MASK_BITS > KCCL_MAX_MEMBERS)
		goto malformed;
	src = bpf_ntohs(h->src_rank);
	if (src < c.mask_base || src >= c.mask_base + KCCL_MASK_BITS ||
	    !((c.mask >> (src - c.mask_base)) & 1)) {
		stat_add(KCCL_AS_NOT_CONTRIB, 1);
		return XDP_DROP;
	}
	c.bit = 1ULL << (src - c.mask_base);
	m = bpf_map_lookup_elem(&members, &src);
	if (!m || !(m->flags & KCCL_M_PRESENT) || m->ip_be != ip->saddr) {
		stat_add(KCCL_AS_NOT_MEMBER, 1);
		return XDP_DROP;
	}
	learn_next_hop(m, eth);

	c.op_id = bpf_ntohl(h->msg_seq);
	ab = bpf_map_lookup_elem(&agg_aborted, &zero);
	if (ab && ab->next && call_aborted(ab, c.op_id)) {
		stat_add(KCCL_AS_ABORTED_CALL, 1);
		return XDP_PASS;
	}
	c.allreduce = flags & KCCL_F_ALLREDUCE;
	chunk = c.frag / cfg_chunk_bytes;
	if (ack_proves(src, c.op_id, chunk)) {
		stat_add(KCCL_AS_STALE, 1);
		return XDP_DROP;
	}
	ack_raise(src, c.op_id, chunk + 1 > cfg_window ? chunk + 1 - cfg_window : 0);
	idx = (c.op_id * 0x9E3779B1U + chunk) & (cfg_nslots - 1);
	base = idx * ((cfg_chunk_bytes + KCCL_AGG_SUB_BYTES - 1) / KCCL_AGG_SUB_BYTES);
	s = bpf_map_lookup_elem(&agg_slots, &idx);
	if (!s) {
		/* Only if the loader set max_entries below cfg_nslots. */
		stat_add(KCCL_AS_BUSY, 1);
		return XDP_DROP;
	}
	sc = bpf_map_lookup_elem(&agg_scratch, &zero);
	if (!sc)
		return XDP_DROP;
	pay_off = (void *)(h + 1) - data;
	PUT(sc, op, c.op);
	PUT(sc, esize, esize);
	/* No helper calls under the lock: read the clock before. */
	c.now = bpf_ktime_get_ns();
	check_proven(s, &c);

	bpf_spin_lock(&s->lock);
	decide(s, sc, &c);
	bpf_spin_unlock(&s->lock);
	act = GET(sc, act);

	if (act == ACT_DROP) {
		__u32 why = GET(sc, why);

		stat_add(why, 1);
		/* An allreduce chunk its members disagree on: passed up flagged
		 * (whole: a multi-buffer frame is never shrunk), so that the
		 * runtime aborts the call for every member at once. */
		if (why == KCCL_AS_MISMATCH && c.allreduce) {
			h->flags = bpf_htons(flags | KCCL_F_MISMATCH);
			/* No checksum rather than a stale one (as on the answers
			 * xdp_agg makes): IPv4 UDP allows it. */
			udp->check = 0;
			return XDP_PASS;
		}
		return XDP_DROP;
	}
	if (act == ACT_PENDING) {
		__u64 missing = bpf_cpu_to_be64(*(volatile __u64 *)&sc->missing);

		stat_add(KCCL_AS_DUP, 1);
		stat_add(KCCL_AS_PENDING, 1);
		return make_answer(ctx, KCCL_T_AGG_PENDING, flags, false, c.bit, sizeof(missing), &missing);
	}
	PUT(sc, res, 0);
	if (act == ACT_ADDED) {
		stopped = sub_passes(ctx, base, pay_off, c.pay_len, 0);
		bpf_spin_lock(&s->lock);
		finish(s, sc, &c, stopped);
		bpf_spin_unlock(&s->lock);
		act = GET(sc, act);
		if (act == ACT_DROP) {
			stat_add(GET(sc, why), 1);
			return XDP_DROP;
		}
		stat_add(KCCL_AS_PKTS, 1);
		if (GET(sc, reclaimed))
			stat_add(KCCL_AS_RECLAIMED, 1);
		if (act == ACT_ADDED)
			return XDP_DROP;
		stat_add(KCCL_AS_CHUNKS_DONE, 1);
	}
	/* Allreduce answers carry the values: written into the payload from
	 * the sub-blocks (DONE: nobody adds to them; a takeover since the
	 * lock makes the pass stop). */
	if (GET(sc, write) && sub_passes(ctx, base, pay_off, c.pay_len, 1)) {
		stat_add(KCCL_AS_BUSY, 1);
		return XDP_DROP;
	}
	ovf = GET(sc, ovf) || (GET(sc, res) & ELEM_SAT);
	if (act == ACT_ANSWER) {
		stat_add(KCCL_AS_DUP_DONE, 1);
		stat_add(c.allreduce ? KCCL_AS_RESULTS : KCCL_AS_ACKS, 1);
		return make_answer(ctx, c.allreduce ? KCCL_T_AGG_RESULT : KCCL_T_AGG_ACK, flags, ovf,
				   c.bit, c.allreduce ? c.pay_len : 0, NULL);
	}
	/* A sharded allreduce: this host owns the chunk and contributes to it
	 * too.  Its own contribution comes through BPF_PROG_TEST_RUN (src ==
	 * cfg_my_rank), whose output is the owner's answer; a chunk a remote
	 * contribution completes also goes to the ring as the owner's copy. */
	own = act == ACT_DONE_ALL && src != cfg_my_rank && cfg_my_rank >= c.mask_base &&
	      cfg_my_rank < c.mask_base + KCCL_MASK_BITS && ((c.mask >> (cfg_my_rank - c.mask_base)) & 1);
	if (act == ACT_DONE_ALL) {
		if (ovf)
			stat_add(KCCL_AS_OVERFLOW, 1);
		stat_add(KCCL_AS_RESULTS, 1);
		if (!own)
			return make_answer(ctx, KCCL_T_AGG_RESULT, flags, ovf, c.mask, c.pay_len, NULL);
	}
	if (act == ACT_DONE_RED && ovf)
		stat_add(KCCL_AS_OVERFLOW, 1);

	/* Reduce completion or retry, or an owner's copy: record to the ring,
	 * then the ACK (reduce) or the RESULT (allreduce, whatever the ring:
	 * the slot is DONE, so the owner's retransmission gets it again). */
	r = deliver(s, base, c.op_id, c.pay_len, c.msg_len, esize, own);
	if (own) {
		stat_add(r ? KCCL_AS_OWN_RING_FULL : KCCL_AS_OWN_RECORDS, 1);
		return make_answer(ctx, KCCL_T_AGG_RESULT, flags, ovf, c.mask, c.pay_len, NULL);
	}
	bpf_spin_lock(&s->lock);
	s->state = r ? KCCL_SLOT_UNDELIVERED : KCCL_SLOT_DONE;
	if (!r)
		s->claimed_ns = c.now;
	bpf_spin_unlock(&s->lock);
	if (r) {
		stat_add(KCCL_AS_RING_FULL, 1);
		return XDP_DROP;
	}
	stat_add(KCCL_AS_RECORDS, 1);
	if (flags & KCCL_F_ACK_LATER) {
		/* The root's runtime answers every contributor once it read
		 * the record, many chunks per datagram (KCCL_T_AGG_ACKS): no
		 * answer packet, no TC pass, no fan-out copies per chunk.  A
		 * retransmission of the chunk still gets an ACK above
		 * (ACT_ANSWER), so a slow root or a lost KCCL_T_AGG_ACKS costs
		 * a timeout, never the chunk. */
		stat_add(KCCL_AS_ACKS_LATER, 1);
		return XDP_DROP;
	}
	stat_add(KCCL_AS_ACKS, 1);
	return make_answer(ctx, KCCL_T_AGG_ACK, flags, ovf, c.mask, 0, NULL);

malformed:
	stat_add(KCCL_AS_MALFORMED, 1);
	return XDP_DROP;
pass:
	stat_add(KCCL_AS_PASSED, 1);
	return XDP_PASS;
}

/*
 * kccl_agg_sweep: frees ACTIVE slots claimed longer than cfg_slot_timeout_ns
 * ago (an operation whose member died leaves them behind; a live chunk that
 * loses its slot is only delayed: its contributors have no answer and
 * retransmit into a fresh slot, each counted once), and with a request
 * (struct kccl_agg_sweep_req at the start of the data, KCCL_SWEEP_CALL) the
 * ACTIVE slots of one aborted call at once, recording the call in
 * agg_aborted (xdp_agg passes its late contributions up).  Not attached:
 * the runtime runs it with BPF_PROG_TEST_RUN (AggEngine::sweep,
 * AggEngine::free_call), one pass over the slots, each under its lock.
 * Counted in KCCL_AS_SWEPT and KCCL_AS_ABORT_FREED.
 */
struct sweep_ctx {
	__u64 now;
	__u32 call_op;
	__u32 call;		/* KCCL_SWEEP_CALL given */
};

/* One slot: counted here (after the unlock: no helper calls under a lock),
 * not in the context, which stays read-only so that the verifier's pass
 * over the callback converges. */
static long sweep_one(__u32 i, void *ctx)
{
	struct sweep_ctx *x = ctx;
	struct kccl_agg_slot *s;
	__u32 idx = i, freed = 0;

	s = bpf_map_lookup_elem(&agg_slots, &idx);
	if (!s)
		return 1;
	bpf_spin_lock(&s->lock);
	if (s->state == KCCL_SLOT_ACTIVE) {
		if (x->call && s->rec.job_id == cfg_job_id && (s->rec.op_id & ~3U) == x->call_op) {
			s->state = KCCL_SLOT_FREE;
			freed = KCCL_AS_ABORT_FREED;
		} else if (x->now - s->claimed_ns > cfg_slot_timeout_ns) {
			s->state = KCCL_SLOT_FREE;
			freed = KCCL_AS_SWEPT;
		}
	}
	bpf_spin_unlock(&s->lock);
	if (freed)
		stat_add(freed, 1);
	return 0;
}

SEC("xdp")
int kccl_agg_sweep(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct kccl_agg_sweep_req *req = data;
	struct sweep_ctx x = { .now = bpf_ktime_get_ns() };
	struct kccl_agg_aborted *ab;
	__u32 zero = 0;

	if ((void *)(req + 1) <= end && (req->flags & KCCL_SWEEP_CALL)) {
		x.call = 1;
		x.call_op = req->call_op & ~3U;
		/* Recorded before its slots are freed: from here on its late
		 * contributions go to user space, none claims a fresh slot. */
		ab = bpf_map_lookup_elem(&agg_aborted, &zero);
		if (ab && !call_aborted(ab, x.call_op)) {
			ab->calls[ab->next & (KCCL_AGG_ABORTED_MAX - 1)] = KCCL_AGG_ABORTED_VALID | x.call_op;
			ab->next++;
		}
	}
	bpf_loop(cfg_nslots, sweep_one, &x, 0);
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
