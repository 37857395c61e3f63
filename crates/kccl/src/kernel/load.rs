//! What loading and attaching any kccl BPF object needs: the root check and
//! skeleton storage, the errors that say the kernel path is unavailable,
//! and what the verifier reports.

use std::ptr::NonNull;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags};

use crate::error::{is_root, Error, Result};
use crate::kernel::agg::XdpMode;
use std::mem::size_of;
use std::mem::MaybeUninit;
use std::os::fd::{FromRawFd, OwnedFd};

pub(crate) fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    Error::KernelPathUnavailable { reason: format!("{what}: {e}") }
}

pub(crate) fn verified_insns(fd: i32) -> Result<u32> {
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

/// Attaches the XDP program `prog_fd` to `ifindex` as a link (detached when
/// the fd is closed or the process dies): native mode, or generic (skb)
/// mode when the driver refuses native.  `what` names the program.
pub(crate) fn attach_xdp(prog_fd: i32, ifindex: u32, what: &str) -> Result<(OwnedFd, XdpMode)> {
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
    match attach(libbpf_rs::libbpf_sys::XDP_FLAGS_DRV_MODE) {
        Ok(l) => Ok((l, XdpMode::Native)),
        Err(native) => match attach(libbpf_rs::libbpf_sys::XDP_FLAGS_SKB_MODE) {
            Ok(l) => Ok((l, XdpMode::Generic)),
            Err(generic) => Err(Error::KernelPathUnavailable {
                reason: format!(
                    "attaching {what} to ifindex {ifindex} failed: native mode: {native}; \
                     generic mode: {generic} (another XDP program attached?)"
                ),
            }),
        },
    }
}

/// Attaches `prog` at its TCX hook of `ifindex` (ingress or egress, as the
/// program's section says) as a link: detached when the Link is dropped or
/// the process dies.  `opts` None appends at the end of the hook's chain.
/// `what` names program and hook in the error ("tc_bcast at TCX egress").
pub(crate) fn attach_tcx<P>(
    prog: &P,
    ifindex: u32,
    opts: Option<&libbpf_rs::libbpf_sys::bpf_tcx_opts>,
    what: &str,
) -> Result<Link>
where
    P: libbpf_rs::AsRawLibbpf<LibbpfType = libbpf_rs::libbpf_sys::bpf_program>,
{
    let opts = opts.map_or(std::ptr::null(), |o| o as *const _);
    // SAFETY: a loaded program, and NULL or a valid, sized opts struct.
    let ptr = unsafe {
        libbpf_rs::libbpf_sys::bpf_program__attach_tcx(prog.as_libbpf_object().as_ptr(), ifindex as i32, opts)
    };
    let ptr = NonNull::new(ptr).ok_or_else(|| Error::KernelPathUnavailable {
        reason: format!(
            "attaching {what} of ifindex {ifindex} failed: {} (kernel >= 6.6 needed for TCX)",
            std::io::Error::last_os_error()
        ),
    })?;
    // SAFETY: ptr is a live bpf_link returned by libbpf; Link owns it now.
    Ok(unsafe { Link::from_ptr(ptr) })
}

/// Counters 0..N of a PERCPU_ARRAY of u64 (`name` in errors), each summed
/// over the CPUs.
pub(crate) fn sum_percpu<const N: usize>(map: &dyn MapCore, name: &str) -> Result<[u64; N]> {
    let mut sum = [0u64; N];
    for (i, slot) in sum.iter_mut().enumerate() {
        let per_cpu = map
            .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| Error::Bpf { step: format!("reading {name}"), source: e })?
            .unwrap_or_default();
        *slot =
            per_cpu.iter().filter_map(|b| b.get(..8)).map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8]))).sum();
    }
    Ok(sum)
}

/// Opens the skeleton of builder `B` (`what` names the program in errors):
/// the root check, its storage, and an error saying the kernel path is
/// unavailable when libbpf cannot open it.
pub(crate) fn open_skeleton<B>(what: &str) -> Result<B::Output>
where
    B: SkelBuilder<'static> + Default,
{
    B::default()
        .open(skeleton_storage(what)?)
        .map_err(|e| unavailable(&format!("opening {what} failed (kernel without BPF/BTF?)"), e))
}

/// Loads an opened skeleton once its read-only globals and map sizes are set.
pub(crate) fn load_skeleton<O: OpenSkel<'static>>(open: O, what: &str) -> Result<O::Output> {
    open.load().map_err(|e| unavailable(&format!("the kernel refused to load {what}"), e))
}

/// The error when object `obj` came out of the build without its .rodata
/// (the read-only globals every kccl program is configured through).
pub(crate) fn no_rodata(obj: &str) -> Error {
    Error::Usage(format!("{obj} has no .rodata section (build problem)"))
}
