//! Looking into the engine's slot table and acknowledgment map from user
//! space (snapshots without the lock): for tests, reclaim checks and the
//! sender's view of what each member has proven it received.

use std::mem::{offset_of, size_of};

use libbpf_rs::{MapCore, MapFlags};

use super::record::{dtype_size, parse_record_header, record_fields, u32_at, u64_at, AggRecord};
use super::{subs_per_slot, AggEngine, SUB_BYTES};
use crate::error::{Error, Result};

/// enum kccl_slot_state
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free,
    Active,
    Delivering,
    Done,
    Undelivered,
    Unknown(u32),
}

impl From<u32> for SlotState {
    fn from(v: u32) -> Self {
        match v {
            0 => SlotState::Free,
            1 => SlotState::Active,
            2 => SlotState::Delivering,
            3 => SlotState::Done,
            4 => SlotState::Undelivered,
            x => SlotState::Unknown(x),
        }
    }
}

/// How many slots are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SlotSummary {
    pub free: u32,
    pub active: u32,
    pub delivering: u32,
    pub done: u32,
    pub undelivered: u32,
    pub unknown: u32,
}

/// One slot as user space reads it (the lock is not taken: a snapshot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub state: SlotState,
    pub expected: u64,
    pub seen: u64,
    /// Contributors whose sub-blocks are being added right now.
    pub busy: u64,
    pub claimed_ns: u64,
    /// Claim generation (the sub-blocks of this chunk carry it).
    pub gen: u64,
    /// The chunk the slot holds (its record header as it will be
    /// delivered): meaningful unless the slot is Free.
    pub rec: AggRecord,
    /// The accumulators in use (payload_len / element size of them, from
    /// the slot's sub-blocks; 0 for a sub-block no contribution of this
    /// generation reached yet).
    pub acc: Vec<i64>,
}

impl AggEngine {
    /// What rank `rank` has proven it received (struct kccl_agg_acks):
    /// None, or (op id, bound): every answer of earlier operations and of
    /// chunks below `bound` of this one.
    pub fn ack_of(&self, rank: u16) -> Result<Option<(u32, u32)>> {
        let v = self
            .xdp
            .maps
            .agg_acks
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| Error::Bpf { step: "reading agg_acks".into(), source: e })?
            .unwrap_or_default();
        let off = usize::from(rank) * 8;
        if v.len() < off + 8 {
            return Err(Error::Usage(format!("agg_acks has no entry for rank {rank}")));
        }
        let a = u64::from_ne_bytes(v[off..off + 8].try_into().unwrap_or([0; 8]));
        Ok((a != 0).then(|| ((a >> 32) as u32, (a as u32).wrapping_sub(1))))
    }

    /// Slots held by operation `op_id` (any state but FREE), as (index, state).
    pub fn slots_of_op(&self, op_id: u32) -> Result<Vec<(u32, SlotState)>> {
        let mut out = Vec::new();
        for index in 0..self.cfg.nslots {
            let s = self.slot(index)?;
            if s.state != SlotState::Free && s.rec.job_id == self.cfg.job_id && s.rec.op_id == op_id {
                out.push((index, s.state));
            }
        }
        Ok(out)
    }

    /// The slot of chunk `frag_off` of operation `op_id` (the program's hash).
    pub fn slot_index(&self, op_id: u32, frag_off: u32) -> u32 {
        let chunk = frag_off / self.cfg.chunk_bytes;
        op_id.wrapping_mul(0x9E37_79B1).wrapping_add(chunk) & (self.cfg.nslots - 1)
    }

    /// A snapshot of slot `index`.
    pub fn slot(&self, index: u32) -> Result<SlotInfo> {
        use crate::skel_agg::types::kccl_agg_slot as S;
        if index >= self.cfg.nslots {
            return Err(Error::Usage(format!("slot {index} is beyond the {} slots", self.cfg.nslots)));
        }
        let v = self.slot_bytes(index)?;
        let rec = &v[offset_of!(S, rec)..];
        // A slot never claimed (or being claimed) may hold no valid header:
        // its fields as they lie, with no values.
        let (hdr, nvalues) = match parse_record_header(rec) {
            Ok(h) => h,
            Err(_) => (record_fields(rec)?, 0),
        };
        let gen = u64_at(&v, offset_of!(S, gen));
        let acc = if nvalues > 0 { self.slot_values(index, gen, hdr.dtype, nvalues)? } else { Vec::new() };
        Ok(SlotInfo {
            state: u32_at(&v, offset_of!(S, state)).into(),
            expected: u64_at(&v, offset_of!(S, expected)),
            seen: u64_at(&v, offset_of!(S, seen)),
            busy: u64_at(&v, offset_of!(S, busy)),
            claimed_ns: u64_at(&v, offset_of!(S, claimed_ns)),
            gen,
            rec: hdr,
            acc,
        })
    }

    /// The first `n` accumulators of slot `index` (dtype `dtype`), sub-block
    /// by sub-block from agg_acc; sub-blocks of another generation than
    /// `gen` count as zeros.
    fn slot_values(&self, index: u32, gen: u64, dtype: u8, n: usize) -> Result<Vec<i64>> {
        use crate::skel_agg::types::kccl_agg_sub as U;
        let per_sub = SUB_BYTES as usize / dtype_size(dtype).unwrap_or(4);
        let subs = subs_per_slot(self.cfg.chunk_bytes);
        let mut out = Vec::with_capacity(n);
        for i in 0..n.div_ceil(per_sub) as u32 {
            let key = index * subs + i;
            let v = self
                .xdp
                .maps
                .agg_acc
                .lookup(&key.to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| Error::Bpf { step: format!("reading agg_acc[{key}]"), source: e })?
                .ok_or_else(|| Error::Usage(format!("agg_acc[{key}] missing (slot {index}, sub-block {i})")))?;
            if v.len() < size_of::<U>() {
                return Err(Error::Usage(format!("agg_acc value of {} bytes, {} expected", v.len(), size_of::<U>())));
            }
            let k = per_sub.min(n - out.len());
            let ours = u64_at(&v, offset_of!(U, gen)) == gen;
            let acc = &v[offset_of!(U, acc)..];
            out.extend((0..k).map(|j| if ours { u64_at(acc, j * 8) as i64 } else { 0 }));
        }
        Ok(out)
    }

    /// How many slots are in each state (for tests and reclaim checks).
    pub fn slots(&self) -> Result<SlotSummary> {
        use crate::skel_agg::types::kccl_agg_slot as S;
        let mut sum = SlotSummary::default();
        for index in 0..self.cfg.nslots {
            let v = self.slot_bytes(index)?;
            match SlotState::from(u32_at(&v, offset_of!(S, state))) {
                SlotState::Free => sum.free += 1,
                SlotState::Active => sum.active += 1,
                SlotState::Delivering => sum.delivering += 1,
                SlotState::Done => sum.done += 1,
                SlotState::Undelivered => sum.undelivered += 1,
                SlotState::Unknown(_) => sum.unknown += 1,
            }
        }
        Ok(sum)
    }

    /// The raw bytes of agg_slots[index] (struct kccl_agg_slot), at least as
    /// long as the struct.
    fn slot_bytes(&self, index: u32) -> Result<Vec<u8>> {
        use crate::skel_agg::types::kccl_agg_slot as S;
        let v = self
            .xdp
            .maps
            .agg_slots
            .lookup(&index.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| Error::Bpf { step: format!("reading agg_slots[{index}]"), source: e })?
            .ok_or_else(|| Error::Usage(format!("agg_slots[{index}] missing")))?;
        if v.len() < size_of::<S>() {
            return Err(Error::Usage(format!("agg_slots value of {} bytes, {} expected", v.len(), size_of::<S>())));
        }
        Ok(v)
    }
}
