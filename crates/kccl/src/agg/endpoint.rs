//! The one constructor of an aggregation's member processes: a
//! [`Collective`](super::Collective) (a contributing member) and the
//! [`Aggregator`](super::Aggregator) service (the group's non-contributing
//! allreduce aggregator) both start as an [`Endpoint`]: the member's entry
//! of the group, the resolved chunk size, the bound socket, a receive batch
//! and the backend (kernel or user path) with the reason it was chosen.

use std::os::fd::AsRawFd;

use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::transport::sock::{BatchSocket, RecvBatch, MAX_BATCH};
use crate::transport::PathChoice;
use crate::wire::HDR_LEN;

use super::backend::{make_backend, resolve_config, AggBackend};
use super::config::AggConfig;

/// Which member process an endpoint is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// A contributing member (every rank but the allreduce aggregator).
    Member,
    /// The group's allreduce aggregator service.
    Aggregator,
}

impl Role {
    /// The group file must agree with the role.
    fn check(self, group: &Group, rank: u16) -> Result<()> {
        match (self, group.aggregator) {
            (Role::Member, Some(a)) if a == rank => Err(Error::Usage(format!(
                "rank {rank} is the group's allreduce aggregator (aggregator = {rank}): run the Aggregator service \
                 (`kccl aggregator`) there, not a Collective"
            ))),
            (Role::Member, _) => Ok(()),
            (Role::Aggregator, Some(a)) if a == rank => Ok(()),
            (Role::Aggregator, Some(a)) => Err(Error::Usage(format!(
                "rank {rank} is not the group's aggregator (the group file says aggregator = {a})"
            ))),
            (Role::Aggregator, None) => Err(Error::Usage(format!(
                "the group file names no aggregator: add `aggregator = {rank}` so that members send to this rank"
            ))),
        }
    }

    /// (receive, send) socket buffer bytes.  The aggregator takes every
    /// member's contributions at once and answers them all: four times a
    /// member's.
    fn socket_buffers(self) -> (usize, usize) {
        match self {
            Role::Member => (64 << 20, 16 << 20),
            Role::Aggregator => (256 << 20, 64 << 20),
        }
    }
}

/// What every member process of an aggregation starts from.
pub(super) struct Endpoint {
    pub(super) me: Member,
    pub(super) chunk: usize,
    pub(super) sock: BatchSocket,
    pub(super) rb: RecvBatch,
    pub(super) backend: AggBackend,
    pub(super) reason: String,
}

impl Endpoint {
    /// Rank `rank`'s endpoint in the calling thread's network namespace
    /// (binds the group's address and port of the rank).
    pub(super) fn open(group: &Group, rank: u16, choice: PathChoice, cfg: &AggConfig, role: Role) -> Result<Endpoint> {
        let me = group.member(rank.into())?.clone();
        role.check(group, rank)?;
        let chunk = resolve_config(group, &me, cfg)?;
        let (rcvbuf, sndbuf) = role.socket_buffers();
        let sock = BatchSocket::bind(me.addr, me.port, rcvbuf, sndbuf)?;
        if cfg.gso {
            sock.enable_gso();
        }
        let rb = RecvBatch::new(MAX_BATCH, HDR_LEN + chunk);
        let (backend, reason) = make_backend(group, &me, cfg, chunk, choice)?;
        // A member's backend waits on its socket and the kernel's records
        // together; the aggregator service reads them in turn (serve_once).
        if role == Role::Member {
            backend.watch_socket(sock.as_raw_fd())?;
        }
        Ok(Endpoint { me, chunk, sock, rb, backend, reason })
    }
}
