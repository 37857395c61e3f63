//! The broadcast fan-out (tc_bcast at TCX egress of the sender's
//! interface): loading with its read-only configuration, attaching, the
//! members it copies to, its counters and miss events.

use crate::error::{Error, Result};
use crate::group::Member;
use crate::skel::{types, TcBcastSkel, TcBcastSkelBuilder};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, RingBuffer, RingBufferBuilder};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::{member_entry, parse_miss_event, skeleton_storage, write_member_entry, MissEvent};

/// skb->mark of the copies tc_bcast makes ("kccl"); see the program header.
pub const CLONE_MARK: u32 = 0x6b63_636c;

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
