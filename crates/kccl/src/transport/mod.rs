//! What the collectives share below their protocols: the path choice
//! ([`PathChoice`], [`Path`]), the UDP socket with batched system calls
//! ([`sock`]) and the CPU accounting of their statistics
//! ([`thread_cpu_time`]).  bcast/, agg/ and sg/ all build on it; none of them
//! imports another.

mod cpu;
mod path;
pub mod sock;

pub use cpu::thread_cpu_time;
pub use path::{Path, PathChoice};
