#!/usr/bin/env bash
# Boots a Debian kernel under qemu and runs one command in it as root, so that a kernel
# bug that kccl's BPF programs trip costs a throwaway VM instead of this machine (which
# reboots on a panic). The guest's root file system is this machine's, read-only over 9p
# (the binaries built here run there unchanged); the current directory is mounted
# writable at the same path, /tmp and /run are fresh tmpfs. No KVM is assumed: qemu
# emulates the CPU (TCG), so code runs 10-30x slower than here; the guest is for
# correctness and kernel complaints, never for timings.
#
#   tests/kernels/vm.sh resolve SPEC          print the Debian kernel SPEC names
#   tests/kernels/vm.sh fetch SPEC...         download it and build its initramfs (cached)
#   tests/kernels/vm.sh run -k SPEC [-t SECONDS] [-c CONSOLE_LOG] -- COMMAND...
#   tests/kernels/vm.sh selftest [SPEC]       a planted complaint must make `run` fail
#
# SPEC: `host` (the newest Debian build of this machine's major.minor), a major.minor
# such as `6.12`, a major such as `7` (the newest 7.x), or an exact version such as
# `6.18.15+deb13-amd64`. Kernels come from Debian's archive (trixie, trixie-security,
# trixie-backports, sid), cached in $KCCL_VM_CACHE (default /var/cache/kccl-kernels).
#
# Exit status of `run`: COMMAND's; 90 when the guest kernel complained (BUG, Oops,
# WARNING, panic, "Bad page state", ...: the complaint lines are printed); 91 when the
# guest did not finish (hang, timeout); 2 for a usage or fetch error.
set -euo pipefail

cache=${KCCL_VM_CACHE:-/var/cache/kccl-kernels}
# What the tests need from modules (the Debian kernels build these as modules): the 9p
# root, veth + bridge for the virtual clusters, netem/ingress for fault tooling.
modules="netfs 9pnet 9pnet_virtio 9p llc stp bridge veth sch_ingress cls_bpf sch_netem"
# A guest console line matching this is a kernel complaint: the run fails with 90.
complaints='BUG:|Oops|WARNING:|Kernel panic|general protection fault|Bad page state|kernel BUG at|page_pool_release_retry|soft lockup|hard LOCKUP|blocked for more than|refcount_t: (underflow|saturated)|UBSAN:|KASAN:'

die() { echo "vm.sh: $*" >&2; exit 2; }

apt_cfg() {   # sets APT: an apt configuration that sees only the suites kernels come from
  local dir=$cache/apt mirror
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
  local key=/usr/share/keyrings/debian-archive-keyring.gpg
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  {
    echo "deb [signed-by=$key] $mirror trixie main"
    echo "deb [signed-by=$key] ${mirror%/debian}/debian-security trixie-security main"
    echo "deb [signed-by=$key] $mirror trixie-backports main"
    echo "deb [signed-by=$key] $mirror sid main"
  } > "$dir/sources.list"
  APT=(-o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=- \
       -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" -o Debug::NoLocking=1)
}

refresh_lists() {   # once a day at most; a suite that cannot be verified is skipped by apt
  local stamp=$cache/apt/updated
  if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440 2>/dev/null)" ]; then
    if timeout 300 apt-get "${APT[@]}" update -qq >/dev/null 2>&1; then touch "$stamp"; fi
  fi
}

# The host's tools the VM needs: qemu, a static busybox for the initramfs, xz/zstd.
need_tools() {
  if command -v qemu-system-x86_64 >/dev/null && [ -x /bin/busybox ] \
     && { ldd /bin/busybox 2>&1 || true; } | grep -q 'not a dynamic'; then
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || die "qemu-system-x86 and busybox-static are missing and installing them needs root"
  . "$(dirname "$0")/../../scripts/apt-lib.sh"
  apt_install_missing vm.sh "kernel VMs" qemu-system-x86 busybox-static xz-utils zstd \
    || die "could not install qemu-system-x86 and busybox-static"
}

# resolve SPEC -> an exact version such as 6.18.15+deb13-amd64
resolve() {
  local spec=$1 pattern
  case "$spec" in
    *-amd64) echo "$spec"; return 0 ;;
    host) spec=$(uname -r | cut -d. -f1,2) ;;
  esac
  case "$spec" in
    [0-9]*.[0-9]*) pattern="^linux-image-${spec//./\\.}\\.[0-9]+\\+deb[0-9]+-amd64\$" ;;
    [0-9]*) pattern="^linux-image-${spec}\\.[0-9]+\\.[0-9]+\\+deb[0-9]+-amd64\$" ;;
    *) die "unknown kernel spec '$spec' (host, 6.12, 7 or an exact version)" ;;
  esac
  apt_cfg
  refresh_lists
  local found
  found=$(apt-cache "${APT[@]}" search "$pattern" 2>/dev/null | awk '{print $1}' \
          | sed 's/^linux-image-//' | sort -V | tail -n 1)
  if [ -z "$found" ]; then   # offline: the newest kernel of that series already fetched
    found=$(ls -1 "$cache" 2>/dev/null | grep -E "${pattern#^linux-image-}" | sort -V | tail -n 1 || true)
  fi
  [ -n "$found" ] || die "no Debian kernel matches '$1' (archive unreachable and none cached?)"
  echo "$found"
}

guest_init() {   # the initramfs's /init: modules, the 9p root, then COMMAND in a chroot
  cat <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $modules; do [ -f /mods/\$m.ko ] && insmod /mods/\$m.ko 2>/dev/null; done
R=/newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot \$R || { echo "vm.sh: no 9p root"; poweroff -f; }
for d in tmp run var/tmp; do mount -t tmpfs tmpfs \$R/\$d; done
mount --move /proc \$R/proc; mount --move /sys \$R/sys; mount --move /dev \$R/dev
mkdir -p \$R/dev/shm \$R/dev/pts; mount -t tmpfs tmpfs \$R/dev/shm; mount -t devpts devpts \$R/dev/pts
mount -t bpf bpf \$R/sys/fs/bpf; mount -t debugfs debugfs \$R/sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs \$R/sys/kernel/tracing 2>/dev/null; mount -t cgroup2 cgroup2 \$R/sys/fs/cgroup 2>/dev/null
mkdir -p \$R/tmp/vm-ctl; mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 ctl \$R/tmp/vm-ctl
W=\$(cat \$R/tmp/vm-ctl/cwd); mkdir -p \$R\$W 2>/dev/null; mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 work \$R\$W
echo "vm.sh: guest \$(uname -r) up"
mkdir -p \$R/tmp/home
chroot \$R /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/tmp/home TERM=dumb KCCL_IN_VM=1 \
  /bin/bash -c 'cd "\$(cat /tmp/vm-ctl/cwd)" && . /tmp/vm-ctl/env && bash /tmp/vm-ctl/cmd; echo \$? > /tmp/vm-ctl/status'
sync; poweroff -f
INIT
}

fetch() {   # the kernel and the modules the tests need, cached; prints the exact version
  local kv dir tmp
  kv=$(resolve "$1"); dir=$cache/$kv
  if [ -f "$dir/vmlinuz" ] && [ -d "$dir/mods" ]; then echo "$kv"; return 0; fi
  need_tools >&2
  apt_cfg
  tmp=$(mktemp -d); chmod 755 "$tmp"
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  (cd "$tmp" && apt-get "${APT[@]}" download "linux-image-$kv" >/dev/null 2>&1) \
    || die "could not download linux-image-$kv from Debian's archive"
  # Newer Debian kernels split the image into linux-binary-* and linux-modules-* packages.
  local dep
  for dep in $(dpkg-deb -f "$tmp"/linux-image-*.deb Depends | tr ',|' '\n\n' | awk '{print $1}' \
               | grep -xE "linux-(binary|modules)-$kv" || true); do
    (cd "$tmp" && apt-get "${APT[@]}" download "$dep" >/dev/null 2>&1) || die "could not download $dep"
  done
  local deb
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  local vmlinuz kmods
  vmlinuz=$(find "$tmp/root" -name "vmlinuz-$kv" | head -n 1)
  [ -n "$vmlinuz" ] || die "no vmlinuz-$kv in the downloaded packages"
  kmods=$(find "$tmp/root" -type d -path "*/lib/modules/$kv/kernel" | head -n 1)
  [ -n "$kmods" ] || die "no modules for $kv in the downloaded packages"
  local m ko
  rm -rf "$dir"; mkdir -p "$dir/mods.new"
  for m in $modules; do
    ko=$(find "$kmods" -name "$m.ko*" | head -n 1)
    [ -n "$ko" ] || continue   # built into this kernel
    case "$ko" in
      *.xz) xz -dc "$ko" > "$dir/mods.new/$m.ko" ;;
      *.zst) zstd -qdc "$ko" > "$dir/mods.new/$m.ko" ;;
      *) cp "$ko" "$dir/mods.new/$m.ko" ;;
    esac
  done
  cp "$vmlinuz" "$dir/vmlinuz"
  mv "$dir/mods.new" "$dir/mods"
  echo "$kv"
}

# initramfs KV: prints the path of KV's initramfs for the current guest_init (built when
# missing: named by the init script's hash, so a changed script never boots a stale one).
initramfs() {
  local dir=$cache/$1 hash ird
  hash=$(guest_init | sha256sum | cut -c1-12)
  if [ ! -f "$dir/initramfs-$hash.gz" ]; then
    ird=$(mktemp -d)
    mkdir -p "$ird/bin" "$ird/mods" "$ird/proc" "$ird/sys" "$ird/dev" "$ird/newroot"
    cp /bin/busybox "$ird/bin/busybox"
    cp "$dir"/mods/*.ko "$ird/mods/" 2>/dev/null || true
    guest_init > "$ird/init"; chmod 755 "$ird/init"
    (cd "$ird" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1 > "$dir/initramfs-$hash.gz.new")
    mv "$dir/initramfs-$hash.gz.new" "$dir/initramfs-$hash.gz"
    rm -rf "$ird"
  fi
  echo "$dir/initramfs-$hash.gz"
}

run() {
  local spec=host limit=900 console=""
  while [ $# -gt 0 ]; do
    case "$1" in
      -k) spec=$2; shift 2 ;;
      -t) limit=$2; shift 2 ;;
      -c) console=$2; shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  [ $# -gt 0 ] || die "usage: vm.sh run -k SPEC [-t SECONDS] [-c CONSOLE_LOG] -- COMMAND..."
  need_tools >&2
  local kv ird; kv=$(fetch "$spec"); ird=$(initramfs "$kv")
  local ctl; ctl=$(mktemp -d)
  pwd > "$ctl/cwd"
  printf '%q ' "$@" > "$ctl/cmd"; echo >> "$ctl/cmd"
  # The guest starts from an empty environment; pass on what steers kccl's tests.
  env | grep -E '^(KCCL_[A-Z0-9_]+|RUST_BACKTRACE|RUST_LOG)=' | sed 's/^/export /; s/=/="/; s/$/"/' > "$ctl/env" || true
  [ -n "$console" ] || console=$(mktemp "${TMPDIR:-/tmp}/kccl-vm-console.XXXXXX")
  echo "vm.sh: booting $kv (limit ${limit}s) for: $*" >&2
  timeout "$limit" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m 4096 \
    -nographic -no-reboot \
    -kernel "$cache/$kv/vmlinuz" -initrd "$ird" \
    -append "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$ctl",mount_tag=ctl,security_model=none,multidevs=remap \
    -virtfs local,path="$(pwd)",mount_tag=work,security_model=none,multidevs=remap \
    -nic none 2>&1 | tr -d '\r' | sed -u 's/\x1b\[[0-9;?]*[a-zA-Z]//g' > "$console" || true
  local bad status=91
  bad=$(grep -E "$complaints" "$console" | head -n 8 || true)
  [ -f "$ctl/status" ] && status=$(cat "$ctl/status")
  rm -rf "$ctl"
  if [ -n "$bad" ]; then
    echo "vm.sh: the guest kernel $kv complained (console: $console):" >&2
    echo "$bad" | sed 's/^/  /' >&2
    return 90
  fi
  if [ "$status" = 91 ]; then
    echo "vm.sh: the guest $kv did not finish (hang or ${limit}s limit; console: $console)" >&2
  fi
  return "$status"
}

# The gate is only as good as its scan: a planted complaint must fail the run with 90.
selftest() {
  local rc=0
  local log; log=$(mktemp)
  run -k "${1:-host}" -t 300 -- sh -c 'echo "<3>BUG: kccl vm.sh self-test, planted" > /dev/kmsg' 2>"$log" || rc=$?
  [ "$rc" -eq 90 ] || cat "$log" >&2
  rm -f "$log"
  [ "$rc" -eq 90 ] || die "self-test: a planted kernel complaint gave exit $rc, not 90: the scan is blind"
  echo "vm.sh: self-test ok: a planted kernel complaint fails the run"
}

case "${1:-}" in
  resolve) shift; [ $# -eq 1 ] || die "usage: vm.sh resolve SPEC"; apt_cfg; resolve "$1" ;;
  fetch) shift; [ $# -ge 1 ] || die "usage: vm.sh fetch SPEC..."; for s in "$@"; do fetch "$s"; done ;;
  run) shift; run "$@" ;;
  selftest) shift; selftest "$@" ;;
  *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
