//! The members map (struct kccl_member, one encoding for every program) and
//! where its entries come from: the neighbour table and interface names of
//! the calling thread's namespace.

use crate::error::{Error, Result};
use crate::group::MAX_MEMBERS;
use crate::skel::types;
use libbpf_rs::{MapCore, MapFlags};
use std::collections::HashMap;
use std::net::Ipv4Addr;

/// Name of interface `ifindex` in the calling thread's namespace.
pub(crate) fn ifname(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_str().ok().map(str::to_owned)
}

// enum kccl_member_flag
const M_PRESENT: u32 = 1 << 0;
const M_RESOLVED: u32 = 1 << 1;

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

/// The next-hop MAC of members[rank] in a members map: None when the slot
/// holds no member or its MAC is unresolved.
pub(crate) fn read_next_hop<M: MapCore>(map: &M, rank: u16) -> Result<Option<[u8; 6]>> {
    use std::mem::offset_of;
    type T = types::kccl_member;
    if rank as usize >= MAX_MEMBERS {
        return Err(Error::Usage(format!("rank {rank} exceeds the kernel limit of {MAX_MEMBERS} members")));
    }
    let step = || format!("reading members[{rank}]");
    let v = map
        .lookup(&u32::from(rank).to_ne_bytes(), MapFlags::ANY)
        .map_err(|e| Error::Bpf { step: step(), source: e })?
        .filter(|v| v.len() == std::mem::size_of::<T>())
        .ok_or_else(|| Error::Usage(format!("{}: no entry of the expected size", step())))?;
    let o = offset_of!(T, flags);
    let flags = u32::from_ne_bytes([v[o], v[o + 1], v[o + 2], v[o + 3]]);
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&v[offset_of!(T, mac)..][..6]);
    Ok((flags & M_PRESENT != 0 && flags & M_RESOLVED != 0).then_some(mac))
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
