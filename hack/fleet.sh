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
# baseline), FLEET_FANOUT (64), FLEET_LEARNED=0 (mount with --no-learned-prefetch: nothing is
# fetched before the read, so every node's read is cold however many runs came before). Membership is the file $FLEET_DIR/peers, re-read every second
# by each node: edit it to move nodes in or out. (The node plugin takes its membership from
# the EndpointSlices of its headless Service instead; see docs/peer.md.)
# FLEET_CPUS=0.2 gives each node (its mount process and its reader) a CPU cgroup capped at that
# many cores, as a machine of its own would: N nodes on this 2-core box then compete for the
# origin and each other, not for the cores (cgroup v1 `cpu` or v2 `cpu.max`).
# FLEET_NIC_MBIT=200 gives each node a network of its own instead of loopback ports: its own
# network namespace (sealed-fleet-<i>, address $FLEET_NET.<10+i>) on a bridge (sealedfbr0,
# $FLEET_NET.1, where the origin listens), with a NIC of that many Mbit/s each way (tbf on both
# ends of its veth), so the nodes compete for the origin and their own links as machines would.
# FLEET_ORIGIN_MBIT caps the origin's link to all nodes together (tbf on the bridge; default
# none), FLEET_QUEUE_MS the depth of each shaped link's queue in milliseconds at its rate
# (default 100; deeper queues delay the ACKs of a node's download behind its upload). FLEET_NET
# (10.213.0) is the /24 of that test network; nothing outside it is reached.
# FLEET_ACK_FIRST (1) lets pure TCP ACKs pass a shaped link's queue first, as a host's
# fair-queueing qdisc (fq, fq_codel) does; 0 is one plain FIFO per direction, where a node's
# download ACKs wait behind its upload (measured: 1.28-1.52x one node's time at N = 8, against
# 1.2x with ACKs first; docs/benchmarks.md). FLEET_TCP_CC picks the nodes' TCP congestion
# control (default: the machine's); one the machine does not allow yet is added to its
# net.ipv4.tcp_allowed_congestion_control, which `down` leaves as it is.
# FLEET_MOUNT_ARGS adds flags to every node's `sealed mount` (e.g. "--readahead 256Mi").
# Needs root and /dev/fuse (and iproute2 with tbf for FLEET_NIC_MBIT); the tools come from
# hack/build-test-tools.sh.
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
NIC_MBIT=${FLEET_NIC_MBIT:-}
ORIGIN_MBIT=${FLEET_ORIGIN_MBIT:-}
QUEUE_MS=${FLEET_QUEUE_MS:-100}
[[ $QUEUE_MS =~ ^[0-9]+$ ]] && ((QUEUE_MS >= 1 && QUEUE_MS <= 10000)) || die "FLEET_QUEUE_MS=$QUEUE_MS: want 1 to 10000"
NET=${FLEET_NET:-10.213.0}
TCP_CC=${FLEET_TCP_CC:-}
ACK_FIRST=${FLEET_ACK_FIRST:-1}
[[ $ACK_FIRST =~ ^[01]$ ]] || die "FLEET_ACK_FIRST=$ACK_FIRST: want 0 or 1"
[[ -z $TCP_CC || $TCP_CC =~ ^[a-z0-9_]+$ ]] || die "FLEET_TCP_CC=$TCP_CC: want a congestion control's name"
BRIDGE=sealedfbr0

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

# --- the test network (FLEET_NIC_MBIT) -----------------------------------------------------

# A token-bucket shaper of $2 Mbit/s on the egress of device $1 (in namespace $3, if given):
# a queue of at most QUEUE_MS, then drops, as a switch port would.
shape() {
  local dev=$1 mbit=$2 ns=${3:-}
  python3 -c 'import sys; m = float(sys.argv[1]); assert 1 <= m <= 100000' "$mbit" 2>/dev/null ||
    die "a link rate of '$mbit' Mbit/s: want 1 to 100000"
  local tc=(tc ${ns:+-n "$ns"})
  if [[ $ACK_FIRST != 1 ]]; then
    "${tc[@]}" qdisc replace dev "$dev" root tbf rate "${mbit}mbit" burst 256kb latency "${QUEUE_MS}ms"
    return
  fi
  # The same rate and queue, but pure ACKs (TCP, flags ACK only, under 128 bytes) go first:
  # what a fair-queueing host qdisc (fq, fq_codel: Linux's usual default; this kernel has
  # neither) does for them. Without it a node's download ACKs wait behind its upload.
  local queue_bytes
  queue_bytes=$(python3 -c 'import sys; print(max(64 * 1024, int(float(sys.argv[1]) * 125000 * int(sys.argv[2]) / 1000)))' "$mbit" "$QUEUE_MS")
  "${tc[@]}" qdisc replace dev "$dev" root handle 1: htb default 20
  # quantum: how many bytes a class sends per round (the default, rate / 10, is over HTB's
  # limit at these rates and draws a warning); a few full frames.
  "${tc[@]}" class add dev "$dev" parent 1: classid 1:1 htb rate "${mbit}mbit" ceil "${mbit}mbit" burst 256kb quantum 60000
  "${tc[@]}" class add dev "$dev" parent 1:1 classid 1:10 htb rate "$(python3 -c 'import sys; print(max(1, float(sys.argv[1]) / 20))' "$mbit")mbit" ceil "${mbit}mbit" prio 0 quantum 60000
  "${tc[@]}" class add dev "$dev" parent 1:1 classid 1:20 htb rate "${mbit}mbit" ceil "${mbit}mbit" burst 256kb prio 1 quantum 60000
  "${tc[@]}" qdisc add dev "$dev" parent 1:10 pfifo limit 1000
  "${tc[@]}" qdisc add dev "$dev" parent 1:20 bfifo limit "$queue_bytes"
  # IPv4, header of 5 words, total length < 128, TCP, flags exactly ACK.
  "${tc[@]}" filter add dev "$dev" parent 1: protocol ip prio 1 u32 \
    match ip protocol 6 0xff match u8 0x05 0x0f at 0 match u16 0x0000 0xff80 at 2 \
    match u8 0x10 0xff at 33 flowid 1:10
}

node_ns() { echo "sealed-fleet-$1"; }
node_ip() { echo "$NET.$((10 + $1))"; }

# The bridge the nodes and the origin share; the origin's own link shaped if FLEET_ORIGIN_MBIT.
net_up() {
  [[ -n $NIC_MBIT ]] || return 0
  command -v tc >/dev/null || die "FLEET_NIC_MBIT needs tc (Debian: iproute2)"
  [[ $NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "FLEET_NET=$NET: want the first three octets of a /24"
  ip link show "$BRIDGE" >/dev/null 2>&1 && die "$BRIDGE exists: hack/fleet.sh down first"
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # Frames between nodes are forwarded port to port; only what the host itself sends (the
  # origin) passes the bridge device's own queue.
  [[ -z $ORIGIN_MBIT ]] || shape "$BRIDGE" "$ORIGIN_MBIT"
  # A namespace may pick only an allowed congestion control (the machine allows its default).
  if [[ -n $TCP_CC ]] && ! grep -qw "$TCP_CC" /proc/sys/net/ipv4/tcp_allowed_congestion_control; then
    grep -qw "$TCP_CC" /proc/sys/net/ipv4/tcp_available_congestion_control ||
      die "FLEET_TCP_CC=$TCP_CC: this kernel has $(cat /proc/sys/net/ipv4/tcp_available_congestion_control)"
    sysctl -qw "net.ipv4.tcp_allowed_congestion_control=$(cat /proc/sys/net/ipv4/tcp_allowed_congestion_control) $TCP_CC"
  fi
}

# Node $1's namespace and NIC: a veth with one end on the bridge, both ends shaped, so the
# node gets NIC_MBIT down and NIC_MBIT up.
node_net_up() {
  [[ -n $NIC_MBIT ]] || return 0
  local i=$1 ns
  ns=$(node_ns "$i")
  ip netns add "$ns"
  ip link add "sfv$i" type veth peer name eth0 netns "$ns"
  ip link set "sfv$i" master "$BRIDGE" up
  ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  shape "sfv$i" "$NIC_MBIT"
  shape eth0 "$NIC_MBIT" "$ns"
  [[ -z $TCP_CC ]] || ip netns exec "$ns" sysctl -qw "net.ipv4.tcp_congestion_control=$TCP_CC"
}

net_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '/^sealed-fleet-/ { print $1 }'); do
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

# The command prefix that runs a program in node $1's network namespace, if it has one (only
# the network: its FUSE mount stays visible in ours). One word a line.
node_net_prefix() {
  [[ -n $NIC_MBIT ]] || return 0
  printf '%s\n' nsenter "--net=/run/netns/$(node_ns "$1")" --
}

up() {
  local n=${1:-4} mib=${2:-1024} i
  [[ $(id -u) -eq 0 && -e /dev/fuse ]] || die "needs root and /dev/fuse"
  [[ -x $SEALED ]] || die "$SEALED missing: cargo build -p sealed-cli"
  [[ -e $W/pids ]] && die "a fleet is up in $W: hack/fleet.sh down first"
  mkdir -p "$W/src"
  : >"$W/pids"
  net_up
  local origin_host=127.0.0.1
  [[ -z $NIC_MBIT ]] || origin_host=$NET.1
  slow_origin_up "$W" "$BUCKET" "$S3_PORT" "$PROXY_PORT" "$TOXI_PORT" "$LATENCY" "$origin_host"
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
  # On loopback each node has its own port; in the test network its own address.
  local addrs=()
  for ((i = 0; i < n; i++)); do
    if [[ -n $NIC_MBIT ]]; then addrs+=("$(node_ip "$i"):$PEER_BASE"); else addrs+=("127.0.0.1:$((PEER_BASE + i))"); fi
    echo "${addrs[i]}" >>"$W/peers"
  done
  local digest peer_flags=() in_net=() learned=()
  [[ ${FLEET_LEARNED:-1} == 1 ]] || learned=(--no-learned-prefetch)
  local extra=()
  read -r -a extra <<<"${FLEET_MOUNT_ARGS:-}"
  digest=$(cat "$W/digest")
  for ((i = 0; i < n; i++)); do
    local d=$W/node-$i
    rm -rf "$d" && mkdir -p "$d/mnt"
    if [[ ${FLEET_PEERS:-1} == 1 ]]; then
      peer_flags=(--peers-file "$W/peers" --peer-listen "${addrs[i]}"
        --peer-token-file "$W/token" --peer-fanout "${FLEET_FANOUT:-64}")
    fi
    cgroup_up "node-$i"
    node_net_up "$i"
    mapfile -t in_net < <(node_net_prefix "$i")
    SEALED_STORE_ENDPOINT="http://$origin_host:$PROXY_PORT" SEALED_LOG=${SEALED_LOG:-warn} \
      in_cgroup "node-$i" "${in_net[@]}" "$SEALED" -o json mount "$digest" "$d/mnt" --cache-dir "$d/cache" --cache-size 4Gi \
      "${peer_flags[@]}" "${learned[@]}" "${extra[@]}" >"$d/stats.json" 2>"$d/log" &
    echo $! >"$d/pid"
  done
  for d in $(nodes); do
    for _ in $(seq 300); do mountpoint -q "$d/mnt" && break; sleep 0.1; done
    mountpoint -q "$d/mnt" || { cat "$d/log" >&2; die "$d did not mount"; }
  done
  log "fleet up: $n nodes in $W, version $digest${FLEET_CPUS:+, $FLEET_CPUS cores each}${NIC_MBIT:+, a $NIC_MBIT Mbit/s NIC each}${ORIGIN_MBIT:+, origin link $ORIGIN_MBIT Mbit/s}"
}

# Every node reads every file once, all at the same moment: "node seconds bytes cpu_seconds"
# lines (cpu_seconds: the node's mount process, user + system, over the read), then a last line
# "machine BUSY" (the fraction of this machine's cores busy over the whole read), so a result
# says whether the nodes or the machine were the limit. With FLEET_NIC_MBIT, each node's link
# over the read lands in $W/links.txt (hack/fleet-links.py $W/links.txt $FLEET_NIC_MBIT).
read_all() {
  local d before after sampler= readers=()
  for d in $(nodes); do cpu_seconds "$(cat "$d/pid")" >"$d/cpu-before"; done
  if [[ -n $NIC_MBIT ]]; then
    sample_links &
    sampler=$!
  fi
  before=$(machine_ticks)
  for d in $(nodes); do
    (
      dir=$(node_cgroup "$(basename "$d")")
      [[ -z $dir ]] || echo "$BASHPID" >"$dir/cgroup.procs"
      start=$(date +%s.%N)
      bytes=$(cat "$d"/mnt/*.safetensors | wc -c)
      elapsed=$(echo "$(date +%s.%N) - $start" | bc)
      cpu=$(echo "$(cpu_seconds "$(cat "$d/pid")") - $(cat "$d/cpu-before")" | bc)
      echo "$(basename "$d") $elapsed $bytes $cpu"
    ) &
    readers+=($!)
  done
  wait "${readers[@]}"
  after=$(machine_ticks)
  [[ -z $sampler ]] || kill "$sampler" 2>/dev/null || true
  python3 -c 'import sys; b = [int(x) for x in sys.argv[1].split()]; a = [int(x) for x in sys.argv[2].split()]
busy, total = a[0] - b[0], a[1] - b[1]
print(f"machine {busy / total:.3f}" if total > 0 else "machine 0")' "$before" "$after"
}

# Every 0.5 s, each node's link counters as "seconds node down_bytes up_bytes" lines in
# $W/links.txt (from the bridge end of its veth: what the bridge sends the node is its
# download); hack/fleet-links.py reads them.
sample_links() {
  local i t n
  n=$(nodes | wc -l)
  while true; do
    t=$(date +%s.%N)
    for ((i = 0; i < n; i++)); do
      echo "$t $i $(cat "/sys/class/net/sfv$i/statistics/tx_bytes" "/sys/class/net/sfv$i/statistics/rx_bytes" 2>/dev/null | paste -sd' ')"
    done
    sleep 0.5
  done >"$W/links.txt"
}

# User + system CPU seconds of process $1 so far (0 if it is gone).
cpu_seconds() {
  local stat ticks
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }
  ticks=$(getconf CLK_TCK)
  # Fields after the command name (which may hold spaces): utime is the 12th, stime the 13th.
  echo "${stat##*) }" | awk -v t="$ticks" '{ printf "%.2f\n", ($12 + $13) / t }'
}

# "busy total" jiffies of all cores so far (/proc/stat; idle and iowait count as not busy).
machine_ticks() {
  awk '$1 == "cpu" { total = 0; for (i = 2; i <= NF; i++) total += $i; print total - $5 - $6, total; exit }' /proc/stat
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
  net_down
  log "fleet down (counters in $W/node-*/stats.json)"
}

case ${1:-} in
  up) shift; up "$@" ;;
  read) read_all ;;
  down) down ;;
  *) die "usage: hack/fleet.sh up [N] [MIB] | read | down" ;;
esac
