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

pub use track::Reliability;

/// Largest message a sender will send and a receiver accepts by default.
pub const MAX_MESSAGE: usize = u32::MAX as usize;
pub const DEFAULT_MAX_RECV_MESSAGE: usize = 1 << 30;
