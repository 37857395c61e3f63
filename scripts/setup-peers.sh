#!/usr/bin/env bash
# Installs the peers kccl's benchmarks compare with: Gloo (Debian's python3-torch, through
# torch.distributed) and Open MPI 4.1 with mpi4py. They install into /usr/bin/python3 (pyenv's
# python3 on PATH does not see them), which is what bench/peers/*.py run under.
# Idempotent and quiet: checks first, installs only what is missing.
set -euo pipefail

pkgs=(python3-torch python3-mpi4py openmpi-bin python3-numpy)
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

need=()
for p in "${pkgs[@]}"; do
  pkg_installed "$p" || need+=("$p")
done

if [ ${#need[@]} -gt 0 ]; then
  echo "setup-peers: installing ${need[*]} (took 34 s and 570 MB on a fresh Debian 12)"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
      echo "setup-peers: need root to install: apt-get install ${need[*]}" >&2
      exit 1
    fi
  fi
  $SUDO apt-get update -qq
  # Recommends are left out: python3-torch recommends build tooling the peers do not use.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Check that what the peers import works under the interpreter they run with
# (mpi4py.MPI is only located: importing it would initialize MPI).
if ! env -u PYTHONPATH -u PYTHONHOME /usr/bin/python3 -c 'import importlib.util as u, numpy, torch.distributed as d
assert d.is_gloo_available() and u.find_spec("mpi4py.MPI")' 2>/dev/null; then
  echo "setup-peers: /usr/bin/python3 cannot import torch.distributed, mpi4py.MPI and numpy after install" >&2
  exit 1
fi
command -v mpirun >/dev/null 2>&1 || { echo "setup-peers: mpirun missing after install" >&2; exit 1; }
echo "setup-peers: ok"
