//! The kccl wire header, encoded and decoded exactly as bpf/include/kccl_wire.h
//! lays it out (big-endian fields).  Tests below check this encoder against the
//! skeleton-generated `kccl_hdr` (size and every offset) and golden bytes.

use crate::skel::types::{kccl_bcast_ack, kccl_hdr};

pub const MAGIC: u32 = 0x4b43_434c;
pub const VERSION: u8 = 1;
pub const HDR_LEN: usize = 40;
pub const T_BCAST: u8 = 1;
pub const T_AGG: u8 = 2;
pub const T_AGG_RESULT: u8 = 3;
pub const T_AGG_ACK: u8 = 4;
/// Broadcast acknowledgment (receiver -> sender); payload: [`BcastAck`].
pub const T_BCAST_ACK: u8 = 5;
/// Fixed part of a [`BcastAck`] payload (struct kccl_bcast_ack).
pub const ACK_LEN: usize = 20;
/// Largest bitmap of one ACK (KCCL_ACK_MAX_BITS).
pub const ACK_MAX_BITS: usize = 8192;
/// enum kccl_ack_flag
pub const ACK_COMPLETE: u16 = 1 << 0;
pub const ACK_GAP: u16 = 1 << 1;
/// Aggregator -> contributor: a counted retransmission; payload = the
/// chunk's missing contributors (u64 mask, big-endian).
pub const T_AGG_PENDING: u8 = 6;
/// Contributor -> aggregator: cumulative receipt of answers (no payload).
pub const T_AGG_RECEIPT: u8 = 7;
/// Contributor -> aggregator: which call to start at (no payload).
pub const T_AGG_SYNC: u8 = 8;
/// Aggregator -> contributor: msg_seq = the op id of the call to start at.
pub const T_AGG_SYNC_ACK: u8 = 9;
/// Reduce root -> contributor: a bitmap of chunks the root's runtime took
/// (frag_off: the chunk of bit 0; bit i LSB first); answers contributions
/// with [`F_ACK_LATER`].
pub const T_AGG_ACKS: u8 = 10;
/// Any member of a call -> the others: the call cannot complete, and why
/// (msg_seq = the call's first op id, call * 4; payload = one byte
/// [`AbortReason`], then UTF-8 text of at most [`AGG_ABORT_MAX_TEXT`] bytes).
pub const T_AGG_ABORT: u8 = 11;
/// Longest explanation an abort carries (KCCL_AGG_ABORT_MAX_TEXT).
pub const AGG_ABORT_MAX_TEXT: usize = 512;
/// Scatter-gather request: coordinator -> workers (see the C header).
pub const T_SG_REQUEST: u8 = 12;
/// Scatter-gather reply fragment: worker -> coordinator.
pub const T_SG_REPLY: u8 = 13;
/// Why a call was aborted (enum kccl_abort_reason, the first payload byte
/// of [`T_AGG_ABORT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AbortReason {
    /// NaN or infinity in a member's float input.
    NonFinite = 1,
    /// The result does not fit the element type.
    Overflow = 2,
    /// Members passed different lengths, ops or element types.
    Mismatch = 3,
    /// A member sent an op or element type the aggregator does not know
    /// (it runs another kccl version).
    Unsupported = 4,
}

impl AbortReason {
    pub fn from_wire(b: u8) -> Option<AbortReason> {
        match b {
            1 => Some(AbortReason::NonFinite),
            2 => Some(AbortReason::Overflow),
            3 => Some(AbortReason::Mismatch),
            4 => Some(AbortReason::Unsupported),
            _ => None,
        }
    }
}

impl std::fmt::Display for AbortReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AbortReason::NonFinite => "non-finite input",
            AbortReason::Overflow => "overflow",
            AbortReason::Mismatch => "mismatched calls",
            AbortReason::Unsupported => "unsupported op or element type",
        })
    }
}

/// Largest [`T_AGG_ACKS`] bitmap (KCCL_AGG_ACKS_MAX_BYTES).
pub const AGG_ACKS_MAX_BYTES: usize = 1024;
pub const F_FANOUT: u16 = 1 << 0;
pub const F_LAST_FRAG: u16 = 1 << 1;
pub const F_ALLREDUCE: u16 = 1 << 2;
pub const F_OVERFLOW: u16 = 1 << 3;
pub const F_USER_ONLY: u16 = 1 << 4;
/// Reduce contribution: answered by the root's runtime with [`T_AGG_ACKS`]
/// after it read the chunk, not by xdp_agg per chunk.
pub const F_ACK_LATER: u16 = 1 << 5;
/// Set by xdp_agg on an allreduce contribution that disagrees with its
/// chunk's slot, passed up for the aggregator's runtime to abort the call.
pub const F_MISMATCH: u16 = 1 << 6;
pub const MASK_BITS: usize = 64;
// enum kccl_agg_op
pub const OP_SUM: u8 = 1;
pub const OP_COUNT: u8 = 2;
pub const OP_MAX: u8 = 3;
pub const OP_MIN: u8 = 4;
pub const OP_AVG: u8 = 5;
pub const OP_CONCAT: u8 = 6;
// enum kccl_dtype
pub const DT_BYTES: u8 = 0;
pub const DT_I32: u8 = 1;
pub const DT_I64: u8 = 2;
pub const DT_F32Q: u8 = 3;
/// kccl_agg_sweep_req.flags: the sweep also frees one aborted call's slots
/// (KCCL_SWEEP_CALL).
pub const SWEEP_CALL: u32 = 1;
/// Aborted calls the kernel remembers (KCCL_AGG_ABORTED_MAX, agg_aborted):
/// their late contributions go to user space until this many more calls
/// were aborted.
pub const AGG_ABORTED_MAX: usize = 8;
/// Bytes of a chunk the kernel combines under one lock (KCCL_AGG_SUB_BYTES).
pub const AGG_SUB_BYTES: usize = 3432;
/// Sub-blocks of the largest chunk (KCCL_AGG_MAX_SUBS).
pub const AGG_MAX_SUBS: usize = 19;
/// Largest chunk payload the kernel aggregates (KCCL_AGG_MAX_PAYLOAD): one
/// IPv4 datagram, a multi-buffer XDP frame on a large MTU.
pub const AGG_MAX_PAYLOAD: usize = AGG_SUB_BYTES * AGG_MAX_SUBS;
const _: () = assert!(AGG_MAX_PAYLOAD + 20 + 8 + HDR_LEN <= 65535, "a chunk fits one IPv4 datagram");
/// KCCL_AGG_MAX_ELEMS: int32 elements in the largest chunk.
pub const AGG_MAX_ELEMS: usize = AGG_MAX_PAYLOAD / 4;
/// Largest UDP payload in a 1500-byte MTU (IPv4, no options).
pub const MAX_UDP_PAYLOAD_1500: usize = 1500 - 20 - 8;
/// Largest message bytes per packet in a 1500-byte MTU.
pub const MAX_PAYLOAD_1500: usize = MAX_UDP_PAYLOAD_1500 - HDR_LEN;

// The C header is the definition; fail the build if the generated copy moves.
const _: () = assert!(std::mem::size_of::<kccl_hdr>() == HDR_LEN);
const _: () = assert!(std::mem::size_of::<kccl_bcast_ack>() == ACK_LEN);

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("datagram of {0} bytes is shorter than the {HDR_LEN}-byte kccl header")]
    Short(usize),
    #[error("bad magic {0:#010x} (not a kccl packet)")]
    BadMagic(u32),
    #[error("unsupported kccl version {0} (this build speaks {VERSION})")]
    BadVersion(u8),
    #[error("payload_len {claimed} does not match the {actual} bytes after the header")]
    BadLength { claimed: usize, actual: usize },
    #[error("fragment [{off}, {end}) lies outside a message of {msg_len} bytes")]
    BadFragment { off: u32, end: u64, msg_len: u32 },
    #[error("broadcast ACK: {0}")]
    BadAck(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    pub version: u8,
    pub msg_type: u8,
    pub flags: u16,
    pub job_id: u32,
    pub src_rank: u16,
    pub mask_base: u16,
    pub dst_mask: u64,
    pub msg_seq: u32,
    pub frag_off: u32,
    pub msg_len: u32,
    pub payload_len: u16,
    /// enum kccl_agg_op (aggregation packets), else 0.
    pub agg_op: u8,
    /// enum kccl_dtype (aggregation packets), else 0.
    pub dtype: u8,
}

impl Header {
    /// A payload-less control header (SYNC, SYNC_ACK): only type, job,
    /// sender and msg_seq mean anything, the rest is zero.
    pub fn control(msg_type: u8, job_id: u32, src_rank: u16, msg_seq: u32) -> Header {
        Header {
            version: VERSION,
            msg_type,
            flags: 0,
            job_id,
            src_rank,
            mask_base: 0,
            dst_mask: 0,
            msg_seq,
            frag_off: 0,
            msg_len: 0,
            payload_len: 0,
            agg_op: 0,
            dtype: 0,
        }
    }

    pub fn encode(&self, out: &mut [u8; HDR_LEN]) {
        out[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        out[4] = self.version;
        out[5] = self.msg_type;
        out[6..8].copy_from_slice(&self.flags.to_be_bytes());
        out[8..12].copy_from_slice(&self.job_id.to_be_bytes());
        out[12..14].copy_from_slice(&self.src_rank.to_be_bytes());
        out[14..16].copy_from_slice(&self.mask_base.to_be_bytes());
        out[16..24].copy_from_slice(&self.dst_mask.to_be_bytes());
        out[24..28].copy_from_slice(&self.msg_seq.to_be_bytes());
        out[28..32].copy_from_slice(&self.frag_off.to_be_bytes());
        out[32..36].copy_from_slice(&self.msg_len.to_be_bytes());
        out[36..38].copy_from_slice(&self.payload_len.to_be_bytes());
        out[38] = self.agg_op;
        out[39] = self.dtype;
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        self.encode(&mut b);
        b
    }

    /// Parses and validates a whole datagram (header + payload).  Returns the
    /// header and the payload slice.
    pub fn decode(dgram: &[u8]) -> Result<(Header, &[u8]), WireError> {
        if dgram.len() < 4 {
            return Err(WireError::Short(dgram.len()));
        }
        let magic = u32::from_be_bytes(be(dgram, 0));
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if dgram.len() < HDR_LEN {
            return Err(WireError::Short(dgram.len()));
        }
        let h = Header {
            version: dgram[4],
            msg_type: dgram[5],
            flags: u16::from_be_bytes(be(dgram, 6)),
            job_id: u32::from_be_bytes(be(dgram, 8)),
            src_rank: u16::from_be_bytes(be(dgram, 12)),
            mask_base: u16::from_be_bytes(be(dgram, 14)),
            dst_mask: u64::from_be_bytes(be(dgram, 16)),
            msg_seq: u32::from_be_bytes(be(dgram, 24)),
            frag_off: u32::from_be_bytes(be(dgram, 28)),
            msg_len: u32::from_be_bytes(be(dgram, 32)),
            payload_len: u16::from_be_bytes(be(dgram, 36)),
            agg_op: dgram[38],
            dtype: dgram[39],
        };
        if h.version != VERSION {
            return Err(WireError::BadVersion(h.version));
        }
        let payload = &dgram[HDR_LEN..];
        if payload.len() != h.payload_len as usize {
            return Err(WireError::BadLength { claimed: h.payload_len as usize, actual: payload.len() });
        }
        let end = h.frag_off as u64 + h.payload_len as u64;
        // An empty fragment only ends an empty message, except an aggregation
        // ACK or RECEIPT, which name a chunk by frag_off/msg_len and carry no
        // data.  A broadcast ACK's payload is its report, a reduce ACKS' a
        // bitmap of chunks and a PENDING's a mask, not message bytes.
        if matches!(h.msg_type, T_BCAST_ACK | T_AGG_ACKS) {
            return Ok((h, payload));
        }
        let no_data = matches!(h.msg_type, T_AGG_ACK | T_AGG_RECEIPT | T_AGG_SYNC | T_AGG_SYNC_ACK);
        if (end > h.msg_len as u64 && h.msg_type != T_AGG_PENDING) || (h.payload_len == 0 && h.msg_len != 0 && !no_data)
        {
            return Err(WireError::BadFragment { off: h.frag_off, end, msg_len: h.msg_len });
        }
        Ok((h, payload))
    }
}

/// The payload of a KCCL_T_BCAST_ACK (struct kccl_bcast_ack + bitmap), see
/// bpf/include/kccl_wire.h for the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BcastAck {
    /// Payload bytes per packet as the receiver derived it (0: unknown).
    pub pkt_bytes: u32,
    /// Packets of the message (0: unknown).
    pub npkts: u32,
    /// Every packet with index < cum is held.
    pub cum: u32,
    /// Packet index of bitmap bit 0.
    pub bm_first: u32,
    /// Bits of `bitmap` that are meaningful.
    pub bm_bits: u16,
    /// ACK_COMPLETE, ACK_GAP.
    pub flags: u16,
    /// ceil(bm_bits / 8) bytes, bit i (LSB first) = packet bm_first + i held.
    pub bitmap: Vec<u8>,
}

impl BcastAck {
    pub fn encoded_len(&self) -> usize {
        ACK_LEN + self.bitmap.len()
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.pkt_bytes.to_be_bytes());
        out.extend_from_slice(&self.npkts.to_be_bytes());
        out.extend_from_slice(&self.cum.to_be_bytes());
        out.extend_from_slice(&self.bm_first.to_be_bytes());
        out.extend_from_slice(&self.bm_bits.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.bitmap);
    }

    /// Parses an ACK payload; checks only what the bytes alone can show
    /// (lengths, bitmap size, unused bits zero); the sender checks the
    /// numbers against the message.
    pub fn decode(p: &[u8]) -> Result<BcastAck, WireError> {
        if p.len() < ACK_LEN {
            return Err(WireError::BadAck("payload shorter than the 20-byte ACK"));
        }
        let a = BcastAck {
            pkt_bytes: u32::from_be_bytes(be(p, 0)),
            npkts: u32::from_be_bytes(be(p, 4)),
            cum: u32::from_be_bytes(be(p, 8)),
            bm_first: u32::from_be_bytes(be(p, 12)),
            bm_bits: u16::from_be_bytes(be(p, 16)),
            flags: u16::from_be_bytes(be(p, 18)),
            bitmap: p[ACK_LEN..].to_vec(),
        };
        if a.bm_bits as usize > ACK_MAX_BITS {
            return Err(WireError::BadAck("bitmap larger than KCCL_ACK_MAX_BITS"));
        }
        if a.bitmap.len() != (a.bm_bits as usize).div_ceil(8) {
            return Err(WireError::BadAck("bitmap length does not match bm_bits"));
        }
        if a.bm_bits % 8 != 0 && a.bitmap.last().is_some_and(|&b| b >> (a.bm_bits % 8) != 0) {
            return Err(WireError::BadAck("bits beyond bm_bits are set"));
        }
        if a.flags & !(ACK_COMPLETE | ACK_GAP) != 0 {
            return Err(WireError::BadAck("unknown flags"));
        }
        Ok(a)
    }

    /// Whether bitmap bit i (packet bm_first + i) is set.
    pub fn bit(&self, i: usize) -> bool {
        i < self.bm_bits as usize && self.bitmap[i / 8] & (1 << (i % 8)) != 0
    }
}

fn be<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    fn sample() -> Header {
        Header {
            version: VERSION,
            msg_type: T_BCAST,
            flags: F_FANOUT | F_LAST_FRAG,
            job_id: 0x0102_0304,
            src_rank: 0x0506,
            mask_base: 64,
            dst_mask: 0x8000_0000_0000_0003,
            msg_seq: 0x0a0b_0c0d,
            frag_off: 0x1122_3344,
            msg_len: 0x1122_3344 + 5,
            payload_len: 5,
            agg_op: 0,
            dtype: 0,
        }
    }

    /// Golden bytes: the layout documented in docs/ARCHITECTURE.md.
    #[test]
    fn golden_bytes() {
        let golden: [u8; HDR_LEN] = [
            0x4b, 0x43, 0x43, 0x4c, // magic "KCCL"
            0x01, 0x01, 0x00, 0x03, // version, type, flags
            0x01, 0x02, 0x03, 0x04, // job_id
            0x05, 0x06, 0x00, 0x40, // src_rank, mask_base
            0x80, 0, 0, 0, 0, 0, 0, 0x03, // dst_mask
            0x0a, 0x0b, 0x0c, 0x0d, // msg_seq
            0x11, 0x22, 0x33, 0x44, // frag_off
            0x11, 0x22, 0x33, 0x49, // msg_len
            0x00, 0x05, 0x00, 0x00, // payload_len, agg_op, dtype
        ];
        assert_eq!(sample().to_bytes(), golden);
        let mut dgram = golden.to_vec();
        dgram.extend_from_slice(b"hello");
        let (h, p) = Header::decode(&dgram).expect("golden decodes");
        assert_eq!(h, sample());
        assert_eq!(p, b"hello");
    }

    /// An aggregation contribution (T_AGG with op and dtype): the two bytes
    /// that are zero for broadcast carry them.
    #[test]
    fn golden_bytes_aggregation() {
        let h = Header {
            version: VERSION,
            msg_type: T_AGG,
            flags: F_LAST_FRAG | F_ALLREDUCE,
            job_id: 7,
            src_rank: 3,
            mask_base: 0,
            dst_mask: 0b1110,
            msg_seq: 42,
            frag_off: 2864,
            msg_len: 2872,
            payload_len: 8,
            agg_op: OP_MAX,
            dtype: DT_I32,
        };
        let golden: [u8; HDR_LEN] = [
            0x4b, 0x43, 0x43, 0x4c, // magic
            0x01, 0x02, 0x00, 0x06, // version, T_AGG, LAST_FRAG|ALLREDUCE
            0x00, 0x00, 0x00, 0x07, // job_id
            0x00, 0x03, 0x00, 0x00, // src_rank, mask_base
            0, 0, 0, 0, 0, 0, 0, 0x0e, // dst_mask: contributors 1, 2, 3
            0x00, 0x00, 0x00, 0x2a, // msg_seq = op id
            0x00, 0x00, 0x0b, 0x30, // frag_off = 2 * 1432
            0x00, 0x00, 0x0b, 0x38, // msg_len
            0x00, 0x08, 0x03, 0x01, // payload_len, agg_op MAX, dtype I32
        ];
        assert_eq!(h.to_bytes(), golden);
        let mut dgram = golden.to_vec();
        dgram.extend_from_slice(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xfe]);
        let (back, p) = Header::decode(&dgram).expect("golden decodes");
        assert_eq!(back, h);
        assert_eq!(p.len(), 8);
    }

    /// `NAME = value` of a C enum member or `#define NAME value`.
    fn c_value(text: &str, name: &str) -> i64 {
        for line in text.lines() {
            let t = line.trim_start();
            let t = t.strip_prefix("#define").unwrap_or(t).trim_start();
            let Some(rest) = t.strip_prefix(name) else { continue };
            if !rest.starts_with([' ', '\t', '=']) {
                continue;
            }
            let expr = rest.trim_start().trim_start_matches('=');
            let expr = expr.split([',', '/']).next().unwrap_or("").trim();
            let num = |v: &str| -> i64 {
                let v = v.trim().trim_end_matches('U');
                match v.strip_prefix("0x") {
                    Some(h) => i64::from_str_radix(h, 16),
                    None => v.parse(),
                }
                .unwrap_or_else(|e| panic!("{name}: cannot parse `{v}` in `{line}`: {e}"))
            };
            return match expr.split_once("<<") {
                Some((a, b)) => num(a) << num(b),
                None => num(expr),
            };
        }
        panic!("{name} not found in the C header");
    }

    /// One definition: every Rust constant equals its C counterpart, read
    /// from the header the BPF programs are compiled with.  (The bcast
    /// skeleton's BTF carries none of these enums, so the header text is
    /// the reference; kccl_hdr's layout is checked against BTF below.)
    #[test]
    fn constants_match_c_header() {
        let wire = include_str!("../../../bpf/include/kccl_wire.h");
        let agg = include_str!("../../../bpf/include/kccl_agg.h");
        let pairs: &[(&str, i64)] = &[
            ("KCCL_MAGIC", MAGIC as i64),
            ("KCCL_VERSION", VERSION as i64),
            ("KCCL_T_BCAST", T_BCAST as i64),
            ("KCCL_T_AGG", T_AGG as i64),
            ("KCCL_T_AGG_RESULT", T_AGG_RESULT as i64),
            ("KCCL_T_AGG_ACK", T_AGG_ACK as i64),
            ("KCCL_T_BCAST_ACK", T_BCAST_ACK as i64),
            ("KCCL_ACK_LEN", ACK_LEN as i64),
            ("KCCL_ACK_MAX_BITS", ACK_MAX_BITS as i64),
            ("KCCL_ACK_COMPLETE", ACK_COMPLETE as i64),
            ("KCCL_ACK_GAP", ACK_GAP as i64),
            ("KCCL_T_AGG_PENDING", T_AGG_PENDING as i64),
            ("KCCL_T_AGG_RECEIPT", T_AGG_RECEIPT as i64),
            ("KCCL_T_AGG_SYNC", T_AGG_SYNC as i64),
            ("KCCL_T_AGG_SYNC_ACK", T_AGG_SYNC_ACK as i64),
            ("KCCL_T_AGG_ACKS", T_AGG_ACKS as i64),
            ("KCCL_AGG_ACKS_MAX_BYTES", AGG_ACKS_MAX_BYTES as i64),
            ("KCCL_T_AGG_ABORT", T_AGG_ABORT as i64),
            ("KCCL_AGG_ABORT_MAX_TEXT", AGG_ABORT_MAX_TEXT as i64),
            ("KCCL_T_SG_REQUEST", T_SG_REQUEST as i64),
            ("KCCL_T_SG_REPLY", T_SG_REPLY as i64),
            ("KCCL_OP_CONCAT", OP_CONCAT as i64),
            ("KCCL_DT_BYTES", DT_BYTES as i64),
            ("KCCL_ABORT_NON_FINITE", AbortReason::NonFinite as i64),
            ("KCCL_ABORT_OVERFLOW", AbortReason::Overflow as i64),
            ("KCCL_ABORT_MISMATCH", AbortReason::Mismatch as i64),
            ("KCCL_ABORT_UNSUPPORTED", AbortReason::Unsupported as i64),
            ("KCCL_OP_SUM", OP_SUM as i64),
            ("KCCL_OP_COUNT", OP_COUNT as i64),
            ("KCCL_OP_MAX", OP_MAX as i64),
            ("KCCL_OP_MIN", OP_MIN as i64),
            ("KCCL_OP_AVG", OP_AVG as i64),
            ("KCCL_DT_I32", DT_I32 as i64),
            ("KCCL_DT_I64", DT_I64 as i64),
            ("KCCL_DT_F32Q", DT_F32Q as i64),
            ("KCCL_F_FANOUT", F_FANOUT as i64),
            ("KCCL_F_LAST_FRAG", F_LAST_FRAG as i64),
            ("KCCL_F_ALLREDUCE", F_ALLREDUCE as i64),
            ("KCCL_F_OVERFLOW", F_OVERFLOW as i64),
            ("KCCL_F_USER_ONLY", F_USER_ONLY as i64),
            ("KCCL_F_ACK_LATER", F_ACK_LATER as i64),
            ("KCCL_F_MISMATCH", F_MISMATCH as i64),
            ("KCCL_MASK_BITS", MASK_BITS as i64),
            ("KCCL_HDR_LEN", HDR_LEN as i64),
        ];
        for (name, rust) in pairs {
            assert_eq!(c_value(wire, name), *rust, "{name}: C header and wire.rs disagree");
        }
        assert_eq!(c_value(agg, "KCCL_AGG_SUB_BYTES"), AGG_SUB_BYTES as i64);
        assert_eq!(c_value(agg, "KCCL_AGG_MAX_SUBS"), AGG_MAX_SUBS as i64);
        assert_eq!(c_value(agg, "KCCL_SWEEP_CALL"), SWEEP_CALL as i64);
        assert_eq!(c_value(agg, "KCCL_AGG_ABORTED_MAX"), AGG_ABORTED_MAX as i64);
        assert_eq!(AGG_MAX_PAYLOAD, 65208);
        assert_eq!(AGG_MAX_PAYLOAD % 8, 0, "chunks must hold whole int64 elements");
        // Golden values too, so a change to both sides is still noticed.
        assert_eq!((OP_SUM, OP_COUNT, OP_MAX, OP_MIN, OP_AVG), (1, 2, 3, 4, 5));
        assert_eq!((DT_I32, DT_I64, DT_F32Q), (1, 2, 3));
    }

    /// The encoder's offsets are the C struct's offsets (from the skeleton's
    /// BTF-generated type).
    #[test]
    fn layout_matches_c_header() {
        assert_eq!(offset_of!(kccl_hdr, magic), 0);
        assert_eq!(offset_of!(kccl_hdr, version), 4);
        assert_eq!(offset_of!(kccl_hdr, r#type), 5);
        assert_eq!(offset_of!(kccl_hdr, flags), 6);
        assert_eq!(offset_of!(kccl_hdr, job_id), 8);
        assert_eq!(offset_of!(kccl_hdr, src_rank), 12);
        assert_eq!(offset_of!(kccl_hdr, mask_base), 14);
        assert_eq!(offset_of!(kccl_hdr, dst_mask), 16);
        assert_eq!(offset_of!(kccl_hdr, msg_seq), 24);
        assert_eq!(offset_of!(kccl_hdr, frag_off), 28);
        assert_eq!(offset_of!(kccl_hdr, msg_len), 32);
        assert_eq!(offset_of!(kccl_hdr, payload_len), 36);
        assert_eq!(offset_of!(kccl_hdr, agg_op), 38);
        assert_eq!(offset_of!(kccl_hdr, dtype), 39);
    }

    /// A gap report of receiver 3 for message 9 of sender 0: packets 0..2048
    /// of 2500 held cumulatively, group [2048, 2058) holds 2048..2050 and 2057.
    #[test]
    fn golden_bytes_bcast_ack() {
        let ack = BcastAck {
            pkt_bytes: 1432,
            npkts: 2500,
            cum: 2050,
            bm_first: 2048,
            bm_bits: 10,
            flags: ACK_GAP,
            bitmap: vec![0b0000_0111, 0b0000_0010],
        };
        let h = Header {
            version: VERSION,
            msg_type: T_BCAST_ACK,
            flags: 0,
            job_id: 7,
            src_rank: 3,
            mask_base: 0,
            dst_mask: 1,
            msg_seq: 9,
            frag_off: 0,
            msg_len: 3_580_000,
            payload_len: ack.encoded_len() as u16,
            agg_op: 0,
            dtype: 0,
        };
        let golden: Vec<u8> = vec![
            0x4b, 0x43, 0x43, 0x4c, // magic
            0x01, 0x05, 0x00, 0x00, // version, T_BCAST_ACK, no flags
            0x00, 0x00, 0x00, 0x07, // job_id
            0x00, 0x03, 0x00, 0x00, // src_rank = receiver 3, mask_base
            0, 0, 0, 0, 0, 0, 0, 0x01, // dst_mask: the sender, rank 0
            0x00, 0x00, 0x00, 0x09, // msg_seq
            0x00, 0x00, 0x00, 0x00, // frag_off
            0x00, 0x36, 0xa0, 0x60, // msg_len 3580000
            0x00, 0x16, 0x00, 0x00, // payload_len 22
            0x00, 0x00, 0x05, 0x98, // pkt_bytes 1432
            0x00, 0x00, 0x09, 0xc4, // npkts 2500
            0x00, 0x00, 0x08, 0x02, // cum 2050
            0x00, 0x00, 0x08, 0x00, // bm_first 2048
            0x00, 0x0a, 0x00, 0x02, // bm_bits 10, ACK_GAP
            0x07, 0x02, // bitmap: 2048, 2049, 2050 | 2057
        ];
        let mut d = h.to_bytes().to_vec();
        ack.encode(&mut d);
        assert_eq!(d, golden);
        let (back, p) = Header::decode(&golden).expect("ACK header decodes");
        assert_eq!(back, h);
        let a = BcastAck::decode(p).expect("ACK payload decodes");
        assert_eq!(a, ack);
        let held: Vec<usize> = (0..10).filter(|&i| a.bit(i)).map(|i| i + 2048).collect();
        assert_eq!(held, [2048, 2049, 2050, 2057]);
        assert!(!a.bit(10), "bits past bm_bits are not held");
    }

    #[test]
    fn bcast_ack_layout_matches_c_header() {
        assert_eq!(offset_of!(kccl_bcast_ack, pkt_bytes), 0);
        assert_eq!(offset_of!(kccl_bcast_ack, npkts), 4);
        assert_eq!(offset_of!(kccl_bcast_ack, cum), 8);
        assert_eq!(offset_of!(kccl_bcast_ack, bm_first), 12);
        assert_eq!(offset_of!(kccl_bcast_ack, bm_bits), 16);
        assert_eq!(offset_of!(kccl_bcast_ack, ack_flags), 18);
    }

    #[test]
    fn bcast_ack_rejects_malformed() {
        let good = BcastAck { bm_bits: 10, bitmap: vec![0xff, 0x03], ..Default::default() };
        let enc = |a: &BcastAck| {
            let mut v = Vec::new();
            a.encode(&mut v);
            v
        };
        assert!(BcastAck::decode(&enc(&good)).is_ok());
        assert!(BcastAck::decode(&enc(&good)[..19]).is_err(), "short");
        let mut e = enc(&good);
        e.push(0);
        assert!(BcastAck::decode(&e).is_err(), "bitmap longer than bm_bits");
        assert!(BcastAck::decode(&enc(&BcastAck { bitmap: vec![0xff, 0x07], ..good.clone() })).is_err(), "bit 10 set");
        assert!(BcastAck::decode(&enc(&BcastAck { flags: 4, ..good.clone() })).is_err(), "unknown flag");
        let big = BcastAck { bm_bits: 8193, bitmap: vec![0; 1025], ..Default::default() };
        assert!(BcastAck::decode(&enc(&big)).is_err(), "bitmap over the limit");
        // The header of an ACK is exempt from the fragment check: its payload
        // is the report, not message bytes (msg_len may be smaller).
        let h = Header { version: VERSION, msg_type: T_BCAST_ACK, msg_len: 1, payload_len: 22, ..Default::default() };
        let mut d = h.to_bytes().to_vec();
        d.extend_from_slice(&enc(&good));
        assert!(Header::decode(&d).is_ok());
    }

    #[test]
    fn rejects_malformed() {
        let good = {
            let mut h = sample();
            h.frag_off = 0;
            h.msg_len = 5;
            let mut d = h.to_bytes().to_vec();
            d.extend_from_slice(b"hello");
            d
        };
        assert!(Header::decode(&good).is_ok());
        assert_eq!(Header::decode(&good[..3]), Err(WireError::Short(3)));
        assert_eq!(Header::decode(&good[..20]), Err(WireError::Short(20)));
        assert!(matches!(Header::decode(&good[..HDR_LEN + 2]), Err(WireError::BadLength { .. })));
        let mut bad = good.clone();
        bad[0] = 0;
        assert!(matches!(Header::decode(&bad), Err(WireError::BadMagic(_))));
        let mut bad = good.clone();
        bad[4] = 9;
        assert_eq!(Header::decode(&bad), Err(WireError::BadVersion(9)));
        // An ACK has no payload but names a chunk of a non-empty message.
        let mut ack = sample();
        (ack.msg_type, ack.frag_off, ack.msg_len, ack.payload_len) = (T_AGG_ACK, 1432, 4000, 0);
        assert_eq!(Header::decode(&ack.to_bytes()).map(|x| x.0), Ok(ack));
        ack.msg_type = T_AGG_RESULT;
        assert!(matches!(Header::decode(&ack.to_bytes()), Err(WireError::BadFragment { .. })));
        let mut bad = good.clone();
        bad[35] = 4; // msg_len 4 < frag end 5
        assert!(matches!(Header::decode(&bad), Err(WireError::BadFragment { .. })));
    }
}
