//! Broadcast over both paths with one wire format.
//!
//! Kernel path: one datagram per fragment (per 64-rank window) with
//! KCCL_F_FANOUT; tc_bcast at TCX egress copies it to every destination in the
//! mask.  Destinations it reports as missed (unresolved neighbour, failed
//! clone) get their copy from user space in the same call.
//! User path (fallback and baseline): one datagram per fragment per
//! destination, sent with sendmmsg in batches of up to 1024.
//! Receivers are plain UDP sockets on both paths.
//!
//! Reliability (docs/BROADCAST.md, AggBox section 3.3): receivers acknowledge
//! per group of packets (or per packet) with KCCL_T_BCAST_ACK and report
//! persisting gaps with a bitmap of what they hold; broadcast() re-sends only
//! the missing packets, only to the receivers missing them (kernel path: one
//! FANOUT datagram whose mask holds exactly those receivers), and returns once
//! every receiver confirmed the message, or fails at the deadline naming the
//! receivers that did not.  The state machines are in [`track`].

mod recv;
mod send;
pub mod track;

pub use recv::{Message, Receiver, RecvStats};
pub use send::{Broadcaster, SendReport, SenderStats};

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};

pub use track::Reliability;

/// Largest message a sender will send and a receiver accepts by default.
pub const MAX_MESSAGE: usize = u32::MAX as usize;
pub const DEFAULT_MAX_RECV_MESSAGE: usize = 1 << 30;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathChoice {
    Kernel,
    User,
    Auto,
}

impl FromStr for PathChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(PathChoice::Kernel),
            "user" => Ok(PathChoice::User),
            "auto" => Ok(PathChoice::Auto),
            _ => Err(Error::Usage(format!("unknown path '{s}': use kernel, user or auto"))),
        }
    }
}

/// What the runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    Kernel,
    User,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Path::Kernel => "kernel",
            Path::User => "user",
        })
    }
}

/// CPU time of the calling thread (user + system, including softirq work the
/// kernel runs in its context).
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid clock id and timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
