// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * xdp_sg: the kernel half of a scatter-gather coordinator (sgbpf), XDP on
 * the coordinator's interface.  Specification: docs/SCATTER_GATHER.md,
 * "Kernel path"; layouts: kccl_wire.h (packets), kccl_sg.h (slots, control
 * commands, done records, counters).
 *
 * What it does: every reply (KCCL_T_SG_REPLY of cfg_job_id to UDP port
 * cfg_port) whose request the runtime opened a slot for is checked against
 * the slot (worker asked, not counted yet, same op and element type) and
 * combined, under the slot's bpf_spin_lock, into the slot's int64
 * accumulators (SUM, COUNT, MAX, MIN over big-endian int32 or int64
 * elements; replies of different lengths combine over the longest, as
 * crates/kccl/src/sg/combine.rs does in user space).  The reply is consumed
 * (XDP_DROP): no skb is built for it.  The reply that meets the request's
 * policy (answered == need) marks the slot DONE and puts a kccl_sg_done
 * record on the sg_done ring buffer; the runtime reads the elements from
 * sg_acc in place (mmap) and frees the slot with a CLOSE.  Duplicates, late
 * replies (DONE/CLOSED slot), workers not asked, source addresses that are
 * not the worker's, and malformed replies are dropped and counted; a reply
 * the kernel cannot combine (several fragments, over KCCL_SG_MAX_ELEMS
 * elements, another op or type) is dropped and its worker marked refused,
 * which the runtime reports.  A reply whose request holds no slot here
 * (CONCAT and multi-packet requests stay on the user path, or the id is
 * unknown or stale) passes to the runtime's socket, which owns those.
 *
 * kccl_sg_ctl (BPF_PROG_TEST_RUN only, never attached) opens and closes
 * slots for the runtime: the packet is a struct kccl_sg_ctl, the answer is
 * written back into it.
 *
 * What it assumes:
 *  - IPv4/UDP over Ethernet (any IHL, no IP fragments); the kccl header in
 *    the linear part of the frame.  The program is xdp.frags (veths of a
 *    9000-byte MTU refuse other programs): a reply of up to
 *    KCCL_SG_MAX_PAYLOAD bytes may arrive as a multi-buffer frame, its
 *    payload is read with bpf_xdp_load_bytes, and no frame is ever
 *    written or resized (never shrink a multi-buffer frame on veth:
 *    ../shared/kernel-bugs/xdp-shrink-frags).
 *  - Configuration (const volatile, set before load): cfg_job_id, cfg_port
 *    (host order), cfg_nslots (== max_entries of sg_slots and sg_acc, a
 *    power of two).  members[rank] is filled by the runtime; a reply is
 *    accepted only from its src_rank's address.
 *  - The runtime never has two requests in flight whose ids share a slot
 *    (ids are consecutive and fewer than nslots are in flight), and closes
 *    every request it opened.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kccl_wire.h"
#include "lib/kccl_xdp.h"
#include "kccl_bcast.h"
#include "kccl_sg.h"
#define KCCL_MEMBERS_MAX	KCCL_SG_MAX_RANKS
#include "lib/kccl_members.h"


const volatile __u32 cfg_job_id = 0;
const volatile __u16 cfg_port = 0;		/* host order; 0: nothing combined */
const volatile __u32 cfg_nslots = 4096;	/* == max_entries of sg_slots and sg_acc */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 4096);		/* set by the loader (cfg_nslots) */
	__type(key, __u32);
	__type(value, struct kccl_sg_slot);
} sg_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 4096);		/* set by the loader (cfg_nslots) */
	__type(key, __u32);
	__type(value, struct kccl_sg_acc);
} sg_acc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, KCCL_SGS_NR);
	__type(key, __u32);
	__type(value, __u64);
} sg_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);		/* set by the loader */
} sg_done SEC(".maps");

/* A reply's elements, converted to int64 before the lock (no helper may
 * run under it, and the loop under it then only loads and combines). */
struct sg_scratch {
	__s64 v[KCCL_SG_MAX_ELEMS];
	__u8 raw[KCCL_SG_MAX_PAYLOAD];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sg_scratch);
} sg_scratch SEC(".maps");

/* Anchors: make the control packet and the done record part of the
 * skeleton, so that the runtime's types come from this one definition. */
struct kccl_sg_ctl *kccl_sg_ctl_layout;
struct kccl_sg_done *kccl_sg_done_layout;

static __always_inline void stat_add(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&sg_stats, &idx);

	if (v)
		*v += 1;
}

/* What the locked section decided. */
enum sg_act {
	ACT_PASS = 0,		/* slot not this request's: to the runtime */
	ACT_DROP,		/* dropped; `why` is the counter */
	ACT_COMBINED,		/* combined, policy not met yet */
	ACT_DONE,		/* combined and the policy is met: record */
};

/* Elements [0, n) of the slot: combine x into the first `old` elements
 * (those an earlier reply had), store the rest (first value of each).
 * Returns the first element whose int64 sum overflowed, or ~0. */
static __always_inline __u32 combine(__s64 *acc, const __s64 *x, __u32 n, __u32 old, __u32 op)
{
	__u32 ovf = ~0U;
	int i;

	bpf_for(i, 0, n) {
		__s64 a, b, s;

		if (i >= KCCL_SG_MAX_ELEMS)
			break;
		b = x[i];
		if ((__u32)i >= old) {
			acc[i] = op == KCCL_OP_COUNT ? (b != 0) : b;
			continue;
		}
		a = acc[i];
		switch (op) {
		case KCCL_OP_SUM:
			s = (__s64)((__u64)a + (__u64)b);
			/* Signed overflow: both operands' sign differs from the sum's. */
			if (((a ^ s) & (b ^ s)) < 0 && ovf == ~0U)
				ovf = i;
			acc[i] = s;
			break;
		case KCCL_OP_COUNT:
			acc[i] = a + (b != 0);
			break;
		case KCCL_OP_MAX:
			acc[i] = b > a ? b : a;
			break;
		default: /* KCCL_OP_MIN */
			acc[i] = b < a ? b : a;
			break;
		}
	}
	return ovf;
}

static __always_inline bool mask_test(const __u64 *m, __u32 r)
{
	return m[(r / 64) & (KCCL_SG_MASK_WORDS - 1)] & (1ULL << (r % 64));
}

static __always_inline void mask_set(__u64 *m, __u32 r)
{
	m[(r / 64) & (KCCL_SG_MASK_WORDS - 1)] |= 1ULL << (r % 64);
}

SEC("xdp.frags")
int kccl_xdp_sg(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct iphdr *ip;
	struct udphdr *udp;
	struct kccl_hdr *h;
	struct kccl_member *m;
	struct kccl_sg_slot *s;
	struct kccl_sg_acc *acc;
	struct kccl_sg_done *rec;
	struct sg_scratch *sc;
	__u32 udp_len, pay_len, msg_len, len, src, id, idx, esize, n, old, ovf, i, zero = 0;
	int k;
	__u32 act, why = KCCL_SGS_PASSED, answered = 0, nelem = 0, overflow_at = 0;
	__u16 flags = 0;
	__u8 op, dt;

	if (!cfg_port)
		return XDP_PASS;
	udp = kccl_xdp_udp(data, end, bpf_htons(cfg_port), &ip);
	if (!udp)
		goto pass;
	h = (void *)(udp + 1);
	if ((void *)(h + 1) > end || h->magic != bpf_htonl(KCCL_MAGIC) || h->version != KCCL_VERSION ||
	    h->type != KCCL_T_SG_REPLY)
		goto pass;
	if (bpf_ntohl(h->job_id) != cfg_job_id) {
		stat_add(KCCL_SGS_OTHER_JOB);
		return XDP_PASS;
	}

	/* A reply of our job: the kernel decides about it from here on. */
	udp_len = bpf_ntohs(udp->len);
	pay_len = bpf_ntohs(h->payload_len);
	msg_len = bpf_ntohl(h->msg_len);
	if (udp_len != sizeof(*udp) + KCCL_HDR_LEN + pay_len ||
	    (__u64)((void *)udp - data) + udp_len > (__u64)bpf_xdp_get_buff_len(ctx) || pay_len > msg_len)
		goto malformed;
	src = bpf_ntohs(h->src_rank);
	m = bpf_map_lookup_elem(&members, &src);
	if (!m || !(m->flags & KCCL_M_PRESENT) || m->ip_be != ip->saddr || m->port_be != udp->source) {
		stat_add(KCCL_SGS_NOT_MEMBER);
		return XDP_DROP;
	}
	id = bpf_ntohl(h->msg_seq);
	op = h->agg_op;
	dt = h->dtype;
	idx = id & (cfg_nslots - 1);
	s = bpf_map_lookup_elem(&sg_slots, &idx);
	acc = bpf_map_lookup_elem(&sg_acc, &idx);
	sc = bpf_map_lookup_elem(&sg_scratch, &zero);
	if (!s || !acc || !sc)
		goto pass;

	/* What the kernel can combine: one whole fragment of int32/int64
	 * elements, at most KCCL_SG_MAX_ELEMS of them. */
	esize = dt == KCCL_DT_I64 ? 8 : 4;
	n = 0;
	why = KCCL_SGS_PASSED;
	if (h->frag_off || pay_len != msg_len || !(h->flags & bpf_htons(KCCL_F_LAST_FRAG)) ||
	    pay_len > KCCL_SG_MAX_PAYLOAD || pay_len / esize > KCCL_SG_MAX_ELEMS)
		why = KCCL_SGS_TOO_LONG;
	else if ((dt != KCCL_DT_I32 && dt != KCCL_DT_I64) ||
		 (op != KCCL_OP_SUM && op != KCCL_OP_COUNT && op != KCCL_OP_MAX && op != KCCL_OP_MIN))
		why = KCCL_SGS_MISMATCH;
	else if (pay_len % esize)
		why = KCCL_SGS_MALFORMED;
	if (why == KCCL_SGS_PASSED && pay_len) {
		/* Copied and converted before the lock: no helper may run
		 * under it.  pay_len is in [1, KCCL_SG_MAX_PAYLOAD] here; the
		 * mask-and-add form keeps that range on the very register the
		 * verifier checks (a plain compare lands on another copy). */
		len = ((pay_len - 1) & (KCCL_SG_MAX_PAYLOAD - 1)) + 1;
		if (bpf_xdp_load_bytes(ctx, (void *)(h + 1) - data, sc->raw, len))
			goto malformed;
		n = pay_len / esize;
		if (dt == KCCL_DT_I32) {
			bpf_for(k, 0, n) {
				if (k >= KCCL_SG_MAX_ELEMS)
					break;
				sc->v[k] = (__s32)bpf_ntohl(*(__u32 *)&sc->raw[k * 4]);
			}
		} else {
			bpf_for(k, 0, n) {
				if (k >= KCCL_SG_MAX_ELEMS)
					break;
				sc->v[k] = (__s64)bpf_be64_to_cpu(*(__u64 *)&sc->raw[k * 8]);
			}
		}
	}

	bpf_spin_lock(&s->lock);
	if (s->req_id != id || s->state == KCCL_SG_FREE) {
		act = ACT_PASS;
	} else if (s->state != KCCL_SG_OPEN) {
		act = ACT_DROP;
		why = KCCL_SGS_LATE;
	} else if (src >= KCCL_SG_MAX_RANKS || !mask_test(s->asked, src)) {
		act = ACT_DROP;
		why = KCCL_SGS_NOT_ASKED;
	} else if (mask_test(s->seen, src)) {
		act = ACT_DROP;
		why = KCCL_SGS_DUP;
	} else if (why != KCCL_SGS_PASSED || op != s->op || dt != s->dtype) {
		/* The worker is refused (sticky; a later good reply of it
		 * is still combined); its repeats are counted again. */
		act = ACT_DROP;
		if (why == KCCL_SGS_PASSED)
			why = KCCL_SGS_MISMATCH;
		if (why != KCCL_SGS_MALFORMED)
			mask_set(s->refused, src);
	} else {
		old = s->nelem;
		ovf = combine(acc->v, sc->v, n, old, op);
		if (n > old)
			s->nelem = n;
		if (ovf != ~0U && !(s->flags & KCCL_SGF_OVERFLOW)) {
			s->flags |= KCCL_SGF_OVERFLOW;
			s->overflow_at = ovf;
		}
		mask_set(s->seen, src);
		s->answered++;
		act = ACT_COMBINED;
		if (s->answered >= s->need) {
			s->state = KCCL_SG_DONE;
			act = ACT_DONE;
			answered = s->answered;
			nelem = s->nelem;
			flags = s->flags;
			overflow_at = s->overflow_at;
		}
	}
	bpf_spin_unlock(&s->lock);

	switch (act) {
	case ACT_PASS:
		stat_add(KCCL_SGS_UNCLAIMED);
		return XDP_PASS;
	case ACT_DROP:
		stat_add(why);
		return XDP_DROP;
	case ACT_COMBINED:
		stat_add(KCCL_SGS_COMBINED);
		return XDP_DROP;
	}
	stat_add(KCCL_SGS_COMBINED);
	stat_add(KCCL_SGS_COMPLETED);
	/* DONE is final until the runtime's CLOSE: nobody writes the slot's
	 * masks or accumulators now, so they are read without the lock. */
	rec = bpf_ringbuf_reserve(&sg_done, sizeof(*rec), 0);
	if (!rec) {
		stat_add(KCCL_SGS_RING_FULL);
		return XDP_DROP;
	}
	rec->req_id = id;
	rec->slot = idx;
	rec->answered = answered;
	rec->nelem = nelem;
	rec->flags = flags;
	rec->op = op;
	rec->dtype = dt;
	rec->overflow_at = overflow_at;
	for (i = 0; i < KCCL_SG_MASK_WORDS; i++)
		rec->seen[i] = s->seen[i];
	bpf_ringbuf_submit(rec, 0);
	return XDP_DROP;

malformed:
	stat_add(KCCL_SGS_MALFORMED);
	return XDP_DROP;
pass:
	stat_add(KCCL_SGS_PASSED);
	return XDP_PASS;
}

/* Opens or closes one slot for the runtime (see struct kccl_sg_ctl). */
SEC("xdp")
int kccl_sg_ctl(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct kccl_sg_ctl *c = data;
	struct kccl_sg_slot *s;
	__u32 idx, asked = 0, taken = 0, i;
	__u64 now = bpf_ktime_get_ns();

	if ((void *)(c + 1) > end)
		return XDP_DROP;
	idx = c->req_id & (cfg_nslots - 1);
	s = bpf_map_lookup_elem(&sg_slots, &idx);
	if (!s) {
		c->result = KCCL_SG_CTL_BAD;
		return XDP_DROP;
	}
	if (c->cmd == KCCL_SG_CMD_OPEN) {
		for (i = 0; i < KCCL_SG_MASK_WORDS; i++)
			asked += __builtin_popcountll(c->asked[i]);
		if (!c->need || c->need > asked || (c->dtype != KCCL_DT_I32 && c->dtype != KCCL_DT_I64) ||
		    (c->op != KCCL_OP_SUM && c->op != KCCL_OP_COUNT && c->op != KCCL_OP_MAX && c->op != KCCL_OP_MIN)) {
			c->result = KCCL_SG_CTL_BAD;
			return XDP_DROP;
		}
		bpf_spin_lock(&s->lock);
		taken = s->state == KCCL_SG_OPEN;
		s->state = KCCL_SG_OPEN;
		s->req_id = c->req_id;
		s->need = c->need;
		s->answered = 0;
		s->nelem = 0;
		s->op = c->op;
		s->dtype = c->dtype;
		s->flags = 0;
		s->overflow_at = 0;
		s->opened_ns = now;
		for (i = 0; i < KCCL_SG_MASK_WORDS; i++) {
			s->asked[i] = c->asked[i];
			s->seen[i] = 0;
			s->refused[i] = 0;
		}
		bpf_spin_unlock(&s->lock);
		stat_add(KCCL_SGS_OPENED);
		if (taken)
			stat_add(KCCL_SGS_TAKEN_OVER);
		c->result = KCCL_SG_CTL_OK;
		return XDP_DROP;
	}
	if (c->cmd != KCCL_SG_CMD_CLOSE) {
		c->result = KCCL_SG_CTL_BAD;
		return XDP_DROP;
	}
	bpf_spin_lock(&s->lock);
	if (s->req_id != c->req_id || s->state == KCCL_SG_FREE) {
		bpf_spin_unlock(&s->lock);
		c->result = KCCL_SG_CTL_NOT_OURS;
		return XDP_DROP;
	}
	c->state = s->state;
	c->answered = s->answered;
	c->nelem = s->nelem;
	c->flags = s->flags;
	c->overflow_at = s->overflow_at;
	c->op = s->op;
	c->dtype = s->dtype;
	for (i = 0; i < KCCL_SG_MASK_WORDS; i++) {
		c->asked[i] = s->asked[i];
		c->seen[i] = s->seen[i];
		c->refused[i] = s->refused[i];
	}
	s->state = KCCL_SG_CLOSED;
	bpf_spin_unlock(&s->lock);
	stat_add(KCCL_SGS_CLOSED);
	c->result = KCCL_SG_CTL_OK;
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
