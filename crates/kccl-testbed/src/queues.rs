//! Queues of a virtual cluster's links: with more than one, every veth gets
//! that many queues and the switch's ports pick a frame's queue by the CPU
//! that sends it (XPS), as a multi-queue NIC with RSS spreads its receive
//! work.  One queue is the default: see "Not the default" below.
//!
//! Why: XDP on a veth runs in the NAPI context of the receive queue the
//! frame arrives on, one CPU at a time per queue.  With one queue, every
//! contribution to an aggregator went through one NAPI context: xdp_agg
//! ran on one CPU while the other waited for answers (a 64 MiB reduce at
//! MTU 65000, root + 4 senders on 2 CPUs: 138-147 ms with one queue,
//! 104-116 ms with a queue per CPU; docs/BENCHMARKS.md).  Everything on
//! the way from a sender's sendmsg to the aggregator's veth runs on the
//! sender's CPU, so steering by that CPU puts each sender's frames on the
//! queue whose NAPI context runs where the sender runs.
//!
//! Not the default: in the kernel VM (Debian 6.18.15, tests/kernels/vm.sh),
//! the kernel-path topology tests with a queue per CPU (2) panic the guest
//! within a minute: "Oops: int3" in bpf_dispatcher_xdp_func under
//! veth_xdp_rcv_skb, while other tests attach and detach XDP programs (the
//! dispatcher is patched with text_poke while both CPUs run XDP); the same
//! tests with one queue ran clean twice (2026-12-07).  Whether the kernel
//! or qemu's CPU emulation is at fault is not known; this machine reboots
//! on a panic, so more queues are opt-in (KCCL_CLUSTER_QUEUES, `kccl
//! cluster up --queues N`) for measurements with one cluster at a time.

use std::process::{Command, Stdio};

use crate::error::{Error, Result};

/// The most queues a veth may get: beyond this, queues cost memory per
/// link (a 1000-host cluster has 2000 veth ends) for no measured gain on
/// the machines this runs on.
pub const MAX_QUEUES: u32 = 16;

/// The queues a new cluster's veths get: KCCL_CLUSTER_QUEUES if set, else
/// one (see the module comment for why not one per CPU).
pub fn default_queues() -> Result<u32> {
    match std::env::var("KCCL_CLUSTER_QUEUES") {
        Err(_) => Ok(1),
        Ok(v) => {
            v.trim().parse::<u32>().ok().filter(|q| (1..=MAX_QUEUES).contains(q)).ok_or_else(|| Error::BadSetting {
                setting: format!("KCCL_CLUSTER_QUEUES={v:?}"),
                why: format!("want a queue count in [1, {MAX_QUEUES}]"),
            })
        }
    }
}

/// The CPUs this process may run on (its affinity mask), ascending.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills
    // at most size_of::<cpu_set_t>() bytes of it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return vec![0];
    }
    // SAFETY: CPU_ISSET reads the set for indices below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// The `ip link add` words that give a veth end `queues` queues each way.
pub fn link_words(queues: u32) -> String {
    format!("numtxqueues {queues} numrxqueues {queues}")
}

/// An XPS mask in the kernel's cpumask syntax: hex words of 32 CPUs,
/// comma-separated, the highest CPUs first ("1,00000000" is CPU 32).
pub fn cpumask(cpus: &[usize]) -> String {
    let words = cpus.iter().max().map_or(1, |&m| m / 32 + 1);
    let mut w = vec![0u32; words];
    for &c in cpus {
        w[c / 32] |= 1 << (c % 32);
    }
    let mut s = format!("{:x}", w[words - 1]);
    for x in w[..words - 1].iter().rev() {
        s.push_str(&format!(",{x:08x}"));
    }
    s
}

/// Which CPUs transmit on queue q of `queues`: the allowed CPUs dealt out
/// in turn (CPU cpus[j] to queue j mod queues), so every CPU has a queue
/// and, with as many queues as CPUs, every queue one CPU.
pub fn xps_plan(cpus: &[usize], queues: u32) -> Vec<Vec<usize>> {
    let mut plan = vec![Vec::new(); queues as usize];
    for (j, &c) in cpus.iter().enumerate() {
        plan[j % queues as usize].push(c);
    }
    plan
}

/// Sets XPS on `ports` (interface names in namespace `ns`) from `plan`.
/// XPS lives in sysfs, which shows the namespace it was mounted in, so this
/// runs one shell under `ip netns exec` (which mounts the namespace's own
/// sysfs).  Queues with no CPU keep an empty mask.
pub fn set_xps(ns: &str, ports: &[String], plan: &[Vec<usize>]) -> std::result::Result<(), String> {
    if plan.len() < 2 {
        return Ok(());
    }
    let mut script = String::from("set -e\n");
    for p in ports {
        for (q, cpus) in plan.iter().enumerate().filter(|(_, c)| !c.is_empty()) {
            script.push_str(&format!("echo {} > /sys/class/net/{p}/queues/tx-{q}/xps_cpus\n", cpumask(cpus)));
        }
    }
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("running `ip netns exec {ns} sh` to set XPS: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "setting XPS on the switch ports in {ns} ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpumask_words() {
        assert_eq!(cpumask(&[0]), "1");
        assert_eq!(cpumask(&[1, 3]), "a");
        assert_eq!(cpumask(&[31]), "80000000");
        assert_eq!(cpumask(&[32]), "1,00000000");
        assert_eq!(cpumask(&[0, 33, 64]), "1,00000002,00000001");
    }

    #[test]
    fn xps_plan_deals_cpus_out() {
        assert_eq!(xps_plan(&[0, 1], 2), vec![vec![0], vec![1]]);
        assert_eq!(xps_plan(&[0, 2, 5], 2), vec![vec![0, 5], vec![2]]);
        assert_eq!(xps_plan(&[0, 1], 4), vec![vec![0], vec![1], vec![], vec![]]);
        assert_eq!(xps_plan(&[3], 1), vec![vec![3]]);
    }
}
