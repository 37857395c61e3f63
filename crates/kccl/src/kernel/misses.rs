//! Destinations a kernel fan-out could not serve (struct kccl_miss_event on
//! the miss ring buffers of tc_bcast and tc_agg_result), for user space to
//! send itself.

use std::sync::{Arc, Mutex};

use libbpf_rs::{MapCore, RingBuffer, RingBufferBuilder};

use crate::error::{Error, Result};
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

/// The reader of one program's miss ring buffer: the ring's callback (which
/// must be 'static) collects the events until [`MissReader::drain`].
pub(crate) struct MissReader {
    ring: RingBuffer<'static>,
    events: Arc<Mutex<Vec<MissEvent>>>,
}

impl MissReader {
    /// Reads `map`, a ring buffer of struct kccl_miss_event named `name`.
    pub(crate) fn new(map: &dyn MapCore, name: &str) -> Result<MissReader> {
        let events: Arc<Mutex<Vec<MissEvent>>> = Arc::default();
        let sink = Arc::clone(&events);
        let mut rb = RingBufferBuilder::new();
        rb.add(map, move |raw: &[u8]| {
            if let Some(ev) = parse_miss_event(raw) {
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

    /// The events written since the last call.
    pub(crate) fn drain(&self) -> Vec<MissEvent> {
        let _ = self.ring.consume();
        self.events.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
}
