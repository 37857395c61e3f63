#!/usr/bin/env bash
# Installs the peers kccl's benchmarks compare with: Gloo (Debian's python3-torch, through
# torch.distributed) and Open MPI 4.1 with mpi4py. They install into /usr/bin/python3 (pyenv's
# python3 on PATH does not see them), which is what crates/kccl-testbed/py/peers/*.py run under.
# Idempotent and quiet: checks first, installs only what is missing.
set -euo pipefail

. "$(dirname "$0")/apt-lib.sh"
apt_install_missing setup-peers "about 570 MB; 34 s when measured on a fresh Debian 12" \
  python3-torch python3-mpi4py openmpi-bin python3-numpy

# Check that what the peers import works under the interpreter they run with
# (mpi4py.MPI is only located: importing it would initialize MPI).
if ! env -u PYTHONPATH -u PYTHONHOME /usr/bin/python3 -c 'import importlib.util as u, numpy, torch.distributed as d
assert d.is_gloo_available() and u.find_spec("mpi4py.MPI")' 2>/dev/null; then
  echo "setup-peers: /usr/bin/python3 cannot import torch.distributed, mpi4py.MPI and numpy after install" >&2
  exit 1
fi
command -v mpirun >/dev/null 2>&1 || { echo "setup-peers: mpirun missing after install" >&2; exit 1; }
echo "setup-peers: ok"
