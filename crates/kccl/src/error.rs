//! Typed errors: each names the step that failed and what the user can do.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("group file {path}{}: {msg}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    GroupFile { path: PathBuf, line: Option<usize>, msg: String },

    #[error("rank {rank} is not a member of group '{group}' (members: {members})")]
    UnknownRank { rank: u32, group: String, members: String },

    #[error("empty destination set: name at least one rank other than the sender ({sender})")]
    EmptyDestinations { sender: u16 },

    #[error("kernel path unavailable: {reason}")]
    KernelPathUnavailable { reason: String },

    #[error("interface '{iface}' does not exist in {netns}: check the group file's iface field")]
    InterfaceMissing { iface: String, netns: String },

    #[error("{what} needs root (CAP_NET_ADMIN and CAP_BPF); run it with sudo")]
    NotRoot { what: String },

    #[error("message of {len} bytes is larger than the limit of {max} bytes")]
    MessageTooLarge { len: usize, max: usize },

    #[error("timed out after {ms} ms waiting for {what}")]
    Timeout { ms: u64, what: String },

    /// An aggregation stalled because these contributors sent nothing: the
    /// aggregator said so (PENDING answers, or the root's own slots).
    #[error(
        "{what}: ranks {ranks:?} did not contribute for {ms} ms (the aggregator has every other contribution); \
         they are dead or stuck. Run the next operation without them (Collective::exclude_ranks) or restart them"
    )]
    MembersMissing { what: String, ranks: Vec<u16>, ms: u64 },

    /// Another member of the call found it cannot complete and said why
    /// (KCCL_T_AGG_ABORT): the cause is there, not at this member.
    #[error("{what}: aborted by rank {rank} ({reason}): {detail}")]
    Aborted { what: String, rank: u16, reason: crate::wire::AbortReason, detail: String },

    #[error("malformed packet: {0}")]
    Wire(#[from] crate::wire::WireError),

    #[error("cluster '{name}': {msg}")]
    Cluster { name: String, msg: String },

    #[error("{step}: {source}")]
    Io {
        step: String,
        #[source]
        source: io::Error,
    },

    #[error("BPF {step}: {source}")]
    Bpf {
        step: String,
        #[source]
        source: libbpf_rs::Error,
    },

    #[error("{0}")]
    Usage(String),

    #[error("aggregation engine configuration: {field}: {msg}")]
    AggConfig { field: &'static str, msg: String },

    #[error("malformed aggregation record on the ring buffer: {0}")]
    AggRecord(String),

    #[error(
        "element {index} is NaN or infinite: float32 data can only be aggregated when finite \
         (nothing was sent; the other members of the operation were told and fail with this reason)"
    )]
    NonFinite { index: usize },

    #[error("{what}: {detail}")]
    Overflow { what: String, detail: String },

    #[error("{what}: rank {rank} {detail}; every member must pass the same length, op and element type")]
    Mismatch { what: String, rank: u16, detail: String },

    #[error(
        "{what}: {count} contributors (ranks {first}..={last}) do not fit one 64-rank aggregation mask \
         (ranks [{base}, {base}+64)); aggregate at most 64 ranks of one 64-aligned block \
         (hierarchical aggregation is a later roadmap item)"
    )]
    TooManyContributors { what: String, count: usize, first: u16, last: u16, base: u16 },

    #[error(
        "broadcast of message {seq} ({len} bytes): receivers {} did not confirm it within {ms} ms \
         ({detail}); check that they are running and reachable, or raise the deadline",
        ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")
    )]
    BroadcastUnconfirmed { seq: u32, len: usize, ms: u64, ranks: Vec<u16>, detail: String },

    #[error("fault injector on {target}: {msg}")]
    Fault { target: String, msg: String },
}

impl Error {
    /// Wraps an I/O error with the step that failed.
    pub fn io(step: impl Into<String>, source: io::Error) -> Self {
        Error::Io { step: step.into(), source }
    }

    /// The last OS error, attributed to `step`.
    pub fn last_os(step: impl Into<String>) -> Self {
        Error::io(step, io::Error::last_os_error())
    }
}

/// Whether the process runs with an effective uid of 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
