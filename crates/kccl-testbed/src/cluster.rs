//! A local virtual cluster: N hosts, each in its own network namespace, wired
//! to one Linux bridge that lives in a switch namespace. Nothing is created in
//! the root network namespace, so a cluster cannot disturb the machine's own
//! networking and `down` only has to delete namespaces.
//!
//! ```text
//!   netns kccl-<name>-h0    netns kccl-<name>-h1          netns kccl-<name>-h<N-1>
//!  +--------------------+  +--------------------+        +--------------------+
//!  | eth0 10.77.0.1/16  |  | eth0 10.77.0.2/16  |  ...   | eth0 10.77.A.B/16  |
//!  | 02:6b:63:00:00:01  |  | 02:6b:63:00:00:02  |        | 02:6b:63:00:A:B    |
//!  +---------|----------+  +---------|----------+        +---------|----------+
//!            | veth                  | veth                        | veth
//!  +---------|-----------------------|-----------------------------|----------+
//!  |        h0                      h1            ...             h<N-1>      |
//!  |         \______________________|_____________________________/           |
//!  |                              br0  (STP off, no multicast snooping)       |
//!  |                                                 netns kccl-<name>-sw     |
//!  +--------------------------------------------------------------------------+
//! ```
//!
//! Host i has (A,B) = ((i+1)/256, (i+1)%256). Every host holds a PERMANENT
//! neighbour entry for every other host, so no ARP traffic competes with the
//! measured traffic (`Neighbours::Learned` leaves the tables empty, to fill
//! by ARP as on a network kccl did not build), and IPv6 is disabled
//! everywhere so no router solicitations or DAD packets appear on the wire.
//!
//! Every veth (both ends, and so the bridge) has the cluster's MTU
//! (`ClusterSpec::mtu`: 9000 unless KCCL_CLUSTER_MTU says otherwise), which
//! the group file names, so aggregation chunks follow it (kccl::chunk).
//!
//! Every veth has one queue unless `ClusterSpec::queues` (at most 16) or
//! KCCL_CLUSTER_QUEUES asks for more; then the switch's ports steer frames
//! to the queue of the sending CPU (XPS), so XDP on a host's interface runs
//! on every CPU, as on a multi-queue NIC (crate::queues says why, and why
//! it is not the default).
//!
//! The group file of the cluster is kept at `/run/kccl/clusters/<name>/group.toml`.

use std::fs::File;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::queues;
use kccl::error::is_root;
use kccl::group::{Group, Member};
use kccl::netns;

/// UDP port every member listens on unless the spec says otherwise.
pub const DEFAULT_PORT: u16 = 47000;

/// Where cluster state (the group file) is kept.
pub const STATE_ROOT: &str = "/run/kccl/clusters";

/// Longest cluster name: keeps "kccl-<name>-h<N>" short enough to read.
pub const MAX_NAME_LEN: usize = 12;

/// MTU of a cluster's links unless KCCL_CLUSTER_MTU or the spec says
/// otherwise: jumbo frames, as a training cluster's network has them.
pub const DEFAULT_MTU: u32 = 9000;

/// The MTU a new cluster gets: KCCL_CLUSTER_MTU if set (the kernel matrix
/// runs the topology tests per MTU with it), else [`DEFAULT_MTU`].
pub fn default_mtu() -> Result<u32> {
    match std::env::var("KCCL_CLUSTER_MTU") {
        Err(_) => Ok(DEFAULT_MTU),
        Ok(v) => {
            v.trim().parse::<u32>().ok().filter(|&m| kccl::chunk::for_mtu(i64::from(m)).is_ok()).ok_or_else(|| {
                Error::BadSetting {
                    setting: format!("KCCL_CLUSTER_MTU={v:?}"),
                    why: format!("want an MTU in [{}, {}]", kccl::chunk::MIN_MTU, kccl::chunk::MAX_MTU),
                }
            })
        }
    }
}

/// Host counts `up` accepts.
pub const MIN_HOSTS: usize = 2;
pub const MAX_HOSTS: usize = 1000;

/// `up` shows its progress (stderr) for clusters larger than this.
pub const PROGRESS_FROM_HOSTS: usize = 50;

/// Interface name of the host side of each veth.
const HOST_IFACE: &str = "eth0";

/// Bridge name inside the switch namespace.
const BRIDGE: &str = "br0";

/// How many `ip -batch` processes run at once while configuring hosts: the
/// work is mostly kernel time under RTNL, so more processes than cores only
/// add scheduling noise.
const PARALLEL_IP: usize = 4;

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    pub name: String,
    pub hosts: usize,
    pub port: u16,
    pub job_id: u32,
    /// MTU of every link (veth ends, bridge) and the group file's `mtu`;
    /// None: [`default_mtu`] (KCCL_CLUSTER_MTU, else [`DEFAULT_MTU`]).
    pub mtu: Option<u32>,
    /// Queues of every veth end, each way; None: [`queues::default_queues`]
    /// (KCCL_CLUSTER_QUEUES, else one).
    pub queues: Option<u32>,
    /// How hosts know each other's MAC addresses.
    pub neighbours: Neighbours,
}

/// The hosts' neighbour tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Neighbours {
    /// A permanent entry for every other host from the start: no ARP
    /// traffic competes with measured traffic.
    #[default]
    Permanent,
    /// Empty tables that fill by ARP, as on a network kccl did not build
    /// (the cold-neighbour topology tests run in this mode).
    Learned,
}

impl ClusterSpec {
    /// A spec with the default port, job 1, the default MTU and permanent
    /// neighbour entries.
    pub fn new(name: &str, hosts: usize) -> Self {
        ClusterSpec {
            name: name.to_owned(),
            hosts,
            port: DEFAULT_PORT,
            job_id: 1,
            mtu: None,
            queues: None,
            neighbours: Neighbours::Permanent,
        }
    }

    /// The queues per veth this spec gives: its own, checked, or the default.
    pub fn resolved_queues(&self) -> Result<u32> {
        match self.queues {
            None => queues::default_queues(),
            Some(q) if (1..=queues::MAX_QUEUES).contains(&q) => Ok(q),
            Some(q) => Err(cluster_err(&self.name, format!("{q} queues per link: want 1 to {}", queues::MAX_QUEUES))),
        }
    }
}

/// One virtual host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub index: usize,
    pub netns: String,
    pub addr: Ipv4Addr,
    pub mac: [u8; 6],
    pub iface: String,
}

/// A running cluster and its group file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub name: String,
    pub hosts: Vec<Host>,
    pub group: Group,
    pub group_path: PathBuf,
}

/// Namespace of host `index` of cluster `name`.
pub fn host_netns(name: &str, index: usize) -> String {
    format!("kccl-{name}-h{index}")
}

/// Namespace of the switch (bridge) of cluster `name`.
pub fn switch_netns(name: &str) -> String {
    format!("kccl-{name}-sw")
}

/// State directory of cluster `name`.
pub fn state_dir(name: &str) -> PathBuf {
    Path::new(STATE_ROOT).join(name)
}

/// Group file path of cluster `name`.
pub fn group_path(name: &str) -> PathBuf {
    state_dir(name).join("group.toml")
}

/// Address of host `index`: 10.77.A.B with (A,B) = ((i+1)/256, (i+1)%256).
/// Offset by one so that no host gets the network address 10.77.0.0.
pub fn host_addr(index: usize) -> Ipv4Addr {
    let n = index + 1;
    Ipv4Addr::new(10, 77, (n / 256) as u8, (n % 256) as u8)
}

/// MAC of host `index`: locally administered 02:6b:63 ("kc"), then the same
/// A,B as the address, so a packet dump maps MACs to hosts at a glance.
pub fn host_mac(index: usize) -> [u8; 6] {
    let n = index + 1;
    [0x02, 0x6b, 0x63, 0x00, (n / 256) as u8, (n % 256) as u8]
}

/// "02:6b:63:00:00:01" form, as `ip` prints and parses it.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn cluster_err(name: &str, msg: impl Into<String>) -> Error {
    Error::Cluster { name: name.to_owned(), msg: msg.into() }
}

/// Checks a cluster name: 1..=12 characters of [a-z0-9-], not starting with
/// '-' (it would read as an option on the command line).
pub fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(cluster_err(
            name,
            format!("a cluster name must be 1 to {MAX_NAME_LEN} characters long (got {})", name.len()),
        ));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')) {
        return Err(cluster_err(name, format!("invalid character {c:?} in cluster name: use only a-z, 0-9 and '-'")));
    }
    if name.starts_with('-') {
        return Err(cluster_err(name, "a cluster name cannot start with '-'"));
    }
    Ok(())
}

/// Which part of cluster `name` the namespace `ns` is, if any: exactly
/// `kccl-<name>-sw` or `kccl-<name>-h<digits>`. Exact matching keeps cluster
/// "a" from claiming the namespaces of cluster "a-b".
fn classify(name: &str, ns: &str) -> Option<NsKind> {
    let rest = ns.strip_prefix("kccl-")?.strip_prefix(name)?.strip_prefix('-')?;
    if rest == "sw" {
        return Some(NsKind::Switch);
    }
    let digits = rest.strip_prefix('h')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // "h01" is not a name `up` makes; leave it alone.
    if digits.len() > 1 && digits.starts_with('0') {
        return None;
    }
    digits.parse().ok().map(NsKind::Host)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NsKind {
    Switch,
    Host(usize),
}

/// Named namespaces that belong to cluster `name`, sorted (switch first, then
/// hosts by index).
fn cluster_namespaces(name: &str) -> Result<Vec<(NsKind, String)>> {
    let dir = Path::new(netns::NETNS_RUN_DIR);
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // No namespace was ever named on this machine.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        let Some(ns) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if let Some(kind) = classify(name, &ns) {
            out.push((kind, ns));
        }
    }
    out.sort_by_key(|(k, _)| match k {
        NsKind::Switch => (0, 0),
        NsKind::Host(i) => (1, *i),
    });
    Ok(out)
}

/// A short name nobody else uses: `prefix` (trimmed, lower-cased) + pid and a
/// per-process counter in base 36. At most 12 characters.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let clean: String = prefix
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
        .skip_while(|c| *c == '-')
        .collect();
    let pid = base36(std::process::id());
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        // The '-' keeps pid 12/counter 3 apart from pid 1/counter 23.
        let suffix = format!("{pid}-{}", base36(n));
        let room = MAX_NAME_LEN.saturating_sub(suffix.len());
        let head: String = clean.chars().take(room).collect();
        let name = if head.is_empty() { format!("k{suffix}") } else { format!("{head}{suffix}") };
        let name: String = name.chars().take(MAX_NAME_LEN).collect();
        // Skip names whose namespaces a crashed earlier process (same pid) left.
        let taken = cluster_namespaces(&name).map(|v| !v.is_empty()).unwrap_or(false);
        if !taken || n > 10_000 {
            return name;
        }
    }
}

fn base36(mut v: u32) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(v % 36) as usize]);
        v /= 36;
        if v == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8_lossy(&out).into_owned()
}

/// Runs `ip [-n ns] -batch -` with `script` on stdin, without waiting.
fn spawn_ip_batch(ns: Option<&str>, script: &str) -> Result<IpBatch> {
    spawn_batch("ip", ns, script)
}

/// `ip` or `bridge` (both iproute2) reading commands from stdin.
fn spawn_batch(tool: &str, ns: Option<&str>, script: &str) -> Result<IpBatch> {
    let mut cmd = Command::new(tool);
    if let Some(ns) = ns {
        cmd.args(["-n", ns]);
    }
    cmd.args(["-batch", "-"]).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
    let label = match ns {
        Some(ns) => format!("{tool} -n {ns} -batch -"),
        None => format!("{tool} -batch -"),
    };
    let mut child = cmd.spawn().map_err(|e| Error::io(format!("running `{label}` (is iproute2 installed?)"), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A write error means ip exited early; its stderr says why, so the
        // error is reported by wait(), not here.
        let _ = stdin.write_all(script.as_bytes());
    }
    Ok(IpBatch { child, label, script: script.to_owned() })
}

struct IpBatch {
    child: Child,
    label: String,
    script: String,
}

/// A failed `ip -batch`: the message names the command, the failing batch
/// line and ip's stderr; `line` is that line's number (1-based) when ip said.
struct BatchError {
    msg: String,
    line: Option<usize>,
}

impl IpBatch {
    fn wait(self) -> std::result::Result<(), BatchError> {
        let out = self
            .child
            .wait_with_output()
            .map_err(|e| BatchError { msg: format!("`{}`: waiting: {e}", self.label), line: None })?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        // ip reports "Command failed -:<line>"; show that line of the script.
        let line = stderr
            .lines()
            .find_map(|l| l.trim().strip_prefix("Command failed -:"))
            .and_then(|n| n.trim().parse::<usize>().ok());
        let at = line
            .and_then(|n| self.script.lines().nth(n.saturating_sub(1)))
            .map(|l| format!(" at `{l}`"))
            .unwrap_or_default();
        // That line of ip's is replaced by the quoted command; keep the rest.
        let why: Vec<&str> =
            stderr.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("Command failed -:")).collect();
        Err(BatchError { msg: format!("`{}` failed ({}){at}: {}", self.label, out.status, why.join("; ")), line })
    }
}

fn ip_batch(name: &str, ns: Option<&str>, script: &str) -> Result<()> {
    spawn_ip_batch(ns, script)?.wait().map_err(|e| cluster_err(name, e.msg))
}

fn bridge_batch(name: &str, ns: &str, script: &str) -> Result<()> {
    spawn_batch("bridge", Some(ns), script)?.wait().map_err(|e| cluster_err(name, e.msg))
}

/// Writes the IPv6-off sysctls inside each namespace. Done from one thread
/// that setns()es from namespace to namespace: /proc/sys/net shows the
/// calling thread's namespace, and this avoids a process per namespace.
fn disable_ipv6(name: &str, namespaces: Vec<String>) -> Result<()> {
    let r = netns::run_in(None, move || {
        for ns in &namespaces {
            netns::enter(ns)?;
            // `default` first so interfaces created later start with IPv6 off.
            for which in ["default", "all"] {
                let p = format!("/proc/sys/net/ipv6/conf/{which}/disable_ipv6");
                match std::fs::write(&p, b"1") {
                    Ok(()) => {}
                    // Kernel without IPv6: nothing to disable.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(kccl::Error::io(format!("disabling IPv6 in {ns}: writing {p}"), e)),
                }
            }
        }
        Ok(())
    });
    r.map_err(|e| cluster_err(name, e.to_string()))
}

/// Creates the cluster described by `spec` and writes its group file.
pub fn up(spec: &ClusterSpec) -> Result<Cluster> {
    let name = spec.name.as_str();
    validate_name(name)?;
    if !(MIN_HOSTS..=MAX_HOSTS).contains(&spec.hosts) {
        return Err(cluster_err(
            name,
            format!("a cluster needs {MIN_HOSTS} to {MAX_HOSTS} hosts (asked for {})", spec.hosts),
        ));
    }
    if spec.port == 0 {
        return Err(cluster_err(name, "port 0 is not a UDP port members can listen on"));
    }
    let mtu = match spec.mtu {
        Some(m) => m,
        None => default_mtu()?,
    };
    if let Err(m) = kccl::chunk::for_mtu(i64::from(mtu)) {
        return Err(cluster_err(name, m));
    }
    let nqueues = spec.resolved_queues()?;
    if !is_root() {
        return Err(Error::NotRoot { what: "creating a virtual cluster".into() });
    }
    let existing = cluster_namespaces(name)?;
    if !existing.is_empty() {
        return Err(cluster_err(
            name,
            format!(
                "already exists ({} namespaces, e.g. {}); remove it first with `kccl cluster down --name {name}`",
                existing.len(),
                existing[0].1
            ),
        ));
    }
    // Bring-up takes a while from about 50 hosts (the per-host neighbour
    // tables grow with the square): say where it is.
    let progress = if spec.hosts > PROGRESS_FROM_HOSTS {
        Progress::new(&format!("kccl cluster up {name}"))
    } else {
        Progress::hidden()
    };
    progress.stage(format!("{} hosts", spec.hosts));
    let mut plan = vec![spec.hosts as u64 / 4];
    plan.extend(std::iter::repeat_n(1, spec.hosts));
    plan.push(spec.hosts as u64 / 4);
    progress.plan(&plan);
    progress.point("namespaces");
    let sw = switch_netns(name);
    let hosts: Vec<Host> = (0..spec.hosts)
        .map(|i| Host {
            index: i,
            netns: host_netns(name, i),
            addr: host_addr(i),
            mac: host_mac(i),
            iface: HOST_IFACE.to_owned(),
        })
        .collect();

    // All namespaces, in one ip process. If this fails (another `up` of the
    // same name racing with this one), delete only the namespaces this call
    // made: `down` would also take the other caller's.
    let mut all_ns = vec![sw.clone()];
    all_ns.extend(hosts.iter().map(|h| h.netns.clone()));
    let script: String = all_ns.iter().map(|ns| format!("netns add {ns}\n")).collect();
    if let Err(e) = spawn_ip_batch(None, &script)?.wait() {
        // ip stops at the failing line: the ones before it were made here.
        let made = e.line.map_or(0, |l| l.saturating_sub(1));
        let undo: String = all_ns[..made.min(all_ns.len())].iter().map(|ns| format!("netns del {ns}\n")).collect();
        if !undo.is_empty() {
            if let Err(de) = ip_batch(name, None, &undo) {
                crate::errln!("kccl: cleaning up cluster '{name}' after a failed `up` also failed: {de}");
            }
        }
        return Err(cluster_err(name, e.msg));
    }

    let built = build(spec, Links { mtu, queues: nqueues }, &sw, hosts, all_ns, &progress);
    progress.finish();
    match built {
        Ok(c) => Ok(c),
        Err(e) => {
            // Leave nothing half-built behind; the build error is the one to report.
            if let Err(de) = down(name) {
                crate::errln!("kccl: cleaning up cluster '{name}' after a failed `up` also failed: {de}");
            }
            Err(e)
        }
    }
}

/// What every link of the cluster gets.
struct Links {
    mtu: u32,
    queues: u32,
}

/// Everything after the namespaces exist; on error the caller runs `down`.
fn build(
    spec: &ClusterSpec,
    links: Links,
    sw: &str,
    hosts: Vec<Host>,
    all_ns: Vec<String>,
    progress: &Progress,
) -> Result<Cluster> {
    let name = spec.name.as_str();
    let mtu = links.mtu;

    // 1. IPv6 off before any interface exists, so none ever gets a
    //    link-local address or sends DAD/router solicitations.
    disable_ipv6(name, all_ns)?;

    // 2. The bridge. STP off and forward_delay 0: ports forward as soon as
    //    they are up; no multicast snooping: the bridge floods multicast like
    //    a dumb switch instead of filtering on IGMP state nobody sends.
    ip_batch(
        name,
        Some(sw),
        &format!(
            "link set lo up\n\
             link add {BRIDGE} type bridge stp_state 0 forward_delay 0 mcast_snooping 0\n\
             link set {BRIDGE} up\n"
        ),
    )?;

    // 3. Per host, one ip process inside the host namespace: the veth (both
    //    ends created directly in their namespaces, with the fixed MAC set
    //    before the link comes up), address, links up, then the permanent
    //    neighbour entries (after eth0 is up: taking a link down flushes
    //    even permanent entries).
    let mut running: Vec<IpBatch> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for h in &hosts {
        progress.point(format!("h{}", h.index));
        let mut s = format!(
            "link add {HOST_IFACE} address {mac} mtu {mtu} {q} type veth peer name h{i} mtu {mtu} {q} netns {sw}\n\
             addr add {addr}/16 dev {HOST_IFACE}\n\
             link set lo up\n\
             link set {HOST_IFACE} up\n",
            mac = format_mac(&h.mac),
            mtu = mtu,
            q = queues::link_words(links.queues),
            i = h.index,
            addr = h.addr,
        );
        for o in hosts.iter().filter(|o| o.index != h.index && spec.neighbours == Neighbours::Permanent) {
            s.push_str(&format!(
                "neigh replace {} lladdr {} dev {HOST_IFACE} nud permanent\n",
                o.addr,
                format_mac(&o.mac)
            ));
        }
        if running.len() >= PARALLEL_IP {
            if let Err(m) = running.remove(0).wait() {
                failures.push(m.msg);
            }
        }
        if !failures.is_empty() {
            break;
        }
        running.push(spawn_ip_batch(Some(&h.netns), &s)?);
    }
    for b in running {
        if let Err(m) = b.wait() {
            failures.push(m.msg);
        }
    }
    if !failures.is_empty() {
        return Err(cluster_err(name, failures.join("; ")));
    }

    // 4. Switch ports into the bridge and up (this is when carrier appears
    //    on each host's eth0).
    progress.point("switch ports and forwarding table");
    let mut s = String::new();
    for h in &hosts {
        s.push_str(&format!("link set h{} master {BRIDGE} up\n", h.index));
    }
    ip_batch(name, Some(sw), &s)?;

    // 4b. The switch knows every host's port from the start (static FDB
    //     entries, as a real switch learns them): receivers that never send
    //     would otherwise stay unlearned and every frame would be flooded to
    //     every port.  Bridged frames skip iptables (br_netfilter, if the
    //     machine loaded it): a switch does not run a firewall per frame.
    let mut fdb = String::new();
    for h in &hosts {
        fdb.push_str(&format!("fdb replace {} dev h{} master static\n", format_mac(&h.mac), h.index));
    }
    bridge_batch(name, sw, &fdb)?;
    // 4c. Each switch port sends a frame on the queue of the CPU that sends
    //     it (XPS): the receiving host's XDP then runs on that CPU.
    let ports: Vec<String> = hosts.iter().map(|h| format!("h{}", h.index)).collect();
    let plan = queues::xps_plan(&queues::allowed_cpus(), links.queues);
    queues::set_xps(sw, &ports, &plan).map_err(|m| cluster_err(name, m))?;
    netns::run_in(Some(sw), || {
        for k in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"] {
            // Absent when br_netfilter is not loaded: nothing to turn off.
            let _ = std::fs::write(format!("/proc/sys/net/bridge/{k}"), "0");
        }
        Ok(())
    })?;

    // 5. The group file.
    let group = Group::new(
        name,
        spec.job_id,
        hosts
            .iter()
            .map(|h| Member {
                rank: h.index as u16,
                addr: h.addr,
                port: spec.port,
                iface: h.iface.clone(),
                netns: Some(h.netns.clone()),
            })
            .collect(),
    )
    .with_mtu(mtu)
    .map_err(|m| cluster_err(name, m))?;
    let dir = state_dir(name);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let path = group_path(name);
    group.save(&path)?;
    Ok(Cluster { name: name.to_owned(), hosts, group, group_path: path })
}

/// Removes every namespace `up` made for `name` (which destroys the veths
/// and the bridge with them), the fault injectors pinned for its hosts and
/// its state directory, and nothing else.
/// Returns how many namespaces were removed; Ok(0) when there was nothing.
pub fn down(name: &str) -> Result<usize> {
    validate_name(name)?;
    let namespaces = cluster_namespaces(name)?;
    let dir = state_dir(name);
    if namespaces.is_empty() && !dir.exists() {
        return Ok(0);
    }
    if !is_root() {
        return Err(Error::NotRoot { what: "removing a virtual cluster".into() });
    }
    if !namespaces.is_empty() {
        let mut script = String::new();
        for (_, ns) in &namespaces {
            script.push_str(&format!("netns del {ns}\n"));
            kccl::fault::clear_namespace(ns)?;
        }
        ip_batch(name, None, &script)?;
    }
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("removing {}", dir.display()), e)),
    }
    Ok(namespaces.len())
}

/// The cluster `name` as recorded in its group file.
pub fn load(name: &str) -> Result<Cluster> {
    validate_name(name)?;
    let path = group_path(name);
    if !path.exists() {
        return Err(cluster_err(
            name,
            format!(
                "no such cluster ({} does not exist); create it with `kccl cluster up --name {name}`",
                path.display()
            ),
        ));
    }
    let group = Group::load(&path)?;
    let hosts = group
        .members
        .iter()
        .map(|m| {
            let index = usize::from(m.rank);
            Host {
                index,
                netns: m.netns.clone().unwrap_or_else(|| host_netns(name, index)),
                addr: m.addr,
                mac: host_mac(index),
                iface: m.iface.clone(),
            }
        })
        .collect();
    Ok(Cluster { name: name.to_owned(), hosts, group, group_path: path })
}

/// Resolves "h3", "3" or "kccl-<name>-h3" to a host namespace of `name`.
fn resolve_host(name: &str, host: &str) -> Result<String> {
    let namespaces = cluster_namespaces(name)?;
    let indices: Vec<usize> = namespaces
        .iter()
        .filter_map(|(k, _)| match k {
            NsKind::Host(i) => Some(*i),
            NsKind::Switch => None,
        })
        .collect();
    if indices.is_empty() {
        return Err(cluster_err(
            name,
            format!(
                "no such cluster (no namespace {}); create it with `kccl cluster up --name {name}`",
                host_netns(name, 0)
            ),
        ));
    }
    let digits = host.strip_prefix('h').unwrap_or(host);
    // Digits only: usize::from_str would also take "+3".
    let wanted = Some(digits)
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse::<usize>().ok())
        .or_else(|| match classify(name, host) {
            Some(NsKind::Host(i)) => Some(i),
            _ => None,
        });
    match wanted {
        Some(i) if indices.contains(&i) => Ok(host_netns(name, i)),
        _ => {
            let max = indices.iter().max().copied().unwrap_or(0);
            Err(cluster_err(
                name,
                format!(
                    "unknown host '{host}': valid hosts are h0..h{max} (or 0..{max}, or {}..{})",
                    host_netns(name, 0),
                    host_netns(name, max)
                ),
            ))
        }
    }
}

/// The network namespace and interface of host `host` (h3, 3 or the
/// namespace name) of cluster `name`.
pub fn host_target(name: &str, host: &str) -> Result<(String, String)> {
    validate_name(name)?;
    Ok((resolve_host(name, host)?, HOST_IFACE.to_owned()))
}

/// Runs `argv` inside host `host` of cluster `name` with inherited stdio.
///
/// The child enters the namespace with setns() between fork and exec instead
/// of going through `ip netns exec`, which remounts /sys and so hides the BPF
/// filesystem. Consequence: /sys/class/net in the child still shows the root
/// namespace's interfaces; use netlink (`ip`) to inspect the host's.
pub fn exec(name: &str, host: &str, argv: &[String]) -> Result<ExitStatus> {
    let Some((prog, args)) = argv.split_first() else {
        return Err(Error::setting("cluster exec", "no command given"));
    };
    validate_name(name)?;
    let ns = resolve_host(name, host)?;
    let p = netns::path(&ns);
    // Opened before the fork: the child must not allocate or open files
    // between fork and exec. O_CLOEXEC (Rust's default) keeps it out of the
    // executed program; setns runs before exec, so that is fine.
    let f = File::open(&p).map_err(|e| Error::io(format!("opening network namespace {}", p.display()), e))?;
    let fd = f.as_raw_fd();
    let mut cmd = Command::new(prog);
    cmd.args(args);
    // SAFETY: the hook only calls setns(2), which is async-signal-safe, on
    // an fd that stays open in the parent (f) until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let status = cmd.status().map_err(|e| Error::io(format!("running {prog:?} in {ns} (setns needs root)"), e))?;
    drop(f);
    Ok(status)
}

/// A cluster that is taken down when the guard is dropped (also on panic),
/// so tests never leak namespaces.
#[derive(Debug)]
pub struct ClusterGuard {
    pub cluster: Cluster,
}

impl ClusterGuard {
    pub fn up(spec: &ClusterSpec) -> Result<ClusterGuard> {
        Ok(ClusterGuard { cluster: up(spec)? })
    }
}

impl Drop for ClusterGuard {
    fn drop(&mut self) {
        if let Err(e) = down(&self.cluster.name) {
            crate::errln!("kccl: removing cluster '{}' failed: {e}", self.cluster.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_macs() {
        assert_eq!(host_addr(0), Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(host_addr(254), Ipv4Addr::new(10, 77, 0, 255));
        assert_eq!(host_addr(255), Ipv4Addr::new(10, 77, 1, 0));
        assert_eq!(format_mac(&host_mac(0)), "02:6b:63:00:00:01");
        assert_eq!(format_mac(&host_mac(999)), "02:6b:63:00:03:e8");
    }

    #[test]
    fn names() {
        assert!(validate_name("a").is_ok());
        assert!(validate_name("abc-123").is_ok());
        for bad in ["", "A", "a_b", "a/b", "-x", "abcdefghijklm"] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
        for _ in 0..50 {
            let n = unique_name("topology-test");
            assert!(validate_name(&n).is_ok(), "{n}");
        }
        assert!(validate_name(&unique_name("")).is_ok());
        assert!(validate_name(&unique_name("---")).is_ok());
    }

    #[test]
    fn classify_is_exact() {
        assert_eq!(classify("a", "kccl-a-sw"), Some(NsKind::Switch));
        assert_eq!(classify("a", "kccl-a-h12"), Some(NsKind::Host(12)));
        assert_eq!(classify("a", "kccl-a-b-h0"), None);
        assert_eq!(classify("a", "kccl-a-h"), None);
        assert_eq!(classify("a", "kccl-a-h01"), None);
        assert_eq!(classify("a", "kccl-a-hx"), None);
        assert_eq!(classify("a", "kccl-ab-h0"), None);
        assert_eq!(classify("a", "xkccl-a-h0"), None);
    }
}
