//! Network namespaces: entering them per thread (setns) so that BPF objects in
//! /sys/fs/bpf stay visible (`ip netns exec` remounts /sys), and running a
//! closure inside one.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use crate::error::{Error, Result};

/// Where `ip netns add` bind-mounts named namespaces.
pub const NETNS_RUN_DIR: &str = "/var/run/netns";

pub fn path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_RUN_DIR).join(name)
}

/// Moves the calling thread into the named network namespace.
pub fn enter(name: &str) -> Result<()> {
    let p = path(name);
    let f = File::open(&p).map_err(|e| Error::io(format!("opening network namespace {}", p.display()), e))?;
    // SAFETY: setns on a valid namespace fd; affects only this thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(Error::last_os(format!("entering network namespace {name} (setns needs root)")));
    }
    Ok(())
}

/// Runs `f` on a new thread inside namespace `name` (or in the current one
/// when `name` is None) and returns its result.
pub fn run_in<T, F>(name: Option<&str>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    let name = name.map(str::to_owned);
    let label = name.clone().unwrap_or_else(|| "current namespace".into());
    std::thread::Builder::new()
        .name(format!("kccl-ns-{label}"))
        .spawn(move || {
            if let Some(n) = &name {
                enter(n)?;
            }
            f()
        })
        .map_err(|e| Error::io("spawning a namespace thread", e))?
        .join()
        .map_err(|_| Error::Usage(format!("thread in {label} panicked")))?
}

/// ifindex of `iface` in the calling thread's namespace.
pub fn ifindex(iface: &str, netns: Option<&str>) -> Result<u32> {
    let missing = || Error::InterfaceMissing {
        iface: iface.to_owned(),
        netns: netns.map(|n| format!("network namespace {n}")).unwrap_or_else(|| "this host".into()),
    };
    let c = CString::new(iface).map_err(|_| missing())?;
    // SAFETY: c is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(missing());
    }
    Ok(idx)
}

/// The kernel's cookie of the calling thread's network namespace
/// (SO_NETNS_COOKIE, Linux >= 5.14).  Unlike the nsfs inode it is never
/// reused, so it tells a recreated namespace of the same name from the one
/// being torn down.
pub fn cookie() -> Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    // SAFETY: plain socket; the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::last_os("making a socket to read the namespace cookie"));
    }
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid fd, out buffer and its length.
    let r = unsafe {
        libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, SO_NETNS_COOKIE, (&mut v as *mut u64).cast(), &mut len)
    };
    if r != 0 {
        return Err(Error::last_os("reading the network namespace cookie (SO_NETNS_COOKIE needs Linux >= 5.14)"));
    }
    Ok(v)
}

/// MTU of `iface` in the calling thread's namespace (SIOCGIFMTU on a socket
/// made here; /sys would show the namespace /sys was mounted in).
pub fn mtu(iface: &str) -> Option<usize> {
    if iface.len() >= libc::IFNAMSIZ {
        return None;
    }
    // SAFETY: plain socket/ioctl/close on a zeroed ifreq with a NUL-terminated name.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(iface.bytes()) {
            *d = s as libc::c_char;
        }
        let rc = libc::ioctl(fd, libc::SIOCGIFMTU, &mut req);
        libc::close(fd);
        (rc == 0).then_some(req.ifr_ifru.ifru_mtu as usize)
    }
}
