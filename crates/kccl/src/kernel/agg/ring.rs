//! The reader of xdp_agg's agg_records ring buffer: hands each completed
//! reduce chunk to the poller's closure where it lies in the ring, without
//! copying it out.
//!
//! Why in place: a 64 MiB int32 reduce arrives as 128 MiB of int64 records;
//! copying them into a queue before the root folds them into its result was
//! a second pass over all of it.  libbpf-rs wants a 'static callback, fixed
//! when the ring is built, while the root's closure borrows its call's
//! state; so each consume call lends the closure to the callback (a raw
//! pointer in `Lent`) and takes it back when the call returns.  libbpf runs
//! the callback only inside that call, on the calling thread.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use libbpf_rs::{MapCore, RingBuffer, RingBufferBuilder};

use super::record::{view, AggRecordView};
use crate::error::{Error, Result};

/// What the poller does with each record.
pub(super) type Visit<'a> = dyn FnMut(AggRecordView<'_>) + 'a;

/// The closure lent for one consume call, and what went wrong in it.
#[derive(Default)]
struct Lent {
    visit: Option<*mut Visit<'static>>,
    /// The first record that did not parse (later ones are still handed on).
    error: Option<Error>,
}

// SAFETY: `visit` is set and used only inside RecordRing::consume, on the
// thread that called it (see the module comment); the Mutex is there for
// the callback's Send bound, not for sharing.
unsafe impl Send for Lent {}

pub(super) struct RecordRing {
    ring: RingBuffer<'static>,
    lent: Arc<Mutex<Lent>>,
}

fn lock(l: &Mutex<Lent>) -> Result<MutexGuard<'_, Lent>> {
    l.lock().map_err(|_| Error::Usage("the agg_records reader panicked in a record callback earlier".into()))
}

/// Clears the lent closure when a consume call ends, also by unwinding.
struct Unlend<'a>(&'a Mutex<Lent>);

impl Drop for Unlend<'_> {
    fn drop(&mut self) {
        if let Ok(mut l) = self.0.lock() {
            l.visit = None;
        }
    }
}

/// The ring's callback: the record to the lent closure.  A record that
/// arrives with nothing lent cannot happen (consume lends before libbpf
/// reads); it would be an error of this file, reported by the next consume.
fn hand_on(lent: &Mutex<Lent>, raw: &[u8]) -> i32 {
    let Ok(mut l) = lent.lock() else {
        return -1;
    };
    let Some(visit) = l.visit else {
        l.error.get_or_insert(Error::AggRecord("a record was read with no reader lent (kccl bug)".into()));
        return 0;
    };
    match view(raw) {
        Ok(v) => {
            drop(l);
            // SAFETY: consume lent this pointer from a live &mut for the
            // duration of the ring call that is running this callback.
            unsafe { (*visit)(v) }
        }
        Err(e) => {
            l.error.get_or_insert(e);
        }
    }
    0
}

impl RecordRing {
    pub(super) fn new(map: &dyn MapCore) -> Result<RecordRing> {
        let lent: Arc<Mutex<Lent>> = Arc::default();
        let cb = Arc::clone(&lent);
        let mut rb = RingBufferBuilder::new();
        rb.add(map, move |raw: &[u8]| hand_on(&cb, raw))
            .map_err(|e| Error::Bpf { step: "adding the agg_records ring buffer".into(), source: e })?;
        let ring = rb.build().map_err(|e| Error::Bpf { step: "creating the record reader".into(), source: e })?;
        Ok(RecordRing { ring, lent })
    }

    /// Hands up to `max` records to `visit`, in ring order, and returns how
    /// many were taken off the ring.  A record that did not parse fails the
    /// call after every good one was handed on (nothing read is lost).
    pub(super) fn consume(&mut self, max: usize, visit: &mut Visit<'_>) -> Result<usize> {
        let p: *mut Visit<'_> = visit;
        // SAFETY: only the lifetime is erased.  The pointer stays in `lent`
        // until `_unlend` drops at the end of this call, which `visit`
        // outlives, and the callback dereferences it only during
        // consume_raw_n below.
        let p: *mut Visit<'static> = unsafe { std::mem::transmute(p) };
        lock(&self.lent)?.visit = Some(p);
        let _unlend = Unlend(&self.lent);
        let n = self.ring.consume_raw_n(max);
        let bad = lock(&self.lent)?.error.take();
        if n < 0 {
            return Err(Error::io("reading the agg_records ring buffer", std::io::Error::from_raw_os_error(-n)));
        }
        match bad {
            Some(e) => Err(e),
            None => Ok(n as usize),
        }
    }

    /// Makes [`RecordRing::wait`] also return when `fd` is readable: a
    /// sharded allreduce's owner waits for its own records and for its
    /// socket's answers at once.  The event carries u64::MAX, no ring's
    /// index (libbpf's own poll, which would index its rings with it, is
    /// never called: `wait` is this type's only epoll_wait).
    pub(super) fn watch(&self, fd: std::os::fd::RawFd) -> Result<()> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: u64::MAX };
        // SAFETY: the ring's epoll fd is open while self lives; ev is one
        // readable event; the kernel checks fd.
        let rc = unsafe { libc::epoll_ctl(self.ring.epoll_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(Error::io("adding the socket to the agg_records ring buffer's epoll set", e));
            }
        }
        Ok(())
    }

    /// Sleeps until the ring buffer signals data or `timeout` passes (rounded
    /// up to whole milliseconds).  Consumes nothing.
    pub(super) fn wait(&self, timeout: Duration) -> Result<()> {
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: the ring's epoll fd is open while self lives; ev is one
        // writable event.
        let rc = unsafe { libc::epoll_wait(self.ring.epoll_fd(), &mut ev, 1, ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io("waiting for agg_records ring buffer data", e));
            }
        }
        Ok(())
    }
}
