#!/usr/bin/env bash
# Installs what building, testing and running kccl needs, only if missing.
# Used by `make demo`, `make test` and .ci/run (fresh Debian 12 machine, root).
set -euo pipefail

need_apt=()
have() { command -v "$1" >/dev/null 2>&1; }
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

for p in clang-16 llvm-16 libbpf-dev libelf-dev zlib1g-dev pkg-config bpftool iproute2 ethtool python3-matplotlib make gcc; do
  pkg_installed "$p" || need_apt+=("$p")
done

if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if have sudo; then SUDO="sudo"; else
      echo "setup: need root to install: ${need_apt[*]} (apt-get install ${need_apt[*]})" >&2
      exit 1
    fi
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if ! have cargo; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    echo "setup: cargo is in ~/.cargo/bin; add it to PATH" >&2
  else
    echo "setup: installing Rust (rustup, from Debian's package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rustup >/dev/null 2>&1 || true
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
# The peers `make test` and the benchmarks compare with (Gloo, Open MPI): on a
# fresh Debian 12 this took 34 s and 570 MB (187 packages).
bash "$(dirname "$0")/setup-peers.sh"

echo "setup: ok"
