//! The allreduce aggregator service (a rank that does not contribute) and a
//! member's serving of contributions after its last call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::sock::{BatchSocket, RecvBatch};
use crate::wire::HDR_LEN;

use super::backend::{make_backend, resolve_config, AggBackend};
use super::config::AggConfig;
use super::dispatch::pump;
use super::root::RootSink;
use super::user::{AggStats, AllreduceOnly, MismatchEvent};
use super::Collective;
use crate::bcast::{Path, PathChoice};

/// The allreduce aggregator service: combines the contributions of every
/// member (all ranks but this one) and answers each with the result.
pub struct Aggregator {
    me: Member,
    sock: BatchSocket,
    rb: RecvBatch,
    backend: AggBackend,
    reason: String,
}

impl Aggregator {
    /// The service of rank `rank`, which must be the group's `aggregator`.
    pub fn new(group: &Group, rank: u16, choice: PathChoice, cfg: AggConfig) -> Result<Aggregator> {
        let me = group.member(rank.into())?.clone();
        match group.aggregator {
            Some(a) if a == rank => {}
            Some(a) => {
                return Err(Error::Usage(format!(
                    "rank {rank} is not the group's aggregator (the group file says aggregator = {a})"
                )))
            }
            None => {
                return Err(Error::Usage(format!(
                    "the group file names no aggregator: add `aggregator = {rank}` so that members send to this rank"
                )))
            }
        }
        let chunk = resolve_config(group, &me, &cfg)?;
        let sock = BatchSocket::bind(me.addr, me.port, 256 << 20, 64 << 20)?;
        if cfg.gso {
            sock.enable_gso();
        }
        let rb = RecvBatch::new(crate::sock::MAX_BATCH, HDR_LEN + chunk);
        let (backend, reason) = make_backend(group, &me, &cfg, chunk, choice)?;
        Ok(Aggregator { me, sock, rb, backend, reason })
    }

    pub fn rank(&self) -> u16 {
        self.me.rank
    }

    pub fn path(&self) -> Path {
        self.backend.path()
    }

    pub fn path_reason(&self) -> &str {
        &self.reason
    }

    /// Counters of the user-space aggregator (on the kernel path: of the
    /// packets the kernel passed up).
    pub fn stats(&self) -> AggStats {
        self.backend.user().stats()
    }

    /// Mismatching contributions refused since the last call.
    pub fn take_mismatches(&mut self) -> Vec<MismatchEvent> {
        self.backend.user_mut().take_mismatches()
    }

    /// Counters of xdp_agg/tc_agg_result (None on the user path).
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_stats(&self) -> Result<Option<crate::kernel_agg::AggStats>> {
        self.backend.kernel_stats()
    }

    /// Serves until `stop` is set (checked at least every 100 ms).
    pub fn serve(&mut self, stop: &AtomicBool) -> Result<()> {
        while !stop.load(Ordering::Relaxed) {
            self.serve_once(Duration::from_millis(100))?;
        }
        Ok(())
    }

    /// The kernel engine (None on the user path): its members map, slots
    /// and counters, for tools and tests that inspect or steer it.
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_engine_mut(&mut self) -> Option<&mut crate::kernel_agg::AggEngine> {
        match &mut self.backend {
            AggBackend::User(_) => None,
            AggBackend::Kernel(k) => Some(k.engine_mut()),
        }
    }

    /// Kernel slots (index, state) held by operation `op_id` (None on the
    /// user path): what an abandoned operation left behind.
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_slots_of_op(&self, op_id: u32) -> Result<Option<Vec<(u32, crate::kernel_agg::SlotState)>>> {
        match &self.backend {
            AggBackend::User(_) => Ok(None),
            AggBackend::Kernel(k) => k.engine().slots_of_op(op_id).map(Some),
        }
    }

    /// One receive batch (or `wait` without traffic); returns the datagrams.
    pub fn serve_once(&mut self, wait: Duration) -> Result<usize> {
        let mut sink = AllreduceOnly;
        if self.backend.path() == Path::Kernel {
            self.backend.poll(Duration::ZERO, usize::MAX, &mut sink)?;
        }
        let Aggregator { sock, rb, backend, .. } = self;
        let n = backend.user_mut().serve_batch(sock, rb, Some(wait), &mut sink)?;
        backend.sync_kernel()?;
        // Aborts it decided on (mismatches the kernel passed up) go now.
        backend.user_mut().flush(sock)?;
        Ok(n)
    }
}

impl Collective {
    /// Serves the aggregator role for `d` without running an operation:
    /// answers retransmissions of finished chunks and takes early
    /// contributions.  A reduce root can linger with it after its last call
    /// so that a contributor whose ACK was lost still finishes.
    pub fn serve_for(&mut self, d: Duration) -> Result<()> {
        let end = Instant::now() + d;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            let mut sink = RootSink::new(&mut self.stash, self.calls.wrapping_sub(1), self.cfg.nslots, None);
            let wait = left.min(Duration::from_millis(50));
            let r = pump(&self.sock, &mut self.rb, &mut self.backend, &mut self.stats, wait, false, None, &mut sink);
            sink.count_into(&mut self.stats);
            r?;
        }
    }
}
