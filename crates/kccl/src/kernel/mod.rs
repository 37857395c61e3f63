//! The BPF data plane seen from user space: typed handles over the generated
//! skeletons, configuration in read-only globals before load, links that the
//! kernel removes when the process dies.
//!
//! Files: what every object needs to load (load.rs); the members map and
//! the neighbour table behind it (members.rs); the miss events of both
//! fan-outs (misses.rs); the broadcast fan-out (bcast.rs); the aggregation
//! engine (agg/).

pub mod agg;
mod bcast;
mod load;
mod members;
mod misses;
mod sg;

pub use bcast::{BcastFanout, BcastStats, CLONE_MARK};
pub(crate) use load::{attach_tcx, attach_xdp, load_skeleton, no_rodata, open_skeleton, sum_percpu, verified_insns};
pub(crate) use members::{ifname, member_entry, read_next_hop, write_member_entry};
pub use members::{neighbours, parse_mac};
pub(crate) use misses::{parse_agg_miss, parse_miss_event, MissReader};
pub use misses::{AggMiss, MissEvent, MissReason};
pub use sg::{
    SgClosed, SgDone, SgEngine, SgEngineConfig, SgPeek, SgSlotState, SgStats, SG_MAX_ELEMS, SG_MAX_RANKS, SG_MAX_SLOTS,
};
