//! The peers kccl is compared with, run on the same virtual cluster: Gloo
//! (torch.distributed from Debian's python3-torch) and Open MPI 4.1 (mpi4py).
//!
//! One rank per host, each a /usr/bin/python3 process inside its host's
//! network namespace (bench/peers/*.py, embedded in this binary and written
//! to a private directory under /run/kccl/peers per run):
//!
//! ```text
//!   Gloo: the runner starts every rank        Open MPI: the runner starts mpirun in h0
//!   ip netns exec kccl-X-h<r> python3 \        ip netns exec kccl-X-h0 mpirun --hostfile H \
//!     gloo_peer.py --rank r                        --mca plm_rsh_agent AGENT python3 mpi_peer.py
//!   (TCP store on h0's eth0:MASTER_PORT,        AGENT 10.77.0.<r+1> orted...  =
//!    GLOO_SOCKET_IFNAME=eth0)                     ip netns exec kccl-X-h<r> sh -c 'orted...'
//! ```
//!
//! Every rank writes rank<R>.json: per timed iteration its CLOCK_MONOTONIC
//! start and end around the collective and the CPU time its process used in
//! it. The scripts check every iteration's result against the reference
//! (nonzero exit and a MISMATCH line otherwise), so a returned
//! [`PeerResult`] is a verified one. Latency of an iteration is first send to
//! last completion: from the root's start (broadcast: only the root sends
//! first) or the earliest rank's start (reduce, allreduce: every rank sends)
//! to the latest rank's end. CLOCK_MONOTONIC is one clock for all network
//! namespaces of the machine. CPU per op is the sum over the rank processes
//! (all their threads); mpirun and orted idle during the collectives and are
//! not counted.

pub(crate) mod kinds;

use kinds::io_err;
pub use kinds::{DType, Peer, PeerError, PeerOp, PYTHON};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::bench::percentile;
use crate::cluster::Cluster;

/// Where the per-run directories (scripts, hostfile, agent, rank outputs) go.
pub const WORK_ROOT: &str = "/run/kccl/peers";

const COMMON_PY: &str = include_str!("../../py/peers/peer_common.py");
const GLOO_PY: &str = include_str!("../../py/peers/gloo_peer.py");
const MPI_PY: &str = include_str!("../../py/peers/mpi_peer.py");

/// Exit code of a rank script whose result check failed.
const EXIT_MISMATCH: i32 = 3;

/// One run: `ranks` ranks (hosts 0..ranks of the cluster) doing `op` on
/// `count` elements each.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerSpec {
    pub peer: Peer,
    pub op: PeerOp,
    pub dtype: DType,
    pub count: usize,
    pub ranks: usize,
    /// Run and checked, not timed.
    pub warmup: usize,
    /// Timed (and checked).
    pub iters: usize,
    /// Whole run, start-up included; also each collective's timeout in Gloo.
    pub timeout: Duration,
    /// Test of the check: rank 0 corrupts one input element, so the run must
    /// fail with [`PeerError::Mismatch`].
    pub inject_mismatch: bool,
}

impl PeerSpec {
    /// `bytes` per rank (a multiple of 4), with iteration counts that keep a
    /// stable median within a reasonable time for that size.
    pub fn new(peer: Peer, op: PeerOp, dtype: DType, bytes: usize, ranks: usize) -> Result<PeerSpec, PeerError> {
        if bytes == 0 || bytes % 4 != 0 {
            return Err(PeerError::Usage(format!(
                "{bytes} bytes: the size must be a positive multiple of 4 (int32/float32 elements)"
            )));
        }
        if ranks < 2 {
            return Err(PeerError::Usage(format!("{ranks} ranks: a collective needs at least 2")));
        }
        let (warmup, iters) = match bytes {
            0..=65_536 => (20, 200),
            65_537..=8_388_608 => (3, 30),
            _ => (2, 10),
        };
        // Rough budget: start-up (importing torch on every rank shares two
        // cores) plus ~100 ms per MB per iteration on a loaded machine.
        let secs = 120 + (warmup + iters) as u64 * (bytes as u64 / 10_000_000 + 1);
        Ok(PeerSpec {
            peer,
            op,
            dtype,
            count: bytes / 4,
            ranks,
            warmup,
            iters,
            timeout: Duration::from_secs(secs),
            inject_mismatch: false,
        })
    }

    /// The CI variant: one warm-up and five timed iterations, and a
    /// timeout that does not let CI wait for the full run's budget.
    pub fn smoke(mut self) -> PeerSpec {
        self.warmup = 1;
        self.iters = 5;
        self.timeout = self.timeout.min(Duration::from_secs(120));
        self
    }

    pub fn bytes(&self) -> usize {
        self.count * 4
    }
}

/// A verified run of one peer (JSON record of `kccl bench peers`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct PeerResult {
    pub peer: Peer,
    pub op: PeerOp,
    pub dtype: DType,
    pub ranks: usize,
    pub count: usize,
    pub bytes: usize,
    pub warmup: usize,
    pub iters: usize,
    /// Every timed and warm-up iteration matched the reference on these
    /// ranks (all ranks, or the root for reduce).
    pub verified_ranks: Vec<usize>,
    /// First send to last completion (see the module comment), microseconds.
    pub median_us: f64,
    pub p99_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
    /// Median over iterations of the spread of the ranks' start times (how
    /// unevenly the ranks left the barrier; part of the latency of reduce
    /// and allreduce, which start at the earliest rank).
    pub start_skew_median_us: f64,
    /// CPU time of all rank processes per operation, microseconds.
    pub cpu_median_us: f64,
    pub cpu_mean_us: f64,
    pub samples_us: Vec<f64>,
    pub cpu_samples_us: Vec<f64>,
    /// How the ranks were started, for the record.
    pub launch: String,
}

impl PeerResult {
    /// One line for a terminal.
    pub fn summary(&self) -> String {
        format!(
            "{:<4} {:<9} {} ranks {} B {}: median {:.1} us p99 {:.1} us (min {:.1} max {:.1}, {} iters) \
             cpu/op {:.1} us, checked on ranks {:?}",
            self.peer,
            self.op,
            self.ranks,
            self.bytes,
            self.dtype,
            self.median_us,
            self.p99_us,
            self.min_us,
            self.max_us,
            self.iters,
            self.cpu_median_us,
            self.verified_ranks
        )
    }
}

/// Checks once per process that `peer` can run; [`PeerError::Missing`]
/// tells the user to run `make setup-peers`.
pub fn check_installed(peer: Peer) -> Result<(), PeerError> {
    static GLOO: OnceLock<Result<(), String>> = OnceLock::new();
    static MPI: OnceLock<Result<(), String>> = OnceLock::new();
    let cell = match peer {
        Peer::Gloo => &GLOO,
        Peer::Mpi => &MPI,
    };
    cell.get_or_init(|| probe(peer)).clone().map_err(|detail| PeerError::Missing { peer, detail })
}

fn probe(peer: Peer) -> Result<(), String> {
    if !Path::new(PYTHON).exists() {
        return Err(format!("{PYTHON} does not exist"));
    }
    // Importing mpi4py.MPI would run MPI_Init as a singleton; finding the
    // module is enough. torch.distributed must be imported to ask for Gloo.
    let code = match peer {
        Peer::Gloo => {
            "import numpy, torch.distributed as d; assert d.is_available() and d.is_gloo_available(), 'no gloo'"
        }
        Peer::Mpi => {
            "import importlib.util as u, numpy; assert u.find_spec('mpi4py') and u.find_spec('mpi4py.MPI'), 'no mpi4py'"
        }
    };
    let out = Command::new(PYTHON)
        .args(["-c", code])
        .env_remove("PYTHONPATH")
        .env_remove("PYTHONHOME")
        .output()
        .map_err(|e| format!("running {PYTHON}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("import failed").trim().to_owned());
    }
    if peer == Peer::Mpi {
        let ok = Command::new("mpirun")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            return Err("mpirun not found on PATH".into());
        }
    }
    Ok(())
}

/// A per-run directory, removed when dropped.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new(cluster: &str) -> Result<WorkDir, PeerError> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = Path::new(WORK_ROOT).join(format!("{cluster}-{}-{n}", std::process::id()));
        // A leftover of a crashed run with the same pid would mix outputs.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("out")).map_err(io_err(format!("creating {}", dir.display())))?;
        Ok(WorkDir(dir))
    }

    fn write(&self, name: &str, text: &str, exec: bool) -> Result<PathBuf, PeerError> {
        let p = self.0.join(name);
        std::fs::write(&p, text).map_err(io_err(format!("writing {}", p.display())))?;
        if exec {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
                .map_err(io_err(format!("making {} executable", p.display())))?;
        }
        Ok(p)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A started process (in its own process group) with its stderr in a file.
struct Proc {
    what: String,
    child: Child,
    stderr: PathBuf,
    status: Option<ExitStatus>,
}

impl Proc {
    fn spawn(what: String, mut cmd: Command, dir: &Path, tag: &str) -> Result<Proc, PeerError> {
        use std::os::unix::process::CommandExt as _;
        let out = dir.join(format!("{tag}.stdout"));
        let err = dir.join(format!("{tag}.stderr"));
        let fo = std::fs::File::create(&out).map_err(io_err(format!("creating {}", out.display())))?;
        let fe = std::fs::File::create(&err).map_err(io_err(format!("creating {}", err.display())))?;
        // pyenv's variables would point /usr/bin/python3 at another stdlib.
        cmd.env_remove("PYTHONPATH").env_remove("PYTHONHOME");
        cmd.stdin(Stdio::null()).stdout(fo).stderr(fe).process_group(0);
        let child = cmd.spawn().map_err(io_err(format!("starting {what} (is iproute2 installed?)")))?;
        Ok(Proc { what, child, stderr: err, status: None })
    }

    fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = lines[lines.len().saturating_sub(6)..].join(" | ");
        if tail.is_empty() {
            "(nothing)".into()
        } else {
            tail
        }
    }

    fn mismatch_line(&self) -> Option<String> {
        let text = std::fs::read_to_string(&self.stderr).ok()?;
        text.lines().find(|l| l.starts_with("MISMATCH")).map(str::to_owned)
    }

    /// Stops the whole process group: these are processes this runner started.
    fn kill(&mut self) {
        if self.status.is_some() {
            return;
        }
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) with a negative pid signals the process group this
        // runner created for the child (process_group(0) above).
        unsafe {
            libc::kill(-pgid, libc::SIGTERM);
        }
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.status = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above; also takes helpers (orted) left in the group.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
    }
}

/// Runs `spec` on hosts 0..spec.ranks of `cluster` and returns the verified timings.
pub fn run(cluster: &Cluster, spec: &PeerSpec) -> Result<PeerResult, PeerError> {
    run_reporting(cluster, spec, None)
}

/// [`run`], telling `on_iteration(done, total)` twice a second how many
/// iterations (warm-up included) rank 0 has finished.
pub fn run_reporting(
    cluster: &Cluster,
    spec: &PeerSpec,
    mut on_iteration: Option<&mut dyn FnMut(u64, u64)>,
) -> Result<PeerResult, PeerError> {
    if spec.ranks < 2 || spec.ranks > cluster.hosts.len() {
        return Err(PeerError::Usage(format!(
            "{} ranks: cluster '{}' has {} hosts (one rank per host, at least 2)",
            spec.ranks,
            cluster.name,
            cluster.hosts.len()
        )));
    }
    if spec.count == 0 || spec.iters == 0 {
        return Err(PeerError::Usage("count and iterations must be at least 1".into()));
    }
    check_installed(spec.peer)?;
    let hosts = &cluster.hosts[..spec.ranks];
    let work = WorkDir::new(&cluster.name)?;
    work.write("peer_common.py", COMMON_PY, false)?;
    let out_dir = work.0.join("out");
    let mut args: Vec<String> = vec![
        "--op".into(),
        spec.op.to_string(),
        "--dtype".into(),
        spec.dtype.to_string(),
        "--count".into(),
        spec.count.to_string(),
        "--warmup".into(),
        spec.warmup.to_string(),
        "--iters".into(),
        spec.iters.to_string(),
        "--out".into(),
        out_dir.display().to_string(),
        "--world".into(),
        spec.ranks.to_string(),
        "--timeout".into(),
        spec.timeout.as_secs().max(1).to_string(),
    ];
    if spec.inject_mismatch {
        args.push("--inject-mismatch".into());
    }
    let progress_file = work.0.join("progress");
    args.push("--progress".into());
    args.push(progress_file.display().to_string());

    let (mut procs, launch) = match spec.peer {
        Peer::Gloo => launch_gloo(&work, hosts, &args)?,
        Peer::Mpi => launch_mpi(&work, hosts, &args)?,
    };
    let waited = wait_all(&mut procs, spec.timeout, || {
        if let (Some(f), Some((done, total))) = (on_iteration.as_mut(), read_progress(&progress_file)) {
            f(done, total);
        }
    });
    for p in procs.iter_mut() {
        p.kill();
    }
    if let Err(running) = waited {
        // Which ranks got to the end, and what the launchers said, is what
        // tells a hung start-up from a hung collective.
        let done: Vec<usize> = (0..spec.ranks).filter(|r| out_dir.join(format!("rank{r}.json")).exists()).collect();
        let said: Vec<String> = procs.iter().map(|p| format!("{}: {}", p.what, p.stderr_tail())).collect();
        let pending = format!("{running}; ranks that finished: {done:?}; stderr: {}", said.join("; "));
        return Err(PeerError::Timeout { peer: spec.peer, op: spec.op, secs: spec.timeout.as_secs(), pending });
    }
    // A failed check wins over the other ranks' reactions to it (aborts, broken connections).
    if let Some(line) = procs.iter().find_map(Proc::mismatch_line) {
        return Err(PeerError::Mismatch { peer: spec.peer, op: spec.op, detail: line });
    }
    if let Some(p) = procs.iter().find(|p| !p.status.is_some_and(|s| s.success())) {
        let status = p.status.map_or_else(|| "no status".into(), |s| s.to_string());
        let status = if p.status.and_then(|s| s.code()) == Some(EXIT_MISMATCH) {
            format!("{status} (a result mismatch)")
        } else {
            status
        };
        return Err(PeerError::Failed {
            peer: spec.peer,
            op: spec.op,
            what: p.what.clone(),
            status,
            stderr: p.stderr_tail(),
        });
    }
    let records = read_ranks(&out_dir, spec, hosts)?;
    Ok(summarize(spec, &records, launch))
}

fn launch_gloo(
    work: &WorkDir,
    hosts: &[crate::cluster::Host],
    args: &[String],
) -> Result<(Vec<Proc>, String), PeerError> {
    static PORT: AtomicU32 = AtomicU32::new(0);
    let script = work.write("gloo_peer.py", GLOO_PY, false)?;
    // A new store port per run: the previous run's store socket may still be
    // in TIME_WAIT on h0.
    let port = 29_500 + (std::process::id() + PORT.fetch_add(1, Ordering::Relaxed)) % 2_000;
    let master = hosts[0].addr;
    let mut procs = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &h.netns, PYTHON])
            .arg(&script)
            .args(args)
            .args(["--rank", &r.to_string()])
            .env("MASTER_ADDR", master.to_string())
            .env("MASTER_PORT", port.to_string())
            .env("GLOO_SOCKET_IFNAME", &h.iface)
            .env("OMP_NUM_THREADS", "1");
        match Proc::spawn(format!("gloo rank {r} in {}", h.netns), cmd, &work.0, &format!("rank{r}")) {
            Ok(p) => procs.push(p),
            Err(e) => {
                for p in procs.iter_mut() {
                    p.kill();
                }
                return Err(e);
            }
        }
    }
    let launch = format!(
        "ip netns exec <host ns> {PYTHON} gloo_peer.py per rank; MASTER_ADDR={master} MASTER_PORT={port} \
         GLOO_SOCKET_IFNAME={}",
        hosts[0].iface
    );
    Ok((procs, launch))
}

/// Open MPI's own launch: mpirun in host 0's namespace, one slot per host in
/// the hostfile (so rank r runs on host r), and an rsh agent that runs each
/// remote orted inside the namespace of the host it was given, each with
/// the namespace's name as hostname.
fn launch_mpi(
    work: &WorkDir,
    hosts: &[crate::cluster::Host],
    args: &[String],
) -> Result<(Vec<Proc>, String), PeerError> {
    let script = work.write("mpi_peer.py", MPI_PY, false)?;
    let hostfile: String = hosts.iter().map(|h| format!("{} slots=1\n", h.addr)).collect();
    let hostfile = work.write("hostfile", &hostfile, false)?;
    let cases: String = hosts.iter().map(|h| format!("  {}) ns={} ;;\n", h.addr, h.netns)).collect();
    let agent = format!(
        "#!/bin/sh\n\
         # rsh agent for mpirun: $1 is a host of the hostfile, the rest the command\n\
         # (orted ...) that ssh would hand to the remote shell.\n\
         host=\"$1\"; shift\n\
         case \"$host\" in\n{cases}  *) echo \"kccl mpi agent: unknown host $host\" >&2; exit 1 ;;\nesac\n\
         exec ip netns exec \"$ns\" unshare --uts /bin/sh -c \"hostname $ns && exec $*\"\n"
    );
    let agent = work.write("netns-agent.sh", &agent, true)?;
    let iface = hosts[0].iface.clone();
    let mca: Vec<(&str, String)> = vec![
        ("plm_rsh_agent", agent.display().to_string()),
        // TCP between the hosts' interfaces only: no shared memory, which
        // would bypass the network the hosts are meant to use.
        ("btl", "tcp,self".into()),
        ("btl_tcp_if_include", iface.clone()),
        ("oob_tcp_if_include", iface.clone()),
        // Every host has one slot, so Open MPI believes no core is shared
        // and busy-polls; all hosts share this machine's cores, and a
        // spinning rank then starves the one it waits for (a 1472-byte
        // broadcast on 4 ranks: 12 ms instead of 90 us). Open MPI sets this
        // itself when it knows a node is oversubscribed.
        ("mpi_yield_when_idle", "1".into()),
        // Every orted started by mpirun and talking straight to it: with the
        // default radix routing tree, 10 hosts already failed here
        // (errmgr "no-path", seen while all hosts still shared one hostname;
        // Open MPI's message suggests routed=direct).
        ("routed", "direct".into()),
        ("plm_rsh_no_tree_spawn", "1".into()),
    ];
    let mut cmd = Command::new("ip");
    // Each host gets its own hostname (a UTS namespace), as real hosts
    // have: Open MPI names its session directory, where PMIx keeps its
    // rendezvous and shared-memory files, after the hostname. With the one
    // hostname of this machine, mpirun and every orted shared one tree and
    // removed each other's files: 4 of 37 runs hung in start-up or failed
    // with "exited improperly"; with a hostname per host, 40 of 40 passed.
    cmd.args(["netns", "exec", &hosts[0].netns, "unshare", "--uts", "/bin/sh", "-c", "hostname \"$0\" && exec \"$@\""])
        .arg(&hosts[0].netns)
        .args(["mpirun", "--allow-run-as-root", "-np"])
        .arg(hosts.len().to_string())
        .arg("--hostfile")
        .arg(&hostfile)
        .args(["--map-by", "node", "--bind-to", "none"]);
    for (k, v) in &mca {
        cmd.args(["--mca", k, v]);
    }
    cmd.arg(PYTHON).arg(&script).args(args);
    let p = Proc::spawn(format!("mpirun in {}", hosts[0].netns), cmd, &work.0, "mpirun")?;
    let launch = format!(
        "ip netns exec {} unshare --uts (hostname = namespace) mpirun -np {} --hostfile <one addr per host, slots=1> --map-by node --bind-to none \
         --mca plm_rsh_agent <ip netns exec agent> --mca btl tcp,self --mca btl_tcp_if_include {iface} \
         --mca oob_tcp_if_include {iface} --mca mpi_yield_when_idle 1 --mca routed direct --mca plm_rsh_no_tree_spawn 1 {PYTHON} mpi_peer.py",
        hosts[0].netns,
        hosts.len()
    );
    Ok((vec![p], launch))
}

/// Waits until every process has exited, or one failed (the others are then
/// left to the caller to stop), or `timeout`. Err: who was still running.
/// "DONE TOTAL" from rank 0's progress file (absent before its first iteration).
fn read_progress(path: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut it = text.split_whitespace().map(|w| w.parse::<u64>().ok());
    Some((it.next()??, it.next()??))
}

/// Waits for every process (or the first failure), calling `poll` every
/// half second while they run (rarely: the ranks being timed share 2 cores).
fn wait_all(procs: &mut [Proc], timeout: Duration, mut poll: impl FnMut()) -> Result<(), String> {
    let end = Instant::now() + timeout;
    let mut polled = Instant::now();
    loop {
        if polled.elapsed() >= Duration::from_millis(500) {
            poll();
            polled = Instant::now();
        }
        let mut running = Vec::new();
        for p in procs.iter_mut() {
            if p.status.is_none() {
                match p.child.try_wait() {
                    Ok(Some(s)) => p.status = Some(s),
                    Ok(None) => running.push(p.what.clone()),
                    // Not waitable: treat as gone; the missing output reports it.
                    Err(_) => p.status = Some(ExitStatus::default()),
                }
            }
        }
        if running.is_empty() || procs.iter().any(|p| p.status.is_some_and(|s| !s.success())) {
            return Ok(());
        }
        if Instant::now() >= end {
            return Err(format!("still running: {}", running.join(", ")));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What one rank wrote (bench/peers/peer_common.py).
#[derive(Debug, serde::Deserialize)]
struct RankRecord {
    peer: String,
    op: String,
    count: usize,
    rank: usize,
    world: usize,
    checked: bool,
    netns_ino: u64,
    start_ns: Vec<u64>,
    end_ns: Vec<u64>,
    cpu_ns: Vec<u64>,
}

fn read_ranks(dir: &Path, spec: &PeerSpec, hosts: &[crate::cluster::Host]) -> Result<Vec<RankRecord>, PeerError> {
    use std::os::unix::fs::MetadataExt as _;
    let mut out = Vec::with_capacity(hosts.len());
    for (r, h) in hosts.iter().enumerate() {
        let path = dir.join(format!("rank{r}.json"));
        let bad = |msg: String| PeerError::Output { peer: spec.peer, op: spec.op, path: path.clone(), msg };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("not written ({e})")))?;
        let rec: RankRecord = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let ns_path = kccl::netns::path(&h.netns);
        let ino = std::fs::metadata(&ns_path).map_err(io_err(format!("reading {}", ns_path.display())))?.ino();
        let want_checked = spec.op != PeerOp::Reduce || r == 0;
        let problem = if rec.peer != spec.peer.to_string() || rec.op != spec.op.to_string() {
            Some(format!("is a {} {} record", rec.peer, rec.op))
        } else if rec.rank != r || rec.world != spec.ranks || rec.count != spec.count {
            Some(format!(
                "rank {} of {} with {} elements, expected rank {r} of {}",
                rec.rank, rec.world, rec.count, spec.ranks
            ))
        } else if rec.netns_ino != ino {
            Some(format!("rank {r} ran outside its host's namespace {}", h.netns))
        } else if rec.checked != want_checked {
            Some(format!("rank {r} checked={} but should be {want_checked}", rec.checked))
        } else if [rec.start_ns.len(), rec.end_ns.len(), rec.cpu_ns.len()].iter().any(|&n| n != spec.iters) {
            Some(format!("{} samples, expected {}", rec.start_ns.len(), spec.iters))
        } else {
            None
        };
        if let Some(msg) = problem {
            return Err(bad(msg));
        }
        out.push(rec);
    }
    Ok(out)
}

fn summarize(spec: &PeerSpec, recs: &[RankRecord], launch: String) -> PeerResult {
    let mut lat = Vec::with_capacity(spec.iters);
    let mut skew = Vec::with_capacity(spec.iters);
    let mut cpu = Vec::with_capacity(spec.iters);
    for i in 0..spec.iters {
        let earliest = recs.iter().map(|r| r.start_ns[i]).min().unwrap_or(0);
        let latest_start = recs.iter().map(|r| r.start_ns[i]).max().unwrap_or(0);
        // Broadcast: nothing is sent before the root starts; receivers that
        // left the barrier earlier were only waiting.
        let start = if spec.op == PeerOp::Broadcast { recs[0].start_ns[i] } else { earliest };
        let end = recs.iter().map(|r| r.end_ns[i]).max().unwrap_or(0);
        lat.push(end.saturating_sub(start) as f64 / 1e3);
        skew.push(latest_start.saturating_sub(earliest) as f64 / 1e3);
        cpu.push(recs.iter().map(|r| r.cpu_ns[i]).sum::<u64>() as f64 / 1e3);
    }
    let sorted = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s
    };
    let (ls, ss, cs) = (sorted(&lat), sorted(&skew), sorted(&cpu));
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    PeerResult {
        peer: spec.peer,
        op: spec.op,
        dtype: spec.dtype,
        ranks: spec.ranks,
        count: spec.count,
        bytes: spec.bytes(),
        warmup: spec.warmup,
        iters: spec.iters,
        verified_ranks: recs.iter().filter(|r| r.checked).map(|r| r.rank).collect(),
        median_us: percentile(&ls, 50.0),
        p99_us: percentile(&ls, 99.0),
        min_us: ls.first().copied().unwrap_or(f64::NAN),
        max_us: ls.last().copied().unwrap_or(f64::NAN),
        mean_us: mean(&lat),
        start_skew_median_us: percentile(&ss, 50.0),
        cpu_median_us: percentile(&cs, 50.0),
        cpu_mean_us: mean(&cpu),
        samples_us: lat,
        cpu_samples_us: cpu,
        launch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: usize, start: Vec<u64>, end: Vec<u64>, cpu: Vec<u64>) -> RankRecord {
        RankRecord {
            peer: "gloo".into(),
            op: "broadcast".into(),
            count: 1,
            rank,
            world: 2,
            checked: true,
            netns_ino: 0,
            start_ns: start,
            end_ns: end,
            cpu_ns: cpu,
        }
    }

    #[test]
    fn latency_is_first_send_to_last_completion() {
        let recs = vec![
            rec(0, vec![1_000, 10_000], vec![3_000, 12_000], vec![500, 700]),
            rec(1, vec![500, 10_500], vec![4_000, 15_000], vec![100, 300]),
        ];
        let mut spec = PeerSpec::new(Peer::Gloo, PeerOp::Broadcast, DType::Int32, 4, 2).expect("valid spec");
        spec.iters = 2;
        // Broadcast starts at the root: 4000-1000 and 15000-10000 ns.
        let b = summarize(&spec, &recs, String::new());
        assert_eq!(b.samples_us, vec![3.0, 5.0]);
        assert_eq!(b.cpu_samples_us, vec![0.6, 1.0]);
        assert_eq!(b.min_us, 3.0);
        assert_eq!(b.max_us, 5.0);
        // Allreduce starts at the earliest rank: 4000-500 and 15000-10000.
        spec.op = PeerOp::Allreduce;
        let a = summarize(&spec, &recs, String::new());
        assert_eq!(a.samples_us, vec![3.5, 5.0]);
        assert_eq!(a.start_skew_median_us, 0.5);
    }

    #[test]
    fn spec_checks_sizes() {
        assert!(PeerSpec::new(Peer::Mpi, PeerOp::Reduce, DType::Float32, 1472, 9).is_ok());
        assert!(matches!(PeerSpec::new(Peer::Mpi, PeerOp::Reduce, DType::Int32, 1471, 9), Err(PeerError::Usage(_))));
        assert!(matches!(PeerSpec::new(Peer::Mpi, PeerOp::Reduce, DType::Int32, 0, 9), Err(PeerError::Usage(_))));
        assert!(matches!(PeerSpec::new(Peer::Gloo, PeerOp::Reduce, DType::Int32, 8, 1), Err(PeerError::Usage(_))));
        let s = PeerSpec::new(Peer::Gloo, PeerOp::Allreduce, DType::Float32, 87_200_000, 4).expect("valid");
        assert_eq!((s.count, s.warmup, s.iters), (21_800_000, 2, 10));
        assert_eq!(s.clone().smoke().iters, 5);
    }

    #[test]
    fn names_round_trip() {
        for p in [Peer::Gloo, Peer::Mpi] {
            assert_eq!(p.to_string().parse::<Peer>().ok(), Some(p));
        }
        for o in [PeerOp::Broadcast, PeerOp::Reduce, PeerOp::Allreduce] {
            assert_eq!(o.to_string().parse::<PeerOp>().ok(), Some(o));
        }
        for d in [DType::Int32, DType::Float32] {
            assert_eq!(d.to_string().parse::<DType>().ok(), Some(d));
        }
        assert!("nccl".parse::<Peer>().is_err());
    }

    #[test]
    fn missing_peer_says_how_to_install() {
        let e = PeerError::Missing { peer: Peer::Mpi, detail: "mpirun not found on PATH".into() };
        let m = e.to_string();
        assert!(m.contains("make setup-peers") && m.contains("mpi peer") && m.contains("mpirun not found"), "{m}");
    }
}
