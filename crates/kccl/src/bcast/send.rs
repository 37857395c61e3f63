//! The sending side of a broadcast: [`Broadcaster`] splits a message into
//! fragments, sends them on the kernel path (one FANOUT datagram per 64-rank
//! window, copied by tc_bcast) or the user path (sendmmsg per destination),
//! reads the receivers' ACKs and re-sends only what they miss.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::kernel::{neighbours, BcastFanout, MissEvent, MissReason};
use crate::netns;
use crate::transport::sock::{BatchSocket, Datagram, RecvBatch, MAX_BATCH};
use crate::wire::{
    BcastAck, Header, ACK_GAP, F_FANOUT, F_LAST_FRAG, HDR_LEN, MASK_BITS, T_BCAST, T_BCAST_ACK, VERSION,
};

use super::track::{Peer, Reliability};
use super::MAX_MESSAGE;
use crate::transport::{Path, PathChoice};

#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SenderStats {
    pub messages: u64,
    /// Fragments of all messages (per 64-rank window).
    pub fragments: u64,
    /// Datagrams user space handed to the kernel (first sends, retransmissions
    /// and fallback copies).
    pub datagrams: u64,
    pub syscalls: u64,
    /// Copies user space sent because the kernel fan-out missed a destination.
    pub fallback_copies: u64,
    pub unresolved_misses: u64,
    /// Packet copies re-sent (one per packet per receiver that missed it).
    pub retransmitted: u64,
    /// Datagrams of those retransmissions user space sent (kernel path: one
    /// per packet per 64-rank window, whatever the number of receivers).
    pub retransmit_datagrams: u64,
    /// Valid acknowledgments taken, and of those, gap reports.
    pub acks: u64,
    pub gap_reports: u64,
    /// Probe timer expiries (a receiver silent for the retransmission timeout).
    pub timeouts: u64,
    /// Messages confirmed by every receiver / failed at the deadline.
    pub confirmed: u64,
    pub unconfirmed: u64,
    /// Datagrams on the sender's socket that are not a well-formed ACK.
    pub ack_malformed: u64,
    pub ack_wrong_job: u64,
    /// From a non-member, or a member's rank from another address/port.
    pub ack_not_member: u64,
    /// From a member that is not a destination of the message.
    pub ack_not_destination: u64,
    /// For a sequence number this sender is not sending (future, unknown).
    pub ack_unknown_seq: u64,
    /// For a message this sender already finished (late duplicates).
    pub ack_stale: u64,
    /// Numbers that do not fit the message (length, packet count, range),
    /// or not addressed to this sender.
    pub ack_invalid: u64,
}

/// What one broadcast() did.
#[derive(Debug, Clone, Copy)]
pub struct SendReport {
    pub path: Path,
    pub seq: u32,
    /// Datagrams of the first transmission handed to the kernel.
    pub datagrams: usize,
    pub fallback_copies: usize,
    /// Packet copies re-sent (per receiver), and the datagrams that took.
    pub retransmitted: usize,
    pub retransmit_datagrams: usize,
    /// Acknowledgments taken, probe timer expiries.
    pub acks: usize,
    pub timeouts: usize,
    /// From the first send until every receiver confirmed (zero when
    /// reliability is off).
    pub confirm_time: Duration,
}

pub struct Broadcaster {
    group: Group,
    me: Member,
    sock: BatchSocket,
    fanout: Option<BcastFanout>,
    path: Path,
    reason: String,
    seq: u32,
    payload: usize,
    stats: SenderStats,
    /// Members whose neighbour was unresolved at the last sync.
    unresolved: bool,
    rel: Reliability,
    /// Acknowledgments arrive on the sending socket.
    ack_rb: RecvBatch,
}

/// Largest ACK datagram: header, fixed part and a full bitmap.
const ACK_DGRAM_MAX: usize = HDR_LEN + crate::wire::ACK_LEN + crate::wire::ACK_MAX_BITS / 8;

/// Default per-packet message bytes for an interface MTU.
fn payload_for_mtu(mtu: usize) -> usize {
    mtu.saturating_sub(20 + 8 + HDR_LEN).clamp(1, 65_507 - HDR_LEN)
}

impl Broadcaster {
    /// Creates rank `rank`'s sender in the calling thread's network namespace.
    pub fn new(group: &Group, rank: u16, choice: PathChoice) -> Result<Broadcaster> {
        let me = group.member(rank.into())?.clone();
        let sock = BatchSocket::bind(me.addr, 0, 4 << 20, 16 << 20)?;
        let mtu = netns::mtu(&me.iface);
        let mut b = Broadcaster {
            group: group.clone(),
            payload: payload_for_mtu(mtu.unwrap_or(1500)),
            me,
            sock,
            fanout: None,
            path: Path::User,
            reason: String::new(),
            // A random first sequence number (like TCP's ISN): receivers
            // remember completed (sender, seq) pairs, and a restarted sender
            // counting from 0 again would have its messages taken for late
            // duplicates (dropped, and re-acknowledged as delivered).
            seq: crate::random_u32(),
            stats: SenderStats::default(),
            unresolved: false,
            rel: Reliability::default(),
            ack_rb: RecvBatch::new(64, ACK_DGRAM_MAX + 64),
        };
        match choice {
            PathChoice::User => b.reason = "user-space path requested (--path user)".into(),
            PathChoice::Kernel => {
                b.enable_kernel()?;
            }
            PathChoice::Auto => {
                if let Err(e) = b.enable_kernel() {
                    b.reason = format!("kernel path off: {e}; using the user-space path");
                }
            }
        }
        Ok(b)
    }

    fn enable_kernel(&mut self) -> Result<()> {
        let ifindex = netns::ifindex(&self.me.iface, self.me.netns.as_deref())?;
        let mut f = BcastFanout::load(self.group.job_id, ifindex)?;
        f.attach()?;
        self.fanout = Some(f);
        self.sync_members()?;
        self.path = Path::Kernel;
        self.reason = format!("kernel path: tc_bcast attached at TCX egress of {}", self.me.iface);
        Ok(())
    }

    /// Writes every member (the paper's append_machine_config) with its MAC
    /// from the kernel's neighbour table.
    pub fn sync_members(&mut self) -> Result<()> {
        let Some(f) = &self.fanout else { return Ok(()) };
        let neigh = neighbours(&self.me.iface);
        self.unresolved = false;
        for m in &self.group.members {
            if m.rank == self.me.rank {
                f.clear_member(m.rank)?;
                continue;
            }
            let mac = neigh.get(&m.addr).copied();
            self.unresolved |= mac.is_none();
            f.set_member(m, mac)?;
        }
        Ok(())
    }

    /// Adds or updates a member at run time (append_machine_config).
    pub fn append_machine_config(&mut self, m: Member) -> Result<()> {
        match self.group.members.iter_mut().find(|x| x.rank == m.rank) {
            Some(x) => *x = m,
            None => {
                self.group.members.push(m);
                self.group.members.sort_by_key(|x| x.rank);
            }
        }
        self.sync_members()
    }

    pub fn path(&self) -> Path {
        self.path
    }

    /// Why this path is in use (printed by the CLI).
    pub fn path_reason(&self) -> &str {
        &self.reason
    }

    pub fn stats(&self) -> SenderStats {
        self.stats
    }

    /// Acknowledgment, retransmission and deadline settings (reliable by
    /// default; `enabled: false` is fire-and-forget).
    pub fn set_reliability(&mut self, cfg: Reliability) -> Result<()> {
        cfg.validate()?;
        self.rel = cfg;
        Ok(())
    }

    pub fn reliability(&self) -> Reliability {
        self.rel
    }

    /// Sequence number of the next message.
    pub fn next_seq(&self) -> u32 {
        self.seq
    }

    /// The sending socket's address: receivers' acknowledgments come here.
    pub fn local_addr(&self) -> Result<SocketAddrV4> {
        self.sock.local_addr()
    }

    pub fn fanout(&self) -> Option<&BcastFanout> {
        self.fanout.as_ref()
    }

    /// Message bytes per packet.
    pub fn payload_per_packet(&self) -> usize {
        self.payload
    }

    pub fn set_payload_per_packet(&mut self, bytes: usize) -> Result<()> {
        let max = payload_for_mtu(netns::mtu(&self.me.iface).unwrap_or(1500));
        if bytes == 0 || bytes > max {
            return Err(Error::Usage(format!("payload per packet must be 1..={max} bytes (interface MTU)")));
        }
        self.payload = bytes;
        Ok(())
    }

    /// Switches between the paths at run time (the benchmark compares both
    /// on one cluster; the program is detached while the user path runs).
    pub fn use_path(&mut self, p: Path) -> Result<()> {
        match (p, self.fanout.as_mut()) {
            (Path::User, f) => {
                if let Some(f) = f {
                    f.detach();
                }
                self.path = Path::User;
            }
            (Path::Kernel, Some(f)) => {
                f.attach()?;
                self.path = Path::Kernel;
            }
            (Path::Kernel, None) => self.enable_kernel()?,
        }
        Ok(())
    }

    /// Sends `data` to every rank in `dests` (see [`Group::destinations`])
    /// and, unless reliability is off, returns once every destination
    /// confirmed the whole message: lost packets are re-sent to the receivers
    /// that miss them.  Fails with [`Error::BroadcastUnconfirmed`] naming the
    /// receivers that did not confirm within the deadline.
    pub fn broadcast(&mut self, data: &[u8], dests: &[u16]) -> Result<SendReport> {
        if dests.is_empty() {
            return Err(Error::EmptyDestinations { sender: self.me.rank });
        }
        if data.len() > MAX_MESSAGE {
            return Err(Error::MessageTooLarge { len: data.len(), max: MAX_MESSAGE });
        }
        if self.path == Path::Kernel && self.unresolved {
            self.sync_members()?;
        }
        let mut targets: Vec<Dest> = Vec::with_capacity(dests.len());
        for &d in dests {
            let m = self.group.member(d.into())?;
            if m.rank == self.me.rank {
                return Err(Error::Usage(format!("rank {d} is the sender; it cannot be a destination")));
            }
            targets.push(Dest { rank: m.rank, to: SocketAddrV4::new(m.addr, m.port) });
        }
        targets.sort_by_key(|m| m.rank);
        targets.dedup_by_key(|m| m.rank);

        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let payload = self.payload;
        let nfrag = data.len().div_ceil(payload).max(1);
        let frag = |i: usize| &data[(i * payload).min(data.len())..((i + 1) * payload).min(data.len())];
        let kernel = self.path == Path::Kernel;

        // One header per (window, fragment); windows group ranks by 64.
        let windows = windows(&targets);
        let mut headers: Vec<[u8; HDR_LEN]> = Vec::with_capacity(windows.len() * nfrag);
        for w in &windows {
            for i in 0..nfrag {
                headers.push(self.header(seq, data.len(), i * payload, frag(i).len(), i + 1 == nfrag, w, kernel));
            }
        }
        let mut report = SendReport {
            path: self.path,
            seq,
            datagrams: 0,
            fallback_copies: 0,
            retransmitted: 0,
            retransmit_datagrams: 0,
            acks: 0,
            timeouts: 0,
            confirm_time: Duration::ZERO,
        };
        let started = Instant::now();
        if !kernel {
            let mut dgrams = Vec::with_capacity(nfrag * targets.len());
            for i in 0..nfrag {
                for (wi, w) in windows.iter().enumerate() {
                    for m in &w.members {
                        dgrams.push(Datagram { to: m.to, head: &headers[wi * nfrag + i], body: frag(i) });
                    }
                }
            }
            self.stats.syscalls += self.sock.send_all(&dgrams)? as u64;
            report.datagrams = dgrams.len();
        } else {
            let mut dgrams = Vec::with_capacity(nfrag * windows.len());
            for i in 0..nfrag {
                for (wi, w) in windows.iter().enumerate() {
                    dgrams.push(Datagram { to: w.members[0].to, head: &headers[wi * nfrag + i], body: frag(i) });
                }
            }
            // Drain the miss ring after every batch: a batch can report at most
            // 1024 x 64 misses, which fits the ring, so no report is lost.
            let mut fallback: Vec<MissEvent> = Vec::new();
            for chunk in dgrams.chunks(MAX_BATCH) {
                self.stats.syscalls += self.sock.send_all(chunk)? as u64;
                if let Some(f) = &self.fanout {
                    fallback.extend(f.drain_misses().into_iter().filter(|e| e.msg_seq == seq));
                }
            }
            report.datagrams = dgrams.len();
            if !fallback.is_empty() {
                report.fallback_copies = self.send_missed(seq, data, &fallback, &targets)?;
            }
        }
        self.stats.messages += 1;
        self.stats.fragments += (nfrag * windows.len()) as u64;
        self.stats.datagrams += (report.datagrams + report.fallback_copies) as u64;
        if self.rel.enabled {
            self.confirm(seq, data, &targets, started, &mut report)?;
            report.confirm_time = started.elapsed();
        }
        Ok(report)
    }

    /// Waits for every target's confirmation of message `seq`, re-sending
    /// what the receivers report missing and probing silent ones.
    fn confirm(
        &mut self,
        seq: u32,
        data: &[u8],
        targets: &[Dest],
        started: Instant,
        report: &mut SendReport,
    ) -> Result<()> {
        let cfg = self.rel;
        let pkt = self.payload as u32;
        let npkts = data.len().div_ceil(self.payload).max(1) as u32;
        // A report that crossed a transmission in flight (or was written
        // before the packet arrived) must not double it.
        let holdoff = (cfg.nak_delay * 2).max(cfg.rto / 2);
        let now = Instant::now();
        let mut peers: Vec<Peer> = targets.iter().map(|d| Peer::new(d.rank, npkts, now, cfg.rto)).collect();
        let index: HashMap<u16, usize> = targets.iter().enumerate().map(|(i, d)| (d.rank, i)).collect();
        let deadline = started + cfg.deadline;
        let mut want: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        loop {
            if !want.is_empty() {
                self.retransmit(seq, data, targets, &mut peers, &mut want, report)?;
            }
            if peers.iter().all(|p| p.complete) {
                self.stats.confirmed += 1;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                self.stats.unconfirmed += 1;
                let missing: Vec<&Peer> = peers.iter().filter(|p| !p.complete).collect();
                let mut detail = missing
                    .iter()
                    .take(8)
                    .map(|p| format!("rank {} confirmed {}/{npkts} packets", p.rank, p.held.count()))
                    .collect::<Vec<_>>()
                    .join(", ");
                detail += &format!(
                    "; {} acknowledgments taken, {} packet copies re-sent, {} probe timeouts",
                    report.acks, report.retransmitted, report.timeouts
                );
                return Err(Error::BroadcastUnconfirmed {
                    seq,
                    len: data.len(),
                    ms: cfg.deadline.as_millis() as u64,
                    ranks: missing.iter().map(|p| p.rank).collect(),
                    detail,
                });
            }
            for (pi, p) in peers.iter_mut().enumerate() {
                if p.next_probe().is_some_and(|t| t <= now) {
                    if let Some(i) = p.probe(now, &cfg) {
                        want.entry(i).or_default().push(pi);
                        self.stats.timeouts += 1;
                        report.timeouts += 1;
                    }
                }
            }
            if !want.is_empty() {
                continue;
            }
            let wake = peers.iter().filter_map(Peer::next_probe).min().unwrap_or(deadline).min(deadline);
            // poll() takes whole milliseconds: round up, never spin on 0.
            let wait = wake.saturating_duration_since(now).as_micros().div_ceil(1000).max(1);
            let got = self.sock.recv_batch(&mut self.ack_rb, Some(Duration::from_millis(wait as u64)))?;
            let now = Instant::now();
            for i in 0..got {
                let (d, from) = self.ack_rb.get(i);
                let Ok(d) = d else {
                    self.stats.ack_malformed += 1;
                    continue;
                };
                let checked = check_ack(&self.group, self.me.rank, &mut self.stats, d, from, seq, data.len());
                let Some((rank, ack)) = checked else { continue };
                let Some(&pi) = index.get(&rank) else {
                    self.stats.ack_not_destination += 1;
                    continue;
                };
                match peers[pi].apply(&ack, pkt, now, &cfg, holdoff) {
                    Ok(missing) => {
                        self.stats.acks += 1;
                        report.acks += 1;
                        if ack.flags & ACK_GAP != 0 {
                            self.stats.gap_reports += 1;
                        }
                        for i in missing {
                            want.entry(i).or_default().push(pi);
                        }
                    }
                    Err(_) => self.stats.ack_invalid += 1,
                }
            }
        }
    }

    /// Re-sends packet i to exactly the peers listed in `want[i]`.
    fn retransmit(
        &mut self,
        seq: u32,
        data: &[u8],
        targets: &[Dest],
        peers: &mut [Peer],
        want: &mut BTreeMap<u32, Vec<usize>>,
        report: &mut SendReport,
    ) -> Result<()> {
        let kernel = self.path == Path::Kernel;
        let payload = self.payload;
        let nfrag = data.len().div_ceil(payload).max(1);
        let now = Instant::now();
        let mut heads: Vec<([u8; HDR_LEN], SocketAddrV4, usize)> = Vec::new();
        for (&i, pis) in want.iter_mut() {
            let i = i as usize;
            let off = (i * payload).min(data.len());
            let plen = (data.len() - off).min(payload);
            let last = i + 1 == nfrag;
            pis.sort_unstable();
            pis.dedup();
            let who: Vec<Dest> = pis.iter().map(|&pi| targets[pi]).collect();
            if kernel {
                // One datagram per 64-rank window; its mask is exactly the
                // receivers that miss this packet.
                for w in windows(&who) {
                    heads.push((self.header(seq, data.len(), off, plen, last, &w, true), w.members[0].to, off));
                }
            } else {
                for d in &who {
                    let w = Window { base: d.rank / 64 * 64, mask: 1 << (d.rank % 64), members: vec![] };
                    heads.push((self.header(seq, data.len(), off, plen, last, &w, false), d.to, off));
                }
            }
            for &pi in pis.iter() {
                peers[pi].sent(now);
            }
            report.retransmitted += pis.len();
            self.stats.retransmitted += pis.len() as u64;
        }
        want.clear();
        let dgrams: Vec<Datagram<'_>> = heads
            .iter()
            .map(|(h, to, off)| Datagram { to: *to, head: h, body: &data[*off..(*off + payload).min(data.len())] })
            .collect();
        let mut fallback: Vec<MissEvent> = Vec::new();
        for chunk in dgrams.chunks(MAX_BATCH) {
            self.stats.syscalls += self.sock.send_all(chunk)? as u64;
            if let (true, Some(f)) = (kernel, &self.fanout) {
                fallback.extend(f.drain_misses().into_iter().filter(|e| e.msg_seq == seq));
            }
        }
        report.retransmit_datagrams += dgrams.len();
        self.stats.retransmit_datagrams += dgrams.len() as u64;
        self.stats.datagrams += dgrams.len() as u64;
        if !fallback.is_empty() {
            let n = self.send_missed(seq, data, &fallback, targets)?;
            report.fallback_copies += n;
            self.stats.datagrams += n as u64;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn header(
        &self,
        seq: u32,
        len: usize,
        off: usize,
        plen: usize,
        last: bool,
        w: &Window,
        fanout: bool,
    ) -> [u8; HDR_LEN] {
        Header {
            version: VERSION,
            msg_type: T_BCAST,
            flags: if last { F_LAST_FRAG } else { 0 } | if fanout { F_FANOUT } else { 0 },
            job_id: self.group.job_id,
            src_rank: self.me.rank,
            mask_base: w.base,
            dst_mask: w.mask,
            msg_seq: seq,
            frag_off: off as u32,
            msg_len: len as u32,
            payload_len: plen as u16,
            agg_op: 0,
            dtype: 0,
        }
        .to_bytes()
    }

    /// User-space copies for destinations the kernel did not serve.
    fn send_missed(&mut self, seq: u32, data: &[u8], misses: &[MissEvent], targets: &[Dest]) -> Result<usize> {
        let payload = self.payload;
        let mut heads: Vec<([u8; HDR_LEN], SocketAddrV4, usize)> = Vec::with_capacity(misses.len());
        for e in misses {
            let Some(m) = targets.iter().find(|m| m.rank == e.rank) else { continue };
            let off = e.frag_off as usize;
            if off > data.len() {
                continue;
            }
            let plen = (data.len() - off).min(payload);
            let w = Window { base: m.rank / 64 * 64, mask: 1u64 << (m.rank % 64), members: vec![] };
            let last = off + plen >= data.len();
            heads.push((self.header(seq, data.len(), off, plen, last, &w, false), m.to, off));
            if e.reason == MissReason::Unresolved {
                self.stats.unresolved_misses += 1;
                self.unresolved = true;
            }
        }
        let dgrams: Vec<Datagram<'_>> = heads
            .iter()
            .map(|(h, to, off)| Datagram { to: *to, head: h, body: &data[*off..(*off + payload).min(data.len())] })
            .collect();
        self.stats.syscalls += self.sock.send_all(&dgrams)? as u64;
        self.stats.fallback_copies += dgrams.len() as u64;
        Ok(dgrams.len())
    }
}

/// Validates one datagram of the sending socket as an ACK of message
/// `seq`; counts and drops anything else.  Returns the acknowledging rank.
fn check_ack(
    group: &Group,
    me: u16,
    st: &mut SenderStats,
    d: &[u8],
    from: SocketAddrV4,
    seq: u32,
    len: usize,
) -> Option<(u16, BcastAck)> {
    let (h, payload) = match Header::decode(d) {
        Ok(x) if x.0.msg_type == T_BCAST_ACK => x,
        _ => {
            st.ack_malformed += 1;
            return None;
        }
    };
    let Ok(ack) = BcastAck::decode(payload) else {
        st.ack_malformed += 1;
        return None;
    };
    if h.job_id != group.job_id {
        st.ack_wrong_job += 1;
        return None;
    }
    // The acknowledging rank must be a member answering from its own
    // address and port (the receiver's bound socket).
    match group.member(h.src_rank.into()) {
        Ok(m) if SocketAddrV4::new(m.addr, m.port) == from && m.rank != me => {}
        _ => {
            st.ack_not_member += 1;
            return None;
        }
    }
    if h.mask_base != me / 64 * 64 || h.dst_mask != 1 << (me % 64) {
        st.ack_invalid += 1;
        return None;
    }
    if h.msg_seq != seq {
        // Late answers to earlier messages are normal (re-acknowledged
        // retransmissions); anything else was never sent.
        let behind = seq.wrapping_sub(h.msg_seq);
        if (1..=STALE_WINDOW).contains(&behind) && u64::from(behind) <= st.messages {
            st.ack_stale += 1;
        } else {
            st.ack_unknown_seq += 1;
        }
        return None;
    }
    if h.msg_len as usize != len {
        st.ack_invalid += 1;
        return None;
    }
    Some((h.src_rank, ack))
}

/// How far back an ACK's sequence number may lie to count as a late answer
/// to an earlier message rather than an unknown sequence.
const STALE_WINDOW: u32 = 1 << 16;

#[derive(Debug, Clone, Copy)]
struct Dest {
    rank: u16,
    to: SocketAddrV4,
}

/// Destinations of one 64-rank window of the mask.
struct Window {
    base: u16,
    mask: u64,
    members: Vec<Dest>,
}

fn windows(sorted: &[Dest]) -> Vec<Window> {
    let mut out: Vec<Window> = Vec::new();
    for &m in sorted {
        let base = m.rank / MASK_BITS as u16 * MASK_BITS as u16;
        match out.last_mut() {
            Some(w) if w.base == base => {
                w.mask |= 1 << (m.rank - base);
                w.members.push(m);
            }
            _ => out.push(Window { base, mask: 1 << (m.rank - base), members: vec![m] }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn member(rank: u16) -> Member {
        Member { rank, addr: Ipv4Addr::new(10, 0, 0, rank as u8 + 1), port: 4000, iface: "eth0".into(), netns: None }
    }

    #[test]
    fn windows_split_by_64() {
        let ds: Vec<Dest> = [1u16, 2, 63, 64, 65, 130]
            .iter()
            .map(|&r| Dest { rank: r, to: SocketAddrV4::new(member(r).addr, 4000) })
            .collect();
        let w = windows(&ds);
        assert_eq!(w.len(), 3);
        assert_eq!((w[0].base, w[0].mask), (0, (1 << 1) | (1 << 2) | (1 << 63)));
        assert_eq!((w[1].base, w[1].mask), (64, 0b11));
        assert_eq!((w[2].base, w[2].mask), (128, 0b100));
    }

    #[test]
    fn payload_fits_mtu() {
        assert_eq!(payload_for_mtu(1500), 1432);
        assert_eq!(payload_for_mtu(65536), 65_507 - HDR_LEN);
    }
}
