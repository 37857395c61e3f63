//! The kernel aggregation engine seen from user space: `xdp_agg` (XDP, the
//! aggregation itself) and `tc_agg_result` (TCX ingress, the fan-out of the
//! answers) on the aggregator's interface, loaded and configured together.
//!
//! Both objects use ONE members map and ONE counter map: the second object
//! reuses the first one's maps before it is loaded.  Layouts come from the
//! skeletons' generated types (bpf/include/kccl_agg.h), checked by the tests
//! below; see docs/AGGREGATION.md for the protocol.
//!
//! Files: loading, attaching, members, counters and the record reader here;
//! configuration and limits in config.rs; record parsing in record.rs; the
//! counters in stats.rs; slot and acknowledgment snapshots in slots.rs.

mod config;
mod record;
mod ring;
mod slots;
mod stats;

#[cfg(test)]
use record::{parse_record_header, view};
use ring::RecordRing;

pub use config::{
    subs_per_slot, AggEngineConfig, XdpMode, MAX_CHUNK_BYTES, MAX_ELEMS, MAX_SLOTS, RECORD_HDR_LEN, SUB_BYTES,
    SUB_ELEMS,
};
pub use record::{dtype_size, AggRecord, AggRecordView};
pub use slots::{SlotInfo, SlotState, SlotSummary};
pub use stats::AggStats;

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use libbpf_rs::Link;

use crate::error::{Error, Result};
use crate::group::Group;
use crate::kernel::{
    attach_tcx, attach_xdp, ifname, load_skeleton, member_entry, neighbours, no_rodata, open_skeleton, parse_agg_miss,
    read_next_hop, sum_percpu, verified_insns, write_member_entry, AggMiss, MissReader, CLONE_MARK,
};
use crate::skel_agg::{XdpAggSkel, XdpAggSkelBuilder};
use crate::skel_agg_result::{TcAggResultSkel, TcAggResultSkelBuilder};

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
    records: RecordRing,
    misses: MissReader<AggMiss>,
    xdp: XdpAggSkel<'static>,
    result: TcAggResultSkel<'static>,
}

impl AggEngine {
    /// Loads both programs (not attached): for BPF_PROG_TEST_RUN fixtures and
    /// for [`AggEngine::load`].
    pub fn open(cfg: &AggEngineConfig) -> Result<AggEngine> {
        cfg.validate()?;
        const WHAT: &str = "the aggregation engine (xdp_agg)";
        let mut open = open_skeleton::<XdpAggSkelBuilder>(WHAT)?;
        let ro = open.maps.rodata_data.as_deref_mut().ok_or_else(|| no_rodata("xdp_agg"))?;
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
        open.maps.agg_acc.set_max_entries(cfg.nslots * subs_per_slot(cfg.chunk_bytes)).map_err(sizing)?;
        open.maps.agg_records.set_max_entries(cfg.ring_bytes).map_err(sizing)?;
        let xdp = load_skeleton(open, WHAT)?;

        const WHAT_R: &str = "the aggregation fan-out (tc_agg_result)";
        let mut open = open_skeleton::<TcAggResultSkelBuilder>(WHAT_R)?;
        let ro = open.maps.rodata_data.as_deref_mut().ok_or_else(|| no_rodata("tc_agg_result"))?;
        ro.cfg_job_id = cfg.job_id;
        ro.cfg_port = cfg.port;
        ro.cfg_my_rank = cfg.my_rank;
        ro.cfg_clone_mark = CLONE_MARK;
        let share = |e| Error::Bpf { step: "sharing members/agg_stats with tc_agg_result".into(), source: e };
        open.maps.members.reuse_fd(xdp.maps.members.as_fd()).map_err(share)?;
        open.maps.agg_stats.reuse_fd(xdp.maps.agg_stats.as_fd()).map_err(share)?;
        let result = load_skeleton(open, WHAT_R)?;

        let records = RecordRing::new(&xdp.maps.agg_records)?;

        let misses = MissReader::new(&result.maps.agg_miss_events, "agg_miss_events", parse_agg_miss)?;

        Ok(AggEngine {
            xdp_link: None,
            tcx_link: None,
            xdp_mode: None,
            ifindex: 0,
            iface: None,
            unresolved: Vec::new(),
            cfg: cfg.clone(),
            records,
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
        let (link, mode) = attach_xdp(self.xdp.progs.kccl_xdp_agg.as_fd().as_raw_fd(), ifindex, "xdp_agg")?;
        let prog = &self.result.progs.kccl_tc_agg_result;
        self.tcx_link = Some(attach_tcx(prog, ifindex, None, "tc_agg_result at TCX ingress")?);
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
                // This member's own contributions to its shard of a sharded
                // allreduce come from its own address (BPF_PROG_TEST_RUN);
                // no answer is ever sent to it (tc_agg_result skips the
                // own rank), so it needs no next hop.
                self.set_member(m.rank, m.addr, m.port, None)?;
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

    /// Where `rank`'s answers go now: the MAC of members[rank] (from the
    /// neighbour table at sync, or learned by xdp_agg from the rank's
    /// packets), None while unresolved or not a member.
    pub fn next_hop(&self, rank: u16) -> Result<Option<[u8; 6]>> {
        read_next_hop(&self.xdp.maps.members, rank)
    }

    /// Gives `rank` (at `ip`:`port`) the next hop the kernel's neighbour
    /// table has for it now, if members[rank] has none yet (xdp_agg may
    /// have learned one meanwhile: that one is newer).  Returns whether the
    /// rank has a next hop afterwards.
    pub fn refresh_member(&mut self, rank: u16, ip: Ipv4Addr, port: u16) -> Result<bool> {
        if self.next_hop(rank)?.is_some() {
            return Ok(true);
        }
        let Some(mac) = self.iface.as_deref().and_then(|i| neighbours(i).get(&ip).copied()) else {
            return Ok(false);
        };
        self.set_member(rank, ip, port, Some(mac))?;
        self.unresolved.retain(|&r| r != rank);
        Ok(true)
    }

    /// Ranks the last [`AggEngine::sync_members`] found no neighbour entry for.
    pub fn unresolved_members(&self) -> &[u16] {
        &self.unresolved
    }

    pub fn stats(&self) -> Result<AggStats> {
        Ok(AggStats::from_array(sum_percpu(&self.xdp.maps.agg_stats, "agg_stats")?))
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
        let n = self.records.consume(max, f)?;
        if n > 0 || timeout.is_zero() {
            return Ok(n);
        }
        self.records.wait(timeout)?;
        // Also records written without a wake-up during the wait.
        self.records.consume(max, f)
    }

    /// Makes the wait of [`AggEngine::poll_records_max`] also end when `fd`
    /// (the member's socket) is readable.
    pub fn watch_fd(&self, fd: std::os::fd::RawFd) -> Result<()> {
        self.records.watch(fd)
    }

    /// Whether [`AggEngine::run_xdp_agg`] may share the maps with the
    /// attached program: BPF_PROG_TEST_RUN runs an XDP program with bottom
    /// halves disabled only since Linux 6.11 (bpf_test_run's
    /// local_bh_disable, added with bpf_net_context).  Before, the NAPI
    /// poll of the same CPU could interrupt the run and reuse xdp_agg's
    /// per-CPU scratch map under it: wrong sums, silently.
    pub fn own_runs_supported() -> std::result::Result<(), String> {
        match kernel_release() {
            Some(v) if v >= (6, 11) => Ok(()),
            Some((a, b)) => Err(format!(
                "kernel {a}.{b} runs BPF_PROG_TEST_RUN with softirqs enabled (6.11 and later disable them), so \
                 a member's own contribution cannot share xdp_agg's per-CPU state safely"
            )),
            None => Err("the kernel release could not be read (uname)".into()),
        }
    }

    /// Runs the attached xdp_agg on `frame` (BPF_PROG_TEST_RUN, same maps):
    /// how a sharded allreduce's owner adds its own contribution to its
    /// shard, which never crosses its interface.  Returns the verdict and
    /// the length of the frame the program left in `out` (the answer, when
    /// it passed one up; `out` must hold the input's length).  A
    /// multi-buffer frame is built by the kernel from `frame` and never
    /// shrunk by the program.
    pub fn run_xdp_agg(&self, frame: &[u8], out: &mut [u8]) -> Result<(u32, usize)> {
        let o = self
            .xdp
            .progs
            .kccl_xdp_agg
            .test_run(libbpf_rs::ProgramInput { data_in: Some(frame), data_out: Some(out), ..Default::default() })
            .map_err(|e| Error::Bpf { step: "running xdp_agg on this member's own contribution".into(), source: e })?;
        Ok((o.return_value, o.data.map_or(0, |d| d.len())))
    }

    /// Destinations tc_agg_result could not serve since the last call, each
    /// with the answer to send it.
    pub fn drain_misses(&self) -> Vec<AggMiss> {
        self.misses.drain()
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

    /// Frees every ACTIVE slot of one call of the job (op ids `call_op`
    /// .. `call_op` + 3: a member aborted it) and, as [`AggEngine::sweep`],
    /// the abandoned ones; returns how many of the call's it freed.
    pub fn free_call(&self, call_op: u32) -> Result<u64> {
        let before = self.stats()?.abort_freed;
        let mut input = [0u8; 64];
        input[..8].copy_from_slice(&sweep_request(call_op));
        self.xdp
            .progs
            .kccl_agg_sweep
            .test_run(libbpf_rs::ProgramInput { data_in: Some(&input), ..Default::default() })
            .map_err(|e| Error::Bpf { step: format!("running kccl_agg_sweep for call op {call_op}"), source: e })?;
        Ok(self.stats()?.abort_freed.saturating_sub(before))
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

/// struct kccl_agg_sweep_req (bpf/include/kccl_agg.h: flags, call_op, two
/// u32 in host order; its size is asserted there, its bytes by the golden
/// test below, its meaning by the free_call fixture): free the call's slots.
fn sweep_request(call_op: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&crate::wire::SWEEP_CALL.to_ne_bytes());
    b[4..].copy_from_slice(&(call_op & !3).to_ne_bytes());
    b
}

/// (major, minor) of the running kernel.
fn kernel_release() -> Option<(u32, u32)> {
    // SAFETY: utsname is plain bytes; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: u is a valid, writable utsname.
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    let rel: Vec<u8> = u.release.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    parse_release(&String::from_utf8_lossy(&rel))
}

fn parse_release(r: &str) -> Option<(u32, u32)> {
    let mut it = r.split(|c: char| !c.is_ascii_digit());
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::record::{DT_I32, DT_I64};
    use super::*;
    use crate::group::MAX_MEMBERS;
    use crate::skel_agg::types::{kccl_agg_record, kccl_agg_slot, kccl_agg_sub};

    #[test]
    fn kernel_releases_parse() {
        assert_eq!(parse_release("6.18.15+deb13-amd64"), Some((6, 18)));
        assert_eq!(parse_release("6.1.0-28-amd64"), Some((6, 1)));
        assert_eq!(parse_release("7.0"), Some((7, 0)));
        assert_eq!(parse_release("garbage"), None);
    }

    #[test]
    fn sweep_request_golden_bytes() {
        let want: [u8; 8] =
            if cfg!(target_endian = "little") { [1, 0, 0, 0, 8, 0, 1, 0] } else { [0, 0, 0, 1, 0, 1, 0, 8] };
        assert_eq!(sweep_request(0x0001_0009), want, "flags KCCL_SWEEP_CALL, then the call's first op id");
    }
    use std::mem::offset_of;

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
        assert_eq!(size_of::<R>(), RECORD_HDR_LEN);
        assert_eq!((SUB_ELEMS, MAX_ELEMS, MAX_CHUNK_BYTES), (858, 16302, 65208));
        type S = kccl_agg_slot;
        assert_eq!(offset_of!(S, lock), 0);
        assert_eq!(offset_of!(S, state), 4);
        assert_eq!(offset_of!(S, expected), 8);
        assert_eq!(offset_of!(S, seen), 16);
        assert_eq!(offset_of!(S, busy), 24);
        assert_eq!(offset_of!(S, claimed_ns), 32);
        assert_eq!(offset_of!(S, gen), 40);
        assert_eq!(offset_of!(S, rec), 48);
        assert_eq!(size_of::<S>(), 48 + size_of::<R>());
        type U = kccl_agg_sub;
        assert_eq!(offset_of!(U, lock), 0);
        assert_eq!(offset_of!(U, count), 4);
        assert_eq!(offset_of!(U, gen), 8);
        assert_eq!(offset_of!(U, acc), 16);
        assert_eq!(size_of::<U>(), 16 + SUB_ELEMS * 8);
        // AggStats has one field per enum kccl_agg_stat entry, in order.
        let h = include_str!("../../../../../bpf/include/kccl_agg.h");
        let body = &h[h.find("enum kccl_agg_stat {").expect("enum kccl_agg_stat")..];
        let names: Vec<String> = body[..body.find("KCCL_AS_NR").expect("KCCL_AS_NR")]
            .lines()
            .filter_map(|l| l.trim().strip_prefix("KCCL_AS_"))
            .map(|l| l.split([',', ' ', '\t']).next().unwrap_or("").to_lowercase())
            .collect();
        assert_eq!(names, AggStats::NAMES);
        assert_eq!(size_of::<crate::skel_agg::types::kccl_agg_acks>(), 8 * MAX_MEMBERS);
        // struct kccl_agg_miss: the miss event, the answer's length, the
        // answer (room for the largest: header + the largest chunk).
        type M = crate::skel_agg_result::types::kccl_agg_miss;
        assert_eq!((offset_of!(M, ev), offset_of!(M, dgram_len), offset_of!(M, dgram)), (0, 16, 24));
        assert_eq!(size_of::<M>(), 24 + crate::wire::HDR_LEN + MAX_CHUNK_BYTES as usize);
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
        for bad in [0, 4, 1430, 65216] {
            assert_eq!(field(AggEngineConfig { chunk_bytes: bad, ..c.clone() }), "chunk_bytes", "{bad}");
        }
        let big = AggEngineConfig { chunk_bytes: 65208, nslots: 64, window: 32, ..c.clone() };
        big.validate().expect("65208 is the maximum");
        // 1024 slots x 19 sub-blocks: too much accumulator memory.
        assert_eq!(field(AggEngineConfig { nslots: 4096, ..big.clone() }), "nslots");
        assert_eq!(field(AggEngineConfig { ring_bytes: 1 << 18, ..big }), "ring_bytes");
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
        let (h, nvalues) = parse_record_header(&b).expect("valid");
        assert_eq!((h.job_id, h.op_id, nvalues, h.overflow, h.contributors), (7, 9, 3, true, 0b110));
        // The values in place: the test's buffer, like the ring, holds
        // them 8-byte aligned after the 32-byte header.
        let mut words = vec![0u64; b.len().div_ceil(8)];
        // SAFETY: u64 has no invalid bit patterns; the slice covers `words`.
        let aligned = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) };
        aligned[..b.len()].copy_from_slice(&b);
        let v = view(&aligned[..b.len()]).expect("values");
        assert_eq!((v.values(), v.job_id, v.contributors), (&[1i64, -2, 3][..], 7, 0b110));
        // Truncated values, misaligned values, short header, unknown
        // dtype, ragged payload.
        assert!(view(&aligned[..b.len() - 1]).is_err());
        let mut shifted = vec![0u64; words.len() + 1];
        // SAFETY: as above.
        let s = unsafe { std::slice::from_raw_parts_mut(shifted.as_mut_ptr().cast::<u8>(), shifted.len() * 8) };
        s[4..4 + b.len()].copy_from_slice(&b);
        assert!(view(&s[4..4 + b.len()]).is_err());
        assert!(parse_record_header(&b[..RECORD_HDR_LEN - 1]).is_err());
        assert!(parse_record_header(&record_bytes(12, 9, &[])).is_err());
        assert!(parse_record_header(&record_bytes(12, DT_I64, &[])).is_err());
        assert_eq!(parse_record_header(&record_bytes(16, DT_I64, &[])).map(|(_, n)| n).ok(), Some(2));
    }
}
