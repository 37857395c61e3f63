//! The kernel aggregation engine seen from user space: `xdp_agg` (XDP, the
//! aggregation itself) and `tc_agg_result` (TCX ingress, the fan-out of the
//! answers) on the aggregator's interface, loaded and configured together.
//!
//! Both objects use ONE members map and ONE counter map: the second object
//! reuses the first one's maps before it is loaded.  Layouts come from the
//! skeletons' generated types (bpf/include/kccl_agg.h), checked by the tests
//! below; see docs/AGGREGATION.md for the protocol.

use std::mem::{offset_of, size_of};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, RingBuffer, RingBufferBuilder};

use crate::error::{Error, Result};
use crate::group::{Group, MAX_MEMBERS};
use crate::kernel::{member_entry, neighbours, skeleton_storage, write_member_entry, MissEvent, CLONE_MARK};
use crate::skel_agg::types::kccl_agg_record;
use crate::skel_agg::{XdpAggSkel, XdpAggSkelBuilder};
use crate::skel_agg_result::{TcAggResultSkel, TcAggResultSkelBuilder};

/// Largest chunk payload the kernel aggregates (KCCL_AGG_MAX_PAYLOAD).
pub const MAX_CHUNK_BYTES: u32 = 3432;
/// Accumulators per slot (KCCL_AGG_MAX_ELEMS).
pub const MAX_ELEMS: usize = MAX_CHUNK_BYTES as usize / 4;
/// Bytes of a ring buffer record before the values (KCCL_AGG_RECORD_HDR_LEN).
pub const RECORD_HDR_LEN: usize = 32;
/// Default chunk size: a 1500-byte MTU (1500 - 20 - 8 - 40).
pub const DEFAULT_CHUNK_BYTES: u32 = 1432;
/// Largest slot count [`AggEngine::load`] accepts (a slot is ~6.9 KiB).
pub const MAX_SLOTS: u32 = 1 << 14;

// The C headers are the definition; fail the build if the generated copies move.
const _: () = assert!(size_of::<kccl_agg_record>() == RECORD_HDR_LEN + MAX_ELEMS * 8);
const _: () = assert!(offset_of!(kccl_agg_record, acc) == RECORD_HDR_LEN);
const _: () = assert!(
    size_of::<crate::skel_agg::types::kccl_member>() == size_of::<crate::skel::types::kccl_member>()
        && size_of::<crate::skel_agg_result::types::kccl_member>() == size_of::<crate::skel::types::kccl_member>()
);

// enum kccl_dtype
const DT_I32: u8 = 1;
const DT_I64: u8 = 2;
const DT_F32Q: u8 = 3;

/// Configuration of the engine (read-only globals of the programs and map
/// sizes, fixed at load).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggEngineConfig {
    pub job_id: u32,
    /// The aggregator's UDP port (contributions go there).
    pub port: u16,
    /// The aggregator's rank (src_rank of the answers).
    pub my_rank: u16,
    /// The job's chunk size: a multiple of 8, at most [`MAX_CHUNK_BYTES`].
    pub chunk_bytes: u32,
    /// Aggregation slots: a power of two, at most [`MAX_SLOTS`].
    pub nslots: u32,
    /// An unfinished chunk older than this may lose its slot.
    pub slot_timeout: Duration,
    /// Ring buffer size for reduce records: a power of two >= 16 KiB.
    pub ring_bytes: u32,
    /// Wake the reader when the ring holds more than this (or an operation
    /// completed); below, records are written without a wake-up.
    pub wakeup_bytes: u32,
    /// The job's largest contributor window (AggConfig::window): below
    /// nslots; a contribution of chunk c proves its sender holds every
    /// answer below c + 1 - window (docs/AGGREGATION.md, "Slot reuse").
    pub window: u32,
}

impl AggEngineConfig {
    /// Defaults: chunk 1432 bytes, 1024 slots, 2 s slot timeout, 64 MiB ring,
    /// wake-up after 1 MiB.
    pub fn new(job_id: u32, port: u16, my_rank: u16) -> Self {
        AggEngineConfig {
            job_id,
            port,
            my_rank,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            nslots: 1024,
            slot_timeout: Duration::from_secs(2),
            ring_bytes: 64 << 20,
            wakeup_bytes: 1 << 20,
            window: 256,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, msg: String| Err(Error::AggConfig { field, msg });
        if self.port == 0 {
            return bad("port", "0 is not a UDP port contributors can send to".into());
        }
        if usize::from(self.my_rank) >= MAX_MEMBERS {
            return bad("my_rank", format!("{} is outside 0..{}", self.my_rank, MAX_MEMBERS - 1));
        }
        if self.chunk_bytes == 0 || self.chunk_bytes > MAX_CHUNK_BYTES || self.chunk_bytes % 8 != 0 {
            return bad(
                "chunk_bytes",
                format!(
                    "{} must be a multiple of 8 (whole int32 and int64 elements) between 8 and {MAX_CHUNK_BYTES}",
                    self.chunk_bytes
                ),
            );
        }
        if !self.nslots.is_power_of_two() || self.nslots > MAX_SLOTS {
            return bad("nslots", format!("{} must be a power of two between 1 and {MAX_SLOTS}", self.nslots));
        }
        if self.window == 0 || self.window >= self.nslots {
            return bad("window", format!("{} must be at least 1 and below nslots {}", self.window, self.nslots));
        }
        if self.slot_timeout.is_zero() || self.slot_timeout.as_nanos() > u128::from(u64::MAX) {
            return bad("slot_timeout", format!("{:?} must be positive and fit 64-bit nanoseconds", self.slot_timeout));
        }
        if !self.ring_bytes.is_power_of_two() || self.ring_bytes < 16 << 10 {
            return bad(
                "ring_bytes",
                format!("{} must be a power of two of at least 16384 (a full record is 6896 bytes)", self.ring_bytes),
            );
        }
        if self.wakeup_bytes >= self.ring_bytes {
            return bad(
                "wakeup_bytes",
                format!(
                    "{} must be below ring_bytes ({}): the ring would fill first",
                    self.wakeup_bytes, self.ring_bytes
                ),
            );
        }
        Ok(())
    }
}

/// How the XDP program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum XdpMode {
    /// In the driver (XDP_FLAGS_DRV_MODE).
    Native,
    /// Generic (skb) mode: the driver refused native mode.
    Generic,
}

macro_rules! agg_stats {
    ($($(#[$doc:meta])* $field:ident),* $(,)?) => {
        /// Counters of xdp_agg and tc_agg_result (enum kccl_agg_stat, same
        /// order), summed over CPUs.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
        pub struct AggStats {
            $($(#[$doc])* pub $field: u64,)*
        }

        impl AggStats {
            const N: usize = [$(stringify!($field)),*].len();

            fn from_array(a: [u64; Self::N]) -> AggStats {
                let mut it = a.into_iter();
                AggStats { $($field: it.next().unwrap_or(0),)* }
            }

            /// Counts since `before` (saturating: counters only grow).
            pub fn delta(&self, before: &AggStats) -> AggStats {
                AggStats { $($field: self.$field.saturating_sub(before.$field),)* }
            }
        }
    };
}

agg_stats! {
    /// Contributions added to a slot.
    pkts,
    /// Chunks completed.
    chunks_done,
    /// Allreduce result packets emitted (before fan-out).
    results,
    /// Reduce ack packets emitted (before fan-out).
    acks,
    /// Ring buffer records written.
    records,
    /// Contribution already counted (slot still active).
    dup,
    /// Contribution for a finished chunk: answer re-sent to its sender.
    dup_done,
    /// Slot held by another live chunk: dropped.
    busy,
    /// Abandoned chunk's slot taken after the deadline.
    reclaimed,
    /// Op/type/length/contributors differ from the slot's.
    mismatch,
    /// Sender not in the contributor mask.
    not_contrib,
    /// Source address is not the sender rank's.
    not_member,
    /// kccl magic but bad header: dropped.
    malformed,
    /// Op/type the kernel does not do: passed to user space.
    unsupported,
    /// KCCL_F_USER_ONLY: passed to user space.
    user_only,
    /// kccl packet of another job: passed.
    other_job,
    /// Ring buffer full: result kept, retried on retransmission.
    ring_full,
    /// Result chunks with a saturated or overflowed element.
    overflow,
    /// Not kccl aggregation traffic: passed.
    passed,
    /// tc_agg_result: copies sent.
    fanout_copies,
    /// tc_agg_result: destinations it could not serve.
    fanout_missed,
    /// Another chunk wanted a DONE slot whose answer not every contributor
    /// has proven to hold yet: dropped (retransmitted by its sender).
    held,
    /// PENDING answers (missing contributors) to counted retransmissions.
    pending,
    /// KCCL_T_AGG_RECEIPT packets taken.
    receipts,
    /// ACTIVE slots freed by the sweep (AggEngine::sweep).
    swept,
    /// Contributions of a chunk whose answer their sender already proved to
    /// hold (a late copy of a retransmission): dropped, never a new slot.
    stale,
}

/// enum kccl_slot_state
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free,
    Active,
    Delivering,
    Done,
    Undelivered,
    Unknown(u32),
}

impl From<u32> for SlotState {
    fn from(v: u32) -> Self {
        match v {
            0 => SlotState::Free,
            1 => SlotState::Active,
            2 => SlotState::Delivering,
            3 => SlotState::Done,
            4 => SlotState::Undelivered,
            x => SlotState::Unknown(x),
        }
    }
}

/// How many slots are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SlotSummary {
    pub free: u32,
    pub active: u32,
    pub delivering: u32,
    pub done: u32,
    pub undelivered: u32,
    pub unknown: u32,
}

/// One slot as user space reads it (the lock is not taken: a snapshot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub state: SlotState,
    pub expected: u64,
    pub seen: u64,
    pub claimed_ns: u64,
    pub job_id: u32,
    pub op_id: u32,
    pub frag_off: u32,
    pub msg_len: u32,
    pub payload_len: u16,
    pub mask_base: u16,
    pub agg_op: u8,
    pub dtype: u8,
    pub overflow: bool,
    pub contributors: u64,
    /// The accumulators in use (payload_len / element size of them).
    pub acc: Vec<i64>,
}

/// A completed reduce chunk from the ring buffer (struct kccl_agg_record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggRecordView<'a> {
    pub job_id: u32,
    pub op_id: u32,
    pub frag_off: u32,
    pub msg_len: u32,
    pub payload_len: u16,
    pub mask_base: u16,
    pub agg_op: u8,
    pub dtype: u8,
    /// An int64 sum overflowed (I64 only): the values are not the true sums.
    pub overflow: bool,
    /// The contributor set (bit i = rank mask_base + i).
    pub contributors: u64,
    values: &'a [i64],
}

impl AggRecordView<'_> {
    /// The chunk's combined values as int64 (payload_len / element size of them).
    pub fn values(&self) -> &[i64] {
        self.values
    }
}

/// Wire element size of `dtype`, None for a type the kernel does not know.
pub fn dtype_size(dtype: u8) -> Option<usize> {
    match dtype {
        DT_I32 | DT_F32Q => Some(4),
        DT_I64 => Some(8),
        _ => None,
    }
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_ne_bytes(a)
}

/// Header fields of a record (or of a slot's `rec`) at the start of `b`,
/// which holds at least RECORD_HDR_LEN bytes, and the number of values.
struct RecordHeader {
    job_id: u32,
    op_id: u32,
    frag_off: u32,
    msg_len: u32,
    payload_len: u16,
    mask_base: u16,
    agg_op: u8,
    dtype: u8,
    overflow: bool,
    contributors: u64,
    nvalues: usize,
}

fn parse_record_header(b: &[u8]) -> Result<RecordHeader> {
    type R = kccl_agg_record;
    if b.len() < RECORD_HDR_LEN {
        return Err(Error::AggRecord(format!("{} bytes, shorter than the {RECORD_HDR_LEN}-byte header", b.len())));
    }
    let payload_len = u16_at(b, offset_of!(R, payload_len));
    let dtype = b[offset_of!(R, dtype)];
    let size = dtype_size(dtype).ok_or_else(|| Error::AggRecord(format!("unknown dtype {dtype}")))?;
    let nvalues = usize::from(payload_len) / size;
    if usize::from(payload_len) % size != 0 || nvalues > MAX_ELEMS {
        return Err(Error::AggRecord(format!(
            "payload_len {payload_len} is not a whole number of dtype {dtype} elements"
        )));
    }
    Ok(RecordHeader {
        job_id: u32_at(b, offset_of!(R, job_id)),
        op_id: u32_at(b, offset_of!(R, op_id)),
        frag_off: u32_at(b, offset_of!(R, frag_off)),
        msg_len: u32_at(b, offset_of!(R, msg_len)),
        payload_len,
        mask_base: u16_at(b, offset_of!(R, mask_base)),
        agg_op: b[offset_of!(R, agg_op)],
        dtype,
        overflow: b[offset_of!(R, overflow)] != 0,
        contributors: u64_at(b, offset_of!(R, contributors)),
        nvalues,
    })
}

fn parse_values(b: &[u8], n: usize, out: &mut Vec<i64>) -> Result<()> {
    let need = RECORD_HDR_LEN + n * 8;
    let vals = b
        .get(RECORD_HDR_LEN..need)
        .ok_or_else(|| Error::AggRecord(format!("{} bytes, {need} needed for {n} values", b.len())))?;
    out.clear();
    out.extend(vals.chunks_exact(8).map(|c| u64_at(c, 0) as i64));
    Ok(())
}

/// Records copied out of the ring buffer by its callback (which must be
/// 'static), handed to the caller of poll_records.
#[derive(Default)]
struct RecordQueue {
    bytes: Vec<u8>,
    spans: Vec<(usize, usize)>,
}

/// The aggregation engine of one job on one interface.
pub struct AggEngine {
    // Links first: they are dropped (detached) before the programs.
    xdp_link: Option<OwnedFd>,
    tcx_link: Option<Link>,
    xdp_mode: Option<XdpMode>,
    ifindex: u32,
    iface: Option<String>,
    unresolved: Vec<u16>,
    cfg: AggEngineConfig,
    ring: RingBuffer<'static>,
    records: Arc<Mutex<RecordQueue>>,
    scratch: Vec<i64>,
    miss_ring: RingBuffer<'static>,
    misses: Arc<Mutex<Vec<MissEvent>>>,
    xdp: XdpAggSkel<'static>,
    result: TcAggResultSkel<'static>,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::KernelPathUnavailable { reason: format!("{what}: {e}") }
}

impl AggEngine {
    /// Loads both programs (not attached): for BPF_PROG_TEST_RUN fixtures and
    /// for [`AggEngine::load`].
    pub fn open(cfg: &AggEngineConfig) -> Result<AggEngine> {
        cfg.validate()?;
        const WHAT: &str = "the aggregation engine (xdp_agg)";
        let mut open = XdpAggSkelBuilder::default()
            .open(skeleton_storage(WHAT)?)
            .map_err(|e| unavailable(&format!("opening {WHAT} failed (kernel without BPF/BTF?)"), e))?;
        let ro = open
            .maps
            .rodata_data
            .as_deref_mut()
            .ok_or_else(|| Error::Usage("xdp_agg has no .rodata section (build problem)".into()))?;
        ro.cfg_job_id = cfg.job_id;
        ro.cfg_port = cfg.port;
        ro.cfg_my_rank = cfg.my_rank;
        ro.cfg_chunk_bytes = cfg.chunk_bytes;
        ro.cfg_nslots = cfg.nslots;
        ro.cfg_slot_timeout_ns = cfg.slot_timeout.as_nanos() as u64;
        ro.cfg_wakeup_bytes = u64::from(cfg.wakeup_bytes);
        ro.cfg_window = cfg.window;
        let sizing = |e| Error::Bpf { step: "sizing the aggregation maps".into(), source: e };
        open.maps.agg_slots.set_max_entries(cfg.nslots).map_err(sizing)?;
        open.maps.agg_records.set_max_entries(cfg.ring_bytes).map_err(sizing)?;
        let xdp = open.load().map_err(|e| unavailable(&format!("the kernel refused to load {WHAT}"), e))?;

        const WHAT_R: &str = "the aggregation fan-out (tc_agg_result)";
        let mut open = TcAggResultSkelBuilder::default()
            .open(skeleton_storage(WHAT_R)?)
            .map_err(|e| unavailable(&format!("opening {WHAT_R} failed"), e))?;
        let ro = open
            .maps
            .rodata_data
            .as_deref_mut()
            .ok_or_else(|| Error::Usage("tc_agg_result has no .rodata section (build problem)".into()))?;
        ro.cfg_job_id = cfg.job_id;
        ro.cfg_port = cfg.port;
        ro.cfg_my_rank = cfg.my_rank;
        ro.cfg_clone_mark = CLONE_MARK;
        let share = |e| Error::Bpf { step: "sharing members/agg_stats with tc_agg_result".into(), source: e };
        open.maps.members.reuse_fd(xdp.maps.members.as_fd()).map_err(share)?;
        open.maps.agg_stats.reuse_fd(xdp.maps.agg_stats.as_fd()).map_err(share)?;
        let result = open.load().map_err(|e| unavailable(&format!("the kernel refused to load {WHAT_R}"), e))?;

        let records: Arc<Mutex<RecordQueue>> = Arc::default();
        let sink = Arc::clone(&records);
        let mut rb = RingBufferBuilder::new();
        rb.add(&xdp.maps.agg_records, move |raw: &[u8]| {
            if let Ok(mut q) = sink.lock() {
                let start = q.bytes.len();
                q.bytes.extend_from_slice(raw);
                q.spans.push((start, raw.len()));
            }
            0
        })
        .map_err(|e| Error::Bpf { step: "adding the agg_records ring buffer".into(), source: e })?;
        let ring = rb.build().map_err(|e| Error::Bpf { step: "creating the record reader".into(), source: e })?;

        let misses: Arc<Mutex<Vec<MissEvent>>> = Arc::default();
        let msink = Arc::clone(&misses);
        let mut rb = RingBufferBuilder::new();
        rb.add(&result.maps.agg_miss_events, move |raw: &[u8]| {
            if let Some(ev) = crate::kernel::parse_miss_event(raw) {
                if let Ok(mut v) = msink.lock() {
                    v.push(ev);
                }
            }
            0
        })
        .map_err(|e| Error::Bpf { step: "adding the agg_miss_events ring buffer".into(), source: e })?;
        let miss_ring =
            rb.build().map_err(|e| Error::Bpf { step: "creating the miss event reader".into(), source: e })?;

        Ok(AggEngine {
            xdp_link: None,
            tcx_link: None,
            xdp_mode: None,
            ifindex: 0,
            iface: None,
            unresolved: Vec::new(),
            cfg: cfg.clone(),
            ring,
            records,
            scratch: Vec::with_capacity(MAX_ELEMS),
            miss_ring,
            misses,
            xdp,
            result,
        })
    }

    /// Loads both programs and attaches them to `ifindex` (in the calling
    /// thread's namespace): xdp_agg in native mode (generic if the driver
    /// refuses, see [`AggEngine::xdp_mode`]), tc_agg_result at TCX ingress.
    /// The links are removed when the engine is dropped (or the process dies).
    pub fn load(cfg: &AggEngineConfig, ifindex: u32) -> Result<AggEngine> {
        let mut e = AggEngine::open(cfg)?;
        e.attach(ifindex)?;
        Ok(e)
    }

    /// Attaches the loaded programs to `ifindex` (see [`AggEngine::load`]).
    pub fn attach(&mut self, ifindex: u32) -> Result<()> {
        if self.xdp_link.is_some() {
            return Err(Error::Usage(format!(
                "the aggregation engine is already attached to ifindex {}",
                self.ifindex
            )));
        }
        let prog_fd = self.xdp.progs.kccl_xdp_agg.as_fd().as_raw_fd();
        let attach = |flags: u32| -> std::result::Result<OwnedFd, std::io::Error> {
            // SAFETY: zeroed options with sz set are what libbpf expects.
            let mut opts: libbpf_rs::libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
            opts.sz = size_of::<libbpf_rs::libbpf_sys::bpf_link_create_opts>() as _;
            opts.flags = flags;
            // SAFETY: a loaded program fd, an ifindex and valid options.
            let fd = unsafe {
                libbpf_rs::libbpf_sys::bpf_link_create(prog_fd, ifindex as i32, libbpf_rs::libbpf_sys::BPF_XDP, &opts)
            };
            if fd < 0 {
                return Err(std::io::Error::from_raw_os_error(-fd));
            }
            // SAFETY: fd is a new link fd we own; closing it detaches.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        let (link, mode) = match attach(libbpf_rs::libbpf_sys::XDP_FLAGS_DRV_MODE) {
            Ok(l) => (l, XdpMode::Native),
            Err(native) => match attach(libbpf_rs::libbpf_sys::XDP_FLAGS_SKB_MODE) {
                Ok(l) => (l, XdpMode::Generic),
                Err(generic) => {
                    return Err(Error::KernelPathUnavailable {
                        reason: format!(
                            "attaching xdp_agg to ifindex {ifindex} failed: native mode: {native}; \
                             generic mode: {generic} (another XDP program attached?)"
                        ),
                    })
                }
            },
        };
        let prog = &self.result.progs.kccl_tc_agg_result;
        // SAFETY: a loaded program and a NULL opts pointer are valid arguments.
        let ptr = unsafe {
            libbpf_rs::libbpf_sys::bpf_program__attach_tcx(
                libbpf_rs::AsRawLibbpf::as_libbpf_object(prog).as_ptr(),
                ifindex as i32,
                std::ptr::null(),
            )
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::KernelPathUnavailable {
            reason: format!(
                "attaching tc_agg_result at TCX ingress of ifindex {ifindex} failed: {} (kernel >= 6.6 needed for TCX)",
                std::io::Error::last_os_error()
            ),
        })?;
        // SAFETY: ptr is a live bpf_link returned by libbpf; Link owns it now.
        self.tcx_link = Some(unsafe { Link::from_ptr(ptr) });
        self.xdp_link = Some(link);
        self.xdp_mode = Some(mode);
        self.ifindex = ifindex;
        self.iface = ifname(ifindex);
        Ok(())
    }

    /// Removes both programs from the interface (also done on drop).
    pub fn detach(&mut self) {
        self.xdp_link = None;
        self.tcx_link = None;
        self.xdp_mode = None;
    }

    /// How xdp_agg is attached; None while not attached.
    pub fn xdp_mode(&self) -> Option<XdpMode> {
        self.xdp_mode
    }

    pub fn config(&self) -> &AggEngineConfig {
        &self.cfg
    }

    /// members[rank]: where `rank`'s answers go (and the only source address
    /// its contributions are accepted from).  `mac` None = unresolved
    /// neighbour: its contributions are still aggregated, its answer copy is
    /// reported on the miss events instead of being sent.
    pub fn set_member(&mut self, rank: u16, ip: Ipv4Addr, port: u16, mac: Option<[u8; 6]>) -> Result<()> {
        write_member_entry(&self.xdp.maps.members, rank, &member_entry(ip, port, mac))
    }

    pub fn clear_member(&mut self, rank: u16) -> Result<()> {
        write_member_entry(&self.xdp.maps.members, rank, &crate::skel::types::kccl_member::default())
    }

    /// Writes every member of `group` except the aggregator itself, with the
    /// MAC from the kernel's neighbour table of the attached interface (read
    /// in the calling thread's namespace).  Ranks without a neighbour entry
    /// are written unresolved and listed by [`AggEngine::unresolved_members`].
    pub fn sync_members(&mut self, group: &Group) -> Result<()> {
        let iface = self.iface.clone().ok_or_else(|| {
            Error::Usage("sync_members needs the engine attached to an interface (its neighbour table)".into())
        })?;
        let neigh = neighbours(&iface);
        let mut unresolved = Vec::new();
        for m in &group.members {
            if m.rank == self.cfg.my_rank {
                self.clear_member(m.rank)?;
                continue;
            }
            let mac = neigh.get(&m.addr).copied();
            if mac.is_none() {
                unresolved.push(m.rank);
            }
            self.set_member(m.rank, m.addr, m.port, mac)?;
        }
        self.unresolved = unresolved;
        Ok(())
    }

    /// Ranks the last [`AggEngine::sync_members`] found no neighbour entry for.
    pub fn unresolved_members(&self) -> &[u16] {
        &self.unresolved
    }

    pub fn stats(&self) -> Result<AggStats> {
        let mut sum = [0u64; AggStats::N];
        for (i, slot) in sum.iter_mut().enumerate() {
            let per_cpu = self
                .xdp
                .maps
                .agg_stats
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| Error::Bpf { step: "reading agg_stats".into(), source: e })?
                .unwrap_or_default();
            *slot = per_cpu.iter().filter(|b| b.len() >= 8).map(|b| u64_at(b, 0)).sum();
        }
        Ok(AggStats::from_array(sum))
    }

    /// Calls `f` for every reduce record on the ring buffer: those already
    /// there (written without a wake-up), else waits up to `timeout` for one.
    /// Returns how many records were handed to `f`.
    pub fn poll_records(&mut self, timeout: Duration, f: &mut dyn FnMut(AggRecordView<'_>)) -> Result<usize> {
        self.poll_records_max(timeout, usize::MAX, f)
    }

    /// [`AggEngine::poll_records`] taking at most `max` records off the ring
    /// buffer: the others stay there, in order, for a later call.  This is
    /// how a reader with bounded memory applies backpressure: while the ring
    /// is full, xdp_agg keeps completed chunks UNDELIVERED and answers
    /// nobody, so the contributors retransmit instead of running ahead.
    /// `max` 0 reads nothing and does not wait.
    pub fn poll_records_max(
        &mut self,
        timeout: Duration,
        max: usize,
        f: &mut dyn FnMut(AggRecordView<'_>),
    ) -> Result<usize> {
        if max == 0 {
            return Ok(0);
        }
        if self.consume_records(max)? == 0 && !timeout.is_zero() {
            self.wait_records(timeout)?;
            // Also records written without a wake-up during the wait.
            self.consume_records(max)?;
        }
        let q = std::mem::take(&mut *self.records.lock().map_err(|_| Error::Usage("record queue poisoned".into()))?);
        let mut n = 0;
        for &(start, len) in &q.spans {
            let raw = &q.bytes[start..start + len];
            let h = parse_record_header(raw)?;
            parse_values(raw, h.nvalues, &mut self.scratch)?;
            f(AggRecordView {
                job_id: h.job_id,
                op_id: h.op_id,
                frag_off: h.frag_off,
                msg_len: h.msg_len,
                payload_len: h.payload_len,
                mask_base: h.mask_base,
                agg_op: h.agg_op,
                dtype: h.dtype,
                overflow: h.overflow,
                contributors: h.contributors,
                values: &self.scratch,
            });
            n += 1;
        }
        Ok(n)
    }

    /// Moves up to `max` records from the ring into the record queue.
    fn consume_records(&mut self, max: usize) -> Result<usize> {
        let n = self.ring.consume_raw_n(max);
        if n < 0 {
            return Err(Error::io("reading the agg_records ring buffer", std::io::Error::from_raw_os_error(-n)));
        }
        Ok(n as usize)
    }

    /// Sleeps until the ring buffer signals data or `timeout` passes (rounded
    /// up to whole milliseconds).  Consumes nothing.
    fn wait_records(&self, timeout: Duration) -> Result<()> {
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: the ring's epoll fd is open while self lives; ev is one
        // writable event.
        let rc = unsafe { libc::epoll_wait(self.ring.epoll_fd(), &mut ev, 1, ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io("waiting for agg_records ring buffer data", e));
            }
        }
        Ok(())
    }

    /// Destinations tc_agg_result could not serve since the last call.
    pub fn drain_misses(&self) -> Vec<MissEvent> {
        let _ = self.miss_ring.consume();
        self.misses.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }

    /// Runs kccl_agg_sweep once (BPF_PROG_TEST_RUN): frees every ACTIVE slot
    /// claimed more than `slot_timeout` ago (left behind by an operation
    /// whose member died).  Returns how many it freed.
    pub fn sweep(&self) -> Result<u64> {
        let before = self.stats()?.swept;
        let input = [0u8; 64];
        self.xdp
            .progs
            .kccl_agg_sweep
            .test_run(libbpf_rs::ProgramInput { data_in: Some(&input), ..Default::default() })
            .map_err(|e| Error::Bpf { step: "running kccl_agg_sweep".into(), source: e })?;
        Ok(self.stats()?.swept.saturating_sub(before))
    }

    /// What rank `rank` has proven it received (struct kccl_agg_acks):
    /// None, or (op id, bound): every answer of earlier operations and of
    /// chunks below `bound` of this one.
    pub fn ack_of(&self, rank: u16) -> Result<Option<(u32, u32)>> {
        let v = self
            .xdp
            .maps
            .agg_acks
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| Error::Bpf { step: "reading agg_acks".into(), source: e })?
            .unwrap_or_default();
        let off = usize::from(rank) * 8;
        if v.len() < off + 8 {
            return Err(Error::Usage(format!("agg_acks has no entry for rank {rank}")));
        }
        let a = u64::from_ne_bytes(v[off..off + 8].try_into().unwrap_or([0; 8]));
        Ok((a != 0).then(|| ((a >> 32) as u32, (a as u32).wrapping_sub(1))))
    }

    /// Slots held by operation `op_id` (any state but FREE), as (index, state).
    pub fn slots_of_op(&self, op_id: u32) -> Result<Vec<(u32, SlotState)>> {
        let mut out = Vec::new();
        for index in 0..self.cfg.nslots {
            let s = self.slot(index)?;
            if s.state != SlotState::Free && s.job_id == self.cfg.job_id && s.op_id == op_id {
                out.push((index, s.state));
            }
        }
        Ok(out)
    }

    /// The slot of chunk `frag_off` of operation `op_id` (the program's hash).
    pub fn slot_index(&self, op_id: u32, frag_off: u32) -> u32 {
        let chunk = frag_off / self.cfg.chunk_bytes;
        op_id.wrapping_mul(0x9E37_79B1).wrapping_add(chunk) & (self.cfg.nslots - 1)
    }

    /// A snapshot of slot `index`.
    pub fn slot(&self, index: u32) -> Result<SlotInfo> {
        use crate::skel_agg::types::kccl_agg_slot as S;
        if index >= self.cfg.nslots {
            return Err(Error::Usage(format!("slot {index} is beyond the {} slots", self.cfg.nslots)));
        }
        let v = self
            .xdp
            .maps
            .agg_slots
            .lookup(&index.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| Error::Bpf { step: format!("reading agg_slots[{index}]"), source: e })?
            .ok_or_else(|| Error::Usage(format!("agg_slots[{index}] missing")))?;
        if v.len() < size_of::<S>() {
            return Err(Error::Usage(format!("agg_slots value of {} bytes, {} expected", v.len(), size_of::<S>())));
        }
        let rec = &v[offset_of!(S, rec)..];
        let h = parse_record_header(rec);
        let mut acc = Vec::new();
        let (nvalues, h) = match h {
            Ok(h) => (h.nvalues, Some(h)),
            Err(_) => (0, None),
        };
        parse_values(rec, nvalues, &mut acc)?;
        let h = h.unwrap_or(RecordHeader {
            job_id: u32_at(rec, 0),
            op_id: u32_at(rec, 4),
            frag_off: u32_at(rec, 8),
            msg_len: u32_at(rec, 12),
            payload_len: u16_at(rec, 16),
            mask_base: u16_at(rec, 18),
            agg_op: rec[20],
            dtype: rec[21],
            overflow: rec[22] != 0,
            contributors: u64_at(rec, 24),
            nvalues: 0,
        });
        Ok(SlotInfo {
            state: u32_at(&v, offset_of!(S, state)).into(),
            expected: u64_at(&v, offset_of!(S, expected)),
            seen: u64_at(&v, offset_of!(S, seen)),
            claimed_ns: u64_at(&v, offset_of!(S, claimed_ns)),
            job_id: h.job_id,
            op_id: h.op_id,
            frag_off: h.frag_off,
            msg_len: h.msg_len,
            payload_len: h.payload_len,
            mask_base: h.mask_base,
            agg_op: h.agg_op,
            dtype: h.dtype,
            overflow: h.overflow,
            contributors: h.contributors,
            acc,
        })
    }

    /// How many slots are in each state (for tests and reclaim checks).
    pub fn slots(&self) -> Result<SlotSummary> {
        use crate::skel_agg::types::kccl_agg_slot as S;
        let mut sum = SlotSummary::default();
        for index in 0..self.cfg.nslots {
            let v = self
                .xdp
                .maps
                .agg_slots
                .lookup(&index.to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| Error::Bpf { step: format!("reading agg_slots[{index}]"), source: e })?
                .unwrap_or_default();
            if v.len() < size_of::<S>() {
                return Err(Error::Usage(format!("agg_slots value of {} bytes, {} expected", v.len(), size_of::<S>())));
            }
            match SlotState::from(u32_at(&v, offset_of!(S, state))) {
                SlotState::Free => sum.free += 1,
                SlotState::Active => sum.active += 1,
                SlotState::Delivering => sum.delivering += 1,
                SlotState::Done => sum.done += 1,
                SlotState::Undelivered => sum.undelivered += 1,
                SlotState::Unknown(_) => sum.unknown += 1,
            }
        }
        Ok(sum)
    }

    /// Instructions the verifier processed for (xdp_agg, tc_agg_result).
    pub fn verified_insns(&self) -> Result<(u32, u32)> {
        Ok((
            verified_insns(self.xdp.progs.kccl_xdp_agg.as_fd().as_raw_fd())?,
            verified_insns(self.result.progs.kccl_tc_agg_result.as_fd().as_raw_fd())?,
        ))
    }

    /// The loaded xdp_agg skeleton (BPF_PROG_TEST_RUN fixtures use its program).
    pub fn xdp_skel(&self) -> &XdpAggSkel<'static> {
        &self.xdp
    }

    /// The loaded tc_agg_result skeleton.
    pub fn result_skel(&self) -> &TcAggResultSkel<'static> {
        &self.result
    }
}

fn verified_insns(fd: i32) -> Result<u32> {
    // SAFETY: zeroed bpf_prog_info is valid; the kernel fills up to len bytes.
    let mut info: libbpf_rs::libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libbpf_rs::libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: fd is a program fd; info/len describe a valid buffer.
    let rc = unsafe { libbpf_rs::libbpf_sys::bpf_prog_get_info_by_fd(fd, &mut info, &mut len) };
    if rc != 0 {
        return Err(Error::io("reading BPF program info", std::io::Error::from_raw_os_error(-rc)));
    }
    Ok(info.verified_insns)
}

/// Name of interface `ifindex` in the calling thread's namespace.
fn ifname(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_str().ok().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skel_agg::types::kccl_agg_slot;

    /// The generated types are the C layout of bpf/include/kccl_agg.h.
    #[test]
    fn layouts_match_kccl_agg_h() {
        type R = kccl_agg_record;
        assert_eq!(offset_of!(R, job_id), 0);
        assert_eq!(offset_of!(R, op_id), 4);
        assert_eq!(offset_of!(R, frag_off), 8);
        assert_eq!(offset_of!(R, msg_len), 12);
        assert_eq!(offset_of!(R, payload_len), 16);
        assert_eq!(offset_of!(R, mask_base), 18);
        assert_eq!(offset_of!(R, agg_op), 20);
        assert_eq!(offset_of!(R, dtype), 21);
        assert_eq!(offset_of!(R, overflow), 22);
        assert_eq!(offset_of!(R, pad), 23);
        assert_eq!(offset_of!(R, contributors), 24);
        assert_eq!(offset_of!(R, acc), RECORD_HDR_LEN);
        assert_eq!(size_of::<R>(), RECORD_HDR_LEN + MAX_ELEMS * 8);
        assert_eq!(MAX_ELEMS, 858);
        type S = kccl_agg_slot;
        assert_eq!(offset_of!(S, lock), 0);
        assert_eq!(offset_of!(S, state), 4);
        assert_eq!(offset_of!(S, expected), 8);
        assert_eq!(offset_of!(S, seen), 16);
        assert_eq!(offset_of!(S, claimed_ns), 24);
        assert_eq!(offset_of!(S, rec), 32);
        assert_eq!(size_of::<S>(), 32 + size_of::<R>());
        // enum kccl_agg_stat has KCCL_AS_NR = 26 counters.
        assert_eq!(AggStats::N, 26);
        assert_eq!(size_of::<crate::skel_agg::types::kccl_agg_acks>(), 8 * MAX_MEMBERS);
    }

    #[test]
    fn config_defaults_and_validation() {
        let c = AggEngineConfig::new(7, 47100, 3);
        assert_eq!(
            (c.chunk_bytes, c.nslots, c.slot_timeout, c.ring_bytes, c.wakeup_bytes),
            (1432, 1024, Duration::from_secs(2), 64 << 20, 1 << 20)
        );
        c.validate().expect("defaults are valid");
        let field = |c: AggEngineConfig| match c.validate() {
            Err(Error::AggConfig { field, .. }) => field,
            other => panic!("expected AggConfig error, got {other:?}"),
        };
        assert_eq!(field(AggEngineConfig { port: 0, ..c.clone() }), "port");
        assert_eq!(field(AggEngineConfig { my_rank: 4096, ..c.clone() }), "my_rank");
        for bad in [0, 4, 1430, 3440] {
            assert_eq!(field(AggEngineConfig { chunk_bytes: bad, ..c.clone() }), "chunk_bytes", "{bad}");
        }
        AggEngineConfig { chunk_bytes: 3432, ..c.clone() }.validate().expect("3432 is the maximum");
        for bad in [0, 3, 1000, MAX_SLOTS * 2] {
            assert_eq!(field(AggEngineConfig { nslots: bad, ..c.clone() }), "nslots", "{bad}");
        }
        assert_eq!(field(AggEngineConfig { slot_timeout: Duration::ZERO, ..c.clone() }), "slot_timeout");
        for bad in [0, 4096, 3 << 20] {
            assert_eq!(field(AggEngineConfig { ring_bytes: bad, ..c.clone() }), "ring_bytes", "{bad}");
        }
        assert_eq!(field(AggEngineConfig { wakeup_bytes: 64 << 20, ..c.clone() }), "wakeup_bytes");
    }

    fn record_bytes(payload_len: u16, dtype: u8, values: &[i64]) -> Vec<u8> {
        let mut b = vec![0u8; RECORD_HDR_LEN];
        b[0..4].copy_from_slice(&7u32.to_ne_bytes());
        b[4..8].copy_from_slice(&9u32.to_ne_bytes());
        b[16..18].copy_from_slice(&payload_len.to_ne_bytes());
        b[21] = dtype;
        b[22] = 1;
        b[24..32].copy_from_slice(&0b110u64.to_ne_bytes());
        for v in values {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        b
    }

    #[test]
    fn record_parsing_checks_lengths() {
        let b = record_bytes(12, DT_I32, &[1, -2, 3]);
        let h = parse_record_header(&b).expect("valid");
        assert_eq!((h.job_id, h.op_id, h.nvalues, h.overflow, h.contributors), (7, 9, 3, true, 0b110));
        let mut v = Vec::new();
        parse_values(&b, h.nvalues, &mut v).expect("values");
        assert_eq!(v, [1, -2, 3]);
        // Truncated values, short header, unknown dtype, ragged payload.
        assert!(parse_values(&b[..b.len() - 1], 3, &mut v).is_err());
        assert!(parse_record_header(&b[..RECORD_HDR_LEN - 1]).is_err());
        assert!(parse_record_header(&record_bytes(12, 9, &[])).is_err());
        assert!(parse_record_header(&record_bytes(12, DT_I64, &[])).is_err());
        assert_eq!(parse_record_header(&record_bytes(16, DT_I64, &[])).map(|h| h.nvalues).ok(), Some(2));
    }
}
