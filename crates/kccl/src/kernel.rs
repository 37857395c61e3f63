//! The BPF data plane seen from user space: typed handles over the generated
//! skeletons, configuration in read-only globals before load, links that the
//! kernel removes when the process dies.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::net::Ipv4Addr;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, RingBuffer, RingBufferBuilder};

use crate::error::{is_root, Error, Result};
use crate::group::{Member, MAX_MEMBERS};
use crate::skel::{types, TcBcastSkel, TcBcastSkelBuilder};

/// skb->mark of the copies tc_bcast makes ("kccl"); see the program header.
pub const CLONE_MARK: u32 = 0x6b63_636c;

// enum kccl_member_flag
const M_PRESENT: u32 = 1 << 0;
const M_RESOLVED: u32 = 1 << 1;

/// enum kccl_miss_reason
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    Unresolved,
    NotMember,
    CloneFailed,
    Unknown(u16),
}

impl From<u16> for MissReason {
    fn from(v: u16) -> Self {
        match v {
            1 => MissReason::Unresolved,
            2 => MissReason::NotMember,
            3 => MissReason::CloneFailed,
            x => MissReason::Unknown(x),
        }
    }
}

/// A destination the kernel fan-out did not serve (struct kccl_miss_event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissEvent {
    pub job_id: u32,
    pub msg_seq: u32,
    pub frag_off: u32,
    pub rank: u16,
    pub reason: MissReason,
}

/// Counters of tc_bcast (enum kccl_bcast_stat), summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BcastStats {
    pub fanout_pkts: u64,
    pub copies: u64,
    pub missed: u64,
    pub malformed: u64,
    pub other_job: u64,
    pub passed: u64,
}

impl BcastStats {
    pub fn delta(&self, before: &BcastStats) -> BcastStats {
        BcastStats {
            fanout_pkts: self.fanout_pkts - before.fanout_pkts,
            copies: self.copies - before.copies,
            missed: self.missed - before.missed,
            malformed: self.malformed - before.malformed,
            other_job: self.other_job - before.other_job,
            passed: self.passed - before.passed,
        }
    }
}

/// The members-map entry (struct kccl_member) of a member at `addr`:`port`
/// whose next-hop MAC is `mac` (None: unresolved neighbour, so the programs
/// report the destination instead of sending to a wrong or zero MAC).  The one
/// encoding of a member, used by [`BcastFanout`] and the aggregation engine.
pub(crate) fn member_entry(addr: Ipv4Addr, port: u16, mac: Option<[u8; 6]>) -> types::kccl_member {
    types::kccl_member {
        ip_be: u32::from(addr).to_be(),
        port_be: port.to_be(),
        mac: mac.unwrap_or_default(),
        flags: M_PRESENT | if mac.is_some() { M_RESOLVED } else { 0 },
    }
}

/// Writes `members[rank] = v` into a members map (ARRAY of struct kccl_member).
pub(crate) fn write_member_entry<M: MapCore>(map: &M, rank: u16, v: &types::kccl_member) -> Result<()> {
    if rank as usize >= MAX_MEMBERS {
        return Err(Error::Usage(format!("rank {rank} exceeds the kernel limit of {MAX_MEMBERS} members")));
    }
    // SAFETY: kccl_member is plain old data; we view it as bytes.
    let bytes =
        unsafe { std::slice::from_raw_parts((v as *const types::kccl_member).cast::<u8>(), std::mem::size_of_val(v)) };
    map.update(&u32::from(rank).to_ne_bytes(), bytes, MapFlags::ANY)
        .map_err(|e| Error::Bpf { step: format!("writing members[{rank}]"), source: e })
}

/// A struct kccl_miss_event from a ring buffer record (tc_bcast's or
/// tc_agg_result's); None if the record is too short.
pub(crate) fn parse_miss_event(raw: &[u8]) -> Option<MissEvent> {
    if raw.len() < std::mem::size_of::<types::kccl_miss_event>() {
        return None;
    }
    // SAFETY: the record is a struct kccl_miss_event written by a kccl
    // program (length checked; read_unaligned needs no alignment).
    let ev: types::kccl_miss_event = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
    Some(MissEvent {
        job_id: ev.job_id,
        msg_seq: ev.msg_seq,
        frag_off: ev.frag_off,
        rank: ev.rank,
        reason: ev.reason.into(),
    })
}

/// Checks what loading BPF needs and returns storage for a skeleton's
/// OpenObject, which the skeleton borrows for as long as the program is loaded
/// (a pointer-sized allocation per load, kept for the process lifetime).
pub(crate) fn skeleton_storage(what: &str) -> Result<&'static mut MaybeUninit<libbpf_rs::OpenObject>> {
    if !is_root() {
        return Err(Error::KernelPathUnavailable {
            reason: format!("not root: loading {what} needs CAP_BPF and CAP_NET_ADMIN (run with sudo)"),
        });
    }
    Ok(Box::leak(Box::new(MaybeUninit::uninit())))
}

/// The broadcast fan-out program of one job on one interface.
pub struct BcastFanout {
    skel: TcBcastSkel<'static>,
    link: Option<Link>,
    ifindex: u32,
    ring: RingBuffer<'static>,
    misses: Arc<Mutex<Vec<MissEvent>>>,
}

impl BcastFanout {
    /// Loads tc_bcast for `job_id`; `ifindex` is the sending interface in the
    /// calling thread's namespace.  Not attached yet.
    pub fn load(job_id: u32, ifindex: u32) -> Result<BcastFanout> {
        const WHAT: &str = "the broadcast program (tc_bcast)";
        let mut open = TcBcastSkelBuilder::default().open(skeleton_storage(WHAT)?).map_err(|e| {
            Error::KernelPathUnavailable { reason: format!("opening {WHAT} failed (kernel without BPF/BTF?): {e}") }
        })?;
        let ro = open
            .maps
            .rodata_data
            .as_deref_mut()
            .ok_or_else(|| Error::Usage("tc_bcast has no .rodata section (build problem)".into()))?;
        ro.cfg_job_id = job_id;
        ro.cfg_clone_mark = CLONE_MARK;
        let skel = open
            .load()
            .map_err(|e| Error::KernelPathUnavailable { reason: format!("the kernel refused to load {WHAT}: {e}") })?;
        let misses: Arc<Mutex<Vec<MissEvent>>> = Arc::default();
        let sink = Arc::clone(&misses);
        let mut rb = RingBufferBuilder::new();
        rb.add(&skel.maps.miss_events, move |raw: &[u8]| {
            if let Some(ev) = parse_miss_event(raw) {
                if let Ok(mut v) = sink.lock() {
                    v.push(ev);
                }
            }
            0
        })
        .map_err(|e| Error::Bpf { step: "adding the miss_events ring buffer".into(), source: e })?;
        let ring = rb.build().map_err(|e| Error::Bpf { step: "creating the ring buffer reader".into(), source: e })?;
        Ok(BcastFanout { skel, link: None, ifindex, ring, misses })
    }

    /// Attaches at TCX egress of the interface (a link: gone when we exit).
    pub fn attach(&mut self) -> Result<()> {
        if self.link.is_some() {
            return Ok(());
        }
        let prog = &self.skel.progs.kccl_tc_bcast;
        // At the head of the TCX chain (BPF_F_BEFORE, no anchor): the fan-out
        // runs first and hands every packet and copy on (TCX_NEXT) to programs
        // attached at the same hook, e.g. a fault injector installed earlier.
        let opts = libbpf_rs::libbpf_sys::bpf_tcx_opts {
            sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_tcx_opts>() as _,
            flags: libbpf_rs::libbpf_sys::BPF_F_BEFORE,
            ..Default::default()
        };
        // SAFETY: a loaded program and a valid, sized opts struct.
        let ptr = unsafe {
            libbpf_rs::libbpf_sys::bpf_program__attach_tcx(
                libbpf_rs::AsRawLibbpf::as_libbpf_object(prog).as_ptr(),
                self.ifindex as i32,
                &opts,
            )
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::KernelPathUnavailable {
            reason: format!(
                "attaching tc_bcast at TCX egress of ifindex {} failed: {} (kernel >= 6.6 needed for TCX)",
                self.ifindex,
                std::io::Error::last_os_error()
            ),
        })?;
        // SAFETY: ptr is a live bpf_link returned by libbpf; Link owns it now.
        self.link = Some(unsafe { Link::from_ptr(ptr) });
        Ok(())
    }

    pub fn detach(&mut self) {
        self.link = None;
    }

    pub fn is_attached(&self) -> bool {
        self.link.is_some()
    }

    /// The paper's append_machine_config: where `m` gets its copy.  `mac` is
    /// None when the neighbour is unresolved: the program then reports the
    /// destination instead of sending to a wrong or zero MAC.
    pub fn set_member(&self, m: &Member, mac: Option<[u8; 6]>) -> Result<()> {
        write_member_entry(&self.skel.maps.members, m.rank, &member_entry(m.addr, m.port, mac))
    }

    pub fn clear_member(&self, rank: u16) -> Result<()> {
        write_member_entry(&self.skel.maps.members, rank, &types::kccl_member::default())
    }

    pub fn stats(&self) -> Result<BcastStats> {
        let mut sum = [0u64; 6];
        for (i, slot) in sum.iter_mut().enumerate() {
            let per_cpu = self
                .skel
                .maps
                .bcast_stats
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| Error::Bpf { step: "reading bcast_stats".into(), source: e })?
                .unwrap_or_default();
            *slot = per_cpu
                .iter()
                .filter_map(|b| b.get(..8))
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
                .sum();
        }
        Ok(BcastStats {
            fanout_pkts: sum[0],
            copies: sum[1],
            missed: sum[2],
            malformed: sum[3],
            other_job: sum[4],
            passed: sum[5],
        })
    }

    /// Destinations the program left to user space since the last call.
    pub fn drain_misses(&self) -> Vec<MissEvent> {
        let _ = self.ring.consume();
        self.misses.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }

    /// The loaded skeleton (BPF_PROG_TEST_RUN fixtures use its program).
    pub fn skel(&self) -> &TcBcastSkel<'static> {
        &self.skel
    }
}

/// Complete neighbour entries of `iface` in the calling thread's namespace
/// (/proc/thread-self: /proc/self/net would be the main thread's namespace).
pub fn neighbours(iface: &str) -> HashMap<Ipv4Addr, [u8; 6]> {
    const ATF_COM: u32 = 0x2;
    let text = std::fs::read_to_string("/proc/thread-self/net/arp").unwrap_or_default();
    let mut out = HashMap::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[5] != iface {
            continue;
        }
        let flags = u32::from_str_radix(f[2].trim_start_matches("0x"), 16).unwrap_or(0);
        let (Ok(ip), Some(mac)) = (f[0].parse::<Ipv4Addr>(), parse_mac(f[3])) else { continue };
        if flags & ATF_COM != 0 && mac != [0; 6] {
            out.insert(ip, mac);
        }
    }
    out
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in mac.iter_mut() {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}
