//! What the aggregation engine is configured with before load (read-only
//! globals and map sizes), the limits of the C headers it is checked
//! against, and how its XDP program ended up attached.

use std::mem::{offset_of, size_of};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::group::MAX_MEMBERS;
use crate::skel_agg::types::{kccl_agg_record, kccl_agg_slot, kccl_agg_sub};

/// Bytes of a chunk combined under one lock (KCCL_AGG_SUB_BYTES).
pub const SUB_BYTES: u32 = crate::wire::AGG_SUB_BYTES as u32;
/// Accumulators of one sub-block (KCCL_AGG_SUB_ELEMS).
pub const SUB_ELEMS: usize = SUB_BYTES as usize / 4;
pub use crate::chunk::MAX_CHUNK_BYTES;
/// Values of the largest record (KCCL_AGG_MAX_ELEMS).
pub const MAX_ELEMS: usize = MAX_CHUNK_BYTES as usize / 4;
/// Bytes of a ring buffer record before the values (KCCL_AGG_RECORD_HDR_LEN).
pub const RECORD_HDR_LEN: usize = 32;
/// Largest slot count [`AggEngine::load`] accepts (a slot is 80 bytes plus
/// ~6.9 KiB per sub-block of its chunk).
pub const MAX_SLOTS: u32 = 1 << 14;

/// Largest agg_acc (sub-block) count the engine accepts: ~225 MiB.
pub const MAX_SUB_BLOCKS: u64 = 1 << 15;

/// Sub-blocks (agg_acc entries) per slot for chunks of `chunk_bytes`.
pub const fn subs_per_slot(chunk_bytes: u32) -> u32 {
    chunk_bytes.div_ceil(SUB_BYTES)
}

// The C headers are the definition; fail the build if the generated copies move.
const _: () = assert!(size_of::<kccl_agg_record>() == RECORD_HDR_LEN);
const _: () = assert!(size_of::<kccl_agg_slot>() == 48 + RECORD_HDR_LEN);
const _: () = assert!(offset_of!(kccl_agg_sub, acc) == 16 && size_of::<kccl_agg_sub>() == 16 + SUB_ELEMS * 8);
const _: () = assert!(
    size_of::<crate::skel_agg::types::kccl_member>() == size_of::<crate::skel::types::kccl_member>()
        && size_of::<crate::skel_agg_result::types::kccl_member>() == size_of::<crate::skel::types::kccl_member>()
);

/// Configuration of the engine (read-only globals of the programs and map
/// sizes, fixed at load).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggEngineConfig {
    pub job_id: u32,
    /// The aggregator's UDP port (contributions go there).
    pub port: u16,
    /// The aggregator's rank (src_rank of the answers).
    pub my_rank: u16,
    /// The job's chunk size: a multiple of 8, at most [`MAX_CHUNK_BYTES`].
    pub chunk_bytes: u32,
    /// Aggregation slots: a power of two, at most [`MAX_SLOTS`].
    pub nslots: u32,
    /// An unfinished chunk older than this may lose its slot.
    pub slot_timeout: Duration,
    /// Ring buffer size for reduce records: a power of two >= 16 KiB.
    pub ring_bytes: u32,
    /// Wake the reader when the ring holds more than this (or an operation
    /// completed); below, records are written without a wake-up.
    pub wakeup_bytes: u32,
    /// The job's largest contributor window (AggConfig::window): below
    /// nslots; a contribution of chunk c proves its sender holds every
    /// answer below c + 1 - window (docs/AGGREGATION.md, "Slot reuse").
    pub window: u32,
}

impl AggEngineConfig {
    /// Defaults: the chunk of a 1500-byte MTU (1432 bytes), 1024 slots, 2 s slot timeout, 64 MiB ring,
    /// wake-up after 1 MiB.
    pub fn new(job_id: u32, port: u16, my_rank: u16) -> Self {
        AggEngineConfig {
            job_id,
            port,
            my_rank,
            chunk_bytes: crate::chunk::DEFAULT_CHUNK_BYTES,
            nslots: 1024,
            slot_timeout: Duration::from_secs(2),
            ring_bytes: 64 << 20,
            wakeup_bytes: 1 << 20,
            window: 256,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, msg: String| Err(Error::AggConfig { field, msg });
        if self.port == 0 {
            return bad("port", "0 is not a UDP port contributors can send to".into());
        }
        if usize::from(self.my_rank) >= MAX_MEMBERS {
            return bad("my_rank", format!("{} is outside 0..{}", self.my_rank, MAX_MEMBERS - 1));
        }
        if let Err(m) = crate::chunk::check(i64::from(self.chunk_bytes)) {
            return bad("chunk_bytes", m);
        }
        if !self.nslots.is_power_of_two() || self.nslots > MAX_SLOTS {
            return bad("nslots", format!("{} must be a power of two between 1 and {MAX_SLOTS}", self.nslots));
        }
        if self.window == 0 || self.window >= self.nslots {
            return bad("window", format!("{} must be at least 1 and below nslots {}", self.window, self.nslots));
        }
        if self.slot_timeout.is_zero() || self.slot_timeout.as_nanos() > u128::from(u64::MAX) {
            return bad("slot_timeout", format!("{:?} must be positive and fit 64-bit nanoseconds", self.slot_timeout));
        }
        let subs = self.nslots as u64 * u64::from(subs_per_slot(self.chunk_bytes));
        if subs > MAX_SUB_BLOCKS {
            return bad(
                "nslots",
                format!(
                    "{} slots of {}-byte chunks need {subs} sub-blocks of accumulators (~6.9 KiB each), more than \
                     {MAX_SUB_BLOCKS}: use fewer slots (a smaller window) for big chunks",
                    self.nslots, self.chunk_bytes
                ),
            );
        }
        // An int32 chunk's record: the header and 8 bytes per 4-byte element.
        let record = RECORD_HDR_LEN as u64 + 2 * u64::from(self.chunk_bytes);
        if !self.ring_bytes.is_power_of_two() || u64::from(self.ring_bytes) < (16 << 10).max(4 * record) {
            return bad(
                "ring_bytes",
                format!(
                    "{} must be a power of two of at least 16384 and of 4 full records ({record} bytes each)",
                    self.ring_bytes
                ),
            );
        }
        if self.wakeup_bytes >= self.ring_bytes {
            return bad(
                "wakeup_bytes",
                format!(
                    "{} must be below ring_bytes ({}): the ring would fill first",
                    self.wakeup_bytes, self.ring_bytes
                ),
            );
        }
        Ok(())
    }
}

/// How the XDP program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum XdpMode {
    /// In the driver (XDP_FLAGS_DRV_MODE).
    Native,
    /// Generic (skb) mode: the driver refused native mode.
    Generic,
}
