//! The aggregator backend of a member (user space always; the kernel's XDP/TC
//! programs when built with `kernel-agg` and loaded), and the checks of a
//! configuration against the group.

use std::net::SocketAddrV4;
use std::time::Duration;

use crate::chunk;
use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::netns;
use crate::transport::sock::{Datagram, DatagramOut};

use super::config::{AggConfig, OwnShardStats};
#[cfg(feature = "kernel-agg")]
use super::kernel_backend;
use super::user::{AggSink, UserAggConfig, UserAggregator};
use crate::transport::{Path, PathChoice};

/// Aggregator backends behind one interface: user space always, the kernel
/// when built with `kernel-agg` and loaded.
// One backend per member, built once and never moved on a hot path.
#[allow(clippy::large_enum_variant)]
pub(super) enum AggBackend {
    User(UserAggregator),
    #[cfg(feature = "kernel-agg")]
    Kernel(kernel_backend::KernelBackend),
}

impl AggBackend {
    pub(super) fn user(&self) -> &UserAggregator {
        match self {
            AggBackend::User(u) => u,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => &k.user,
        }
    }

    pub(super) fn user_mut(&mut self) -> &mut UserAggregator {
        match self {
            AggBackend::User(u) => u,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => &mut k.user,
        }
    }

    /// What the kernel left to user space after a receive batch: the
    /// answers its fan-out missed (queued for the caller's flush), the
    /// calls of allreduce mismatches it passed up (aborted), and the slots
    /// of calls whose abort the user-space side took
    /// (UserAggregator::take_abort; it freed its own), freed at once
    /// instead of after the slot timeout.
    pub(super) fn sync_kernel(&mut self) -> Result<()> {
        #[cfg(feature = "kernel-agg")]
        if let AggBackend::Kernel(k) = self {
            k.serve_misses()?;
            k.abort_kernel_mismatches();
        }
        let calls = self.user_mut().take_aborted_calls();
        #[cfg(feature = "kernel-agg")]
        if let AggBackend::Kernel(k) = self {
            for c in calls {
                k.engine().free_call(c)?;
            }
        }
        #[cfg(not(feature = "kernel-agg"))]
        drop(calls);
        Ok(())
    }

    /// Keeps `d`, this member's own abort of the call of `op_id` (a reduce
    /// root's), to answer that call's late contributions with it.
    pub(super) fn keep_abort(&mut self, op_id: u32, d: Vec<u8>) {
        self.user_mut().remember_abort(op_id & !3, d);
    }

    /// Frees the ACTIVE slots of the call of op id `op_id` (any op of it),
    /// in user space and in the kernel: the call was aborted.
    pub(super) fn free_call(&mut self, op_id: u32) -> Result<()> {
        self.user_mut().free_call(op_id);
        match self {
            AggBackend::User(_) => Ok(()),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.engine().free_call(op_id).map(|_| ()),
        }
    }

    pub(super) fn path(&self) -> Path {
        match self {
            AggBackend::User(_) => Path::User,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(_) => Path::Kernel,
        }
    }

    #[cfg(feature = "kernel-agg")]
    pub(super) fn kernel_stats(&self) -> Result<Option<crate::kernel_agg::AggStats>> {
        match self {
            AggBackend::User(_) => Ok(None),
            AggBackend::Kernel(k) => k.engine().stats().map(Some),
        }
    }

    /// What `rank` proved it received from this aggregator (receipts; on
    /// the kernel path also its contributions): None or (op id, bound).
    pub(super) fn ack_of(&self, rank: u16) -> Result<Option<(u32, u32)>> {
        match self {
            AggBackend::User(u) => Ok(u.receipt_of(rank)),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.engine().ack_of(rank),
        }
    }

    /// The kernel slot's missing contributors of a chunk being aggregated.
    pub(super) fn kernel_missing(&self, op_id: u32, frag_off: u32) -> Option<(u16, u64)> {
        match self {
            AggBackend::User(_) => {
                let _ = (op_id, frag_off);
                None
            }
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.missing(op_id, frag_off),
        }
    }

    /// Completed reduce chunks of the kernel (ring buffer records), at most
    /// `max` (the others stay in the ring).
    /// Makes the kernel path's record wait also end when the member's
    /// socket is readable (a sharded allreduce's owner waits for both).
    pub(super) fn watch_socket(&self, fd: std::os::fd::RawFd) -> Result<()> {
        match self {
            AggBackend::User(_) => {
                let _ = fd;
                Ok(())
            }
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.engine().watch_fd(fd),
        }
    }

    /// Op `op_id`'s own shard starts (`on`) or ends: while it runs, the
    /// ring's records of it are this member's results.
    pub(super) fn own_shard(&mut self, op_id: u32, on: bool) {
        match self {
            AggBackend::User(_) => {
                let _ = (op_id, on);
            }
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) if on => k.own.begin(op_id),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.own.end(op_id),
        }
    }

    /// Whether this member can contribute to its own shard: always on the
    /// user path (loopback), on the kernel path if its kernel runs
    /// BPF_PROG_TEST_RUN safely next to the attached program.
    pub(super) fn own_shard_supported(&self) -> std::result::Result<(), String> {
        match self {
            AggBackend::User(_) => Ok(()),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(_) => crate::kernel_agg::AggEngine::own_runs_supported(),
        }
    }

    /// Whether an own shard is running (its records and the socket are
    /// waited for together).
    pub(super) fn own_shard_active(&self) -> bool {
        match self {
            AggBackend::User(_) => false,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.own.active(),
        }
    }

    pub(super) fn own_shard_stats(&self) -> OwnShardStats {
        match self {
            AggBackend::User(_) => OwnShardStats::default(),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.own.stats,
        }
    }

    /// Whether the own-shard inbox holds datagrams.
    pub(super) fn own_inbox_waiting(&self) -> bool {
        match self {
            AggBackend::User(_) => false,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.own.has_inbox(),
        }
    }

    /// What this member's own XDP program passed up and its own records,
    /// as datagrams from this member's address.
    pub(super) fn take_own_inbox(&mut self) -> Option<(Vec<Vec<u8>>, SocketAddrV4)> {
        match self {
            AggBackend::User(_) => None,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => Some((k.own.take_inbox(), k.own.addr())),
        }
    }

    pub(super) fn poll(&mut self, timeout: Duration, max: usize, sink: &mut dyn AggSink) -> Result<usize> {
        match self {
            AggBackend::User(_) => {
                let _ = (timeout, max, sink);
                Ok(0)
            }
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.poll(timeout, max, sink),
        }
    }
}

/// This member's own XDP program as the destination of its contributions
/// to its own shard (sharded allreduce, kernel path).
pub(super) struct OwnXdp<'a>(pub &'a mut AggBackend);

impl DatagramOut for OwnXdp<'_> {
    fn send_all(&mut self, dgrams: &[Datagram<'_>]) -> Result<usize> {
        match &mut *self.0 {
            AggBackend::User(_) => Err(Error::Usage(format!(
                "{} contribution(s) to this member's own shard went to its XDP program on the user-space path \
                 (a kccl bug: they belong on the loopback socket)",
                dgrams.len()
            ))),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.send_own(dgrams),
        }
    }
}

/// Picks the backend for `choice`; returns it with the reason.
pub(super) fn make_backend(
    group: &Group,
    me: &Member,
    cfg: &AggConfig,
    chunk: usize,
    choice: PathChoice,
) -> Result<(AggBackend, String)> {
    let ucfg = UserAggConfig {
        job_id: group.job_id,
        my_rank: me.rank,
        chunk_bytes: chunk,
        nslots: cfg.nslots,
        slot_timeout: cfg.slot_timeout,
        linger: cfg.deadline,
    };
    let user = UserAggregator::new(group, ucfg);
    match choice {
        PathChoice::User => Ok((AggBackend::User(user), "user-space path requested (--path user)".into())),
        PathChoice::Kernel => kernel_backend(group, me, cfg, chunk, user),
        PathChoice::Auto => {
            let fallback = UserAggregator::new(group, user.config().clone());
            match kernel_backend(group, me, cfg, chunk, user) {
                Ok(k) => Ok(k),
                Err(e) => Ok((AggBackend::User(fallback), format!("kernel path off: {e}; using the user-space path"))),
            }
        }
    }
}

#[cfg(feature = "kernel-agg")]
pub(super) fn kernel_backend(
    group: &Group,
    me: &Member,
    cfg: &AggConfig,
    chunk: usize,
    user: UserAggregator,
) -> Result<(AggBackend, String)> {
    let k = kernel_backend::KernelBackend::load(group, me, cfg, chunk, user)?;
    let why = format!("kernel path: xdp_agg and tc_agg_result attached to {}", me.iface);
    Ok((AggBackend::Kernel(k), why))
}

#[cfg(not(feature = "kernel-agg"))]
pub(super) fn kernel_backend(
    _group: &Group,
    _me: &Member,
    _cfg: &AggConfig,
    _chunk: usize,
    _user: UserAggregator,
) -> Result<(AggBackend, String)> {
    Err(Error::KernelPathUnavailable {
        reason: "this build has no kernel aggregation (the cargo feature `kernel-agg` is off); \
                 rebuild with --features kernel-agg or use the user-space path (--path user)"
            .into(),
    })
}

/// Checks the configuration against the group; returns the chunk size.
pub(super) fn resolve_config(group: &Group, me: &Member, cfg: &AggConfig) -> Result<usize> {
    let chunk = group.chunk_bytes;
    let nslots = cfg.nslots.next_power_of_two();
    if cfg.window == 0 || cfg.window >= nslots {
        return Err(Error::Usage(format!(
            "AggConfig.window {} must be at least 1 and below nslots {nslots} (two chunks of one operation \
             must never need the same aggregation slot)",
            cfg.window
        )));
    }
    if cfg.rto.is_zero() || cfg.deadline < cfg.rto {
        return Err(Error::Usage(format!(
            "AggConfig: rto {:?} must be positive and not longer than the deadline {:?}",
            cfg.rto, cfg.deadline
        )));
    }
    if let Some(mtu) = netns::mtu(&me.iface) {
        let need = chunk::mtu_needed(chunk) as usize;
        if need > mtu {
            return Err(Error::Usage(format!(
                "the group's chunks of {chunk} bytes (its `mtu` {}) need an MTU of at least {need} but {} has \
                 {mtu}: set `mtu = {mtu}` in the group file or raise the interface's MTU",
                group.mtu, me.iface
            )));
        }
    }
    Ok(chunk as usize)
}
