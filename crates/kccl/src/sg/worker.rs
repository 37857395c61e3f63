//! A scatter-gather worker: an ordinary UDP server on the member's address
//! and port that answers each request of its group's coordinators with the
//! reply the application's handler makes, cut into datagrams of the group's
//! chunk size.  A repeated request (the coordinator asks again when a copy or
//! a reply was lost) gets the same reply from a cache, without running the
//! handler again, so that workers answer idempotently.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::combine::{Combine, Elem};
use crate::error::Result;
use crate::group::Group;
use crate::transport::sock::{BatchSocket, Datagram, RecvBatch};
use crate::wire::{self, Header, F_LAST_FRAG, HDR_LEN, MASK_BITS, T_SG_REPLY, T_SG_REQUEST};

/// A request as the handler sees it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub coordinator: u16,
    pub id: u32,
    pub combine: Combine,
    pub elem: Elem,
    pub body: &'a [u8],
}

/// Counters of a worker since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerStats {
    /// Requests the handler answered.
    pub requests: u64,
    /// Repeated requests answered from the cache.
    pub repeats: u64,
    /// Reply datagrams sent.
    pub datagrams: u64,
    /// Packets from another job, a non-member, an address that is not the
    /// member's, or not addressed to this worker.
    pub foreign: u64,
    /// Packets that are not a well-formed request.
    pub malformed: u64,
    /// Handler replies not sent: longer than a reply can be (4 GiB - 1).
    pub too_large: u64,
}

/// Replies kept for repeated requests: the newest `MAX_ENTRIES`, at most
/// `MAX_BYTES` together.
const MAX_ENTRIES: usize = 8192;
const MAX_BYTES: usize = 256 << 20;

/// A reply kept for a repeated request: only the same request (id, combine,
/// element type and bytes) gets it; a coordinator started again that reuses
/// an id with another request gets a fresh answer.
struct Cached {
    op: (u8, u8),
    body: Vec<u8>,
    reply: Arc<Vec<u8>>,
}

#[derive(Default)]
struct ReplyCache {
    map: HashMap<(u16, u32), Cached>,
    order: VecDeque<(u16, u32)>,
    bytes: usize,
}

impl ReplyCache {
    fn get(&self, key: (u16, u32), op: (u8, u8), body: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.map.get(&key).filter(|c| c.op == op && c.body == body).map(|c| c.reply.clone())
    }

    fn put(&mut self, key: (u16, u32), c: Cached) {
        self.bytes += c.reply.len() + c.body.len();
        if let Some(old) = self.map.insert(key, c) {
            self.bytes -= old.reply.len() + old.body.len();
        } else {
            self.order.push_back(key);
        }
        while self.order.len() > MAX_ENTRIES || (self.bytes > MAX_BYTES && self.order.len() > 1) {
            let k = self.order.pop_front().expect("non-empty");
            if let Some(c) = self.map.remove(&k) {
                self.bytes -= c.reply.len() + c.body.len();
            }
        }
    }
}

/// A reply to send: to whom, what, and the request it answers.
struct Answer {
    coordinator: u16,
    to: SocketAddrV4,
    reply: Arc<Vec<u8>>,
    req: Header,
}

/// A worker: see the module comment.
pub struct Worker {
    group: Group,
    rank: u16,
    sock: BatchSocket,
    rb: RecvBatch,
    chunk: usize,
    cache: ReplyCache,
    stats: WorkerStats,
}

impl Worker {
    /// A worker for member `rank` of `group`, bound to its address and port.
    pub fn new(group: &Group, rank: u16) -> Result<Worker> {
        let me = group.member(rank.into())?;
        let sock = BatchSocket::bind(me.addr, me.port, 4 << 20, 8 << 20)?;
        let chunk = group.chunk_bytes as usize;
        Ok(Worker {
            group: group.clone(),
            rank,
            sock,
            rb: RecvBatch::new(64, HDR_LEN + chunk),
            chunk,
            cache: ReplyCache::default(),
            stats: WorkerStats::default(),
        })
    }

    pub fn stats(&self) -> WorkerStats {
        self.stats
    }

    /// Serves until `stop` is set or `until` passes (checked at least every
    /// 50 ms).
    pub fn serve(
        &mut self,
        mut handler: impl FnMut(&Request<'_>) -> Vec<u8>,
        stop: &AtomicBool,
        until: Option<Instant>,
    ) -> Result<()> {
        while !stop.load(Ordering::Relaxed) && until.is_none_or(|u| Instant::now() < u) {
            self.serve_batch(&mut handler, Duration::from_millis(50))?;
        }
        Ok(())
    }

    /// Answers the requests of one receive batch (waits up to `timeout` for
    /// one); returns how many requests it answered.
    pub fn serve_batch(
        &mut self,
        handler: &mut impl FnMut(&Request<'_>) -> Vec<u8>,
        timeout: Duration,
    ) -> Result<usize> {
        let n = self.sock.recv_batch(&mut self.rb, Some(timeout))?;
        let mut answered = 0;
        for i in 0..n {
            let Some(a) = self.take(i, handler) else { continue };
            self.send_reply(a.coordinator, a.to, &a.reply, a.req)?;
            answered += 1;
        }
        Ok(answered)
    }

    /// Datagram i of the batch: the reply to send, or None (dropped).
    fn take(&mut self, i: usize, handler: &mut impl FnMut(&Request<'_>) -> Vec<u8>) -> Option<Answer> {
        let (dgram, from) = self.rb.get(i);
        let Some((h, body)) = dgram.ok().and_then(|d| Header::decode(d).ok()) else {
            self.stats.malformed += 1;
            return None;
        };
        let (Some(combine), Some(elem)) = (Combine::from_wire(h.agg_op), Elem::from_wire(h.dtype)) else {
            self.stats.malformed += 1;
            return None;
        };
        if h.msg_type != T_SG_REQUEST || h.frag_off != 0 || h.msg_len as usize != body.len() {
            self.stats.malformed += 1;
            return None;
        }
        let coordinator = self.group.member(h.src_rank.into()).ok().map(|m| SocketAddrV4::new(m.addr, m.port));
        let my_bit = h.dst_mask.checked_shr(u32::from(self.rank.wrapping_sub(h.mask_base))).unwrap_or(0) & 1;
        if h.job_id != self.group.job_id
            || coordinator != Some(from)
            || h.src_rank == self.rank
            || self.rank < h.mask_base
            || usize::from(self.rank - h.mask_base) >= MASK_BITS
            || my_bit == 0
        {
            self.stats.foreign += 1;
            return None;
        }
        let key = (h.src_rank, h.msg_seq);
        let op = (h.agg_op, h.dtype);
        let reply = match self.cache.get(key, op, body) {
            Some(r) => {
                self.stats.repeats += 1;
                r
            }
            None => {
                let req = Request { coordinator: h.src_rank, id: h.msg_seq, combine, elem, body };
                let r = Arc::new(handler(&req));
                self.stats.requests += 1;
                self.cache.put(key, Cached { op, body: body.to_vec(), reply: r.clone() });
                r
            }
        };
        Some(Answer { coordinator: h.src_rank, to: from, reply, req: h })
    }

    fn send_reply(&mut self, coordinator: u16, to: SocketAddrV4, reply: &[u8], req: Header) -> Result<()> {
        if u32::try_from(reply.len()).is_err() {
            // The coordinator waits for it until its deadline and names this
            // worker as missing.
            self.stats.too_large += 1;
            return Ok(());
        }
        let base = coordinator - coordinator % MASK_BITS as u16;
        let frags: Vec<(usize, &[u8])> = if reply.is_empty() {
            vec![(0, reply)]
        } else {
            reply.chunks(self.chunk).enumerate().map(|(k, c)| (k * self.chunk, c)).collect()
        };
        let heads: Vec<[u8; HDR_LEN]> = frags
            .iter()
            .map(|&(off, c)| {
                Header {
                    version: wire::VERSION,
                    msg_type: T_SG_REPLY,
                    flags: if off + c.len() == reply.len() { F_LAST_FRAG } else { 0 },
                    job_id: self.group.job_id,
                    src_rank: self.rank,
                    mask_base: base,
                    dst_mask: 1u64 << (coordinator - base),
                    msg_seq: req.msg_seq,
                    frag_off: off as u32,
                    msg_len: reply.len() as u32,
                    payload_len: c.len() as u16,
                    agg_op: req.agg_op,
                    dtype: req.dtype,
                }
                .to_bytes()
            })
            .collect();
        let dgrams: Vec<Datagram<'_>> =
            heads.iter().zip(&frags).map(|(h, &(_, c))| Datagram { to, head: h, body: c }).collect();
        self.sock.send_all(&dgrams)?;
        self.stats.datagrams += dgrams.len() as u64;
        Ok(())
    }
}

impl AsRawFd for Worker {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

/// The reply of the vector worker (`kccl sg-worker --reply vector:N`): N
/// int32 elements derived from the request's bytes and the worker's rank, in
/// [-99,999, 99,999], so a coordinator can check a combined result exactly
/// ([`sample_sum`]).
pub fn sample_vector(rank: u16, body: &[u8], len: usize) -> Vec<i32> {
    let seed = body.iter().fold(0i32, |a, &b| a.wrapping_mul(31).wrapping_add(b.into()));
    (0..len)
        .map(|i| seed.wrapping_add((i as i32).wrapping_mul(7)).wrapping_mul(i32::from(rank) + 1) % 100_000)
        .collect()
}

/// The SUM of the vector workers `ranks`' replies to `body`.
pub fn sample_sum(ranks: &[u16], body: &[u8], len: usize) -> Result<Vec<i32>> {
    let mut acc = super::combine::Acc::new(Combine::Sum, Elem::I32);
    for &r in ranks {
        acc.add(r, super::combine::encode_i32(&sample_vector(r, body, len))).map_err(crate::Error::Usage)?;
    }
    match acc.finish("the vector workers' sum")? {
        super::combine::Value::I32(v) => Ok(v),
        _ => unreachable!("an int32 SUM"),
    }
}
