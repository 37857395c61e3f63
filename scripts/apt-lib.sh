# Shared by setup.sh and setup-peers.sh: install the Debian packages of a list
# that are missing, quietly, as root or through sudo. Another apt/dpkg process
# (unattended upgrades, a user's install) holds the dpkg lock for minutes at a
# time: wait for it (up to KCCL_APT_WAIT seconds, default 600) instead of failing.

pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# apt_run LABEL apt-get-args...: runs apt-get, retrying while the lock is held.
apt_run() {
  local label=$1; shift
  local sudo="" waited=0 limit=${KCCL_APT_WAIT:-600} out
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  while :; do
    if out=$(DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout="$limit" "$@" 2>&1 >/dev/null); then
      return 0
    fi
    if grep -qiE 'could not get lock|unable to acquire|lock-frontend' <<<"$out" && [ "$waited" -lt "$limit" ]; then
      [ "$waited" -eq 0 ] && echo "$label: another apt/dpkg process holds the lock; waiting (up to ${limit}s)" >&2
      sleep 5; waited=$((waited + 5)); continue
    fi
    echo "$label: apt-get $* failed:" >&2
    echo "$out" >&2
    return 1
  done
}

# apt_install_missing LABEL NOTE pkg...: installs the missing ones (NOTE says what they cost).
apt_install_missing() {
  local label=$1 note=$2; shift 2
  local need=() p
  for p in "$@"; do pkg_installed "$p" || need+=("$p"); done
  [ ${#need[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    echo "$label: need root to install: apt-get install ${need[*]}" >&2
    return 1
  fi
  echo "$label: installing ${need[*]}${note:+ ($note)}"
  apt_run "$label" update -qq
  # Recommends are left out: python3-torch recommends build tooling nobody here uses.
  apt_run "$label" install -y -qq --no-install-recommends "${need[@]}"
}
