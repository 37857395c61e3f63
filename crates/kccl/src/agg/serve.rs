//! A member's aggregator role between and after its calls: answering
//! retransmissions of finished chunks, taking early contributions, and
//! waiting for the receipts of the last operation it combined.

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::wire::MASK_BITS;

use super::dispatch::pump;
use super::root::RootSink;
use super::{user, Collective};

impl Collective {
    /// Serves the aggregator role for `d` without running an operation:
    /// answers retransmissions of finished chunks and takes early
    /// contributions.  A reduce root can linger with it after its last call
    /// so that a contributor whose ACK was lost still finishes.
    pub fn serve_for(&mut self, d: Duration) -> Result<()> {
        let end = Instant::now() + d;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            let mut sink = RootSink::new(&mut self.stash, self.calls.wrapping_sub(1), self.cfg.nslots, None);
            let wait = left.min(Duration::from_millis(50));
            let r = pump(&self.sock, &mut self.rb, &mut self.backend, &mut self.stats, wait, false, None, &mut sink);
            sink.count_into(&mut self.stats);
            r?;
        }
    }

    /// After the last operation this member combined (a reduce it was the
    /// root of, or its shard of a sharded allreduce): keeps answering
    /// retransmissions until every contributor of it confirmed it has every
    /// answer (its RECEIPT; an ACK or RESULT lost on the way is re-sent
    /// from the finished chunk), or `max` passed.  Call it before the
    /// process exits (on the kernel path the programs detach with it, on
    /// the user path nobody else answers).  Returns the ranks that did not
    /// confirm (their receipt was lost, or they died); empty when all did
    /// or there was no such operation.
    pub fn settle(&mut self, max: Duration) -> Result<Vec<u16>> {
        let Some(d) = self.last_served else { return Ok(Vec::new()) };
        let end = Instant::now() + max;
        loop {
            let mut open = Vec::new();
            for b in (0..MASK_BITS).filter(|&b| d.mask >> b & 1 != 0) {
                let rank = d.base + b as u16;
                if !user::ack_covers(self.backend.ack_of(rank)?, d.op_id, d.nchunks) {
                    open.push(rank);
                }
            }
            let left = end.saturating_duration_since(Instant::now());
            if open.is_empty() || left.is_zero() {
                return Ok(open);
            }
            self.serve_for(left.min(Duration::from_millis(5)))?;
        }
    }
}
