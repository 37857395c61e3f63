//! Group files (TOML): who is in a job and where each rank listens.
//!
//! ```toml
//! name = "demo"          # optional, for messages
//! job = 1                # job id carried in every kccl header
//! aggregator = 4         # optional: rank that aggregates allreduce (runs
//!                        # `kccl aggregator`, contributes nothing)
//! mtu = 9000             # optional: the network's MTU (default 1500); the
//!                        # aggregation chunk follows from it (src/chunk.rs)
//! chunk_bytes = 1432     # optional: a smaller chunk (multiple of 8, <= mtu - 68)
//!
//! [[member]]
//! rank = 0
//! addr = "10.77.0.1"
//! port = 47000
//! iface = "eth0"         # interface the member sends from
//! netns = "kccl-demo-h0" # optional: network namespace of a local virtual host
//! ```
//!
//! Every error names the file, the line and the field.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::Path;

use serde::Deserialize;

use crate::chunk;
use crate::error::{Error, Result};

/// Highest rank + 1 that the kernel maps hold (bpf/include/kccl_bcast.h).
pub const MAX_MEMBERS: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub rank: u16,
    pub addr: Ipv4Addr,
    pub port: u16,
    pub iface: String,
    pub netns: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    pub job_id: u32,
    /// Sorted by rank.
    pub members: Vec<Member>,
    /// The allreduce aggregator rank (`aggregator = <rank>`), if any.
    pub aggregator: Option<u16>,
    /// The network's MTU (`mtu`, default 1500): every member's interface
    /// must carry datagrams this big.
    pub mtu: u32,
    /// Aggregation chunk size in bytes: `chunk_bytes` if pinned, else the
    /// largest the MTU allows (crate::chunk).
    pub chunk_bytes: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    name: Option<String>,
    job: u32,
    aggregator: Option<toml::Spanned<i64>>,
    mtu: Option<toml::Spanned<i64>>,
    chunk_bytes: Option<toml::Spanned<i64>>,
    #[serde(default)]
    member: Vec<toml::Spanned<RawMember>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMember {
    rank: i64,
    addr: String,
    port: i64,
    iface: String,
    netns: Option<String>,
}

impl Group {
    pub fn load(path: &Path) -> Result<Group> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading group file {}", path.display()), e))?;
        Group::parse(&text, path)
    }

    /// Parses group-file text; `path` is used in error messages only.
    pub fn parse(text: &str, path: &Path) -> Result<Group> {
        let err = |line: Option<usize>, msg: String| Error::GroupFile { path: path.to_path_buf(), line, msg };
        let raw: RawGroup = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start));
            // One line: the parser's message plus the offending source line,
            // which names the field.
            let mut msg = e.message().trim().replace('\n', "; ");
            if let Some(src) = line.and_then(|l| text.lines().nth(l - 1)) {
                msg += &format!(" in `{}`", src.trim());
            }
            err(line, msg)
        })?;
        if raw.member.is_empty() {
            return Err(err(None, "no [[member]] entries: a group needs at least 2 members".into()));
        }
        let mut by_rank: BTreeMap<u16, (usize, Member)> = BTreeMap::new();
        let mut by_endpoint: BTreeMap<(Ipv4Addr, u16), u16> = BTreeMap::new();
        for spanned in &raw.member {
            let line = line_of(text, spanned.span().start);
            let m = spanned.get_ref();
            let e = |field: &str, msg: String| err(Some(line), format!("member field `{field}`: {msg}"));
            if !(0..MAX_MEMBERS as i64).contains(&m.rank) {
                return Err(e("rank", format!("{} is outside 0..{}", m.rank, MAX_MEMBERS - 1)));
            }
            let rank = m.rank as u16;
            let addr: Ipv4Addr =
                m.addr.parse().map_err(|_| e("addr", format!("'{}' is not an IPv4 address", m.addr)))?;
            if addr.is_unspecified() || addr.is_broadcast() || addr.is_multicast() {
                return Err(e("addr", format!("{addr} cannot be a member address")));
            }
            if !(1..=65535).contains(&m.port) {
                return Err(e("port", format!("{} is not a UDP port (1..65535)", m.port)));
            }
            let port = m.port as u16;
            if m.iface.is_empty() || m.iface.len() > 15 || m.iface.contains(['/', ' ']) {
                return Err(e("iface", format!("'{}' is not an interface name", m.iface)));
            }
            if let Some((first_line, _)) = by_rank.get(&rank) {
                return Err(e("rank", format!("rank {rank} is already used on line {first_line}")));
            }
            if let Some(other) = by_endpoint.insert((addr, port), rank) {
                return Err(e("port", format!("{addr}:{port} is already used by rank {other}")));
            }
            let member = Member { rank, addr, port, iface: m.iface.clone(), netns: m.netns.clone() };
            by_rank.insert(rank, (line, member));
        }
        if by_rank.len() < 2 {
            return Err(err(None, "a group needs at least 2 members".into()));
        }
        let aggregator = match &raw.aggregator {
            None => None,
            Some(a) => {
                let line = Some(line_of(text, a.span().start));
                let v = *a.get_ref();
                match u16::try_from(v).ok().filter(|r| by_rank.contains_key(r)) {
                    Some(r) => Some(r),
                    None => {
                        let ranks: Vec<String> = by_rank.keys().map(|r| r.to_string()).collect();
                        return Err(err(
                            line,
                            format!(
                                "`aggregator`: {v} is not a member rank (members: {}); name the rank that runs \
                                 `kccl aggregator`",
                                ranks.join(",")
                            ),
                        ));
                    }
                }
            }
        };
        let mtu = raw.mtu.as_ref().map_or(i64::from(chunk::DEFAULT_MTU), |m| *m.get_ref());
        let chunk_bytes = chunk::resolve(mtu, raw.chunk_bytes.as_ref().map(|c| *c.get_ref())).map_err(|m| {
            // The line of the key the message is about.
            let key = if m.starts_with("`mtu`") { raw.mtu.as_ref() } else { raw.chunk_bytes.as_ref() };
            err(key.map(|k| line_of(text, k.span().start)), m)
        })?;
        Ok(Group {
            name: raw.name.unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into()).unwrap_or_default()),
            job_id: raw.job,
            members: by_rank.into_values().map(|(_, m)| m).collect(),
            aggregator,
            mtu: mtu as u32,
            chunk_bytes,
        })
    }

    /// A group with the default aggregation settings (no aggregator rank,
    /// a 1500-byte MTU and its 1432-byte chunks).
    pub fn new(name: &str, job_id: u32, mut members: Vec<Member>) -> Group {
        members.sort_by_key(|m| m.rank);
        Group {
            name: name.to_owned(),
            job_id,
            members,
            aggregator: None,
            mtu: chunk::DEFAULT_MTU,
            chunk_bytes: chunk::DEFAULT_CHUNK_BYTES,
        }
    }

    /// The same group on a network of `mtu` bytes, its chunk following.
    pub fn with_mtu(mut self, mtu: u32) -> std::result::Result<Group, String> {
        self.chunk_bytes = chunk::for_mtu(i64::from(mtu))?;
        self.mtu = mtu;
        Ok(self)
    }

    pub fn member(&self, rank: u32) -> Result<&Member> {
        self.members.iter().find(|m| u32::from(m.rank) == rank).ok_or_else(|| Error::UnknownRank {
            rank,
            group: self.name.clone(),
            members: self.rank_list(),
        })
    }

    /// "0-9" style summary of the ranks, for error messages.
    pub fn rank_list(&self) -> String {
        let ranks: Vec<u16> = self.members.iter().map(|m| m.rank).collect();
        let mut out = String::new();
        let mut i = 0;
        while i < ranks.len() {
            let mut j = i;
            while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
                j += 1;
            }
            if !out.is_empty() {
                out.push(',');
            }
            if j > i {
                let _ = write!(out, "{}-{}", ranks[i], ranks[j]);
            } else {
                let _ = write!(out, "{}", ranks[i]);
            }
            i = j + 1;
        }
        out
    }

    /// Resolves destination ranks (deduplicated, sorted); the sender itself and
    /// unknown ranks are errors, not silently dropped.
    pub fn destinations(&self, sender: u16, ranks: &[u32]) -> Result<Vec<u16>> {
        let mut out = Vec::with_capacity(ranks.len());
        for &r in ranks {
            let m = self.member(r)?;
            if m.rank == sender {
                return Err(Error::Usage(format!("rank {sender} is the sender; it cannot be a destination")));
            }
            out.push(m.rank);
        }
        out.sort_unstable();
        out.dedup();
        if out.is_empty() {
            return Err(Error::EmptyDestinations { sender });
        }
        Ok(out)
    }

    /// Every rank but `sender`.
    pub fn all_but(&self, sender: u16) -> Vec<u16> {
        self.members.iter().map(|m| m.rank).filter(|&r| r != sender).collect()
    }

    /// Serializes to the group-file format (used by `kccl cluster up`).
    pub fn to_toml(&self) -> String {
        let mut s = format!("# kccl group file\nname = {:?}\njob = {}\n", self.name, self.job_id);
        if let Some(a) = self.aggregator {
            let _ = writeln!(s, "aggregator = {a}");
        }
        let _ = writeln!(s, "mtu = {}", self.mtu);
        if chunk::for_mtu(i64::from(self.mtu)) != Ok(self.chunk_bytes) {
            let _ = writeln!(s, "chunk_bytes = {}", self.chunk_bytes);
        }
        for m in &self.members {
            let _ = write!(
                s,
                "\n[[member]]\nrank = {}\naddr = \"{}\"\nport = {}\niface = {:?}\n",
                m.rank, m.addr, m.port, m.iface
            );
            if let Some(ns) = &m.netns {
                let _ = writeln!(s, "netns = {ns:?}");
            }
        }
        s
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_toml()).map_err(|e| Error::io(format!("writing group file {}", path.display()), e))
    }
}

fn line_of(text: &str, byte: usize) -> usize {
    text[..byte.min(text.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

/// Parses rank lists like "1-9", "1,3,5", "all" (all but the sender).
pub fn parse_ranks(spec: &str, group: &Group, sender: u16) -> Result<Vec<u32>> {
    if spec.trim() == "all" {
        return Ok(group.all_but(sender).into_iter().map(u32::from).collect());
    }
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || Error::Usage(format!("bad rank list '{spec}': '{part}' is not N or N-M"));
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Group> {
        Group::parse(text, Path::new("g.toml"))
    }

    const GOOD: &str = r#"
job = 7
[[member]]
rank = 0
addr = "10.0.0.1"
port = 4000
iface = "eth0"

[[member]]
rank = 1
addr = "10.0.0.2"
port = 4000
iface = "eth0"
netns = "h1"
"#;

    #[test]
    fn parses_and_round_trips() {
        let g = p(GOOD).expect("valid");
        assert_eq!(g.job_id, 7);
        assert_eq!(g.members.len(), 2);
        assert_eq!(g.members[1].netns.as_deref(), Some("h1"));
        let again = p(&g.to_toml()).expect("round trip");
        assert_eq!(again, g);
    }

    fn err_text(text: &str) -> String {
        p(text).expect_err("must be refused").to_string()
    }

    #[test]
    fn missing_addr_names_field_and_line() {
        let t = GOOD.replace("addr = \"10.0.0.2\"\n", "");
        let e = err_text(&t);
        assert!(e.contains("addr") && e.contains("line"), "{e}");
    }

    #[test]
    fn bad_values_name_field_and_line() {
        let e = err_text(&GOOD.replace("10.0.0.2", "10.0.0.300"));
        assert!(e.contains("line 9") && e.contains("`addr`"), "{e}");
        let e =
            err_text(&GOOD.replace("port = 4000\niface = \"eth0\"\nnetns", "port = 70000\niface = \"eth0\"\nnetns"));
        assert!(e.contains("`port`") && e.contains("70000"), "{e}");
        let e = err_text(&GOOD.replace("rank = 1", "rank = 0"));
        assert!(e.contains("already used on line 3"), "{e}");
        let e = err_text(&GOOD.replace("rank = 1", "rank = -2"));
        assert!(e.contains("`rank`"), "{e}");
        let e = err_text(&GOOD.replace("netns = \"h1\"", "colour = \"red\""));
        assert!(e.contains("colour") && e.contains("line"), "{e}");
        let e = err_text("job = 1\n");
        assert!(e.contains("member"), "{e}");
        let e = err_text(&GOOD.replace("10.0.0.2\"\nport = 4000", "10.0.0.1\"\nport = 4000"));
        assert!(e.contains("already used by rank 0"), "{e}");
    }

    #[test]
    fn aggregation_keys() {
        let g = p(GOOD).expect("valid");
        assert_eq!((g.aggregator, g.mtu, g.chunk_bytes), (None, 1500, chunk::DEFAULT_CHUNK_BYTES));
        let t = GOOD.replace("job = 7\n", "job = 7\naggregator = 1\nmtu = 4000\nchunk_bytes = 3432\n");
        let g = p(&t).expect("valid");
        assert_eq!((g.aggregator, g.chunk_bytes), (Some(1), 3432));
        assert_eq!(p(&g.to_toml()).expect("round trip"), g);
        let e = err_text(&GOOD.replace("job = 7\n", "job = 7\naggregator = 5\n"));
        assert!(e.contains("line 3") && e.contains("`aggregator`") && e.contains("members: 0,1"), "{e}");
        let e = err_text(&GOOD.replace("job = 7\n", "job = 7\naggregator = -1\n"));
        assert!(e.contains("`aggregator`") && e.contains("-1"), "{e}");
        let e = err_text(&GOOD.replace("job = 7\n", "job = 7\naggregator = \"x\"\n"));
        assert!(e.contains("aggregator") && e.contains("line 3"), "{e}");
        for bad in ["0", "4", "12", "65216", "1433", "-8", "8928"] {
            let e = err_text(&GOOD.replace("job = 7\n", &format!("job = 7\nchunk_bytes = {bad}\n")));
            assert!(e.contains("line 3") && e.contains("`chunk_bytes`") && e.contains(bad), "{bad}: {e}");
        }
        for good in ["8", "1432"] {
            let g = p(&GOOD.replace("job = 7\n", &format!("job = 7\nchunk_bytes = {good}\n"))).expect(good);
            assert_eq!(g.chunk_bytes.to_string(), good);
        }
        // The chunk follows the MTU; a pin may only be smaller.
        for (mtu, pin, want) in [(9000, None, 8928), (65535, None, 65208), (9000, Some(3432), 3432)] {
            let pin = pin.map(|c| format!("chunk_bytes = {c}\n")).unwrap_or_default();
            let g = p(&GOOD.replace("job = 7\n", &format!("job = 7\nmtu = {mtu}\n{pin}"))).expect("valid");
            assert_eq!((g.mtu, g.chunk_bytes), (mtu, want));
            assert_eq!(p(&g.to_toml()).expect("round trip"), g);
        }
        for bad in ["100", "65536", "\"jumbo\""] {
            let e = err_text(&GOOD.replace("job = 7\n", &format!("job = 7\nmtu = {bad}\n")));
            assert!(e.contains("line 3") && e.contains("mtu"), "{bad}: {e}");
        }
        let e = err_text(&GOOD.replace("job = 7\n", "job = 7\nmtu = 9000\nchunk_bytes = 9000\n"));
        assert!(e.contains("line 4") && e.contains("`chunk_bytes`"), "{e}");
    }

    #[test]
    fn destinations_refuse_unknown_empty_and_self() {
        let g = p(GOOD).expect("valid");
        assert_eq!(g.destinations(0, &[1, 1]).expect("ok"), vec![1]);
        assert!(matches!(g.destinations(0, &[5]), Err(Error::UnknownRank { rank: 5, .. })));
        assert!(matches!(g.destinations(0, &[]), Err(Error::EmptyDestinations { .. })));
        assert!(g.destinations(0, &[0]).is_err());
    }

    #[test]
    fn rank_lists() {
        let g = p(GOOD).expect("valid");
        assert_eq!(parse_ranks("1-3,7", &g, 0).expect("ok"), vec![1, 2, 3, 7]);
        assert_eq!(parse_ranks("all", &g, 0).expect("ok"), vec![1]);
        assert!(parse_ranks("3-1", &g, 0).is_err());
        assert!(parse_ranks("x", &g, 0).is_err());
        assert_eq!(g.rank_list(), "0-1");
    }
}
