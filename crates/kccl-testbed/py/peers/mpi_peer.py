"""One rank of the Open MPI peer (Debian's openmpi-bin 4.1 + python3-mpi4py).
Started by mpirun (rank and size come from MPI); the runner launches mpirun in
host 0's namespace with an rsh agent that enters each host's namespace
(see crates/kccl/src/bench_peers.rs and docs/PEERS.md).
See peer_common.py for the loop and the output."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import peer_common as pc  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main():
    a = pc.parse_args("mpi")
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if a.world is not None and a.world != world:
        sys.stderr.write(f"mpi_peer: mpirun started {world} ranks, expected {a.world}\n")
        comm.Abort(2)
    src = pc.rank_data(rank, a.count, a.dtype, a.inject_mismatch)
    # Separate send and receive buffers (MPI is not in place here): the input
    # never changes, the output is marked before each iteration.
    out = np.empty_like(src)
    mpi_t = MPI.INT32_T if a.dtype == "int32" else MPI.FLOAT

    if a.op == "broadcast":
        buf = src.copy()

        def prepare():
            if rank == pc.ROOT:
                buf[:] = src
            else:
                buf.fill(pc.SENTINEL)

        def op():
            comm.Bcast([buf, mpi_t], root=pc.ROOT)

        result = lambda: buf  # noqa: E731
    else:

        def prepare():
            out.fill(pc.SENTINEL)

        if a.op == "reduce":

            def op():
                comm.Reduce([src, mpi_t], [out, mpi_t], op=MPI.SUM, root=pc.ROOT)

        else:

            def op():
                comm.Allreduce([src, mpi_t], [out, mpi_t], op=MPI.SUM)

        result = lambda: out  # noqa: E731

    rc = pc.run("mpi", a, rank, world, comm.Barrier, prepare, op, result)
    if rc != 0:
        # Takes every rank and mpirun down with a nonzero exit.
        comm.Abort(rc)
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
