# shellcheck shell=bash
# Shared helpers for the hack/ scripts. Source it; it defines functions only.

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SEALED_CACHE="${SEALED_CACHE:-$HOME/.cache/sealed-volumes}"

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

need_root() {
  [[ $(id -u) -eq 0 ]] || die "$1 must run as root (it starts containerd and the kubelet)"
}

# The version a tool module pins, read from its go.mod ("require MODULE vX").
pinned_version() {
  local dir=$1 module=$2
  awk -v m="$module" '$1 == m && $2 ~ /^v/ { print $2; exit }
                      $1 == "require" && $2 == m { print $3; exit }' "$HACK_DIR/tools/$dir/go.mod"
}

# Installs Debian packages that are missing; apt-get update only when needed.
apt_ensure() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get to install them"
  log "apt-get install ${missing[*]}"
  apt-get update -qq >/dev/null || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install ${missing[*]} failed"
}

# Polls a command until it succeeds or the timeout (seconds) runs out.
wait_for() {
  local what=$1 timeout=$2
  shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "timed out after ${timeout}s waiting for $what"; return 1; }
    sleep 1
  done
}

# Prints the comment block at the top of the calling script (its usage) and exits 2.
usage_from_header() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$1" >&2
  exit 2
}

# An S3-compatible origin with injected latency, for benchmarks: s3s-fs serving DIR/s3 (the
# bucket BUCKET made in it) on 127.0.0.1:S3_PORT, and toxiproxy (API on TOXI_PORT) forwarding
# PROXY_HOST:PROXY_PORT (PROXY_HOST: 7th argument, default 127.0.0.1) to it with LATENCY_MS each
# way. Pids are appended to DIR/pids. Needs
# s3s-fs, toxiproxy-server and toxiproxy-cli on PATH (hack/build-test-tools.sh) and
# AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY set.
slow_origin_up() {
  local dir=$1 bucket=$2 s3_port=$3 proxy_port=$4 toxi_port=$5 latency=$6 proxy_host=${7:-127.0.0.1}
  mkdir -p "$dir/s3/$bucket"
  s3s-fs --host 127.0.0.1 --port "$s3_port" --access-key "$AWS_ACCESS_KEY_ID" \
    --secret-key "$AWS_SECRET_ACCESS_KEY" "$dir/s3" >"$dir/s3s-fs.log" 2>&1 &
  echo $! >>"$dir/pids"
  toxiproxy-server -host 127.0.0.1 -port "$toxi_port" >"$dir/toxiproxy.log" 2>&1 &
  echo $! >>"$dir/pids"
  local toxi=(toxiproxy-cli -h "127.0.0.1:$toxi_port")
  for _ in $(seq 50); do
    "${toxi[@]}" list >/dev/null 2>&1 && break
    sleep 0.1
  done
  "${toxi[@]}" create -l "$proxy_host:$proxy_port" -u "127.0.0.1:$s3_port" origin >/dev/null
  "${toxi[@]}" toxic add -t latency -a "latency=$latency" -n down origin >/dev/null
  "${toxi[@]}" toxic add -t latency -a "latency=$latency" -u -n up origin >/dev/null
}
