//! The broadcast fan-out (tc_bcast at TCX egress of the sender's
//! interface): loading with its read-only configuration, attaching, the
//! members it copies to, its counters and miss events.

use crate::error::Result;
use crate::group::Member;
use crate::skel::{types, TcBcastSkel, TcBcastSkelBuilder};
use libbpf_rs::Link;

use super::{
    attach_tcx, load_skeleton, member_entry, no_rodata, open_skeleton, parse_miss_event, sum_percpu,
    write_member_entry, MissEvent, MissReader,
};

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
    misses: MissReader,
}

impl BcastFanout {
    /// Loads tc_bcast for `job_id`; `ifindex` is the sending interface in the
    /// calling thread's namespace.  Not attached yet.
    pub fn load(job_id: u32, ifindex: u32) -> Result<BcastFanout> {
        const WHAT: &str = "the broadcast program (tc_bcast)";
        let mut open = open_skeleton::<TcBcastSkelBuilder>(WHAT)?;
        let ro = open.maps.rodata_data.as_deref_mut().ok_or_else(|| no_rodata("tc_bcast"))?;
        ro.cfg_job_id = job_id;
        ro.cfg_clone_mark = CLONE_MARK;
        let skel = load_skeleton(open, WHAT)?;
        let misses = MissReader::new(&skel.maps.miss_events, "miss_events", parse_miss_event)?;
        Ok(BcastFanout { skel, link: None, ifindex, misses })
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
        self.link = Some(attach_tcx(prog, self.ifindex, Some(&opts), "tc_bcast at TCX egress")?);
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
        let sum: [u64; 6] = sum_percpu(&self.skel.maps.bcast_stats, "bcast_stats")?;
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
        self.misses.drain()
    }

    /// The loaded skeleton (BPF_PROG_TEST_RUN fixtures use its program).
    pub fn skel(&self) -> &TcBcastSkel<'static> {
        &self.skel
    }
}
