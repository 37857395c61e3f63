//! `kccl sg-worker` and `kccl scatter`: scatter-gather from the command line
//! (docs/SCATTER_GATHER.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use kccl::group::parse_ranks;
use kccl::sg::{self, Combine, Coordinator, Elem, Gathered, Policy, Request, Spec, Value, Worker};

use crate::error::{Error, Result};
use crate::member_args::{member_setup, MemberArgs};
use crate::signals;

#[derive(Args)]
pub struct SgWorkerArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// What to answer: `vector:N` (N int32 elements derived from the request
    /// and this rank: `kccl scatter --check` knows them) or `echo` (the
    /// request's bytes).
    #[arg(long, default_value = "vector:363")]
    reply: String,
    /// Stop after this many seconds (default: at SIGINT/SIGTERM).
    #[arg(long)]
    seconds: Option<f64>,
}

#[derive(Args)]
pub struct ScatterArgs {
    #[command(flatten)]
    member: MemberArgs,
    /// Workers: "1-9", "1,3,5" or "all" (every other member).
    #[arg(long, default_value = "all")]
    to: String,
    /// Completion: all, any, or n:<count> (the first count replies).
    #[arg(long, default_value = "all")]
    policy: String,
    /// Seconds after which a request ends with the replies that came.
    #[arg(long, default_value_t = 1.0)]
    deadline: f64,
    /// sum, min, max, count, or concat (replies side by side).
    #[arg(long, default_value = "sum")]
    combine: String,
    /// Element type of the replies: i32, i64, or bytes (concat only).
    #[arg(long, default_value = "i32")]
    elem: String,
    /// The request's bytes, as text.
    #[arg(long, default_value = "")]
    request: String,
    /// Requests to issue, one after the other (request i carries the text
    /// followed by " #i" when count > 1).
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Check every result against what `sg-worker --reply vector:N` answers
    /// (sum of int32 vectors of N elements).
    #[arg(long)]
    check: Option<usize>,
    /// Write the last result to this file: one element per line, or for
    /// concat one "rank<TAB>reply" line per worker.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the coordinator's counters at the end.
    #[arg(long)]
    stats: bool,
}

/// What `sg-worker` answers a request with.
type Handler = Box<dyn FnMut(&Request<'_>) -> Vec<u8>>;

/// The handler `--reply` names.
fn reply_maker(spec: &str, rank: u16) -> Result<Handler> {
    if spec == "echo" {
        return Ok(Box::new(|req: &Request<'_>| req.body.to_vec()));
    }
    let n = spec
        .strip_prefix("vector:")
        .and_then(|n| n.parse::<usize>().ok())
        .ok_or_else(|| Error::Usage(format!("--reply {spec}: use vector:<elements> or echo")))?;
    Ok(Box::new(move |req: &Request<'_>| sg::encode_i32(&sg::sample_vector(rank, req.body, n))))
}

pub fn worker(a: SgWorkerArgs) -> Result<()> {
    let (group, rank, _) = member_setup(&a.member)?;
    let mut handler = reply_maker(&a.reply, rank)?;
    let until = match a.seconds {
        Some(s) => Some(
            Instant::now()
                + Duration::try_from_secs_f64(s).map_err(|_| Error::Usage(format!("--seconds {s}: not a duration")))?,
        ),
        None => None,
    };
    let mut w = Worker::new(&group, rank)?;
    signals::stop_on_signals()?;
    eprintln!(
        "kccl: scatter-gather worker rank {rank} of '{}' answering ({}); an ordinary UDP socket",
        group.name, a.reply
    );
    while !signals::stop_requested() && until.is_none_or(|u| Instant::now() < u) {
        w.serve_batch(&mut handler, Duration::from_millis(50))?;
    }
    let s = w.stats();
    eprintln!(
        "kccl: worker rank {rank}: {} requests answered, {} repeats from the cache, {} reply datagrams, {} foreign and {} malformed packets dropped",
        s.requests, s.repeats, s.datagrams, s.foreign, s.malformed
    );
    Ok(())
}

pub fn scatter(a: ScatterArgs) -> Result<()> {
    let (group, rank, choice) = member_setup(&a.member)?;
    let workers: Vec<u16> = group.destinations(rank, &parse_ranks(&a.to, &group, rank)?)?;
    let deadline = Duration::try_from_secs_f64(a.deadline)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Error::Usage(format!("--deadline {}: must be a positive number of seconds", a.deadline)))?;
    let spec = Spec {
        policy: a.policy.parse::<Policy>()?,
        deadline,
        combine: a.combine.parse::<Combine>()?,
        elem: a.elem.parse::<Elem>()?,
    };
    if a.check.is_some() && (spec.combine, spec.elem) != (Combine::Sum, Elem::I32) {
        return Err(Error::Usage("--check needs --combine sum --elem i32 (the vector workers' sum)".into()));
    }
    let mut c = Coordinator::new(&group, rank, choice)?;
    eprintln!("kccl: {}", c.path_reason());
    let mut last = None;
    let mut times = Vec::with_capacity(a.count);
    for i in 0..a.count {
        let body = if a.count > 1 { format!("{} #{i}", a.request) } else { a.request.clone() };
        let got = c.scatter(body.as_bytes(), &workers, spec)?;
        if let Some(n) = a.check {
            let want = sg::sample_sum(&got.answered, body.as_bytes(), n)?;
            if got.value != Value::I32(want) {
                return Err(Error::Usage(format!(
                    "request {}: the result is not the sum of the answering workers' vectors (check failed)",
                    got.id
                )));
            }
        }
        times.push(got.elapsed);
        last = Some(got);
    }
    let Some(got) = last else { return Ok(()) };
    print_result(&got);
    if a.count > 1 {
        times.sort_unstable();
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
        println!("{} requests: latency p50 {:.0} us, p99 {:.0} us", a.count, at(0.5), at(0.99));
    }
    if a.check.is_some() {
        println!("check: every result is the exact sum of the answering workers' vectors");
    }
    if let Some(path) = &a.out {
        std::fs::write(path, render(&got.value))
            .map_err(|e| kccl::Error::io(format!("writing {}", path.display()), e))?;
    }
    if a.stats {
        println!("{}", serde_json::to_string(&c.stats()).expect("plain counters serialize"));
        if let Some(k) = c.kernel_stats()? {
            println!("xdp_sg: {}", serde_json::to_string(&k).expect("plain counters serialize"));
        }
    }
    Ok(())
}

fn print_result(g: &Gathered) {
    let outcome = match g.outcome {
        sg::Outcome::Complete => "complete",
        sg::Outcome::Deadline => "ended by its deadline",
        sg::Outcome::Exhausted => "ended: no worker left to wait for",
    };
    println!(
        "request {}: {outcome} after {:.3} ms; answered {:?}; missing {:?}; re-requests {}",
        g.id,
        g.elapsed.as_secs_f64() * 1e3,
        g.answered,
        g.missing,
        g.re_requests
    );
    for (r, why) in &g.refused {
        println!("  rank {r} refused: {why}");
    }
    match &g.value {
        Value::I32(v) => {
            println!("  {} int32: {:?}{}", v.len(), &v[..v.len().min(8)], if v.len() > 8 { " ..." } else { "" })
        }
        Value::I64(v) => {
            println!("  {} int64: {:?}{}", v.len(), &v[..v.len().min(8)], if v.len() > 8 { " ..." } else { "" })
        }
        Value::Replies(rs) => {
            for (r, b) in rs {
                println!("  rank {r}: {} bytes: {}", b.len(), String::from_utf8_lossy(&b[..b.len().min(64)]));
            }
        }
    }
}

fn render(v: &Value) -> Vec<u8> {
    match v {
        Value::I32(v) => v.iter().map(|x| format!("{x}\n")).collect::<String>().into_bytes(),
        Value::I64(v) => v.iter().map(|x| format!("{x}\n")).collect::<String>().into_bytes(),
        Value::Replies(rs) => {
            let mut out = Vec::new();
            for (r, b) in rs {
                out.extend_from_slice(format!("{r}\t").as_bytes());
                out.extend_from_slice(b);
                out.push(b'\n');
            }
            out
        }
    }
}
