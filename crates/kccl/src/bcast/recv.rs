//! The receiving side of a broadcast: [`Receiver`] reassembles fragments
//! into messages, acknowledges them (per group or per packet, with a gap
//! bitmap), remembers finished messages to drop duplicates, and counts
//! every datagram it drops by reason ([`RecvStats`]).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::transport::sock::{BatchSocket, Datagram, RecvBatch};
use crate::wire::{BcastAck, Header, ACK_GAP, HDR_LEN, MASK_BITS, T_BCAST, T_BCAST_ACK, VERSION};

use super::track::{self, Assembly, Frag, Reliability};
use super::DEFAULT_MAX_RECV_MESSAGE;

/// A reassembled message.
#[derive(Debug, Clone)]
pub struct Message {
    pub src_rank: u16,
    pub seq: u32,
    pub data: Vec<u8>,
    /// When the receiving application had the whole message (CLOCK_MONOTONIC,
    /// comparable across the namespaces of one machine).
    pub completed: Instant,
    /// When the last datagram of it entered the receiving host's stack
    /// (kernel timestamp, CLOCK_REALTIME), if the socket records them.
    pub arrived: Option<SystemTime>,
}

/// What a receiver dropped, by reason: nothing is dropped uncounted.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct RecvStats {
    pub datagrams: u64,
    pub messages: u64,
    /// Not a kccl broadcast datagram, or a fragment inconsistent with the
    /// message's other fragments (size, offset).
    pub malformed: u64,
    pub truncated: u64,
    pub wrong_job: u64,
    /// From a non-member, or a member's rank from another address (forged).
    pub not_member: u64,
    pub not_addressed: u64,
    /// Packets of an incomplete message held already.
    pub duplicates: u64,
    /// Packets of a message already completed and delivered (late
    /// duplicates, retransmissions after completion): never delivered again.
    pub after_complete: u64,
    pub too_large: u64,
    pub evicted: u64,
    /// Acknowledgments sent: all of them, gap reports among them, and
    /// COMPLETE re-sent for messages already completed.
    pub acks_sent: u64,
    pub gap_reports: u64,
    pub reacks: u64,
    /// Acknowledgments the socket refused to send (counted, not fatal).
    pub ack_send_errors: u64,
}

impl RecvStats {
    /// `self - before`, field by field (counters only grow).
    pub fn delta(&self, before: &RecvStats) -> RecvStats {
        RecvStats {
            datagrams: self.datagrams - before.datagrams,
            messages: self.messages - before.messages,
            malformed: self.malformed - before.malformed,
            truncated: self.truncated - before.truncated,
            wrong_job: self.wrong_job - before.wrong_job,
            not_member: self.not_member - before.not_member,
            not_addressed: self.not_addressed - before.not_addressed,
            duplicates: self.duplicates - before.duplicates,
            after_complete: self.after_complete - before.after_complete,
            too_large: self.too_large - before.too_large,
            evicted: self.evicted - before.evicted,
            acks_sent: self.acks_sent - before.acks_sent,
            gap_reports: self.gap_reports - before.gap_reports,
            reacks: self.reacks - before.reacks,
            ack_send_errors: self.ack_send_errors - before.ack_send_errors,
        }
    }

    /// Datagrams dropped as bad input (not duplicates).
    pub fn dropped(&self) -> u64 {
        self.malformed + self.truncated + self.wrong_job + self.not_member + self.not_addressed + self.too_large
    }
}

struct Partial {
    asm: Assembly,
    arrived: Option<SystemTime>,
    /// Where the sender's data comes from: acknowledgments go there.
    reply_to: SocketAddrV4,
}

/// A completed message, remembered to drop late copies and re-acknowledge.
struct DoneMsg {
    pkt: u32,
    npkts: u32,
    msg_len: u32,
    last_reack: Option<Instant>,
}

/// One acknowledgment waiting to be sent (header + payload).
struct OutAck {
    to: SocketAddrV4,
    head: [u8; HDR_LEN],
    body: Vec<u8>,
}

pub struct Receiver {
    job_id: u32,
    me: Member,
    members: HashMap<u16, Member>,
    sock: BatchSocket,
    rb: RecvBatch,
    partial: HashMap<(u16, u32), Partial>,
    done: HashMap<(u16, u32), DoneMsg>,
    done_order: VecDeque<(u16, u32)>,
    ready: VecDeque<Message>,
    stats: RecvStats,
    max_message: usize,
    max_pending: usize,
    rel: Reliability,
    outbox: Vec<OutAck>,
}

/// Datagrams per recvmmsg of a receiver.
const RECV_SLOTS: usize = 64;

/// Completed (sender, seq) pairs remembered to recognise late duplicates.
const DONE_MEMORY: usize = 8192;

/// At most one re-acknowledgment of a completed message per this interval
/// (a burst of retransmissions gets one answer).
const REACK_INTERVAL: Duration = Duration::from_micros(500);

impl Receiver {
    /// Binds rank `rank`'s address and port in the calling thread's namespace.
    pub fn new(group: &Group, rank: u16) -> Result<Receiver> {
        let me = group.member(rank.into())?.clone();
        let sock = BatchSocket::bind(me.addr, me.port, 256 << 20, 1 << 20)?;
        sock.enable_rx_timestamps()?;
        // Slots take the largest UDP datagram: a sender on a larger MTU (lo,
        // jumbo frames) must not be truncated here.  calloc'd pages are only
        // made resident where datagrams land.
        let dgram_max = 65_507;
        Ok(Receiver {
            job_id: group.job_id,
            members: group.members.iter().map(|m| (m.rank, m.clone())).collect(),
            me,
            sock,
            rb: RecvBatch::new(RECV_SLOTS, dgram_max),
            partial: HashMap::new(),
            done: HashMap::new(),
            done_order: VecDeque::new(),
            ready: VecDeque::new(),
            stats: RecvStats::default(),
            max_message: DEFAULT_MAX_RECV_MESSAGE,
            max_pending: 64,
            rel: Reliability::default(),
            outbox: Vec::new(),
        })
    }

    pub fn set_max_message(&mut self, bytes: usize) {
        self.max_message = bytes;
    }

    /// Acknowledgment settings (group size, per-packet mode, gap delay;
    /// `enabled: false` sends no acknowledgments at all).
    pub fn set_reliability(&mut self, cfg: Reliability) -> Result<()> {
        cfg.validate()?;
        self.rel = cfg;
        Ok(())
    }

    pub fn stats(&self) -> RecvStats {
        self.stats
    }

    pub fn local_addr(&self) -> Result<SocketAddrV4> {
        self.sock.local_addr()
    }

    /// Next complete message; Error::Timeout if none completes in `timeout`.
    /// Acknowledgments and gap reports are sent from inside this call, so
    /// a receiver must keep calling it while senders wait for confirmation.
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Message> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(m) = self.ready.pop_front() {
                return Ok(m);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(self.timeout_error(timeout.unwrap_or_default()));
            }
            // Wake for the earliest gap report too.
            let timer = if self.rel.enabled {
                self.partial.values().filter_map(|p| p.asm.next_report(&self.rel)).min()
            } else {
                None
            };
            let wake = match (deadline, timer) {
                (Some(d), Some(t)) => Some(d.min(t)),
                (d, t) => d.or(t),
            };
            let left = wake.map(|w| {
                // poll() takes whole milliseconds: round up, never spin on 0.
                Duration::from_millis(w.saturating_duration_since(now).as_micros().div_ceil(1000).max(1) as u64)
            });
            let n = self.sock.recv_batch(&mut self.rb, left)?;
            let now = Instant::now();
            for i in 0..n {
                self.ingest(i, now);
            }
            if self.rel.enabled {
                // Gaps only once the socket queue is drained (a short batch):
                // while behind, a hole may be a repair still queued here.
                if n < RECV_SLOTS {
                    self.gap_reports(now);
                }
                self.flush_acks();
            }
        }
    }

    fn timeout_error(&self, t: Duration) -> Error {
        let mut what = format!("a complete message on rank {}", self.me.rank);
        for ((src, seq), p) in self.partial.iter().take(4) {
            what += &format!("; message {seq} from rank {src} has {}", p.asm.describe());
        }
        Error::Timeout { ms: t.as_millis() as u64, what }
    }

    fn queue_ack(&mut self, to: SocketAddrV4, sender: u16, seq: u32, msg_len: u32, ack: &BcastAck) {
        let mut body = Vec::with_capacity(ack.encoded_len());
        ack.encode(&mut body);
        let head = Header {
            version: VERSION,
            msg_type: T_BCAST_ACK,
            flags: 0,
            job_id: self.job_id,
            src_rank: self.me.rank,
            mask_base: sender / 64 * 64,
            dst_mask: 1 << (sender % 64),
            msg_seq: seq,
            frag_off: 0,
            msg_len,
            payload_len: body.len() as u16,
            agg_op: 0,
            dtype: 0,
        }
        .to_bytes();
        self.stats.acks_sent += 1;
        if ack.flags & ACK_GAP != 0 {
            self.stats.gap_reports += 1;
        }
        self.outbox.push(OutAck { to, head, body });
    }

    fn flush_acks(&mut self) {
        if self.outbox.is_empty() {
            return;
        }
        let dgrams: Vec<Datagram<'_>> =
            self.outbox.iter().map(|a| Datagram { to: a.to, head: &a.head, body: &a.body }).collect();
        if self.sock.send_all(&dgrams).is_err() {
            self.stats.ack_send_errors += 1;
        }
        self.outbox.clear();
    }

    fn gap_reports(&mut self, now: Instant) {
        let rel = self.rel;
        let mut reports = Vec::new();
        for (&(src, seq), p) in self.partial.iter_mut() {
            for a in p.asm.gap_reports(now, &rel) {
                reports.push((p.reply_to, src, seq, p.asm.msg_len(), a));
            }
        }
        for (to, src, seq, len, a) in reports {
            self.queue_ack(to, src, seq, len, &a);
        }
    }

    fn ingest(&mut self, i: usize, now: Instant) {
        self.stats.datagrams += 1;
        let (dgram, from) = self.rb.get(i);
        let rx_time = self.rb.rx_time(i);
        let Ok(dgram) = dgram else {
            self.stats.truncated += 1;
            return;
        };
        let (h, payload) = match Header::decode(dgram) {
            Ok(x) if x.0.msg_type == T_BCAST => x,
            _ => {
                self.stats.malformed += 1;
                return;
            }
        };
        if h.job_id != self.job_id {
            self.stats.wrong_job += 1;
            return;
        }
        // The sender must be a member and send from its own address.
        match self.members.get(&h.src_rank) {
            Some(m) if *from.ip() == m.addr && m.rank != self.me.rank => {}
            _ => {
                self.stats.not_member += 1;
                return;
            }
        }
        let r = self.me.rank;
        if r < h.mask_base || r - h.mask_base >= MASK_BITS as u16 || h.dst_mask & (1 << (r - h.mask_base)) == 0 {
            self.stats.not_addressed += 1;
            return;
        }
        if h.msg_len as usize > self.max_message {
            self.stats.too_large += 1;
            return;
        }
        let key = (h.src_rank, h.msg_seq);
        if let Some(d) = self.done.get_mut(&key) {
            // Completed and delivered: never again; the sender may have
            // missed the acknowledgment, so it gets it again.
            self.stats.after_complete += 1;
            let due = d.last_reack.is_none_or(|t| now.saturating_duration_since(t) >= REACK_INTERVAL);
            if self.rel.enabled && due && d.msg_len == h.msg_len {
                d.last_reack = Some(now);
                let ack = track::complete_ack(d.pkt, d.npkts);
                self.stats.reacks += 1;
                self.queue_ack(from, key.0, key.1, h.msg_len, &ack);
            }
            return;
        }
        // Fast path: a whole message in one datagram.
        if h.frag_off == 0 && h.payload_len as u32 == h.msg_len && !self.partial.contains_key(&key) {
            self.complete(key, payload.to_vec(), rx_time, (0, 1), from);
            return;
        }
        if !self.partial.contains_key(&key) && self.partial.len() >= self.max_pending {
            // Bound memory: drop the oldest incomplete message (counted).
            if let Some(old) = self.partial.keys().min_by_key(|k| (k.0, k.1)).copied() {
                self.partial.remove(&old);
                self.stats.evicted += 1;
            }
        }
        let p = self.partial.entry(key).or_insert_with(|| Partial {
            asm: Assembly::new(h.msg_len, now),
            arrived: None,
            reply_to: from,
        });
        if p.asm.msg_len() != h.msg_len {
            self.stats.malformed += 1;
            return;
        }
        p.reply_to = from;
        match p.asm.ingest(h.frag_off, payload, now) {
            Frag::Invalid => self.stats.malformed += 1,
            Frag::Duplicate => self.stats.duplicates += 1,
            Frag::New => {
                p.arrived = p.arrived.max(rx_time);
                if p.asm.is_complete() {
                    if let Some(p) = self.partial.remove(&key) {
                        let shape = (p.asm.pkt_bytes(), p.asm.npkts().unwrap_or(1));
                        self.complete(key, p.asm.buf, p.arrived, shape, from);
                    }
                } else if self.rel.enabled {
                    if let Some(a) = p.asm.ack_after(h.frag_off, &self.rel) {
                        let len = p.asm.msg_len();
                        self.queue_ack(from, key.0, key.1, len, &a);
                    }
                }
            }
        }
    }

    /// Delivers a message once; `shape` = (packet bytes, packets).
    fn complete(
        &mut self,
        key: (u16, u32),
        data: Vec<u8>,
        arrived: Option<SystemTime>,
        shape: (u32, u32),
        from: SocketAddrV4,
    ) {
        let msg_len = data.len() as u32;
        self.stats.messages += 1;
        if self.rel.enabled {
            self.queue_ack(from, key.0, key.1, msg_len, &track::complete_ack(shape.0, shape.1));
        }
        self.done.insert(key, DoneMsg { pkt: shape.0, npkts: shape.1, msg_len, last_reack: None });
        self.done_order.push_back(key);
        if self.done_order.len() > DONE_MEMORY {
            if let Some(old) = self.done_order.pop_front() {
                self.done.remove(&old);
            }
        }
        self.ready.push_back(Message { src_rank: key.0, seq: key.1, data, completed: Instant::now(), arrived });
    }
}
