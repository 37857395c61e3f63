//! Broadcast reliability state, free of sockets so it can be unit-tested:
//! packet bitmaps, the receiver's per-message reassembly with its
//! acknowledgment decisions, and the sender's per-receiver view built from
//! acknowledgments.  The protocol is described in docs/BROADCAST.md and in
//! bpf/include/kccl_wire.h (struct kccl_bcast_ack).

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::wire::{BcastAck, ACK_COMPLETE, ACK_GAP, ACK_MAX_BITS};

/// Reliability settings of a broadcast sender and receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Reliability {
    /// Sender: wait for every receiver's confirmation and repair losses;
    /// receiver: send acknowledgments.  Off = fire-and-forget (a plain UDP
    /// receiver that never acknowledges, or a baseline measurement).
    pub enabled: bool,
    /// Receiver: acknowledge cumulatively every `ack_group` packets (the
    /// paper's group ACK, 1024); also the size of a gap report's bitmap.
    pub ack_group: u32,
    /// Receiver: acknowledge every packet (bitmap of that one packet).
    pub per_packet: bool,
    /// Receiver: how long a gap (a missing packet below a held one, or no
    /// new packet of an incomplete message) persists before it reports it.
    pub nak_delay: Duration,
    /// Sender: a receiver heard from neither since this long after the last
    /// packet sent to it gets a probe (the first packet it has not
    /// confirmed); doubled on every consecutive timeout up to `rto_max`.
    pub rto: Duration,
    pub rto_max: Duration,
    /// Sender: broadcast() fails after this long with the receivers that
    /// did not confirm.
    pub deadline: Duration,
}

impl Default for Reliability {
    fn default() -> Self {
        Reliability {
            enabled: true,
            ack_group: 1024,
            per_packet: false,
            nak_delay: Duration::from_millis(2),
            rto: Duration::from_millis(20),
            rto_max: Duration::from_millis(320),
            deadline: Duration::from_secs(10),
        }
    }
}

impl Reliability {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(format!("broadcast reliability: {m}")));
        if self.ack_group == 0 || self.ack_group as usize > ACK_MAX_BITS {
            return bad(format!("ack group {} must be 1..={ACK_MAX_BITS} packets", self.ack_group));
        }
        if self.nak_delay.is_zero() || self.rto.is_zero() || self.deadline.is_zero() {
            return bad("nak delay, retransmission timeout and deadline must be positive".into());
        }
        if self.rto_max < self.rto {
            return bad(format!("rto_max {:?} is below rto {:?}", self.rto_max, self.rto));
        }
        Ok(())
    }
}

/// A set of packet indices `0..len`.
#[derive(Debug, Clone, Default)]
pub struct Bits {
    words: Vec<u64>,
    len: u32,
    count: u32,
}

impl Bits {
    pub fn new(len: u32) -> Bits {
        Bits { words: vec![0; (len as usize).div_ceil(64)], len, count: 0 }
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    pub fn is_full(&self) -> bool {
        self.count == self.len
    }

    pub fn get(&self, i: u32) -> bool {
        i < self.len && self.words[i as usize / 64] & (1 << (i % 64)) != 0
    }

    /// Sets bit i; true if it was clear.
    pub fn set(&mut self, i: u32) -> bool {
        if i >= self.len || self.get(i) {
            return false;
        }
        self.words[i as usize / 64] |= 1 << (i % 64);
        self.count += 1;
        true
    }

    /// Sets every bit below `end`.
    pub fn set_below(&mut self, end: u32) {
        let end = end.min(self.len);
        let full = end as usize / 64;
        for w in 0..full {
            if self.words[w] != u64::MAX {
                self.count += self.words[w].count_zeros();
                self.words[w] = u64::MAX;
            }
        }
        for i in full as u32 * 64..end {
            self.set(i);
        }
    }

    /// First clear bit at or after `from`.
    pub fn first_clear(&self, from: u32) -> Option<u32> {
        let mut i = from;
        while i < self.len {
            let w = self.words[i as usize / 64] | ((1u64 << (i % 64)) - 1);
            if w != u64::MAX {
                let b = (i / 64) * 64 + w.trailing_ones();
                return (b < self.len).then_some(b);
            }
            i = (i / 64 + 1) * 64;
        }
        None
    }

    /// Bitmap bytes of `[first, first + bits)` (bit i LSB-first).
    pub fn bitmap(&self, first: u32, bits: u32) -> Vec<u8> {
        let mut out = vec![0u8; bits as usize / 8 + usize::from(bits % 8 != 0)];
        for i in 0..bits {
            if self.get(first + i) {
                out[i as usize / 8] |= 1 << (i % 8);
            }
        }
        out
    }
}

/// Outcome of one data fragment at the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frag {
    /// A packet not held before (index, when the packet size is known).
    New,
    /// Held already (duplicate or retransmission).
    Duplicate,
    /// Inconsistent with the message's other fragments (size or offset).
    Invalid,
}

/// The receiver's view of one incomplete message: which packets it holds,
/// where the bytes go, and when it acknowledges.
#[derive(Debug)]
pub struct Assembly {
    pub buf: Vec<u8>,
    /// Message bytes per packet (payload_len of every fragment but the
    /// last); 0 until a fragment other than the last arrived.
    pkt: u32,
    held: Bits,
    /// Every packet below `cum` is held.
    cum: u32,
    /// Highest held packet index + 1.
    top: u32,
    /// The last fragment (offset, length) held before the packet size was
    /// known: it only becomes a numbered packet once `pkt` is.
    early_last: Option<(u32, u32)>,
    /// `cum` at the last cumulative acknowledgment sent.
    acked_cum: u32,
    last_arrival: Instant,
    /// Since when a packet below `top` is missing (cleared by progress of cum).
    gap_since: Option<Instant>,
    last_report: Option<Instant>,
    /// Gap reports sent since the last new packet (bounded: a sender that
    /// gave up must not be reported to forever).
    reports_idle: u32,
}

/// A hole below a held packet is reported after `nak_delay`; missing packets
/// above the highest held one only after `TAIL_FACTOR * nak_delay` without
/// any new packet: a sender (or this receiver's thread) that is merely slow
/// must not be asked to re-send the rest of a large message.
pub const TAIL_FACTOR: u32 = 8;

/// Gap reports a receiver sends for one message without receiving anything
/// new before it gives up reporting it (it stays buffered until evicted).
pub const MAX_IDLE_REPORTS: u32 = 64;

/// Largest number of gap reports (one per group with holes) per round.
pub const MAX_REPORTS_PER_ROUND: usize = 64;

impl Assembly {
    pub fn new(msg_len: u32, now: Instant) -> Assembly {
        Assembly {
            buf: vec![0u8; msg_len as usize],
            pkt: 0,
            held: Bits::new(0),
            cum: 0,
            top: 0,
            early_last: None,
            acked_cum: 0,
            last_arrival: now,
            gap_since: None,
            last_report: None,
            reports_idle: 0,
        }
    }

    pub fn msg_len(&self) -> u32 {
        self.buf.len() as u32
    }

    /// Packets of the message, once known.
    pub fn npkts(&self) -> Option<u32> {
        (self.pkt != 0).then_some(self.held.len())
    }

    pub fn pkt_bytes(&self) -> u32 {
        self.pkt
    }

    pub fn cum(&self) -> u32 {
        self.cum
    }

    pub fn is_complete(&self) -> bool {
        self.pkt != 0 && self.held.is_full()
    }

    /// Bytes held (for diagnostics).
    pub fn bytes_held(&self) -> usize {
        let full = self.held.count() as usize * self.pkt as usize;
        let last_short = if self.pkt != 0 && self.held.get(self.held.len() - 1) {
            self.pkt as usize - (self.msg_len() as usize - (self.held.len() as usize - 1) * self.pkt as usize)
        } else {
            0
        };
        (full - last_short) + self.early_last.map_or(0, |(_, l)| l as usize)
    }

    /// Takes the fragment at byte `off` (the caller checked that it lies
    /// inside the message and that the message length matches).
    pub fn ingest(&mut self, off: u32, data: &[u8], now: Instant) -> Frag {
        let len = data.len() as u32;
        let msg_len = self.msg_len();
        let last = off as u64 + len as u64 == msg_len as u64;
        if len == 0 {
            return Frag::Invalid; // only an empty message has an empty fragment
        }
        if self.pkt == 0 {
            if last {
                // Size unknown: hold the bytes, number the packet later.
                return match self.early_last {
                    Some((o, _)) if o == off => Frag::Duplicate,
                    Some(_) => Frag::Invalid,
                    None => {
                        self.early_last = Some((off, len));
                        self.buf[off as usize..].copy_from_slice(data);
                        self.arrival(now, None);
                        Frag::New
                    }
                };
            }
            if off % len != 0 {
                return Frag::Invalid;
            }
            let n = msg_len.div_ceil(len);
            if let Some((o, l)) = self.early_last {
                // The early last fragment must be packet n - 1 of this size.
                if o % len != 0 || o / len != n - 1 || l > len {
                    return Frag::Invalid;
                }
            }
            self.pkt = len;
            self.held = Bits::new(n);
            if let Some((o, _)) = self.early_last.take() {
                self.held.set(o / len);
                self.top = o / len + 1;
            }
        }
        let p = self.pkt;
        let n = self.held.len();
        let ok = off % p == 0 && if last { off / p == n - 1 && len <= p } else { len == p };
        if !ok {
            return Frag::Invalid;
        }
        let i = off / p;
        if !self.held.set(i) {
            return Frag::Duplicate;
        }
        self.buf[off as usize..(off + len) as usize].copy_from_slice(data);
        self.arrival(now, Some(i));
        Frag::New
    }

    /// Packet `idx` (None: not numbered yet) arrived new.
    fn arrival(&mut self, now: Instant, idx: Option<u32>) {
        self.last_arrival = now;
        self.reports_idle = 0;
        let Some(i) = idx else { return };
        let before = self.cum;
        self.cum = self.held.first_clear(self.cum).unwrap_or(self.held.len());
        self.top = self.top.max(i + 1);
        if self.cum >= self.top {
            self.gap_since = None;
        } else if self.cum != before || self.gap_since.is_none() {
            self.gap_since = Some(now);
        }
    }

    fn ack(&self, flags: u16, bm_first: u32, bm_bits: u32) -> BcastAck {
        BcastAck {
            pkt_bytes: self.pkt,
            npkts: self.npkts().unwrap_or(0),
            cum: self.cum,
            bm_first,
            bm_bits: bm_bits as u16,
            flags,
            bitmap: self.held.bitmap(bm_first, bm_bits),
        }
    }

    /// The acknowledgment owed right after packet `off` arrived new, if any:
    /// per-packet mode acknowledges it; group mode acknowledges when `cum`
    /// crosses a multiple of the group size.  (Completion is acknowledged by
    /// the caller with [`complete_ack`].)
    pub fn ack_after(&mut self, off: u32, cfg: &Reliability) -> Option<BcastAck> {
        if self.pkt == 0 {
            return None;
        }
        if cfg.per_packet {
            self.acked_cum = self.cum;
            return Some(self.ack(0, off / self.pkt, 1));
        }
        let g = cfg.ack_group;
        if self.cum / g > self.acked_cum / g {
            self.acked_cum = self.cum;
            return Some(self.ack(0, 0, 0));
        }
        None
    }

    /// When [`gap_reports`] has something to say next (None: nothing pending).
    pub fn next_report(&self, cfg: &Reliability) -> Option<Instant> {
        if self.reports_idle >= MAX_IDLE_REPORTS {
            return None;
        }
        let idle = self.last_arrival + cfg.nak_delay * TAIL_FACTOR;
        let due = match self.gap_since {
            Some(g) => (g + cfg.nak_delay).min(idle),
            None => idle,
        };
        Some(match self.last_report {
            Some(r) => due.max(r + cfg.nak_delay),
            None => due,
        })
    }

    /// Gap reports due at `now`: one ACK_GAP per group (of `ack_group`
    /// packets, aligned) that misses packets, whose bitmap says exactly which
    /// of its packets are held.  Up to the highest held packet while packets
    /// keep arriving, up to the end once nothing arrived for `nak_delay`.
    pub fn gap_reports(&mut self, now: Instant, cfg: &Reliability) -> Vec<BcastAck> {
        match self.next_report(cfg) {
            Some(t) if t <= now => {}
            _ => return Vec::new(),
        }
        self.last_report = Some(now);
        self.reports_idle += 1;
        if self.pkt == 0 {
            // Only the last fragment (or nothing numbered): everything is missing.
            return vec![self.ack(ACK_GAP, 0, 0)];
        }
        let n = self.held.len();
        let idle = now >= self.last_arrival + cfg.nak_delay * TAIL_FACTOR;
        let limit = if idle { n } else { self.top };
        let g = cfg.ack_group.min(ACK_MAX_BITS as u32);
        let mut out = Vec::new();
        let mut at = self.cum;
        while let Some(miss) = self.held.first_clear(at) {
            if miss >= limit || out.len() >= MAX_REPORTS_PER_ROUND {
                break;
            }
            // The bitmap ends at `limit`: packets above the highest held one
            // may simply not have arrived yet, and every clear bit of a report
            // is re-sent.
            let first = miss / g * g;
            let bits = g.min(limit - first);
            out.push(self.ack(ACK_GAP, first, bits));
            at = first + bits;
        }
        out
    }

    /// The acknowledgment of a completed message.
    pub fn complete_ack(&self) -> BcastAck {
        complete_ack(self.pkt, self.npkts().unwrap_or(1))
    }

    /// What is missing, for a timeout message.
    pub fn describe(&self) -> String {
        match self.npkts() {
            Some(n) => format!("{}/{} packets (all below {} held)", self.held.count(), n, self.cum),
            None => format!("{}/{} bytes", self.bytes_held(), self.msg_len()),
        }
    }
}

/// COMPLETE acknowledgment of a message of `npkts` packets of `pkt` bytes.
pub fn complete_ack(pkt: u32, npkts: u32) -> BcastAck {
    BcastAck { pkt_bytes: pkt, npkts, cum: npkts, flags: ACK_COMPLETE, ..Default::default() }
}

/// Why the sender ignored an acknowledgment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckReject {
    /// Numbers that do not fit the message (packet count, size, range).
    Invalid,
}

/// The sender's view of one receiver during one message.
#[derive(Debug)]
pub struct Peer {
    pub rank: u16,
    /// Packets the receiver confirmed.
    pub held: Bits,
    /// When every packet was last sent to it as a whole (the first
    /// transmission): the re-send holdoff of a packet runs from here until
    /// it is re-sent individually.
    sent_all: Instant,
    pub complete: bool,
    /// Last valid ACK or last packet sent to it: the probe timer runs from
    /// the later of the two.
    pub last_event: Instant,
    pub rto: Duration,
    /// When a packet was last re-sent to it (not re-sent again before
    /// `holdoff`, so a report that crossed the retransmission in flight
    /// does not double it).
    /// Per packet: when it was last re-sent and how often.  Each re-send of
    /// the same packet doubles its holdoff (up to 16x): a receiver whose
    /// socket queue is long keeps reporting a hole whose repair is queued.
    retx_at: std::collections::HashMap<u32, (Instant, u32)>,
    /// Copies re-sent to it since `budget_start` (at most REPAIR_BURST per
    /// holdoff: a receiver that lost much because it was overrun is not
    /// overrun again by the repair).
    budget_start: Instant,
    budget_used: u32,
    pub acks: u64,
}

/// Packets re-sent to one receiver per holdoff interval at most (the rest
/// follow its next gap reports).
pub const REPAIR_BURST: u32 = 512;

impl Peer {
    pub fn new(rank: u16, npkts: u32, now: Instant, rto: Duration) -> Peer {
        Peer {
            rank,
            held: Bits::new(npkts),
            sent_all: now,
            complete: false,
            last_event: now,
            rto,
            retx_at: Default::default(),
            budget_start: now,
            budget_used: 0,
            acks: 0,
        }
    }

    /// Applies an ACK for this message (`npkts` packets of `pkt` bytes);
    /// returns the packets to re-send to this receiver now (gap reports).
    pub fn apply(
        &mut self,
        a: &BcastAck,
        pkt: u32,
        now: Instant,
        cfg: &Reliability,
        holdoff: Duration,
    ) -> std::result::Result<Vec<u32>, AckReject> {
        let n = self.held.len();
        let end = a.bm_first as u64 + a.bm_bits as u64;
        let known = a.pkt_bytes != 0;
        if a.cum > n
            || end > n as u64
            || (known && n > 1 && (a.pkt_bytes != pkt || a.npkts != n))
            || (!known && a.npkts != 0 && a.npkts != n)
            || (a.flags & ACK_COMPLETE != 0 && a.cum != n)
            || (a.flags & ACK_GAP != 0 && a.bm_bits != 0 && !known)
        {
            return Err(AckReject::Invalid);
        }
        self.acks += 1;
        self.last_event = now;
        self.rto = cfg.rto;
        self.held.set_below(a.cum);
        for i in 0..a.bm_bits as u32 {
            if a.bit(i as usize) {
                self.held.set(a.bm_first + i);
            }
        }
        if a.flags & ACK_COMPLETE != 0 || self.held.is_full() {
            self.complete = true;
            self.held.set_below(n);
            self.retx_at.clear();
            return Ok(Vec::new());
        }
        if a.flags & ACK_GAP == 0 {
            return Ok(Vec::new());
        }
        let (from, to) = if a.bm_bits == 0 { (a.cum, n) } else { (a.bm_first, end as u32) };
        if now >= self.budget_start + holdoff {
            self.budget_start = now;
            self.budget_used = 0;
        }
        let mut out = Vec::new();
        let mut at = from;
        while let Some(i) = self.held.first_clear(at) {
            if i >= to || self.budget_used >= REPAIR_BURST {
                break;
            }
            at = i + 1;
            let (last_sent, times) = self.retx_at.get(&i).copied().unwrap_or((self.sent_all, 0));
            if now < last_sent + holdoff * (1 << times.min(4)) {
                continue; // possibly still in flight (or the report predates it)
            }
            self.retx_at.insert(i, (now, times + 1));
            self.budget_used += 1;
            out.push(i);
        }
        Ok(out)
    }

    /// When the probe timer fires (None once complete).
    pub fn next_probe(&self) -> Option<Instant> {
        (!self.complete).then(|| self.last_event + self.rto)
    }

    /// The probe timer fired: the first packet the receiver has not
    /// confirmed is re-sent (the receiver then reports its gaps, or
    /// re-acknowledges a message it completed); the timer backs off.
    pub fn probe(&mut self, now: Instant, cfg: &Reliability) -> Option<u32> {
        if self.complete {
            return None;
        }
        self.rto = (self.rto * 2).min(cfg.rto_max);
        self.last_event = now;
        let i = self.held.first_clear(0)?;
        let times = self.retx_at.get(&i).map_or(0, |x| x.1);
        self.retx_at.insert(i, (now, times + 1));
        Some(i)
    }

    /// A packet was sent to this receiver (initial send or retransmission).
    pub fn sent(&mut self, now: Instant) {
        self.last_event = self.last_event.max(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(group: u32) -> Reliability {
        Reliability { ack_group: group, ..Default::default() }
    }

    #[test]
    fn bits_set_count_first_clear() {
        let mut b = Bits::new(130);
        assert_eq!(b.first_clear(0), Some(0));
        b.set_below(70);
        assert_eq!(b.count(), 70);
        assert_eq!(b.first_clear(0), Some(70));
        assert!(b.set(71));
        assert!(!b.set(71), "second set is not new");
        assert!(!b.set(130), "out of range");
        assert_eq!(b.first_clear(71), Some(72));
        b.set_below(130);
        assert!(b.is_full());
        assert_eq!(b.first_clear(0), None);
        assert_eq!(b.count(), 130);
        let mut c = Bits::new(10);
        c.set(0);
        c.set(2);
        c.set(9);
        assert_eq!(c.bitmap(0, 10), vec![0b0000_0101, 0b0000_0010]);
        assert_eq!(c.bitmap(2, 3), vec![0b001]);
    }

    /// 10 packets of 100 bytes + 1 of 50: in order, one group ACK at 4 and
    /// 8 (group 4), complete at the end; bytes placed.
    #[test]
    fn assembly_in_order_group_acks() {
        let t = Instant::now();
        let c = cfg(4);
        let msg: Vec<u8> = (0..1050u32).map(|i| i as u8).collect();
        let mut a = Assembly::new(1050, t);
        let mut acks = Vec::new();
        for i in 0..11u32 {
            let off = i * 100;
            let end = (off + 100).min(1050);
            assert_eq!(a.ingest(off, &msg[off as usize..end as usize], t), Frag::New);
            if let Some(k) = a.ack_after(off, &c) {
                acks.push(k.cum);
            }
        }
        assert_eq!(acks, vec![4, 8]);
        assert!(a.is_complete());
        assert_eq!(a.buf, msg);
        assert_eq!(a.complete_ack().cum, 11);
        assert_eq!(a.complete_ack().flags, ACK_COMPLETE);
        assert_eq!(a.ingest(300, &msg[300..400], t), Frag::Duplicate);
    }

    #[test]
    fn assembly_rejects_inconsistent_fragments() {
        let t = Instant::now();
        let mut a = Assembly::new(1000, t);
        assert_eq!(a.ingest(0, &[0; 300], t), Frag::New);
        assert_eq!(a.ingest(300, &[0; 200], t), Frag::Invalid, "non-last fragment of another size");
        assert_eq!(a.ingest(150, &[0; 300], t), Frag::Invalid, "offset not a multiple");
        assert_eq!(a.ingest(600, &[0; 400], t), Frag::Invalid, "last fragment longer than a packet");
        assert_eq!(a.ingest(900, &[0; 100], t), Frag::New);
        // Last fragment first, then a packet size it does not fit.
        let mut b = Assembly::new(1000, t);
        assert_eq!(b.ingest(900, &[1; 100], t), Frag::New);
        assert_eq!(b.npkts(), None);
        assert_eq!(b.ingest(900, &[1; 100], t), Frag::Duplicate);
        assert_eq!(b.ingest(0, &[1; 400], t), Frag::Invalid, "900 is not a multiple of 400");
        assert_eq!(b.ingest(0, &[1; 300], t), Frag::New);
        assert_eq!(b.npkts(), Some(4));
        assert_eq!(b.cum(), 1);
        assert_eq!(b.ingest(300, &[1; 300], t), Frag::New);
        assert_eq!(b.ingest(600, &[1; 300], t), Frag::New);
        assert!(b.is_complete(), "the early last fragment counts once numbered");
    }

    /// Gaps: packets 0..10 of 20 minus 3 and 7 held, then silence: the
    /// report of group [0, 8) names exactly 3 and 7 as missing, group
    /// [8, 16) is reported (10..16 missing) and [16, 20) too.
    #[test]
    fn gap_reports_name_exactly_the_missing_packets() {
        let t = Instant::now();
        let c = cfg(8);
        let mut a = Assembly::new(2000, t);
        for i in (0..10u32).filter(|i| *i != 3 && *i != 7) {
            a.ingest(i * 100, &[7; 100], t);
        }
        assert!(a.gap_reports(t, &c).is_empty(), "not before nak_delay");
        // While packets flow, only up to the highest held packet.
        let soon = t + c.nak_delay / 2;
        a.ingest(1000, &[7; 100], soon);
        let r = a.gap_reports(t + c.nak_delay, &c);
        assert_eq!(r.len(), 1, "gap below the top persisted: {r:?}");
        assert_eq!((r[0].bm_first, r[0].bm_bits, r[0].flags, r[0].cum), (0, 8, ACK_GAP, 3));
        assert_eq!(r[0].bitmap, vec![0b0111_0111]);
        // Group [8, 16) holds 8, 9, 10 and nothing above: not reported while
        // packets flow (11.. may still be on their way).
        assert!(a.gap_reports(t + c.nak_delay, &c).is_empty(), "one report per nak_delay");
        // Idle (no new packet for TAIL_FACTOR x nak_delay): every group with
        // a hole, up to the end.
        let r = a.gap_reports(soon + c.nak_delay * TAIL_FACTOR, &c);
        let ranges: Vec<(u32, u16)> = r.iter().map(|k| (k.bm_first, k.bm_bits)).collect();
        assert_eq!(ranges, vec![(0, 8), (8, 8), (16, 4)]);
        assert_eq!(r[1].bitmap, vec![0b0000_0111]);
        assert_eq!(r[2].bitmap, vec![0]);
        // The sender side turns that into exactly the missing packets.
        let hold = Duration::from_millis(5);
        let mut p = Peer::new(1, 20, t, c.rto);
        // Within the holdoff of the first transmission: maybe in flight.
        assert!(p.apply(&r[0], 100, t + hold / 2, &c, hold).unwrap().is_empty());
        let t1 = t + hold;
        let mut missing = Vec::new();
        for k in &r {
            missing.extend(p.apply(k, 100, t1, &c, hold).expect("valid"));
        }
        let want: Vec<u32> = [3, 7].into_iter().chain(11..20).collect();
        assert_eq!(missing, want);
        // The same report again right away: held off (in flight).
        assert!(p.apply(&r[0], 100, t1, &c, hold).unwrap().is_empty());
        // Re-sent once: the next holdoff is twice as long.
        assert!(p.apply(&r[0], 100, t1 + hold, &c, hold).unwrap().is_empty());
        assert_eq!(p.apply(&r[0], 100, t1 + hold * 2, &c, hold).unwrap(), vec![3, 7]);
    }

    /// A receiver that lost everything gets at most REPAIR_BURST packets per
    /// holdoff, lowest first; the rest after the next report.
    #[test]
    fn repair_is_bounded_per_holdoff() {
        let t = Instant::now();
        let c = cfg(1024);
        let hold = Duration::from_millis(10);
        let mut p = Peer::new(1, 3000, t, c.rto);
        let all_missing = BcastAck { pkt_bytes: 100, npkts: 3000, flags: ACK_GAP, ..Default::default() };
        let first = p.apply(&all_missing, 100, t + hold, &c, hold).unwrap();
        assert_eq!(first, (0..REPAIR_BURST).collect::<Vec<u32>>());
        assert!(p.apply(&all_missing, 100, t + hold, &c, hold).unwrap().is_empty(), "budget spent");
        // One holdoff later: a new budget (the first ones, still unconfirmed,
        // are due again: lowest first).
        let next = p.apply(&all_missing, 100, t + hold * 2, &c, hold).unwrap();
        assert_eq!(next.len(), REPAIR_BURST as usize);
    }

    /// A hole in the group that holds the highest packet: the report's
    /// bitmap ends at that packet, so nothing not yet arrived is re-sent.
    #[test]
    fn flowing_report_ends_at_the_highest_held_packet() {
        let t = Instant::now();
        let c = cfg(8);
        let mut a = Assembly::new(2000, t);
        for i in (0..12u32).filter(|i| *i != 9) {
            a.ingest(i * 100, &[1; 100], t);
        }
        let r = a.gap_reports(t + c.nak_delay, &c);
        let ranges: Vec<(u32, u16)> = r.iter().map(|k| (k.bm_first, k.bm_bits)).collect();
        assert_eq!(ranges, vec![(8, 4)], "bits 8..12 only");
        let mut p = Peer::new(1, 20, t, c.rto);
        assert_eq!(p.apply(&r[0], 100, t + c.rto, &c, Duration::ZERO).unwrap(), vec![9]);
    }

    #[test]
    fn idle_reports_stop_after_a_bound() {
        let t = Instant::now();
        let c = cfg(8);
        let mut a = Assembly::new(500, t);
        a.ingest(0, &[0; 100], t);
        let mut now = t;
        let mut sent = 0;
        for _ in 0..1000 {
            now += c.nak_delay * TAIL_FACTOR;
            sent += a.gap_reports(now, &c).len();
        }
        assert_eq!(sent, MAX_IDLE_REPORTS as usize);
        assert_eq!(a.next_report(&c), None);
        a.ingest(100, &[0; 100], now);
        assert!(a.next_report(&c).is_some(), "a new packet revives reporting");
    }

    #[test]
    fn only_last_fragment_reports_everything_missing() {
        let t = Instant::now();
        let c = cfg(8);
        let mut a = Assembly::new(250, t);
        a.ingest(200, &[0; 50], t);
        assert!(a.gap_reports(t + c.nak_delay, &c).is_empty(), "the tail waits longer");
        let r = a.gap_reports(t + c.nak_delay * TAIL_FACTOR, &c);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].pkt_bytes, r[0].bm_bits, r[0].cum, r[0].flags), (0, 0, 0, ACK_GAP));
        let mut p = Peer::new(2, 3, t, c.rto);
        assert_eq!(p.apply(&r[0], 100, t, &c, Duration::ZERO).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn per_packet_mode_acks_every_packet() {
        let t = Instant::now();
        let c = Reliability { per_packet: true, ..cfg(1024) };
        let mut a = Assembly::new(250, t);
        let mut p = Peer::new(1, 3, t, c.rto);
        for off in [200u32, 0, 100] {
            let len = if off == 200 { 50 } else { 100 };
            assert_eq!(a.ingest(off, &vec![0; len], t), Frag::New);
            if let Some(k) = a.ack_after(off, &c) {
                assert_eq!((k.bm_first, k.bm_bits), (off / 100, 1));
                assert!(p.apply(&k, 100, t, &c, Duration::ZERO).unwrap().is_empty());
            }
        }
        // The last fragment came first (size unknown): its ACK is implied by
        // the cumulative count of the later ones.
        assert!(p.held.is_full() && p.complete, "{:?}", p.held);
    }

    #[test]
    fn sender_rejects_acks_that_do_not_fit() {
        let t = Instant::now();
        let c = cfg(8);
        let mut p = Peer::new(1, 10, t, c.rto);
        let ok = BcastAck { pkt_bytes: 100, npkts: 10, cum: 3, ..Default::default() };
        assert!(p.apply(&ok, 100, t, &c, Duration::ZERO).is_ok());
        let bad = [
            BcastAck { cum: 11, ..ok.clone() },
            BcastAck { pkt_bytes: 99, ..ok.clone() },
            BcastAck { npkts: 9, ..ok.clone() },
            BcastAck { flags: ACK_COMPLETE, ..ok.clone() },
            BcastAck { bm_first: 8, bm_bits: 3, bitmap: vec![0, 0], ..ok.clone() },
        ];
        for b in &bad {
            assert_eq!(p.apply(b, 100, t, &c, Duration::ZERO), Err(AckReject::Invalid), "{b:?}");
        }
        assert_eq!(p.acks, 1, "rejected ACKs change nothing");
        assert_eq!(p.held.count(), 3);
        assert!(!p.complete);
    }

    #[test]
    fn probe_backs_off_and_targets_first_unconfirmed() {
        let t = Instant::now();
        let c = cfg(8);
        let mut p = Peer::new(1, 5, t, c.rto);
        assert_eq!(p.next_probe(), Some(t + c.rto));
        let k = BcastAck { pkt_bytes: 100, npkts: 5, cum: 2, ..Default::default() };
        p.apply(&k, 100, t, &c, Duration::ZERO).unwrap();
        assert_eq!(p.probe(t + c.rto, &c), Some(2));
        assert_eq!(p.rto, c.rto * 2);
        for _ in 0..10 {
            p.probe(t, &c);
        }
        assert_eq!(p.rto, c.rto_max);
        let done = BcastAck { cum: 5, flags: ACK_COMPLETE, ..k };
        p.apply(&done, 100, t, &c, Duration::ZERO).unwrap();
        assert_eq!(p.rto, c.rto, "an ACK resets the backoff");
        assert_eq!(p.next_probe(), None);
        assert_eq!(p.probe(t, &c), None);
    }

    #[test]
    fn config_validation() {
        assert!(Reliability::default().validate().is_ok());
        assert!(Reliability { ack_group: 0, ..Default::default() }.validate().is_err());
        assert!(Reliability { ack_group: 8193, ..Default::default() }.validate().is_err());
        assert!(Reliability { deadline: Duration::ZERO, ..Default::default() }.validate().is_err());
        assert!(Reliability { rto_max: Duration::from_millis(1), ..Default::default() }.validate().is_err());
    }
}
