//! SIGINT/SIGTERM as a request to stop: long-running commands (`kccl
//! aggregator`) check the flag between rounds of work and then report what
//! they did, instead of dying with their counters unprinted.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::Relaxed);
}

/// Installs the handler for SIGINT and SIGTERM: from then on they set the
/// flag instead of ending the process (the caller's loop sees it within one
/// round of work).
pub fn stop_on_signals() -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a plain handler, an empty mask and
        // no flags is valid; on_signal only stores to an atomic.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(Error::io(format!("installing the handler of signal {sig}"), std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// True once SIGINT or SIGTERM arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::Relaxed)
}
