//! Destinations a kernel fan-out could not serve (struct kccl_miss_event on
//! the miss ring buffers of tc_bcast and tc_agg_result), for user space to
//! send itself.

use crate::skel::types;

/// enum kccl_miss_reason
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    Unresolved,
    NotMember,
    CloneFailed,
    Unknown(u16),
}

impl From<u16> for MissReason {
    fn from(v: u16) -> Self {
        match v {
            1 => MissReason::Unresolved,
            2 => MissReason::NotMember,
            3 => MissReason::CloneFailed,
            x => MissReason::Unknown(x),
        }
    }
}

/// A destination the kernel fan-out did not serve (struct kccl_miss_event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissEvent {
    pub job_id: u32,
    pub msg_seq: u32,
    pub frag_off: u32,
    pub rank: u16,
    pub reason: MissReason,
}

/// A struct kccl_miss_event from a ring buffer record (tc_bcast's or
/// tc_agg_result's); None if the record is too short.
pub(crate) fn parse_miss_event(raw: &[u8]) -> Option<MissEvent> {
    if raw.len() < std::mem::size_of::<types::kccl_miss_event>() {
        return None;
    }
    // SAFETY: the record is a struct kccl_miss_event written by a kccl
    // program (length checked; read_unaligned needs no alignment).
    let ev: types::kccl_miss_event = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
    Some(MissEvent {
        job_id: ev.job_id,
        msg_seq: ev.msg_seq,
        frag_off: ev.frag_off,
        rank: ev.rank,
        reason: ev.reason.into(),
    })
}
