//! The kernel aggregation backend (cargo feature `kernel-agg`): xdp_agg and
//! tc_agg_result, loaded by `crate::kernel_agg::AggEngine`, aggregate T_AGG
//! packets to this member's port in the kernel and fan the ACK/RESULT
//! packets out; reduce chunks arrive as ring buffer records.  Packets the
//! kernel passes up (USER_ONLY redo, op/type it does not do) reach the
//! socket and are served by the user-space aggregator kept here, so both
//! backends answer every packet of the protocol.
//!
//! Written against the AggEngine interface agreed for the merge:
//! AggEngineConfig::new(job_id, port, my_rank) with pub fields chunk_bytes,
//! nslots, slot_timeout (ring_bytes, wakeup_bytes left at their defaults);
//! AggEngine::load(&cfg, ifindex), sync_members(&Group), stats(),
//! poll_records(timeout, &mut dyn FnMut(AggRecordView)) -> Result<usize> (here its
//! bounded form poll_records_max).

use std::time::{Duration, Instant};

use std::net::SocketAddrV4;

use crate::agg::user::{describe_chunk, AggSink, UserAggregator};
use crate::agg::AggConfig;
use crate::error::Result;
use crate::group::{Group, Member};
use crate::kernel::MissReason;
use crate::kernel_agg::{AggEngine, AggEngineConfig, SlotState};
use crate::netns;
use crate::transport::sock::Datagram;

use super::own_shard::OwnShard;

pub(crate) struct KernelBackend {
    /// Boxed: the engine (skeletons, ring buffer readers) would make this
    /// variant of AggBackend much larger than the user-space one.
    engine: Box<AggEngine>,
    job_id: u32,
    /// Serves what the kernel passes up.
    pub user: UserAggregator,
    sweep_every: Duration,
    last_sweep: Instant,
    /// This member's contributions to its own shard (sharded allreduce).
    pub own: OwnShard,
}

impl KernelBackend {
    pub fn load(group: &Group, me: &Member, cfg: &AggConfig, chunk: usize, user: UserAggregator) -> Result<Self> {
        let ifindex = netns::ifindex(&me.iface, me.netns.as_deref())?;
        let mut c = AggEngineConfig::new(group.job_id, me.port, me.rank);
        c.chunk_bytes = chunk as u32;
        c.nslots = cfg.nslots.next_power_of_two() as u32;
        c.slot_timeout = cfg.slot_timeout;
        c.window = cfg.window as u32;
        let mut engine = AggEngine::load(&c, ifindex)?;
        engine.sync_members(group)?;
        let sweep_every = cfg.slot_timeout / 4;
        Ok(KernelBackend {
            engine: Box::new(engine),
            job_id: group.job_id,
            user,
            sweep_every,
            last_sweep: Instant::now(),
            own: OwnShard::new(me.rank, SocketAddrV4::new(me.addr, me.port)),
        })
    }

    /// Runs the kernel's sweep (frees ACTIVE slots older than slot_timeout:
    /// operations whose member died) every slot_timeout / 4.
    pub fn maybe_sweep(&mut self) -> Result<()> {
        if self.last_sweep.elapsed() < self.sweep_every {
            return Ok(());
        }
        self.last_sweep = Instant::now();
        self.engine.sweep().map(|_| ())
    }

    /// The contributors chunk `frag_off` of `op_id` still waits for, if its
    /// slot is aggregating it: (mask_base, missing mask).
    pub fn missing(&self, op_id: u32, frag_off: u32) -> Option<(u16, u64)> {
        let s = self.engine.slot(self.engine.slot_index(op_id, frag_off)).ok()?;
        (s.state == SlotState::Active
            && s.rec.job_id == self.job_id
            && s.rec.op_id == op_id
            && s.rec.frag_off == frag_off)
            .then_some((s.rec.mask_base, s.expected & !s.seen))
    }

    /// Aborts the calls of the allreduce contributions xdp_agg passed up as
    /// mismatching their chunk's slot (KCCL_F_MISMATCH): the abort names
    /// the sender and both layouts (the slot's read from the kernel) and
    /// goes to the slot's contributors and the sender
    /// (UserAggregator::abort_mismatch).
    pub fn abort_kernel_mismatches(&mut self) {
        for h in self.user.take_kernel_mismatches() {
            let sent = describe_chunk(true, h.msg_len, h.agg_op, h.dtype, h.dst_mask, h.mask_base);
            let slot = self.engine.slot(self.engine.slot_index(h.msg_seq, h.frag_off)).ok().filter(|s| {
                s.state != SlotState::Free
                    && s.rec.job_id == self.job_id
                    && (s.rec.op_id, s.rec.frag_off) == (h.msg_seq, h.frag_off)
            });
            let (base, expected, detail) = match slot {
                Some(s) => {
                    let was =
                        describe_chunk(true, s.rec.msg_len, s.rec.agg_op, s.rec.dtype, s.expected, s.rec.mask_base);
                    (s.rec.mask_base, s.expected, format!("sent {sent}, the chunk is {was}"))
                }
                // Gone since (freed or taken over): the sender's own view.
                None => (h.mask_base, h.dst_mask, format!("sent {sent}, which the kernel's chunk did not match")),
            };
            self.user.abort_mismatch(&h, base, expected, &detail);
        }
    }

    /// Sends from user space, at once, the answers tc_agg_result could not
    /// fan out (struct kccl_agg_miss: a failed clone, a member without a
    /// next hop), and gives a member that had no next hop the one the
    /// neighbour table has now, so the kernel serves its next answers.
    /// Queued on the user-space side: the caller's flush sends them.
    pub fn serve_misses(&mut self) -> Result<()> {
        for m in self.engine.drain_misses() {
            let ev = m.event;
            if ev.job_id != self.job_id {
                continue;
            }
            if ev.reason == MissReason::Unresolved {
                if let Some(addr) = self.user.member_addr(ev.rank) {
                    self.engine.refresh_member(ev.rank, *addr.ip(), addr.port())?;
                }
            }
            self.user.relay_kernel_answer(ev.rank, &m.answer);
        }
        Ok(())
    }

    /// This member's own contributions to its shard, through its xdp_agg
    /// (see own_shard.rs); what they pass up goes to the user-space
    /// aggregator's queue (relayed copies) and the own-shard inbox.
    pub fn send_own(&mut self, dgrams: &[Datagram<'_>]) -> Result<usize> {
        self.own.send(&self.engine, &mut self.user, dgrams)
    }

    pub fn engine(&self) -> &AggEngine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut AggEngine {
        &mut self.engine
    }

    /// Hands ring buffer records (completed reduce chunks) to the sink, at
    /// most `max` of them: the rest stay in the ring, in order (see
    /// `AggEngine::poll_records_max`).  Records of this member's own shard
    /// of a sharded allreduce go to its inbox instead.
    pub fn poll(&mut self, timeout: Duration, max: usize, sink: &mut dyn AggSink) -> Result<usize> {
        self.maybe_sweep()?;
        let job = self.job_id;
        let user = &mut self.user;
        let own = &mut self.own;
        self.engine.poll_records_max(timeout, max, &mut |r| {
            if r.job_id != job || own.take_record(&r) {
                return;
            }
            // Taken: its contributors learn it with this round's other
            // chunks (they asked for that with F_ACK_LATER; any that did
            // not already got xdp_agg's ACK and count this one a duplicate).
            user.ack_later(&r);
            sink.deliver(&r);
        })
    }
}
