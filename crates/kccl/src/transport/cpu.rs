//! CPU accounting shared by the collectives' statistics and benchmarks.

use std::time::Duration;

/// CPU time of the calling thread (user + system, including softirq work the
/// kernel runs in its context).
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid clock id and timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
