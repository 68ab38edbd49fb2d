#!/usr/bin/env bash
# A fleet of N "nodes" on this machine: N `sealed mount` processes of one version, each with
# its own cache dir and peer port, over one S3-compatible origin (s3s-fs) reached through
# toxiproxy with 25 ms of latency each way, as a bucket in another zone would be.
#
#   hack/fleet.sh up [N] [MIB]   # N nodes (default 4) mounting a fresh MIB-MiB version (default 1024)
#   hack/fleet.sh read           # every node reads every file at once; per-node seconds on stdout
#   hack/fleet.sh down           # unmount; per-node counters (JSON) land in $FLEET_DIR/node-*/stats.json
#
# Env: FLEET_DIR (default /tmp/sealed-fleet), SEALED (the binary; default the debug build in
# $CARGO_TARGET_DIR), FLEET_LATENCY_MS (25), FLEET_PEERS=0 (nodes without the peer tier: the
# baseline), FLEET_FANOUT (64). Membership is the file $FLEET_DIR/peers, re-read every second
# by each node: edit it to move nodes in or out. (The node plugin takes its membership from
# the EndpointSlices of its headless Service instead; see docs/peer.md.)
# FLEET_CPUS=0.2 gives each node (its mount process and its reader) a CPU cgroup capped at that
# many cores, as a machine of its own would: N nodes on this 2-core box then compete for the
# origin and each other, not for the cores (cgroup v1 `cpu` or v2 `cpu.max`).
# Needs root and /dev/fuse; the tools come from hack/build-test-tools.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

W=${FLEET_DIR:-/tmp/sealed-fleet}
SEALED=${SEALED:-${CARGO_TARGET_DIR:-$HACK_DIR/../target}/debug/sealed}
LATENCY=${FLEET_LATENCY_MS:-25}
BUCKET=fleet
S3_PORT=${FLEET_S3_PORT:-30611}
PROXY_PORT=${FLEET_PROXY_PORT:-30612}
TOXI_PORT=${FLEET_TOXI_PORT:-30613}
# Below the kernel's ephemeral range (32768-60999), so no outgoing connection holds one.
PEER_BASE=${FLEET_PEER_BASE:-30700}

export PATH="$("$HACK_DIR/build-test-tools.sh"):$PATH"
export AWS_ACCESS_KEY_ID=fleet AWS_SECRET_ACCESS_KEY=fleetsecret SEALED_STORE_REGION=us-east-1
export SEALED_STORE="s3://$BUCKET"

CG_NAME=sealed-fleet
# The CPU cgroup directory of node $1 under the hierarchy this machine has ("" without FLEET_CPUS).
node_cgroup() {
  [[ -n ${FLEET_CPUS:-} ]] || return 0
  if [[ -e /sys/fs/cgroup/cgroup.controllers ]]; then
    echo "/sys/fs/cgroup/$CG_NAME/$1"
  else
    echo "/sys/fs/cgroup/cpu/$CG_NAME/$1"
  fi
}

# Makes node $1's cgroup with FLEET_CPUS cores (a quota of that share of each 100 ms period).
cgroup_up() {
  local dir quota
  dir=$(node_cgroup "$1")
  [[ -n $dir ]] || return 0
  quota=$(python3 -c 'import sys; c = float(sys.argv[1]); assert 0.01 <= c <= 64; print(int(c * 100000))' \
    "$FLEET_CPUS") || die "FLEET_CPUS=$FLEET_CPUS: want cores per node, 0.01 to 64"
  if [[ -e /sys/fs/cgroup/cgroup.controllers ]]; then
    mkdir -p "/sys/fs/cgroup/$CG_NAME"
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
    grep -qw cpu "/sys/fs/cgroup/$CG_NAME/cgroup.subtree_control" ||
      echo +cpu >"/sys/fs/cgroup/$CG_NAME/cgroup.subtree_control"
    mkdir -p "$dir" && echo "$quota 100000" >"$dir/cpu.max"
  else
    [[ -d /sys/fs/cgroup/cpu ]] || die "FLEET_CPUS needs a cpu cgroup controller (v1 or v2)"
    mkdir -p "$dir" && echo 100000 >"$dir/cpu.cfs_period_us" && echo "$quota" >"$dir/cpu.cfs_quota_us"
  fi
}

# Runs "$@" (exec) inside node $1's cgroup, if it has one.
in_cgroup() {
  local dir
  dir=$(node_cgroup "$1")
  shift
  [[ -z $dir ]] || echo "$BASHPID" >"$dir/cgroup.procs"
  exec "$@"
}

cgroups_down() {
  local top
  for top in "/sys/fs/cgroup/$CG_NAME" "/sys/fs/cgroup/cpu/$CG_NAME"; do
    [[ -d $top ]] || continue
    find "$top" -mindepth 1 -maxdepth 1 -type d -exec rmdir {} + 2>/dev/null || true
    rmdir "$top" 2>/dev/null || true
  done
}

nodes() { find "$W" -maxdepth 1 -name 'node-*' -type d 2>/dev/null | sort -V; }

up() {
  local n=${1:-4} mib=${2:-1024} i
  [[ $(id -u) -eq 0 && -e /dev/fuse ]] || die "needs root and /dev/fuse"
  [[ -x $SEALED ]] || die "$SEALED missing: cargo build -p sealed-cli"
  [[ -e $W/pids ]] && die "a fleet is up in $W: hack/fleet.sh down first"
  mkdir -p "$W/src"
  : >"$W/pids"
  slow_origin_up "$W" "$BUCKET" "$S3_PORT" "$PROXY_PORT" "$TOXI_PORT" "$LATENCY"
  if [[ ! -e $W/digest ]]; then
    log "a $mib MiB version (4 files of random bytes)"
    for i in 0 1 2 3; do
      head -c $((mib / 4))M /dev/urandom >"$W/src/model-0$i.safetensors"
    done
    # Pushed straight to s3s-fs: only the nodes' reads pay the latency.
    SEALED_STORE_ENDPOINT="http://127.0.0.1:$S3_PORT" "$SEALED" push "$W/src" >"$W/digest"
  fi
  openssl rand -hex 24 >"$W/token"
  rm -rf --one-file-system "$W"/node-*
  : >"$W/peers"
  for ((i = 0; i < n; i++)); do echo "127.0.0.1:$((PEER_BASE + i))" >>"$W/peers"; done
  local digest peer_flags=()
  digest=$(cat "$W/digest")
  for ((i = 0; i < n; i++)); do
    local d=$W/node-$i
    rm -rf "$d" && mkdir -p "$d/mnt"
    if [[ ${FLEET_PEERS:-1} == 1 ]]; then
      peer_flags=(--peers-file "$W/peers" --peer-listen "127.0.0.1:$((PEER_BASE + i))"
        --peer-token-file "$W/token" --peer-fanout "${FLEET_FANOUT:-64}")
    fi
    cgroup_up "node-$i"
    SEALED_STORE_ENDPOINT="http://127.0.0.1:$PROXY_PORT" SEALED_LOG=${SEALED_LOG:-warn} \
      in_cgroup "node-$i" "$SEALED" -o json mount "$digest" "$d/mnt" --cache-dir "$d/cache" --cache-size 4Gi \
      "${peer_flags[@]}" >"$d/stats.json" 2>"$d/log" &
    echo $! >"$d/pid"
  done
  for d in $(nodes); do
    for _ in $(seq 300); do mountpoint -q "$d/mnt" && break; sleep 0.1; done
    mountpoint -q "$d/mnt" || { cat "$d/log" >&2; die "$d did not mount"; }
  done
  log "fleet up: $n nodes in $W, version $digest${FLEET_CPUS:+, $FLEET_CPUS cores each}"
}

# Every node reads every file once, all at the same moment: "node seconds bytes" lines.
read_all() {
  local d start
  for d in $(nodes); do
    (
      dir=$(node_cgroup "$(basename "$d")")
      [[ -z $dir ]] || echo "$BASHPID" >"$dir/cgroup.procs"
      start=$(date +%s.%N)
      bytes=$(cat "$d"/mnt/*.safetensors | wc -c)
      echo "$(basename "$d") $(echo "$(date +%s.%N) - $start" | bc) $bytes"
    ) &
  done
  wait
}

down() {
  local d p
  for d in $(nodes); do
    [[ -e $d/pid ]] && kill -TERM "$(cat "$d/pid")" 2>/dev/null || true
  done
  for d in $(nodes); do
    if [[ -e $d/pid ]]; then
      p=$(cat "$d/pid")
      for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
      rm -f "$d/pid"
    fi
    umount -l "$d/mnt" 2>/dev/null || true
  done
  if [[ -e $W/pids ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$W/pids"
    rm -f "$W/pids"
  fi
  cgroups_down
  log "fleet down (counters in $W/node-*/stats.json)"
}

case ${1:-} in
  up) shift; up "$@" ;;
  read) read_all ;;
  down) down ;;
  *) die "usage: hack/fleet.sh up [N] [MIB] | read | down" ;;
esac
