//! `kccl broadcast`, `kccl receive` and `kccl bench broadcast`: the
//! broadcast sender and receiver of one member, and the benchmark of both
//! paths on a virtual cluster.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use kccl::bcast::{Broadcaster, Receiver, Reliability};
use kccl::group::parse_ranks;
use kccl::transport::{Path, PathChoice};
use kccl_testbed::bench::{write_outputs, BcastHarness, BcastRecord};
use kccl_testbed::cluster;

use crate::error::{Error, Result};
use crate::member_args::{member_setup, MemberArgs};

#[derive(Args)]
pub struct BroadcastArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// Destination ranks: "1-9", "1,3,5" or "all".
    #[arg(long)]
    to: String,
    /// File to send, or - for stdin.
    input: String,
    /// Fail if a receiver has not confirmed the whole message after this many seconds.
    #[arg(long, default_value_t = 10.0)]
    deadline: f64,
    /// Retransmission timeout in milliseconds (probe of a silent receiver; doubles up to 16x).
    #[arg(long, default_value_t = 20.0)]
    rto_ms: f64,
    /// Fire-and-forget: do not wait for acknowledgments (plain UDP receivers).
    #[arg(long)]
    no_ack: bool,
}

#[derive(Args)]
pub struct ReceiveArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// Acknowledge every N packets (group acknowledgment), 1..=8192.
    #[arg(long, default_value_t = 1024)]
    ack_group: u32,
    /// Acknowledge every packet instead of every group.
    #[arg(long)]
    ack_per_packet: bool,
    /// Report a gap in a message after it persisted this many milliseconds.
    #[arg(long, default_value_t = 2.0)]
    nak_delay_ms: f64,
    /// Send no acknowledgments (for fire-and-forget senders).
    #[arg(long)]
    no_ack: bool,
    /// Number of messages to receive before exiting (default: run until interrupted).
    #[arg(long)]
    count: Option<u64>,
    /// Write messages here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Give up after this many seconds without a complete message.
    #[arg(long)]
    timeout: Option<f64>,
}

#[derive(Args)]
pub struct BenchBroadcastArgs {
    #[arg(long, default_value = "1,3,5,7,9", value_delimiter = ',')]
    receivers: Vec<usize>,
    /// UDP payload bytes per packet (kccl header included), 41..=1472.
    #[arg(long, default_value = "64,256,512,1024,1472", value_delimiter = ',')]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 1000)]
    iters: usize,
    #[arg(long, default_value = "bench-broadcast.json")]
    json: PathBuf,
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Fast run for CI: few iterations, a few points.
    #[arg(long)]
    smoke: bool,
}

pub fn broadcast(a: BroadcastArgs) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    let ranks = parse_ranks(&a.to, &group, rank)?;
    let dests = group.destinations(rank, &ranks)?;
    let mut data = Vec::new();
    if a.input == "-" {
        std::io::stdin().read_to_end(&mut data).map_err(|e| Error::io("reading stdin", e))?;
    } else {
        data = std::fs::read(&a.input).map_err(|e| Error::io(format!("reading {}", a.input), e))?;
    }
    let mut b = Broadcaster::new(&group, rank, choice)?;
    eprintln!("kccl: {}", b.path_reason());
    let secs = |what: &str, v: f64| -> Result<Duration> {
        Duration::try_from_secs_f64(v)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| Error::Usage(format!("--{what} {v}: must be a positive number")))
    };
    let rto = secs("rto-ms", a.rto_ms / 1000.0)?;
    b.set_reliability(Reliability {
        enabled: !a.no_ack,
        rto,
        rto_max: rto * 16,
        deadline: secs("deadline", a.deadline)?,
        ..Reliability::default()
    })?;
    let r = b.broadcast(&data, &dests)?;
    eprintln!(
        "kccl: sent {} bytes as message {} to {} ranks over the {} path ({} datagrams from user space, {} fallback copies)",
        data.len(),
        r.seq,
        dests.len(),
        r.path,
        r.datagrams,
        r.fallback_copies
    );
    if !a.no_ack {
        eprintln!(
            "kccl: every receiver confirmed after {:.1} ms ({} acknowledgments, {} packet copies re-sent, {} timeouts)",
            r.confirm_time.as_secs_f64() * 1e3,
            r.acks,
            r.retransmitted,
            r.timeouts
        );
    }
    if let Some(f) = b.fanout() {
        let s = f.stats()?;
        if s.missed > 0 {
            eprintln!("kccl: the kernel fan-out left {} copies to user space (unresolved neighbours)", s.missed);
        }
    }
    Ok(())
}

pub fn receive(a: ReceiveArgs) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    if choice == PathChoice::Kernel {
        eprintln!("kccl: receivers use an ordinary UDP socket on both paths");
    }
    let mut r = Receiver::new(&group, rank)?;
    let nak = Duration::try_from_secs_f64(a.nak_delay_ms / 1000.0)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Error::Usage(format!("--nak-delay-ms {}: must be a positive number", a.nak_delay_ms)))?;
    r.set_reliability(Reliability {
        enabled: !a.no_ack,
        ack_group: a.ack_group,
        per_packet: a.ack_per_packet,
        nak_delay: nak,
        ..Reliability::default()
    })?;
    let mut out: Box<dyn Write> = match &a.out {
        Some(p) => Box::new(std::fs::File::create(p).map_err(|e| Error::io(format!("creating {}", p.display()), e))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let timeout = a.timeout.map(Duration::from_secs_f64);
    let mut n = 0u64;
    while a.count.is_none_or(|c| n < c) {
        let m = match r.recv(timeout) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("kccl: receive counters: {}", serde_json::to_string(&r.stats()).unwrap_or_default());
                return Err(e.into());
            }
        };
        out.write_all(&m.data).map_err(|e| Error::io("writing received data", e))?;
        out.flush().map_err(|e| Error::io("writing received data", e))?;
        eprintln!("kccl: message {} from rank {}: {} bytes", m.seq, m.src_rank, m.data.len());
        n += 1;
    }
    // Keep acknowledging for a moment: the sender may still be waiting for
    // a lost acknowledgment of the last message.
    let linger = Instant::now() + Duration::from_millis(200);
    while !a.no_ack && Instant::now() < linger {
        if let Ok(m) = r.recv(Some(linger.saturating_duration_since(Instant::now()))) {
            eprintln!("kccl: message {} from rank {} after --count: not written", m.seq, m.src_rank);
        }
    }
    let s = r.stats();
    if s.dropped() + s.evicted + s.duplicates + s.after_complete > 0 {
        eprintln!("kccl: receive counters: {}", serde_json::to_string(&s).unwrap_or_default());
    }
    Ok(())
}

pub fn bench_broadcast(mut a: BenchBroadcastArgs) -> Result<()> {
    if a.smoke {
        a.receivers = vec![1, 3];
        a.sizes = vec![64, 1472];
        a.iters = 50;
    }
    if let Some(&bad) =
        a.sizes.iter().find(|&&s| !(kccl::wire::HDR_LEN + 1..=kccl::wire::MAX_UDP_PAYLOAD_1500).contains(&s))
    {
        return Err(Error::Usage(format!(
            "size {bad}: sizes are UDP payload bytes per packet, {}..={}",
            kccl::wire::HDR_LEN + 1,
            kccl::wire::MAX_UDP_PAYLOAD_1500
        )));
    }
    let max = a.receivers.iter().copied().max().unwrap_or(1).max(1);
    let h = BcastHarness::new(&cluster::unique_name("bench"), max)?;
    println!("{}", kccl_testbed::bench::BCAST_LEGEND);
    let records: Vec<BcastRecord> = h.with_sender(PathChoice::Kernel, |h, b| {
        let mut all = Vec::new();
        for &size in &a.sizes {
            for &n in &a.receivers {
                let rows = h.measure(b, &[Path::Kernel, Path::User], n, size, a.iters)?;
                kccl_testbed::bench::print_rows(&rows);
                all.extend(rows);
            }
        }
        Ok(all)
    })?;
    drop(h);
    write_outputs(&records, &a.json, a.plot.as_deref(), "broadcast")?;
    println!(
        "wrote {}{}",
        a.json.display(),
        a.plot.as_ref().map(|p| format!(" and {}", p.display())).unwrap_or_default()
    );
    Ok(())
}
