"""One rank of the Gloo peer: torch.distributed (Debian's python3-torch, CPU)
with the gloo backend. Run with /usr/bin/python3 inside the rank's host
namespace, with MASTER_ADDR/MASTER_PORT (rank 0's address, where the TCP store
listens) and GLOO_SOCKET_IFNAME (the host's interface) set.
See peer_common.py for the loop and the output."""

import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer_common as pc  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    a = pc.parse_args("gloo")
    if a.rank is None or a.world is None:
        sys.stderr.write("gloo_peer: --rank and --world are required\n")
        return 2
    for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        if k not in os.environ:
            sys.stderr.write(f"gloo_peer: {k} is not set\n")
            return 2
    # The peers compete with each other for the machine's cores: one thread
    # per rank, as every rank is one host's process.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=a.rank, world_size=a.world, timeout=datetime.timedelta(seconds=a.timeout)
    )
    src = torch.from_numpy(pc.rank_data(a.rank, a.count, a.dtype, a.inject_mismatch))
    buf = src.clone()

    def prepare():
        # Gloo works in place: restore the input, or mark a receiver's buffer
        # so a broadcast that did not arrive cannot pass the check.
        if a.op == "broadcast" and a.rank != pc.ROOT:
            buf.fill_(pc.SENTINEL)
        else:
            buf.copy_(src)

    if a.op == "broadcast":
        op = lambda: dist.broadcast(buf, src=pc.ROOT)  # noqa: E731
    elif a.op == "reduce":
        op = lambda: dist.reduce(buf, dst=pc.ROOT, op=dist.ReduceOp.SUM)  # noqa: E731
    else:
        op = lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # noqa: E731

    rc = pc.run("gloo", a, a.rank, a.world, dist.barrier, prepare, op, buf.numpy)
    if rc == 0:
        # Nobody leaves while another rank still needs the store on rank 0.
        dist.barrier()
        dist.destroy_process_group()
    else:
        # A mismatching rank leaves at once; the runner stops the others.
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
