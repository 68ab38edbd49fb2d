#!/usr/bin/env bash
# Readahead windows against a slow store (docs/benchmarks.md, "Readahead windows without a
# disk cache"; "Readahead at high latency"): one file of random bytes on s3s-fs behind toxiproxy
# (LATENCY ms each way), read once with `dd bs=1M` through a fresh `sealed mount` per case
# (`--no-disk-cache`, or a fresh disk cache with BENCH_DISK=1), page caches dropped; prints
# "flags GB/s origin-bytes/file largest-readahead-window" per run.
#
#   hack/bench-readahead.sh                                   # 512 MiB, 3 runs per case
#   BENCH_CASES=$'\n--readahead 256Mi' BENCH_RUNS=2 hack/bench-readahead.sh
#   BENCH_LATENCY_MS=100 BENCH_DISK=1 BENCH_CASES=$'\n--prefetch-memory 64Mi' hack/bench-readahead.sh
#
# Env: SEALED (default the build in $CARGO_TARGET_DIR), BENCH_DIR, BENCH_MIB (512), BENCH_RUNS
# (3), BENCH_LATENCY_MS (25), BENCH_DISK (0), BENCH_CASES (one set of mount flags per line; an
# empty line is the defaults). Needs root
# and /dev/fuse; tools from hack/build-test-tools.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

W=${BENCH_DIR:-/tmp/sealed-readahead-bench}
SEALED=${SEALED:-${CARGO_TARGET_DIR:-$HACK_DIR/../target}/debug/sealed}
MIB=${BENCH_MIB:-512}
RUNS=${BENCH_RUNS:-3}
CASES=${BENCH_CASES:-$'\n--readahead 256Mi'}
LATENCY=${BENCH_LATENCY_MS:-25}
DISK=${BENCH_DISK:-0}

[[ $(id -u) -eq 0 && -e /dev/fuse ]] || die "needs root and /dev/fuse"
[[ -x $SEALED ]] || die "$SEALED missing: cargo build -p sealed-cli"
export PATH="$("$HACK_DIR/build-test-tools.sh"):$PATH"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret SEALED_STORE_REGION=us-east-1
export SEALED_STORE=s3://readahead

cleanup() {
  local p
  umount -l "$W/mnt" 2>/dev/null || true
  if [[ -e $W/pids ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$W/pids"
  fi
  rm -rf --one-file-system "$W"
}
trap cleanup EXIT

rm -rf --one-file-system "$W"
mkdir -p "$W/src" "$W/mnt"
: >"$W/pids"
slow_origin_up "$W" readahead 30631 30632 30633 "$LATENCY"
head -c "${MIB}M" /dev/urandom >"$W/src/model.bin"
DIGEST=$(SEALED_STORE_ENDPOINT=http://127.0.0.1:30631 "$SEALED" push "$W/src")

while IFS= read -r flags; do
  read -ra extra <<<"$flags"
  for _ in $(seq "$RUNS"); do
    rm -rf --one-file-system "$W/cache"
    if [[ $DISK == 1 ]]; then tier=(--cache-dir "$W/cache" --cache-size 8Gi); else tier=(--no-disk-cache); fi
    SEALED_STORE_ENDPOINT=http://127.0.0.1:30632 "$SEALED" -o json mount "$DIGEST" "$W/mnt" \
      "${tier[@]}" --no-learned-prefetch "${extra[@]}" >"$W/stats.json" 2>"$W/log" &
    pid=$!
    for _ in $(seq 100); do mountpoint -q "$W/mnt" && break; sleep 0.1; done
    sync && echo 3 >/proc/sys/vm/drop_caches
    t0=$(date +%s.%N)
    dd if="$W/mnt/model.bin" of=/dev/null bs=1M status=none
    t1=$(date +%s.%N)
    kill -TERM "$pid" && wait "$pid" || true
    python3 - "$W/stats.json" "${flags:-default}" "$t0" "$t1" "$MIB" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
size = int(sys.argv[5]) << 20
secs = float(sys.argv[4]) - float(sys.argv[3])
print(f"{sys.argv[2]}\t{size / secs / 1e9:.3f} GB/s\t{s['store_bytes_fetched'] / size:.2f}x origin"
      f"\twindow {s.get('readahead_window_bytes', 0) / 2**20:.0f} MiB")
PY
  done
done <<<"$CASES"
