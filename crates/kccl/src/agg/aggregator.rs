//! The allreduce aggregator service: a rank that does not contribute,
//! combines every member's contributions and answers each with the result.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::error::Result;
use crate::group::{Group, Member};
use crate::transport::sock::{BatchSocket, RecvBatch};
use crate::transport::{Path, PathChoice};

use super::backend::AggBackend;
use super::config::AggConfig;
use super::endpoint::{Endpoint, Role};
use super::user::{AggStats, AllreduceOnly, MismatchEvent};

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
        let Endpoint { me, sock, rb, backend, reason, .. } =
            Endpoint::open(group, rank, choice, &cfg, Role::Aggregator)?;
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
