//! What every member command (`broadcast`, `receive`, `reduce`, `allreduce`,
//! `aggregator`, `sg-worker`, `scatter`) takes to say who it is: the group
//! file, its rank and the path; and entering the rank's namespace.

use std::path::PathBuf;

use clap::Args;
use kccl::group::Group;
use kccl::netns;
use kccl::transport::PathChoice;

use crate::error::Result;

#[derive(Args)]
pub struct MemberArgs {
    /// Group file (TOML).
    #[arg(long)]
    group: PathBuf,
    /// This process's rank.
    #[arg(long)]
    rank: u32,
    /// kernel, user or auto (kernel if BPF can be loaded, else user).
    #[arg(long, default_value = "auto")]
    path: String,
}

/// Loads the group and, for a member of a local virtual cluster, enters its
/// namespace (setns keeps /sys/fs/bpf visible, unlike `ip netns exec`).
pub fn member_setup(m: &MemberArgs) -> Result<(Group, u16, PathChoice)> {
    let group = Group::load(&m.group)?;
    let me = group.member(m.rank)?;
    if let Some(ns) = &me.netns {
        if netns::path(ns).exists() {
            netns::enter(ns)?;
        } else {
            eprintln!("kccl: namespace {ns} of rank {} does not exist here: staying in this namespace", me.rank);
        }
    }
    Ok((group.clone(), me.rank, m.path.parse()?))
}
