//! What loading and attaching any kccl BPF object needs: the root check and
//! skeleton storage, the errors that say the kernel path is unavailable,
//! and what the verifier reports.

use crate::error::{is_root, Error, Result};
use std::mem::size_of;
use std::mem::MaybeUninit;

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
