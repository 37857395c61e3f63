//! Destinations a kernel fan-out could not serve (struct kccl_miss_event on
//! tc_bcast's miss ring buffer, struct kccl_agg_miss with the answer itself
//! on tc_agg_result's), for user space to send itself.

use std::sync::{Arc, Mutex};

use libbpf_rs::{MapCore, RingBuffer, RingBufferBuilder};

use crate::error::{Error, Result};
use crate::skel::types;
use crate::skel_agg_result::types as agg_types;

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

/// A destination tc_agg_result's fan-out did not serve, with the answer it
/// should have received (struct kccl_agg_miss).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggMiss {
    pub event: MissEvent,
    /// The answer's UDP payload (kccl header and payload, FANOUT cleared);
    /// empty if the kernel could not copy it.
    pub answer: Vec<u8>,
}

/// A struct kccl_agg_miss from tc_agg_result's ring; None if the record is
/// shorter than its header or than the answer length it states.
pub(crate) fn parse_agg_miss(raw: &[u8]) -> Option<AggMiss> {
    let event = parse_miss_event(raw)?;
    let head = std::mem::offset_of!(agg_types::kccl_agg_miss, dgram);
    let len_at = std::mem::offset_of!(agg_types::kccl_agg_miss, dgram_len);
    let len = u32::from_ne_bytes(raw.get(len_at..len_at + 4)?.try_into().ok()?) as usize;
    let answer = raw.get(head..head + len)?.to_vec();
    Some(AggMiss { event, answer })
}

/// The reader of one program's miss ring buffer: the ring's callback (which
/// must be 'static) collects the records, parsed by `parse`, until
/// [`MissReader::drain`].
pub(crate) struct MissReader<T = MissEvent> {
    ring: RingBuffer<'static>,
    events: Arc<Mutex<Vec<T>>>,
}

impl<T: Send + 'static> MissReader<T> {
    /// Reads `map`, a ring buffer named `name` of records `parse` reads.
    pub(crate) fn new(map: &dyn MapCore, name: &str, parse: fn(&[u8]) -> Option<T>) -> Result<MissReader<T>> {
        let events: Arc<Mutex<Vec<T>>> = Arc::default();
        let sink = Arc::clone(&events);
        let mut rb = RingBufferBuilder::new();
        rb.add(map, move |raw: &[u8]| {
            if let Some(ev) = parse(raw) {
                if let Ok(mut v) = sink.lock() {
                    v.push(ev);
                }
            }
            0
        })
        .map_err(|e| Error::Bpf { step: format!("adding the {name} ring buffer"), source: e })?;
        let ring = rb.build().map_err(|e| Error::Bpf { step: format!("creating the {name} reader"), source: e })?;
        Ok(MissReader { ring, events })
    }

    /// The records written since the last call.
    pub(crate) fn drain(&self) -> Vec<T> {
        let _ = self.ring.consume();
        self.events.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A struct kccl_agg_miss record as the ring hands it over: the event
    /// (host order), dgram_len, pad, then dgram_len answer bytes (the rest
    /// of the reservation is not looked at).
    fn agg_record(rank: u16, reason: u16, answer: &[u8], claimed_len: u32) -> Vec<u8> {
        let mut r = Vec::new();
        for v in [7u32, 12, 2864] {
            r.extend_from_slice(&v.to_ne_bytes());
        }
        r.extend_from_slice(&rank.to_ne_bytes());
        r.extend_from_slice(&reason.to_ne_bytes());
        r.extend_from_slice(&claimed_len.to_ne_bytes());
        r.extend_from_slice(&[0; 4]);
        r.extend_from_slice(answer);
        r
    }

    #[test]
    fn agg_miss_records_carry_the_answer() {
        let m = parse_agg_miss(&agg_record(3, 1, b"answer", 6)).expect("parses");
        let ev = MissEvent { job_id: 7, msg_seq: 12, frag_off: 2864, rank: 3, reason: MissReason::Unresolved };
        assert_eq!(m, AggMiss { event: ev, answer: b"answer".to_vec() });
        let empty = parse_agg_miss(&agg_record(4, 3, &[], 0)).expect("parses");
        assert_eq!((empty.event.reason, empty.answer.len()), (MissReason::CloneFailed, 0));
        // A record shorter than the answer it claims, or than its header.
        assert_eq!(parse_agg_miss(&agg_record(3, 1, b"ans", 6)), None);
        assert_eq!(parse_agg_miss(&agg_record(3, 1, &[], 0)[..20]), None);
    }
}
