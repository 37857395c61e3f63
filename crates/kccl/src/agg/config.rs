//! A Collective's configuration ([`AggConfig`]) and what its calls report
//! ([`CollectiveStats`], [`SendReport`]).

use std::time::Duration;

use super::member::{ContribStats, MIN_CWND};
use super::op::Quant;
use super::user::AggStats;

/// Tuning of one member or aggregator.  The chunk size is not here: it is
/// the group file's (its `mtu`, crate::chunk), the same for every member.
/// `window` must stay below the aggregator's `nslots`.
#[derive(Debug, Clone, PartialEq)]
pub struct AggConfig {
    /// Span of chunks a contributor may have sent above its lowest
    /// unanswered one (the slot-reuse proof's W; also the largest
    /// congestion window, which bounds the chunks in flight).
    pub window: usize,
    /// Bytes a contributor may have in flight toward one aggregator: the
    /// window shrinks to this many chunks (at least 8) when chunks are
    /// large.  Why: 256 chunks of 64 KB from each of 4 senders overflow the
    /// aggregator's veth ring (256 frames) and cost retransmissions and
    /// timeouts (64 MiB reduce at MTU 65000: 446 retransmissions per
    /// operation at 16 MiB in flight, none at 2 MiB; docs/BENCHMARKS.md).
    pub window_bytes: usize,
    /// Retransmission timeout: a chunk unanswered this long after its last
    /// send is sent again (fast retransmission usually comes first).
    pub rto: Duration,
    /// An operation fails when nothing progressed for this long.
    pub deadline: Duration,
    pub quant: Quant,
    /// Aggregation slots (power of two) of this member's aggregator role.
    pub nslots: usize,
    /// An aggregating chunk idle for this long may lose its slot.
    pub slot_timeout: Duration,
    /// Send runs of chunks to one address as UDP GSO messages (one stack
    /// traversal per run instead of per datagram; the wire is unchanged).
    /// On by default (docs/AGGREGATION.md, "UDP GSO": why it was opt-in
    /// and what changed); a kernel that refuses UDP_SEGMENT falls back to
    /// single datagrams by itself.
    pub gso: bool,
    /// Who combines an allreduce: one aggregator rank, or every member a
    /// shard of the vector (docs/AGGREGATION.md, "Sharded allreduce").
    pub allreduce: AllreduceMode,
}

/// Who combines the chunks of an allreduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllreduceMode {
    /// The group file's `aggregator` when it names one, else sharded.
    #[default]
    Auto,
    /// The group's aggregator rank (a `kccl aggregator` service) combines
    /// every chunk; its link carries every member's data.
    Aggregator,
    /// Every member combines a contiguous run of chunks (its shard): each
    /// member sends each shard to the shard's owner and gets the shard's
    /// result back from it, so every link carries about 2(N-1)/N of the
    /// vector each way, as a ring does.
    Sharded,
}

impl std::str::FromStr for AllreduceMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(AllreduceMode::Auto),
            "aggregator" => Ok(AllreduceMode::Aggregator),
            "sharded" => Ok(AllreduceMode::Sharded),
            _ => Err(format!("allreduce mode {s:?}: expected auto, aggregator or sharded")),
        }
    }
}

impl std::fmt::Display for AllreduceMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AllreduceMode::Auto => "auto",
            AllreduceMode::Aggregator => "aggregator",
            AllreduceMode::Sharded => "sharded",
        })
    }
}

impl Default for AggConfig {
    fn default() -> Self {
        AggConfig {
            window: 256,
            window_bytes: 2 << 20,
            rto: Duration::from_millis(25),
            deadline: Duration::from_secs(10),
            quant: Quant::Auto,
            nslots: 1024,
            slot_timeout: Duration::from_secs(2),
            gso: true,
            allreduce: AllreduceMode::Auto,
        }
    }
}

impl AggConfig {
    /// The contributor window in chunks of `chunk` bytes: `window`, and no
    /// more chunks than `window_bytes` holds (but at least MIN_CWND, the
    /// smallest window in which a lone loss shows as a gap).
    pub fn window_chunks(&self, chunk: usize) -> usize {
        self.window.min((self.window_bytes / chunk.max(1)).max(MIN_CWND))
    }
}

/// Counters of a Collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CollectiveStats {
    /// API calls (reduce, allreduce, send/get_aggregated_data).
    pub calls: u64,
    /// Wire operations run (pre-passes and redos included).
    pub ops: u64,
    /// Operations redone in int64 after an int32 overflow.
    pub redo_ops: u64,
    pub recv_calls: u64,
    /// Datagrams that were neither contributions nor answers (or truncated).
    pub other_datagrams: u64,
    /// Reduce chunks the root received (user or kernel aggregation).
    pub root_chunks: u64,
    /// Reduce chunks completed before the root reached their operation.
    pub stashed: u64,
    /// Reduce chunks of calls this root had already finished (or given up
    /// on) when they completed: dropped.
    pub stale_chunks: u64,
    /// Calls this member aborted for the others (KCCL_T_AGG_ABORT sent:
    /// its own input was bad, or as a reduce root it found the result
    /// overflowing or the members' calls mismatched).
    pub aborts_sent: u64,
    pub contrib: ContribStats,
    /// The user-space aggregator of this member (reduce root, USER_ONLY).
    pub agg: AggStats,
    /// Its own shards of sharded allreduces on the kernel path.
    pub own_shard: OwnShardStats,
}

/// A sharded allreduce's own shard on the kernel path (agg/own_shard.rs):
/// this member's contributions to it and its copies of the results.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct OwnShardStats {
    /// Own contributions run through xdp_agg (BPF_PROG_TEST_RUN).
    pub runs: u64,
    /// Answers those runs passed up (PENDING, RESULT, or this member's own
    /// contribution handed to its user-space aggregator).
    pub passed: u64,
    /// Copies of a RESULT the own contribution completed, sent to the other
    /// contributors from user space.
    pub relayed: u64,
    /// The owner's copies read from the ring (a remote contribution
    /// completed the chunk).
    pub records: u64,
}

/// What a contributor's reduce call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendReport {
    pub op_id: u32,
    pub chunks: usize,
    pub datagrams: u64,
    pub retransmits: u64,
    pub elapsed: Duration,
}

#[cfg(test)]
mod tests {
    use super::AggConfig;

    #[test]
    fn window_in_chunks_follows_the_byte_budget() {
        let c = AggConfig::default();
        // 2 MiB: every chunk of MTU 1500 fits 256, 9000 gives 234, 65000 32.
        assert_eq!([1432, 8928, 64928].map(|b| c.window_chunks(b)), [256, 234, 32]);
        let tiny = AggConfig { window_bytes: 0, ..AggConfig::default() };
        assert_eq!(tiny.window_chunks(1432), 8, "never below MIN_CWND");
        let small = AggConfig { window: 4, window_bytes: 0, ..AggConfig::default() };
        assert_eq!(small.window_chunks(1432), 4, "never above window");
    }
}
