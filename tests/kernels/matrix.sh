#!/usr/bin/env bash
# The kernel matrix: kccl's BPF programs and collectives run on Debian kernels booted in
# throwaway VMs (tests/kernels/vm.sh), and a run fails on a failed test or on any kernel
# complaint in a guest's console (BUG, Oops, WARNING, "Bad page state", panic). This is how
# a kernel path is proven before it runs on a machine that reboots on a panic.
#
#   tests/kernels/matrix.sh --smoke   this machine's major.minor: the fixtures and one small
#                                     broadcast, reduce and allreduce per MTU (`.ci/run`
#                                     runs it before any native kernel test)
#   tests/kernels/matrix.sh           the full matrix: the newest 6.12, the newest of this
#                                     machine's major.minor, the newest 7.x; fixtures and
#                                     kernel-path topologies (with loss) per MTU
#
# KCCL_VM_KERNELS and KCCL_VM_MTUS override the lists (e.g. KCCL_VM_KERNELS="7.3.4+deb13-amd64").
# When no VM can be made (no root to install qemu, Debian's archive unreachable and nothing
# cached), it says why and exits 0, or 1 under KCCL_REQUIRE_ROOT=1 (CI).
# Results: target/kernel-matrix/summary.txt and one console log per kernel.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=tests/kernels
mode=full
[ "${1:-}" = --smoke ] && mode=smoke
if [ "$mode" = smoke ]; then
  kernels=${KCCL_VM_KERNELS:-host}
  limit=${KCCL_VM_LIMIT:-1800}
else
  kernels=${KCCL_VM_KERNELS:-6.12 host 7}
  limit=${KCCL_VM_LIMIT:-10800}
fi
# Ethernet, jumbo frames, and loopback-sized links (chunks of 1432, 8928 and 64928 bytes:
# single-buffer frames, then multi-buffer ones of 3 and 16 fragments).
mtus=${KCCL_VM_MTUS:-1500 9000 65000}
out=target/kernel-matrix
mkdir -p "$out"

skip() {
  echo "kernel matrix: SKIPPED: $*" >&2
  if [ "${KCCL_REQUIRE_ROOT:-0}" = 1 ]; then
    echo "kernel matrix: KCCL_REQUIRE_ROOT=1: a skipped kernel matrix is a failure" >&2
    exit 1
  fi
  exit 0
}

[ "$(id -u)" -eq 0 ] || skip "needs root (qemu's 9p export of / and kernel downloads)"

# Build on the host; the guest runs these binaries from the read-only root.
manifest=$out/manifest
cargo build --release --workspace --tests --bins --quiet || { echo "kernel matrix: build failed" >&2; exit 1; }
cargo test --release --workspace --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*/deps/[^"]*"' | cut -d'"' -f4 \
  | sed -E 's|^(.*/deps/([a-z_]+)-[0-9a-f]+)$|\2 \1|' > "$manifest"
echo "kccl_cli $(pwd)/target/release/kccl" >> "$manifest"

: > "$out/summary.txt"
failed=0
for spec in $kernels; do
  if ! kv=$("$here/vm.sh" fetch "$spec"); then
    if [ "$spec" = host ] && [ "$mode" = smoke ]; then
      skip "no Debian kernel VM for this machine's $(uname -r) (see the lines above)"
    fi
    echo "$spec: FETCH FAILED" | tee -a "$out/summary.txt"; failed=$((failed + 1)); continue
  fi
  if [ -z "${scan_checked:-}" ]; then   # once: a planted complaint must fail a VM run
    "$here/vm.sh" selftest "$kv" || { echo "kernel matrix: the VMs' complaint scan is blind" >&2; exit 1; }
    scan_checked=1
  fi
  log=$out/$kv.log console=$out/$kv.console
  t0=$SECONDS
  "$here/vm.sh" run -k "$kv" -t "$limit" -c "$console" -- \
    bash "$here/guest.sh" "$mode" "$manifest" "$mtus" > "$log" 2>&1
  rc=$?
  secs=$((SECONDS - t0))
  case $rc in
    0) verdict="ok" ;;
    90) verdict="KERNEL COMPLAINED" ;;
    91) verdict="DID NOT FINISH" ;;
    *) verdict="FAILED ($rc steps)" ;;
  esac
  [ $rc -eq 0 ] || failed=$((failed + 1))
  {
    echo "$kv ($mode, MTU $mtus): $verdict in ${secs} s"
    grep -E '^step: ' "$console" | sed 's/^/  /'
    grep -A8 'complained' "$log" | sed 's/^/  /'
  } | tee -a "$out/summary.txt"
  if [ $rc -ne 0 ]; then
    echo "  console: $console; the failed steps' output:"
    grep -B40 -E '^step: .* FAIL' "$console" | tail -n 60 | sed 's/^/  | /'
  fi
done
[ $failed -eq 0 ] || { echo "kernel matrix: $failed kernel(s) failed; see $out/summary.txt" >&2; exit 1; }
echo "kernel matrix: every kernel clean ($out/summary.txt)"
