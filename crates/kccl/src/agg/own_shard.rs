//! A sharded allreduce's own shard on the kernel path (cargo feature
//! `kernel-agg`).  This member owns a shard and contributes to it, but its
//! own datagrams never cross its interface, so its XDP program would never
//! see them: they go through BPF_PROG_TEST_RUN of the attached xdp_agg
//! (same maps, `AggEngine::run_xdp_agg`) instead.  What the program passes
//! up is handled as tc_agg_result and the stack would: an answer addressed
//! to contributors is fanned out from user space (it completed the chunk:
//! the others' copies) and this member's copy lands in an inbox the
//! dispatcher reads like its socket; anything else passed up (a
//! contribution for the user-space aggregator) lands there too.  When a
//! remote contribution completes one of the owned chunks, xdp_agg writes
//! the result to the ring instead (tc_agg_result skips the owner), and
//! [`OwnShard::take_record`] turns that record into the RESULT datagram
//! the owner would have received.

use std::net::SocketAddrV4;

use crate::error::Result;
use crate::kernel_agg::{AggEngine, AggRecordView};
use crate::transport::sock::Datagram;
use crate::wire::{
    Header, F_FANOUT, F_LAST_FRAG, F_OVERFLOW, HDR_LEN, T_AGG_ACK, T_AGG_PENDING, T_AGG_RESULT, VERSION,
};

use super::config::OwnShardStats;
use super::user::{encode_result, UserAggregator};

const XDP_PASS: u32 = 2;
const ETH_HLEN: usize = 14;
const IP_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
/// The source MAC of the frames this member runs through its own xdp_agg:
/// locally administered, "kccl".  xdp_agg learns it as the own rank's next
/// hop, which tc_agg_result never uses (it skips the owner).
const OWN_MAC: [u8; 6] = [0x02, 0x6b, 0x63, 0x63, 0x6c, 0x00];

pub(crate) struct OwnShard {
    me: u16,
    addr: SocketAddrV4,
    /// Op ids whose own shard this member is contributing to now.
    ops: Vec<u32>,
    /// Datagrams for this member's dispatcher, as if its socket got them.
    inbox: Vec<Vec<u8>>,
    frame: Vec<u8>,
    out: Vec<u8>,
    pub stats: OwnShardStats,
}

impl OwnShard {
    pub fn new(me: u16, addr: SocketAddrV4) -> OwnShard {
        OwnShard {
            me,
            addr,
            ops: Vec::new(),
            inbox: Vec::new(),
            frame: Vec::new(),
            out: Vec::new(),
            stats: OwnShardStats::default(),
        }
    }

    /// This member's address: the source of everything in the inbox.
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// From now on, records of `op_id` are this member's own results.
    pub fn begin(&mut self, op_id: u32) {
        if !self.ops.contains(&op_id) {
            self.ops.push(op_id);
        }
    }

    /// The operation is over (done or failed): its late records, if any,
    /// go wherever other records go.
    pub fn end(&mut self, op_id: u32) {
        self.ops.retain(|&o| o != op_id);
    }

    pub fn active(&self) -> bool {
        !self.ops.is_empty()
    }

    /// Runs each datagram (addressed to this member) through xdp_agg and
    /// handles what it passes up.  Returns the number of runs.
    pub fn send(&mut self, engine: &AggEngine, user: &mut UserAggregator, dgrams: &[Datagram<'_>]) -> Result<usize> {
        for d in dgrams {
            self.build_frame(d);
            self.out.resize(self.frame.len(), 0);
            let (verdict, len) = engine.run_xdp_agg(&self.frame, &mut self.out)?;
            self.stats.runs += 1;
            if verdict == XDP_PASS {
                let Some(dgram) = udp_payload(&self.out[..len.min(self.out.len())]) else { continue };
                let dgram = dgram.to_vec();
                self.stats.passed += 1;
                self.passed_up(user, dgram);
            }
        }
        Ok(dgrams.len())
    }

    /// Ethernet + IPv4 + UDP from this member to `d.to` around the datagram,
    /// as the wire would have delivered it.
    fn build_frame(&mut self, d: &Datagram<'_>) {
        let udp_len = UDP_HLEN + d.head.len() + d.body.len();
        let tot = IP_HLEN + udp_len;
        let f = &mut self.frame;
        f.clear();
        f.extend_from_slice(&OWN_MAC);
        f.extend_from_slice(&OWN_MAC);
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        let ip = f.len();
        f.extend_from_slice(&[0x45, 0]);
        f.extend_from_slice(&(tot as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]); // id, DF, ttl 64, UDP, checksum
        f.extend_from_slice(&self.addr.ip().octets());
        f.extend_from_slice(&d.to.ip().octets());
        let sum = ipv4_checksum(&f[ip..ip + IP_HLEN]);
        f[ip + 10..ip + 12].copy_from_slice(&sum.to_be_bytes());
        f.extend_from_slice(&self.addr.port().to_be_bytes());
        f.extend_from_slice(&d.to.port().to_be_bytes());
        f.extend_from_slice(&(udp_len as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0]); // no UDP checksum (IPv4 allows it)
        f.extend_from_slice(d.head);
        f.extend_from_slice(d.body);
    }

    /// What the stack would do with a datagram xdp_agg passed up: an answer
    /// it made (FANOUT, signed by this member) goes to every contributor it
    /// names, as tc_agg_result would send it (FANOUT cleared), this
    /// member's copy into the inbox; anything else into the inbox as is.
    fn passed_up(&mut self, user: &mut UserAggregator, dgram: Vec<u8>) {
        let Ok((mut h, payload)) = Header::decode(&dgram) else {
            self.inbox.push(dgram);
            return;
        };
        let answer = matches!(h.msg_type, T_AGG_RESULT | T_AGG_ACK | T_AGG_PENDING);
        if !answer || h.flags & F_FANOUT == 0 || h.src_rank != self.me {
            self.inbox.push(dgram);
            return;
        }
        h.flags &= !F_FANOUT;
        let mut copy = h.to_bytes().to_vec();
        copy.extend_from_slice(payload);
        for bit in 0..64u16 {
            if h.dst_mask >> bit & 1 == 0 {
                continue;
            }
            let rank = h.mask_base.wrapping_add(bit);
            if rank != self.me {
                user.relay_kernel_answer(rank, &copy);
                self.stats.relayed += 1;
            }
        }
        let own = self.me.wrapping_sub(h.mask_base);
        if own < 64 && h.dst_mask >> own & 1 == 1 {
            self.inbox.push(copy);
        }
    }

    /// The owner's copy of a chunk a remote contribution completed: if the
    /// record is of an op this member contributes its own shard to now, it
    /// becomes the RESULT datagram xdp_agg would have answered (int32 types
    /// saturated, F_OVERFLOW as the fan-out's copies carry it) and true is
    /// returned.
    pub fn take_record(&mut self, r: &AggRecordView<'_>) -> bool {
        if !self.ops.contains(&r.op_id) {
            return false;
        }
        let own = self.me.wrapping_sub(r.mask_base);
        let plen = usize::from(r.payload_len);
        let mut d = vec![0u8; HDR_LEN + plen];
        let values = r.values();
        let esize = if values.is_empty() { 0 } else { plen / values.len() };
        if own >= 64 || esize == 0 || plen % values.len() != 0 {
            return false;
        }
        let sat = encode_result(values, r.dtype, &mut d[HDR_LEN..]);
        let last = r.frag_off as usize + plen >= r.msg_len as usize;
        let h = Header {
            version: VERSION,
            msg_type: T_AGG_RESULT,
            flags: if last { F_LAST_FRAG } else { 0 } | if sat || u8::from(r.overflow) != 0 { F_OVERFLOW } else { 0 },
            job_id: r.job_id,
            src_rank: self.me,
            mask_base: r.mask_base,
            dst_mask: 1 << own,
            msg_seq: r.op_id,
            frag_off: r.frag_off,
            msg_len: r.msg_len,
            payload_len: r.payload_len,
            agg_op: r.agg_op,
            dtype: r.dtype,
        };
        d[..HDR_LEN].copy_from_slice(&h.to_bytes());
        self.inbox.push(d);
        self.stats.records += 1;
        true
    }

    pub fn has_inbox(&self) -> bool {
        !self.inbox.is_empty()
    }

    /// The datagrams for this member's dispatcher since the last call.
    pub fn take_inbox(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.inbox)
    }
}

/// The UDP payload of an Ethernet + IPv4 + UDP frame (bytes past the UDP
/// length, such as the trailer of an answer made from a multi-buffer
/// frame, are not part of it).
fn udp_payload(f: &[u8]) -> Option<&[u8]> {
    let ihl = usize::from(*f.get(ETH_HLEN)? & 0xf) * 4;
    let u = ETH_HLEN + ihl;
    let len = usize::from(u16::from_be_bytes([*f.get(u + 4)?, *f.get(u + 5)?]));
    if ihl < IP_HLEN || len < UDP_HLEN {
        return None;
    }
    f.get(u + UDP_HLEN..u + len)
}

fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut s: u32 = h.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]))).sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_the_datagram_with_valid_headers() {
        let me = SocketAddrV4::new([10, 0, 0, 3].into(), 47003);
        let mut o = OwnShard::new(3, me);
        let head = [7u8; HDR_LEN];
        o.build_frame(&Datagram { to: me, head: &head, body: &[1, 2, 3] });
        let f = &o.frame;
        assert_eq!(f.len(), ETH_HLEN + IP_HLEN + UDP_HLEN + HDR_LEN + 3);
        assert_eq!(ipv4_checksum(&f[ETH_HLEN..ETH_HLEN + IP_HLEN]), 0, "IPv4 header checksum verifies");
        assert_eq!(&f[26..30], &[10, 0, 0, 3]);
        assert_eq!(&f[30..34], &[10, 0, 0, 3]);
        let p = udp_payload(f).expect("payload");
        assert_eq!(&p[..HDR_LEN], &head);
        assert_eq!(&p[HDR_LEN..], &[1, 2, 3]);
        // A trailer behind the datagram is not part of it.
        let mut t = f.clone();
        t.extend_from_slice(&[9; 100]);
        assert_eq!(udp_payload(&t), Some(p));
        assert_eq!(udp_payload(&t[..40]), None);
    }
}
