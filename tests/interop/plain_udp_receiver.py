#!/usr/bin/env python3
"""Receive kccl broadcast datagrams with a plain UDP socket (no kccl code).

Shows that a kccl receiver needs nothing but a UDP socket and the 40-byte
header below: whether a copy was made by the kernel fan-out (tc_bcast at the
sender's TCX egress) or sent from user space, it is an ordinary UDP/IPv4
datagram addressed to this receiver's own address and port.

Usage:
    plain_udp_receiver.py ADDR PORT COUNT OUT [--ready FILE] [--timeout S]

Binds ADDR:PORT, receives COUNT datagrams, checks each header, and writes to
OUT every message's payload (its fragments' payloads concatenated in frag_off
order), messages in the order their first fragment arrived.  With --ready,
FILE is created once the socket is bound, so a test can wait for it before
sending.  Exits 0 when every message is complete, 1 on a bad header, a
timeout or an incomplete message (the reason goes to stderr).

The kccl header (bpf/include/kccl_wire.h is the definition): 40 bytes at the
start of the UDP payload, all fields big-endian, so one struct format string
parses it: "!IBBHIHHQIIIHBB".

    off size field        meaning
     0   4   magic        0x4b43434c, b"KCCL"
     4   1   version      1
     5   1   type         1 = broadcast data fragment
     6   2   flags        bit 0 FANOUT (ask the sender's TC program to fan the
                          packet out; copies keep it), bit 1 LAST_FRAG
     8   4   job_id       job (group) the packet belongs to
    12   2   src_rank     sender rank
    14   2   mask_base    rank of bit 0 of dst_mask (a multiple of 64)
    16   8   dst_mask     bit i set: rank mask_base + i is a destination
    24   4   msg_seq      message number, per (job, sender)
    28   4   frag_off     byte offset of this fragment in the message
    32   4   msg_len      total message length in bytes
    36   2   payload_len  message bytes after the header (the rest of the
                          datagram must be exactly this long)
    38   1   agg_op       0 for broadcast
    39   1   dtype        0 for broadcast

A message is identified by (job_id, src_rank, msg_seq) and is complete when
its fragments cover [0, msg_len) without gaps.  A fragment that arrives twice
is kept once (keyed by frag_off).  Which ranks a datagram was meant for is in
mask_base/dst_mask; this script takes whatever arrives at ADDR:PORT.
"""

import argparse
import socket
import struct
import sys

HDR = struct.Struct("!IBBHIHHQIIIHBB")
assert HDR.size == 40
MAGIC = b"KCCL"
VERSION = 1


def parse(dgram):
    """Returns (header dict, payload) or raises ValueError."""
    if len(dgram) < HDR.size:
        raise ValueError(f"datagram of {len(dgram)} bytes is shorter than the 40-byte header")
    if dgram[:4] != MAGIC:
        raise ValueError(f"bad magic {dgram[:4]!r} (expected {MAGIC!r})")
    (_magic, version, mtype, flags, job_id, src_rank, mask_base, dst_mask, msg_seq, frag_off, msg_len,
     payload_len, _agg_op, _dtype) = HDR.unpack_from(dgram)
    if version != VERSION:
        raise ValueError(f"unsupported version {version} (expected {VERSION})")
    payload = dgram[HDR.size:]
    if len(payload) != payload_len:
        raise ValueError(f"payload_len {payload_len} but {len(payload)} bytes follow the header")
    if frag_off + payload_len > msg_len:
        raise ValueError(f"fragment [{frag_off}, {frag_off + payload_len}) outside a {msg_len}-byte message")
    h = dict(type=mtype, flags=flags, job_id=job_id, src_rank=src_rank, mask_base=mask_base,
             dst_mask=dst_mask, msg_seq=msg_seq, frag_off=frag_off, msg_len=msg_len)
    return h, payload


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr")
    ap.add_argument("port", type=int)
    ap.add_argument("count", type=int, help="datagrams to receive")
    ap.add_argument("out", help="file for the reassembled messages")
    ap.add_argument("--ready", help="file to create once the socket is bound")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each datagram")
    a = ap.parse_args()

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((a.addr, a.port))
    sock.settimeout(a.timeout)
    if a.ready:
        with open(a.ready, "w") as f:
            f.write(f"{a.addr}:{a.port}\n")

    messages = {}  # (job, src, seq) -> {"len": msg_len, "frags": {off: payload}}
    order = []
    for i in range(a.count):
        try:
            dgram, peer = sock.recvfrom(65535)
        except socket.timeout:
            print(f"plain_udp_receiver: timed out after {a.timeout} s waiting for datagram {i + 1}/{a.count}",
                  file=sys.stderr)
            return 1
        try:
            h, payload = parse(dgram)
        except ValueError as e:
            print(f"plain_udp_receiver: datagram {i + 1} from {peer}: {e}", file=sys.stderr)
            return 1
        key = (h["job_id"], h["src_rank"], h["msg_seq"])
        if key not in messages:
            messages[key] = {"len": h["msg_len"], "frags": {}}
            order.append(key)
        m = messages[key]
        if m["len"] != h["msg_len"]:
            print(f"plain_udp_receiver: message {key}: msg_len changed from {m['len']} to {h['msg_len']}",
                  file=sys.stderr)
            return 1
        m["frags"].setdefault(h["frag_off"], payload)

    with open(a.out, "wb") as out:
        for key in order:
            m = messages[key]
            data = b""
            for off in sorted(m["frags"]):
                if off != len(data):
                    print(f"plain_udp_receiver: message {key}: gap or overlap at byte {len(data)} "
                          f"(next fragment starts at {off})", file=sys.stderr)
                    return 1
                data += m["frags"][off]
            if len(data) != m["len"]:
                print(f"plain_udp_receiver: message {key} incomplete: {len(data)}/{m['len']} bytes",
                      file=sys.stderr)
                return 1
            out.write(data)
    print(f"plain_udp_receiver: {a.count} datagrams, {len(order)} messages -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
