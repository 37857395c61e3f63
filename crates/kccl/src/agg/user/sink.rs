//! Where the user-space aggregator hands what it decides: admission of a
//! new chunk and delivery of a completed one (the root's stash, the kernel
//! path's ring-buffer reader, or nothing when only allreduce is served).

use std::net::SocketAddrV4;

use crate::kernel_agg::AggRecordView;
use crate::wire::{Header, F_ALLREDUCE};

/// What the owner of the aggregator says about a contribution before it is
/// aggregated (the local root knows the op it runs; the allreduce service
/// takes every allreduce contribution and no reduce one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// Not expected here (yet): dropped and counted as `early`.
    Early,
    /// Differs from what the local root expects: counted, dropped, reported.
    Mismatch(String),
}

/// The owner's side of the aggregator: admission of contributions that would
/// be aggregated, and delivery of completed reduce chunks.
pub trait AggSink {
    fn admit(&mut self, h: &Header) -> Admit;
    fn deliver(&mut self, d: &AggRecordView<'_>);
    /// How many completed reduce chunks the owner can take now.  The kernel
    /// path reads no more ring buffer records than this; the others wait in
    /// the ring (the user path's backpressure is [`Admit::Early`]).
    fn room(&self) -> usize {
        usize::MAX
    }
    /// A KCCL_T_AGG_ABORT datagram (`payload` its reason and text) from
    /// `from`: a reduce root waiting for that call fails with it.
    fn abort(&mut self, _h: &Header, _payload: &[u8], _from: SocketAddrV4) {}
}

/// The allreduce service: every allreduce contribution is taken; reduce
/// contributions have no root here and are counted as `early` and dropped.
pub struct AllreduceOnly;

impl AggSink for AllreduceOnly {
    fn admit(&mut self, h: &Header) -> Admit {
        if h.flags & F_ALLREDUCE != 0 {
            Admit::Yes
        } else {
            Admit::Early
        }
    }
    fn deliver(&mut self, _: &AggRecordView<'_>) {}
}
