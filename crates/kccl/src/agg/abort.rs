//! Aborting a call on the wire (KCCL_T_AGG_ABORT): a member that finds a
//! call cannot complete (NaN in its own float input, an overflowing result
//! at a reduce root, members that passed different lengths) tells every
//! other member of the call at once, so nobody waits out the deadline for
//! a contribution that will never come and then blames the wrong rank.
//!
//! The abort names the call's first op id (call * 4: it covers the exponent
//! pre-pass, the data and the redo of the call), the rank that found the
//! problem (`src_rank`), the reason (first payload byte) and what to fix
//! (UTF-8 text).  It is accepted only from that rank's address in the group
//! and for the receiver's current call; it is sent once (best effort: a
//! lost abort leaves the receiver with the old deadline error).

use std::net::SocketAddrV4;

use crate::error::{Error, Result};
use crate::group::Group;
use crate::transport::sock::{BatchSocket, Datagram};
use crate::wire::{AbortReason, Header, AGG_ABORT_MAX_TEXT, F_LAST_FRAG, HDR_LEN, T_AGG_ABORT, VERSION};

/// An abort received for the current call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    pub rank: u16,
    pub reason: AbortReason,
    pub detail: String,
}

impl Abort {
    /// The error the receiving call fails with.
    pub fn error(&self, what: &str) -> Error {
        Error::Aborted { what: what.to_owned(), rank: self.rank, reason: self.reason, detail: self.detail.clone() }
    }
}

/// The members of one call an abort may come from, with their addresses.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    pub job_id: u32,
    /// The call's first op id (call * 4).
    pub call_op: u32,
    pub ranks: Vec<(u16, SocketAddrV4)>,
}

/// What an abort datagram turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// For this call, from a member of it.
    Abort(Abort),
    /// For one of the next calls, which this member has not reached yet
    /// (it is still in an earlier one): kept until it gets there.
    Ahead { call_op: u32, abort: Abort },
    /// Well formed, for another call (an earlier one this member finished).
    Stale,
    /// From an address that is not the named rank's, another job, or an
    /// unreadable payload: counted and ignored.
    Bad,
}

/// How far ahead (in op ids: 8 calls) an abort is kept for a call this
/// member has not started yet: the one that found the problem may be a
/// call or two ahead of a slow member.
const AHEAD_OPS: u32 = 8 * 4;

/// The call's first op id of an op id (op ids are call * 4 + k).
pub fn call_op(op_id: u32) -> u32 {
    op_id & !3
}

impl Peers {
    /// The members of a call with contributors `base + i` (bit i of
    /// `mask`) and aggregator or root `agg`, except `me`.
    pub fn of(group: &Group, op_id: u32, base: u16, mask: u64, agg: u16, me: u16) -> Peers {
        let in_call = |r: u16| r == agg || (r >= base && r - base < 64 && mask >> (r - base) & 1 != 0);
        let ranks = group
            .members
            .iter()
            .filter(|m| m.rank != me && in_call(m.rank))
            .map(|m| (m.rank, SocketAddrV4::new(m.addr, m.port)))
            .collect();
        Peers { job_id: group.job_id, call_op: call_op(op_id), ranks }
    }

    /// Checks an abort datagram against this call.
    pub fn receive(&self, h: &Header, payload: &[u8], from: SocketAddrV4) -> Received {
        let known = self.ranks.iter().any(|&(r, a)| r == h.src_rank && a == from);
        let Some((reason, detail)) = parse(payload) else { return Received::Bad };
        if h.msg_type != T_AGG_ABORT || h.job_id != self.job_id || !known {
            return Received::Bad;
        }
        let abort = Abort { rank: h.src_rank, reason, detail };
        let ahead = call_op(h.msg_seq).wrapping_sub(self.call_op);
        match ahead {
            0 => Received::Abort(abort),
            1..=AHEAD_OPS => Received::Ahead { call_op: call_op(h.msg_seq), abort },
            _ => Received::Stale,
        }
    }

    /// The abort of this call from `me` (see [`datagram`]).
    pub fn abort_datagram(&self, me: u16, base: u16, mask: u64, reason: AbortReason, detail: &str) -> Vec<u8> {
        datagram(self.job_id, me, base, mask, self.call_op, reason, detail)
    }

    /// Sends abort datagram `d` to every peer (one sendmmsg).
    pub fn send(&self, sock: &BatchSocket, d: &[u8]) -> Result<()> {
        let dgrams: Vec<Datagram<'_>> = self.ranks.iter().map(|&(_, to)| Datagram { to, head: d, body: &[] }).collect();
        sock.send_all(&dgrams).map(|_| ())
    }
}

/// The whole abort datagram (header, reason, text) of call `call_op` from
/// rank `me` to the call's contributors `base + i` (bit i of `mask`).
pub fn datagram(
    job_id: u32,
    me: u16,
    base: u16,
    mask: u64,
    call_op: u32,
    reason: AbortReason,
    detail: &str,
) -> Vec<u8> {
    let body = payload(reason, detail);
    let h = Header {
        version: VERSION,
        msg_type: T_AGG_ABORT,
        flags: F_LAST_FRAG,
        job_id,
        src_rank: me,
        mask_base: base,
        dst_mask: mask,
        msg_seq: call_op,
        frag_off: 0,
        msg_len: body.len() as u32,
        payload_len: body.len() as u16,
        agg_op: 0,
        dtype: 0,
    };
    let mut head = [0u8; HDR_LEN];
    h.encode(&mut head);
    let mut d = head.to_vec();
    d.extend_from_slice(&body);
    d
}

/// The payload of an abort: the reason byte, then `detail` cut to
/// AGG_ABORT_MAX_TEXT bytes at a character boundary.
pub fn payload(reason: AbortReason, detail: &str) -> Vec<u8> {
    let mut end = detail.len().min(AGG_ABORT_MAX_TEXT);
    while !detail.is_char_boundary(end) {
        end -= 1;
    }
    let mut p = Vec::with_capacity(1 + end);
    p.push(reason as u8);
    p.extend_from_slice(&detail.as_bytes()[..end]);
    p
}

/// Reason and text of an abort payload; None if it is not one.
pub fn parse(p: &[u8]) -> Option<(AbortReason, String)> {
    let (&code, text) = p.split_first()?;
    if text.len() > AGG_ABORT_MAX_TEXT {
        return None;
    }
    Some((AbortReason::from_wire(code)?, std::str::from_utf8(text).ok()?.to_owned()))
}

/// The reason to abort a call with, for errors a member finds in its own
/// part of the call (None: an error the other members see themselves, or a
/// local one such as a timeout, which is not announced).
pub fn reason_of(e: &Error) -> Option<AbortReason> {
    match e {
        Error::NonFinite { .. } => Some(AbortReason::NonFinite),
        Error::Overflow { .. } => Some(AbortReason::Overflow),
        Error::Mismatch { .. } => Some(AbortReason::Mismatch),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn group() -> Group {
        let members = (0..4u8)
            .map(|r| crate::group::Member {
                rank: r.into(),
                addr: Ipv4Addr::new(10, 0, 0, r + 1),
                port: 47000,
                iface: "eth0".into(),
                netns: None,
            })
            .collect();
        Group::new("t", 9, members)
    }

    fn header(src: u16, op: u32, job: u32) -> Header {
        Header {
            version: VERSION,
            msg_type: T_AGG_ABORT,
            flags: F_LAST_FRAG,
            job_id: job,
            src_rank: src,
            mask_base: 0,
            dst_mask: 0b111,
            msg_seq: op,
            frag_off: 0,
            msg_len: 0,
            payload_len: 0,
            agg_op: 0,
            dtype: 0,
        }
    }

    #[test]
    fn accepted_only_from_the_named_members_address_for_the_current_call() {
        // Call 2 (op ids 8..11) of contributors 0..2, aggregator 3, seen by rank 0.
        let peers = Peers::of(&group(), 9, 0, 0b111, 3, 0);
        assert_eq!(peers.ranks.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2, 3]);
        let from = |r: u8| SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, r + 1), 47000);
        let p = payload(AbortReason::NonFinite, "element 17 is NaN");
        let want = Abort { rank: 1, reason: AbortReason::NonFinite, detail: "element 17 is NaN".into() };
        assert_eq!(peers.receive(&header(1, 8, 9), &p, from(1)), Received::Abort(want.clone()));
        assert_eq!(peers.receive(&header(1, 11, 9), &p, from(1)), Received::Abort(want), "any op of the call");
        assert_eq!(peers.receive(&header(1, 4, 9), &p, from(1)), Received::Stale, "an earlier call");
        let later = Abort { rank: 1, reason: AbortReason::NonFinite, detail: "element 17 is NaN".into() };
        assert_eq!(
            peers.receive(&header(1, 13, 9), &p, from(1)),
            Received::Ahead { call_op: 12, abort: later },
            "the next call, which rank 0 has not started"
        );
        assert_eq!(peers.receive(&header(1, 8 + 33 * 4, 9), &p, from(1)), Received::Stale, "too far ahead");
        assert_eq!(peers.receive(&header(1, 8, 9), &p, from(2)), Received::Bad, "rank 2's address naming rank 1");
        assert_eq!(peers.receive(&header(1, 8, 7), &p, from(1)), Received::Bad, "another job");
        assert_eq!(peers.receive(&header(0, 8, 9), &p, from(0)), Received::Bad, "itself: not a peer");
        assert_eq!(peers.receive(&header(1, 8, 9), &[9, b'x'], from(1)), Received::Bad, "unknown reason");
        assert_eq!(peers.receive(&header(1, 8, 9), &[], from(1)), Received::Bad, "empty payload");
    }

    #[test]
    fn payload_is_cut_at_a_character_boundary() {
        let long = "é".repeat(AGG_ABORT_MAX_TEXT);
        let p = payload(AbortReason::Overflow, &long);
        assert!(p.len() <= 1 + AGG_ABORT_MAX_TEXT);
        let (r, text) = parse(&p).expect("parses");
        assert_eq!(r, AbortReason::Overflow);
        assert!(long.starts_with(&text) && !text.is_empty());
        assert_eq!(parse(&[AbortReason::Mismatch as u8, 0xff]), None, "not UTF-8");
    }
}
