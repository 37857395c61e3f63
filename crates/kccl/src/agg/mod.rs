//! Aggregation: reduce and allreduce over both paths with one protocol
//! (docs/AGGREGATION.md).
//!
//! - [`Collective`]: one per member process.  `reduce` (contributors send
//!   with [`Collective::send_aggregated_data`], the root collects with
//!   [`Collective::get_aggregated_data`] and folds its own data in) and
//!   `allreduce` (every member contributes to the group's aggregator rank
//!   and gets the result back).
//! - [`Aggregator`]: the allreduce aggregator service, a rank that does not
//!   contribute (`aggregator = <rank>` in the group file).
//!
//! The aggregation itself runs in a backend: the user-space aggregator
//! ([`user::UserAggregator`], always present: it also serves the packets
//! the kernel passes up) or, with the cargo feature `kernel-agg`, the XDP/TC
//! programs of `crate::kernel_agg` (agg/kernel_backend.rs).
//!
//! Operation ids: every API call of a Collective takes the next call number
//! `k` and uses op ids `4k` (exponent pre-pass of float32 SUM/AVG), `4k + 1`
//! (the data) and `4k + 2` (the int64 redo of chunks whose int32 result
//! overflowed).  Members must make the same sequence of calls (as in MPI);
//! a failed call does not shift the ids of later ones.

pub mod codec;
pub mod member;
pub mod packet;
pub mod quant;
pub mod user;

#[cfg(feature = "kernel-agg")]
mod kernel_backend;

use std::fmt;
use std::net::SocketAddrV4;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::{check_chunk_bytes, Group, Member};
use crate::netns;
use crate::sock::{BatchSocket, RecvBatch};
use crate::wire::{
    Header, DT_F32Q, DT_I32, DT_I64, F_ALLREDUCE, HDR_LEN, MASK_BITS, OP_AVG, OP_COUNT, OP_MAX, OP_MIN, OP_SUM, T_AGG,
    T_AGG_ACK, T_AGG_PENDING, T_AGG_RECEIPT, T_AGG_RESULT, T_AGG_SYNC, T_AGG_SYNC_ACK,
};

pub use crate::bcast::{Path, PathChoice};
use codec::{Dst, Enc, FinEnc, Finish, OutOfRange, Src};
use member::{ContribStats, Contributor, Cwnd, Spec, Timing};
use user::{Admit, AggSink, AggStats, AllreduceOnly, ChunkDone, MismatchEvent, UserAggConfig, UserAggregator};

/// Aggregation operation (enum kccl_agg_op).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AggOp {
    Sum,
    /// Per element: how many members' values are non-zero.
    Count,
    Max,
    Min,
    /// Sum divided by the number of members (integers: truncated toward 0).
    Avg,
}

impl AggOp {
    pub fn wire(self) -> u8 {
        match self {
            AggOp::Sum => OP_SUM,
            AggOp::Count => OP_COUNT,
            AggOp::Max => OP_MAX,
            AggOp::Min => OP_MIN,
            AggOp::Avg => OP_AVG,
        }
    }

    pub fn from_wire(v: u8) -> Option<AggOp> {
        match v {
            OP_SUM => Some(AggOp::Sum),
            OP_COUNT => Some(AggOp::Count),
            OP_MAX => Some(AggOp::Max),
            OP_MIN => Some(AggOp::Min),
            OP_AVG => Some(AggOp::Avg),
            _ => None,
        }
    }
}

impl fmt::Display for AggOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AggOp::Sum => "SUM",
            AggOp::Count => "COUNT",
            AggOp::Max => "MAX",
            AggOp::Min => "MIN",
            AggOp::Avg => "AVG",
        })
    }
}

impl FromStr for AggOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(AggOp::Sum),
            "count" => Ok(AggOp::Count),
            "max" => Ok(AggOp::Max),
            "min" => Ok(AggOp::Min),
            "avg" | "average" => Ok(AggOp::Avg),
            _ => Err(Error::Usage(format!("unknown aggregation op '{s}': use sum, count, max, min or avg"))),
        }
    }
}

/// Element type on the wire (enum kccl_dtype).  float32 data is F32Q for
/// SUM/AVG (quantized); its MAX/MIN/COUNT travel exactly as I32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    I32,
    I64,
    F32Q,
}

impl DType {
    pub fn wire(self) -> u8 {
        match self {
            DType::I32 => DT_I32,
            DType::I64 => DT_I64,
            DType::F32Q => DT_F32Q,
        }
    }

    pub fn from_wire(v: u8) -> Option<DType> {
        match v {
            DT_I32 => Some(DType::I32),
            DT_I64 => Some(DType::I64),
            DT_F32Q => Some(DType::F32Q),
            _ => None,
        }
    }

    pub fn elem_size(self) -> usize {
        match self {
            DType::I64 => 8,
            _ => 4,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for f32 {}
}

/// Element types that can be aggregated: i32, i64, f32.
pub trait Element: sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    const NAME: &'static str;
    #[doc(hidden)]
    fn src(data: &[Self]) -> Src<'_>;
    #[doc(hidden)]
    fn dst(out: &mut [Self]) -> Dst<'_>;
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    const NAME: &'static str = "i32";
    fn src(data: &[Self]) -> Src<'_> {
        Src::I32(data)
    }
    fn dst(out: &mut [Self]) -> Dst<'_> {
        Dst::I32(out)
    }
}

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    const NAME: &'static str = "i64";
    fn src(data: &[Self]) -> Src<'_> {
        Src::I64(data)
    }
    fn dst(out: &mut [Self]) -> Dst<'_> {
        Dst::I64(out)
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32Q;
    const NAME: &'static str = "f32";
    fn src(data: &[Self]) -> Src<'_> {
        Src::F32(data)
    }
    fn dst(out: &mut [Self]) -> Dst<'_> {
        Dst::F32(out)
    }
}

/// float32 quantization for SUM/AVG.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Quant {
    /// Shared exponent per chunk, agreed by a MAX pre-pass: cannot overflow.
    #[default]
    Auto,
    /// `q = round(x * s)` (AggBox: 1e8).  Elements with `|x * s|` beyond
    /// int32 are refused; int32 sums that overflow are redone in int64.
    Fixed(f64),
}

/// Tuning of one member or aggregator.  Every member of a job must use the
/// same chunk size (the group file's), and `window` must stay below the
/// aggregator's `nslots`.
#[derive(Debug, Clone, PartialEq)]
pub struct AggConfig {
    /// Chunk bytes; None: the group file's `chunk_bytes` (default 1432, for
    /// an MTU of 1500).
    pub chunk_bytes: Option<u32>,
    /// Span of chunks a contributor may have sent above its lowest
    /// unanswered one (the slot-reuse proof's W; also the largest
    /// congestion window, which bounds the chunks in flight).
    pub window: usize,
    /// Retransmission timeout: a chunk unanswered this long after its last
    /// send is sent again (fast retransmission usually comes first).
    pub rto: Duration,
    /// An operation fails when nothing progressed for this long.
    pub deadline: Duration,
    pub quant: Quant,
    /// Aggregation slots (power of two) of this member's aggregator role.
    pub nslots: usize,
    /// An aggregating chunk idle for this long may lose its slot.
    pub slot_timeout: Duration,
    /// Send runs of chunks to one address as UDP GSO messages (one stack
    /// traversal per run instead of per datagram; the wire is unchanged).
    /// Off by default: experimental (docs/AGGREGATION.md, "UDP GSO").
    pub gso: bool,
}

impl Default for AggConfig {
    fn default() -> Self {
        AggConfig {
            chunk_bytes: None,
            window: 256,
            rto: Duration::from_millis(25),
            deadline: Duration::from_secs(10),
            quant: Quant::Auto,
            nslots: 1024,
            slot_timeout: Duration::from_secs(2),
            gso: false,
        }
    }
}

/// Counters of a Collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CollectiveStats {
    /// API calls (reduce, allreduce, send/get_aggregated_data).
    pub calls: u64,
    /// Wire operations run (pre-passes and redos included).
    pub ops: u64,
    /// Operations redone in int64 after an int32 overflow.
    pub redo_ops: u64,
    pub recv_calls: u64,
    /// Datagrams that were neither contributions nor answers (or truncated).
    pub other_datagrams: u64,
    /// Reduce chunks the root received (user or kernel aggregation).
    pub root_chunks: u64,
    /// Reduce chunks completed before the root reached their operation.
    pub stashed: u64,
    /// Reduce chunks of calls this root had already finished (or given up
    /// on) when they completed: dropped.
    pub stale_chunks: u64,
    pub contrib: ContribStats,
    /// The user-space aggregator of this member (reduce root, USER_ONLY).
    pub agg: AggStats,
}

/// What a contributor's reduce call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendReport {
    pub op_id: u32,
    pub chunks: usize,
    pub datagrams: u64,
    pub retransmits: u64,
    pub elapsed: Duration,
}

/// Aggregator backends behind one interface: user space always, the kernel
/// when built with `kernel-agg` and loaded.
// One backend per member, built once and never moved on a hot path.
#[allow(clippy::large_enum_variant)]
enum AggBackend {
    User(UserAggregator),
    #[cfg(feature = "kernel-agg")]
    Kernel(kernel_backend::KernelBackend),
}

impl AggBackend {
    fn user(&self) -> &UserAggregator {
        match self {
            AggBackend::User(u) => u,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => &k.user,
        }
    }

    fn user_mut(&mut self) -> &mut UserAggregator {
        match self {
            AggBackend::User(u) => u,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => &mut k.user,
        }
    }

    fn path(&self) -> Path {
        match self {
            AggBackend::User(_) => Path::User,
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(_) => Path::Kernel,
        }
    }

    #[cfg(feature = "kernel-agg")]
    fn kernel_stats(&self) -> Result<Option<crate::kernel_agg::AggStats>> {
        match self {
            AggBackend::User(_) => Ok(None),
            AggBackend::Kernel(k) => k.engine().stats().map(Some),
        }
    }

    /// What `rank` proved it received from this aggregator (receipts; on
    /// the kernel path also its contributions): None or (op id, bound).
    fn ack_of(&self, rank: u16) -> Result<Option<(u32, u32)>> {
        match self {
            AggBackend::User(u) => Ok(u.receipt_of(rank)),
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.engine().ack_of(rank),
        }
    }

    /// The kernel slot's missing contributors of a chunk being aggregated.
    fn kernel_missing(&self, op_id: u32, frag_off: u32) -> Option<(u16, u64)> {
        match self {
            AggBackend::User(_) => {
                let _ = (op_id, frag_off);
                None
            }
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.missing(op_id, frag_off),
        }
    }

    /// Completed reduce chunks of the kernel (ring buffer records), at most
    /// `max` (the others stay in the ring).
    fn poll(&mut self, timeout: Duration, max: usize, sink: &mut dyn AggSink) -> Result<usize> {
        match self {
            AggBackend::User(_) => {
                let _ = (timeout, max, sink);
                Ok(0)
            }
            #[cfg(feature = "kernel-agg")]
            AggBackend::Kernel(k) => k.poll(timeout, max, sink),
        }
    }
}

/// Picks the backend for `choice`; returns it with the reason.
fn make_backend(
    group: &Group,
    me: &Member,
    cfg: &AggConfig,
    chunk: usize,
    choice: PathChoice,
) -> Result<(AggBackend, String)> {
    let ucfg = UserAggConfig {
        job_id: group.job_id,
        my_rank: me.rank,
        chunk_bytes: chunk,
        nslots: cfg.nslots,
        slot_timeout: cfg.slot_timeout,
        linger: cfg.deadline,
    };
    let user = UserAggregator::new(group, ucfg);
    match choice {
        PathChoice::User => Ok((AggBackend::User(user), "user-space path requested (--path user)".into())),
        PathChoice::Kernel => kernel_backend(group, me, cfg, chunk, user),
        PathChoice::Auto => {
            let fallback = UserAggregator::new(group, user.config().clone());
            match kernel_backend(group, me, cfg, chunk, user) {
                Ok(k) => Ok(k),
                Err(e) => Ok((AggBackend::User(fallback), format!("kernel path off: {e}; using the user-space path"))),
            }
        }
    }
}

#[cfg(feature = "kernel-agg")]
fn kernel_backend(
    group: &Group,
    me: &Member,
    cfg: &AggConfig,
    chunk: usize,
    user: UserAggregator,
) -> Result<(AggBackend, String)> {
    let k = kernel_backend::KernelBackend::load(group, me, cfg, chunk, user)?;
    let why = format!("kernel path: xdp_agg and tc_agg_result attached to {}", me.iface);
    Ok((AggBackend::Kernel(k), why))
}

#[cfg(not(feature = "kernel-agg"))]
fn kernel_backend(
    _group: &Group,
    _me: &Member,
    _cfg: &AggConfig,
    _chunk: usize,
    _user: UserAggregator,
) -> Result<(AggBackend, String)> {
    Err(Error::KernelPathUnavailable {
        reason: "this build has no kernel aggregation (the cargo feature `kernel-agg` is off); \
                 rebuild with --features kernel-agg or use the user-space path (--path user)"
            .into(),
    })
}

/// Checks the configuration against the group; returns the chunk size.
fn resolve_config(group: &Group, me: &Member, cfg: &AggConfig) -> Result<usize> {
    let chunk = match cfg.chunk_bytes {
        None => group.chunk_bytes,
        Some(c) => check_chunk_bytes(i64::from(c)).map_err(|m| Error::Usage(format!("AggConfig: {m}")))?,
    };
    if cfg.chunk_bytes.is_some_and(|c| c != group.chunk_bytes) {
        return Err(Error::Usage(format!(
            "AggConfig.chunk_bytes {} differs from the group file's chunk_bytes {}: every member and the \
             aggregator must use the same chunk size (set it in the group file)",
            cfg.chunk_bytes.unwrap_or_default(),
            group.chunk_bytes
        )));
    }
    let nslots = cfg.nslots.next_power_of_two();
    if cfg.window == 0 || cfg.window >= nslots {
        return Err(Error::Usage(format!(
            "AggConfig.window {} must be at least 1 and below nslots {nslots} (two chunks of one operation \
             must never need the same aggregation slot)",
            cfg.window
        )));
    }
    if cfg.rto.is_zero() || cfg.deadline < cfg.rto {
        return Err(Error::Usage(format!(
            "AggConfig: rto {:?} must be positive and not longer than the deadline {:?}",
            cfg.rto, cfg.deadline
        )));
    }
    if let Some(mtu) = netns::mtu(&me.iface) {
        if chunk as usize + 20 + 8 + HDR_LEN > mtu {
            return Err(Error::Usage(format!(
                "chunk_bytes {chunk} needs an MTU of at least {} but {} has {mtu}: lower chunk_bytes in the group \
                 file to {} or raise the MTU",
                chunk as usize + 20 + 8 + HDR_LEN,
                me.iface,
                mtu.saturating_sub(20 + 8 + HDR_LEN) / 8 * 8
            )));
        }
    }
    Ok(chunk as usize)
}

/// Contributor window: ranks and their 64-rank mask.
#[derive(Debug, Clone, Copy)]
struct Contributors {
    base: u16,
    mask: u64,
    count: usize,
}

fn contributors(group: &Group, what: &str, exclude: &[u16]) -> Result<Contributors> {
    let ranks: Vec<u16> = group.members.iter().map(|m| m.rank).filter(|r| !exclude.contains(r)).collect();
    let (Some(&first), Some(&last)) = (ranks.first(), ranks.last()) else {
        return Ok(Contributors { base: 0, mask: 0, count: 0 });
    };
    let base = first / MASK_BITS as u16 * MASK_BITS as u16;
    if ranks.len() > MASK_BITS || last - base >= MASK_BITS as u16 {
        return Err(Error::TooManyContributors { what: what.into(), count: ranks.len(), first, last, base });
    }
    let mask = ranks.iter().fold(0u64, |m, r| m | 1 << (r - base));
    Ok(Contributors { base, mask, count: ranks.len() })
}

/// Reduce chunks that completed before the local root reached their call.
///
/// On the user path the root admits only contributions of the next two
/// calls, and only while the stash has room ([`Admit::Early`] otherwise), so
/// contributors wait for a slow root.  On the kernel path nothing waits for
/// the root: xdp_agg completes and ACKs chunks on its own, so the
/// contributors can finish any number of calls before the root reads their
/// records.  The stash therefore keeps every record of a later call, and
/// the root reads no more records than the stash can hold
/// ([`AggSink::room`]): the rest wait in the ring buffer, which xdp_agg
/// fills in call order (a contributor starts call k + 1 only after every
/// chunk of call k was ACKed, i.e. recorded), and when the ring is full the
/// kernel stops ACKing, so the contributors wait after all.
#[derive(Default)]
struct Stash {
    chunks: Vec<Stashed>,
}

/// Whether op id `op_id` belongs to call `call` or a later one (call `k`
/// uses op ids 4k..4k+3; serial-number arithmetic: the 2^31 op ids from
/// `4 * call` on are "now or later", the others past).
fn call_or_later(op_id: u32, call: u32) -> bool {
    op_id.wrapping_sub(call.wrapping_mul(4)) < 1 << 31
}

impl Stash {
    /// At the start of call `call` (whose data op id is `op_id`): removes
    /// and returns the chunks of `op_id`, forgets those of earlier calls
    /// and keeps those of later ones.
    fn take_call(&mut self, call: u32, op_id: u32) -> Vec<Stashed> {
        let (mut now, mut keep) = (Vec::new(), Vec::new());
        for c in std::mem::take(&mut self.chunks) {
            if c.op_id == op_id {
                now.push(c);
            } else if call_or_later(c.op_id, call.wrapping_add(1)) {
                keep.push(c);
            }
        }
        self.chunks = keep;
        now
    }
}

struct Stashed {
    op_id: u32,
    frag_off: u32,
    msg_len: u32,
    payload_len: u16,
    agg_op: u8,
    dtype: u8,
    overflow: bool,
    contributors: u64,
    values: Vec<i64>,
}

impl Stashed {
    fn view(&self) -> ChunkDone<'_> {
        ChunkDone {
            op_id: self.op_id,
            frag_off: self.frag_off,
            msg_len: self.msg_len,
            payload_len: self.payload_len,
            agg_op: self.agg_op,
            dtype: self.dtype,
            overflow: self.overflow,
            contributors: self.contributors,
            values: &self.values,
        }
    }
}

/// What the root expects of one of its operations' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Expect {
    op_id: u32,
    allreduce: bool,
    agg_op: u8,
    dtype: u8,
    msg_len: u32,
    mask_base: u16,
    mask: u64,
}

impl Expect {
    fn check(&self, h: &Header) -> std::result::Result<(), String> {
        let got = (h.flags & F_ALLREDUCE != 0, h.agg_op, h.dtype, h.msg_len, h.mask_base, h.dst_mask);
        let want = (self.allreduce, self.agg_op, self.dtype, self.msg_len, self.mask_base, self.mask);
        if got == want {
            return Ok(());
        }
        Err(format!(
            "sent {} bytes of dtype {} op {} for contributors {:#x} ({}), the root expects {} bytes of dtype {} op {} \
             for contributors {:#x} ({})",
            h.msg_len,
            h.dtype,
            h.agg_op,
            h.dst_mask,
            if got.0 { "allreduce" } else { "reduce" },
            self.msg_len,
            self.dtype,
            self.agg_op,
            self.mask,
            if self.allreduce { "allreduce" } else { "reduce" }
        ))
    }
}

/// The root's state of one reduce: where finished chunks go.
struct RootState<'a> {
    what: String,
    main: Expect,
    pre: Option<Expect>,
    chunk: usize,
    /// Wire elements before the data (agreed exponents of float32 SUM/AVG).
    prefix: usize,
    es: usize,
    contributors: usize,
    agg_op: u8,
    fin: FinKind,
    count: usize,
    own: Option<Src<'a>>,
    out: Dst<'a>,
    done: Vec<u64>,
    ndone: usize,
    nchunks: usize,
    last_progress: Instant,
    exps: Vec<i64>,
    exps_got: usize,
    scales: Vec<f64>,
    block: usize,
    pending: Vec<(usize, Vec<i64>)>,
    error: Option<Error>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FinKind {
    Int,
    /// Quantized: `scales` per `block` data elements (fixed scale: one
    /// block; automatic: from the exponent prefix).
    F32Q,
    F32Ord,
    F32NonZero,
}

impl RootState<'_> {
    fn on_chunk(&mut self, d: &ChunkDone<'_>) {
        if self.error.is_some() {
            return;
        }
        let e = self.main;
        if d.msg_len != e.msg_len || d.dtype != e.dtype || d.agg_op != e.agg_op || d.contributors != e.mask {
            self.error = Some(Error::Mismatch {
                what: self.what.clone(),
                rank: e.mask_base + d.contributors.trailing_zeros() as u16,
                detail: format!(
                    "(one of contributors {:#x}) made chunk {} of {} bytes dtype {} op {}, the root expects {} bytes \
                     dtype {} op {} from contributors {:#x}",
                    d.contributors, d.frag_off, d.msg_len, d.dtype, d.agg_op, e.msg_len, e.dtype, e.agg_op, e.mask
                ),
            });
            return;
        }
        let c = d.frag_off as usize / self.chunk;
        if c >= self.nchunks || self.done[c / 64] & (1 << (c % 64)) != 0 {
            return;
        }
        self.done[c / 64] |= 1 << (c % 64);
        self.ndone += 1;
        self.last_progress = Instant::now();
        if d.overflow {
            self.error = Some(Error::Overflow {
                what: self.what.clone(),
                detail: format!(
                    "an int64 sum of chunk {c} (elements from {}) overflowed; the result does not fit i64",
                    c * self.chunk / self.es
                ),
            });
            return;
        }
        let first = c * self.chunk / self.es;
        let vals = d.values;
        // Prefix part (agreed exponents, each summed over the contributors).
        let mut data_first = first;
        let mut data_vals = vals;
        if first < self.prefix {
            let k = (self.prefix - first).min(vals.len());
            self.exps[first..first + k].copy_from_slice(&vals[..k]);
            self.exps_got += k;
            data_first = self.prefix;
            data_vals = &vals[k..];
            if self.exps_got == self.prefix && self.prefix > 0 {
                self.exponents_ready();
            }
        }
        if data_vals.is_empty() {
            return;
        }
        if self.exps_got < self.prefix {
            self.pending.push((data_first, data_vals.to_vec()));
            return;
        }
        self.apply(data_first - self.prefix, data_vals);
    }

    fn exponents_ready(&mut self) {
        let n = self.contributors.max(1) as i64;
        self.scales.clear();
        for (b, &sum) in self.exps.iter().enumerate() {
            if sum % n != 0 {
                self.error = Some(Error::Mismatch {
                    what: self.what.clone(),
                    rank: self.main.mask_base + self.main.mask.trailing_zeros() as u16,
                    detail: format!(
                        "(one of the contributors) sent a different agreed exponent for block {b} (sum {sum} over {n} \
                         contributors)"
                    ),
                });
                return;
            }
            self.scales.push(quant::auto_scale((sum / n) as i32, 0));
        }
        for (first, vals) in std::mem::take(&mut self.pending) {
            self.apply(first - self.prefix, &vals);
        }
    }

    fn apply(&mut self, data_first: usize, vals: &[i64]) {
        let enc = match self.fin {
            FinKind::Int => FinEnc::Int,
            FinKind::F32Q => FinEnc::F32Q { scales: &self.scales, block: self.block },
            FinKind::F32Ord => FinEnc::F32Ord,
            FinKind::F32NonZero => FinEnc::F32NonZero,
        };
        let f = Finish { agg_op: self.agg_op, enc, count: self.count };
        if let Err(OutOfRange { index, value }) = f.apply(vals, data_first, self.own, &mut self.out) {
            self.error = Some(Error::Overflow {
                what: self.what.clone(),
                detail: format!("element {index} is {value}, outside the output type; use a wider element type"),
            });
        }
    }

    fn complete(&self) -> bool {
        self.ndone == self.nchunks
    }

    fn missing(&self) -> Vec<usize> {
        (0..self.nchunks).filter(|&c| self.done[c / 64] & (1 << (c % 64)) == 0).collect()
    }
}

/// The sink of a pump: admission and delivery for the local root.
struct RootSink<'s, 'a> {
    stash: &'s mut Stash,
    /// Call number of the current call.
    call: u32,
    cap: usize,
    state: Option<&'s mut RootState<'a>>,
    stashed: u64,
    stale: u64,
}

impl AggSink for RootSink<'_, '_> {
    fn admit(&mut self, h: &Header) -> Admit {
        if let Some(st) = self.state.as_deref_mut() {
            let which =
                if h.msg_seq == st.main.op_id { Some(st.main) } else { st.pre.filter(|p| p.op_id == h.msg_seq) };
            if let Some(e) = which {
                return match e.check(h) {
                    Ok(()) => Admit::Yes,
                    Err(detail) => {
                        if st.error.is_none() {
                            st.error = Some(Error::Mismatch {
                                what: st.what.clone(),
                                rank: h.src_rank,
                                detail: detail.clone(),
                            });
                        }
                        Admit::Mismatch(detail)
                    }
                };
            }
        }
        // An allreduce through this member (the pre-pass of a reduce to it):
        // its results go out as packets, nothing to keep.
        if h.flags & F_ALLREDUCE != 0 {
            return Admit::Yes;
        }
        // A reduce to this member of one of the next calls: take it while
        // the stash has room (bounded memory), else the sender retransmits.
        let ahead = h.msg_seq.wrapping_sub(self.call.wrapping_add(1).wrapping_mul(4));
        if ahead < 8 && self.stash.chunks.len() < self.cap {
            Admit::Yes
        } else {
            Admit::Early
        }
    }

    fn deliver(&mut self, d: &ChunkDone<'_>) {
        if let Some(st) = self.state.as_deref_mut() {
            if d.op_id == st.main.op_id {
                st.on_chunk(d);
                return;
            }
        }
        // Any later call, however far ahead: on the kernel path this record
        // is the only copy of the chunk (its contributors were ACKed and
        // moved on), so dropping it would lose the chunk for good.  room()
        // bounds how many are read.
        if !call_or_later(d.op_id, self.call.wrapping_add(1)) {
            self.stale += 1;
            return;
        }
        self.stashed += 1;
        self.stash.chunks.push(Stashed {
            op_id: d.op_id,
            frag_off: d.frag_off,
            msg_len: d.msg_len,
            payload_len: d.payload_len,
            agg_op: d.agg_op,
            dtype: d.dtype,
            overflow: d.overflow,
            contributors: d.contributors,
            values: d.values.to_vec(),
        });
    }

    fn room(&self) -> usize {
        self.cap.saturating_sub(self.stash.chunks.len())
    }
}

/// One member process of a group.
pub struct Collective {
    group: Group,
    me: Member,
    cfg: AggConfig,
    chunk: usize,
    sock: BatchSocket,
    rb: RecvBatch,
    backend: AggBackend,
    reason: String,
    /// Calls made so far (the next call's number).
    calls: u32,
    stash: Stash,
    stats: CollectiveStats,
    scratch: Vec<i64>,
    /// AIMD window toward each aggregating rank, kept across operations.
    cwnds: std::collections::HashMap<u16, Cwnd>,
    /// Ranks left out of every contributor set (Collective::exclude_ranks).
    excluded: Vec<u16>,
    /// The last reduce this member finished as root, for settle().
    last_root: Option<RootDone>,
    /// Whether the first call's number was agreed with an aggregator
    /// (KCCL_T_AGG_SYNC).
    synced: bool,
}

/// A reduce operation finished at this root: (op id, chunks, contributors).
#[derive(Debug, Clone, Copy)]
struct RootDone {
    op_id: u32,
    nchunks: u32,
    base: u16,
    mask: u64,
}

/// Where RESULT chunks go: (chunk, payload, overflow).
type Decode<'d> = &'d mut dyn FnMut(usize, &[u8], bool);

/// Receives one batch (or times out) and hands every datagram to its role:
/// contributions to the aggregator backend, answers to the contributor.
#[allow(clippy::too_many_arguments)]
fn pump(
    sock: &BatchSocket,
    rb: &mut RecvBatch,
    backend: &mut AggBackend,
    stats: &mut CollectiveStats,
    wait: Duration,
    root_waiting: bool,
    mut contrib: Option<(&mut Contributor<'_>, Decode<'_>)>,
    sink: &mut dyn AggSink,
) -> Result<()> {
    let mut sock_wait = wait;
    if backend.path() == Path::Kernel {
        // Kernel records: wait on the ring when the root waits for them,
        // else only drain it; then the socket without blocking.  No more
        // records than the sink can keep: the others stay in the ring (with
        // no room, the root waits on its socket only).
        let room = sink.room();
        let ring_wait = root_waiting && room > 0;
        let t = if ring_wait { wait.min(Duration::from_millis(1)) } else { Duration::ZERO };
        backend.poll(t, room, sink)?;
        sock_wait = if ring_wait { Duration::ZERO } else { wait };
    }
    let n = sock.recv_batch(rb, Some(sock_wait))?;
    stats.recv_calls += 1;
    let now = Instant::now();
    for i in 0..n {
        let (d, from) = rb.get(i);
        let Ok(d) = d else {
            stats.other_datagrams += 1;
            continue;
        };
        match Header::decode(d) {
            Ok((h, p)) if h.msg_type == T_AGG => {
                let agg = backend.user_mut();
                agg.count_datagram();
                agg.ingest(&h, p, from, now, sink);
            }
            Ok((h, _)) if h.msg_type == T_AGG_RECEIPT => backend.user_mut().take_receipt(&h, from),
            Ok((h, p)) if matches!(h.msg_type, T_AGG_RESULT | T_AGG_ACK | T_AGG_PENDING) => match contrib.as_mut() {
                Some((c, dec)) => {
                    c.on_answer(&h, p, from, now, &mut **dec);
                }
                None => stats.contrib.stale_answers += 1,
            },
            _ => stats.other_datagrams += 1,
        }
    }
    backend.user_mut().flush(sock)
}

/// How a member's aggregated chunks become output elements (allreduce).
fn finish_of<'a>(enc: &Enc<'a>, op: AggOp, count: usize) -> Finish<'a> {
    let fe = match *enc {
        Enc::F32Q { scales, block, .. } => FinEnc::F32Q { scales, block },
        Enc::F32Ord(_) => FinEnc::F32Ord,
        Enc::F32NonZero(_) => FinEnc::F32NonZero,
        Enc::I32(_) | Enc::I64(_) => FinEnc::Int,
    };
    Finish { agg_op: op.wire(), enc: fe, count }
}

fn chunk_list(cs: &[usize]) -> String {
    let shown: Vec<String> = cs.iter().take(8).map(|c| c.to_string()).collect();
    let more = if cs.len() > 8 { format!(" and {} more", cs.len() - 8) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

impl Collective {
    /// Rank `rank`'s member process, in the calling thread's network
    /// namespace (binds the group's address and port of the rank).
    pub fn new(group: &Group, rank: u16, choice: PathChoice, cfg: AggConfig) -> Result<Collective> {
        let me = group.member(rank.into())?.clone();
        if group.aggregator == Some(rank) {
            return Err(Error::Usage(format!(
                "rank {rank} is the group's allreduce aggregator (aggregator = {rank}): run the Aggregator service \
                 (`kccl aggregator`) there, not a Collective"
            )));
        }
        let chunk = resolve_config(group, &me, &cfg)?;
        let sock = BatchSocket::bind(me.addr, me.port, 64 << 20, 16 << 20)?;
        if cfg.gso {
            sock.enable_gso();
        }
        let rb = RecvBatch::new(crate::sock::MAX_BATCH, HDR_LEN + chunk);
        let (backend, reason) = make_backend(group, &me, &cfg, chunk, choice)?;
        Ok(Collective {
            group: group.clone(),
            me,
            cfg,
            chunk,
            sock,
            rb,
            backend,
            reason,
            calls: 0,
            stash: Stash::default(),
            stats: CollectiveStats::default(),
            scratch: Vec::with_capacity(chunk / 4),
            cwnds: Default::default(),
            excluded: Vec::new(),
            last_root: None,
            synced: false,
        })
    }

    /// Runs the following operations without `ranks` (e.g. the ones an
    /// Error::MembersMissing named): they are left out of every contributor
    /// set.  Every remaining member must exclude the same ranks before its
    /// next call (their contributor masks must agree), and the excluded
    /// ranks must not call again.  A reduce root cannot be excluded.
    pub fn exclude_ranks(&mut self, ranks: &[u16]) -> Result<()> {
        if ranks.contains(&self.me.rank) {
            return Err(Error::Usage(format!("rank {} cannot exclude itself", self.me.rank)));
        }
        for &r in ranks {
            self.group.member(r.into())?;
            if !self.excluded.contains(&r) {
                self.excluded.push(r);
            }
        }
        Ok(())
    }

    /// Ranks excluded with [`exclude_ranks`](Self::exclude_ranks).
    pub fn excluded_ranks(&self) -> &[u16] {
        &self.excluded
    }

    pub fn rank(&self) -> u16 {
        self.me.rank
    }

    /// The path of this member's aggregator role (reduce root).  Contributions
    /// are the same packets on both paths.
    pub fn path(&self) -> Path {
        self.backend.path()
    }

    /// Why this path is in use.
    pub fn path_reason(&self) -> &str {
        &self.reason
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    pub fn config(&self) -> &AggConfig {
        &self.cfg
    }

    pub fn stats(&self) -> CollectiveStats {
        CollectiveStats { agg: self.backend.user().stats(), ..self.stats }
    }

    /// Mismatching contributions this member's aggregator role refused.
    pub fn take_mismatches(&mut self) -> Vec<MismatchEvent> {
        self.backend.user_mut().take_mismatches()
    }

    /// Counters of xdp_agg/tc_agg_result (None on the user path).
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_stats(&self) -> Result<Option<crate::kernel_agg::AggStats>> {
        self.backend.kernel_stats()
    }

    fn timing(&self) -> Timing {
        Timing { window: self.cfg.window, rto: self.cfg.rto, deadline: self.cfg.deadline }
    }

    fn next_call(&mut self) -> u32 {
        let k = self.calls;
        self.calls = self.calls.wrapping_add(1);
        self.stats.calls += 1;
        k
    }

    /// reduce: combines every member's `data` with `op` at `root`.  Returns
    /// Some(result) on the root (its own data folded in), None elsewhere.
    /// Members: every rank of the group but the allreduce aggregator.
    pub fn reduce<T: Element>(&mut self, data: &[T], op: AggOp, root: u16) -> Result<Option<Vec<T>>> {
        if root == self.me.rank {
            self.root_collect(data.len(), op, Some(data)).map(Some)
        } else {
            self.send_aggregated_data(data, op, root).map(|_| None)
        }
    }

    /// allreduce: every member (all ranks but the group's aggregator) gets
    /// `op` over every member's `data`, combined by the aggregator rank.
    pub fn allreduce<T: Element>(&mut self, data: &[T], op: AggOp) -> Result<Vec<T>> {
        if let Some(agg) = self.group.aggregator {
            self.sync_start(agg)?;
        }
        let call = self.next_call();
        let what = format!("allreduce call {call} ({} {op}, {} elements)", T::NAME, data.len());
        let Some(agg) = self.group.aggregator else {
            return Err(Error::Usage(format!(
                "{what}: the group file names no allreduce aggregator; add `aggregator = <rank>` (a rank that runs \
                 `kccl aggregator`)"
            )));
        };
        let mut exclude = vec![agg];
        exclude.extend(&self.excluded);
        let set = contributors(&self.group, &what, &exclude)?;
        let mut out = vec![T::default(); data.len()];
        if data.is_empty() {
            return Ok(out);
        }
        check_len::<T>(&what, data.len(), 0)?;
        let agg_addr = self.addr_of(agg)?;
        let src = T::src(data);
        let mut scales = Vec::new();
        let quant = self.cfg.quant;
        if let (Src::F32(f), AggOp::Sum | AggOp::Avg) = (src, op) {
            match quant {
                // Agree on the per-chunk exponents first (MAX of one int32
                // per chunk); the int32 result needs ceil(log2 n) headroom.
                Quant::Auto => {
                    let mut exps = Vec::new();
                    quant::block_exponents(f, self.chunk / 4, &mut exps)?;
                    let spec = self.spec(&what, call * 4, AggOp::Max, agg, agg_addr, set, true, false);
                    let mut agreed = vec![0i32; exps.len()];
                    let fin = finish_of(&Enc::I32(&exps), AggOp::Max, set.count);
                    let (_, ovf) = self.run_allreduce(spec, Enc::I32(&exps), fin, &mut Dst::I32(&mut agreed))?;
                    if !ovf.is_empty() {
                        return Err(self.protocol_error(&what, "the exponent pre-pass came back with OVERFLOW"));
                    }
                    let h = quant::headroom(set.count);
                    scales = agreed.iter().map(|&e| quant::auto_scale(e, h)).collect();
                }
                Quant::Fixed(s) => {
                    quant::check_fixed(f, s)?;
                    scales = vec![s];
                }
            }
        }
        let enc = self.encoding(src, op, &scales, &[])?;
        let fin = finish_of(&enc, op, set.count);
        let spec = self.spec(&what, call * 4 + 1, op, agg, agg_addr, set, true, false);
        let (_, overflowed) = self.run_allreduce(spec, enc, fin, &mut T::dst(&mut out))?;
        if !overflowed.is_empty() {
            self.redo(&what, call, op, agg, agg_addr, set, &enc, &overflowed, &mut T::dst(&mut out))?;
        }
        Ok(out)
    }

    /// The paper's building block of reduce, contributor side: sends `data`
    /// for the reduce to rank `to` and waits until every chunk is
    /// acknowledged.
    pub fn send_aggregated_data<T: Element>(&mut self, data: &[T], op: AggOp, to: u16) -> Result<SendReport> {
        let call = self.next_call();
        let what = format!("reduce call {call} to rank {to} ({} {op}, {} elements)", T::NAME, data.len());
        let to_addr = self.addr_of(to)?;
        if to == self.me.rank {
            return Err(Error::Usage(format!("{what}: rank {to} is this member; use get_aggregated_data or reduce")));
        }
        if self.group.aggregator == Some(to) {
            return Err(Error::Usage(format!(
                "{what}: rank {to} is the group's allreduce aggregator, which has no reduce root; reduce to a member"
            )));
        }
        let set = self.reduce_contributors(&what, to)?;
        let mut report =
            SendReport { op_id: call * 4 + 1, chunks: 0, datagrams: 0, retransmits: 0, elapsed: Duration::ZERO };
        if data.is_empty() {
            return Ok(report);
        }
        let t0 = Instant::now();
        let src = T::src(data);
        let (mut agreed, mut scales) = (Vec::new(), Vec::new());
        if let (Src::F32(f), AggOp::Sum | AggOp::Avg) = (src, op) {
            match self.cfg.quant {
                // The exponents are agreed by an allreduce MAX through the
                // root; the data message then starts with them, so that the
                // root learns the scales from its own reduce records (on the
                // kernel path it never sees that allreduce's results).  The
                // root keeps int64 sums: no headroom needed.
                Quant::Auto => {
                    let mut exps = Vec::new();
                    quant::block_exponents(f, self.chunk / 4, &mut exps)?;
                    check_len::<T>(&what, data.len(), exps.len())?;
                    let spec = self.spec(&what, call * 4, AggOp::Max, to, to_addr, set, true, false);
                    agreed = vec![0i32; exps.len()];
                    let fin = finish_of(&Enc::I32(&exps), AggOp::Max, set.count);
                    let (_, ovf) = self.run_allreduce(spec, Enc::I32(&exps), fin, &mut Dst::I32(&mut agreed))?;
                    if !ovf.is_empty() {
                        return Err(self.protocol_error(&what, "the exponent pre-pass came back with OVERFLOW"));
                    }
                    scales = agreed.iter().map(|&e| quant::auto_scale(e, 0)).collect();
                }
                Quant::Fixed(s) => {
                    quant::check_fixed(f, s)?;
                    scales = vec![s];
                }
            }
        }
        check_len::<T>(&what, data.len(), agreed.len())?;
        let enc = self.encoding(src, op, &scales, &agreed)?;
        let spec = self.spec(&what, call * 4 + 1, op, to, to_addr, set, false, false);
        let (st, _) = self.contribute(spec, enc, &mut |_, _, _| {})?;
        report.chunks = st.chunks as usize;
        report.datagrams = st.datagrams;
        report.retransmits = st.retransmits;
        report.elapsed = t0.elapsed();
        Ok(report)
    }

    /// The paper's building block of reduce, root side: the aggregate of
    /// the contributors' data (`len` elements each; this member's own data
    /// is not included: see [`reduce`](Self::reduce)).  AVG divides by the
    /// number of contributors.
    pub fn get_aggregated_data<T: Element>(&mut self, len: usize, op: AggOp) -> Result<Vec<T>> {
        self.root_collect::<T>(len, op, None)
    }

    /// Before this member's first allreduce: asks the group's aggregator
    /// service which call to start at (KCCL_T_AGG_SYNC), so that a member
    /// process started again against a long-lived aggregator does not reuse
    /// op ids whose answers or receipts it still holds: a reused op id would
    /// be answered from the old operation's slot, or dropped as a late
    /// copy.  Every member of a run asks before the run's first operation
    /// can finish, so all get the same call.  Retried every rto (doubling)
    /// until the deadline.  Not for reduce: a root may start reading only
    /// after its contributors finished (the kernel aggregates meanwhile),
    /// and a root is normally a process of the job itself.
    fn sync_start(&mut self, agg_rank: u16) -> Result<()> {
        if self.synced {
            return Ok(());
        }
        let agg = self.addr_of(agg_rank)?;
        let h = Header::control(T_AGG_SYNC, self.group.job_id, self.me.rank, 0);
        let mut hb = [0u8; HDR_LEN];
        h.encode(&mut hb);
        let t0 = Instant::now();
        let mut rto = self.cfg.rto;
        loop {
            self.sock.send_all(&[crate::sock::Datagram { to: agg, head: &hb, body: &[] }])?;
            let until = Instant::now() + rto;
            while let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) {
                let n = self.sock.recv_batch(&mut self.rb, Some(left))?;
                for i in 0..n {
                    let (d, from) = self.rb.get(i);
                    match d.ok().and_then(|d| Header::decode(d).ok()) {
                        Some((a, _))
                            if a.msg_type == T_AGG_SYNC_ACK
                                && from == agg
                                && a.src_rank == agg_rank
                                && a.job_id == self.group.job_id =>
                        {
                            let call = a.msg_seq / 4;
                            // Only forward: a call already made keeps its number.
                            if (call.wrapping_sub(self.calls) as i32) > 0 {
                                self.calls = call;
                            }
                            self.synced = true;
                            return Ok(());
                        }
                        // Nothing else is due before the first operation;
                        // senders of anything else retransmit.
                        _ => self.stats.other_datagrams += 1,
                    }
                }
            }
            if t0.elapsed() >= self.cfg.deadline {
                return Err(Error::Timeout {
                    ms: t0.elapsed().as_millis() as u64,
                    what: format!(
                        "rank {}: no answer from aggregator rank {agg_rank} ({agg}) to which call to start at \
                         (KCCL_T_AGG_SYNC); check that it runs (`kccl aggregator`, or the reduce root) with the \
                         same kccl version and group file",
                        self.me.rank
                    ),
                });
            }
            rto = rto.saturating_mul(2).min(self.cfg.rto.saturating_mul(16));
        }
    }

    /// After the last reduce this member finished as root: keeps answering
    /// retransmissions until every contributor of it confirmed it has every
    /// answer (its RECEIPT; an ACK lost in the fan-out is re-sent from the
    /// finished chunk), or `max` passed.  Call it before the process exits
    /// (on the kernel path the programs detach with it, on the user path
    /// nobody else answers).  Returns the ranks that did not confirm (their
    /// receipt was lost, or they died); empty when all did or there was no
    /// such reduce.
    pub fn settle(&mut self, max: Duration) -> Result<Vec<u16>> {
        let Some(d) = self.last_root else { return Ok(Vec::new()) };
        let end = Instant::now() + max;
        loop {
            let mut open = Vec::new();
            for b in (0..MASK_BITS).filter(|&b| d.mask >> b & 1 != 0) {
                let rank = d.base + b as u16;
                if !user::ack_covers(self.backend.ack_of(rank)?, d.op_id, d.nchunks) {
                    open.push(rank);
                }
            }
            let left = end.saturating_duration_since(Instant::now());
            if open.is_empty() || left.is_zero() {
                return Ok(open);
            }
            self.serve_for(left.min(Duration::from_millis(5)))?;
        }
    }

    /// Serves the aggregator role for `d` without running an operation:
    /// answers retransmissions of finished chunks and takes early
    /// contributions.  A reduce root can linger with it after its last call
    /// so that a contributor whose ACK was lost still finishes.
    pub fn serve_for(&mut self, d: Duration) -> Result<()> {
        let end = Instant::now() + d;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            let mut sink = RootSink {
                stash: &mut self.stash,
                call: self.calls.wrapping_sub(1),
                cap: self.cfg.nslots,
                state: None,
                stashed: 0,
                stale: 0,
            };
            let wait = left.min(Duration::from_millis(50));
            let r = pump(&self.sock, &mut self.rb, &mut self.backend, &mut self.stats, wait, false, None, &mut sink);
            self.stats.stashed += sink.stashed;
            self.stats.stale_chunks += sink.stale;
            r?;
        }
    }

    fn protocol_error(&self, what: &str, msg: &str) -> Error {
        Error::Usage(format!("{what}: {msg} (protocol error; check that every member runs the same kccl version)"))
    }

    fn addr_of(&self, rank: u16) -> Result<SocketAddrV4> {
        let m = self.group.member(rank.into())?;
        Ok(SocketAddrV4::new(m.addr, m.port))
    }

    fn reduce_contributors(&self, what: &str, root: u16) -> Result<Contributors> {
        if self.excluded.contains(&root) {
            return Err(Error::Usage(format!("{what}: root {root} was excluded (Collective::exclude_ranks)")));
        }
        let mut exclude = vec![root];
        exclude.extend(self.group.aggregator);
        exclude.extend(&self.excluded);
        contributors(&self.group, what, &exclude)
    }

    #[allow(clippy::too_many_arguments)]
    fn spec(
        &self,
        what: &str,
        op_id: u32,
        op: AggOp,
        agg: u16,
        agg_addr: SocketAddrV4,
        set: Contributors,
        allreduce: bool,
        user_only: bool,
    ) -> Spec {
        Spec {
            what: format!("{what}, op id {op_id}"),
            job_id: self.group.job_id,
            my_rank: self.me.rank,
            agg_rank: agg,
            agg_addr,
            op_id,
            agg_op: op.wire(),
            chunk: self.chunk,
            allreduce,
            user_only,
            mask_base: set.base,
            mask: set.mask,
        }
    }

    /// The wire encoding of `src` for `op` (codec.rs); refuses non-finite
    /// floats before anything is sent.  `scales`: per block of chunk/4
    /// elements (automatic) or one fixed scale.
    fn encoding<'a>(&self, src: Src<'a>, op: AggOp, scales: &'a [f64], prefix: &'a [i32]) -> Result<Enc<'a>> {
        Ok(match src {
            Src::I32(d) => Enc::I32(d),
            Src::I64(d) => Enc::I64(d),
            Src::F32(d) => {
                if let Some(index) = quant::first_non_finite(d) {
                    return Err(Error::NonFinite { index });
                }
                match op {
                    AggOp::Max | AggOp::Min => Enc::F32Ord(d),
                    AggOp::Count => Enc::F32NonZero(d),
                    AggOp::Sum | AggOp::Avg => {
                        let block = if scales.len() == 1 && self.cfg.quant != Quant::Auto {
                            d.len().max(1)
                        } else {
                            self.chunk / 4
                        };
                        Enc::F32Q { data: d, scales, block, prefix }
                    }
                }
            }
        })
    }

    /// One operation as a contributor, to completion or error.  `decode`
    /// gets each newly answered RESULT chunk.  Returns this operation's
    /// counters and the chunks whose RESULT carried F_OVERFLOW.
    fn contribute(
        &mut self,
        spec: Spec,
        enc: Enc<'_>,
        decode: &mut dyn FnMut(usize, &[u8], bool),
    ) -> Result<(ContribStats, Vec<usize>)> {
        let agg_rank = spec.agg_rank;
        let cwnd = *self.cwnds.entry(agg_rank).or_insert_with(|| Cwnd::new(self.cfg.window));
        let mut c = Contributor::new(spec, enc, self.timing(), cwnd);
        self.stats.ops += 1;
        let res = loop {
            let now = Instant::now();
            if let Err(e) = c.send_due(&self.sock, now) {
                break Err(e);
            }
            if c.done() {
                break Ok(());
            }
            let mut sink = RootSink {
                stash: &mut self.stash,
                call: self.calls.wrapping_sub(1),
                cap: self.cfg.nslots,
                state: None,
                stashed: 0,
                stale: 0,
            };
            let wait = c.wait(now);
            let r = pump(
                &self.sock,
                &mut self.rb,
                &mut self.backend,
                &mut self.stats,
                wait,
                false,
                Some((&mut c, &mut *decode)),
                &mut sink,
            );
            self.stats.stashed += sink.stashed;
            self.stats.stale_chunks += sink.stale;
            if let Err(e) = r {
                break Err(e);
            }
            if c.done() {
                break Ok(());
            }
            if let Err(e) = c.check_deadline(Instant::now()) {
                break Err(e);
            }
        };
        self.cwnds.insert(agg_rank, c.cwnd);
        // Done or given up: either way this member wants no more answers of
        // the operation, so the aggregator may reuse its slots.  Best effort
        // (if lost, the slots are reused cfg_slot_timeout after completion).
        let _ = c.send_receipt(&self.sock);
        self.stats.contrib.add(&c.stats);
        res.map(|()| (c.stats, c.overflowed().to_vec()))
    }

    /// An allreduce-type operation (RESULT answers) decoded into `out`;
    /// chunks with F_OVERFLOW are left for the redo.
    fn run_allreduce(
        &mut self,
        spec: Spec,
        enc: Enc<'_>,
        fin: Finish<'_>,
        out: &mut Dst<'_>,
    ) -> Result<(ContribStats, Vec<usize>)> {
        let what = spec.what.clone();
        let es = enc.elem_size();
        let dtype = enc.dtype();
        let chunk = self.chunk;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut err: Option<OutOfRange> = None;
        let res = self.contribute(spec, enc, &mut |c, payload, overflow| {
            if overflow || err.is_some() {
                return;
            }
            codec::read_wire(payload, dtype, &mut scratch);
            if let Err(e) = fin.apply(&scratch, c * chunk / es, None, out) {
                err = Some(e);
            }
        });
        self.scratch = scratch;
        let r = res?;
        if let Some(OutOfRange { index, value }) = err {
            return Err(Error::Overflow {
                what,
                detail: format!("element {index} is {value}, outside the output type; use a wider element type"),
            });
        }
        Ok(r)
    }

    /// The exact redo of allreduce chunks whose int32 result overflowed:
    /// their int32 wire values (as sent: quantized for F32Q) are resent
    /// widened to I64, with USER_ONLY (the kernel passes them to the
    /// aggregator's user space, which sums in int64 and answers in int64),
    /// under op id 4k + 2.  The redo message is the overflowed chunks
    /// concatenated in chunk order; a chunk of C bytes holds C/8 int64
    /// elements, so original chunk `overflowed[j]` is redo chunks 2j and
    /// 2j + 1 (the last original chunk may be shorter, and is last).
    #[allow(clippy::too_many_arguments)]
    fn redo(
        &mut self,
        what: &str,
        call: u32,
        op: AggOp,
        agg: u16,
        agg_addr: SocketAddrV4,
        set: Contributors,
        enc: &Enc<'_>,
        overflowed: &[usize],
        out: &mut Dst<'_>,
    ) -> Result<()> {
        if enc.dtype() == DT_I64 {
            return Err(Error::Overflow {
                what: what.into(),
                detail: format!(
                    "the int64 sum overflowed in chunks {} (elements from {}); the result does not fit i64",
                    chunk_list(overflowed),
                    overflowed[0] * self.chunk / 8
                ),
            });
        }
        let epc = self.chunk / 4;
        let total = enc.elems();
        let mut wide: Vec<i64> = Vec::with_capacity(overflowed.len() * epc);
        let mut buf = vec![0u8; self.chunk];
        for &c in overflowed {
            let first = c * epc;
            let n = epc.min(total - first);
            enc.encode(first, &mut buf[..n * 4]);
            wide.extend(buf[..n * 4].chunks_exact(4).map(|b| i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))));
        }
        self.stats.redo_ops += 1;
        let fin = finish_of(enc, op, set.count);
        let half = self.chunk / 8;
        let spec = self.spec(what, call * 4 + 2, op, agg, agg_addr, set, true, true);
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut err: Option<Error> = None;
        let res = self.contribute(spec, Enc::I64(&wide), &mut |k, payload, overflow| {
            if err.is_some() {
                return;
            }
            if overflow {
                err = Some(Error::Overflow {
                    what: what.into(),
                    detail: format!("the int64 redo of chunk {} overflowed", overflowed[k / 2]),
                });
                return;
            }
            codec::read_wire(payload, DT_I64, &mut scratch);
            let first = overflowed[k / 2] * epc + (k % 2) * half;
            if let Err(OutOfRange { index, value }) = fin.apply(&scratch, first, None, out) {
                err = Some(Error::Overflow {
                    what: what.into(),
                    detail: format!(
                        "element {index} sums to {value}, which does not fit the output type (computed exactly by \
                         the int64 redo); use i64 data"
                    ),
                });
            }
        });
        self.scratch = scratch;
        res?;
        err.map_or(Ok(()), Err)
    }

    /// The root of a reduce: serves the aggregation (user space) or reads
    /// the kernel's records until every chunk of the operation is in, and
    /// folds `own` in.
    fn root_collect<T: Element>(&mut self, len: usize, op: AggOp, own: Option<&[T]>) -> Result<Vec<T>> {
        let call = self.next_call();
        let me = self.me.rank;
        let what = format!("reduce call {call} at root {me} ({} {op}, {len} elements)", T::NAME);
        if self.group.aggregator == Some(me) {
            return Err(Error::Usage(format!("{what}: rank {me} is the allreduce aggregator")));
        }
        let set = self.reduce_contributors(&what, me)?;
        let mut out = vec![T::default(); len];
        if len == 0 {
            return Ok(out);
        }
        let own_src = own.map(T::src);
        if let Some(Src::F32(f)) = own_src {
            if let Some(index) = quant::first_non_finite(f) {
                return Err(Error::NonFinite { index });
            }
        }
        let block_elems = self.chunk / 4;
        // Encoding of the contributors' messages (what codec::Enc makes).
        let (fin, dtype, prefix, scales, block) = match (T::DTYPE, op, self.cfg.quant) {
            (DType::I32, _, _) => (FinKind::Int, DT_I32, 0, vec![], 1),
            (DType::I64, _, _) => (FinKind::Int, DT_I64, 0, vec![], 1),
            (DType::F32Q, AggOp::Max | AggOp::Min, _) => (FinKind::F32Ord, DT_I32, 0, vec![], 1),
            (DType::F32Q, AggOp::Count, _) => (FinKind::F32NonZero, DT_I32, 0, vec![], 1),
            (DType::F32Q, _, Quant::Auto) => (FinKind::F32Q, DT_F32Q, len.div_ceil(block_elems), vec![], block_elems),
            (DType::F32Q, _, Quant::Fixed(s)) => {
                if !(s.is_finite() && s > 0.0) {
                    return Err(Error::Usage(format!("{what}: quantization scale {s} must be finite and positive")));
                }
                (FinKind::F32Q, DT_F32Q, 0, vec![s], len)
            }
        };
        let count = set.count + usize::from(own.is_some());
        if set.count == 0 {
            let Some(o) = own_src else {
                return Err(Error::Usage(format!("{what}: no other member contributes to a reduce at rank {me}")));
            };
            let one = [1.0];
            let enc = match fin {
                FinKind::Int => FinEnc::Int,
                FinKind::F32Q => FinEnc::F32Q { scales: &one, block: usize::MAX },
                FinKind::F32Ord => FinEnc::F32Ord,
                FinKind::F32NonZero => FinEnc::F32NonZero,
            };
            let f = Finish { agg_op: op.wire(), enc, count };
            codec::own_only(&f, o, &mut T::dst(&mut out)).map_err(|OutOfRange { index, value }| Error::Overflow {
                what: what.clone(),
                detail: format!("element {index} is {value}, outside the output type"),
            })?;
            return Ok(out);
        }
        check_len::<T>(&what, len, prefix)?;
        let es = if dtype == DT_I64 { 8 } else { 4 };
        let msg_len = (prefix + len) * es;
        let main = Expect {
            op_id: call * 4 + 1,
            allreduce: false,
            agg_op: op.wire(),
            dtype,
            msg_len: msg_len as u32,
            mask_base: set.base,
            mask: set.mask,
        };
        let pre = (prefix > 0).then_some(Expect {
            op_id: call * 4,
            allreduce: true,
            agg_op: OP_MAX,
            dtype: DT_I32,
            msg_len: (prefix * 4) as u32,
            mask_base: set.base,
            mask: set.mask,
        });
        let nchunks = packet::chunk_count(msg_len, self.chunk);
        let mut st = RootState {
            what: what.clone(),
            main,
            pre,
            chunk: self.chunk,
            prefix,
            es,
            contributors: set.count,
            agg_op: op.wire(),
            fin,
            count,
            own: own_src,
            out: T::dst(&mut out),
            done: vec![0u64; nchunks.div_ceil(64)],
            ndone: 0,
            nchunks,
            last_progress: Instant::now(),
            exps: vec![0i64; prefix],
            exps_got: 0,
            scales,
            block,
            pending: Vec::new(),
            error: None,
        };
        // Chunks that completed before this call; forget older ones.
        let early = self.stash.take_call(call, main.op_id);
        for c in &early {
            st.on_chunk(&c.view());
        }
        loop {
            if let Some(e) = st.error.take() {
                return Err(e);
            }
            if st.complete() {
                break;
            }
            let since = st.last_progress.elapsed();
            if since >= self.cfg.deadline {
                return Err(self.root_timeout(&st, since));
            }
            let wait = (self.cfg.deadline - since).min(Duration::from_millis(50));
            let mut sink = RootSink {
                stash: &mut self.stash,
                call,
                cap: self.cfg.nslots,
                state: Some(&mut st),
                stashed: 0,
                stale: 0,
            };
            let r = pump(&self.sock, &mut self.rb, &mut self.backend, &mut self.stats, wait, true, None, &mut sink);
            self.stats.stashed += sink.stashed;
            self.stats.stale_chunks += sink.stale;
            r?;
        }
        self.stats.root_chunks += nchunks as u64;
        drop(st);
        self.last_root = Some(RootDone { op_id: main.op_id, nchunks: nchunks as u32, base: set.base, mask: set.mask });
        Ok(out)
    }

    fn root_timeout(&self, st: &RootState<'_>, since: Duration) -> Error {
        let missing = st.missing();
        let mut why = String::new();
        if let Some(&c) = missing.first() {
            let off = (c * self.chunk) as u32;
            match self
                .backend
                .user()
                .missing(st.main.op_id, off)
                .or_else(|| self.backend.kernel_missing(st.main.op_id, off))
            {
                Some((base, m)) => {
                    let ranks: Vec<String> =
                        (0..64).filter(|b| m & (1u64 << b) != 0).map(|b| (base as usize + b).to_string()).collect();
                    why = format!("; chunk {c} still waits for ranks {}", ranks.join(", "));
                }
                None if self.backend.path() == Path::User => {
                    why = format!("; no contribution to chunk {c} arrived");
                }
                None => {}
            }
            if st.prefix > 0 && st.exps_got < st.prefix {
                why += "; the exponent prefix is incomplete";
            }
            if self.backend.path() == Path::Kernel && self.stash.chunks.len() >= self.cfg.nslots {
                why += &format!(
                    "; the stash is full ({} chunks of later calls; more records wait in the ring buffer)",
                    self.stash.chunks.len()
                );
            }
        }
        Error::Timeout {
            ms: since.as_millis() as u64,
            what: format!(
                "{}: no chunk completed for {} ms; {} of {} chunks missing (chunks {}){why}. Check that every \
                 contributor runs this reduce with the same length, op and type",
                st.what,
                since.as_millis(),
                missing.len(),
                st.nchunks,
                chunk_list(&missing)
            ),
        }
    }
}

/// The message (prefix + data) must fit the header's 32-bit msg_len.
fn check_len<T: Element>(what: &str, len: usize, prefix: usize) -> Result<()> {
    let bytes = (len + prefix).saturating_mul(T::DTYPE.elem_size());
    if bytes > u32::MAX as usize {
        return Err(Error::Usage(format!(
            "{what}: {bytes} wire bytes exceed the 32-bit message length of the header; split the tensor"
        )));
    }
    Ok(())
}

/// The allreduce aggregator service: combines the contributions of every
/// member (all ranks but this one) and answers each with the result.
pub struct Aggregator {
    me: Member,
    sock: BatchSocket,
    rb: RecvBatch,
    backend: AggBackend,
    reason: String,
}

impl Aggregator {
    /// The service of rank `rank`, which must be the group's `aggregator`.
    pub fn new(group: &Group, rank: u16, choice: PathChoice, cfg: AggConfig) -> Result<Aggregator> {
        let me = group.member(rank.into())?.clone();
        match group.aggregator {
            Some(a) if a == rank => {}
            Some(a) => {
                return Err(Error::Usage(format!(
                    "rank {rank} is not the group's aggregator (the group file says aggregator = {a})"
                )))
            }
            None => {
                return Err(Error::Usage(format!(
                    "the group file names no aggregator: add `aggregator = {rank}` so that members send to this rank"
                )))
            }
        }
        let chunk = resolve_config(group, &me, &cfg)?;
        let sock = BatchSocket::bind(me.addr, me.port, 256 << 20, 64 << 20)?;
        if cfg.gso {
            sock.enable_gso();
        }
        let rb = RecvBatch::new(crate::sock::MAX_BATCH, HDR_LEN + chunk);
        let (backend, reason) = make_backend(group, &me, &cfg, chunk, choice)?;
        Ok(Aggregator { me, sock, rb, backend, reason })
    }

    pub fn rank(&self) -> u16 {
        self.me.rank
    }

    pub fn path(&self) -> Path {
        self.backend.path()
    }

    pub fn path_reason(&self) -> &str {
        &self.reason
    }

    /// Counters of the user-space aggregator (on the kernel path: of the
    /// packets the kernel passed up).
    pub fn stats(&self) -> AggStats {
        self.backend.user().stats()
    }

    /// Mismatching contributions refused since the last call.
    pub fn take_mismatches(&mut self) -> Vec<MismatchEvent> {
        self.backend.user_mut().take_mismatches()
    }

    /// Counters of xdp_agg/tc_agg_result (None on the user path).
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_stats(&self) -> Result<Option<crate::kernel_agg::AggStats>> {
        self.backend.kernel_stats()
    }

    /// Serves until `stop` is set (checked at least every 100 ms).
    pub fn serve(&mut self, stop: &AtomicBool) -> Result<()> {
        while !stop.load(Ordering::Relaxed) {
            self.serve_once(Duration::from_millis(100))?;
        }
        Ok(())
    }

    /// Kernel slots (index, state) held by operation `op_id` (None on the
    /// user path): what an abandoned operation left behind.
    #[cfg(feature = "kernel-agg")]
    pub fn kernel_slots_of_op(&self, op_id: u32) -> Result<Option<Vec<(u32, crate::kernel_agg::SlotState)>>> {
        match &self.backend {
            AggBackend::User(_) => Ok(None),
            AggBackend::Kernel(k) => k.engine().slots_of_op(op_id).map(Some),
        }
    }

    /// One receive batch (or `wait` without traffic); returns the datagrams.
    pub fn serve_once(&mut self, wait: Duration) -> Result<usize> {
        let mut sink = AllreduceOnly;
        if self.backend.path() == Path::Kernel {
            self.backend.poll(Duration::ZERO, usize::MAX, &mut sink)?;
        }
        let Aggregator { sock, rb, backend, .. } = self;
        backend.user_mut().serve_batch(sock, rb, Some(wait), &mut sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn g(ranks: &[u16]) -> Group {
        let members = ranks
            .iter()
            .map(|&r| Member {
                rank: r,
                addr: Ipv4Addr::new(10, 0, (r / 256) as u8, (r % 256) as u8 + 1),
                port: 4000,
                iface: "lo".into(),
                netns: None,
            })
            .collect();
        Group::new("t", 1, members)
    }

    #[test]
    fn contributor_masks() {
        let grp = g(&[0, 1, 2, 5]);
        let c = contributors(&grp, "x", &[0]).expect("fits");
        assert_eq!((c.base, c.mask, c.count), (0, 0b100110, 3));
        let grp = g(&(64..=128).collect::<Vec<_>>());
        let c = contributors(&grp, "x", &[128]).expect("64 ranks in [64, 128)");
        assert_eq!((c.base, c.count, c.mask), (64, 64, u64::MAX));
        let e = contributors(&grp, "x", &[64]).expect_err("65..=128 leaves the block");
        assert!(matches!(e, Error::TooManyContributors { count: 64, first: 65, last: 128, .. }), "{e}");
        let grp = g(&(0..=64).collect::<Vec<_>>());
        let e = contributors(&grp, "allreduce", &[]).expect_err("65 ranks");
        assert!(matches!(e, Error::TooManyContributors { count: 65, .. }), "{e}");
        assert!(e.to_string().contains("hierarchical"), "{e}");
        // 3 ranks spanning two 64-rank blocks.
        let grp = g(&[0, 63, 64, 200]);
        let e = contributors(&grp, "reduce", &[200]).expect_err("spans two blocks");
        assert!(e.to_string().contains("0..=64"), "{e}");
    }

    #[test]
    fn ops_and_types_match_the_wire() {
        for op in [AggOp::Sum, AggOp::Count, AggOp::Max, AggOp::Min, AggOp::Avg] {
            assert_eq!(AggOp::from_wire(op.wire()), Some(op));
            assert_eq!(op.to_string().to_lowercase().parse::<AggOp>().expect("parses"), op);
        }
        for t in [DType::I32, DType::I64, DType::F32Q] {
            assert_eq!(DType::from_wire(t.wire()), Some(t));
        }
        assert_eq!((AggOp::Sum.wire(), AggOp::Avg.wire(), DType::F32Q.wire()), (1, 5, 3));
        assert!(AggOp::from_wire(0).is_none() && DType::from_wire(4).is_none());
    }

    /// Regression: on the kernel path the root's kernel ACKs every chunk
    /// itself, so contributors can finish any number of calls before the
    /// root reads their ring buffer records.  The root used to keep only
    /// records of the next two calls and dropped the others, which were then
    /// lost for good (the root timed out on that call).  Records of every
    /// later call are kept; those of past calls are dropped; room() bounds
    /// how many are read off the ring.
    #[test]
    fn root_keeps_records_of_every_later_call() {
        let vals = [7i64, -3];
        let rec = |op_id: u32| ChunkDone {
            op_id,
            frag_off: 0,
            msg_len: 16,
            payload_len: 16,
            agg_op: OP_SUM,
            dtype: DT_I64,
            overflow: false,
            contributors: 0b11,
            values: &vals,
        };
        let mut stash = Stash::default();
        let mut sink = RootSink { stash: &mut stash, call: 5, cap: 8, state: None, stashed: 0, stale: 0 };
        assert_eq!(sink.room(), 8);
        // Calls 6 and 7 (what used to be kept), then 8, 9 and 30.
        for call in [6u32, 7, 8, 9, 30] {
            sink.deliver(&rec(call * 4 + 1));
        }
        assert_eq!(sink.room(), 3, "5 of 8 stash places used");
        // Calls 5 (the current one: no state, so a contributor call) and 2.
        for call in [5u32, 2] {
            sink.deliver(&rec(call * 4 + 1));
        }
        assert_eq!((sink.stashed, sink.stale), (5, 2));
        // The root reaches call 9: its chunk comes out of the stash, call
        // 30's stays, calls 6..=8 are past (that root skipped them).
        let got = stash.take_call(9, 37);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].op_id, got[0].values.as_slice()), (37, &vals[..]));
        assert_eq!(stash.chunks.iter().map(|c| c.op_id).collect::<Vec<_>>(), [121]);
        // Op ids wrap: call 2^30 - 1 uses op ids from 2^32 - 4, the next
        // call from 0.
        let last = (1u32 << 30) - 1;
        assert!(call_or_later(1, last.wrapping_add(1)) && call_or_later(1, last));
        assert!(!call_or_later(last.wrapping_mul(4) + 1, 0));
        let mut sink = RootSink { stash: &mut stash, call: last, cap: 8, state: None, stashed: 0, stale: 0 };
        sink.deliver(&rec(1));
        assert_eq!((sink.stashed, sink.stale), (1, 0));
    }

    #[test]
    fn config_is_checked() {
        let grp = g(&[0, 1]);
        let me = grp.members[0].clone();
        assert_eq!(resolve_config(&grp, &me, &AggConfig::default()).expect("defaults"), 1432);
        let bad = AggConfig { window: 1024, ..AggConfig::default() };
        assert!(resolve_config(&grp, &me, &bad).expect_err("window").to_string().contains("nslots"));
        let bad = AggConfig { chunk_bytes: Some(1000), ..AggConfig::default() };
        assert!(resolve_config(&grp, &me, &bad).is_err());
        let bad = AggConfig { chunk_bytes: Some(1001), ..AggConfig::default() };
        assert!(resolve_config(&grp, &me, &bad).expect_err("odd").to_string().contains("multiple of 8"));
    }

    /// Members on 127.0.0.1 with their own ports: the whole API without
    /// namespaces or root (ranks 0..=2 members, rank 3 the aggregator).
    #[test]
    fn loopback_reduce_and_allreduce() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let socks: Vec<std::net::UdpSocket> =
            (0..4).map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind")).collect();
        let ports: Vec<u16> = socks.iter().map(|s| s.local_addr().expect("addr").port()).collect();
        drop(socks);
        let members = ports
            .iter()
            .enumerate()
            .map(|(r, &port)| Member {
                rank: r as u16,
                addr: Ipv4Addr::LOCALHOST,
                port,
                iface: "lo".into(),
                netns: None,
            })
            .collect();
        let mut grp = Group::new("loop", 9, members);
        grp.aggregator = Some(3);
        let cfg = AggConfig { deadline: Duration::from_secs(10), ..AggConfig::default() };
        let stop = Arc::new(AtomicBool::new(false));
        let mut agg = Aggregator::new(&grp, 3, PathChoice::User, cfg.clone()).expect("aggregator");
        let agg_thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                agg.serve(&stop).expect("serve");
                agg.stats()
            })
        };
        const LEN: usize = 3000;
        let len = LEN;
        let data = |r: u16| -> Vec<f32> { (0..LEN).map(|i| (i as f32 - 1500.0) * 0.01 + f32::from(r)).collect() };
        let ints = |r: u16| -> Vec<i64> { (0..LEN as i64).map(|i| i * (i64::from(r) + 1) - 7).collect() };
        let threads: Vec<_> = (0..3u16)
            .map(|r| {
                let (g, c) = (grp.clone(), cfg.clone());
                std::thread::spawn(move || {
                    let mut col = Collective::new(&g, r, PathChoice::User, c).expect("collective");
                    let sum = col.allreduce(&data(r), AggOp::Sum).expect("allreduce");
                    let max = col.allreduce(&ints(r), AggOp::Max).expect("allreduce max");
                    let red = col.reduce(&ints(r), AggOp::Sum, 1).expect("reduce");
                    let avg = col.reduce(&data(r), AggOp::Avg, 0).expect("reduce avg");
                    (r, sum, max, red, avg)
                })
            })
            .collect();
        for t in threads {
            let (r, sum, max, red, avg) = t.join().expect("member");
            for i in 0..len {
                let want: f64 = (0..3u16).map(|k| f64::from(data(k)[i])).sum();
                // e <= 5 here (|x| < 18), n = 3, h = 2: bound 3 * 2^(5+2-31).
                assert!((f64::from(sum[i]) - want).abs() <= 3.0 * 2f64.powi(-24) + 1e-5, "rank {r} [{i}]");
                assert_eq!(max[i], ints(2)[i].max(ints(0)[i]), "rank {r} [{i}]");
            }
            match (r, red, avg) {
                (1, Some(v), None) => {
                    assert_eq!(v, (0..len as i64).map(|i| i * 6 - 21).collect::<Vec<_>>());
                }
                (0, None, Some(v)) => {
                    for (i, x) in v.iter().enumerate() {
                        let want: f64 = (0..3u16).map(|k| f64::from(data(k)[i])).sum::<f64>() / 3.0;
                        assert!((f64::from(*x) - want).abs() <= 1e-5, "avg [{i}] = {x}, want {want}");
                    }
                }
                (2, None, None) => {}
                other => panic!("rank {r}: unexpected roles {other:?}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let st = agg_thread.join().expect("aggregator");
        assert_eq!(st.rejected(), 0, "{st:?}");
        assert!(st.results > 0);
    }

    #[cfg(not(feature = "kernel-agg"))]
    #[test]
    fn kernel_path_needs_the_feature() {
        let grp = g(&[0, 1]);
        let me = grp.members[0].clone();
        let err = make_backend(&grp, &me, &AggConfig::default(), 1432, PathChoice::Kernel)
            .err()
            .expect("no kernel backend in this build");
        assert!(matches!(err, Error::KernelPathUnavailable { .. }));
        assert!(err.to_string().contains("kernel-agg"), "{err}");
        let (b, why) = make_backend(&grp, &me, &AggConfig::default(), 1432, PathChoice::Auto).expect("falls back");
        assert_eq!(b.path(), Path::User);
        assert!(why.contains("kernel-agg"), "{why}");
    }
}
