//! The kernel half of a coordinator on the kernel path: xdp_sg
//! (crate::kernel::SgEngine) attached to the coordinator's interface
//! combines the replies of the requests it holds a slot for, and the
//! coordinator reads only the result.  This decides which requests the
//! kernel takes, opens and closes their slots, and turns what a slot holds
//! into the coordinator's terms.
//!
//! The kernel takes a request when it can combine every reply it expects:
//! SUM, MIN, MAX or COUNT of int32/int64 (CONCAT gathers replies side by
//! side: user path), workers of rank < SG_MAX_RANKS, and a slot no other
//! request in flight holds.  Replies it cannot combine (more than
//! SG_MAX_ELEMS elements, several datagrams, another op or type) refuse
//! their worker, which the coordinator reports with the reason.

use std::collections::HashMap;

use super::combine::{Acc, Combine, Elem};
use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::kernel::{SgClosed, SgDone, SgEngine, SgEngineConfig, SgPeek, SG_MAX_ELEMS, SG_MAX_RANKS};
use crate::netns;

/// Why the kernel refused a worker's reply, as the coordinator reports it.
pub(super) fn refusal() -> String {
    format!(
        "the kernel could not combine its reply: more than {SG_MAX_ELEMS} elements or several datagrams \
         (ask with the user path for replies that long), or another op or element type"
    )
}

pub(super) struct KernelGather {
    engine: SgEngine,
    /// The request each slot in use holds.
    slots: HashMap<u32, u32>,
    iface: String,
}

impl KernelGather {
    /// Loads xdp_sg on `me`'s interface (in the calling thread's network
    /// namespace) and tells it every member's address.
    pub fn load(group: &Group, me: &Member) -> Result<KernelGather> {
        if me.iface == "lo" {
            // XDP there would sit in every local process's traffic, and
            // generic XDP on loopback gains nothing over the socket.
            return Err(Error::KernelPathUnavailable {
                reason: format!(
                    "member {} is on the loopback interface: the kernel path attaches XDP to a network \
                     interface; use the user path on loopback",
                    me.rank
                ),
            });
        }
        let ifindex = netns::ifindex(&me.iface, me.netns.as_deref())?;
        let mut engine = SgEngine::load(&SgEngineConfig::new(group.job_id, me.port), ifindex)?;
        // Ranks beyond the kernel's masks are never asked through it.
        for m in group.members.iter().filter(|m| usize::from(m.rank) < SG_MAX_RANKS) {
            engine.set_member(m.rank, m.addr, m.port)?;
        }
        Ok(KernelGather { engine, slots: HashMap::new(), iface: me.iface.clone() })
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// Opens request `id`'s slot when the kernel can take it (see the
    /// module comment); false leaves the request to the user path.
    pub fn try_open(&mut self, id: u32, need: usize, combine: Combine, elem: Elem, workers: &[u16]) -> Result<bool> {
        let slot = self.engine.slot_of(id);
        if combine == Combine::Concat
            || elem == Elem::Bytes
            || workers.iter().any(|&w| usize::from(w) >= SG_MAX_RANKS)
            || self.slots.contains_key(&slot)
        {
            return Ok(false);
        }
        self.engine.open_request(id, need as u32, combine.wire(), elem.wire(), workers)?;
        self.slots.insert(slot, id);
        Ok(true)
    }

    /// Reads request `id`'s slot without ending it.
    pub fn peek(&self, id: u32) -> Result<Option<SgPeek>> {
        self.engine.peek(id)
    }

    /// Ends request `id` in the kernel: what its slot held and its value so
    /// far.  None when its slot holds another request (never, as long as
    /// this is the engine's only user).
    pub fn close(&mut self, id: u32, combine: Combine, elem: Elem) -> Result<Option<(SgClosed, Acc)>> {
        let slot = self.engine.slot_of(id);
        if self.slots.get(&slot) == Some(&id) {
            self.slots.remove(&slot);
        }
        let Some(c) = self.engine.close_request(id)? else { return Ok(None) };
        let vals = self.engine.values(slot, c.nelem).to_vec();
        let acc = Acc::from_kernel(combine, elem, vals, c.overflow_at.map(|i| i as usize));
        Ok(Some((c, acc)))
    }

    /// Done records that arrived (no wait).
    pub fn done(&mut self) -> Result<Vec<SgDone>> {
        self.engine.poll_done(std::time::Duration::ZERO)
    }

    /// Readable (epoll) when done records wait.
    pub fn done_fd(&self) -> i32 {
        self.engine.done_fd()
    }

    pub fn stats(&self) -> Result<crate::kernel::SgStats> {
        self.engine.stats()
    }
}
