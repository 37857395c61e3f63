//! The coordinator of scatter-gather on the user-space path: it sends a
//! request to its workers, gathers their replies (reassembling multi-packet
//! ones, dropping duplicates, foreign and stale packets), combines them and
//! completes the request by its policy or its deadline.  Many requests can be
//! in flight at once; a worker that has not answered is asked again (only
//! it) after a retransmission timeout that doubles up to a cap.
//!
//! On the kernel path xdp_sg on the coordinator's interface combines the
//! replies of the requests it can take (sg/kernel_gather.rs) and only the
//! result reaches this process: a done record on a ring buffer, the elements
//! read in place.  The timer then reads the request's slot to ask again only
//! the workers whose reply the kernel has not combined, and finds a request
//! that can no longer meet its policy.  Requests the kernel cannot take stay
//! on the user path of the same coordinator.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::combine::{self, Acc, Combine, Elem, Value};
use super::kernel_gather::{self, KernelGather};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::transport::sock::{BatchSocket, Datagram, RecvBatch};
use crate::transport::{Path, PathChoice};
use crate::wire::{self, Header, F_LAST_FRAG, HDR_LEN, MASK_BITS, T_SG_REPLY, T_SG_REQUEST};

/// When a request completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Every worker asked.
    All,
    /// The first reply.
    Any,
    /// The first n replies (n <= the workers asked).
    AtLeast(usize),
}

impl Policy {
    fn needed(self, workers: usize) -> usize {
        match self {
            Policy::All => workers,
            Policy::Any => 1,
            Policy::AtLeast(n) => n,
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "all" => Ok(Policy::All),
            "any" => Ok(Policy::Any),
            _ => s
                .strip_prefix("n:")
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .map(Policy::AtLeast)
                .ok_or_else(|| Error::Usage(format!("unknown policy '{s}': use all, any or n:<count>"))),
        }
    }
}

/// What one request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub policy: Policy,
    /// The request ends by then at the latest, with what has arrived.
    pub deadline: Duration,
    pub combine: Combine,
    pub elem: Elem,
}

impl Spec {
    /// Wait for all, one second at most.
    pub fn new(combine: Combine, elem: Elem) -> Spec {
        Spec { policy: Policy::All, deadline: Duration::from_secs(1), combine, elem }
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Its policy was met.
    Complete,
    /// Its deadline passed first: the result combines the replies that came.
    Deadline,
    /// Every worker answered or was refused and the policy cannot be met.
    Exhausted,
}

/// One finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gathered {
    pub id: u32,
    pub outcome: Outcome,
    pub value: Value,
    /// Workers whose reply is in `value`, by rank.
    pub answered: Vec<u16>,
    /// Workers asked whose whole reply had not arrived when it ended.
    pub missing: Vec<u16>,
    /// Workers whose reply could not be combined, and why.
    pub refused: Vec<(u16, String)>,
    pub elapsed: Duration,
    /// Request datagrams sent again to workers that had not answered.
    pub re_requests: usize,
}

/// Tuning of a coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SgConfig {
    /// Wait for a worker's reply before asking it again; doubles per retry.
    pub rto: Duration,
    pub rto_max: Duration,
    /// Requests in flight at once.
    pub max_in_flight: usize,
    /// Largest reply accepted from one worker, in bytes.
    pub max_reply: usize,
}

impl Default for SgConfig {
    fn default() -> Self {
        SgConfig {
            rto: Duration::from_millis(20),
            rto_max: Duration::from_millis(320),
            max_in_flight: 4096,
            max_reply: 64 << 20,
        }
    }
}

/// Counters of a coordinator since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CoordStats {
    pub requests: u64,
    pub complete: u64,
    pub by_deadline: u64,
    pub exhausted: u64,
    /// Reply fragments taken.
    pub fragments: u64,
    /// Fragments of a reply already held, or of a worker already combined.
    pub duplicates: u64,
    /// Replies to a request that had already ended.
    pub stale: u64,
    /// Replies naming a request id never issued.
    pub unknown: u64,
    /// Packets from outside the request: another job, a non-member, a
    /// worker not asked, an address that is not the member's.
    pub foreign: u64,
    /// Packets that are not a well-formed reply of this request.
    pub malformed: u64,
    pub re_requests: u64,
    /// Requests the kernel combined (kernel path).
    pub in_kernel: u64,
    /// Replies of requests the kernel holds that reached the socket anyway
    /// (xdp_sg did not see them); left out.
    pub bypassed: u64,
}

enum WorkerState {
    Waiting,
    /// Part of a multi-packet reply.
    Partial(Reassembly),
    Answered,
    Refused,
}

struct Reassembly {
    buf: Vec<u8>,
    held: Vec<bool>,
    left: usize,
}

struct Pending {
    spec: Spec,
    workers: Vec<u16>,
    state: Vec<WorkerState>,
    acc: Acc,
    answered: Vec<u16>,
    refused: Vec<(u16, String)>,
    body: Vec<u8>,
    t0: Instant,
    retry_at: Instant,
    rto: Duration,
    re_requests: usize,
    /// The kernel combines its replies (its slot is open in xdp_sg).
    in_kernel: bool,
}

impl Pending {
    fn unanswered(&self) -> impl Iterator<Item = u16> + '_ {
        self.workers
            .iter()
            .zip(&self.state)
            .filter(|(_, s)| matches!(s, WorkerState::Waiting | WorkerState::Partial(_)))
            .map(|(&w, _)| w)
    }
}

/// The coordinator: see the module comment.
pub struct Coordinator {
    group: Group,
    rank: u16,
    path: Path,
    path_reason: String,
    cfg: SgConfig,
    sock: BatchSocket,
    rb: RecvBatch,
    chunk: usize,
    next_id: u32,
    pending: HashMap<u32, Pending>,
    done: VecDeque<(u32, Result<Gathered>)>,
    stats: CoordStats,
    kernel: Option<KernelGather>,
    /// On the kernel path: the socket and the done ring, one fd to wait on.
    epoll: Option<OwnedFd>,
}

impl Coordinator {
    /// A coordinator for member `rank` of `group`, bound to its address and
    /// port, in the calling thread's network namespace.  `Kernel` loads
    /// xdp_sg on the member's interface or fails saying why; `Auto` falls
    /// back to the user path and says why.
    pub fn new(group: &Group, rank: u16, choice: PathChoice) -> Result<Coordinator> {
        let me = group.member(rank.into())?;
        let sock = BatchSocket::bind(me.addr, me.port, 8 << 20, 4 << 20)?;
        let kernel = match choice {
            PathChoice::User => Err("user path (asked for)".to_owned()),
            PathChoice::Kernel => Ok(KernelGather::load(group, me)?),
            PathChoice::Auto => KernelGather::load(group, me).map_err(|e| format!("user path: kernel path off: {e}")),
        };
        let (kernel, path, path_reason) = match kernel {
            Ok(k) => {
                let why = format!(
                    "kernel path: xdp_sg on {} combines the replies (SUM/MIN/MAX/COUNT of int32/int64, \
                     up to {} elements each); the request goes to each worker from user space",
                    k.iface(),
                    crate::kernel::SG_MAX_ELEMS
                );
                (Some(k), Path::Kernel, why)
            }
            Err(why) => (None, Path::User, why),
        };
        let epoll = match &kernel {
            Some(k) => Some(wait_set(&[sock.as_raw_fd(), k.done_fd()])?),
            None => None,
        };
        let chunk = group.chunk_bytes as usize;
        Ok(Coordinator {
            group: group.clone(),
            rank,
            path,
            path_reason,
            cfg: SgConfig::default(),
            sock,
            rb: RecvBatch::new(256, HDR_LEN + chunk),
            chunk,
            next_id: crate::random_u32(),
            pending: HashMap::new(),
            done: VecDeque::new(),
            stats: CoordStats::default(),
            kernel,
            epoll,
        })
    }

    /// The kernel engine's counters (kernel path only).
    pub fn kernel_stats(&self) -> Result<Option<crate::kernel::SgStats>> {
        self.kernel.as_ref().map(|k| k.stats()).transpose()
    }

    pub fn path(&self) -> Path {
        self.path
    }

    /// Which path and why, for the user.
    pub fn path_reason(&self) -> &str {
        &self.path_reason
    }

    pub fn set_config(&mut self, cfg: SgConfig) -> Result<()> {
        if cfg.rto.is_zero() || cfg.rto_max < cfg.rto || cfg.max_in_flight == 0 {
            return Err(Error::Usage(format!(
                "scatter-gather config: want 0 < rto <= rto_max and max_in_flight > 0, got {cfg:?}"
            )));
        }
        self.cfg = cfg;
        Ok(())
    }

    /// The id the next request gets (random at first; ids wrap; tests start
    /// near the wrap).
    pub fn set_next_id(&mut self, id: u32) {
        self.next_id = id;
    }

    pub fn stats(&self) -> CoordStats {
        self.stats
    }

    /// Requests submitted and not yet returned by [`Coordinator::poll`] or
    /// [`Coordinator::wait`].
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Largest request body: one datagram.
    pub fn max_request(&self) -> usize {
        self.chunk
    }

    /// Sends `body` to `workers` (every other member if empty) and returns
    /// the request's id; its result comes from [`Coordinator::poll`] or
    /// [`Coordinator::wait`].
    pub fn submit(&mut self, body: &[u8], workers: &[u16], spec: Spec) -> Result<u32> {
        combine::check(spec.combine, spec.elem)?;
        if body.len() > self.chunk {
            return Err(Error::MessageTooLarge { len: body.len(), max: self.chunk });
        }
        if spec.deadline.is_zero() {
            return Err(Error::Usage("a scatter-gather deadline must be positive".into()));
        }
        let mut workers = if workers.is_empty() { self.group.all_but(self.rank) } else { workers.to_vec() };
        workers.sort_unstable();
        workers.dedup();
        if workers.is_empty() || workers.contains(&self.rank) {
            return Err(Error::EmptyDestinations { sender: self.rank });
        }
        for &w in &workers {
            self.group.member(w.into())?;
        }
        if let Policy::AtLeast(n) = spec.policy {
            if n == 0 || n > workers.len() {
                return Err(Error::Usage(format!(
                    "policy n:{n} with {} workers: want 1..={}",
                    workers.len(),
                    workers.len()
                )));
            }
        }
        if self.pending.len() >= self.cfg.max_in_flight {
            return Err(Error::Usage(format!(
                "{} scatter-gather requests in flight already (max_in_flight): poll or wait for one first",
                self.pending.len()
            )));
        }
        let mut id = self.next_id;
        while self.pending.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        self.next_id = id.wrapping_add(1);
        let now = Instant::now();
        let in_kernel = match &mut self.kernel {
            Some(k) => k.try_open(id, spec.policy.needed(workers.len()), spec.combine, spec.elem, &workers)?,
            None => false,
        };
        let p = Pending {
            spec,
            state: workers.iter().map(|_| WorkerState::Waiting).collect(),
            workers,
            acc: Acc::new(spec.combine, spec.elem),
            answered: Vec::new(),
            refused: Vec::new(),
            body: body.to_vec(),
            t0: now,
            retry_at: now + self.cfg.rto,
            rto: self.cfg.rto,
            re_requests: 0,
            in_kernel,
        };
        if let Err(e) = self.send_request(id, &p, &p.workers) {
            if let (true, Some(k)) = (in_kernel, &mut self.kernel) {
                k.close(id, spec.combine, spec.elem)?;
            }
            return Err(e);
        }
        self.pending.insert(id, p);
        self.stats.requests += 1;
        self.stats.in_kernel += u64::from(in_kernel);
        Ok(id)
    }

    /// One request datagram per worker (the kernel path will send one and fan
    /// it out in TC).
    fn send_request(&self, id: u32, p: &Pending, to: &[u16]) -> Result<()> {
        let mut heads = Vec::with_capacity(to.len());
        let mut addrs = Vec::with_capacity(to.len());
        for &w in to {
            let m = self.group.member(w.into())?;
            let base = w - w % MASK_BITS as u16;
            let h = Header {
                version: wire::VERSION,
                msg_type: T_SG_REQUEST,
                flags: F_LAST_FRAG,
                job_id: self.group.job_id,
                src_rank: self.rank,
                mask_base: base,
                dst_mask: 1u64 << (w - base),
                msg_seq: id,
                frag_off: 0,
                msg_len: p.body.len() as u32,
                payload_len: p.body.len() as u16,
                agg_op: p.spec.combine.wire(),
                dtype: p.spec.elem.wire(),
            };
            heads.push(h.to_bytes());
            addrs.push(SocketAddrV4::new(m.addr, m.port));
        }
        let dgrams: Vec<Datagram<'_>> =
            heads.iter().zip(&addrs).map(|(h, &to)| Datagram { to, head: h, body: &p.body }).collect();
        self.sock.send_all(&dgrams)?;
        Ok(())
    }

    /// Makes progress for up to `timeout` (None: until a request ends) and
    /// returns the requests that ended, oldest first.  Each request ends
    /// exactly once: Ok with its result, or Err (an exact result that does
    /// not fit the element type).
    pub fn poll(&mut self, timeout: Option<Duration>) -> Result<Vec<(u32, Result<Gathered>)>> {
        let until = timeout.map(|t| Instant::now() + t);
        loop {
            self.expire(Instant::now())?;
            if !self.done.is_empty() {
                return Ok(self.done.drain(..).collect());
            }
            let now = Instant::now();
            let next_timer = self.pending.values().map(|p| p.retry_at.min(p.t0 + p.spec.deadline)).min();
            let wake = match (next_timer, until) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) => a,
                (None, Some(b)) => b,
                (None, None) => return Ok(Vec::new()),
            };
            if until.is_some_and(|u| now >= u) {
                return Ok(Vec::new());
            }
            let wait = wake.saturating_duration_since(now).max(Duration::from_micros(100));
            let n = match &self.epoll {
                Some(ep) => {
                    wait_readable(ep, wait)?;
                    self.take_kernel_done()?;
                    self.sock.recv_batch(&mut self.rb, Some(Duration::ZERO))?
                }
                None => self.sock.recv_batch(&mut self.rb, Some(wait))?,
            };
            for i in 0..n {
                self.take(i);
            }
        }
    }

    /// Waits for request `id` to end (other requests that end meanwhile stay
    /// for [`Coordinator::poll`]).
    pub fn wait(&mut self, id: u32) -> Result<Gathered> {
        loop {
            if let Some(at) = self.done.iter().position(|(d, _)| *d == id) {
                return self.done.remove(at).expect("position is in range").1;
            }
            if !self.pending.contains_key(&id) {
                return Err(Error::Usage(format!("scatter-gather request {id} is not in flight")));
            }
            let ended = self.poll(None)?;
            self.done.extend(ended);
        }
    }

    /// Submits and waits: one request, one result.
    pub fn scatter(&mut self, body: &[u8], workers: &[u16], spec: Spec) -> Result<Gathered> {
        let id = self.submit(body, workers, spec)?;
        self.wait(id)
    }

    /// Re-requests from the workers of requests whose timer ran out, and ends
    /// those past their deadline.
    fn expire(&mut self, now: Instant) -> Result<()> {
        let mut ended = Vec::new();
        let mut again = Vec::new();
        for (&id, p) in &mut self.pending {
            if now >= p.t0 + p.spec.deadline {
                ended.push((id, Outcome::Deadline));
            } else if now >= p.retry_at {
                let to: Vec<u16> = match (&self.kernel, p.in_kernel) {
                    (Some(k), true) => match k.peek(id)? {
                        // Done: its record is late or was lost (ring full).
                        Some(s) if s.state == crate::kernel::SgSlotState::Open => {
                            let to: Vec<u16> = p
                                .workers
                                .iter()
                                .copied()
                                .filter(|w| s.seen.binary_search(w).is_err() && s.refused.binary_search(w).is_err())
                                .collect();
                            if to.is_empty() {
                                // Refused replies: nothing more can come.
                                ended.push((id, Outcome::Exhausted));
                                continue;
                            }
                            to
                        }
                        _ => {
                            ended.push((id, Outcome::Complete));
                            continue;
                        }
                    },
                    _ => p.unanswered().collect(),
                };
                p.re_requests += to.len();
                p.rto = (p.rto * 2).min(self.cfg.rto_max);
                p.retry_at = now + p.rto;
                again.push((id, to));
            }
        }
        for (id, to) in again {
            self.stats.re_requests += to.len() as u64;
            self.send_request(id, &self.pending[&id], &to)?;
        }
        for (id, outcome) in ended {
            self.end(id, outcome);
        }
        Ok(())
    }

    /// Ends the kernel's requests whose done record arrived.
    fn take_kernel_done(&mut self) -> Result<()> {
        let Some(k) = &mut self.kernel else { return Ok(()) };
        for d in k.done()? {
            // A request ended meanwhile (deadline) has no record to take.
            if self.pending.get(&d.req_id).is_some_and(|p| p.in_kernel) {
                self.end(d.req_id, Outcome::Complete);
            }
        }
        Ok(())
    }

    fn end(&mut self, id: u32, outcome: Outcome) {
        let Some(p) = self.pending.remove(&id) else { return };
        let (outcome, r) = if p.in_kernel { self.end_in_kernel(id, outcome, p) } else { end_in_user(id, outcome, p) };
        match outcome {
            Outcome::Complete => self.stats.complete += 1,
            Outcome::Deadline => self.stats.by_deadline += 1,
            Outcome::Exhausted => self.stats.exhausted += 1,
        }
        self.done.push_back((id, r));
    }

    /// Closes request `id`'s slot and makes its result from what the kernel
    /// combined: a slot that met its policy is Complete whatever the caller
    /// thought (its record may not have been read yet).
    fn end_in_kernel(&mut self, id: u32, outcome: Outcome, p: Pending) -> (Outcome, Result<Gathered>) {
        let k = self.kernel.as_mut().expect("a request in the kernel has a kernel");
        let (closed, acc) = match k.close(id, p.spec.combine, p.spec.elem) {
            Ok(Some(c)) => c,
            Ok(None) => {
                let reason = format!("the kernel's slot of scatter-gather request {id} holds another request");
                return (outcome, Err(Error::KernelPathUnavailable { reason }));
            }
            Err(e) => return (outcome, Err(e)),
        };
        let outcome = if closed.state == crate::kernel::SgSlotState::Done { Outcome::Complete } else { outcome };
        let has = |v: &[u16], w: &u16| v.binary_search(w).is_ok();
        let missing = p.workers.iter().copied().filter(|w| !has(&closed.seen, w) && !has(&closed.refused, w)).collect();
        let refused = closed.refused.iter().map(|&w| (w, kernel_gather::refusal())).collect();
        let r = acc.finish(&describe(id, &p)).map(|value| Gathered {
            id,
            outcome,
            value,
            answered: closed.seen,
            missing,
            refused,
            elapsed: p.t0.elapsed(),
            re_requests: p.re_requests,
        });
        (outcome, r)
    }

    /// Takes datagram i of the last receive batch.
    fn take(&mut self, i: usize) {
        let (dgram, from) = self.rb.get(i);
        let Ok(dgram) = dgram else {
            self.stats.malformed += 1;
            return;
        };
        let Ok((h, payload)) = Header::decode(dgram) else {
            self.stats.malformed += 1;
            return;
        };
        if h.msg_type != T_SG_REPLY {
            self.stats.malformed += 1;
            return;
        }
        let my_base = self.rank - self.rank % MASK_BITS as u16;
        let from_member = self.group.member(h.src_rank.into()).ok().map(|m| SocketAddrV4::new(m.addr, m.port));
        if h.job_id != self.group.job_id
            || from_member != Some(from)
            || h.mask_base != my_base
            || h.dst_mask != 1u64 << (self.rank - my_base)
        {
            self.stats.foreign += 1;
            return;
        }
        let id = h.msg_seq;
        let Some(p) = self.pending.get_mut(&id) else {
            // Issued within the last 2^31 ids and no longer pending: it ended.
            if self.next_id.wrapping_sub(id).wrapping_sub(1) < 1 << 31 {
                self.stats.stale += 1;
            } else {
                self.stats.unknown += 1;
            }
            return;
        };
        let Ok(w) = p.workers.binary_search(&h.src_rank) else {
            self.stats.foreign += 1;
            return;
        };
        if p.in_kernel {
            self.stats.bypassed += 1;
            return;
        }
        let (chunk, max_reply) = (self.chunk, self.cfg.max_reply);
        let len = h.msg_len as usize;
        let off = h.frag_off as usize;
        let last = h.flags & F_LAST_FRAG != 0;
        let want_payload = len.saturating_sub(off).min(chunk);
        if h.agg_op != p.spec.combine.wire()
            || h.dtype != p.spec.elem.wire()
            || off % chunk != 0
            || (off >= len && len > 0)
            || payload.len() != want_payload
            || last != (off + chunk >= len)
        {
            self.stats.malformed += 1;
            return;
        }
        let state = &mut p.state[w];
        if matches!(state, WorkerState::Answered | WorkerState::Refused) {
            self.stats.duplicates += 1;
            return;
        }
        if len > max_reply {
            *state = WorkerState::Refused;
            p.refused.push((h.src_rank, format!("a reply of {len} bytes exceeds max_reply ({max_reply})")));
        } else {
            if matches!(state, WorkerState::Waiting) {
                let frags = len.div_ceil(chunk).max(1);
                *state = WorkerState::Partial(Reassembly { buf: vec![0; len], held: vec![false; frags], left: frags });
            }
            let WorkerState::Partial(r) = state else { unreachable!("made partial above") };
            if r.buf.len() != len {
                self.stats.malformed += 1;
                return;
            }
            let k = off / chunk;
            if r.held[k] {
                self.stats.duplicates += 1;
                return;
            }
            r.held[k] = true;
            r.left -= 1;
            r.buf[off..off + payload.len()].copy_from_slice(payload);
            self.stats.fragments += 1;
            if r.left > 0 {
                return;
            }
            // A request ends as soon as its policy is met, so every whole
            // reply that reaches here is wanted.
            let reply = std::mem::take(&mut r.buf);
            match p.acc.add(h.src_rank, reply) {
                Ok(()) => {
                    *state = WorkerState::Answered;
                    p.answered.push(h.src_rank);
                }
                Err(why) => {
                    *state = WorkerState::Refused;
                    p.refused.push((h.src_rank, why));
                }
            }
        }
        let needed = p.spec.policy.needed(p.workers.len());
        if p.answered.len() >= needed {
            self.end(id, Outcome::Complete);
        } else if p.unanswered().next().is_none() {
            // Some replies were refused: nothing more can come.
            self.end(id, Outcome::Exhausted);
        }
    }
}

/// The result of user-path request `id` from what this process combined.
fn end_in_user(id: u32, outcome: Outcome, p: Pending) -> (Outcome, Result<Gathered>) {
    let missing: Vec<u16> = p.unanswered().collect();
    let what = describe(id, &p);
    let mut answered = p.answered;
    answered.sort_unstable();
    let r = p.acc.finish(&what).map(|value| Gathered {
        id,
        outcome,
        value,
        answered,
        missing,
        refused: p.refused,
        elapsed: p.t0.elapsed(),
        re_requests: p.re_requests,
    });
    (outcome, r)
}

/// Names request `id` in errors.
fn describe(id: u32, p: &Pending) -> String {
    format!("scatter-gather request {id} ({} over {} workers)", p.spec.combine, p.workers.len())
}

/// An epoll set of `fds` (level-triggered, readable).
fn wait_set(fds: &[RawFd]) -> Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned below.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(Error::io("epoll_create1 (scatter-gather wait set)", std::io::Error::last_os_error()));
    }
    // SAFETY: ep is a new fd nobody else owns.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    for &fd in fds {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
        // SAFETY: valid epoll fd, fd and event.
        if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(Error::io("epoll_ctl (scatter-gather wait set)", std::io::Error::last_os_error()));
        }
    }
    Ok(ep)
}

/// Waits up to `timeout` for something in `ep` to be readable.
fn wait_readable(ep: &OwnedFd, timeout: Duration) -> Result<()> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 2];
    // SAFETY: valid epoll fd and event buffer of len 2.
    let rc = unsafe { libc::epoll_wait(ep.as_raw_fd(), ev.as_mut_ptr(), 2, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("epoll_wait (scatter-gather)", e));
        }
    }
    Ok(())
}

impl AsRawFd for Coordinator {
    /// Readable when replies or (kernel path) done records wait: register
    /// it with epoll and call [`Coordinator::poll`] with a zero timeout
    /// when it fires.
    fn as_raw_fd(&self) -> RawFd {
        match &self.epoll {
            Some(ep) => ep.as_raw_fd(),
            None => self.sock.as_raw_fd(),
        }
    }
}
