"""What gloo_peer.py and mpi_peer.py share: arguments, per-rank reference data,
the timed loop with its result check, and the per-rank JSON output.

One process per rank. Every iteration: restore the buffers (untimed), barrier,
record CLOCK_MONOTONIC and this process's CPU clock, run the collective,
record both again, then check the result against the reference before the
iteration is kept. CLOCK_MONOTONIC is one clock for every network namespace of
a machine (no time namespaces are used), so the runner can take, per iteration,
the earliest start to the latest end across ranks. Warm-up iterations are run
and checked but not recorded.

Exit codes: 0 ok, 3 result mismatch (message on stderr, starts with
"MISMATCH"), 2 bad arguments.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

OPS = ("broadcast", "reduce", "allreduce")
DTYPES = {"int32": np.int32, "float32": np.float32}
ROOT = 0
# Values of one element stay below 2**24 even when summed over many ranks, so
# float32 sums are exact in any order and int32 never overflows.
PERIOD = 251
STEP = 3
SENTINEL = -7


def parse_args(peer):
    p = argparse.ArgumentParser(description=f"{peer} peer rank for kccl's benchmarks")
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="int32")
    p.add_argument("--count", type=int, required=True, help="elements per rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    p.add_argument("--rank", type=int, help="gloo only: this rank")
    p.add_argument("--world", type=int, help="gloo only: number of ranks")
    p.add_argument("--timeout", type=float, default=120.0, help="gloo only: seconds before a collective gives up")
    p.add_argument(
        "--progress",
        help="rank 0 overwrites this file with 'DONE TOTAL' after each iteration (outside the timed window)",
    )
    p.add_argument(
        "--inject-mismatch",
        action="store_true",
        help="test of the check: rank 0 adds 1 to its first input element, so every checked result is wrong",
    )
    a = p.parse_args()
    if a.count < 1 or a.iters < 1 or a.warmup < 0:
        p.error("--count and --iters must be >= 1, --warmup >= 0")
    return a


def rank_data(rank, count, dtype, inject_mismatch=False):
    """Input of `rank`: element i = i mod 251 + 3*rank + 1 (never the sentinel)."""
    base = np.arange(count, dtype=np.int64) % PERIOD
    v = (base + STEP * rank + 1).astype(DTYPES[dtype])
    if inject_mismatch and rank == ROOT:
        v[0] += 1
    return v


def expected(op, world, count, dtype):
    """What the checked rank(s) must hold after `op`."""
    if op == "broadcast":
        return rank_data(ROOT, count, dtype)
    base = np.arange(count, dtype=np.int64) % PERIOD
    s = world * base + STEP * world * (world - 1) // 2 + world
    return s.astype(DTYPES[dtype])


def checked(op, rank):
    """Whether `rank` holds a result of `op` (reduce: only the root)."""
    return op != "reduce" or rank == ROOT


def first_mismatch(got, want):
    bad = np.flatnonzero(got != want)
    if bad.size == 0:
        return None
    i = int(bad[0])
    return f"{bad.size} of {want.size} elements differ; first at index {i}: got {got[i]!r}, expected {want[i]!r}"


def run(peer, args, rank, world, barrier, prepare, op_fn, result):
    """The timed loop. prepare(): restores buffers (untimed); op_fn(): the
    collective; result(): the numpy view to check."""
    want = expected(args.op, world, args.count, args.dtype) if checked(args.op, rank) else None
    starts, ends, cpus = [], [], []
    total = args.warmup + args.iters
    progress_fd = os.open(args.progress, os.O_WRONLY | os.O_CREAT, 0o644) if args.progress and rank == 0 else None
    for it in range(total):
        prepare()
        barrier()
        c0 = time.process_time_ns()
        t0 = time.monotonic_ns()
        op_fn()
        t1 = time.monotonic_ns()
        c1 = time.process_time_ns()
        if want is not None:
            why = first_mismatch(result(), want)
            if why is not None:
                sys.stderr.write(
                    f"MISMATCH {peer} {args.op} {args.dtype} x{args.count} rank {rank} of {world} "
                    f"iteration {it}: {why}\n"
                )
                sys.stderr.flush()
                return 3
        if it >= args.warmup:
            starts.append(t0)
            ends.append(t1)
            cpus.append(c1 - c0)
        if progress_fd is not None:
            # Fixed width, so a shorter figure never leaves a longer one's tail behind.
            os.pwrite(progress_fd, f"{it + 1:>10} {total:>10}\n".encode(), 0)
    rec = {
        "peer": peer,
        "op": args.op,
        "dtype": args.dtype,
        "count": args.count,
        "bytes": args.count * np.dtype(DTYPES[args.dtype]).itemsize,
        "rank": rank,
        "world": world,
        "root": ROOT,
        "warmup": args.warmup,
        "checked": want is not None,
        "pid": os.getpid(),
        # Which network namespace this rank ran in: the runner checks it is its host's.
        "netns_ino": os.stat("/proc/self/ns/net").st_ino,
        "start_ns": starts,
        "end_ns": ends,
        "cpu_ns": cpus,
    }
    path = os.path.join(args.out, f"rank{rank}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    # Rename: the runner never reads a half-written file.
    os.replace(tmp, path)
    return 0
