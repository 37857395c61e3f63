//! Fault injection for kccl packets (bpf/tc_fault.bpf.c): loss, duplication
//! and reordering at TCX egress of one interface, with probabilities in parts
//! per million and a reproducible pseudo-random decision sequence.
//!
//! [`FaultInjector`] is the typed handle over the skeleton (load, attach,
//! configure, read counters, detach).  [`install`], [`clear`] and
//! [`pinned_stats`] make the fault outlive the process (`kccl fault`): the TCX
//! link and the configuration and counter maps are pinned under
//! `/sys/fs/bpf/kccl/fault-<netns>-<iface>/`.  The loader enters the host's
//! network namespace (setns, on its own thread) only because TCX attach takes
//! an ifindex of the caller's namespace; pinning is a bpffs operation of the
//! mount namespace, which setns of a network namespace does not change.
//! Removing the link pin releases the link, which detaches the program.

use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use libbpf_rs::{Link, MapCore, MapFlags, MapHandle};

use crate::error::{Error, Result};
use crate::kernel::{load_skeleton, no_rodata, open_skeleton};
use crate::netns;
use crate::skel_fault::{types, TcFaultSkel, TcFaultSkelBuilder};

/// skb->mark of copies that must pass the injector untouched ("kcfp").
pub const PASS_MARK: u32 = 0x6b63_6670;
/// skb->mark of a clone the injector rewrites into the held packet ("kcfr").
pub const RELEASE_MARK: u32 = 0x6b63_6672;
/// Where injectors are pinned.
pub const PIN_ROOT: &str = "/sys/fs/bpf/kccl";
/// Parts per million: probability 1.
pub const PPM: u32 = 1_000_000;

/// Probabilities (parts per million; mutually exclusive outcomes of one draw,
/// so their sum is at most [`PPM`]) and the seed of the decision sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FaultConfig {
    pub loss_ppm: u32,
    pub dup_ppm: u32,
    pub reorder_ppm: u32,
    pub seed: u64,
}

impl FaultConfig {
    /// From fractions in [0, 1] (as the CLI takes them).
    pub fn from_fractions(loss: f64, dup: f64, reorder: f64, seed: u64) -> Result<FaultConfig> {
        let ppm = |what: &str, p: f64| -> Result<u32> {
            if !(0.0..=1.0).contains(&p) {
                return Err(Error::Usage(format!("--{what} {p}: a probability must be in [0, 1]")));
            }
            Ok((p * f64::from(PPM)).round() as u32)
        };
        let c = FaultConfig {
            loss_ppm: ppm("loss", loss)?,
            dup_ppm: ppm("dup", dup)?,
            reorder_ppm: ppm("reorder", reorder)?,
            seed,
        };
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<()> {
        let sum = u64::from(self.loss_ppm) + u64::from(self.dup_ppm) + u64::from(self.reorder_ppm);
        if sum > u64::from(PPM) {
            return Err(Error::Usage(format!(
                "loss + dup + reorder = {sum} ppm exceeds 1: they are exclusive outcomes of one draw"
            )));
        }
        Ok(())
    }
}

/// What the injector decided for one kccl packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Drop,
    Duplicate,
    /// Hold for reordering (becomes Pass when the CPU already holds one).
    Hold,
    Pass,
}

/// Reference model of the program's per-CPU generator (splitmix64 seeded with
/// `seed ^ cpu * golden`), exact for a sequence handled by one CPU.
#[derive(Debug, Clone)]
pub struct FaultRng {
    state: u64,
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl FaultRng {
    pub fn new(seed: u64, cpu: u32) -> FaultRng {
        FaultRng { state: seed ^ u64::from(cpu).wrapping_mul(GOLDEN) }
    }

    /// The next draw, uniform in [0, 1e6).
    pub fn next_ppm(&mut self) -> u32 {
        self.state = self.state.wrapping_add(GOLDEN);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (((z >> 32) * u64::from(PPM)) >> 32) as u32
    }

    /// The decision the program makes for the next packet under `cfg`.
    pub fn decide(&mut self, cfg: &FaultConfig) -> Decision {
        let u = self.next_ppm();
        if u < cfg.loss_ppm {
            Decision::Drop
        } else if u - cfg.loss_ppm < cfg.dup_ppm {
            Decision::Duplicate
        } else if u - cfg.loss_ppm - cfg.dup_ppm < cfg.reorder_ppm {
            Decision::Hold
        } else {
            Decision::Pass
        }
    }
}

/// Counters of tc_fault (enum kccl_fault_stat), summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FaultStats {
    pub seen: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub held: u64,
    pub released: u64,
    pub passed: u64,
}

impl FaultStats {
    pub fn delta(&self, before: &FaultStats) -> FaultStats {
        FaultStats {
            seen: self.seen - before.seen,
            dropped: self.dropped - before.dropped,
            duplicated: self.duplicated - before.duplicated,
            held: self.held - before.held,
            released: self.released - before.released,
            passed: self.passed - before.passed,
        }
    }
}

fn bpf_err(step: &str) -> impl FnOnce(libbpf_rs::Error) -> Error + '_ {
    move |e| Error::Bpf { step: step.to_owned(), source: e }
}

fn cfg_bytes(c: &types::kccl_fault_cfg) -> &[u8] {
    // SAFETY: kccl_fault_cfg is plain old data; we view it as bytes.
    unsafe { std::slice::from_raw_parts((c as *const types::kccl_fault_cfg).cast::<u8>(), std::mem::size_of_val(c)) }
}

/// Writes `cfg` into a fault_cfg map with the next epoch (re-seeds every CPU).
fn write_cfg<M: MapCore>(map: &M, cfg: &FaultConfig) -> Result<()> {
    cfg.validate()?;
    let key = 0u32.to_ne_bytes();
    let old = map.lookup(&key, MapFlags::ANY).map_err(bpf_err("reading fault_cfg"))?.unwrap_or_default();
    let epoch = old
        .get(std::mem::offset_of!(types::kccl_fault_cfg, epoch)..)
        .and_then(|b| b.get(..8))
        .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
        .unwrap_or(0);
    let v = types::kccl_fault_cfg {
        loss_ppm: cfg.loss_ppm,
        dup_ppm: cfg.dup_ppm,
        reorder_ppm: cfg.reorder_ppm,
        seed: cfg.seed,
        epoch: epoch.wrapping_add(1),
        ..Default::default()
    };
    map.update(&key, cfg_bytes(&v), MapFlags::ANY).map_err(bpf_err("writing fault_cfg"))
}

fn read_stats<M: MapCore>(map: &M) -> Result<FaultStats> {
    let mut sum = [0u64; 6];
    for (i, slot) in sum.iter_mut().enumerate() {
        let per_cpu = map
            .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
            .map_err(bpf_err("reading fault_stats"))?
            .unwrap_or_default();
        *slot =
            per_cpu.iter().filter_map(|b| b.get(..8)).map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8]))).sum();
    }
    Ok(FaultStats { seen: sum[0], dropped: sum[1], duplicated: sum[2], held: sum[3], released: sum[4], passed: sum[5] })
}

/// The fault injector program (loaded; attached to at most one interface).
pub struct FaultInjector {
    skel: TcFaultSkel<'static>,
    link: Option<Link>,
}

impl FaultInjector {
    /// Loads tc_fault with all probabilities 0 (everything passes).
    pub fn load() -> Result<FaultInjector> {
        const WHAT: &str = "the fault injector (tc_fault)";
        let mut open = open_skeleton::<TcFaultSkelBuilder>(WHAT)?;
        let ro = open.maps.rodata_data.as_deref_mut().ok_or_else(|| no_rodata("tc_fault"))?;
        ro.cfg_pass_mark = PASS_MARK;
        ro.cfg_release_mark = RELEASE_MARK;
        let skel = load_skeleton(open, WHAT)?;
        Ok(FaultInjector { skel, link: None })
    }

    /// Attaches at TCX egress of `ifindex` in the calling thread's namespace.
    pub fn attach(&mut self, ifindex: u32) -> Result<()> {
        if self.link.is_some() {
            return Err(Error::Fault { target: format!("ifindex {ifindex}"), msg: "already attached".into() });
        }
        let prog = &self.skel.progs.kccl_tc_fault;
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
                "attaching tc_fault at TCX egress of ifindex {ifindex} failed: {} (kernel >= 6.6 needed for TCX)",
                std::io::Error::last_os_error()
            ),
        })?;
        // SAFETY: ptr is a live bpf_link returned by libbpf; Link owns it now.
        self.link = Some(unsafe { Link::from_ptr(ptr) });
        Ok(())
    }

    /// Sets probabilities and seed (a new epoch: every CPU re-seeds).
    pub fn set_config(&self, cfg: &FaultConfig) -> Result<()> {
        write_cfg(&self.skel.maps.fault_cfg, cfg)
    }

    pub fn stats(&self) -> Result<FaultStats> {
        read_stats(&self.skel.maps.fault_stats)
    }

    /// Detaches (drops the link; a pinned link stays until unpinned).
    pub fn detach(&mut self) {
        self.link = None;
    }

    pub fn is_attached(&self) -> bool {
        self.link.is_some()
    }

    /// Pins the link and the fault_cfg and fault_stats maps into `dir`.
    pub fn pin(&mut self, dir: &Path) -> Result<()> {
        let link = self
            .link
            .as_mut()
            .ok_or_else(|| Error::Fault { target: dir.display().to_string(), msg: "not attached".into() })?;
        ensure_bpffs()?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        link.pin(dir.join("link")).map_err(bpf_err("pinning the fault link"))?;
        self.skel.maps.fault_cfg.pin(dir.join("cfg")).map_err(bpf_err("pinning fault_cfg"))?;
        self.skel.maps.fault_stats.pin(dir.join("stats")).map_err(bpf_err("pinning fault_stats"))?;
        Ok(())
    }

    /// The loaded skeleton (BPF_PROG_TEST_RUN fixtures use its program).
    pub fn skel(&self) -> &TcFaultSkel<'static> {
        &self.skel
    }
}

/// Mounts the BPF filesystem at /sys/fs/bpf when nothing is mounted there
/// (a machine without systemd leaves it bare), so injectors can be pinned.
fn ensure_bpffs() -> Result<()> {
    const BPF_FS_MAGIC: libc::c_long = 0xcafe4a11;
    const MOUNT_POINT: &str = "/sys/fs/bpf";
    let mp = std::ffi::CString::new(MOUNT_POINT).map_err(|_| Error::Usage("bpffs path".into()))?;
    // SAFETY: statfs into a zeroed struct through a NUL-terminated path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(mp.as_ptr(), &mut st) } == 0 && st.f_type as libc::c_long == BPF_FS_MAGIC {
        return Ok(());
    }
    let fs = std::ffi::CString::new("bpf").map_err(|_| Error::Usage("bpffs type".into()))?;
    // SAFETY: mount(2) with NUL-terminated strings and no data.
    if unsafe { libc::mount(fs.as_ptr(), mp.as_ptr(), fs.as_ptr(), 0, std::ptr::null()) } != 0 {
        return Err(Error::last_os(format!(
            "mounting the BPF filesystem at {MOUNT_POINT} (needs root; or run `mount -t bpf bpf {MOUNT_POINT}`)"
        )));
    }
    Ok(())
}

/// `/sys/fs/bpf/kccl/fault-<netns>-<iface>` (netns `root` for the caller's).
pub fn pin_dir(netns: Option<&str>, iface: &str) -> PathBuf {
    PathBuf::from(PIN_ROOT).join(format!("fault-{}-{iface}", netns.unwrap_or("root")))
}

fn target(netns: Option<&str>, iface: &str) -> String {
    format!("{iface} in {}", netns.map(|n| format!("network namespace {n}")).unwrap_or_else(|| "this host".into()))
}

/// Installs (or reconfigures, without reloading) a pinned injector at TCX
/// egress of `iface` in network namespace `netns`.  Returns the pin directory.
pub fn install(netns: Option<&str>, iface: &str, cfg: &FaultConfig) -> Result<PathBuf> {
    cfg.validate()?;
    let dir = pin_dir(netns, iface);
    if dir.join("link").exists() && !pin_stale(&dir, netns) {
        let map = MapHandle::from_pinned_path(dir.join("cfg")).map_err(bpf_err("opening the pinned fault_cfg"))?;
        write_cfg(&map, cfg)?;
        return Ok(dir);
    }
    if dir.exists() {
        // Leftovers of an interrupted install, or of an interface that is
        // gone (its namespace was deleted): start over.
        std::fs::remove_dir_all(&dir).map_err(|e| Error::io(format!("removing stale {}", dir.display()), e))?;
    }
    let (ns, ifc, c, d) = (netns.map(str::to_owned), iface.to_owned(), *cfg, dir.clone());
    netns::run_in(netns, move || {
        let ifindex = netns::ifindex(&ifc, ns.as_deref())?;
        let mut inj = FaultInjector::load()?;
        inj.set_config(&c)?;
        inj.attach(ifindex)?;
        // The pin records which namespace instance it serves, so a pin of a
        // namespace that was deleted and recreated under the same name is
        // known stale even while the old one is still being torn down.
        let marked = inj.pin(&d).and_then(|()| {
            let m = d.join(format!("{NETNS_MARK}{}", netns::cookie()?));
            std::fs::create_dir(&m).map_err(|e| Error::io(format!("creating {}", m.display()), e))
        });
        if let Err(e) = marked {
            let _ = std::fs::remove_dir_all(&d);
            return Err(e);
        }
        Ok(())
    })?;
    Ok(dir)
}

/// Prefix of the directory in a pin directory that names the cookie of the
/// namespace the injector was attached in (bpffs holds no regular files).
const NETNS_MARK: &str = "netns-cookie-";

/// True if the injector pinned at `dir` no longer acts on `iface` of the
/// namespace now called `netns`: its device is gone, or the namespace was
/// recreated (the old one may still be tearing down, asynchronously, with
/// its device still present).
fn pin_stale(dir: &Path, netns: Option<&str>) -> bool {
    if link_detached(&dir.join("link")) {
        return true;
    }
    let Some(marked) = std::fs::read_dir(dir).ok().and_then(|rd| {
        rd.flatten().find_map(|e| e.file_name().to_str()?.strip_prefix(NETNS_MARK)?.parse::<u64>().ok())
    }) else {
        return false; // a pin without the mark: only the device check applies
    };
    match netns::run_in(netns, netns::cookie) {
        Ok(now) => now != marked,
        Err(_) => netns.is_some_and(|n| !netns::path(n).exists()),
    }
}

/// True if the pinned TCX link no longer has a device: its interface (or
/// the whole namespace, e.g. a virtual cluster torn down) is gone, so
/// reconfiguring it would inject nothing.  Unreadable pins count as live.
fn link_detached(link_pin: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(link_pin.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libbpf_rs::libbpf_sys::bpf_obj_get(c.as_ptr()) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut info = libbpf_rs::libbpf_sys::bpf_link_info::default();
    let mut len = std::mem::size_of_val(&info) as u32;
    // SAFETY: valid fd, info buffer and its length.
    let r = unsafe { libbpf_rs::libbpf_sys::bpf_link_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    // SAFETY: for a TCX link the kernel fills the tcx member of the union.
    r == 0
        && info.type_ == libbpf_rs::libbpf_sys::BPF_LINK_TYPE_TCX
        && unsafe { info.__bindgen_anon_1.tcx.ifindex } == 0
}

/// Removes a pinned injector (the link is released, so the program detaches;
/// a packet it held is lost).  Ok(false) if none was installed.
pub fn clear(netns: Option<&str>, iface: &str) -> Result<bool> {
    let dir = pin_dir(netns, iface);
    if !dir.exists() {
        return Ok(false);
    }
    std::fs::remove_dir_all(&dir).map_err(|e| Error::io(format!("removing {}", dir.display()), e))?;
    Ok(true)
}

/// Removes every injector pinned for interfaces of namespace `netns` (a
/// cluster being torn down); returns how many.
pub fn clear_namespace(netns: &str) -> Result<usize> {
    let prefix = format!("fault-{netns}-");
    let Ok(rd) = std::fs::read_dir(PIN_ROOT) else { return Ok(0) };
    let mut n = 0;
    for e in rd.flatten() {
        if e.file_name().to_str().is_some_and(|f| f.starts_with(&prefix)) {
            std::fs::remove_dir_all(e.path())
                .map_err(|err| Error::io(format!("removing {}", e.path().display()), err))?;
            n += 1;
        }
    }
    Ok(n)
}

/// Counters of a pinned injector.
pub fn pinned_stats(netns: Option<&str>, iface: &str) -> Result<FaultStats> {
    let dir = pin_dir(netns, iface);
    if !dir.join("stats").exists() {
        return Err(Error::Fault {
            target: target(netns, iface),
            msg: format!("no fault injector installed (nothing pinned at {})", dir.display()),
        });
    }
    if pin_stale(&dir, netns) {
        return Err(Error::Fault {
            target: target(netns, iface),
            msg: format!("the injector pinned at {} lost its interface (stale pin); clear it", dir.display()),
        });
    }
    let map = MapHandle::from_pinned_path(dir.join("stats")).map_err(bpf_err("opening the pinned fault_stats"))?;
    read_stats(&map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_and_limits() {
        let c = FaultConfig::from_fractions(0.1, 0.05, 0.25, 7).unwrap();
        assert_eq!((c.loss_ppm, c.dup_ppm, c.reorder_ppm, c.seed), (100_000, 50_000, 250_000, 7));
        assert!(FaultConfig::from_fractions(1.5, 0.0, 0.0, 0).is_err());
        assert!(FaultConfig::from_fractions(-0.1, 0.0, 0.0, 0).is_err());
        assert!(FaultConfig::from_fractions(0.6, 0.5, 0.0, 0).is_err());
        assert!(FaultConfig::from_fractions(1.0, 0.0, 0.0, 0).is_ok());
    }

    #[test]
    fn rng_is_reproducible_and_uniform() {
        let a: Vec<u32> = {
            let mut r = FaultRng::new(42, 0);
            (0..1000).map(|_| r.next_ppm()).collect()
        };
        let mut r = FaultRng::new(42, 0);
        assert!(a.iter().all(|&x| x == r.next_ppm() && x < PPM));
        let mut other = FaultRng::new(43, 0);
        assert!(a.iter().any(|&x| x != other.next_ppm()));
        let cfg = FaultConfig { loss_ppm: 100_000, ..Default::default() };
        let mut r = FaultRng::new(1, 0);
        let drops = (0..100_000).filter(|_| r.decide(&cfg) == Decision::Drop).count();
        assert!((9_000..11_000).contains(&drops), "{drops}");
    }

    #[test]
    fn pin_dir_names_namespace_and_interface() {
        assert_eq!(pin_dir(Some("kccl-kccl-h3"), "eth0"), PathBuf::from("/sys/fs/bpf/kccl/fault-kccl-kccl-h3-eth0"));
        assert_eq!(pin_dir(None, "lo"), PathBuf::from("/sys/fs/bpf/kccl/fault-root-lo"));
    }
}
