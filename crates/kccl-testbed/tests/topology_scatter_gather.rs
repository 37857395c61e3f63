//! Scatter-gather on a virtual cluster: the coordinator on the kernel path
//! (xdp_sg on its eth0 combines the replies) and on the user path, checked
//! request by request against the sums computed here from the workers'
//! deterministic replies.
//!
//! ```text
//!   coordinator (rank 0)                        workers (ranks 1..N)
//!  netns kccl-<name>-h0                        netns kccl-<name>-h1 .. -hN
//!  +------------------------------+  request   +----------------------------+
//!  | Coordinator (kernel or user) | ---------> | sg::Worker (UDP server)    |
//!  |  xdp_sg on eth0: replies     | <--------- |  reply: sample_vector(rank)|
//!  |  combined per request slot   |   replies  | eth0 [tc_fault egress]     |
//!  | eth0 [tc_fault egress]       |            +-------------|--------------+
//!  +-------------|----------------+                          |
//!  +-------------h0------------------------------------------h1 .. hN-----+
//!  |                     br0 (netns kccl-<name>-sw)                       |
//!  +----------------------------------------------------------------------+
//! ```
//!
//! Per request: the outcome, who answered, who is missing or refused, and
//! the value, bit-exact.  Per host: the coordinator's counters (every
//! eligible request combined in the kernel, no reply bypassing it) and the
//! kernel's (every reply combined once).  Without root each test prints
//! `SKIPPED <test>: needs root`.
//!
//! Run: `cargo test --release -p kccl-testbed --test topology_scatter_gather -- --test-threads=1 --nocapture`

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kccl::fault::{self, FaultConfig};
use kccl::group::Group;
use kccl::netns;
use kccl::sg::{
    encode_i32, sample_sum, sample_vector, Combine, Coordinator, Elem, Gathered, Outcome, Policy, Request, Spec, Value,
    Worker,
};
use kccl::transport::{Path, PathChoice};
use kccl_testbed::cluster::{self, ClusterGuard, ClusterSpec};

#[path = "../../kccl/tests/support/mod.rs"]
mod support;
use support::root_or_skip;

/// Elements of a reply (a vector the kernel combines: <= 1024).
const LEN: usize = 363;
/// Elements of a reply to a request whose body starts with "long": more
/// than the kernel combines.
const LONG: usize = 2000;

/// A cluster of `hosts` hosts; rank i lives in host i.
struct Topo {
    guard: ClusterGuard,
}

impl Topo {
    fn up(prefix: &str, hosts: usize) -> Topo {
        let name = cluster::unique_name(prefix);
        let guard = ClusterGuard::up(&ClusterSpec::new(&name, hosts)).expect("cluster up");
        Topo { guard }
    }

    fn group(&self) -> &Group {
        &self.guard.cluster.group
    }

    fn ns(&self, rank: u16) -> String {
        cluster::host_netns(&self.guard.cluster.name, rank.into())
    }
}

/// What every worker answers: its sample vector of the request's body.
fn answer(rank: u16, req: &Request<'_>) -> Vec<u8> {
    let n = if req.body.starts_with(b"long") { LONG } else { LEN };
    encode_i32(&sample_vector(rank, req.body, n))
}

/// Worker threads, each in its rank's namespace, until dropped.
struct Workers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    fn start(t: &Topo, ranks: &[u16]) -> Workers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = ranks
            .iter()
            .map(|&r| {
                let (g, ns, stop) = (t.group().clone(), t.ns(r), stop.clone());
                let (tx, rx) = std::sync::mpsc::channel();
                let h = std::thread::spawn(move || {
                    netns::enter(&ns).unwrap_or_else(|e| panic!("entering {ns}: {e}"));
                    let mut w = Worker::new(&g, r).unwrap_or_else(|e| panic!("worker {r} binds: {e}"));
                    tx.send(()).expect("the test waits");
                    w.serve(|req| answer(r, req), &stop, None).unwrap_or_else(|e| panic!("worker {r}: {e}"));
                });
                // Bound before any request goes out.
                rx.recv().unwrap_or_else(|_| panic!("worker {r} did not start"));
                h
            })
            .collect();
        Workers { stop, threads }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Runs `f` with a coordinator of rank 0 on `choice`, on a thread inside
/// rank 0's namespace.
fn with_coordinator<T: Send>(t: &Topo, choice: PathChoice, f: impl FnOnce(&mut Coordinator) -> T + Send) -> T {
    let ns = t.ns(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            netns::enter(&ns).unwrap_or_else(|e| panic!("entering {ns}: {e}"));
            let mut c = Coordinator::new(t.group(), 0, choice).unwrap_or_else(|e| panic!("coordinator: {e}"));
            println!("coordinator: {}", c.path_reason());
            if choice == PathChoice::Kernel {
                assert_eq!(c.path(), Path::Kernel);
            }
            f(&mut c)
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// The sum the answered workers' replies make.
fn want(g: &Gathered, body: &[u8]) -> Value {
    Value::I32(sample_sum(&g.answered, body, LEN).expect("fits int32"))
}

fn spec(policy: Policy, deadline: Duration) -> Spec {
    Spec { policy, deadline, combine: Combine::Sum, elem: Elem::I32 }
}

/// Checks one result of a request to `workers` with `body`.
fn check(g: &Gathered, body: &[u8], policy: Policy, workers: &[u16]) {
    assert_eq!(g.outcome, Outcome::Complete, "request {}: {g:?}", g.id);
    let need = match policy {
        Policy::All => workers.len(),
        Policy::Any => 1,
        Policy::AtLeast(n) => n,
    };
    assert!(g.answered.len() >= need, "request {}: {} answered, {need} needed", g.id, g.answered.len());
    assert!(g.answered.iter().all(|w| workers.contains(w)), "request {}: answered {:?}", g.id, g.answered);
    assert!(g.refused.is_empty(), "request {}: refused {:?}", g.id, g.refused);
    assert_eq!(g.value, want(g, body), "request {} ({:?})", g.id, String::from_utf8_lossy(body));
}

/// Sequential requests by policy, then `burst` requests in flight at once;
/// returns every result by body.
fn workload(c: &mut Coordinator, workers: &[u16], burst: usize) -> BTreeMap<String, Gathered> {
    let mut out = BTreeMap::new();
    for (policy, n) in [(Policy::All, 20), (Policy::Any, 10), (Policy::AtLeast(3), 10)] {
        for i in 0..n {
            let body = format!("{policy:?} {i}");
            let g = c
                .scatter(body.as_bytes(), workers, spec(policy, Duration::from_secs(5)))
                .unwrap_or_else(|e| panic!("{body}: {e}"));
            check(&g, body.as_bytes(), policy, workers);
            out.insert(body, g);
        }
    }
    let mut ids = BTreeMap::new();
    for i in 0..burst {
        let body = format!("burst {i}");
        let id = c.submit(body.as_bytes(), workers, spec(Policy::All, Duration::from_secs(10))).expect("submits");
        ids.insert(id, body);
    }
    let t0 = Instant::now();
    while !ids.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(30), "{} requests of the burst never ended", ids.len());
        for (id, r) in c.poll(Some(Duration::from_secs(1))).expect("polls") {
            let body = ids.remove(&id).unwrap_or_else(|| panic!("request {id} ended twice or was never sent"));
            let g = r.unwrap_or_else(|e| panic!("{body}: {e}"));
            check(&g, body.as_bytes(), Policy::All, workers);
            out.insert(body, g);
        }
    }
    out
}

#[test]
fn a_kernel_path_matches_the_user_path() {
    if !root_or_skip("a_kernel_path_matches_the_user_path", "namespaces and XDP") {
        return;
    }
    let t = Topo::up("sga", 9);
    let workers: Vec<u16> = (1..9).collect();
    let _w = Workers::start(&t, &workers);
    let burst = 300;
    let (kernel, ks, kstats) = with_coordinator(&t, PathChoice::Kernel, |c| {
        let got = workload(c, &workers, burst);
        (got, c.stats(), c.kernel_stats().expect("kernel counters").expect("kernel path"))
    });
    let requests = 40 + burst as u64;
    println!("kernel path: {ks:?}\nxdp_sg: {kstats:?}");
    assert_eq!((ks.requests, ks.in_kernel, ks.complete, ks.bypassed), (requests, requests, requests, 0));
    assert_eq!(kstats.completed, requests, "every request met its policy in the kernel");
    assert_eq!(kstats.opened, requests);
    assert_eq!(kstats.closed, requests);
    assert_eq!((kstats.malformed, kstats.not_member, kstats.mismatch, kstats.too_long), (0, 0, 0, 0));
    // Replies to a request that was already DONE (policies any, n:3) are late.
    let answered: u64 = kernel.values().map(|g| g.answered.len() as u64).sum();
    assert_eq!(kstats.combined, answered, "each answered reply combined once");

    let (user, us) = with_coordinator(&t, PathChoice::User, |c| (workload(c, &workers, burst), c.stats()));
    assert_eq!((us.in_kernel, us.complete), (0, requests));
    for (body, g) in &kernel {
        let u = &user[body];
        if u.answered == g.answered {
            assert_eq!(u.value, g.value, "{body}: the paths disagree");
        }
    }
}

#[test]
fn b_kernel_path_dead_worker_long_replies_and_concat() {
    if !root_or_skip("b_kernel_path_dead_worker_long_replies_and_concat", "namespaces and XDP") {
        return;
    }
    let t = Topo::up("sgb", 6);
    let live: Vec<u16> = (1..5).collect();
    let all: Vec<u16> = (1..6).collect(); // rank 5 runs no worker
    let _w = Workers::start(&t, &live);
    with_coordinator(&t, PathChoice::Kernel, |c| {
        // Waiting for all: the deadline ends it, rank 5 named, the others'
        // sum exact, rank 5 asked again (only it) while it waited.
        let g = c.scatter(b"dead", &all, spec(Policy::All, Duration::from_millis(400))).expect("gathers");
        assert_eq!(g.outcome, Outcome::Deadline, "{g:?}");
        assert_eq!((g.answered.clone(), g.missing.clone()), (live.clone(), vec![5]));
        assert_eq!(g.value, want(&g, b"dead"));
        assert!(g.re_requests > 0, "rank 5 was never asked again: {g:?}");

        // Four of five: complete without rank 5.
        let g = c.scatter(b"four", &all, spec(Policy::AtLeast(4), Duration::from_secs(5))).expect("gathers");
        check(&g, b"four", Policy::AtLeast(4), &all);
        assert_eq!(g.answered, live);

        // Replies longer than the kernel combines: every worker refused
        // with the reason, and the request ends as soon as nothing more
        // can come (the timer reads the slot), long before its deadline.
        let g = c.scatter(b"long", &live, spec(Policy::All, Duration::from_secs(20))).expect("gathers");
        assert_eq!(g.outcome, Outcome::Exhausted, "{g:?}");
        assert!(g.elapsed < Duration::from_secs(5), "exhaustion found after {:?}", g.elapsed);
        assert_eq!(g.refused.iter().map(|(r, _)| *r).collect::<Vec<_>>(), live);
        assert!(g.refused[0].1.contains("1024 elements"), "{}", g.refused[0].1);

        // CONCAT stays on the user path of the same coordinator.
        let before = c.stats().in_kernel;
        let s = Spec { combine: Combine::Concat, elem: Elem::Bytes, ..spec(Policy::All, Duration::from_secs(5)) };
        let g = c.scatter(b"concat", &live, s).expect("gathers");
        let want: Vec<(u16, Vec<u8>)> =
            live.iter().map(|&r| (r, encode_i32(&sample_vector(r, b"concat", LEN)))).collect();
        assert_eq!(g.value, Value::Replies(want));
        assert_eq!(c.stats().in_kernel, before, "concat went through the kernel");

        let k = c.kernel_stats().expect("counters").expect("kernel path");
        println!("coordinator: {:?}\nxdp_sg: {k:?}", c.stats());
        assert!(k.too_long >= 4, "each worker's long reply refused (repeats count again): {}", k.too_long);
        assert_eq!(c.stats().bypassed, 0);
    });
}

/// 5% loss and 2% duplication on every host's egress (requests and
/// replies): every request still completes, exact.
fn lossy(test: &str, prefix: &str, choice: PathChoice) {
    if !root_or_skip(test, "namespaces, XDP and tc_fault") {
        return;
    }
    let t = Topo::up(prefix, 6);
    let workers: Vec<u16> = (1..6).collect();
    let seed = 0x5eed_5600 + u64::from(choice == PathChoice::User);
    println!("{test}: fault seed {seed}");
    let cfg = FaultConfig::from_fractions(0.05, 0.02, 0.0, seed).expect("a valid fault config");
    for r in 0..6 {
        fault::install(Some(&t.ns(r)), "eth0", &cfg).unwrap_or_else(|e| panic!("fault on rank {r}: {e}"));
    }
    let _w = Workers::start(&t, &workers);
    let (stats, re) = with_coordinator(&t, choice, |c| {
        let mut re = 0;
        for i in 0..150 {
            let body = format!("lossy {i}");
            let g = c
                .scatter(body.as_bytes(), &workers, spec(Policy::All, Duration::from_secs(10)))
                .unwrap_or_else(|e| panic!("{body}: {e}"));
            check(&g, body.as_bytes(), Policy::All, &workers);
            re += g.re_requests;
        }
        (c.stats(), re)
    });
    let dropped: u64 =
        (0..6).map(|r| fault::pinned_stats(Some(&t.ns(r)), "eth0").expect("fault counters").dropped).sum();
    println!("{test}: {stats:?}; {re} re-requests; {dropped} packets dropped by tc_fault");
    assert!(dropped > 0, "the fault injector dropped nothing");
    assert!(re > 0, "losses were repaired without asking again?");
    assert_eq!(stats.complete, 150);
}

#[test]
fn c_kernel_path_under_loss_and_duplication() {
    lossy("c_kernel_path_under_loss_and_duplication", "sgc", PathChoice::Kernel);
}

#[test]
fn d_user_path_under_loss_and_duplication() {
    lossy("d_user_path_under_loss_and_duplication", "sgd", PathChoice::User);
}
