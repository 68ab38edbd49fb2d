#!/usr/bin/env bash
# Would grouping chunks into larger objects pay? (docs/peer.md, "The 1,000-node arithmetic";
# docs/benchmarks.md, "Grouping chunks".) The same MIB of bytes on s3s-fs behind toxiproxy
# (LATENCY ms each way), stored as 1 MiB chunk objects and as groups of G chunks, read by a
# plain parallel GET (curl) in one run, caches dropped before every case:
#   whole-chunks    every 1 MiB object, CONCURRENCY at once (what a cold node does today)
#   whole-gG        every G MiB group, CONCURRENCY at once (fewer, larger requests)
#   whole-gG-bytes  every group, with the same bytes in flight as whole-chunks
#                   (CONCURRENCY / G at once: the mount bounds bytes in flight, not requests)
#   sparse-chunks   a random SPARSE% of the chunks, one GET each (a reader that touches part
#                   of a checkpoint: one shard, some tensors)
#   sparse-gG-range the same chunks as ranged GETs into the groups (as many requests as
#                   sparse-chunks: grouping saves nothing here)
#   sparse-gG-whole the groups that hold them, whole (fewer requests, bytes nobody asked for)
# Each row: seconds, GET requests, bytes fetched.
#
#   hack/bench-grouping.sh                        # 1 GiB, groups of 4 and 16, best of 3
#   BENCH_MIB=256 BENCH_RUNS=1 BENCH_GROUPS=16 hack/bench-grouping.sh
#
# Env: BENCH_DIR, BENCH_MIB (1024), BENCH_GROUPS ("4 16"), BENCH_RUNS (3), BENCH_LATENCY_MS
# (25), BENCH_CONCURRENCY (64), BENCH_SPARSE_PERCENT (10), BENCH_CSV
# (docs/benchmarks/grouping.csv). Needs s3s-fs and toxiproxy from hack/build-test-tools.sh,
# curl, and root (to drop caches). Prints a Markdown table on stdout; progress on stderr.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

W=${BENCH_DIR:-/tmp/sealed-grouping-bench}
MIB=${BENCH_MIB:-1024}
GROUPS_=${BENCH_GROUPS:-4 16}
RUNS=${BENCH_RUNS:-3}
LATENCY=${BENCH_LATENCY_MS:-25}
CONCURRENCY=${BENCH_CONCURRENCY:-64}
SPARSE=${BENCH_SPARSE_PERCENT:-10}
CSV=${BENCH_CSV:-$HACK_DIR/../docs/benchmarks/grouping.csv}
BUCKET=grouping
S3_PORT=30641
PROXY_PORT=30642
TOXI_PORT=30643
CHUNK=$((1 << 20))

[[ $(id -u) -eq 0 ]] || die "needs root (to drop the page cache between cases)"
command -v curl >/dev/null || die "curl is needed"
export PATH="$("$HACK_DIR/build-test-tools.sh" --path):$PATH"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret

cleanup() {
  local p
  if [[ -e $W/pids ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$W/pids"
  fi
  [[ ${BENCH_KEEP:-0} == 1 ]] || rm -rf --one-file-system "$W"
}
trap cleanup EXIT
drop_caches() { sync && echo 3 >/proc/sys/vm/drop_caches; }

rm -rf --one-file-system "$W"
mkdir -p "$W"
: >"$W/pids"
slow_origin_up "$W" "$BUCKET" "$S3_PORT" "$PROXY_PORT" "$TOXI_PORT" "$LATENCY"
B=$W/s3/$BUCKET

# The objects, written straight into s3s-fs's directory: chunks/NNNNNN (1 MiB each) and, per
# group size G, gG/NNNNNN (G chunks concatenated, in order).
log "$MIB MiB as 1 MiB chunks and as groups of ${GROUPS_// /, } MiB"
mkdir -p "$B/chunks"
head -c "$((MIB * CHUNK))" /dev/urandom | split -a 6 -d -b "$CHUNK" - "$B/chunks/"
for g in $GROUPS_; do
  ((g > 0 && MIB % g == 0)) || die "a group size must divide BENCH_MIB ($g, $MIB)"
  mkdir -p "$B/g$g"
  cat "$B"/chunks/* | split -a 6 -d -b "$((g * CHUNK))" - "$B/g$g/"
done
# The sparse reader's chunks: SPARSE% of them, the same ones in every run and case.
mapfile -t PICKED < <(seq 0 $((MIB - 1)) | shuf --random-source=<(yes) -n $((MIB * SPARSE / 100)) | sort -n)
((${#PICKED[@]} > 0)) || die "BENCH_SPARSE_PERCENT=$SPARSE picks no chunk of $MIB"

url() { printf 'url = "http://127.0.0.1:%s/%s/%s"\noutput = "/dev/null"\n' "$PROXY_PORT" "$BUCKET" "$1"; }

# get NAME PARALLEL: runs the curl config $W/NAME.curl; prints "seconds requests bytes".
get() {
  local cfg=$W/$1.curl t0 t1 out
  drop_caches
  t0=$(date +%s.%N)
  # curl 7.x signs no payload hash; s3s-fs requires the header (S3 accepts it too).
  out=$(curl -sf --no-progress-meter --parallel --parallel-max "$2" --aws-sigv4 "aws:amz:us-east-1:s3" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
    --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" -w '%{size_download}\n' -K "$cfg") ||
    { log "a GET of $1 failed"; return 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v z="$t1" '{ n++; b += $1 } END { printf "%.3f %d %d", z - a, n, b }' <<<"$out"
}

# The curl configs, made once.
for i in $(seq 0 $((MIB - 1))); do url "chunks/$(printf %06d "$i")"; done >"$W/whole-chunks.curl"
for i in "${PICKED[@]}"; do url "chunks/$(printf %06d "$i")"; done >"$W/sparse-chunks.curl"
for g in $GROUPS_; do
  for i in $(seq 0 $((MIB / g - 1))); do url "g$g/$(printf %06d "$i")"; done >"$W/whole-g$g.curl"
  cp "$W/whole-g$g.curl" "$W/whole-g$g-bytes.curl"
  for i in "${PICKED[@]}"; do
    url "g$g/$(printf %06d $((i / g)))"
    printf 'range = "%d-%d"\n' $((i % g * CHUNK)) $(((i % g + 1) * CHUNK - 1))
  done >"$W/sparse-g$g-range.curl"
  for grp in $(printf '%s\n' "${PICKED[@]}" | awk -v g="$g" '{ print int($1 / g) }' | uniq); do
    url "g$g/$(printf %06d "$grp")"
  done >"$W/sparse-g$g-whole.curl"
done

CASES=(whole-chunks sparse-chunks)
for g in $GROUPS_; do CASES+=("whole-g$g" "whole-g$g-bytes" "sparse-g$g-range" "sparse-g$g-whole"); done
parallel_of() {
  case $1 in
    *-bytes) local g=${1#whole-g}; g=${g%-bytes}; echo $(((CONCURRENCY + g - 1) / g)) ;;
    *) echo "$CONCURRENCY" ;;
  esac
}

echo "run,case,parallel,seconds,requests,bytes" >"$CSV"
for run in $(seq "$RUNS"); do
  for c in "${CASES[@]}"; do
    p=$(parallel_of "$c")
    result=$(get "$c" "$p") || die "case $c failed"
    read -r s n b <<<"$result"
    echo "$run,$c,$p,$s,$n,$b" >>"$CSV"
    log "run $run: $c ($p at once) $s s, $n GETs, $b bytes"
  done
done
log "wrote $CSV"

# The table: best of the runs per case, and the rate of the bytes a reader wanted.
python3 - "$CSV" "$MIB" "${#PICKED[@]}" "$LATENCY" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
mib, picked, latency = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
best = {}
for r in rows:
    if r["case"] not in best or float(r["seconds"]) < float(best[r["case"]]["seconds"]):
        best[r["case"]] = r
print(f"| case ({latency} ms each way) | at once | best s | GETs | MiB fetched | wanted MiB/s | vs chunks |")
print("|---|---|---|---|---|---|---|")
for name, r in best.items():
    wanted = mib if name.startswith("whole") else picked
    base = best["whole-chunks" if name.startswith("whole") else "sparse-chunks"]
    s = float(r["seconds"])
    print(f"| {name} | {r['parallel']} | {s:.2f} | {r['requests']} | {int(r['bytes']) / 2**20:.0f} "
          f"| {wanted / s:.0f} | {float(base['seconds']) / s:.2f}x |")
PY
