//! BPF_PROG_TEST_RUN fixtures of the fault injector (bpf/tc_fault.bpf.c), a
//! statistical test of its loss probability and seed reproducibility, and the
//! pinned install/clear path of `kccl fault`.
//!
//! Harness (as in bpf_bcast_fixtures.rs): every fixture runs in its own network
//! namespace `kccl-ffx-<pid>-<n>` with a veth pair fxa/fxb (IPv6 off).  The
//! program is loaded and attached at TCX egress of fxa (so its marked clones
//! re-enter it, where the release clone is rewritten); each step is one BPF_PROG_TEST_RUN with
//! `__sk_buff.ifindex = fxa`, so bpf_clone_redirect() copies (duplicates,
//! the releasing packet and the released held packet) are really transmitted
//! on fxa and captured, in order, by an AF_PACKET socket on fxb.  A fixture is
//! a sequence of steps on one loaded injector (reordering needs two packets);
//! a step may first rewrite the configuration.  The runner prints `ok`/`FAIL`
//! per fixture and fails at the end with everything that differed.  Without
//! root each test prints `SKIPPED <test>: needs root` and returns.

use std::mem::{offset_of, size_of};
use std::process::Command;
use std::time::{Duration, Instant};

use kccl::error::is_root;
use kccl::fault::{self, Decision, FaultConfig, FaultInjector, FaultRng, FaultStats, PASS_MARK, RELEASE_MARK};
use kccl::netns;
use kccl::skel_fault::types::__sk_buff;

mod support;
use support::{inet_csum, our_namespaces, run, Capture, NetnsGuard};

/// tc_fault passes with TCX_NEXT (-1) so that later programs of the TCX chain still run.
const TCX_NEXT: u32 = u32::MAX;
const TC_ACT_SHOT: u32 = 2;
const MAGIC: u32 = 0x4b43_434c;

// ---------------------------------------------------------------------------
// Packets.

/// Ethernet/IPv4/UDP frame to 10.9.0.2:47002 with `payload` (UDP checksum 0).
fn udp_frame(payload: &[u8], ip_id: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00];
    let tot = 20 + 8 + payload.len();
    let mut ip = vec![0x45, 0, (tot >> 8) as u8, tot as u8, (ip_id >> 8) as u8, ip_id as u8, 0x40, 0, 64, 17, 0, 0];
    ip.extend_from_slice(&[10, 9, 0, 1, 10, 9, 0, 2]);
    let c = inet_csum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    let ulen = 8 + payload.len();
    f.extend_from_slice(&[0x9c, 0x40, 0xb7, 0x9a, (ulen >> 8) as u8, ulen as u8, 0, 0]);
    f.extend_from_slice(payload);
    f
}

/// A kccl frame (magic + 36 header bytes + `n` patterned bytes), tagged by `tag`.
fn kccl(tag: u8, n: usize) -> Vec<u8> {
    let mut p = MAGIC.to_be_bytes().to_vec();
    p.extend_from_slice(&[1, 1, 0, 0]);
    p.extend((0..32 + n).map(|i| (i as u8).wrapping_mul(7).wrapping_add(tag)));
    udp_frame(&p, 0x1000 + u16::from(tag))
}

fn not_kccl() -> Vec<u8> {
    udp_frame(b"just some UDP payload that is not kccl at all, 0123456789", 7)
}

fn arp() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x08, 0x06]);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1, 2, 0, 0, 0, 0, 1, 10, 9, 0, 1, 0, 0, 0, 0, 0, 0, 10, 9, 0, 2]);
    f.resize(60, 0);
    f
}

fn describe(f: &[u8]) -> String {
    let tag = if f.len() > 42 + 8 { format!(" tag-byte {:#04x}", f[42 + 8]) } else { String::new() };
    format!(
        "{} bytes ip_id {:#06x}{tag}",
        f.len(),
        f.get(18..20).map(|b| u16::from_be_bytes([b[0], b[1]])).unwrap_or(0)
    )
}

// ---------------------------------------------------------------------------
// Fixtures.

struct Step {
    /// Written before the packet (a new epoch).
    cfg: Option<FaultConfig>,
    input: Vec<u8>,
    mark: u32,
    /// skb gso_size: nonzero makes the input one GSO send of several
    /// datagrams (only the decision is tested; such a frame is never
    /// transmitted by a fixture).
    gso_size: u32,
    verdict: u32,
    /// Frames captured on fxb, in order.
    captured: Vec<Vec<u8>>,
}

struct Fixture {
    name: &'static str,
    cfg: FaultConfig,
    steps: Vec<Step>,
    stats: FaultStats,
}

fn cfg(loss: u32, dup: u32, reorder: u32) -> FaultConfig {
    FaultConfig { loss_ppm: loss, dup_ppm: dup, reorder_ppm: reorder, seed: 1 }
}

fn step(input: Vec<u8>, verdict: u32, captured: Vec<Vec<u8>>) -> Step {
    Step { cfg: None, input, mark: 0, gso_size: 0, verdict, captured }
}

fn st(seen: u64, dropped: u64, duplicated: u64, held: u64, released: u64, passed: u64) -> FaultStats {
    FaultStats { seen, dropped, duplicated, held, released, passed }
}

const ALL: u32 = fault::PPM;

fn fixtures() -> Vec<Fixture> {
    let (a, b, c) = (kccl(0xa0, 100), kccl(0xb0, 100), kccl(0xc0, 100));
    let zero = FaultStats::default();
    let mut v = vec![
        Fixture {
            name: "non-kccl UDP passes untouched under loss 100%",
            cfg: cfg(ALL, 0, 0),
            steps: vec![step(not_kccl(), TCX_NEXT, vec![])],
            stats: zero,
        },
        Fixture {
            name: "ARP passes untouched under loss 100%",
            cfg: cfg(ALL, 0, 0),
            steps: vec![step(arp(), TCX_NEXT, vec![])],
            stats: zero,
        },
        Fixture {
            name: "non-kccl UDP is never duplicated or held",
            cfg: cfg(0, ALL / 2, ALL / 2),
            steps: vec![step(not_kccl(), TCX_NEXT, vec![]), step(not_kccl(), TCX_NEXT, vec![])],
            stats: zero,
        },
        Fixture {
            name: "loss 100% drops kccl",
            cfg: cfg(ALL, 0, 0),
            steps: vec![step(a.clone(), TC_ACT_SHOT, vec![]), step(b.clone(), TC_ACT_SHOT, vec![])],
            stats: st(2, 2, 0, 0, 0, 0),
        },
        Fixture {
            name: "loss 0 passes kccl",
            cfg: cfg(0, 0, 0),
            steps: vec![step(a.clone(), TCX_NEXT, vec![]), step(b.clone(), TCX_NEXT, vec![])],
            stats: st(2, 0, 0, 0, 0, 2),
        },
        Fixture {
            name: "dup 100%: one captured copy equal to the input, original passes",
            cfg: cfg(0, ALL, 0),
            steps: vec![step(a.clone(), TCX_NEXT, vec![a.clone()])],
            stats: st(1, 0, 1, 0, 0, 1),
        },
        Fixture {
            name: "our pass mark passes untouched under loss 100%",
            cfg: cfg(ALL, 0, 0),
            steps: vec![Step { mark: PASS_MARK, ..step(a.clone(), TCX_NEXT, vec![]) }],
            stats: zero,
        },
        Fixture {
            name: "a release clone with nothing held is dropped",
            cfg: cfg(0, 0, 0),
            steps: vec![Step { mark: RELEASE_MARK, ..step(a.clone(), TC_ACT_SHOT, vec![]) }],
            stats: zero,
        },
        Fixture {
            name: "reorder: A held and dropped; B (reorder now 0) passes first, then A byte for byte",
            cfg: cfg(0, 0, ALL),
            steps: vec![
                step(a.clone(), TC_ACT_SHOT, vec![]),
                Step { cfg: Some(cfg(0, 0, 0)), ..step(b.clone(), TC_ACT_SHOT, vec![b.clone(), a.clone()]) },
                step(c.clone(), TCX_NEXT, vec![]),
            ],
            stats: st(3, 0, 0, 1, 1, 2),
        },
        Fixture {
            name: "reorder 100%: A held, B (slot full) passes and releases A, C held",
            cfg: cfg(0, 0, ALL),
            steps: vec![
                step(a.clone(), TC_ACT_SHOT, vec![]),
                step(b.clone(), TC_ACT_SHOT, vec![b.clone(), a.clone()]),
                step(c.clone(), TC_ACT_SHOT, vec![]),
            ],
            stats: st(3, 0, 0, 2, 1, 1),
        },
        Fixture {
            name: "reorder: held packet longer than the releasing one (tail grows)",
            cfg: cfg(0, 0, ALL),
            steps: vec![
                step(kccl(0xd0, 1400), TC_ACT_SHOT, vec![]),
                Step { cfg: Some(cfg(0, 0, 0)), ..step(b.clone(), TC_ACT_SHOT, vec![b.clone(), kccl(0xd0, 1400)]) },
            ],
            stats: st(2, 0, 0, 1, 1, 1),
        },
        Fixture {
            name: "reorder: held packet shorter than the releasing one (tail shrinks)",
            cfg: cfg(0, 0, ALL),
            steps: vec![
                step(kccl(0xe0, 0), TC_ACT_SHOT, vec![]),
                Step {
                    cfg: Some(cfg(0, 0, 0)),
                    ..step(kccl(0xf0, 900), TC_ACT_SHOT, vec![kccl(0xf0, 900), kccl(0xe0, 0)])
                },
            ],
            stats: st(2, 0, 0, 1, 1, 1),
        },
        Fixture {
            name: "a packet longer than the hold slot is never held",
            cfg: cfg(0, 0, ALL),
            steps: vec![step(kccl(0x11, 2100), TCX_NEXT, vec![])],
            stats: st(1, 0, 0, 0, 0, 1),
        },
        Fixture {
            name: "dup does not release a held packet; the next pass does",
            cfg: cfg(0, 0, ALL),
            steps: vec![
                step(a.clone(), TC_ACT_SHOT, vec![]),
                Step { cfg: Some(cfg(0, ALL, 0)), ..step(b.clone(), TCX_NEXT, vec![b.clone()]) },
                Step { cfg: Some(cfg(0, 0, 0)), ..step(c.clone(), TC_ACT_SHOT, vec![c.clone(), a.clone()]) },
            ],
            stats: st(3, 0, 1, 1, 1, 2),
        },
    ];
    // A GSO send (datagrams cut apart after the hook) is one decision:
    // dropped whole; never held (its bytes are not one datagram), and it
    // does not release a held packet (the replayed bytes would inherit the
    // clone's GSO state).
    let gso = |s: Step| Step { gso_size: 100, ..s };
    v.push(Fixture {
        name: "GSO send under loss 100% is dropped whole",
        cfg: cfg(ALL, 0, 0),
        steps: vec![gso(step(kccl(0x61, 300), TC_ACT_SHOT, vec![]))],
        stats: st(1, 1, 0, 0, 0, 0),
    });
    v.push(Fixture {
        name: "GSO send under reorder 100% passes, not held",
        cfg: cfg(0, 0, ALL),
        steps: vec![gso(step(kccl(0x62, 300), TCX_NEXT, vec![]))],
        stats: st(1, 0, 0, 0, 0, 1),
    });
    v.push(Fixture {
        name: "GSO send does not release a held packet; the next single datagram does",
        cfg: cfg(0, 0, ALL),
        steps: vec![
            step(a.clone(), TC_ACT_SHOT, vec![]),
            Step { cfg: Some(cfg(0, 0, 0)), ..gso(step(kccl(0x63, 300), TCX_NEXT, vec![])) },
            step(c.clone(), TC_ACT_SHOT, vec![c.clone(), a.clone()]),
        ],
        stats: st(3, 0, 0, 1, 1, 2),
    });
    // Not-kccl traffic does not release a held packet either.
    v.push(Fixture {
        name: "non-kccl traffic does not release a held packet",
        cfg: cfg(0, 0, ALL),
        steps: vec![step(a.clone(), TC_ACT_SHOT, vec![]), step(not_kccl(), TCX_NEXT, vec![])],
        stats: st(1, 0, 0, 1, 0, 0),
    });
    v
}

// ---------------------------------------------------------------------------
// Harness.

fn ctx_with(ifindex: u32, mark: u32, gso_size: u32) -> Vec<u8> {
    let mut ctx = vec![0u8; size_of::<__sk_buff>()];
    ctx[offset_of!(__sk_buff, gso_size)..][..4].copy_from_slice(&gso_size.to_ne_bytes());
    ctx[offset_of!(__sk_buff, ifindex)..][..4].copy_from_slice(&ifindex.to_ne_bytes());
    ctx[offset_of!(__sk_buff, mark)..][..4].copy_from_slice(&mark.to_ne_bytes());
    ctx
}

/// One BPF_PROG_TEST_RUN: (verdict, output bytes).
fn test_run(inj: &FaultInjector, input: &[u8], ifindex: u32, mark: u32, gso_size: u32) -> kccl::Result<(u32, Vec<u8>)> {
    let mut ctx_in = ctx_with(ifindex, mark, gso_size);
    let mut data_out = vec![0u8; input.len() + 4096];
    let out = inj
        .skel()
        .progs
        .kccl_tc_fault
        .test_run(libbpf_rs::ProgramInput {
            data_in: Some(input),
            data_out: Some(&mut data_out),
            context_in: Some(&mut ctx_in),
            ..Default::default()
        })
        .map_err(|e| kccl::Error::Bpf { step: "BPF_PROG_TEST_RUN of kccl_tc_fault".into(), source: e })?;
    Ok((out.return_value, out.data.map(|d| d.to_vec()).unwrap_or_default()))
}

struct StepResult {
    verdict: u32,
    output: Vec<u8>,
    captured: Vec<Vec<u8>>,
}

/// Runs inside the fixture's namespace.
fn observe(
    cfg: FaultConfig,
    steps: Vec<(Option<FaultConfig>, Vec<u8>, u32, u32)>,
) -> kccl::Result<(Vec<StepResult>, FaultStats)> {
    let fxa = netns::ifindex("fxa", None)?;
    let fxb = netns::ifindex("fxb", None)?;
    let mut inj = FaultInjector::load()?;
    inj.set_config(&cfg)?;
    // Attached too: the marked clones re-enter the program at fxa's egress
    // (the release clone is rewritten there; test_run alone would not).
    inj.attach(fxa)?;
    let cap = Capture::open(fxb)?;
    let stale = cap.drain(Duration::from_millis(20))?;
    if !stale.is_empty() {
        return Err(kccl::Error::Usage(format!("{} stray frame(s) on fxb before the run", stale.len())));
    }
    let before = inj.stats()?;
    let mut out = Vec::new();
    for (c, input, mark, gso_size) in steps {
        if let Some(c) = c {
            inj.set_config(&c)?;
        }
        let (verdict, output) = test_run(&inj, &input, fxa, mark, gso_size)?;
        let captured = cap.drain(Duration::from_millis(100))?;
        out.push(StepResult { verdict, output, captured });
    }
    Ok((out, inj.stats()?.delta(&before)))
}

fn run_fixture(n: usize, fx: &Fixture) -> Result<(), Vec<String>> {
    let ns = format!("kccl-ffx-{}-{n}", std::process::id());
    let _guard = NetnsGuard::up(ns.clone()).map_err(|e| vec![format!("namespace setup: {e}")])?;
    let steps: Vec<_> = fx.steps.iter().map(|s| (s.cfg, s.input.clone(), s.mark, s.gso_size)).collect();
    let cfg = fx.cfg;
    // One CPU for the whole fixture: the hold slot is per CPU.
    let (results, stats) = netns::run_in(Some(&ns), move || {
        pin_to_cpu(0);
        observe(cfg, steps)
    })
    .map_err(|e| vec![format!("run: {e}")])?;
    let mut errs = Vec::new();
    for (i, (s, r)) in fx.steps.iter().zip(&results).enumerate() {
        if r.verdict != s.verdict {
            errs.push(format!("step {i}: verdict {} (want {})", r.verdict, s.verdict));
        }
        if r.verdict == TCX_NEXT && r.output != s.input {
            errs.push(format!(
                "step {i}: passed packet modified: {} (input {})",
                describe(&r.output),
                describe(&s.input)
            ));
        }
        if r.captured != s.captured {
            errs.push(format!(
                "step {i}: captured [{}], want [{}]",
                r.captured.iter().map(|f| describe(f)).collect::<Vec<_>>().join(", "),
                s.captured.iter().map(|f| describe(f)).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    if stats != fx.stats {
        errs.push(format!("counter deltas {stats:?} (want {:?})", fx.stats));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one bit set; pid 0 is this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
            panic!("sched_setaffinity(cpu {cpu}): {}", std::io::Error::last_os_error());
        }
    }
}

#[test]
fn tc_fault_fixture_table() {
    if !is_root() {
        println!("SKIPPED tc_fault_fixture_table: needs root (BPF_PROG_TEST_RUN)");
        return;
    }
    let table = fixtures();
    let t0 = Instant::now();
    let mut failed = Vec::new();
    for (n, fx) in table.iter().enumerate() {
        let t = Instant::now();
        match run_fixture(n, fx) {
            Ok(()) => println!("ok   [{n:2}] {} ({:?})", fx.name, t.elapsed()),
            Err(errs) => {
                println!("FAIL [{n:2}] {}:", fx.name);
                for e in &errs {
                    println!("    - {e}");
                }
                failed.push(format!("[{n}] {}: {}", fx.name, errs.join("; ")));
            }
        }
    }
    println!("{} fixtures, {} failed, {:?}", table.len(), failed.len(), t0.elapsed());
    let left = our_namespaces("kccl-ffx-");
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    assert!(failed.is_empty(), "{} of {} fixtures failed:\n{}", failed.len(), table.len(), failed.join("\n"));
}

/// The decision sequence of `runs` packets under `cfg` (one CPU, loss only:
/// no copies are made, so no namespace is needed).
fn decisions(inj: &FaultInjector, cfg: &FaultConfig, runs: usize) -> kccl::Result<Vec<bool>> {
    inj.set_config(cfg)?;
    let pkt = kccl(0x42, 64);
    (0..runs).map(|_| test_run(inj, &pkt, 0, 0, 0).map(|(v, _)| v == TC_ACT_SHOT)).collect()
}

#[test]
fn tc_fault_loss_statistics_and_seed() {
    if !is_root() {
        println!("SKIPPED tc_fault_loss_statistics_and_seed: needs root (BPF_PROG_TEST_RUN)");
        return;
    }
    const RUNS: usize = 20_000;
    let seed: u64 = std::env::var("KCCL_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    println!("seed {seed} (rerun with KCCL_FAULT_SEED={seed})");
    let result = std::thread::spawn(move || -> kccl::Result<()> {
        pin_to_cpu(0);
        let inj = FaultInjector::load()?;
        let cfg = FaultConfig { loss_ppm: 100_000, dup_ppm: 0, reorder_ppm: 0, seed };
        let before = inj.stats()?;
        let first = decisions(&inj, &cfg, RUNS)?;
        let stats = inj.stats()?.delta(&before);
        let drops = first.iter().filter(|&&d| d).count();
        // Binomial(20000, 0.1): sd 42.4; +-250 is ~6 sd.
        println!("loss 10%: {drops} of {RUNS} dropped ({:.3}%)", drops as f64 * 100.0 / RUNS as f64);
        assert!((2000 - 250..=2000 + 250).contains(&drops), "seed {seed}: {drops} drops of {RUNS}");
        assert_eq!(
            stats,
            FaultStats {
                seen: RUNS as u64,
                dropped: drops as u64,
                passed: (RUNS - drops) as u64,
                ..Default::default()
            }
        );
        // Same seed (re-written: a new epoch re-seeds): the same sequence.
        let again = decisions(&inj, &cfg, RUNS)?;
        assert!(first == again, "seed {seed}: the same seed gave a different decision sequence");
        // The user-space reference model predicts it exactly (CPU 0).
        let mut model = FaultRng::new(seed, 0);
        let predicted: Vec<bool> = (0..RUNS).map(|_| model.decide(&cfg) == Decision::Drop).collect();
        let first_diff = first.iter().zip(&predicted).position(|(a, b)| a != b);
        assert!(first_diff.is_none(), "seed {seed}: program and FaultRng differ first at packet {first_diff:?}");
        // Another seed: another sequence.
        let other = decisions(&inj, &FaultConfig { seed: seed ^ 1, ..cfg }, RUNS)?;
        assert!(first != other, "seeds {seed} and {} gave the same sequence", seed ^ 1);
        Ok(())
    })
    .join()
    .expect("statistics thread panicked");
    result.expect("statistics run");
}

/// `kccl fault` persistence: install pins the link (fault survives the
/// loader), reconfiguring rewrites the pinned config, --clear detaches.
#[test]
fn tc_fault_pinned_install_and_clear() {
    if !is_root() {
        println!("SKIPPED tc_fault_pinned_install_and_clear: needs root (TCX attach, bpffs)");
        return;
    }
    let ns = format!("kccl-ffx-{}-pin", std::process::id());
    let _guard = NetnsGuard::up(ns.clone()).expect("namespace");
    /// Unpins on drop (also when an assertion fails).
    struct Unpin(String);
    impl Drop for Unpin {
        fn drop(&mut self) {
            let _ = fault::clear(Some(&self.0), "fxa");
        }
    }
    let _unpin = Unpin(ns.clone());
    let dir = fault::pin_dir(Some(&ns), "fxa");
    let cfg = FaultConfig { loss_ppm: fault::PPM, dup_ppm: 0, reorder_ppm: 0, seed: 3 };
    let got = fault::install(Some(&ns), "fxa", &cfg).expect("install");
    assert_eq!(got, dir);
    assert!(dir.join("link").exists() && dir.join("cfg").exists() && dir.join("stats").exists());
    // Attached (in the namespace, not in ours): the link is listed by bpftool.
    let out = Command::new("bpftool").args(["link", "show", "pinned", dir.join("link").to_str().unwrap()]).output();
    if let Ok(o) = out {
        let s = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "bpftool link show: {s}");
    }
    // Real traffic through the attached injector: kccl datagrams sent from
    // fxa are counted and dropped.
    send_kccl(&ns, 5).expect("sending kccl datagrams");
    let stats = fault::pinned_stats(Some(&ns), "fxa").expect("pinned stats");
    println!("pinned injector counters after 5 kccl datagrams at loss 100%: {stats:?}");
    assert_eq!((stats.seen, stats.dropped), (5, 5), "{stats:?}");
    // Reconfigure in place (no reload).
    fault::install(Some(&ns), "fxa", &FaultConfig { loss_ppm: 0, ..cfg }).expect("reconfigure");
    assert!(fault::clear(Some(&ns), "fxa").expect("clear"));
    assert!(!dir.exists());
    assert!(!fault::clear(Some(&ns), "fxa").expect("second clear"));
    assert!(fault::pinned_stats(Some(&ns), "fxa").is_err());
}

/// Sends `n` kccl datagrams out of fxa in `ns` (static neighbour, so they
/// leave at once).
fn send_kccl(ns: &str, n: usize) -> kccl::Result<()> {
    netns::run_in(Some(ns), move || {
        run_ok(&["ip", "addr", "replace", "10.77.0.1/24", "dev", "fxa"]);
        run_ok(&[
            "ip",
            "neigh",
            "replace",
            "10.77.0.9",
            "lladdr",
            "02:00:00:00:00:09",
            "dev",
            "fxa",
            "nud",
            "permanent",
        ]);
        let s = std::net::UdpSocket::bind("10.77.0.1:0").map_err(|e| kccl::Error::io("bind", e))?;
        let mut p = MAGIC.to_be_bytes().to_vec();
        p.resize(60, 0);
        for _ in 0..n {
            s.send_to(&p, "10.77.0.9:47000").map_err(|e| kccl::Error::io("send", e))?;
        }
        Ok(())
    })
}

/// A pin left behind by a namespace that was deleted (a torn-down cluster)
/// must not swallow the next install under the same name: reconfiguring the
/// stale pin would inject nothing.
#[test]
fn tc_fault_stale_pin_is_replaced() {
    if !is_root() {
        println!("SKIPPED tc_fault_stale_pin_is_replaced: needs root (TCX attach, bpffs)");
        return;
    }
    let ns = format!("kccl-ffx-{}-stale", std::process::id());
    struct Unpin(String);
    impl Drop for Unpin {
        fn drop(&mut self) {
            let _ = fault::clear(Some(&self.0), "fxa");
        }
    }
    let _unpin = Unpin(ns.clone());
    let cfg = FaultConfig { loss_ppm: fault::PPM, dup_ppm: 0, reorder_ppm: 0, seed: 5 };
    {
        let _guard = NetnsGuard::up(ns.clone()).expect("namespace");
        fault::install(Some(&ns), "fxa", &cfg).expect("install");
    } // namespace (and interface) deleted; the pin stays
    let err = fault::pinned_stats(Some(&ns), "fxa").expect_err("stats of a stale pin");
    assert!(err.to_string().contains("stale pin"), "{err}");
    let _guard = NetnsGuard::up(ns.clone()).expect("namespace again");
    fault::install(Some(&ns), "fxa", &cfg).expect("install over the stale pin");
    send_kccl(&ns, 3).expect("sending kccl datagrams");
    let stats = fault::pinned_stats(Some(&ns), "fxa").expect("pinned stats");
    assert_eq!((stats.seen, stats.dropped), (3, 3), "the new injector must act: {stats:?}");
}

fn run_ok(args: &[&str]) {
    if let Err(e) = run(args) {
        panic!("{e}");
    }
}
