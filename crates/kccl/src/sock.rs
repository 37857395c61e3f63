//! UDP sockets with batched system calls (sendmmsg/recvmmsg): the one socket
//! layer both paths use, so the user-space baseline is as tuned as we can make
//! it and the kernel path pays the same per-call costs.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::error::{Error, Result};

/// Largest batch one sendmmsg/recvmmsg call takes (UIO_MAXIOV).
pub const MAX_BATCH: usize = 1024;

pub struct BatchSocket {
    sock: UdpSocket,
}

/// One datagram to send: up to two byte slices (header, payload) and a target.
pub struct Datagram<'a> {
    pub to: SocketAddrV4,
    pub head: &'a [u8],
    pub body: &'a [u8],
}

pub fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    }
}

impl BatchSocket {
    /// Binds in the calling thread's network namespace.  Buffers are raised
    /// with the *FORCE options when root (past net.core.*mem_max), else as far
    /// as the sysctls allow.
    pub fn bind(addr: Ipv4Addr, port: u16, rcvbuf: usize, sndbuf: usize) -> Result<BatchSocket> {
        let sock = UdpSocket::bind(SocketAddrV4::new(addr, port))
            .map_err(|e| Error::io(format!("binding UDP socket to {addr}:{port}"), e))?;
        let s = BatchSocket { sock };
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

    /// Sends every datagram, MAX_BATCH per system call.  Returns the number of
    /// sendmmsg calls made.
    pub fn send_all(&self, dgrams: &[Datagram<'_>]) -> Result<usize> {
        let mut calls = 0;
        let mut names: Vec<libc::sockaddr_in> = Vec::with_capacity(dgrams.len().min(MAX_BATCH));
        let mut iovs: Vec<[libc::iovec; 2]> = Vec::with_capacity(dgrams.len().min(MAX_BATCH));
        let mut hdrs: Vec<libc::mmsghdr> = Vec::with_capacity(dgrams.len().min(MAX_BATCH));
        for chunk in dgrams.chunks(MAX_BATCH) {
            names.clear();
            iovs.clear();
            hdrs.clear();
            for d in chunk {
                names.push(sockaddr(d.to));
                iovs.push([
                    libc::iovec { iov_base: d.head.as_ptr() as *mut _, iov_len: d.head.len() },
                    libc::iovec { iov_base: d.body.as_ptr() as *mut _, iov_len: d.body.len() },
                ]);
            }
            for (name, iov) in names.iter_mut().zip(iovs.iter_mut()) {
                // SAFETY: all-zero is a valid msghdr.
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_name = (name as *mut libc::sockaddr_in).cast();
                m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
                m.msg_hdr.msg_iov = iov.as_mut_ptr();
                m.msg_hdr.msg_iovlen = 2;
                hdrs.push(m);
            }
            let mut done = 0;
            while done < hdrs.len() {
                // SAFETY: hdrs[done..] point into names/iovs/dgrams, all alive.
                let n = unsafe {
                    libc::sendmmsg(self.sock.as_raw_fd(), hdrs[done..].as_mut_ptr(), (hdrs.len() - done) as u32, 0)
                };
                calls += 1;
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(Error::io(format!("sendmmsg to {}", chunk[done].to), e));
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
