//! Broadcast benchmark harness (used by `kccl bench broadcast` and `kccl demo`).
//!
//! One process drives a whole virtual cluster: the sender runs on a thread that
//! entered host 0's namespace, each receiver on a thread in its own host.
//! Latency is first send to the last receiver holding the whole message: the
//! kernel's receive timestamp of the last datagram at the last receiver
//! (CLOCK_REALTIME, one clock for every namespace of the machine).  The time
//! until the receiving application returns it is reported beside it
//! (app_p50_us/app_p99_us).  Sender CPU is the sender thread's CPU time in
//! broadcast() calls; without CONFIG_IRQ_TIME_ACCOUNTING the softirq work the
//! kernel does in the sender's context (delivering the copies through the
//! bridge into the receivers' sockets) is charged to it on both paths.
//! Every timed iteration checks each receiver's bytes (length + FNV-1a hash).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver as Rx, RecvTimeoutError, Sender as Tx};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crate::cluster::{ClusterGuard, ClusterSpec};
use crate::error::{Error, Result};
use kccl::bcast::{Broadcaster, Receiver};
use kccl::group::Group;
use kccl::netns;
use kccl::transport::{thread_cpu_time, Path, PathChoice};
use kccl::wire::HDR_LEN;

use super::{fnv1a, percentile, process_cpu_time};

/// One result row of `kccl bench broadcast` (JSON record).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BcastRecord {
    pub path: Path,
    pub receivers: usize,
    /// UDP payload bytes per packet (kccl header included), as in the paper.
    pub size: usize,
    pub iters: usize,
    /// First send to the last receiver host holding the whole message: the
    /// kernel's receive timestamp (SO_TIMESTAMPNS) of the last datagram at
    /// the last receiver.
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    /// First send to the last receiving *application* returning the whole
    /// message: adds the wake-up of every receiver thread, which on a 2-core
    /// machine running all hosts is mostly scheduler queueing.
    pub app_p50_us: f64,
    pub app_p99_us: f64,
    pub app_mean_us: f64,
    /// Sender thread CPU per broadcast (includes softirq work in its context).
    pub sender_cpu_us: f64,
    /// CPU of the whole process (sender, receivers, softirq) per broadcast.
    pub total_cpu_us: f64,
    /// Datagrams user space sent per broadcast (retransmissions included).
    pub datagrams_per_op: f64,
    /// First send until broadcast() returned, i.e. until every receiver's
    /// acknowledgment arrived (reliable broadcast), median.
    pub confirm_p50_us: f64,
    /// Packet copies re-sent per broadcast (reliability).
    pub retransmitted_per_op: f64,
    /// Iterations in which some receiver did not get the message in time.
    pub lost: usize,
}

struct Done {
    rank: u16,
    seq: u32,
    len: usize,
    hash: u64,
    completed: Instant,
    arrived: Option<SystemTime>,
}

/// When the last receiver held / returned the message.
#[derive(Clone, Copy)]
struct Completion {
    app: Instant,
    arrived: Option<SystemTime>,
}

/// A cluster with one sender (rank 0) and receiver threads on ranks 1..=n.
pub struct BcastHarness {
    guard: Option<ClusterGuard>,
    group: Group,
    stop: Arc<AtomicBool>,
    done_rx: Mutex<Rx<Done>>,
    threads: Vec<JoinHandle<()>>,
}

impl BcastHarness {
    /// Creates a cluster of `receivers + 1` hosts named `name`.
    pub fn new(name: &str, receivers: usize) -> Result<BcastHarness> {
        BcastHarness::on_cluster(&ClusterSpec::new(name, receivers + 1))
    }

    /// Creates the cluster `spec` describes (host 0 sends).
    pub fn on_cluster(spec: &ClusterSpec) -> Result<BcastHarness> {
        let guard = ClusterGuard::up(spec)?;
        let group = guard.cluster.group.clone();
        BcastHarness::on_group(group, Some(guard))
    }

    /// Uses an existing group (rank 0 sends; every other member receives),
    /// e.g. members on loopback when namespaces cannot be made.
    pub fn on_group(group: Group, guard: Option<ClusterGuard>) -> Result<BcastHarness> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, done_rx) = channel();
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = channel::<Result<()>>();
        for m in group.members.iter().skip(1) {
            threads.push(spawn_receiver(&group, m.rank, Arc::clone(&stop), tx.clone(), ready_tx.clone())?);
        }
        let mut h = BcastHarness { guard, group, stop, done_rx: Mutex::new(done_rx), threads };
        for _ in 1..h.group.members.len() {
            match ready_rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::Timeout { ms: 10_000, what: "receivers to bind".into() }),
            }
        }
        h.threads.shrink_to_fit();
        Ok(h)
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Runs `f` with rank 0's broadcaster on a thread inside host 0.
    pub fn with_sender<T, F>(&self, choice: PathChoice, f: F) -> Result<T>
    where
        T: Send,
        F: FnOnce(&Self, &mut Broadcaster) -> Result<T> + Send,
    {
        let ns = self.group.members[0].netns.clone();
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Some(ns) = &ns {
                    netns::enter(ns)?;
                }
                let mut b = Broadcaster::new(&self.group, 0, choice)?;
                f(self, &mut b)
            })
            .join()
            .map_err(|_| Error::panicked("the sender thread"))?
        })
    }

    /// Waits until ranks `1..=n` completed message `seq`; checks bytes.
    /// Returns the last completion times, or None on timeout.
    fn wait(&self, seq: u32, n: usize, len: usize, hash: u64, timeout: Duration) -> Result<Option<Completion>> {
        let deadline = Instant::now() + timeout;
        let mut got = vec![false; n + 1];
        let mut count = 0;
        let mut last: Option<Completion> = None;
        while count < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = self
                .done_rx
                .lock()
                .map_err(|_| Error::panicked("a receiver thread holding the channel"))?
                .recv_timeout(left);
            match next {
                Ok(d) => {
                    if d.seq != seq || d.rank as usize > n || got[d.rank as usize] {
                        continue; // a late message of a lost iteration
                    }
                    if d.len != len || d.hash != hash {
                        return Err(Error::wrong(
                            "broadcast",
                            format!(
                            "rank {} received message {seq} with wrong bytes ({} bytes, hash {:x}; expected {len}, {hash:x})",
                            d.rank, d.len, d.hash
                        )));
                    }
                    got[d.rank as usize] = true;
                    count += 1;
                    last = Some(match last {
                        None => Completion { app: d.completed, arrived: d.arrived },
                        Some(l) => Completion {
                            app: l.app.max(d.completed),
                            arrived: l.arrived.zip(d.arrived).map(|(a, b)| a.max(b)),
                        },
                    });
                }
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::panicked("the receiver threads (they ended unexpectedly)"))
                }
            }
        }
        Ok(last)
    }

    /// Sends one message of `len` patterned bytes to ranks 1..=n over `path`
    /// and checks that every receiver got every byte.
    pub fn verify(&self, b: &mut Broadcaster, path: Path, n: usize, len: usize) -> Result<()> {
        b.use_path(path)?;
        let data: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
        let dests: Vec<u16> = (1..=n as u16).collect();
        let r = b.broadcast(&data, &dests)?;
        let timeout = Duration::from_secs(5) + Duration::from_micros((len as u64 * n as u64) / 20);
        match self.wait(r.seq, n, len, fnv1a(&data), timeout)? {
            Some(_) => Ok(()),
            None => Err(Error::Timeout {
                ms: timeout.as_millis() as u64,
                what: format!("all {n} receivers to get a {len}-byte message over the {path} path"),
            }),
        }
    }

    /// Broadcasts `data` to ranks 1..=n over the sender's current path and
    /// waits until every receiver holds every byte (hash checked).  Returns
    /// first send to the later of broadcast() returning and the last
    /// receiving application returning the message, or None if some receiver
    /// did not get it within `timeout`.
    pub fn deliver(&self, b: &mut Broadcaster, data: &[u8], n: usize, timeout: Duration) -> Result<Option<Duration>> {
        let dests: Vec<u16> = (1..=n as u16).collect();
        let t0 = Instant::now();
        let r = b.broadcast(data, &dests)?;
        let sent = Instant::now();
        Ok(self.wait(r.seq, n, data.len(), fnv1a(data), timeout)?.map(|c| c.app.max(sent).duration_since(t0)))
    }

    /// Timed broadcasts of `size`-byte packets (header included) to ranks
    /// 1..=n, alternating paths in blocks so drift hits both alike.
    pub fn measure(
        &self,
        b: &mut Broadcaster,
        paths: &[Path],
        n: usize,
        size: usize,
        iters: usize,
    ) -> Result<Vec<BcastRecord>> {
        let len = size.checked_sub(HDR_LEN).ok_or_else(|| {
            Error::setting(format!("size {size}"), format!("smaller than the {HDR_LEN}-byte kccl header"))
        })?;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + n) as u8).collect();
        let hash = fnv1a(&data);
        let dests: Vec<u16> = (1..=n as u16).collect();
        let warmup = (iters / 10).clamp(3, 50);
        let blocks = 4.min(iters.max(1));
        let mut lat: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
        let mut app_lat: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
        let mut cpu = vec![Duration::ZERO; paths.len()];
        let mut total_cpu = vec![Duration::ZERO; paths.len()];
        let mut dgrams = vec![0usize; paths.len()];
        let mut retx = vec![0usize; paths.len()];
        let mut confirm: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
        let mut lost = vec![0usize; paths.len()];
        for &p in paths {
            self.verify(b, p, n, len)?;
            b.use_path(p)?;
            for _ in 0..warmup {
                let r = b.broadcast(&data, &dests)?;
                self.wait(r.seq, n, len, hash, Duration::from_secs(1))?;
            }
        }
        for blk in 0..blocks {
            let per = iters / blocks + usize::from(blk < iters % blocks);
            for (pi, &p) in paths.iter().enumerate() {
                b.use_path(p)?;
                for _ in 0..per {
                    let proc0 = process_cpu_time();
                    let c0 = thread_cpu_time();
                    let t0 = Instant::now();
                    let t0_real = SystemTime::now();
                    let r = b.broadcast(&data, &dests)?;
                    cpu[pi] += thread_cpu_time() - c0;
                    dgrams[pi] += r.datagrams + r.fallback_copies + r.retransmit_datagrams;
                    retx[pi] += r.retransmitted;
                    confirm[pi].push(r.confirm_time.as_secs_f64() * 1e6);
                    match self.wait(r.seq, n, len, hash, Duration::from_secs(1))? {
                        Some(c) => {
                            app_lat[pi].push(c.app.saturating_duration_since(t0).as_secs_f64() * 1e6);
                            // Receive timestamps are always on for kccl receivers;
                            // without one the app time is the arrival bound.
                            let arrived = c.arrived.and_then(|a| a.duration_since(t0_real).ok());
                            lat[pi].push(arrived.unwrap_or(c.app.saturating_duration_since(t0)).as_secs_f64() * 1e6);
                        }
                        None => lost[pi] += 1,
                    }
                    total_cpu[pi] += process_cpu_time() - proc0;
                }
            }
        }
        Ok(paths
            .iter()
            .enumerate()
            .map(|(pi, &p)| {
                let l = &mut lat[pi];
                l.sort_by(f64::total_cmp);
                app_lat[pi].sort_by(f64::total_cmp);
                let a = &app_lat[pi];
                BcastRecord {
                    path: p,
                    receivers: n,
                    size,
                    iters,
                    p50_us: percentile(l, 50.0),
                    p99_us: percentile(l, 99.0),
                    mean_us: if l.is_empty() { f64::NAN } else { l.iter().sum::<f64>() / l.len() as f64 },
                    min_us: l.first().copied().unwrap_or(f64::NAN),
                    max_us: l.last().copied().unwrap_or(f64::NAN),
                    app_p50_us: percentile(a, 50.0),
                    app_p99_us: percentile(a, 99.0),
                    app_mean_us: if a.is_empty() { f64::NAN } else { a.iter().sum::<f64>() / a.len() as f64 },
                    sender_cpu_us: cpu[pi].as_secs_f64() * 1e6 / iters.max(1) as f64,
                    total_cpu_us: total_cpu[pi].as_secs_f64() * 1e6 / iters.max(1) as f64,
                    datagrams_per_op: dgrams[pi] as f64 / iters.max(1) as f64,
                    confirm_p50_us: {
                        let c = &mut confirm[pi];
                        c.sort_by(f64::total_cmp);
                        percentile(c, 50.0)
                    },
                    retransmitted_per_op: retx[pi] as f64 / iters.max(1) as f64,
                    lost: lost[pi],
                }
            })
            .collect())
    }
}

impl Drop for BcastHarness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The guard tears the cluster down after every socket is closed.
        self.guard.take();
    }
}

fn spawn_receiver(
    group: &Group,
    rank: u16,
    stop: Arc<AtomicBool>,
    tx: Tx<Done>,
    ready: Tx<Result<()>>,
) -> Result<JoinHandle<()>> {
    let group = group.clone();
    std::thread::Builder::new()
        .name(format!("kccl-recv-{rank}"))
        .spawn(move || {
            let setup = || -> Result<Receiver> {
                if let Some(ns) = group.member(rank.into())?.netns.as_deref() {
                    netns::enter(ns)?;
                }
                Ok(Receiver::new(&group, rank)?)
            };
            let mut r = match setup() {
                Ok(r) => {
                    let _ = ready.send(Ok(()));
                    r
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            while !stop.load(Ordering::Relaxed) {
                match r.recv(Some(Duration::from_millis(100))) {
                    Ok(m) => {
                        let d = Done {
                            rank,
                            seq: m.seq,
                            len: m.data.len(),
                            hash: fnv1a(&m.data),
                            completed: m.completed,
                            arrived: m.arrived,
                        };
                        if tx.send(d).is_err() {
                            return;
                        }
                    }
                    Err(kccl::Error::Timeout { .. }) => {}
                    Err(e) => {
                        crate::errln!("kccl: receiver {rank}: {e}");
                        return;
                    }
                }
            }
        })
        .map_err(|e| Error::io("spawning a receiver thread", e))
}

/// What the latency columns of [`print_rows`] measure, from the first send.
pub const BCAST_LEGEND: &str =
    "   in-kernel: until the last receiver's kernel had every datagram; delivered: until the last\n   \
     receiving program had the message; acked: until every receiver's acknowledgment reached the sender.";

/// Prints broadcast rows of one point and, with both paths, their ratios.
pub fn print_rows(rows: &[BcastRecord]) {
    let k = rows.iter().find(|r| r.path == Path::Kernel);
    let u = rows.iter().find(|r| r.path == Path::User);
    for r in rows {
        crate::outln!(
            "  {:<6} recv={:<3} size={:<5} in-kernel p50={:>7.1}us p99={:>7.1}us | delivered p50={:>7.1}us p99={:>7.1}us | sender cpu={:>6.1}us total cpu={:>6.1}us | acked p50={:>7.1}us re-sent={:.2} lost={}",
            r.path.to_string(),
            r.receivers,
            r.size,
            r.p50_us,
            r.p99_us,
            r.app_p50_us,
            r.app_p99_us,
            r.sender_cpu_us,
            r.total_cpu_us,
            r.confirm_p50_us,
            r.retransmitted_per_op,
            r.lost
        );
    }
    if let (Some(k), Some(u)) = (k, u) {
        crate::outln!(
            "  ratio kernel/user: in-kernel p50 {} p99 {} | delivered p50 {} p99 {} | sender cpu {}",
            super::agg::ratio(k.p50_us, u.p50_us, "us"),
            super::agg::ratio(k.p99_us, u.p99_us, "us"),
            super::agg::ratio(k.app_p50_us, u.app_p50_us, "us"),
            super::agg::ratio(k.app_p99_us, u.app_p99_us, "us"),
            super::agg::ratio(k.sender_cpu_us, u.sender_cpu_us, "us")
        );
    }
}
