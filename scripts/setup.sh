#!/usr/bin/env bash
# Installs what building, testing and running kccl needs, only if missing.
# Used by `make demo`, `make test` and .ci/run (fresh Debian 12 machine, root).
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }
. "$(dirname "$0")/apt-lib.sh"

# Build and run: the BPF toolchain, libbpf's dependencies, namespaces/links (iproute2,
# ethtool) and matplotlib for the benchmark plots.
apt_install_missing setup "" clang-16 llvm-16 libbpf-dev libelf-dev zlib1g-dev pkg-config bpftool \
  iproute2 ethtool python3-matplotlib make gcc

if ! have cargo; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    echo "setup: cargo is in ~/.cargo/bin; add it to PATH" >&2
  else
    echo "setup: installing Rust (rustup, from Debian's package)"
    apt_run setup install -y -qq rustup || true
    have rustup && rustup default stable
  fi
fi
if have cargo; then
  rustup component list --installed 2>/dev/null | grep -q clippy || rustup component add clippy rustfmt >/dev/null 2>&1 || true
fi

# The kernel's BTF is what vmlinux.h is generated from.
if [ ! -r /sys/kernel/btf/vmlinux ]; then
  echo "setup: warning: /sys/kernel/btf/vmlinux missing: set KCCL_VMLINUX_H to a vmlinux.h to build" >&2
fi
# The peers (Gloo, Open MPI: ~570 MB) are NOT installed here: only what compares with them
# (`make test`, `make bench`, `kccl bench peers|all`) runs scripts/setup-peers.sh.
echo "setup: ok"
