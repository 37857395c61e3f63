//! The testbed's errors: each names the step that failed and what to do.
//! Errors of the library (a collective that failed, a bad group file) pass
//! through unchanged as [`Error::Kccl`].

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The library failed (a collective, a group file, the kernel path).
    #[error(transparent)]
    Kccl(#[from] kccl::Error),

    /// A peer (Gloo, Open MPI) failed, or is not installed.
    #[error(transparent)]
    Peer(#[from] crate::peers::kinds::PeerError),

    #[error("cluster '{name}': {msg}")]
    Cluster { name: String, msg: String },

    #[error("{what} needs root (CAP_NET_ADMIN and CAP_BPF); run it with sudo")]
    NotRoot { what: String },

    #[error("{step}: {source}")]
    Io {
        step: String,
        #[source]
        source: io::Error,
    },

    #[error("timed out after {ms} ms waiting for {what}")]
    Timeout { ms: u64, what: String },

    /// A setting of a benchmark or of the cluster that cannot work.
    #[error("{setting}: {why}")]
    BadSetting { setting: String, why: String },

    /// A benchmark's result check failed: the collective returned wrong data.
    #[error("{what} check: {detail}")]
    WrongResult { what: String, detail: String },

    /// This rank stopped because another rank of the same benchmark failed;
    /// that rank's error is the cause (the harness reports it instead).
    #[error("another rank of the benchmark failed (see its error)")]
    OtherRankFailed,

    #[error("{what} panicked (a bug: please report it with the output above)")]
    Panicked { what: String },

    /// A system tool the testbed runs (ip, ethtool, python3) failed.
    #[error("`{cmd}` failed: {detail} ({hint})")]
    Tool { cmd: String, detail: String, hint: String },

    /// The machine does not offer what a benchmark measures with.
    #[error("{what}: {detail}")]
    Host { what: String, detail: String },
}

impl Error {
    /// Wraps an I/O error with the step that failed.
    pub fn io(step: impl Into<String>, source: io::Error) -> Self {
        Error::Io { step: step.into(), source }
    }

    /// A setting that cannot work, and why.
    pub fn setting(setting: impl Into<String>, why: impl Into<String>) -> Self {
        Error::BadSetting { setting: setting.into(), why: why.into() }
    }

    /// A failed result check of `what` (e.g. "reduce", "GEMM").
    pub fn wrong(what: impl std::fmt::Display, detail: impl Into<String>) -> Self {
        Error::WrongResult { what: what.to_string(), detail: detail.into() }
    }

    pub fn panicked(what: impl Into<String>) -> Self {
        Error::Panicked { what: what.into() }
    }
}
