//! The kernel scatter-gather engine seen from user space: `xdp_sg` on the
//! coordinator's interface combines the workers' replies per request slot,
//! `kccl_sg_ctl` (run through BPF_PROG_TEST_RUN, never attached) opens and
//! closes slots, the `sg_done` ring buffer says which requests met their
//! policy, and `sg_acc` (mmapped) holds their elements.  Layouts:
//! bpf/include/kccl_sg.h, checked against the skeleton's types below;
//! protocol: docs/SCATTER_GATHER.md.

use std::collections::VecDeque;
use std::mem::size_of;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libbpf_rs::{MapCore, MapFlags, RingBuffer, RingBufferBuilder};

use crate::error::{Error, Result};
use crate::kernel::agg::XdpMode;
use crate::kernel::{
    attach_xdp, load_skeleton, member_entry, no_rodata, open_skeleton, sum_percpu, verified_insns, write_member_entry,
};
use crate::skel_sg::types::{kccl_sg_ctl, kccl_sg_done, kccl_sg_slot};
use crate::skel_sg::{XdpSgSkel, XdpSgSkelBuilder};

/// Ranks a kernel-path request can ask (KCCL_SG_MAX_RANKS).
pub const SG_MAX_RANKS: usize = 1024;
/// Elements of one reply the kernel combines (KCCL_SG_MAX_ELEMS).
pub const SG_MAX_ELEMS: usize = 1024;
/// Requests in flight at most (KCCL_SG_MAX_SLOTS).
pub const SG_MAX_SLOTS: u32 = 65536;

const CMD_OPEN: u32 = 1;
const CMD_CLOSE: u32 = 2;
const CTL_OK: u32 = 1;
const CTL_BAD: u32 = 2;
const CTL_NOT_OURS: u32 = 3;
const FLAG_OVERFLOW: u16 = 1;
/// enum kccl_sg_state.
const STATE_OPEN: u32 = 1;
const STATE_DONE: u32 = 2;
const STATE_CLOSED: u32 = 3;

/// The slot state a CLOSE found (enum kccl_sg_state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SgSlotState {
    /// Replies were still being combined: the policy was not met.
    Open,
    /// The policy was met (its done record was delivered or lost).
    Done,
    /// Closed before.
    Closed,
}

/// Configuration of the engine (read-only globals and map sizes).
#[derive(Debug, Clone)]
pub struct SgEngineConfig {
    pub job_id: u32,
    /// The coordinator's UDP port (replies go there).
    pub port: u16,
    /// Requests in flight at most: a power of two, 1 ..= SG_MAX_SLOTS.
    pub nslots: u32,
    /// Bytes of the done ring buffer (a power of two, pages).
    pub ring_bytes: u32,
}

impl SgEngineConfig {
    pub fn new(job_id: u32, port: u16) -> SgEngineConfig {
        SgEngineConfig { job_id, port, nslots: 4096, ring_bytes: 1 << 20 }
    }

    pub fn validate(&self) -> Result<()> {
        if self.port == 0 {
            return Err(Error::Usage("the scatter-gather engine needs the coordinator's UDP port (0 given)".into()));
        }
        if !self.nslots.is_power_of_two() || self.nslots > SG_MAX_SLOTS {
            return Err(Error::Usage(format!(
                "scatter-gather slots must be a power of two up to {SG_MAX_SLOTS}, not {}",
                self.nslots
            )));
        }
        if !self.ring_bytes.is_power_of_two() || self.ring_bytes < 4096 {
            return Err(Error::Usage(format!(
                "the done ring must be a power of two of at least 4096 bytes, not {}",
                self.ring_bytes
            )));
        }
        Ok(())
    }
}

/// A request that met its policy in the kernel (struct kccl_sg_done).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SgDone {
    pub req_id: u32,
    pub slot: u32,
    pub answered: u32,
    pub nelem: u32,
    /// First element whose int64 sum overflowed.
    pub overflow_at: Option<u32>,
    pub op: u8,
    pub dtype: u8,
    /// Ranks whose replies are in.
    pub seen: Vec<u16>,
}

/// What a CLOSE found in a request's slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SgClosed {
    pub state: SgSlotState,
    pub answered: u32,
    pub nelem: u32,
    pub overflow_at: Option<u32>,
    pub asked: Vec<u16>,
    pub seen: Vec<u16>,
    /// Ranks whose reply the kernel could not combine (too long, another
    /// op or type), without those whose good reply came later.
    pub refused: Vec<u16>,
}

/// What a request's slot holds, read without closing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SgPeek {
    pub state: SgSlotState,
    pub answered: u32,
    pub asked: Vec<u16>,
    pub seen: Vec<u16>,
    /// Ranks whose reply the kernel could not combine (see [`SgClosed`]).
    pub refused: Vec<u16>,
}

/// The counters of enum kccl_sg_stat, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SgStats {
    pub passed: u64,
    pub other_job: u64,
    pub unclaimed: u64,
    pub combined: u64,
    pub completed: u64,
    pub dup: u64,
    pub late: u64,
    pub not_member: u64,
    pub not_asked: u64,
    pub mismatch: u64,
    pub too_long: u64,
    pub malformed: u64,
    pub ring_full: u64,
    pub opened: u64,
    pub taken_over: u64,
    pub closed: u64,
}

const NR_STATS: usize = 16;

impl SgStats {
    fn from_array(a: [u64; NR_STATS]) -> SgStats {
        SgStats {
            passed: a[0],
            other_job: a[1],
            unclaimed: a[2],
            combined: a[3],
            completed: a[4],
            dup: a[5],
            late: a[6],
            not_member: a[7],
            not_asked: a[8],
            mismatch: a[9],
            too_long: a[10],
            malformed: a[11],
            ring_full: a[12],
            opened: a[13],
            taken_over: a[14],
            closed: a[15],
        }
    }
}

/// sg_acc mapped read-only into this process.
struct AccMap {
    ptr: NonNull<i64>,
    len: usize,
}

impl AccMap {
    fn new(fd: i32, nslots: u32) -> Result<AccMap> {
        let len = nslots as usize * SG_MAX_ELEMS * size_of::<i64>();
        // SAFETY: mapping a BPF_F_MMAPABLE array map fd of exactly its size.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::io("mapping sg_acc (mmap of the accumulators)", std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(p.cast::<i64>())
            .ok_or_else(|| Error::io("mapping sg_acc", std::io::Error::other("mmap returned NULL")))?;
        Ok(AccMap { ptr, len })
    }

    fn slot(&self, slot: u32, nelem: u32) -> &[i64] {
        let at = slot as usize * SG_MAX_ELEMS;
        let n = (nelem as usize).min(SG_MAX_ELEMS);
        assert!((at + SG_MAX_ELEMS) * size_of::<i64>() <= self.len, "slot index within the map");
        // SAFETY: within the mapping (asserted); the kernel writes a slot
        // only while it is OPEN, and callers read DONE/CLOSED slots.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), n) }
    }
}

impl Drop for AccMap {
    fn drop(&mut self) {
        // SAFETY: unmapping what new() mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: the mapping is read-only shared memory owned by this struct.
unsafe impl Send for AccMap {}

fn ranks_of(mask: &[u64]) -> Vec<u16> {
    let mut v = Vec::new();
    for (w, &bits) in mask.iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            v.push((w * 64) as u16 + b.trailing_zeros() as u16);
            b &= b - 1;
        }
    }
    v
}

/// kccl_sg_ctl answered with a result this runtime does not know: the
/// program and the runtime were built from different kccl_sg.h.
fn ctl_answer(cmd: &str, req_id: u32, result: u32) -> Error {
    Error::io(
        format!("kccl_sg_ctl {cmd} of request {req_id}"),
        std::io::Error::other(format!("unknown result {result}: xdp_sg and the runtime disagree; rebuild kccl")),
    )
}

fn parse_done(raw: &[u8]) -> Option<SgDone> {
    if raw.len() < size_of::<kccl_sg_done>() {
        return None;
    }
    // SAFETY: length checked; kccl_sg_done is plain old data.
    let d: kccl_sg_done = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
    Some(SgDone {
        req_id: d.req_id,
        slot: d.slot,
        answered: d.answered,
        nelem: d.nelem,
        overflow_at: (d.flags & FLAG_OVERFLOW != 0).then_some(d.overflow_at),
        op: d.op,
        dtype: d.dtype,
        seen: ranks_of(&d.seen),
    })
}

/// The scatter-gather engine of one job on one interface.
pub struct SgEngine {
    xdp_link: Option<OwnedFd>,
    xdp_mode: Option<XdpMode>,
    cfg: SgEngineConfig,
    done: VecDeque<SgDone>,
    inbox: Arc<Mutex<Vec<SgDone>>>,
    ring: RingBuffer<'static>,
    acc: AccMap,
    skel: XdpSgSkel<'static>,
}

impl SgEngine {
    /// Loads xdp_sg (not attached): for BPF_PROG_TEST_RUN fixtures and for
    /// [`SgEngine::load`].
    pub fn open(cfg: &SgEngineConfig) -> Result<SgEngine> {
        cfg.validate()?;
        const WHAT: &str = "the scatter-gather engine (xdp_sg)";
        let mut open = open_skeleton::<XdpSgSkelBuilder>(WHAT)?;
        let ro = open.maps.rodata_data.as_deref_mut().ok_or_else(|| no_rodata("xdp_sg"))?;
        ro.cfg_job_id = cfg.job_id;
        ro.cfg_port = cfg.port;
        ro.cfg_nslots = cfg.nslots;
        let sizing = |e| Error::Bpf { step: "sizing the scatter-gather maps".into(), source: e };
        open.maps.sg_slots.set_max_entries(cfg.nslots).map_err(sizing)?;
        open.maps.sg_acc.set_max_entries(cfg.nslots).map_err(sizing)?;
        open.maps.sg_done.set_max_entries(cfg.ring_bytes).map_err(sizing)?;
        let skel = load_skeleton(open, WHAT)?;
        let acc = AccMap::new(skel.maps.sg_acc.as_fd().as_raw_fd(), cfg.nslots)?;
        let inbox: Arc<Mutex<Vec<SgDone>>> = Arc::default();
        let sink = Arc::clone(&inbox);
        let mut b = RingBufferBuilder::new();
        b.add(&skel.maps.sg_done, move |raw: &[u8]| {
            if let (Some(d), Ok(mut q)) = (parse_done(raw), sink.lock()) {
                q.push(d);
            }
            0
        })
        .map_err(|e| Error::Bpf { step: "reading the sg_done ring buffer".into(), source: e })?;
        let ring = b.build().map_err(|e| Error::Bpf { step: "reading the sg_done ring buffer".into(), source: e })?;
        Ok(SgEngine { xdp_link: None, xdp_mode: None, cfg: cfg.clone(), done: VecDeque::new(), inbox, ring, acc, skel })
    }

    /// Loads xdp_sg and attaches it to `ifindex` (in the calling thread's
    /// namespace); detached when the engine is dropped.
    pub fn load(cfg: &SgEngineConfig, ifindex: u32) -> Result<SgEngine> {
        let mut e = SgEngine::open(cfg)?;
        let (link, mode) = attach_xdp(e.skel.progs.kccl_xdp_sg.as_fd().as_raw_fd(), ifindex, "xdp_sg")?;
        e.xdp_link = Some(link);
        e.xdp_mode = Some(mode);
        Ok(e)
    }

    pub fn xdp_mode(&self) -> Option<XdpMode> {
        self.xdp_mode
    }

    pub fn config(&self) -> &SgEngineConfig {
        &self.cfg
    }

    /// members[rank]: replies of `rank` are accepted only from this address.
    pub fn set_member(&mut self, rank: u16, ip: Ipv4Addr, port: u16) -> Result<()> {
        if rank as usize >= SG_MAX_RANKS {
            return Err(Error::Usage(format!(
                "rank {rank} exceeds the kernel scatter-gather limit of {SG_MAX_RANKS} ranks"
            )));
        }
        write_member_entry(&self.skel.maps.members, rank, &member_entry(ip, port, None))
    }

    fn ctl(&self, c: &mut kccl_sg_ctl, what: &str) -> Result<u32> {
        // SAFETY: kccl_sg_ctl is plain old data; viewed as its bytes.
        let input =
            unsafe { std::slice::from_raw_parts((c as *const kccl_sg_ctl).cast::<u8>(), size_of::<kccl_sg_ctl>()) };
        let mut out = vec![0u8; size_of::<kccl_sg_ctl>()];
        self.skel
            .progs
            .kccl_sg_ctl
            .test_run(libbpf_rs::ProgramInput { data_in: Some(input), data_out: Some(&mut out), ..Default::default() })
            .map_err(|e| Error::Bpf { step: format!("running kccl_sg_ctl ({what})"), source: e })?;
        // SAFETY: out holds size_of::<kccl_sg_ctl>() bytes written by the program.
        *c = unsafe { std::ptr::read_unaligned(out.as_ptr().cast()) };
        Ok(c.result)
    }

    /// Opens request `req_id`'s slot: the replies of `asked` are combined
    /// with `op` over `dtype` elements until `need` of them are in.
    pub fn open_request(&self, req_id: u32, need: u32, op: u8, dtype: u8, asked: &[u16]) -> Result<()> {
        let mut c = kccl_sg_ctl { cmd: CMD_OPEN, req_id, need, op, dtype, ..Default::default() };
        for &r in asked {
            if r as usize >= SG_MAX_RANKS {
                return Err(Error::Usage(format!(
                    "worker rank {r} exceeds the kernel scatter-gather limit of {SG_MAX_RANKS} ranks"
                )));
            }
            c.asked[r as usize / 64] |= 1u64 << (r % 64);
        }
        match self.ctl(&mut c, "open")? {
            CTL_OK => Ok(()),
            CTL_BAD => Err(Error::Usage(format!(
                "the kernel refused request {req_id}: need {need} of {} workers, op {op}, type {dtype} \
                 (it combines SUM, COUNT, MAX, MIN of int32/int64)",
                asked.len()
            ))),
            r => Err(ctl_answer("open", req_id, r)),
        }
    }

    /// Closes request `req_id`: no reply is combined into it afterwards.
    /// None when its slot holds another request (or none).
    pub fn close_request(&self, req_id: u32) -> Result<Option<SgClosed>> {
        let mut c = kccl_sg_ctl { cmd: CMD_CLOSE, req_id, ..Default::default() };
        match self.ctl(&mut c, "close")? {
            CTL_OK => {}
            CTL_NOT_OURS => return Ok(None),
            r => return Err(ctl_answer("close", req_id, r)),
        }
        let state = match c.state {
            STATE_OPEN => SgSlotState::Open,
            STATE_DONE => SgSlotState::Done,
            _ => SgSlotState::Closed,
        };
        let refused: Vec<u64> = c.refused.iter().zip(c.seen.iter()).map(|(r, s)| r & !s).collect();
        Ok(Some(SgClosed {
            state,
            answered: c.answered,
            nelem: c.nelem,
            overflow_at: (c.flags & FLAG_OVERFLOW != 0).then_some(c.overflow_at),
            asked: ranks_of(&c.asked),
            seen: ranks_of(&c.seen),
            refused: ranks_of(&refused),
        }))
    }

    /// What request `req_id`'s slot holds now, read under its lock without
    /// changing it (the re-request timer and the exhaustion check read it):
    /// None when the slot holds another request or none.
    pub fn peek(&self, req_id: u32) -> Result<Option<SgPeek>> {
        let idx = self.slot_of(req_id);
        let raw = self
            .skel
            .maps
            .sg_slots
            .lookup(&idx.to_ne_bytes(), MapFlags::LOCK)
            .map_err(|e| Error::Bpf { step: format!("reading scatter-gather slot {idx}"), source: e })?;
        let Some(raw) = raw.filter(|r| r.len() >= size_of::<kccl_sg_slot>()) else { return Ok(None) };
        // SAFETY: raw holds a whole kccl_sg_slot (checked above), plain old data.
        let s: kccl_sg_slot = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
        let state = match s.state {
            STATE_OPEN => SgSlotState::Open,
            STATE_DONE => SgSlotState::Done,
            STATE_CLOSED => SgSlotState::Closed,
            _ => return Ok(None),
        };
        if s.req_id != req_id {
            return Ok(None);
        }
        let refused: Vec<u64> = s.refused.iter().zip(s.seen.iter()).map(|(r, s)| r & !s).collect();
        Ok(Some(SgPeek {
            state,
            answered: s.answered,
            asked: ranks_of(&s.asked),
            seen: ranks_of(&s.seen),
            refused: ranks_of(&refused),
        }))
    }

    /// The combined elements of a DONE or CLOSED request's slot (valid
    /// until the slot is opened again).
    pub fn values(&self, slot: u32, nelem: u32) -> &[i64] {
        self.acc.slot(slot & (self.cfg.nslots - 1), nelem)
    }

    /// The slot of request `req_id`.
    pub fn slot_of(&self, req_id: u32) -> u32 {
        req_id & (self.cfg.nslots - 1)
    }

    /// Done records that arrived: waits up to `timeout` for one when none is
    /// queued (Duration::ZERO: busy-poll, no wait).
    pub fn poll_done(&mut self, timeout: Duration) -> Result<Vec<SgDone>> {
        let consume = |r: &RingBuffer<'static>| -> Result<()> {
            r.consume().map_err(|e| Error::Bpf { step: "consuming the sg_done ring buffer".into(), source: e })
        };
        consume(&self.ring)?;
        let mut got = self.take_inbox();
        if got.is_empty() && !timeout.is_zero() {
            self.ring
                .poll(timeout)
                .map_err(|e| Error::Bpf { step: "polling the sg_done ring buffer".into(), source: e })?;
            got = self.take_inbox();
        }
        self.done.extend(got);
        Ok(self.done.drain(..).collect())
    }

    fn take_inbox(&self) -> Vec<SgDone> {
        self.inbox.lock().map(|mut q| std::mem::take(&mut *q)).unwrap_or_default()
    }

    /// The ring buffer's epoll fd (readable when done records wait).
    pub fn done_fd(&self) -> i32 {
        self.ring.epoll_fd()
    }

    pub fn stats(&self) -> Result<SgStats> {
        Ok(SgStats::from_array(sum_percpu::<NR_STATS>(&self.skel.maps.sg_stats, "sg_stats")?))
    }

    /// One BPF_PROG_TEST_RUN of xdp_sg: (verdict, output frame).
    pub fn run_xdp_sg(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        let mut out = vec![0u8; frame.len() + 256];
        let (verdict, n) = self
            .skel
            .progs
            .kccl_xdp_sg
            .test_run(libbpf_rs::ProgramInput { data_in: Some(frame), data_out: Some(&mut out), ..Default::default() })
            .map(|r| (r.return_value, r.data.map_or(0, |d| d.len())))
            .map_err(|e| Error::Bpf { step: "running xdp_sg (BPF_PROG_TEST_RUN)".into(), source: e })?;
        out.truncate(n);
        Ok((verdict, out))
    }

    /// Instructions the verifier processed for (xdp_sg, kccl_sg_ctl).
    pub fn verified_insns(&self) -> Result<(u32, u32)> {
        Ok((
            verified_insns(self.skel.progs.kccl_xdp_sg.as_fd().as_raw_fd())?,
            verified_insns(self.skel.progs.kccl_sg_ctl.as_fd().as_raw_fd())?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASK_WORDS: usize = SG_MAX_RANKS / 64;

    #[test]
    fn layouts_match_kccl_sg_h() {
        assert_eq!(size_of::<kccl_sg_slot>(), 40 + 3 * 8 * MASK_WORDS);
        assert_eq!(size_of::<kccl_sg_ctl>(), 40 + 3 * 8 * MASK_WORDS);
        assert_eq!(size_of::<kccl_sg_done>(), 24 + 8 * MASK_WORDS);
        assert_eq!(size_of::<crate::skel_sg::types::kccl_sg_acc>(), SG_MAX_ELEMS * 8);
    }

    #[test]
    fn done_record_golden_bytes() {
        let mut raw = vec![0u8; size_of::<kccl_sg_done>()];
        raw[0..4].copy_from_slice(&7u32.to_ne_bytes()); // req_id
        raw[4..8].copy_from_slice(&3u32.to_ne_bytes()); // slot
        raw[8..12].copy_from_slice(&2u32.to_ne_bytes()); // answered
        raw[12..16].copy_from_slice(&363u32.to_ne_bytes()); // nelem
        raw[16..18].copy_from_slice(&1u16.to_ne_bytes()); // flags: overflow
        raw[18] = 1; // op SUM
        raw[19] = 2; // dtype I64
        raw[20..24].copy_from_slice(&5u32.to_ne_bytes()); // overflow_at
        raw[24..32].copy_from_slice(&0b1010u64.to_ne_bytes()); // seen word 0
        raw[24 + 8 * 15..].copy_from_slice(&(1u64 << 63).to_ne_bytes()); // rank 1023
        let d = parse_done(&raw).expect("a whole record");
        assert_eq!(
            d,
            SgDone {
                req_id: 7,
                slot: 3,
                answered: 2,
                nelem: 363,
                overflow_at: Some(5),
                op: 1,
                dtype: 2,
                seen: vec![1, 3, 1023],
            }
        );
        assert_eq!(parse_done(&raw[..raw.len() - 1]), None);
    }
}
