//! What a peer run names and how it fails: which peer (Gloo, Open MPI),
//! which collective, which element type, the interpreter every peer rank
//! runs on, and [`PeerError`].  A leaf module (it imports nothing of this crate), so that the
//! testbed's [`crate::Error`] carries a `PeerError` without an import circle
//! through the runner (error -> peers -> cluster/bench -> error).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Interpreter of the peers: Debian's python3-torch and python3-mpi4py are
/// installed for it (pyenv's python3 on PATH does not see them).
pub const PYTHON: &str = "/usr/bin/python3";

/// Which peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Peer {
    Gloo,
    Mpi,
}

/// Which collective. The root of broadcast and reduce is rank 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerOp {
    Broadcast,
    Reduce,
    Allreduce,
}

/// Element type (both 4 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Int32,
    Float32,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Peer::Gloo => "gloo",
            Peer::Mpi => "mpi",
        })
    }
}

impl fmt::Display for PeerOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PeerOp::Broadcast => "broadcast",
            PeerOp::Reduce => "reduce",
            PeerOp::Allreduce => "allreduce",
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::Int32 => "int32",
            DType::Float32 => "float32",
        })
    }
}

impl FromStr for Peer {
    type Err = PeerError;
    fn from_str(s: &str) -> Result<Self, PeerError> {
        match s {
            "gloo" => Ok(Peer::Gloo),
            "mpi" | "openmpi" => Ok(Peer::Mpi),
            _ => Err(PeerError::Usage(format!("unknown peer '{s}': use gloo or mpi"))),
        }
    }
}

impl FromStr for PeerOp {
    type Err = PeerError;
    fn from_str(s: &str) -> Result<Self, PeerError> {
        match s {
            "broadcast" => Ok(PeerOp::Broadcast),
            "reduce" => Ok(PeerOp::Reduce),
            "allreduce" => Ok(PeerOp::Allreduce),
            _ => Err(PeerError::Usage(format!("unknown op '{s}': use broadcast, reduce or allreduce"))),
        }
    }
}

impl FromStr for DType {
    type Err = PeerError;
    fn from_str(s: &str) -> Result<Self, PeerError> {
        match s {
            "int32" => Ok(DType::Int32),
            "float32" => Ok(DType::Float32),
            _ => Err(PeerError::Usage(format!("unknown element type '{s}': use int32 or float32"))),
        }
    }
}

/// Errors of the peer runner; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(
        "the {peer} peer is not installed ({detail}): run `make setup-peers` \
         (installs python3-torch, python3-mpi4py and openmpi-bin for {PYTHON})"
    )]
    Missing { peer: Peer, detail: String },

    #[error("{peer} {op}: result check failed, no timing kept: {detail}")]
    Mismatch { peer: Peer, op: PeerOp, detail: String },

    #[error("{peer} {op}: {what} exited with {status}; its stderr ends with: {stderr}")]
    Failed { peer: Peer, op: PeerOp, what: String, status: String, stderr: String },

    #[error("{peer} {op}: timed out after {secs} s ({pending}); raise the timeout or lower the size/iterations")]
    Timeout { peer: Peer, op: PeerOp, secs: u64, pending: String },

    #[error("{peer} {op}: rank output {path}: {msg}")]
    Output { peer: Peer, op: PeerOp, path: PathBuf, msg: String },

    #[error("{0}")]
    Usage(String),

    #[error("{step}: {source}")]
    Io {
        step: String,
        #[source]
        source: std::io::Error,
    },

    #[error(transparent)]
    Kccl(#[from] kccl::Error),
}

pub(super) fn io_err(step: impl Into<String>) -> impl FnOnce(std::io::Error) -> PeerError {
    let step = step.into();
    move |source| PeerError::Io { step, source }
}
