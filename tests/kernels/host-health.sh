#!/usr/bin/env bash
# Refuses to run native kernel tests on a kernel that has already reported memory
# corruption since boot: such a kernel panics soon (this machine reboots on a panic), in
# the middle of whatever runs next. `make test` runs this before any native kernel test.
# Exit 0: nothing reported (or the log is unreadable, said so); 1: corruption reported.
set -uo pipefail
corrupt='Bad page state|kernel BUG at|general protection fault|refcount_t: (underflow|saturated)|page_pool.*leak'
if ! log=$(dmesg 2>/dev/null); then
  echo "host-health: cannot read the kernel log (dmesg needs root here); not checked" >&2
  exit 0
fi
hits=$(grep -E "$corrupt" <<<"$log" | tail -n 3)
if [ -n "$hits" ]; then
  echo "host-health: this machine's kernel ($(uname -r)) has reported memory corruption since boot:" >&2
  echo "$hits" | cut -c1-200 | sed 's/^/  /' >&2
  echo "host-health: no native kernel test runs on it; reboot it, and run the path that did it" >&2
  echo "             only in tests/kernels/matrix.sh until the VMs show it clean" >&2
  exit 1
fi
echo "host-health: the kernel log shows no memory corruption"
