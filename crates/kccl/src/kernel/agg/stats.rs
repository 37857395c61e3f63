//! The aggregation engine's counters (enum kccl_agg_stat), summed over CPUs.

macro_rules! agg_stats {
    ($($(#[$doc:meta])* $field:ident),* $(,)?) => {
        /// Counters of xdp_agg and tc_agg_result (enum kccl_agg_stat, same
        /// order), summed over CPUs.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
        pub struct AggStats {
            $($(#[$doc])* pub $field: u64,)*
        }

        impl AggStats {
            pub(super) const N: usize = Self::NAMES.len();
            /// Field names in enum kccl_agg_stat order (KCCL_AS_<NAME>).
            pub(super) const NAMES: &'static [&'static str] = &[$(stringify!($field)),*];

            pub(super) fn from_array(a: [u64; Self::N]) -> AggStats {
                let mut it = a.into_iter();
                AggStats { $($field: it.next().unwrap_or(0),)* }
            }

            /// Counts since `before` (saturating: counters only grow).
            pub fn delta(&self, before: &AggStats) -> AggStats {
                AggStats { $($field: self.$field.saturating_sub(before.$field),)* }
            }
        }
    };
}

agg_stats! {
    /// Contributions added to a slot.
    pkts,
    /// Chunks completed.
    chunks_done,
    /// Allreduce result packets emitted (before fan-out).
    results,
    /// Reduce ack packets emitted (before fan-out).
    acks,
    /// Ring buffer records written.
    records,
    /// Contribution already counted (slot still active).
    dup,
    /// Contribution for a finished chunk: answer re-sent to its sender.
    dup_done,
    /// Slot held by another live chunk: dropped.
    busy,
    /// Abandoned chunk's slot taken after the deadline.
    reclaimed,
    /// Op/type/length/contributors differ from the slot's.
    mismatch,
    /// Sender not in the contributor mask.
    not_contrib,
    /// Source address is not the sender rank's.
    not_member,
    /// kccl magic but bad header: dropped.
    malformed,
    /// Op/type the kernel does not do: passed to user space.
    unsupported,
    /// KCCL_F_USER_ONLY: passed to user space.
    user_only,
    /// kccl packet of another job: passed.
    other_job,
    /// Ring buffer full: result kept, retried on retransmission.
    ring_full,
    /// Result chunks with a saturated or overflowed element.
    overflow,
    /// Not kccl aggregation traffic: passed.
    passed,
    /// tc_agg_result: copies sent.
    fanout_copies,
    /// tc_agg_result: destinations it could not serve.
    fanout_missed,
    /// Another chunk wanted a DONE slot whose answer not every contributor
    /// has proven to hold yet: dropped (retransmitted by its sender).
    held,
    /// PENDING answers (missing contributors) to counted retransmissions.
    pending,
    /// KCCL_T_AGG_RECEIPT packets taken.
    receipts,
    /// ACTIVE slots freed by the sweep (AggEngine::sweep).
    swept,
    /// Contributions of a chunk whose answer their sender already proved to
    /// hold (a late copy of a retransmission): dropped, never a new slot.
    stale,
    /// tc_agg_result: answers made from a multi-buffer contribution, cut to
    /// their datagram (bpf_skb_change_tail) before the fan-out.
    trimmed,
    /// Reduce chunks recorded without an ACK: their contributions asked for
    /// the root's runtime to acknowledge them (KCCL_F_ACK_LATER).
    acks_later,
    /// A member's next-hop MAC set from the source MAC of its contribution
    /// or receipt (it was unresolved, or it changed).
    next_hop_learned,
    /// ACTIVE slots of an aborted call freed at once (AggEngine::free_call).
    abort_freed,
    /// Contributions of a call aborted recently (agg_aborted): passed up
    /// untouched, answered with the abort from user space.
    aborted_call,
    /// Allreduce chunks a remote contribution completed while this host
    /// also contributes (it owns the chunk's shard): the result goes to
    /// the ring for the owner's runtime (its copy; the fan-out skips it).
    own_records,
    /// ... and the ring was full: the owner's retransmission (through
    /// BPF_PROG_TEST_RUN) fetches the result from the DONE slot.
    own_ring_full,
    /// tc_agg_result: answers whose contributors include this host, which
    /// got its copy from the ring or the test run, not from the fan-out.
    own_skipped,
}
