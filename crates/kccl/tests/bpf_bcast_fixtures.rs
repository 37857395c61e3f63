//! BPF_PROG_TEST_RUN fixtures of the TCX egress broadcast fan-out program
//! (bpf/tc_bcast.bpf.c): one table of packets in, verdicts, copies, output
//! bytes, counters and miss events out.
//!
//! Harness.  Every fixture runs in its own network namespace
//! `kccl-fx-<pid>-<n>` holding a veth pair and nothing else (IPv6 disabled so
//! that no stray ND/MLD frames show up):
//!
//! ```text
//!   netns kccl-fx-<pid>-<n>
//!   +--------------------------------------------------------------------+
//!   | BPF_PROG_TEST_RUN(kccl_tc_bcast, data_in, ctx.ifindex = fxa)       |
//!   |     |  skb->dev = fxa (program loaded, NOT attached)               |
//!   |     v                                                              |
//!   | bpf_clone_redirect(skb, fxa) --> fxa ===veth=== fxb --> AF_PACKET  |
//!   |     |                                       (ETH_P_ALL, bound fxb, |
//!   |     |  the original skb is not transmitted:  captures the clones)  |
//!   |     v  its final bytes come back as data_out                       |
//!   | verdict (TCX_NEXT / TC_ACT_SHOT), data_out, ctx_out (mark, dev)   |
//!   +--------------------------------------------------------------------+
//! ```
//!
//! The test-run skb's device is taken from `__sk_buff.ifindex` of the context
//! we pass (looked up in the namespace of the calling thread, which is why the
//! run happens on a thread that entered the namespace).  Each clone the
//! program makes is really transmitted on fxa and captured on fxb; the
//! original skb (the copy for the highest served rank) is what test_run
//! returns as output data.  So for N served destinations we expect N-1
//! captured frames plus the output.
//!
//! Expected bytes are built from scratch by the small packet builder below
//! (checksums computed over the whole header / pseudo-header + UDP), never by
//! patching the input the way the program does, and every copy's checksums
//! are also verified independently.
//!
//! The namespace is removed by a guard's Drop (also on panic).  The runner
//! goes through the whole table, prints `ok`/`FAIL` per fixture and fails at
//! the end with the list of failed fixtures and why.  Without root the test
//! prints `SKIPPED <test>: needs root (BPF_PROG_TEST_RUN)` and returns.

use std::mem::{offset_of, size_of};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use kccl::error::is_root;
use kccl::group::Member;
use kccl::kernel::{BcastFanout, BcastStats, MissEvent, MissReason, CLONE_MARK};
use kccl::netns;
use kccl::skel::types::__sk_buff;
use kccl::wire::{
    BcastAck, Header, ACK_GAP, F_FANOUT, F_LAST_FRAG, T_AGG, T_AGG_ABORT, T_AGG_ACKS, T_AGG_PENDING, T_AGG_RECEIPT,
    T_BCAST, T_BCAST_ACK, VERSION,
};

mod support;
use support::{csum_add, csum_fold, inet_csum, our_namespaces, pseudo_sum, run, Capture, NetnsGuard};

/// TCX_NEXT (-1): tc_bcast hands every packet it lets out on to the next
/// program of the TCX chain (a fault injector behind it must see them).
const TCX_NEXT: u32 = u32::MAX;
const TC_ACT_SHOT: u32 = 2;

const JOB: u32 = 7;
const MSG_SEQ: u32 = 42;
const FRAG_OFF: u32 = 0x1_0000;
const PAYLOAD_LEN: usize = 100;
const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0];
const SRC_IP: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 100);
const SPORT: u16 = 40000;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_IPV6: u16 = 0x86dd;

// ---------------------------------------------------------------------------
// Members of the fixture group: rank r lives at 10.9.(r>>8).(r&255), UDP port
// 47000+r, MAC 02:00:00:00:(r>>8):(r&255) (10.9.0.r and 02:..:r for r < 256).

fn ip_of(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, (rank >> 8) as u8, rank as u8)
}

fn port_of(rank: u16) -> u16 {
    47000 + rank
}

fn mac_of(rank: u16) -> [u8; 6] {
    [0x02, 0, 0, 0, (rank >> 8) as u8, rank as u8]
}

fn member(rank: u16) -> Member {
    Member { rank, addr: ip_of(rank), port: port_of(rank), iface: "fxa".into(), netns: None }
}

// ---------------------------------------------------------------------------
// Packet builder.

/// Ethernet + IPv4 + UDP frame.
#[derive(Clone, Debug)]
struct Udp4 {
    eth_dst: [u8; 6],
    ip_id: u16,
    /// The IPv4 flags + fragment offset field (host order).
    frag: u16,
    /// IPv4 options (a multiple of 4 bytes).
    options: Vec<u8>,
    daddr: Ipv4Addr,
    dport: u16,
    /// Send UDP checksum 0 ("no checksum").
    no_udp_csum: bool,
    /// Value of the UDP length field instead of the real length.
    udp_len_field: Option<u16>,
    payload: Vec<u8>,
}

impl Udp4 {
    fn new(eth_dst: [u8; 6], daddr: Ipv4Addr, dport: u16, payload: Vec<u8>) -> Udp4 {
        Udp4 {
            eth_dst,
            ip_id: 0x1234,
            frag: 0x4000, // DF
            options: Vec::new(),
            daddr,
            dport,
            no_udp_csum: false,
            udp_len_field: None,
            payload,
        }
    }

    /// The same datagram addressed to `rank` (what a copy for it must be).
    /// The copy for `rank`: addressed to it, without KCCL_F_FANOUT (tc_bcast
    /// clears it before cloning so that no copy is ever fanned out again).
    fn to_rank(&self, rank: u16) -> Udp4 {
        Udp4 { eth_dst: mac_of(rank), daddr: ip_of(rank), dport: port_of(rank), ..self.without_fanout() }
    }

    /// The same packet with the FANOUT bit of its kccl header cleared.
    fn without_fanout(&self) -> Udp4 {
        let mut p = self.clone();
        if p.payload.len() >= 8 {
            p.payload[7] &= !(F_FANOUT as u8); // flags: bytes 6..8, big-endian
        }
        p
    }

    fn build(&self) -> Vec<u8> {
        assert!(self.options.len() % 4 == 0 && self.options.len() <= 40);
        let ihl = 5 + self.options.len() / 4;
        let udp_len = 8 + self.payload.len();
        let tot_len = ihl * 4 + udp_len;
        let mut f = Vec::with_capacity(14 + tot_len);
        f.extend_from_slice(&self.eth_dst);
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&ETH_P_IP.to_be_bytes());
        // IPv4
        let ip_start = f.len();
        f.push(0x40 | ihl as u8);
        f.push(0); // tos
        f.extend_from_slice(&(tot_len as u16).to_be_bytes());
        f.extend_from_slice(&self.ip_id.to_be_bytes());
        f.extend_from_slice(&self.frag.to_be_bytes());
        f.push(64); // ttl
        f.push(17); // UDP
        f.extend_from_slice(&[0, 0]); // checksum, below
        f.extend_from_slice(&SRC_IP.octets());
        f.extend_from_slice(&self.daddr.octets());
        f.extend_from_slice(&self.options);
        let c = inet_csum(&f[ip_start..]);
        f[ip_start + 10..ip_start + 12].copy_from_slice(&c.to_be_bytes());
        // UDP
        let udp_start = f.len();
        let len_field = self.udp_len_field.unwrap_or(udp_len as u16);
        f.extend_from_slice(&SPORT.to_be_bytes());
        f.extend_from_slice(&self.dport.to_be_bytes());
        f.extend_from_slice(&len_field.to_be_bytes());
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&self.payload);
        if !self.no_udp_csum {
            let s = csum_add(pseudo_sum(SRC_IP, self.daddr, udp_len as u16), &f[udp_start..]);
            let mut c = !csum_fold(s);
            if c == 0 {
                c = 0xffff; // RFC 768: a computed 0 is sent as all ones
            }
            f[udp_start + 6..udp_start + 8].copy_from_slice(&c.to_be_bytes());
        }
        f
    }
}

fn header(dst_mask: u64, mask_base: u16) -> Header {
    Header {
        version: VERSION,
        msg_type: T_BCAST,
        flags: F_FANOUT | F_LAST_FRAG,
        job_id: JOB,
        src_rank: 0,
        mask_base,
        dst_mask,
        msg_seq: MSG_SEQ,
        frag_off: FRAG_OFF,
        msg_len: FRAG_OFF + PAYLOAD_LEN as u32,
        payload_len: PAYLOAD_LEN as u16,
        agg_op: 0,
        dtype: 0,
    }
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

/// A kccl datagram with header `h` and PAYLOAD_LEN patterned bytes, addressed
/// to `first` (the first destination, as the runtime sends it).
fn kccl_udp(h: &Header, first: u16) -> Udp4 {
    kccl_udp_n(h, first, PAYLOAD_LEN)
}

/// The same with `n` payload bytes.
fn kccl_udp_n(h: &Header, first: u16, n: usize) -> Udp4 {
    let mut p = h.to_bytes().to_vec();
    p.extend_from_slice(&pattern(n));
    Udp4::new(mac_of(first), ip_of(first), port_of(first), p)
}

fn mask_of(ranks: &[u16], base: u16) -> u64 {
    ranks.iter().fold(0u64, |m, &r| m | 1u64 << (r - base))
}

// ---------------------------------------------------------------------------
// Independent checks of a captured frame.

/// Verifies the IPv4 header checksum and the UDP checksum (over pseudo-header
/// + UDP; 0 means "no checksum" and passes) of an Ethernet/IPv4/UDP frame.
fn verify_checksums(f: &[u8]) -> Result<(), String> {
    if f.len() < 34 || u16::from_be_bytes([f[12], f[13]]) != ETH_P_IP {
        return Err("not an IPv4 frame".into());
    }
    let ihl = usize::from(f[14] & 0xf) * 4;
    let ip = f.get(14..14 + ihl).ok_or("IPv4 header truncated")?;
    if csum_fold(csum_add(0, ip)) != 0xffff {
        return Err(format!("bad IPv4 header checksum {:#06x}", u16::from_be_bytes([ip[10], ip[11]])));
    }
    let tot_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let udp = f.get(14 + ihl..14 + tot_len).ok_or("IPv4 total length beyond the frame")?;
    let udp_len = u16::from_be_bytes([udp[4], udp[5]]);
    if usize::from(udp_len) != udp.len() {
        return Err(format!("UDP length {udp_len} but {} bytes", udp.len()));
    }
    let check = u16::from_be_bytes([udp[6], udp[7]]);
    if check == 0 {
        return Ok(());
    }
    let saddr = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let daddr = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    if csum_fold(csum_add(pseudo_sum(saddr, daddr, udp_len), udp)) != 0xffff {
        return Err(format!("bad UDP checksum {check:#06x}"));
    }
    Ok(())
}

fn describe(f: &[u8]) -> String {
    let mac = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(":");
    if f.len() < 14 {
        return format!("{} bytes (runt)", f.len());
    }
    let proto = u16::from_be_bytes([f[12], f[13]]);
    let mut s = format!("{} bytes dst {} type {proto:#06x}", f.len(), mac(&f[0..6]));
    if proto == ETH_P_IP && f.len() >= 34 {
        let ihl = usize::from(f[14] & 0xf) * 4;
        s += &format!(" ip {}.{}.{}.{} ipcsum {:#06x}", f[30], f[31], f[32], f[33], u16::from_be_bytes([f[24], f[25]]));
        if f[23] == 17 && f.len() >= 14 + ihl + 8 {
            let u = &f[14 + ihl..];
            s += &format!(
                " udp dport {} csum {:#06x}",
                u16::from_be_bytes([u[2], u[3]]),
                u16::from_be_bytes([u[6], u[7]])
            );
        }
    }
    s
}

/// "" when equal, else where and how `got` differs from `want`.
fn diff(want: &[u8], got: &[u8]) -> String {
    if want == got {
        return String::new();
    }
    let at = want.iter().zip(got).position(|(a, b)| a != b).unwrap_or(want.len().min(got.len()));
    format!(
        "first difference at byte {at} (want {:02x?}, got {:02x?}); want [{}], got [{}]",
        want.get(at..(at + 4).min(want.len())).unwrap_or(&[]),
        got.get(at..(at + 4).min(got.len())).unwrap_or(&[]),
        describe(want),
        describe(got)
    )
}

// ---------------------------------------------------------------------------
// The table.

struct Fixture {
    name: String,
    /// The program's cfg_job_id.
    job: u32,
    /// set_member(rank, mac) before the run (None = unresolved neighbour).
    members: Vec<(u16, Option<[u8; 6]>)>,
    /// Ranks set and then removed with clear_member.
    cleared: Vec<u16>,
    input: Vec<u8>,
    /// __sk_buff.mark of the test-run context.
    mark: u32,
    verdict: u32,
    /// Frames that must leave fxa (the clones), in any order.
    copies: Vec<Vec<u8>>,
    /// Bytes of the original skb after the run.
    output: Vec<u8>,
    /// __sk_buff.mark after the run.
    out_mark: u32,
    stats: BcastStats,
    misses: Vec<(u16, MissReason)>,
    /// Every copy and the output must carry valid IPv4 and UDP checksums.
    checksums: bool,
    /// Interface set down after the setup (to make clones fail).
    down: Option<&'static str>,
}

fn resolved(ranks: impl IntoIterator<Item = u16>) -> Vec<(u16, Option<[u8; 6]>)> {
    ranks.into_iter().map(|r| (r, Some(mac_of(r)))).collect()
}

/// A packet the program must pass untouched (members 1..9 are configured so
/// that nothing is skipped for lack of them).
fn untouched(name: &str, input: Vec<u8>, stats: BcastStats) -> Fixture {
    Fixture {
        name: name.into(),
        job: JOB,
        members: resolved(1..=9),
        cleared: vec![],
        output: input.clone(),
        input,
        mark: 0,
        verdict: TCX_NEXT,
        copies: vec![],
        out_mark: 0,
        stats,
        misses: vec![],
        checksums: false,
        down: None,
    }
}

fn passed() -> BcastStats {
    BcastStats { passed: 1, ..Default::default() }
}

fn malformed() -> BcastStats {
    BcastStats { malformed: 1, ..Default::default() }
}

/// A fan-out of `pkt` whose clones serve `clones` and whose original ends up
/// addressed to `last` (None: unchanged input).
fn fanout(name: &str, members: Vec<(u16, Option<[u8; 6]>)>, pkt: &Udp4, clones: &[u16], last: Option<u16>) -> Fixture {
    let served = clones.len() as u64 + u64::from(last.is_some());
    let input = pkt.build();
    Fixture {
        name: name.into(),
        job: JOB,
        members,
        cleared: vec![],
        copies: clones.iter().map(|&r| pkt.to_rank(r).build()).collect(),
        output: last.map(|r| pkt.to_rank(r).build()).unwrap_or_else(|| pkt.without_fanout().build()),
        input,
        mark: 0,
        verdict: if last.is_some() { TCX_NEXT } else { TC_ACT_SHOT },
        out_mark: CLONE_MARK,
        stats: BcastStats { fanout_pkts: 1, copies: served, ..Default::default() },
        misses: vec![],
        checksums: true,
        down: None,
    }
}

fn fixtures() -> Vec<Fixture> {
    let mut t = Vec::new();
    let ranks = |r: std::ops::RangeInclusive<u16>| r.collect::<Vec<u16>>();

    // 1. Nine destinations, ranks 1..9 of a group with sender 0.
    {
        let dst = ranks(1..=9);
        let pkt = kccl_udp(&header(mask_of(&dst, 0), 0), 1);
        t.push(fanout("nine destinations (ranks 1..9)", resolved(1..=9), &pkt, &dst[..8], Some(9)));
    }
    // 2. Wide masks.
    {
        let dst = ranks(64..=127);
        let pkt = kccl_udp(&header(u64::MAX, 64), 64);
        t.push(fanout(
            "64 destinations (ranks 64..127, mask_base 64)",
            resolved(64..=127),
            &pkt,
            &dst[..63],
            Some(127),
        ));
    }
    {
        let dst = ranks(32..=63);
        let pkt = kccl_udp(&header(0xffff_ffff_0000_0000, 0), 32);
        t.push(fanout(
            "32 destinations (ranks 32..63, upper mask half)",
            resolved(32..=63),
            &pkt,
            &dst[..31],
            Some(63),
        ));
    }
    {
        let dst: Vec<u16> = (129..=191).step_by(2).collect();
        let pkt = kccl_udp(&header(0xaaaa_aaaa_aaaa_aaaa, 128), 129);
        t.push(fanout(
            "32 destinations (odd ranks 129..191, mask_base 128)",
            resolved(128..=191),
            &pkt,
            &dst[..31],
            Some(191),
        ));
    }
    {
        let pkt = kccl_udp(&header(1 << 63 | 1, 4032), 4032);
        t.push(fanout("last window (ranks 4032 and 4095)", resolved([4032, 4095]), &pkt, &[4032], Some(4095)));
    }
    {
        let pkt = kccl_udp(&header(1 << 5, 0), 5);
        t.push(fanout("one destination, already addressed to it", resolved(1..=9), &pkt, &[], Some(5)));
    }
    {
        let pkt = kccl_udp(&header(1 << 6, 0), 5);
        t.push(fanout("one destination, packet addressed to another rank", resolved(1..=9), &pkt, &[], Some(6)));
    }
    {
        // Initial address unrelated to any member: the rewrite starts from it.
        let mut pkt = kccl_udp(&header(mask_of(&[1, 2], 0), 0), 1);
        pkt.eth_dst = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee];
        pkt.daddr = Ipv4Addr::new(192, 168, 77, 200);
        pkt.dport = 9999;
        t.push(fanout("packet addressed to a non-member", resolved(1..=9), &pkt, &[1], Some(2)));
    }
    {
        // IPv4 options: the UDP header is 4 bytes further.
        let mut pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        pkt.options = vec![0x94, 0x04, 0x00, 0x00]; // router alert
        t.push(fanout("IPv4 with options (ihl 6)", resolved(1..=9), &pkt, &[1, 2], Some(3)));
    }
    {
        let mut f = fanout(
            "foreign skb mark 0x1234 still fans out",
            resolved(1..=9),
            &kccl_udp(&header(mask_of(&[1, 2], 0), 0), 1),
            &[1],
            Some(2),
        );
        f.mark = 0x1234;
        t.push(f);
    }

    // 3. Not kccl: passed untouched.
    {
        let pkt = Udp4::new(mac_of(1), ip_of(1), 53, pattern(60));
        t.push(untouched("plain UDP (no kccl magic)", pkt.build(), passed()));
    }
    {
        let mut f = Udp4::new(mac_of(1), ip_of(1), 80, vec![]).build();
        f.truncate(14);
        // IPv4 header with protocol TCP + a 20-byte TCP header + kccl bytes.
        let hdr = header(mask_of(&[1, 2], 0), 0).to_bytes();
        let tot = 20 + 20 + hdr.len();
        let mut ip = vec![0x45, 0, (tot >> 8) as u8, tot as u8, 0, 1, 0x40, 0, 64, 6, 0, 0];
        ip.extend_from_slice(&SRC_IP.octets());
        ip.extend_from_slice(&ip_of(1).octets());
        let c = inet_csum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend_from_slice(&ip);
        f.extend_from_slice(&[0x9c, 0x40, 0xb7, 0x99, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x18, 0xff, 0xff, 0, 0, 0, 0]);
        f.extend_from_slice(&hdr);
        t.push(untouched("TCP segment carrying kccl bytes", f, passed()));
    }
    {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
        f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]); // Ethernet/IPv4, request
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&SRC_IP.octets());
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&ip_of(1).octets());
        t.push(untouched("ARP request", f, passed()));
    }
    {
        let mut udp = Vec::new();
        let mut p = header(mask_of(&[1, 2], 0), 0).to_bytes().to_vec();
        p.extend_from_slice(&pattern(PAYLOAD_LEN));
        udp.extend_from_slice(&SPORT.to_be_bytes());
        udp.extend_from_slice(&port_of(1).to_be_bytes());
        udp.extend_from_slice(&((8 + p.len()) as u16).to_be_bytes());
        udp.extend_from_slice(&[0x12, 0x34]);
        udp.extend_from_slice(&p);
        let mut f = vec![0x33, 0x33, 0, 0, 0, 1];
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
        f.extend_from_slice(&[0x60, 0, 0, 0]);
        f.extend_from_slice(&(udp.len() as u16).to_be_bytes());
        f.extend_from_slice(&[17, 64]);
        f.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x64]);
        f.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01]);
        f.extend_from_slice(&udp);
        t.push(untouched("IPv6 UDP carrying a kccl fan-out header", f, passed()));
    }
    {
        // BPF_PROG_TEST_RUN itself refuses (EINVAL) frames of ETH_HLEN bytes
        // or less, and IPv4/IPv6 frames without a complete L3 header, so the
        // shortest runt we can feed is ETH_HLEN + 1 of another EtherType.
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&0x88b5u16.to_be_bytes()); // local experimental
        f.push(0x4b);
        t.push(untouched("runt: 15-byte frame (EtherType 0x88b5)", f, passed()));
    }
    {
        // Complete IPv4 header (protocol UDP), UDP header and magic cut short.
        let pkt = kccl_udp(&header(mask_of(&[1, 2], 0), 0), 1);
        let mut f = pkt.build();
        f.truncate(14 + 20 + 8 + 2);
        t.push(untouched("runt: UDP datagram cut inside the kccl magic", f, passed()));
    }
    {
        let mut pkt = kccl_udp(&header(mask_of(&[1, 2], 0), 0), 1);
        pkt.frag = 0x2000; // MF, offset 0
        t.push(untouched("IPv4 first fragment (MF) of a kccl packet", pkt.build(), passed()));
    }
    {
        let mut pkt = kccl_udp(&header(mask_of(&[1, 2], 0), 0), 1);
        pkt.frag = 0x0010; // offset 128 bytes, last fragment
        t.push(untouched("IPv4 later fragment starting with kccl bytes", pkt.build(), passed()));
    }

    // 4. User-space path packet (no FANOUT flag).
    {
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.flags = F_LAST_FRAG;
        t.push(untouched("kccl without KCCL_F_FANOUT", kccl_udp(&h, 1).build(), passed()));
    }

    // 5. Our own clone coming back: untouched, not counted.
    {
        let mut f = untouched(
            "marked CLONE_MARK (re-entering clone)",
            kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1).build(),
            BcastStats::default(),
        );
        f.mark = CLONE_MARK;
        f.out_mark = CLONE_MARK;
        t.push(f);
    }

    // 6. Malformed kccl packets.
    {
        let h = header(mask_of(&[1, 2, 3], 0), 0).to_bytes();
        let pkt = Udp4::new(mac_of(1), ip_of(1), port_of(1), h[..20].to_vec());
        t.push(untouched("malformed: truncated header (UDP payload 20 bytes)", pkt.build(), malformed()));
    }
    {
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.version = 2;
        t.push(untouched("malformed: version 2", kccl_udp(&h, 1).build(), malformed()));
    }
    {
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.msg_type = 0;
        t.push(untouched("malformed: type 0", kccl_udp(&h, 1).build(), malformed()));
    }
    {
        // An aggregation contribution leaving a host that also broadcasts is
        // unicast: passed, even with FANOUT and a mask.
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.msg_type = T_AGG;
        t.push(untouched(
            "type 2 (aggregation) with FANOUT: passed, not fanned out",
            kccl_udp(&h, 1).build(),
            passed(),
        ));
    }
    for (ty, name) in
        [(T_AGG_PENDING, "PENDING"), (T_AGG_RECEIPT, "RECEIPT"), (T_AGG_ACKS, "ACKS"), (T_AGG_ABORT, "ABORT")]
    {
        // The other aggregation types leaving the host: passed and counted
        // as such, never malformed.
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.msg_type = ty;
        t.push(untouched(&format!("type {ty} (aggregation {name}): passed"), kccl_udp(&h, 1).build(), passed()));
    }

    // 6b. Broadcast ACKs (KCCL_T_BCAST_ACK): a receiver's answer to the
    // sender is unicast; tc_bcast never fans it out.
    {
        let ack = BcastAck {
            pkt_bytes: PAYLOAD_LEN as u32,
            npkts: 40,
            cum: 16,
            bm_first: 16,
            bm_bits: 16,
            flags: ACK_GAP,
            bitmap: vec![0xf7, 0xff],
        };
        let mut body = Vec::new();
        ack.encode(&mut body);
        let h = Header {
            version: VERSION,
            msg_type: T_BCAST_ACK,
            flags: 0,
            job_id: JOB,
            src_rank: 3,
            mask_base: 0,
            dst_mask: 1,
            msg_seq: MSG_SEQ,
            frag_off: 0,
            msg_len: 40 * PAYLOAD_LEN as u32,
            payload_len: body.len() as u16,
            agg_op: 0,
            dtype: 0,
        };
        let mut p = h.to_bytes().to_vec();
        p.extend_from_slice(&body);
        let pkt = Udp4::new(mac_of(0), ip_of(0), 40_000, p.clone());
        t.push(untouched("type 5 ACK to the sender's port: passed untouched", pkt.build(), passed()));
        // A forged ACK asking for a fan-out to 1..9 is still just passed.
        let mut forged = h;
        forged.flags = F_FANOUT;
        forged.dst_mask = mask_of(&(1..=9).collect::<Vec<u16>>(), 0);
        let mut p = forged.to_bytes().to_vec();
        p.extend_from_slice(&body);
        let pkt = Udp4::new(mac_of(1), ip_of(1), port_of(1), p);
        t.push(untouched("type 5 ACK with FANOUT and mask 1..9: passed, not fanned out", pkt.build(), passed()));
        // An ACK of another job: passed too (type checked before the job).
        let mut other = h;
        other.job_id = JOB + 1;
        let mut p = other.to_bytes().to_vec();
        p.extend_from_slice(&body);
        let pkt = Udp4::new(mac_of(0), ip_of(0), 40_000, p);
        t.push(untouched("type 5 ACK of another job: passed", pkt.build(), passed()));
    }
    // 6c. A retransmission: a middle packet (no LAST_FRAG) whose mask holds
    // exactly the receivers that reported it missing, 3 and 7 of 1..9:
    // copies to 3 and 7 only, each keeping the sender's source address and
    // port (where the receivers' ACKs go).
    {
        let mut h = header(mask_of(&[3, 7], 0), 0);
        h.flags = F_FANOUT;
        h.msg_len = FRAG_OFF + 3 * PAYLOAD_LEN as u32;
        let pkt = kccl_udp(&h, 3);
        t.push(fanout("retransmission to exactly ranks 3 and 7 of 1..9", resolved(1..=9), &pkt, &[3], Some(7)));
    }
    for claimed in [PAYLOAD_LEN - 1, PAYLOAD_LEN + 1, 0] {
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.payload_len = claimed as u16;
        let name = format!("malformed: payload_len {claimed} for {PAYLOAD_LEN} bytes");
        t.push(untouched(&name, kccl_udp(&h, 1).build(), malformed()));
    }
    {
        let mut pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        pkt.udp_len_field = Some((8 + 40 + PAYLOAD_LEN + 60) as u16);
        t.push(untouched("malformed: UDP length beyond the packet", pkt.build(), malformed()));
    }
    t.push(untouched("malformed: dst_mask 0", kccl_udp(&header(0, 0), 1).build(), malformed()));
    t.push(untouched("malformed: mask_base 32", kccl_udp(&header(1, 32), 32).build(), malformed()));
    t.push(untouched("malformed: mask_base 4096 (beyond members)", kccl_udp(&header(1, 4096), 1).build(), malformed()));

    // 7. Another job.
    {
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.job_id = JOB + 1;
        t.push(untouched("other job id", kccl_udp(&h, 1).build(), BcastStats { other_job: 1, ..Default::default() }));
    }

    // 8. Unresolved neighbours.
    let unresolved = |bad: &[u16]| -> Vec<(u16, Option<[u8; 6]>)> {
        (1..=9).map(|r| (r, if bad.contains(&r) { None } else { Some(mac_of(r)) })).collect()
    };
    {
        let pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        let mut f = fanout("unresolved middle rank 2 of 1,2,3", unresolved(&[2]), &pkt, &[1], Some(3));
        f.stats.missed = 1;
        f.misses = vec![(2, MissReason::Unresolved)];
        t.push(f);
    }
    {
        // The highest rank is the original's: it is left to user space, the
        // clones serve 1 and 2 and the original (last rewritten for 2) is
        // dropped.
        let pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        let mut f = fanout("unresolved highest rank 3 of 1,2,3", unresolved(&[3]), &pkt, &[1, 2], None);
        f.output = pkt.to_rank(2).build();
        f.stats.missed = 1;
        f.misses = vec![(3, MissReason::Unresolved)];
        t.push(f);
    }
    {
        let pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        let mut f = fanout("all of 1,2,3 unresolved", unresolved(&[1, 2, 3]), &pkt, &[], None);
        f.stats.missed = 3;
        f.misses = vec![(1, MissReason::Unresolved), (2, MissReason::Unresolved), (3, MissReason::Unresolved)];
        t.push(f);
    }

    // 9. Ranks without a member.
    {
        let members = resolved([1, 2, 3, 5, 6]);
        let pkt = kccl_udp(&header(mask_of(&[1, 4, 6], 0), 0), 1);
        let mut f = fanout("rank 4 not in members (1,4,6)", members, &pkt, &[1], Some(6));
        f.stats.missed = 1;
        f.misses = vec![(4, MissReason::NotMember)];
        t.push(f);
    }
    {
        let pkt = kccl_udp(&header(mask_of(&[1, 2], 0), 0), 1);
        let mut f = fanout("highest rank 2 removed with clear_member", resolved([1, 2]), &pkt, &[1], None);
        f.cleared = vec![2];
        f.output = pkt.to_rank(1).build();
        f.stats.missed = 1;
        f.misses = vec![(2, MissReason::NotMember)];
        t.push(f);
    }

    // Clones that cannot be transmitted (the veth peer is down, so
    // bpf_clone_redirect returns NET_XMIT_DROP): reported, the original still
    // serves the highest rank.
    {
        let pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        let mut f = fanout("clones fail: veth peer fxb down", resolved(1..=9), &pkt, &[], Some(3));
        f.down = Some("fxb");
        f.stats.missed = 2;
        f.misses = vec![(1, MissReason::CloneFailed), (2, MissReason::CloneFailed)];
        t.push(f);
    }
    {
        let pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        let mut f = fanout("clones fail: fxa down", resolved(1..=9), &pkt, &[], Some(3));
        f.down = Some("fxa");
        f.stats.missed = 2;
        f.misses = vec![(1, MissReason::CloneFailed), (2, MissReason::CloneFailed)];
        t.push(f);
    }

    // Sizes and trailers.
    {
        let mut h = header(mask_of(&[1, 2, 3, 4], 0), 0);
        h.payload_len = kccl::wire::MAX_PAYLOAD_1500 as u16;
        h.msg_len = FRAG_OFF + h.payload_len as u32;
        let pkt = kccl_udp_n(&h, 1, kccl::wire::MAX_PAYLOAD_1500);
        assert_eq!(pkt.build().len(), 1514);
        t.push(fanout("full 1500-byte MTU packet, 4 destinations", resolved(1..=9), &pkt, &[1, 2, 3], Some(4)));
    }
    {
        let mut h = header(mask_of(&[1, 2, 3], 0), 0);
        h.payload_len = 0;
        h.msg_len = 0;
        h.frag_off = FRAG_OFF;
        let pkt = kccl_udp_n(&h, 1, 0);
        t.push(fanout("empty payload (payload_len 0)", resolved(1..=9), &pkt, &[1, 2], Some(3)));
    }
    {
        // Bytes after the IPv4 datagram (e.g. a link-layer trailer) are
        // neither part of UDP nor touched.
        let pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        let trailer = [0xde, 0xad, 0xbe, 0xef, 0x00, 0x01];
        let with_trailer = |mut v: Vec<u8>| {
            v.extend_from_slice(&trailer);
            v
        };
        let mut f = fanout("6 trailing bytes after the datagram", resolved(1..=9), &pkt, &[1, 2], Some(3));
        f.input = with_trailer(f.input);
        f.output = with_trailer(f.output);
        f.copies = f.copies.into_iter().map(with_trailer).collect();
        t.push(f);
    }

    // 10. No UDP checksum: copies keep 0.
    {
        let mut pkt = kccl_udp(&header(mask_of(&[1, 2, 3], 0), 0), 1);
        pkt.no_udp_csum = true;
        t.push(fanout("UDP checksum 0 stays 0", resolved(1..=9), &pkt, &[1, 2], Some(3)));
    }

    t
}

// ---------------------------------------------------------------------------
// Harness.

/// What one test run produced.
struct Observed {
    fxa: u32,
    verdict: u32,
    output: Vec<u8>,
    ctx_mark: u32,
    ctx_ifindex: u32,
    captured: Vec<Vec<u8>>,
    stats: BcastStats,
    misses: Vec<MissEvent>,
}

fn ctx_u32(ctx: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(ctx[off..off + 4].try_into().unwrap())
}

/// Runs inside the fixture's namespace.
fn observe(
    job: u32,
    members: Vec<(u16, Option<[u8; 6]>)>,
    cleared: Vec<u16>,
    input: Vec<u8>,
    mark: u32,
) -> kccl::Result<Observed> {
    let fxa = netns::ifindex("fxa", None)?;
    let fxb = netns::ifindex("fxb", None)?;
    let fan = BcastFanout::load(job, fxa)?;
    for &(r, mac) in &members {
        fan.set_member(&member(r), mac)?;
    }
    for &r in &cleared {
        fan.set_member(&member(r), Some(mac_of(r)))?;
        fan.clear_member(r)?;
    }
    let cap = Capture::open(fxb)?;
    let stale = cap.drain(Duration::from_millis(20))?;
    if !stale.is_empty() {
        return Err(kccl::Error::Usage(format!(
            "{} stray frame(s) on fxb before the run: {}",
            stale.len(),
            describe(&stale[0])
        )));
    }
    let before = fan.stats()?;
    let early = fan.drain_misses();
    if !early.is_empty() {
        return Err(kccl::Error::Usage(format!("miss events before the run: {early:?}")));
    }

    // A zeroed __sk_buff with ifindex (picks skb->dev) and mark.
    let mut ctx_in = vec![0u8; size_of::<__sk_buff>()];
    ctx_in[offset_of!(__sk_buff, ifindex)..][..4].copy_from_slice(&fxa.to_ne_bytes());
    ctx_in[offset_of!(__sk_buff, mark)..][..4].copy_from_slice(&mark.to_ne_bytes());
    let mut ctx_out = vec![0u8; ctx_in.len()];
    let mut data_out = vec![0u8; input.len() + 512];
    let (verdict, output) = {
        let out = fan
            .skel()
            .progs
            .kccl_tc_bcast
            .test_run(libbpf_rs::ProgramInput {
                data_in: Some(&input),
                data_out: Some(&mut data_out),
                context_in: Some(&mut ctx_in),
                context_out: Some(&mut ctx_out),
                ..Default::default()
            })
            .map_err(|e| kccl::Error::Bpf { step: "BPF_PROG_TEST_RUN of kccl_tc_bcast".into(), source: e })?;
        (out.return_value, out.data.map(|d| d.to_vec()).unwrap_or_default())
    };
    let captured = cap.drain(Duration::from_millis(150))?;
    let stats = fan.stats()?.delta(&before);
    let misses = fan.drain_misses();
    Ok(Observed {
        fxa,
        verdict,
        output,
        ctx_mark: ctx_u32(&ctx_out, offset_of!(__sk_buff, mark)),
        ctx_ifindex: ctx_u32(&ctx_out, offset_of!(__sk_buff, ifindex)),
        captured,
        stats,
        misses,
    })
}

/// Runs one fixture in a fresh namespace; Err lists everything that differed.
fn run_fixture(n: usize, fx: &Fixture) -> Result<(), Vec<String>> {
    let ns = format!("kccl-fx-{}-{n}", std::process::id());
    let _guard = NetnsGuard::up(ns.clone()).map_err(|e| vec![format!("namespace setup: {e}")])?;
    if let Some(dev) = fx.down {
        run(&["ip", "-n", &ns, "link", "set", dev, "down"]).map_err(|e| vec![format!("namespace setup: {e}")])?;
    }
    let (job, members, cleared, input, mark) =
        (fx.job, fx.members.clone(), fx.cleared.clone(), fx.input.clone(), fx.mark);
    let o = netns::run_in(Some(&ns), move || observe(job, members, cleared, input, mark))
        .map_err(|e| vec![format!("run: {e}")])?;

    let mut errs = Vec::new();
    let verdict_name = |v: u32| match v {
        TCX_NEXT => "TCX_NEXT".to_string(),
        TC_ACT_SHOT => "TC_ACT_SHOT".to_string(),
        x => format!("{x}"),
    };
    if o.verdict != fx.verdict {
        errs.push(format!("verdict {} (want {})", verdict_name(o.verdict), verdict_name(fx.verdict)));
    }
    if o.ctx_ifindex != o.fxa {
        errs.push(format!("skb->dev was ifindex {} after the run, not fxa ({})", o.ctx_ifindex, o.fxa));
    }
    if o.ctx_mark != fx.out_mark {
        errs.push(format!("skb mark {:#x} after the run (want {:#x})", o.ctx_mark, fx.out_mark));
    }
    let d = diff(&fx.output, &o.output);
    if !d.is_empty() {
        errs.push(format!("output skb: {d}"));
    }
    if o.stats != fx.stats {
        errs.push(format!("counter deltas {:?} (want {:?})", o.stats, fx.stats));
    }
    let want_misses: Vec<MissEvent> = fx
        .misses
        .iter()
        .map(|&(rank, reason)| MissEvent { job_id: JOB, msg_seq: MSG_SEQ, frag_off: FRAG_OFF, rank, reason })
        .collect();
    if o.misses != want_misses {
        errs.push(format!("miss events {:?} (want {:?})", o.misses, want_misses));
    }

    // Copies: a multiset comparison with a readable report.
    let mut unmatched: Vec<&Vec<u8>> = o.captured.iter().collect();
    let mut missing = Vec::new();
    for want in &fx.copies {
        match unmatched.iter().position(|g| *g == want) {
            Some(i) => {
                unmatched.remove(i);
            }
            None => missing.push(want),
        }
    }
    if !missing.is_empty() || !unmatched.is_empty() {
        let mut s = format!("captured {} frame(s), want {}", o.captured.len(), fx.copies.len());
        for m in &missing {
            s += &format!("\n      missing copy: {}", describe(m));
            // The closest captured frame: same destination MAC.
            if let Some(g) = unmatched.iter().find(|g| g.len() >= 6 && g[..6] == m[..6]) {
                s += &format!("\n        captured for that MAC: {}", diff(m, g));
            }
        }
        for u in &unmatched {
            s += &format!("\n      unexpected frame: {}", describe(u));
        }
        errs.push(s);
    }
    if fx.checksums {
        for (i, c) in o.captured.iter().enumerate() {
            if let Err(e) = verify_checksums(c) {
                errs.push(format!("captured frame {i} ({}): {e}", describe(c)));
            }
        }
        if fx.verdict == TCX_NEXT {
            if let Err(e) = verify_checksums(&o.output) {
                errs.push(format!("output skb ({}): {e}", describe(&o.output)));
            }
        }
    }
    // The expectations themselves must be well-formed.
    if fx.checksums {
        for c in fx.copies.iter().chain([&fx.output]) {
            if let Err(e) = verify_checksums(c) {
                errs.push(format!("fixture bug: expected frame {}: {e}", describe(c)));
            }
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

#[test]
fn tc_bcast_fixture_table() {
    if !is_root() {
        println!("SKIPPED tc_bcast_fixture_table: needs root (BPF_PROG_TEST_RUN)");
        return;
    }
    // The context we hand the kernel is the generated struct's size; the
    // kernel accepts up to sizeof(struct __sk_buff) and needs the fields it
    // does not allow to be zero, which a zeroed buffer guarantees.
    assert!(offset_of!(__sk_buff, ifindex) == 40 && offset_of!(__sk_buff, mark) == 8);

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
    let left = our_namespaces("kccl-fx-");
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    assert!(failed.is_empty(), "{} of {} fixtures failed:\n{}", failed.len(), table.len(), failed.join("\n"));
}

/// The test's own checksum code against golden values (computed elsewhere),
/// so that "valid checksum" above means something.  Needs no root.
#[test]
fn fixture_checksum_helpers() {
    let ip = [
        0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8,
        0x00, 0xc7,
    ];
    assert_eq!(inet_csum(&ip), 0xb861);
    let mut udp = vec![0x03, 0xe8, 0x07, 0xd0, 0x00, 0x0d, 0x00, 0x00];
    udp.extend_from_slice(b"hello");
    let sum = csum_add(pseudo_sum(Ipv4Addr::new(192, 168, 0, 1), Ipv4Addr::new(192, 168, 0, 199), 13), &udp);
    assert_eq!(!csum_fold(sum), 0x2e31);

    let pkt = kccl_udp(&header(0b110, 0), 1);
    let good = pkt.build();
    verify_checksums(&good).expect("builder output verifies");
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 0x40;
    assert!(verify_checksums(&bad).is_err(), "a flipped payload bit must break the UDP checksum");
    let mut bad_ip = good.clone();
    bad_ip[14 + 8] -= 1; // ttl
    assert!(verify_checksums(&bad_ip).is_err(), "a changed TTL must break the IPv4 checksum");
    let r2 = pkt.to_rank(2).build();
    verify_checksums(&r2).expect("rewritten frame verifies");
    assert_eq!(
        (&r2[0..6], &r2[30..34], &r2[36..38]),
        (&mac_of(2)[..], &[10, 9, 0, 2][..], &47002u16.to_be_bytes()[..])
    );
}
