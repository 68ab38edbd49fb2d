#!/usr/bin/env bash
# Benchmarks `sealed mount` side by side with its peers on the same bytes, in one run.
#
#   hack/bench-mount.sh                 # 2 GiB file; needs root, /dev/fuse, target/release/sealed
#   BENCH_MB=512 hack/bench-mount.sh    # smaller
#
# Peers (each skipped, saying so, when its tool is missing): native reads (page cache, disk),
# bindfs (passthrough FUSE), rclone mount, casync mount, and a plain parallel ranged GET from the
# loopback S3-compatible server (moto). Page caches are dropped before every cold read.
# Prints a Markdown table of results on stdout; progress goes to stderr.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SEALED=${SEALED:-$ROOT/target/release/sealed}
MB=${BENCH_MB:-2048}
W=${BENCH_DIR:-/tmp/sealed-bench}
S3_PORT=${BENCH_S3_PORT:-39517}
S3_MB=${BENCH_S3_MB:-512} # at most ~800: one listing page of chunk objects

log() { printf '[bench] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mounts and dropping page caches)"
[[ -e /dev/fuse ]] || die "/dev/fuse is absent"
[[ -x $SEALED ]] || die "$SEALED missing: cargo build --release -p sealed-cli"

MOUNTS=()
PIDS=()
cleanup() {
  for m in "${MOUNTS[@]}"; do umount -l "$m" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  # Gigabytes of test data: keep them only when asked (BENCH_KEEP=1).
  [[ ${BENCH_KEEP:-0} == 1 ]] || rm -rf --one-file-system "$W"
}
trap cleanup EXIT

now() { date +%s.%N; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# rate FILE: reads FILE once with 1 MiB requests; prints GB/s (10^9 bytes per second).
rate() {
  local f=$1 t0 t1 bytes
  bytes=$(stat -L -c %s "$f")
  t0=$(now)
  dd if="$f" of=/dev/null bs=1M status=none
  t1=$(now)
  awk -v b="$bytes" -v a="$t0" -v z="$t1" 'BEGIN { printf "%.2f", b / (z - a) / 1e9 }'
}
wait_mounted() {
  for _ in $(seq 1 200); do
    mountpoint -q "$1" && return 0
    sleep 0.05
  done
  log "$1 did not mount"
  return 1
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

RESULTS=()
result() { RESULTS+=("| $1 | $2 | $3 |"); log "$1: $2 GB/s"; }

rm -rf "$W"
mkdir -p "$W"/{src,store,mnt-sealed,mnt-bind,mnt-rclone,mnt-casync,cache}

# A safetensors file (8-byte little-endian header length, JSON header, then tensors) and a loader
# that reads the header, then every tensor in file order, as safetensors' loaders do.
cat >"$W/safetensors_bench.py" <<'PY'
import json, os, struct, sys, time
mode, path = sys.argv[1], sys.argv[2]
if mode == "make":
    total = int(sys.argv[3]) << 20
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header, offset, i = {}, 0, 0
    sizes = [4 << 20, 64 << 10, 16 << 10, 1 << 20, 256 << 10, 8 << 10]
    while offset < total:
        n = sizes[i % len(sizes)]
        header[f"layer.{i}.weight"] = {"dtype": "F32", "shape": [n // 4], "data_offsets": [offset, offset + n]}
        offset += n
        i += 1
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        left = offset
        while left:
            n = min(left, 8 << 20)
            f.write(os.urandom(n))
            left -= n
    print(f"{i} tensors, {offset >> 20} MiB", file=sys.stderr)
else:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        total = 0
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = t["data_offsets"]
            f.seek(base + a)
            total += len(f.read(b - a))
    dt = time.perf_counter() - t0
    print(f"{dt * 1000:.0f} ms ({total / dt / 1e9:.2f} GB/s, {len(header)} tensors)")
PY
log "making a ${MB} MiB file of random bytes"
head -c $((MB << 20)) /dev/urandom >"$W/src/data.bin"
export SEALED_STORE="file://$W/store"
DIGEST=$("$SEALED" push "$W/src" --no-progress 2>/dev/null | tail -1)
log "pushed $DIGEST"

mount_sealed() { # mount_sealed STORE CACHE_DIR [extra flags…]
  local store=$1 cache=$2
  shift 2
  "$SEALED" --store "$store" mount "$DIGEST" "$W/mnt-sealed" --background --cache-dir "$cache" \
    --cache-size 64Gi --log-file "$W/sealed.log" "$@" >&2
  MOUNTS+=("$W/mnt-sealed")
}

# Native.
drop_caches
result "native read, from disk (caches dropped)" "$(rate "$W/src/data.bin")" "\`dd bs=1M\` of the source file"
cat "$W/src/data.bin" >/dev/null
NATIVE_PC=$(rate "$W/src/data.bin")
result "native read, page cache" "$NATIVE_PC" "second \`dd\` of the source file"

# bindfs: a passthrough FUSE filesystem over the same local file.
BIND=""
if command -v bindfs >/dev/null; then
  bindfs -r "$W/src" "$W/mnt-bind"
  MOUNTS+=("$W/mnt-bind")
  wait_mounted "$W/mnt-bind"
  drop_caches
  BIND=$(rate "$W/mnt-bind/data.bin")
  result "bindfs (passthrough FUSE), cold" "$BIND" "\`bindfs -r src mnt\`"
  umount "$W/mnt-bind"
  # The ceiling for any FUSE filesystem's page-cache reads on this kernel.
  bindfs -r -o kernel_cache "$W/src" "$W/mnt-bind"
  wait_mounted "$W/mnt-bind"
  cat "$W/mnt-bind/data.bin" >/dev/null
  result "bindfs -o kernel_cache, re-read (page cache)" "$(rate "$W/mnt-bind/data.bin")" \
    "second \`dd\` through \`bindfs -r -o kernel_cache\`"
  umount "$W/mnt-bind"
else
  log "bindfs not installed: skipped"
fi

# sealed mount from the local file store.
drop_caches
mount_sealed "file://$W/store" "$W/cache"
SEALED_COLD=$(rate "$W/mnt-sealed/data.bin")
result "sealed mount, first read from file:// store (empty disk cache)" "$SEALED_COLD" \
  "\`sealed mount --background --cache-dir <empty>\`"
SEALED_PC=$(rate "$W/mnt-sealed/data.bin")
result "sealed mount, re-read (page cache)" "$SEALED_PC" "second \`dd\` through the same mount"
"$SEALED" umount "$W/mnt-sealed" >&2
sleep 0.5
drop_caches
mount_sealed "file://$W/store" "$W/cache"
SEALED_DISK=$(rate "$W/mnt-sealed/data.bin")
result "sealed mount, read from warm node disk cache (new process)" "$SEALED_DISK" \
  "remount with the same \`--cache-dir\`, caches dropped"
"$SEALED" umount "$W/mnt-sealed" >&2
sleep 0.5
drop_caches
mount_sealed "file://$W/store" "$W/cache-none" --no-disk-cache
SEALED_NODISK=$(rate "$W/mnt-sealed/data.bin")
result "sealed mount, first read from file:// store, no disk cache" "$SEALED_NODISK" \
  "\`--no-disk-cache\`"
"$SEALED" umount "$W/mnt-sealed" >&2
sleep 0.5

# rclone mount of the same directory (local backend), cold.
RCLONE=""
if command -v rclone >/dev/null; then
  rclone mount "$W/src" "$W/mnt-rclone" --read-only --daemon 2>>"$W/rclone.log" || true
  MOUNTS+=("$W/mnt-rclone")
  if wait_mounted "$W/mnt-rclone" 2>/dev/null; then
    drop_caches
    RCLONE=$(rate "$W/mnt-rclone/data.bin")
    result "rclone mount (local backend), cold" "$RCLONE" "\`rclone mount src mnt --read-only\`"
    umount "$W/mnt-rclone" || umount -l "$W/mnt-rclone"
  else
    log "rclone mount failed: skipped (see $W/rclone.log)"
  fi
else
  log "rclone not installed: skipped"
fi

# casync mount of a chunk store made from the same directory, cold.
CASYNC=""
if command -v casync >/dev/null; then
  casync make --store="$W/casync.castr" "$W/data.caidx" "$W/src" >/dev/null 2>&1
  casync mount --store="$W/casync.castr" "$W/data.caidx" "$W/mnt-casync" 2>>"$W/casync.log" &
  PIDS+=($!)
  MOUNTS+=("$W/mnt-casync")
  if wait_mounted "$W/mnt-casync" 2>/dev/null; then
    drop_caches
    CASYNC=$(rate "$W/mnt-casync/data.bin")
    result "casync mount, cold" "$CASYNC" "\`casync mount --store=… data.caidx mnt\`"
    umount "$W/mnt-casync" >/dev/null 2>&1 || umount -l "$W/mnt-casync"
  else
    log "casync mount failed: skipped (see $W/casync.log)"
  fi
else
  log "casync not installed: skipped"
fi

# The loopback S3-compatible server: sealed mount vs a plain parallel ranged GET.
S3_GET=""
S3_SEALED=""
if command -v moto_server >/dev/null && command -v curl >/dev/null; then
  moto_server -p "$S3_PORT" >"$W/moto.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$S3_PORT/" >/dev/null && break; sleep 0.1; done
  export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1
  curl -sf -X PUT "http://127.0.0.1:$S3_PORT/bench" >/dev/null
  S3="s3://bench/store"
  SIGV4=(--aws-sigv4 "aws:amz:us-east-1:s3" --user bench:bench)
  # moto keeps objects in memory and is slow: a smaller file for this comparison.
  mkdir -p "$W/src-s3"
  head -c $((S3_MB << 20)) "$W/src/data.bin" >"$W/src-s3/data.bin"
  S3_DIGEST=$("$SEALED" --store "$S3" --endpoint "http://127.0.0.1:$S3_PORT" push "$W/src-s3" \
    --no-progress 2>/dev/null | tail -1)
  # Plain parallel GET of the same bytes as the server holds them (this version's chunk
  # objects), 16 at a time. (A ranged GET of one big object is no fair baseline on moto: it
  # copies the whole object per request, ~5 MB/s.)
  curl -sf "${SIGV4[@]}" "http://127.0.0.1:$S3_PORT/bench?list-type=2&prefix=store/chunks/&max-keys=1000" |
    grep -o '<Key>[^<]*</Key>' | sed 's/<Key>\(.*\)<\/Key>/\1/' >"$W/s3-keys"
  cfg="$W/gets.curl"
  : >"$cfg"
  first=1
  while read -r key; do
    ((first)) || echo next >>"$cfg"
    first=0
    printf 'url = "http://127.0.0.1:%s/bench/%s"\noutput = "/dev/null"\n' "$S3_PORT" "$key" >>"$cfg"
    printf 'aws-sigv4 = "aws:amz:us-east-1:s3"\nuser = "bench:bench"\nfail\nsilent\n' >>"$cfg"
  done <"$W/s3-keys"
  t0=$(now)
  curl -s --parallel --parallel-max 16 -K "$cfg"
  t1=$(now)
  size=$(stat -c %s "$W/src-s3/data.bin")
  S3_GET=$(awk -v b="$size" -v a="$t0" -v z="$t1" 'BEGIN { printf "%.2f", b / (z - a) / 1e9 }')
  result "plain parallel GET from moto of the same bytes (${S3_MB} MiB, $(wc -l <"$W/s3-keys") chunk objects, curl, 16 at once)" \
    "$S3_GET" "\`curl --parallel --parallel-max 16\`"
  drop_caches
  "$SEALED" --store "$S3" --endpoint "http://127.0.0.1:$S3_PORT" mount "$S3_DIGEST" "$W/mnt-sealed" \
    --background --cache-dir "$W/cache-s3" --cache-size 64Gi --log-file "$W/sealed-s3.log" >&2
  MOUNTS+=("$W/mnt-sealed")
  S3_SEALED=$(rate "$W/mnt-sealed/data.bin")
  result "sealed mount, first read from moto S3 (${S3_MB} MiB, empty disk cache)" "$S3_SEALED" \
    "\`sealed --store s3://… --endpoint http://127.0.0.1:… mount\`"
  "$SEALED" umount "$W/mnt-sealed" >&2
  sleep 0.5
else
  log "moto_server or curl not installed: S3 comparison skipped"
fi

# Mount-ready time: a version of 1,000 small files, and one of 10 GiB.
mkdir -p "$W/many" "$W/huge" "$W/mnt-ready"
for i in $(seq 0 999); do
  d="$W/many/d$((i % 10))"
  mkdir -p "$d"
  echo "file $i" >"$d/f$i.txt"
done
truncate -s 10G "$W/huge/huge.bin"
MANY=$("$SEALED" push "$W/many" --no-progress 2>/dev/null | tail -1)
log "pushing a 10 GiB (sparse) file"
HUGE=$("$SEALED" push "$W/huge" --no-progress 2>/dev/null | tail -1)
ready_ms() { # median of 5 `sealed mount --background` runs, ms (process start to mounted)
  local digest=$1 times=() t0 t1
  for _ in 1 2 3 4 5; do
    t0=$(now)
    "$SEALED" mount "$digest" "$W/mnt-ready" --background --cache-dir "$W/cache" >/dev/null 2>&1
    t1=$(now)
    mountpoint -q "$W/mnt-ready" || die "mount-ready run did not mount"
    times+=("$(awk -v a="$t0" -v z="$t1" 'BEGIN { printf "%.1f", (z - a) * 1000 }')")
    "$SEALED" umount "$W/mnt-ready" >/dev/null 2>&1
    sleep 0.2
  done
  printf '%s\n' "${times[@]}" | sort -n | sed -n 3p
}
READY_MANY=$(ready_ms "$MANY")
READY_HUGE=$(ready_ms "$HUGE")
log "mount-ready: 1,000 files ${READY_MANY} ms, 10 GiB ${READY_HUGE} ms"

# Safetensors: header, then every tensor, from local disk vs through the mount (both cold).
python3 "$W/safetensors_bench.py" make "$W/st/model.safetensors" 512 >&2
"$SEALED" push "$W/st" --no-progress >"$W/st.digest" 2>/dev/null
ST_DIGEST=$(tail -1 "$W/st.digest")
drop_caches
ST_LOCAL=$(python3 "$W/safetensors_bench.py" load "$W/st/model.safetensors")
"$SEALED" mount "$ST_DIGEST" "$W/mnt-sealed" --background --cache-dir "$W/cache-st" >&2
MOUNTS+=("$W/mnt-sealed")
drop_caches
ST_MOUNT=$(python3 "$W/safetensors_bench.py" load "$W/mnt-sealed/model.safetensors")
"$SEALED" umount "$W/mnt-sealed" >&2
log "safetensors load: local ${ST_LOCAL}, mount ${ST_MOUNT}"

cat <<EOF
Machine: $(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) RAM, kernel $(uname -r); file of ${MB} MiB random bytes; GB/s = 10^9 bytes/s.

| measurement | GB/s | how |
|---|---|---|
$(printf '%s\n' "${RESULTS[@]}")

| ratio | measured | target |
|---|---|---|
| sealed first read (file:// store, with disk cache) / bindfs | $(ratio "$SEALED_COLD" "$BIND") | ≥ 0.6 |
| sealed first read (file:// store, no disk cache: the CLI default for file://) / bindfs | $(ratio "$SEALED_NODISK" "$BIND") | ≥ 0.6 |
| sealed first read (with disk cache) / rclone mount | $(ratio "$SEALED_COLD" "$RCLONE") | ≥ 5 |
| sealed first read (no disk cache) / rclone mount | $(ratio "$SEALED_NODISK" "$RCLONE") | ≥ 5 |
| sealed first read (with disk cache) / casync mount | $(ratio "$SEALED_COLD" "$CASYNC") | ≥ 5 |
| sealed first read from moto S3 / parallel ranged GET | $(ratio "$S3_SEALED" "$S3_GET") | ≥ 0.8 |
| sealed re-read / native page-cache read | $(ratio "$SEALED_PC" "$NATIVE_PC") | ≥ 0.9 |

| mount-ready (\`sealed mount --background\`, process start to mounted, median of 5) | ms |
|---|---|
| 1,000 small files | ${READY_MANY} |
| 10 GiB file | ${READY_HUGE} |

| safetensors load (header, then every tensor in file order; caches dropped) | |
|---|---|
| local disk | ${ST_LOCAL} |
| through \`sealed mount\` (file:// store, empty disk cache) | ${ST_MOUNT} |
EOF
