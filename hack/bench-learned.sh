#!/usr/bin/env bash
# The learned prefetch benchmark (docs/benchmarks.md, "Learned prefetch"): a loader that reads
# a version's tensors out of file order (1 MiB preads at seeded random offsets over 4 shards),
# against an S3-compatible origin (s3s-fs) behind toxiproxy with 25 ms each way. Per run, on
# fresh node caches and dropped page caches:
#   first    the version's first mount anywhere: it records the profile (stored when its
#            reader goes quiet for 5 s);
#   replay   a second node: it finds the profile and fetches those chunks before they are read;
#   plain    the same second node without it (--no-learned-prefetch).
#
#   hack/bench-learned.sh                       # 1 GiB version, 256 reads, best of 3
#   BENCH_MIB=512 BENCH_READS=128 BENCH_RUNS=1 hack/bench-learned.sh
#
# Env: SEALED (default the build in $CARGO_TARGET_DIR), BENCH_DIR, BENCH_MIB (1024),
# BENCH_READS (256), BENCH_RUNS (3), BENCH_LATENCY_MS (25), BENCH_CSV
# (docs/benchmarks/learned.csv). Needs root and /dev/fuse; tools from hack/build-test-tools.sh.
# Prints a Markdown table on stdout; progress on stderr.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

W=${BENCH_DIR:-/tmp/sealed-learned-bench}
SEALED=${SEALED:-${CARGO_TARGET_DIR:-$HACK_DIR/../target}/debug/sealed}
MIB=${BENCH_MIB:-1024}
READS=${BENCH_READS:-256}
RUNS=${BENCH_RUNS:-3}
LATENCY=${BENCH_LATENCY_MS:-25}
CSV=${BENCH_CSV:-$HACK_DIR/../docs/benchmarks/learned.csv}
BUCKET=learned
S3_PORT=30621
PROXY_PORT=30622
TOXI_PORT=30623

[[ $(id -u) -eq 0 && -e /dev/fuse ]] || die "needs root and /dev/fuse"
[[ -x $SEALED ]] || die "$SEALED missing: cargo build -p sealed-cli"
export PATH="$("$HACK_DIR/build-test-tools.sh"):$PATH"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret SEALED_STORE_REGION=us-east-1
export SEALED_STORE="s3://$BUCKET"

cleanup() {
  local p
  for m in "$W"/node-*/mnt; do umount -l "$m" 2>/dev/null || true; done
  if [[ -e $W/pids ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$W/pids"
  fi
  [[ ${BENCH_KEEP:-0} == 1 ]] || rm -rf --one-file-system "$W"
}
trap cleanup EXIT

rm -rf --one-file-system "$W"
mkdir -p "$W/src"
: >"$W/pids"
slow_origin_up "$W" "$BUCKET" "$S3_PORT" "$PROXY_PORT" "$TOXI_PORT" "$LATENCY"
log "a $MIB MiB version in 4 shards"
for i in 0 1 2 3; do
  head -c $((MIB / 4))M /dev/urandom >"$W/src/model-0000$i-of-00004.safetensors"
done
# Pushed straight to s3s-fs: only the mounts pay the latency.
DIGEST=$(SEALED_STORE_ENDPOINT="http://127.0.0.1:$S3_PORT" "$SEALED" push "$W/src")
PROFILE=$W/s3/$BUCKET/profiles/${DIGEST#blake3:}

# The loader: READS preads of 1 MiB at seeded random MiB offsets; prints seconds and bytes.
workload() {
  python3 - "$1" "$READS" <<'PY'
import os, random, sys, time
root, reads = sys.argv[1], int(sys.argv[2])
files = sorted(os.path.join(root, f) for f in os.listdir(root))
sizes = [os.path.getsize(f) for f in files]
rng = random.Random(7)
pieces = []
for _ in range(reads):
    i = rng.randrange(len(files))
    pieces.append((i, rng.randrange(sizes[i] >> 20) << 20))
fds = [os.open(f, os.O_RDONLY) for f in files]
start = time.monotonic()
n = sum(len(os.pread(fds[i], 1 << 20, off)) for i, off in pieces)
print(f"{time.monotonic() - start:.3f} {n}")
PY
}

# node NAME [mount flags]: a fresh node cache, a mount, the workload; prints its seconds.
node() {
  local name=$1 d=$W/node-$1 out
  shift
  rm -rf --one-file-system "$d" && mkdir -p "$d/mnt"
  SEALED_STORE_ENDPOINT="http://127.0.0.1:$PROXY_PORT" SEALED_LOG=${SEALED_LOG:-info} \
    "$SEALED" mount "$DIGEST" "$d/mnt" --background --cache-dir "$d/cache" --cache-size 4Gi \
    --log-file "$d/log" "$@" >/dev/null
  sync && echo 3 >/proc/sys/vm/drop_caches
  out=$(workload "$d/mnt")
  log "$name: ${out% *} s"
  echo "${out% *}"
  [[ $name == first ]] && wait_for_profile
  "$SEALED" umount "$d/mnt" >/dev/null
}

wait_for_profile() {
  for _ in $(seq 300); do
    [[ -s $PROFILE ]] && return 0
    sleep 0.1
  done
  die "no profile stored at $PROFILE after the first mount went quiet"
}

echo "run,case,seconds" >"$CSV"
for run in $(seq "$RUNS"); do
  rm -f "$PROFILE"
  for case in first replay plain; do
    flags=()
    [[ $case == plain ]] && flags=(--no-learned-prefetch)
    echo "$run,$case,$(node "$case" "${flags[@]}")" >>"$CSV"
  done
done
log "wrote $CSV"
python3 - "$CSV" "$MIB" "$READS" "$LATENCY" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
best = {}
for r in rows:
    best[r["case"]] = min(best.get(r["case"], float("inf")), float(r["seconds"]))
print(f"{sys.argv[3]} x 1 MiB random reads of a {sys.argv[2]} MiB version, {sys.argv[4]} ms each way, best of {len(rows) // 3}")
print()
print("| case | seconds | plain / case |")
print("|---|---|---|")
for case in ("first", "replay", "plain"):
    print(f"| {case} | {best[case]:.2f} | {best['plain'] / best[case]:.2f}× |")
PY
