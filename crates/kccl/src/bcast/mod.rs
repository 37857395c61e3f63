//! Broadcast over both paths with one wire format.
//!
//! Kernel path: one datagram per fragment (per 64-rank window) with
//! KCCL_F_FANOUT; tc_bcast at TCX egress copies it to every destination in the
//! mask.  Destinations it reports as missed (unresolved neighbour, failed
//! clone) get their copy from user space in the same call.
//! User path (fallback and baseline): one datagram per fragment per
//! destination, sent with sendmmsg in batches of up to 1024.
//! Receivers are plain UDP sockets on both paths.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::net::SocketAddrV4;
use std::str::FromStr;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, Result};
use crate::group::{Group, Member};
use crate::kernel::{neighbours, BcastFanout, MissEvent, MissReason};
use crate::netns;
use crate::sock::{BatchSocket, Datagram, RecvBatch, MAX_BATCH};
use crate::wire::{Header, F_FANOUT, F_LAST_FRAG, HDR_LEN, MASK_BITS, T_BCAST, VERSION};

/// Largest message a sender will send and a receiver accepts by default.
pub const MAX_MESSAGE: usize = u32::MAX as usize;
pub const DEFAULT_MAX_RECV_MESSAGE: usize = 1 << 30;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathChoice {
    Kernel,
    User,
    Auto,
}

impl FromStr for PathChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(PathChoice::Kernel),
            "user" => Ok(PathChoice::User),
            "auto" => Ok(PathChoice::Auto),
            _ => Err(Error::Usage(format!("unknown path '{s}': use kernel, user or auto"))),
        }
    }
}

/// What the runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    Kernel,
    User,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Path::Kernel => "kernel",
            Path::User => "user",
        })
    }
}

#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SenderStats {
    pub messages: u64,
    /// Fragments of all messages (per 64-rank window).
    pub fragments: u64,
    /// Datagrams user space handed to the kernel.
    pub datagrams: u64,
    pub syscalls: u64,
    /// Copies user space sent because the kernel fan-out missed a destination.
    pub fallback_copies: u64,
    pub unresolved_misses: u64,
}

/// What one broadcast() did.
#[derive(Debug, Clone, Copy)]
pub struct SendReport {
    pub path: Path,
    pub seq: u32,
    pub datagrams: usize,
    pub fallback_copies: usize,
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
}

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
            seq: 0,
            stats: SenderStats::default(),
            unresolved: false,
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

    /// Sends `data` to every rank in `dests` (see [`Group::destinations`]).
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
        let mut report = SendReport { path: self.path, seq, datagrams: 0, fallback_copies: 0 };
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
        Ok(report)
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
    pub malformed: u64,
    pub truncated: u64,
    pub wrong_job: u64,
    pub not_member: u64,
    pub not_addressed: u64,
    pub duplicates: u64,
    pub too_large: u64,
    pub evicted: u64,
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
            too_large: self.too_large - before.too_large,
            evicted: self.evicted - before.evicted,
        }
    }
}

struct Partial {
    buf: Vec<u8>,
    got: usize,
    seen: HashSet<u32>,
    arrived: Option<SystemTime>,
}

pub struct Receiver {
    job_id: u32,
    me: Member,
    members: HashMap<u16, Member>,
    sock: BatchSocket,
    rb: RecvBatch,
    partial: HashMap<(u16, u32), Partial>,
    done: HashSet<(u16, u32)>,
    done_order: VecDeque<(u16, u32)>,
    ready: VecDeque<Message>,
    stats: RecvStats,
    max_message: usize,
    max_pending: usize,
}

/// Completed (sender, seq) pairs remembered to recognise late duplicates.
const DONE_MEMORY: usize = 8192;

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
            rb: RecvBatch::new(64, dgram_max),
            partial: HashMap::new(),
            done: HashSet::new(),
            done_order: VecDeque::new(),
            ready: VecDeque::new(),
            stats: RecvStats::default(),
            max_message: DEFAULT_MAX_RECV_MESSAGE,
            max_pending: 64,
        })
    }

    pub fn set_max_message(&mut self, bytes: usize) {
        self.max_message = bytes;
    }

    pub fn stats(&self) -> RecvStats {
        self.stats
    }

    pub fn local_addr(&self) -> Result<SocketAddrV4> {
        self.sock.local_addr()
    }

    /// Next complete message; Error::Timeout if none completes in `timeout`.
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Message> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(m) = self.ready.pop_front() {
                return Ok(m);
            }
            let left = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(self.timeout_error(timeout.unwrap_or_default()));
                    }
                    Some(d - now)
                }
                None => None,
            };
            let n = self.sock.recv_batch(&mut self.rb, left)?;
            for i in 0..n {
                self.ingest(i);
            }
        }
    }

    fn timeout_error(&self, t: Duration) -> Error {
        let mut what = format!("a complete message on rank {}", self.me.rank);
        for ((src, seq), p) in self.partial.iter().take(4) {
            what += &format!("; message {seq} from rank {src} has {}/{} bytes", p.got, p.buf.len());
        }
        Error::Timeout { ms: t.as_millis() as u64, what }
    }

    fn ingest(&mut self, i: usize) {
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
        if self.done.contains(&key) {
            self.stats.duplicates += 1;
            return;
        }
        // Fast path: a whole message in one datagram.
        if h.frag_off == 0 && h.payload_len as u32 == h.msg_len && !self.partial.contains_key(&key) {
            self.complete(key, payload.to_vec(), rx_time);
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
            buf: vec![0u8; h.msg_len as usize],
            got: 0,
            seen: HashSet::new(),
            arrived: None,
        });
        if p.buf.len() != h.msg_len as usize {
            self.stats.malformed += 1;
            return;
        }
        if !p.seen.insert(h.frag_off) {
            self.stats.duplicates += 1;
            return;
        }
        let off = h.frag_off as usize;
        p.buf[off..off + payload.len()].copy_from_slice(payload);
        p.got += payload.len();
        p.arrived = p.arrived.max(rx_time);
        if p.got >= p.buf.len() {
            if let Some(p) = self.partial.remove(&key) {
                self.complete(key, p.buf, p.arrived);
            }
        }
    }

    fn complete(&mut self, key: (u16, u32), data: Vec<u8>, arrived: Option<SystemTime>) {
        self.stats.messages += 1;
        self.done.insert(key);
        self.done_order.push_back(key);
        if self.done_order.len() > DONE_MEMORY {
            if let Some(old) = self.done_order.pop_front() {
                self.done.remove(&old);
            }
        }
        self.ready.push_back(Message { src_rank: key.0, seq: key.1, data, completed: Instant::now(), arrived });
    }
}

/// CPU time of the calling thread (user + system, including softirq work the
/// kernel runs in its context).
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid clock id and timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
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
