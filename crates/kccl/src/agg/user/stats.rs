//! What the user-space aggregator counts and reports: its counters (named
//! after enum kccl_agg_stat where both paths count the same thing) and the
//! contributions it refused as mismatched.

/// Aggregator counters; the names follow enum kccl_agg_stat where the two
/// paths count the same thing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AggStats {
    /// Datagrams read from the socket.
    pub datagrams: u64,
    /// recvmmsg / sendmmsg calls.
    pub recv_calls: u64,
    pub send_calls: u64,
    /// Contributions added to a slot.
    pub pkts: u64,
    pub chunks_done: u64,
    /// Allreduce result chunks completed (before the per-contributor copies).
    pub results: u64,
    /// Reduce chunks completed (ACKed).
    pub acks: u64,
    /// Answer datagrams sent (one per contributor, plus re-answers).
    pub answers_sent: u64,
    /// Reduce chunks acknowledged in batches (KCCL_T_AGG_ACKS) after the
    /// root took them (the kernel's records, or chunks completed here).
    pub acks_later: u64,
    /// KCCL_T_AGG_ACKS datagrams sent (one per contributor and bitmap).
    pub ack_batches: u64,
    /// Contribution already counted (slot still active).
    pub dup: u64,
    /// PENDING answers to such duplicates, naming the contributors the
    /// chunk still waits for (as xdp_agg sends them).
    pub pending: u64,
    /// Aborts of a call taken from its members (KCCL_T_AGG_ABORT).
    pub aborts: u64,
    /// Allreduce calls this aggregator aborted itself: its members sent
    /// chunks that disagree (length, type, op or contributors).
    pub aborts_sent: u64,
    /// Aborts sent again to a contribution of an aborted call (a member
    /// that started late).
    pub aborts_resent: u64,
    /// ACTIVE slots of aborted calls freed at once.
    pub abort_freed: u64,
    /// Contribution for a finished chunk: the answer was sent again.
    pub dup_done: u64,
    /// Slot held by another live chunk: dropped (the sender retransmits).
    pub busy: u64,
    /// Abandoned chunk's slot taken after the slot timeout.
    pub reclaimed: u64,
    /// Op/type/length/contributors differ from the slot's (or from what the
    /// local root expects).
    pub mismatch: u64,
    /// Sender not in the packet's contributor mask.
    pub not_contrib: u64,
    /// Sender rank unknown or sending from another address than its own.
    pub not_member: u64,
    /// kccl packet with a bad header or chunk geometry.
    pub malformed: u64,
    /// Datagram larger than a chunk (cut by the receive buffer).
    pub truncated: u64,
    /// Op or type this runtime does not know.
    pub unsupported: u64,
    /// Packet of another job.
    pub other_job: u64,
    /// Contributions with USER_ONLY (overflow redo).
    pub user_only: u64,
    /// Chunk of an operation that already finished and whose answer was
    /// already recycled: dropped.
    pub stale: u64,
    /// Reduce contribution for an operation the local root has not started
    /// (and no room to take it early): dropped, the sender retransmits.
    pub early: u64,
    /// Result chunks with a saturated (int32) or overflowed (int64) element.
    pub overflow: u64,
    /// Datagrams that are not contributions (answers, broadcast, ...).
    pub not_contribution: u64,
    /// KCCL_T_AGG_RECEIPT packets taken (a contributor is done with an
    /// operation).
    pub receipts: u64,
    /// KCCL_T_AGG_SYNC requests answered.
    pub syncs: u64,
    /// Kernel path: answers tc_agg_result could not fan out (a failed
    /// clone, a member without a next hop), sent from here instead.
    pub misses_relayed: u64,
    /// Kernel path: such misses without an answer to send (the kernel
    /// could not copy it, or the rank is not a member): left to the
    /// contributor's retransmission.
    pub misses_unserved: u64,
}

impl AggStats {
    /// Datagrams dropped for any reason other than duplicates/busy/early.
    pub fn rejected(&self) -> u64 {
        self.mismatch
            + self.not_contrib
            + self.not_member
            + self.malformed
            + self.truncated
            + self.unsupported
            + self.other_job
            + self.stale
    }
}

/// A contribution refused because it does not match its operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MismatchEvent {
    pub op_id: u32,
    pub rank: u16,
    pub detail: String,
}
