//! The member handle of an aggregation, [`Collective`] (one per member
//! process): its construction, configuration and the bookkeeping its
//! operations share (call numbers, contributor sets, aborts).  The
//! operations are in reduce.rs and allreduce.rs, serving after the last call
//! in serve.rs.

use std::net::SocketAddrV4;

use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::transport::sock::{BatchSocket, RecvBatch};
use crate::transport::{Path, PathChoice};
use crate::wire::MASK_BITS;

use super::abort;
use super::backend::AggBackend;
use super::config::{AggConfig, CollectiveStats};
use super::endpoint::{Endpoint, Role};
use super::member::{Cwnd, Timing};
use super::op::Element;
use super::root::{RootDone, Stash};
use super::user::MismatchEvent;

/// Contributor window: ranks and their 64-rank mask.
#[derive(Debug, Clone, Copy)]
pub(super) struct Contributors {
    pub(super) base: u16,
    pub(super) mask: u64,
    pub(super) count: usize,
}

pub(super) fn contributors(group: &Group, what: &str, exclude: &[u16]) -> Result<Contributors> {
    let ranks: Vec<u16> = group.members.iter().map(|m| m.rank).filter(|r| !exclude.contains(r)).collect();
    let (Some(&first), Some(&last)) = (ranks.first(), ranks.last()) else {
        return Ok(Contributors { base: 0, mask: 0, count: 0 });
    };
    let base = first / MASK_BITS as u16 * MASK_BITS as u16;
    if ranks.len() > MASK_BITS || last - base >= MASK_BITS as u16 {
        return Err(Error::TooManyContributors { what: what.into(), count: ranks.len(), first, last, base });
    }
    let mask = ranks.iter().fold(0u64, |m, r| m | 1 << (r - base));
    Ok(Contributors { base, mask, count: ranks.len() })
}

/// One member process of a group.
pub struct Collective {
    pub(super) group: Group,
    pub(super) me: Member,
    pub(super) cfg: AggConfig,
    pub(super) chunk: usize,
    pub(super) sock: BatchSocket,
    pub(super) rb: RecvBatch,
    pub(super) backend: AggBackend,
    pub(super) reason: String,
    /// Calls made so far (the next call's number).
    pub(super) calls: u32,
    pub(super) stash: Stash,
    pub(super) stats: CollectiveStats,
    pub(super) scratch: Vec<i64>,
    /// AIMD window toward each aggregating rank, kept across operations.
    pub(super) cwnds: std::collections::HashMap<u16, Cwnd>,
    /// Ranks left out of every contributor set (Collective::exclude_ranks).
    pub(super) excluded: Vec<u16>,
    /// The last operation this member combined (a reduce as its root, or
    /// its shard of a sharded allreduce), for settle().
    pub(super) last_served: Option<RootDone>,
    /// Whether the first call's number was agreed with an aggregator
    /// (KCCL_T_AGG_SYNC).
    pub(super) synced: bool,
    /// Another member's abort of a call this member had not started when
    /// it arrived: (the call's first op id, the abort).
    pub(super) abort_ahead: Option<(u32, abort::Abort)>,
}

pub(super) fn chunk_list(cs: &[usize]) -> String {
    let shown: Vec<String> = cs.iter().take(8).map(|c| c.to_string()).collect();
    let more = if cs.len() > 8 { format!(" and {} more", cs.len() - 8) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// The message (prefix + data) must fit the header's 32-bit msg_len.
pub(super) fn check_len<T: Element>(what: &str, len: usize, prefix: usize) -> Result<()> {
    let bytes = (len + prefix).saturating_mul(T::DTYPE.elem_size());
    if bytes > u32::MAX as usize {
        return Err(Error::Usage(format!(
            "{what}: {bytes} wire bytes exceed the 32-bit message length of the header; split the tensor"
        )));
    }
    Ok(())
}

impl Collective {
    /// Rank `rank`'s member process, in the calling thread's network
    /// namespace (binds the group's address and port of the rank).
    pub fn new(group: &Group, rank: u16, choice: PathChoice, cfg: AggConfig) -> Result<Collective> {
        let Endpoint { me, chunk, sock, rb, backend, reason } =
            Endpoint::open(group, rank, choice, &cfg, Role::Member)?;
        Ok(Collective {
            group: group.clone(),
            me,
            cfg,
            chunk,
            sock,
            rb,
            backend,
            reason,
            calls: 0,
            stash: Stash::default(),
            stats: CollectiveStats::default(),
            scratch: Vec::with_capacity(chunk / 4),
            cwnds: Default::default(),
            excluded: Vec::new(),
            last_served: None,
            synced: false,
            abort_ahead: None,
        })
    }

    /// Runs the following operations without `ranks` (e.g. the ones an
    /// Error::MembersMissing named): they are left out of every contributor
    /// set.  Every remaining member must exclude the same ranks before its
    /// next call (their contributor masks must agree), and the excluded
    /// ranks must not call again.  A reduce root cannot be excluded.
    pub fn exclude_ranks(&mut self, ranks: &[u16]) -> Result<()> {
        if ranks.contains(&self.me.rank) {
            return Err(Error::Usage(format!("rank {} cannot exclude itself", self.me.rank)));
        }
        for &r in ranks {
            self.group.member(r.into())?;
            if !self.excluded.contains(&r) {
                self.excluded.push(r);
            }
        }
        Ok(())
    }

    /// Ranks excluded with [`exclude_ranks`](Self::exclude_ranks).
    pub fn excluded_ranks(&self) -> &[u16] {
        &self.excluded
    }

    pub fn rank(&self) -> u16 {
        self.me.rank
    }

    /// The path of this member's aggregator role (reduce root).  Contributions
    /// are the same packets on both paths.
    pub fn path(&self) -> Path {
        self.backend.path()
    }

    /// Why this path is in use.
    pub fn path_reason(&self) -> &str {
        &self.reason
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    pub fn config(&self) -> &AggConfig {
        &self.cfg
    }

    pub fn stats(&self) -> CollectiveStats {
        CollectiveStats { agg: self.backend.user().stats(), own_shard: self.backend.own_shard_stats(), ..self.stats }
    }

    /// Mismatching contributions this member's aggregator role refused.
    pub fn take_mismatches(&mut self) -> Vec<MismatchEvent> {
        self.backend.user_mut().take_mismatches()
    }

    /// Counters of xdp_agg/tc_agg_result (None on the user path).
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_stats(&self) -> Result<Option<crate::kernel_agg::AggStats>> {
        self.backend.kernel_stats()
    }

    pub(super) fn timing(&self) -> Timing {
        Timing { window: self.cfg.window_chunks(self.chunk), rto: self.cfg.rto, deadline: self.cfg.deadline }
    }

    pub(super) fn next_call(&mut self) -> u32 {
        let k = self.calls;
        self.calls = self.calls.wrapping_add(1);
        self.stats.calls += 1;
        k
    }

    pub(super) fn protocol_error(&self, what: &str, msg: &str) -> Error {
        Error::Usage(format!("{what}: {msg} (protocol error; check that every member runs the same kccl version)"))
    }

    /// Tells the call's other members (contributors in `set` and the
    /// aggregator or root `agg`) that the call cannot complete when `e` is
    /// an error of this member's own part of it (abort.rs), then returns
    /// `e`.  Best effort: a lost abort leaves them their deadline error.
    pub(super) fn announce(&mut self, call: u32, set: Contributors, agg: u16, e: Error) -> Error {
        if let Some(reason) = abort::reason_of(&e) {
            let peers = abort::Peers::of(&self.group, call * 4, set.base, set.mask, agg, self.me.rank);
            let d = peers.abort_datagram(self.me.rank, set.base, set.mask, reason, &e.to_string());
            if peers.send(&self.sock, &d).is_ok() {
                self.stats.aborts_sent += 1;
            }
            // This member's own aggregator slots of the call (a reduce
            // root's) will not complete either.  Best effort, like the
            // abort: if it fails, the sweep frees them after the slot
            // timeout; the error reported is the call's.
            let _ = self.backend.free_call(call * 4);
            // A reduce root also answers the call's late contributions
            // (a contributor that missed this datagram) with it.
            if agg == self.me.rank {
                self.backend.keep_abort(call * 4, d);
            }
        }
        e
    }

    /// `r`, announced to the call's other members if it is such an error.
    pub(super) fn or_abort<V>(&mut self, r: Result<V>, call: u32, set: Contributors, agg: u16) -> Result<V> {
        r.map_err(|e| self.announce(call, set, agg, e))
    }

    pub(super) fn addr_of(&self, rank: u16) -> Result<SocketAddrV4> {
        let m = self.group.member(rank.into())?;
        Ok(SocketAddrV4::new(m.addr, m.port))
    }

    pub(super) fn reduce_contributors(&self, what: &str, root: u16) -> Result<Contributors> {
        if self.excluded.contains(&root) {
            return Err(Error::Usage(format!("{what}: root {root} was excluded (Collective::exclude_ranks)")));
        }
        let mut exclude = vec![root];
        exclude.extend(self.group.aggregator);
        exclude.extend(&self.excluded);
        contributors(&self.group, what, &exclude)
    }
}
