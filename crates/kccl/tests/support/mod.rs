//! Test support shared by every test crate of the workspace (the one place
//! for it; other crates include this file with `#[path]`): the root gate,
//! scratch directories, deterministic payloads, Internet checksums for building expected frames, a
//! private network namespace with a veth pair (fxa/fxb) that is removed on
//! drop, and an AF_PACKET capture of what a program sent out of an interface.
#![allow(dead_code)] // each test crate uses its own subset

use std::mem::size_of;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kccl::netns;

/// Whether a test that needs root may run. Without root it prints a visible
/// `SKIPPED <test>: needs root (<why>)` line and returns false, so the test
/// returns early. With `KCCL_REQUIRE_ROOT=1` (set by .ci/run, which runs as
/// root) a missing root is a failure, never a silent pass.
pub fn root_or_skip(test: &str, why: &str) -> bool {
    if kccl::error::is_root() {
        return true;
    }
    if std::env::var("KCCL_REQUIRE_ROOT").is_ok_and(|v| v == "1") {
        panic!("{test} needs root ({why}) and KCCL_REQUIRE_ROOT=1 forbids skipping it");
    }
    println!("SKIPPED {test}: needs root ({why})");
    false
}

/// The command prefix that runs a program as user `nobody` (from root).
pub const AS_NOBODY: &[&str] = &["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"];

/// A command running `bin` through `prefix` (e.g. [`AS_NOBODY`]), or directly
/// when `prefix` is empty.
pub fn command_with(prefix: &[&str], bin: &str) -> Command {
    match prefix.split_first() {
        Some((p, rest)) => {
            let mut c = Command::new(p);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// The prefix that runs `bin` without root: [`AS_NOBODY`] as root, nothing
/// otherwise; None (after a visible `SKIPPED <test>` line) when root cannot
/// run `bin` as nobody, e.g. a directory on its path is not searchable by
/// others.
pub fn non_root_prefix(test: &str, bin: &str) -> Option<&'static [&'static str]> {
    if !kccl::error::is_root() {
        return Some(&[]);
    }
    match Command::new(AS_NOBODY[0]).args(&AS_NOBODY[1..]).arg(bin).arg("--version").output() {
        Ok(o) if o.status.success() => Some(AS_NOBODY),
        Ok(o) => {
            println!(
                "SKIPPED {test}: {bin} cannot be run as nobody (needs every directory on its path to be \
                 searchable by others): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            None
        }
        Err(e) => {
            println!("SKIPPED {test}: cannot run setpriv to become nobody: {e}");
            None
        }
    }
}

/// A temporary directory that user `nobody` can read (0755, files 0644),
/// removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("kccl-cli-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("creating scratch dir");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod scratch dir");
        Scratch(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn write(&self, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, bytes).expect("writing scratch file");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod scratch file");
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `len` deterministic bytes; different salts give different bytes, so a
/// receiver that got the wrong message (or bytes of another) is caught.
pub fn pattern(len: usize, salt: u64) -> Vec<u8> {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn csum_add(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

pub fn csum_fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// Ones' complement checksum of `bytes` (the value to store in a header).
pub fn inet_csum(bytes: &[u8]) -> u16 {
    !csum_fold(csum_add(0, bytes))
}

/// Sum of the IPv4 pseudo-header of a UDP datagram of `udp_len` bytes.
pub fn pseudo_sum(saddr: Ipv4Addr, daddr: Ipv4Addr, udp_len: u16) -> u32 {
    let mut s = csum_add(0, &saddr.octets());
    s = csum_add(s, &daddr.octets());
    s += 17;
    s + u32::from(udp_len)
}

/// A private network namespace with the veth pair fxa/fxb; removed on drop.
pub struct NetnsGuard {
    pub name: String,
}

pub fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

impl NetnsGuard {
    pub fn up(name: String) -> Result<NetnsGuard, String> {
        run(&["ip", "netns", "add", &name])?;
        let g = NetnsGuard { name };
        let n = g.name.as_str();
        run(&["ip", "netns", "exec", n, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])?;
        run(&["ip", "netns", "exec", n, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"])?;
        run(&["ip", "-n", n, "link", "add", "fxa", "type", "veth", "peer", "name", "fxb"])?;
        for dev in ["fxa", "fxb"] {
            run(&["ip", "netns", "exec", n, "sysctl", "-qw", &format!("net.ipv6.conf.{dev}.disable_ipv6=1")])?;
            run(&["ip", "-n", n, "link", "set", dev, "up"])?;
        }
        Ok(g)
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        if let Err(e) = run(&["ip", "netns", "del", &self.name]) {
            eprintln!("warning: {e}");
        }
    }
}

/// Namespaces of this process whose names start with `tag` (as made by
/// `format!("{tag}{pid}-...")`), for checking that guards removed them.
pub fn our_namespaces(tag: &str) -> Vec<String> {
    let prefix = format!("{tag}{}-", std::process::id());
    std::fs::read_dir(netns::NETNS_RUN_DIR)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

pub fn io_err(step: &str) -> kccl::Error {
    kccl::Error::last_os(step.to_owned())
}

/// AF_PACKET/SOCK_RAW socket on one interface (all protocols), nonblocking.
pub struct Capture {
    fd: OwnedFd,
}

impl Capture {
    pub fn open(ifindex: u32) -> kccl::Result<Capture> {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the fd is owned below.
        let raw = unsafe {
            libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, i32::from(proto))
        };
        if raw < 0 {
            return Err(io_err("socket(AF_PACKET)"));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let rcvbuf: libc::c_int = 4 << 20;
        // SAFETY: valid fd, option value of the stated size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&rcvbuf as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        // SAFETY: zeroed sockaddr_ll is valid; we fill family, protocol, ifindex.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: sll is a sockaddr_ll of the given size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io_err("bind(AF_PACKET)"));
        }
        Ok(Capture { fd })
    }

    /// Frames received (not sent) on the interface until it has been quiet
    /// for `idle`.
    pub fn drain(&self, idle: Duration) -> kccl::Result<Vec<Vec<u8>>> {
        let mut frames = Vec::new();
        let mut buf = vec![0u8; 65536];
        loop {
            let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, idle.as_millis() as libc::c_int) };
            if n < 0 {
                return Err(io_err("poll(AF_PACKET)"));
            }
            if n == 0 {
                return Ok(frames);
            }
            loop {
                // SAFETY: zeroed sockaddr_ll is valid as an out parameter.
                let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut flen = size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                // SAFETY: buf and from are valid for the lengths given.
                let r = unsafe {
                    libc::recvfrom(
                        self.fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&mut from as *mut libc::sockaddr_ll).cast(),
                        &mut flen,
                    )
                };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    // ENETDOWN: reported once (then cleared) when bound to
                    // a device that is down; nothing to capture there.
                    if e.kind() == std::io::ErrorKind::WouldBlock || e.raw_os_error() == Some(libc::ENETDOWN) {
                        break;
                    }
                    return Err(kccl::Error::io("recvfrom(AF_PACKET)", e));
                }
                if from.sll_pkttype != libc::PACKET_OUTGOING {
                    frames.push(buf[..r as usize].to_vec());
                }
            }
        }
    }
}

/// Ethernet + IPv4 (DF, TTL 64, any options) + UDP frame, checksums computed
/// from scratch (the UDP one only when `udp_csum`).
#[derive(Clone, Debug)]
pub struct Frame {
    pub eth_src: [u8; 6],
    pub eth_dst: [u8; 6],
    pub saddr: Ipv4Addr,
    pub daddr: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub options: Vec<u8>,
    pub udp_csum: bool,
    pub udp_len_field: Option<u16>,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn build(&self) -> Vec<u8> {
        let ihl = 5 + self.options.len() / 4;
        let udp_len = 8 + self.payload.len();
        let tot_len = ihl * 4 + udp_len;
        let mut f = Vec::with_capacity(14 + tot_len);
        f.extend_from_slice(&self.eth_dst);
        f.extend_from_slice(&self.eth_src);
        f.extend_from_slice(&0x0800u16.to_be_bytes()); // ETH_P_IP
        let ip_start = f.len();
        f.push(0x40 | ihl as u8);
        f.push(0);
        f.extend_from_slice(&(tot_len as u16).to_be_bytes());
        f.extend_from_slice(&0x1234u16.to_be_bytes());
        f.extend_from_slice(&0x4000u16.to_be_bytes()); // DF
        f.push(64);
        f.push(17);
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&self.saddr.octets());
        f.extend_from_slice(&self.daddr.octets());
        f.extend_from_slice(&self.options);
        let c = inet_csum(&f[ip_start..]);
        f[ip_start + 10..ip_start + 12].copy_from_slice(&c.to_be_bytes());
        let udp_start = f.len();
        f.extend_from_slice(&self.sport.to_be_bytes());
        f.extend_from_slice(&self.dport.to_be_bytes());
        f.extend_from_slice(&self.udp_len_field.unwrap_or(udp_len as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&self.payload);
        if self.udp_csum {
            let s = csum_add(pseudo_sum(self.saddr, self.daddr, udp_len as u16), &f[udp_start..]);
            let mut c = !csum_fold(s);
            if c == 0 {
                c = 0xffff;
            }
            f[udp_start + 6..udp_start + 8].copy_from_slice(&c.to_be_bytes());
        }
        f
    }
}
