//! UDP sockets with batched system calls (sendmmsg/recvmmsg): the one socket
//! layer both paths use, so the user-space baseline is as tuned as we can make
//! it and the kernel path pays the same per-call costs.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::error::{Error, Result};

/// Largest batch one sendmmsg/recvmmsg call takes (UIO_MAXIOV).
pub const MAX_BATCH: usize = 1024;

/// Most datagrams one UDP GSO send carries (the kernel allows 64).  Kept
/// small: the segments of one send reach the aggregator's veth back to back
/// while softirqs are off, and bursts of 64 from 4 senders overflowed its
/// 256-entry ring (10x the drops of single sends, measured); 16 keeps most
/// of the saving (one stack traversal per 16 datagrams).
pub const GSO_MAX_SEGS: usize = 16;
/// Largest UDP payload of one GSO send: the IPv4 total length (65535) less
/// the IP and UDP headers.
const GSO_MAX_BYTES: usize = 65535 - 20 - 8;

pub struct BatchSocket {
    sock: UdpSocket,
    /// Send runs of equal-size datagrams to one address as one UDP GSO
    /// message (see [`BatchSocket::enable_gso`]); cleared if the kernel
    /// refuses one.
    gso: AtomicBool,
}

/// One datagram to send: up to two byte slices (header, payload) and a target.
pub struct Datagram<'a> {
    pub to: SocketAddrV4,
    pub head: &'a [u8],
    pub body: &'a [u8],
}

impl Datagram<'_> {
    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A control message buffer holding UDP_SEGMENT = `seg` (unused when 0).
fn gso_cmsg(seg: u16) -> [u64; 3] {
    let mut buf = [0u64; 3];
    if seg != 0 {
        // SAFETY: the buffer is 24 bytes, 8-aligned: room for one cmsghdr
        // (16 bytes) and a u16 (CMSG_SPACE(2) == 24); the libc macros only
        // compute addresses inside it.
        unsafe {
            let mut m: libc::msghdr = std::mem::zeroed();
            m.msg_control = buf.as_mut_ptr().cast();
            m.msg_controllen = libc::CMSG_SPACE(2) as usize;
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = libc::UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(2) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
        }
    }
    buf
}

pub fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    }
}

/// Where a sender's datagrams go: a socket, or (a sharded allreduce's own
/// shard on the kernel path) this member's own XDP program.
pub trait DatagramOut {
    /// Sends every datagram; returns the number of system calls made.
    fn send_all(&mut self, dgrams: &[Datagram<'_>]) -> Result<usize>;
}

impl DatagramOut for &BatchSocket {
    fn send_all(&mut self, dgrams: &[Datagram<'_>]) -> Result<usize> {
        BatchSocket::send_all(self, dgrams)
    }
}

impl AsRawFd for BatchSocket {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }
}

impl BatchSocket {
    /// Binds in the calling thread's network namespace.  Buffers are raised
    /// with the *FORCE options when root (past net.core.*mem_max), else as far
    /// as the sysctls allow.
    pub fn bind(addr: Ipv4Addr, port: u16, rcvbuf: usize, sndbuf: usize) -> Result<BatchSocket> {
        let sock = UdpSocket::bind(SocketAddrV4::new(addr, port))
            .map_err(|e| Error::io(format!("binding UDP socket to {addr}:{port}"), e))?;
        let s = BatchSocket { sock, gso: AtomicBool::new(false) };
        s.set_buf(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, rcvbuf);
        s.set_buf(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, sndbuf);
        Ok(s)
    }

    /// Asks the kernel to stamp each datagram when it enters this host's
    /// stack (SO_TIMESTAMPNS, CLOCK_REALTIME); see [`RecvBatch::get`].
    pub fn enable_rx_timestamps(&self) -> Result<()> {
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with a c_int option value on an owned fd.
        let rc = unsafe {
            libc::setsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_TIMESTAMPNS,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(Error::last_os("enabling SO_TIMESTAMPNS"));
        }
        Ok(())
    }

    fn set_buf(&self, force: libc::c_int, plain: libc::c_int, bytes: usize) {
        let v = bytes.min(i32::MAX as usize / 2) as libc::c_int;
        for opt in [force, plain] {
            // SAFETY: setsockopt with a c_int option value on an owned fd.
            let rc = unsafe {
                libc::setsockopt(
                    self.sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                return;
            }
        }
    }

    pub fn local_addr(&self) -> Result<SocketAddrV4> {
        match self.sock.local_addr().map_err(|e| Error::io("reading socket address", e))? {
            std::net::SocketAddr::V4(a) => Ok(a),
            std::net::SocketAddr::V6(a) => Err(Error::Usage(format!("unexpected IPv6 socket address {a}"))),
        }
    }

    /// Sends runs of consecutive datagrams that go to one address and have
    /// one size (the last of a run may be shorter) as single UDP GSO
    /// messages (UDP_SEGMENT): the stack is traversed once per run, and
    /// the datagrams are cut apart where the path needs it (at the latest
    /// before an XDP program: veth drops GSO from a peer that runs XDP), so
    /// receivers see the same datagrams.  Not for packets a TC program at
    /// this host's egress must see one by one (tc_bcast parses only the
    /// first segment).
    pub fn enable_gso(&self) {
        self.gso.store(true, Ordering::Relaxed);
    }

    pub fn gso_enabled(&self) -> bool {
        self.gso.load(Ordering::Relaxed)
    }

    /// Sends every datagram, at most MAX_BATCH messages per system call
    /// (GSO runs count as one message when enabled).  Returns the number of
    /// sendmmsg calls made.
    pub fn send_all(&self, dgrams: &[Datagram<'_>]) -> Result<usize> {
        let gso = self.gso_enabled();
        // Messages as (first datagram, datagrams, segment size if GSO).
        let mut msgs: Vec<(usize, usize, u16)> = Vec::with_capacity(if gso { 8 } else { dgrams.len() });
        let mut i = 0;
        while i < dgrams.len() {
            let seg = dgrams[i].len();
            let (mut n, mut bytes) = (1, seg);
            if gso {
                while let Some(d) = dgrams.get(i + n) {
                    let l = d.len();
                    if d.to != dgrams[i].to || l > seg || l == 0 || n == GSO_MAX_SEGS || bytes + l > GSO_MAX_BYTES {
                        break;
                    }
                    n += 1;
                    bytes += l;
                    if l < seg {
                        break; // only the last segment may be short
                    }
                }
            }
            msgs.push((i, n, if n > 1 { seg as u16 } else { 0 }));
            i += n;
        }
        let mut calls = 0;
        let mut names: Vec<libc::sockaddr_in> = Vec::with_capacity(msgs.len().min(MAX_BATCH));
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(2 * dgrams.len().min(MAX_BATCH * GSO_MAX_SEGS));
        let mut cmsgs: Vec<[u64; 3]> = Vec::with_capacity(msgs.len().min(MAX_BATCH));
        let mut hdrs: Vec<libc::mmsghdr> = Vec::with_capacity(msgs.len().min(MAX_BATCH));
        for batch in msgs.chunks(MAX_BATCH) {
            names.clear();
            iovs.clear();
            cmsgs.clear();
            hdrs.clear();
            for &(first, n, seg) in batch {
                names.push(sockaddr(dgrams[first].to));
                for d in &dgrams[first..first + n] {
                    iovs.push(libc::iovec { iov_base: d.head.as_ptr() as *mut _, iov_len: d.head.len() });
                    iovs.push(libc::iovec { iov_base: d.body.as_ptr() as *mut _, iov_len: d.body.len() });
                }
                cmsgs.push(gso_cmsg(seg));
            }
            let mut iov_at = 0;
            for (k, &(_, n, seg)) in batch.iter().enumerate() {
                // SAFETY: all-zero is a valid msghdr.
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_name = (&mut names[k] as *mut libc::sockaddr_in).cast();
                m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
                m.msg_hdr.msg_iov = iovs[iov_at..].as_mut_ptr();
                m.msg_hdr.msg_iovlen = 2 * n;
                iov_at += 2 * n;
                if seg != 0 {
                    m.msg_hdr.msg_control = cmsgs[k].as_mut_ptr().cast();
                    // SAFETY: CMSG_SPACE only computes a size.
                    m.msg_hdr.msg_controllen = unsafe { libc::CMSG_SPACE(2) } as usize;
                }
                hdrs.push(m);
            }
            let mut done = 0;
            while done < hdrs.len() {
                // SAFETY: hdrs[done..] point into names/iovs/cmsgs/dgrams,
                // all alive and not moved until the call returns.
                let n = unsafe {
                    libc::sendmmsg(self.sock.as_raw_fd(), hdrs[done..].as_mut_ptr(), (hdrs.len() - done) as u32, 0)
                };
                calls += 1;
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    let (first, _, seg) = batch[done];
                    if seg != 0 && matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EIO | libc::ENOPROTOOPT)) {
                        // This kernel or device will not segment: send the
                        // rest one datagram per message from now on.
                        self.gso.store(false, Ordering::Relaxed);
                        return Ok(calls + self.send_all(&dgrams[first..])?);
                    }
                    return Err(Error::io(format!("sendmmsg to {}", dgrams[first].to), e));
                }
                done += n as usize;
            }
        }
        Ok(calls)
    }

    /// Receives a batch into `rb` (one recvmmsg); blocks until at least one
    /// datagram arrives or `timeout` passes (returns 0).
    pub fn recv_batch(&self, rb: &mut RecvBatch, timeout: Option<Duration>) -> Result<usize> {
        if let Some(t) = timeout {
            let ms = t.as_millis().min(i32::MAX as u128) as i32;
            let mut pfd = libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    return Ok(0);
                }
                return Err(Error::io("poll on receive socket", e));
            }
            if rc == 0 {
                return Ok(0);
            }
        }
        let n = rb.bufs.len();
        // Only the headers the last call filled were changed by the kernel.
        for i in 0..rb.dirty.min(n) {
            let h = &mut rb.hdrs[i].msg_hdr;
            h.msg_name = (&mut rb.names[i] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            rb.iovs[i] = libc::iovec { iov_base: rb.bufs[i].as_mut_ptr().cast(), iov_len: rb.bufs[i].len() };
            h.msg_iov = &mut rb.iovs[i];
            h.msg_iovlen = 1;
            h.msg_flags = 0;
            h.msg_control = rb.cmsg[i].as_mut_ptr().cast();
            h.msg_controllen = rb.cmsg[i].len() * 8;
        }
        loop {
            // SAFETY: hdrs point at live buffers sized by iov_len.
            let got = unsafe {
                libc::recvmmsg(
                    self.sock.as_raw_fd(),
                    rb.hdrs.as_mut_ptr(),
                    n as u32,
                    libc::MSG_WAITFORONE,
                    std::ptr::null_mut(),
                )
            };
            if got < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::io("recvmmsg", e));
            }
            rb.filled = got as usize;
            rb.dirty = rb.filled;
            return Ok(rb.filled);
        }
    }
}

/// Reusable buffers of one recvmmsg batch (allocated once per receiver).
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    names: Vec<libc::sockaddr_in>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
    /// Control buffers (u64 for alignment) for the receive timestamps.
    cmsg: Vec<[u64; 8]>,
    filled: usize,
    /// Headers to (re)initialise before the next call: all at first, then
    /// those the previous call filled.
    dirty: usize,
}

// SAFETY: the raw pointers in `hdrs`/`iovs` only ever point into heap
// buffers owned by the same RecvBatch (bufs, names, iovs, cmsg: Vecs that
// are never resized), so they stay valid when the batch moves to another
// thread, and nothing else holds them.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    pub fn new(slots: usize, dgram_max: usize) -> RecvBatch {
        let slots = slots.clamp(1, MAX_BATCH);
        RecvBatch {
            bufs: (0..slots).map(|_| vec![0u8; dgram_max]).collect(),
            // SAFETY: all-zero sockaddr_in and mmsghdr are valid values.
            names: vec![unsafe { std::mem::zeroed() }; slots],
            iovs: (0..slots).map(|_| libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }).collect(),
            hdrs: (0..slots).map(|_| unsafe { std::mem::zeroed() }).collect(),
            cmsg: vec![[0u64; 8]; slots],
            filled: 0,
            dirty: slots,
        }
    }

    /// Datagram i of the last batch: Err(()) if it was truncated.
    pub fn get(&self, i: usize) -> (Result<&[u8], ()>, SocketAddrV4) {
        let h = &self.hdrs[i];
        let from = SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(self.names[i].sin_addr.s_addr)),
            u16::from_be(self.names[i].sin_port),
        );
        if h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
            return (Err(()), from);
        }
        (Ok(&self.bufs[i][..h.msg_len as usize]), from)
    }

    /// Kernel receive time of datagram i, if SO_TIMESTAMPNS is on.
    pub fn rx_time(&self, i: usize) -> Option<std::time::SystemTime> {
        let h = &self.hdrs[i].msg_hdr;
        // SAFETY: walking the control messages the kernel wrote into our
        // buffer, with the libc CMSG macros and the length it reported.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(h);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                    let ts: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                    return Some(std::time::UNIX_EPOCH + Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32));
                }
                c = libc::CMSG_NXTHDR(h, c);
            }
        }
        None
    }

    pub fn len(&self) -> usize {
        self.filled
    }

    pub fn is_empty(&self) -> bool {
        self.filled == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs of equal-size datagrams to one address go out as GSO sends and
    /// arrive as the same datagrams, in order (loopback segments them for a
    /// socket without UDP_GRO); a change of size or address ends a run.
    #[test]
    fn gso_runs_arrive_as_the_same_datagrams() {
        let tx = BatchSocket::bind(Ipv4Addr::LOCALHOST, 0, 1 << 20, 1 << 20).expect("bind tx");
        let rx_a = BatchSocket::bind(Ipv4Addr::LOCALHOST, 0, 8 << 20, 1 << 20).expect("bind rx a");
        let rx_b = BatchSocket::bind(Ipv4Addr::LOCALHOST, 0, 8 << 20, 1 << 20).expect("bind rx b");
        let (a, b) = (rx_a.local_addr().expect("addr a"), rx_b.local_addr().expect("addr b"));
        tx.enable_gso();
        // 40 full datagrams and a short one to a (ending the run), 1 more to a,
        // then 3 to b, then 4 to a.
        let heads: Vec<[u8; 4]> = (0..49u32).map(|i| i.to_le_bytes()).collect();
        let body: Vec<u8> = (0..1400).map(|i| (i % 251) as u8).collect();
        let plan: Vec<(SocketAddrV4, usize)> = (0..49)
            .map(|i| match i {
                0..=39 => (a, 1400),
                40 => (a, 333),
                42..=44 => (b, 1400),
                _ => (a, 1400),
            })
            .collect();
        let dgrams: Vec<Datagram<'_>> =
            plan.iter().zip(&heads).map(|(&(to, len), h)| Datagram { to, head: h, body: &body[..len] }).collect();
        let calls = tx.send_all(&dgrams).expect("send");
        assert_eq!(calls, 1, "one sendmmsg call");
        assert!(tx.gso_enabled(), "the kernel refused a GSO send (fell back)");
        let mut got: Vec<(SocketAddrV4, u32, usize)> = Vec::new();
        for (sock, addr, want) in [(&rx_a, a, 46), (&rx_b, b, 3)] {
            let mut rb = RecvBatch::new(64, 2048);
            let mut n = 0;
            while n < want {
                let k = sock.recv_batch(&mut rb, Some(Duration::from_secs(2))).expect("recv");
                assert!(k > 0, "only {n} of {want} datagrams arrived at {addr}");
                for i in 0..k {
                    let (d, _) = rb.get(i);
                    let d = d.expect("not truncated");
                    let idx = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
                    assert_eq!(&d[4..], &body[..d.len() - 4], "datagram {idx} payload");
                    got.push((addr, idx, d.len() - 4));
                }
                n += k;
            }
        }
        let want: Vec<(SocketAddrV4, u32, usize)> = plan
            .iter()
            .enumerate()
            .map(|(i, &(to, len))| (to, i as u32, len))
            .filter(|e| e.0 == a)
            .chain(plan.iter().enumerate().map(|(i, &(to, len))| (to, i as u32, len)).filter(|e| e.0 == b))
            .collect();
        assert_eq!(got, want);
    }
}
