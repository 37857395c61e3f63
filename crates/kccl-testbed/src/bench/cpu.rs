//! Aggregator CPU under a paced load (`kccl bench cpu`): the aggregator's
//! receive path runs in a threaded NAPI kernel thread pinned to CPU 1 (GRO on
//! its veth, TSO/GSO off on the bridge port so the user path also goes through
//! NAPI), the aggregator's thread is pinned to CPU 1 too, senders to CPU 0.
//! The aggregator's CPU is that NAPI thread's run time (/proc/PID/schedstat:
//! XDP, the stack, socket delivery, the ACK fan-out) plus the aggregator
//! thread's CPU time, over the wall time of a paced run (the same offered load
//! on both paths).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::agg::{check, enter_host, guarded, poisoned, rank_data, serve_until, CpuRecord, Gate, Kind};
use crate::cluster::{ClusterGuard, ClusterSpec};
use crate::error::{Error, Result};
use kccl::agg::{AggConfig, AggOp, Collective};
use kccl::transport::{thread_cpu_time, Path, PathChoice};

/// Aggregator CPU under a paced load (`kccl bench cpu`): `senders` ranks
/// reduce a `bytes` vector to host 0 every `period`, for `duration`.
pub fn measure_cpu(
    name: &str,
    senders: usize,
    choice: PathChoice,
    bytes: usize,
    period: Duration,
    duration: Duration,
    cfg: &AggConfig,
) -> Result<CpuRecord> {
    let guard = ClusterGuard::up(&ClusterSpec::new(name, senders + 1))?;
    let group = guard.cluster.group.clone();
    let agg_ns = group.members[0]
        .netns
        .clone()
        .ok_or_else(|| Error::setting("host 0", "has no namespace (the CPU benchmark needs the virtual cluster)"))?;
    let napi_pid = threaded_napi(&crate::cluster::switch_netns(&guard.cluster.name), "h0", &agg_ns)?;
    pin(napi_pid, 1)?;
    let elems = bytes / 4;
    let ranks: Vec<u16> = group.members.iter().take(senders + 1).map(|m| m.rank).collect();
    let barrier = Gate::new(ranks.len());
    let ops = duration.as_secs_f64() / period.as_secs_f64();
    let nops = (ops.ceil() as usize).max(1);
    let agg_thread_cpu = Mutex::new(Duration::ZERO);
    let path_used: Mutex<Option<Path>> = Mutex::new(None);
    let done_ops = Mutex::new(0usize);
    let wall = Mutex::new(Duration::ZERO);
    let napi0 = Arc::new(Mutex::new(0u64));
    let finished = std::sync::atomic::AtomicUsize::new(0);
    let others = ranks.len() - 1;
    std::thread::scope(|s| -> Result<()> {
        let mut hs = Vec::new();
        for &rank in &ranks {
            let (group, barrier, agg_thread_cpu, path_used, done_ops, wall, napi0, all, finished) =
                (&group, &barrier, &agg_thread_cpu, &path_used, &done_ops, &wall, &napi0, &ranks, &finished);
            hs.push(s.spawn(move || -> Result<()> {
                guarded(barrier, || {
                    enter_host(group, rank)?;
                    pin(0, if rank == 0 { 1 } else { 0 })?;
                    let mut c = Collective::new(group, rank, choice, cfg.clone())?;
                    let data = rank_data(rank, elems);
                    // One untimed, checked operation; warms both paths up.
                    barrier.wait()?;
                    if let Some(r) = c.reduce(&data, AggOp::Sum, 0)? {
                        check(Kind::Reduce, AggOp::Sum, all, &r, elems, rank)?;
                    }
                    if rank == 0 {
                        serve_until(&mut c, finished, others, cfg.deadline, barrier)?;
                    } else {
                        finished.fetch_add(1, Ordering::SeqCst);
                    }
                    barrier.wait()?;
                    let t0 = Instant::now();
                    let c0 = thread_cpu_time();
                    if rank == 0 {
                        *path_used.lock().map_err(|_| poisoned())? = Some(c.path());
                        *napi0.lock().map_err(|_| poisoned())? = schedstat_ns(napi_pid)?;
                    }
                    for k in 0..nops {
                        // Paced: operation k starts at k * period.
                        let due = period * k as u32;
                        if let Some(wait) = due.checked_sub(t0.elapsed()) {
                            std::thread::sleep(wait);
                        }
                        c.reduce(&data, AggOp::Sum, 0)?;
                        if rank == 0 {
                            *done_ops.lock().map_err(|_| poisoned())? += 1;
                        } else {
                            finished.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    if rank == 0 {
                        *agg_thread_cpu.lock().map_err(|_| poisoned())? = thread_cpu_time() - c0;
                        *wall.lock().map_err(|_| poisoned())? = t0.elapsed();
                        let n0 = *napi0.lock().map_err(|_| poisoned())?;
                        *napi0.lock().map_err(|_| poisoned())? = schedstat_ns(napi_pid)?.saturating_sub(n0);
                        serve_until(&mut c, finished, others * (nops + 1), cfg.deadline, barrier)?;
                    }
                    Ok(())
                })
            }));
        }
        let mut first = None;
        for h in hs {
            if let Err(e) = h.join().map_err(|_| Error::panicked("a benchmark rank"))? {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    })?;
    drop(guard);
    let wall = wall.into_inner().map_err(|_| poisoned())?.as_secs_f64().max(1e-9);
    let napi = *napi0.lock().map_err(|_| poisoned())? as f64 / 1e9;
    let thread = agg_thread_cpu.into_inner().map_err(|_| poisoned())?.as_secs_f64();
    let ops = done_ops.into_inner().map_err(|_| poisoned())?;
    Ok(CpuRecord {
        path: path_used.into_inner().map_err(|_| poisoned())?.unwrap_or(Path::User),
        op: "sum",
        senders,
        bytes,
        offered_mb_s: (senders * bytes) as f64 / period.as_secs_f64() / 1e6,
        achieved_mb_s: (ops * senders * bytes) as f64 / wall / 1e6,
        cpu_pct: (napi + thread) / wall * 100.0,
        napi_cpu_pct: napi / wall * 100.0,
        thread_cpu_pct: thread / wall * 100.0,
        ops,
    })
}

/// Moves host `ns`'s eth0 receive processing into a threaded NAPI kernel
/// thread and returns its pid.  GRO on eth0 makes veth use NAPI even without
/// XDP; the bridge port must not send TSO/GSO skbs, or veth bypasses NAPI.
fn threaded_napi(switch_ns: &str, port: &str, ns: &str) -> Result<i32> {
    run("ip", &["netns", "exec", switch_ns, "ethtool", "-K", port, "tso", "off", "gso", "off"])?;
    run("ip", &["netns", "exec", ns, "ethtool", "-K", "eth0", "gro", "on"])?;
    let before = napi_threads()?;
    run("ip", &["netns", "exec", ns, "sh", "-c", "echo 1 > /sys/class/net/eth0/threaded"])?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = napi_threads()?;
        if let Some(&pid) = now.iter().find(|p| !before.contains(p)) {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            return Err(Error::Host {
                what: "threaded NAPI".into(),
                detail: format!(
                    "no threaded NAPI kernel thread appeared for eth0 in {ns} (needs kernel support for /sys/class/net/*/threaded)"
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn napi_threads() -> Result<Vec<i32>> {
    let mut v = Vec::new();
    let dir = std::fs::read_dir("/proc").map_err(|e| Error::io("listing /proc", e))?;
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) {
            if comm.starts_with("napi/eth0-") {
                v.push(pid);
            }
        }
    }
    Ok(v)
}

/// CPU time a task has run, in ns (first field of /proc/PID/schedstat).
fn schedstat_ns(pid: i32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .map_err(|e| Error::io(format!("reading /proc/{pid}/schedstat"), e))?;
    s.split_whitespace().next().and_then(|v| v.parse().ok()).ok_or_else(|| Error::Host {
        what: format!("/proc/{pid}/schedstat"),
        detail: format!("unexpected contents {s:?}"),
    })
}

/// Pins task `pid` (0: the calling thread) to `cpu` (if the machine has it).
fn pin(pid: i32, cpu: usize) -> Result<()> {
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let cpu = cpu.min(ncpu - 1);
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(Error::io(format!("pinning task {pid} to CPU {cpu}"), std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out =
        std::process::Command::new(cmd).args(args).output().map_err(|e| Error::io(format!("running {cmd}"), e))?;
    if !out.status.success() {
        return Err(Error::Tool {
            cmd: format!("{cmd} {}", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            hint: "make setup installs ethtool".into(),
        });
    }
    Ok(())
}
