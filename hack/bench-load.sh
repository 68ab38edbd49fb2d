#!/usr/bin/env bash
# The model-load benchmark (docs/benchmarks.md, "Loading a checkpoint"): a multi-shard
# safetensors checkpoint loaded by the real `safetensors` loader (safe_open, mmap, every
# tensor) and read by an O_DIRECT reader, in one run, page caches dropped before every case:
#   a         local disk (the source directory)
#   b         a fresh `sealed mount` from a file:// store (empty node cache)
#   c         a second mount on the same node (files hydrated by b: FUSE passthrough)
#   c-reread  c again without dropping caches, against a native page-cache re-read
#   d         a fresh mount from s3s-fs behind toxiproxy (LATENCY ms each way); it records the
#             learned profile
#   d-model   d with --prefetch model (every tensor fetched in offset order on open)
#   get       a plain parallel GET of the same chunk objects through the same proxy (curl,
#             CONCURRENCY at once: the mount's per-read fetch bound)
#   e         `sealed pull` through the proxy, then the load from the pulled directory
#   f-replay  a second node (fresh cache) that replays d's learned profile
#   f-plain   that node without it (--no-learned-prefetch)
#   odirect-* the O_DIRECT reader on local disk (a) and through the hydrated mount (c)
#   c-cpu     CPU seconds (user + system) of c's serving process from its start (the mount,
#             whose checks of the copies found on disk start as it is set up) until c's load
#             and every check have ended, and
#   c-verify  the wall time of its checks of the hydrated files found on disk (summed over
#             files; they run beside the load: `docs/mount.md`, "What is verified, per path")
#
#   hack/bench-load.sh                          # 2 GiB in 4 shards, best of 3
#   BENCH_MIB=512 BENCH_RUNS=1 hack/bench-load.sh
#   BENCH_CASES=local hack/bench-load.sh        # a, b, c and the re-reads only (no S3, no proxy)
#
# Env: SEALED (default the build in $CARGO_TARGET_DIR), BENCH_DIR, BENCH_MIB (2048), BENCH_RUNS
# (3), BENCH_LATENCY_MS (25), BENCH_CONCURRENCY (64), BENCH_CSV (docs/benchmarks/load.csv),
# BENCH_PNG (docs/benchmarks/load.png), BENCH_PYTHON (a python with safetensors and numpy;
# default: a venv made under ~/.cache/sealed-volumes with pinned versions from PyPI). Needs
# root and /dev/fuse; s3s-fs and toxiproxy from hack/build-test-tools.sh. Prints a Markdown
# table on stdout; progress on stderr.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

W=${BENCH_DIR:-/tmp/sealed-load-bench}
SEALED=${SEALED:-${CARGO_TARGET_DIR:-$HACK_DIR/../target}/debug/sealed}
MIB=${BENCH_MIB:-2048}
RUNS=${BENCH_RUNS:-3}
LATENCY=${BENCH_LATENCY_MS:-25}
CONCURRENCY=${BENCH_CONCURRENCY:-64}
CASES=${BENCH_CASES:-all}
# The serving processes log each check of a hydrated file (c-verify sums them; debug: the
# small ones too).
export SEALED_LOG=${SEALED_LOG:-warn,sealed_mount::verify=debug}
CSV=${BENCH_CSV:-$HACK_DIR/../docs/benchmarks/load.csv}
PNG=${BENCH_PNG:-$HACK_DIR/../docs/benchmarks/load.png}
BUCKET=load
S3_PORT=30631
PROXY_PORT=30632
TOXI_PORT=30633
# What the loader needs, pinned: the numbers should not move with a new wheel.
PY_PINS=(safetensors==0.8.0 numpy==2.4.6 matplotlib==3.11.2)

[[ $(id -u) -eq 0 && -e /dev/fuse ]] || die "needs root and /dev/fuse"
[[ -x $SEALED ]] || die "$SEALED missing: cargo build -p sealed-cli"
[[ $CASES == all || $CASES == local ]] || die "BENCH_CASES is all or local"
if [[ $CASES == all ]]; then
  command -v curl >/dev/null || die "curl is needed for the parallel GET"
  export PATH="$("$HACK_DIR/build-test-tools.sh" --path):$PATH"
fi
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret SEALED_STORE_REGION=us-east-1

python_env() {
  if [[ -n ${BENCH_PYTHON:-} ]]; then
    echo "$BENCH_PYTHON"
    return
  fi
  local key venv
  key=$(printf '%s\n' "${PY_PINS[@]}" | sha256sum | cut -c1-12)
  venv=$SEALED_CACHE/bench-venv-$key
  if [[ ! -x $venv/bin/python ]]; then
    log "a python venv with ${PY_PINS[*]} in $venv"
    python3 -m venv "$venv.tmp" && "$venv.tmp/bin/pip" install -q "${PY_PINS[@]}" >&2 &&
      mv "$venv.tmp" "$venv" || die "could not install ${PY_PINS[*]} from PyPI"
  fi
  echo "$venv/bin/python"
}
PY=$(python_env)

cleanup() {
  local p m
  for m in "$W"/mnt-*; do umount -l "$m" 2>/dev/null || true; done
  if [[ -e $W/pids ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$W/pids"
  fi
  [[ ${BENCH_KEEP:-0} == 1 ]] || rm -rf --one-file-system "$W"
}
trap cleanup EXIT

drop_caches() { sync && echo 3 >/proc/sys/vm/drop_caches; }

rm -rf --one-file-system "$W"
mkdir -p "$W/src"
: >"$W/pids"
[[ $CASES == all ]] && slow_origin_up "$W" "$BUCKET" "$S3_PORT" "$PROXY_PORT" "$TOXI_PORT" "$LATENCY"

# The loader: `load DIR` opens every *.safetensors with safe_open (mmap) and materialises
# every tensor; `odirect DIR` reads every shard with O_DIRECT in 16 MiB requests. Both print
# seconds and bytes.
cat >"$W/load.py" <<'PY'
import mmap, os, sys, time
mode, root = sys.argv[1], sys.argv[2]
shards = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".safetensors"))
start = time.monotonic()
n = 0
if mode == "make":
    import numpy as np
    from safetensors.numpy import save_file
    total, count = int(sys.argv[3]) << 20, int(sys.argv[4])
    rng = np.random.default_rng(7)
    # Tensors of a transformer block's shapes: large projections and small norms.
    sizes = [32 << 20, 8 << 20, 16 << 10, 4 << 20, 64 << 10]
    for s in range(count):
        tensors, have, i = {}, 0, 0
        while have < total // count:
            size = min(sizes[i % len(sizes)], total // count - have)
            tensors[f"layers.{s}.{i}.weight"] = rng.integers(0, 255, size, dtype=np.uint8)
            have += size
            i += 1
        save_file(tensors, os.path.join(root, f"model-{s + 1:05d}-of-{count:05d}.safetensors"))
    sys.exit(0)
if mode == "load":
    from safetensors import safe_open
    for path in shards:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                n += f.get_tensor(key).nbytes
elif mode == "odirect":
    block = 16 << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    for path in shards:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while True:
                got = os.readv(fd, [buf])
                n += got
                if got < block:
                    break
        finally:
            os.close(fd)
print(f"{time.monotonic() - start:.3f} {n}")
PY

SHARDS=4
log "a $MIB MiB checkpoint in $SHARDS safetensors shards"
"$PY" "$W/load.py" make "$W/src" "$MIB" "$SHARDS"
BYTES=$(du -cb "$W"/src/*.safetensors | tail -1 | cut -f1)
export SEALED_STORE="file://$W/store"
DIGEST=$("$SEALED" push "$W/src")
# The same version on s3s-fs, pushed around the proxy: only the reads pay the latency.
[[ $CASES == all ]] &&
  SEALED_STORE="s3://$BUCKET" SEALED_STORE_ENDPOINT="http://127.0.0.1:$S3_PORT" "$SEALED" push "$W/src" >/dev/null
PROFILE=$W/s3/$BUCKET/profiles/${DIGEST#blake3:}
log "version $DIGEST ($BYTES bytes)"

# timed MODE DIR: the loader's seconds (its bytes are checked against the checkpoint's).
timed() {
  local out
  out=$("$PY" "$W/load.py" "$1" "$2")
  [[ ${out#* } -ge $((BYTES * 99 / 100)) ]] || die "$1 of $2 read ${out#* } bytes, not ~$BYTES"
  echo "${out% *}"
}

# mount NAME STORE-KIND [flags]: mounts the version at $W/mnt-NAME with node cache
# $W/cache-NAME (kept across calls with the same NAME).
mount_at() {
  local name=$1 kind=$2 store=()
  shift 2
  mkdir -p "$W/mnt-$name"
  [[ $kind == s3 ]] && store=(env SEALED_STORE="s3://$BUCKET" SEALED_STORE_ENDPOINT="http://127.0.0.1:$PROXY_PORT")
  "${store[@]}" "$SEALED" mount "$DIGEST" "$W/mnt-$name" --background --cache-dir "$W/cache-$name" \
    --cache-size 8Gi --log-file "$W/log-$name" "$@" >/dev/null
}
umount_at() { "$SEALED" umount "$W/mnt-$1" >/dev/null; }
# The serving process of mount NAME, and its CPU seconds (user + system) so far.
server_pid() {
  local p
  for p in $(pgrep -f -- "--daemon-child"); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- " $W/mnt-$1 " && echo "$p"
  done
}
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"; }
# The summed wall time of the checks of hydrated files logged in mount NAME's log since line FROM.
verify_s() {
  tail -n +"$2" "$W/log-$1" | grep 'cache copy verified' |
    sed -n 's/.*micros=\([0-9]*\).*/\1/p' | awk '{ t += $1 } END { printf "%.3f", t / 1e6 }'
}
# How many checks of hydrated files mount NAME logged since line FROM; done once every shard's.
checks() { tail -n +"$2" "$W/log-$1" | grep -c 'cache copy verified' || true; }
checks_done() { [[ $(checks "$1" "$2") -ge $SHARDS ]]; }
# How many hydrated files mount NAME's disk cache holds; b's assemblies finish after its load
# returns, and c measures the hydrated path, so b is unmounted only once every shard is there.
hydrated() { find "$W/cache-$1/files" -type f 2>/dev/null | wc -l; }
hydrated_done() { [[ $(hydrated "$1") -ge $SHARDS ]]; }
fresh() { umount -l "$W/mnt-$1" 2>/dev/null || true; rm -rf --one-file-system "$W/cache-$1"; }

# The parallel GET: every chunk object of the version, once, CONCURRENCY at once.
parallel_get() {
  local cfg=$W/gets.curl t0 t1
  : >"$cfg"
  (cd "$W/s3/$BUCKET" && find chunks -type f) | while read -r key; do
    printf 'url = "http://127.0.0.1:%s/%s/%s"\noutput = "/dev/null"\n' "$PROXY_PORT" "$BUCKET" "$key" >>"$cfg"
  done
  local want got
  want=$(cd "$W/s3/$BUCKET" && find chunks -type f -printf '%s\n' | awk '{ b += $1 } END { print b }')
  t0=$(date +%s.%N)
  # curl 7.x signs no payload hash; s3s-fs requires the header (S3 accepts it too). The bytes
  # are summed: a GET that failed must not pass for a fast one.
  got=$(curl -sf --no-progress-meter --parallel --parallel-max "$CONCURRENCY" \
    --aws-sigv4 "aws:amz:us-east-1:s3" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
    --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" -w '%{size_download}\n' -K "$cfg" |
    awk '{ b += $1 } END { print b + 0 }')
  t1=$(date +%s.%N)
  [[ $got == "$want" ]] || { log "the parallel GET read $got bytes, not $want"; return 1; }
  awk -v a="$t0" -v z="$t1" 'BEGIN { printf "%.3f", z - a }'
}

echo "run,case,seconds" >"$CSV"
# A case that failed inside $(...) leaves an empty time: stop rather than record it.
row() { [[ -n $3 ]] || die "case $2 failed"; echo "$1,$2,$3" >>"$CSV"; log "run $1: $2 $3 s"; }
for run in $(seq "$RUNS"); do
  drop_caches; row "$run" a "$(timed load "$W/src")"
  drop_caches; row "$run" odirect-a "$(timed odirect "$W/src")"

  fresh b
  mount_at b file; drop_caches; row "$run" b "$(timed load "$W/mnt-b")"
  wait_for "b's hydration of the $SHARDS shards" 60 hydrated_done b ||
    die "b hydrated $(hydrated b) of $SHARDS shards"
  umount_at b
  # The checks of the copies b left start while the mount is set up (`verify::walk_mount`):
  # caches are dropped before mounting, and c-cpu counts the serving process from its start
  # to the end of the last check, so no part of them falls outside the window.
  log0=$(($(wc -l <"$W/log-b") + 1)); drop_caches
  mount_at b file
  pid=$(server_pid b)
  row "$run" c "$(timed load "$W/mnt-b")"
  wait_for "c's checks of the $SHARDS shards" 60 checks_done b "$log0" ||
    die "c checked $(checks b "$log0") of $SHARDS hydrated shards"
  row "$run" c-cpu "$(cpu_s "$pid")"
  row "$run" c-verify "$(verify_s b "$log0")"
  row "$run" c-reread "$(timed load "$W/mnt-b")"
  row "$run" a-reread "$(timed load "$W/src")"
  drop_caches; row "$run" odirect-c "$(timed odirect "$W/mnt-b")"
  umount_at b
  [[ $CASES == all ]] || continue

  rm -f "$PROFILE"
  fresh d
  mount_at d s3; drop_caches; row "$run" d "$(timed load "$W/mnt-d")"; umount_at d
  # `sealed umount` returns once the kernel let go; the serving process writes the profile
  # as it ends (within 5 s).
  wait_for "d's learned profile" 10 test -s "$PROFILE" || die "the first mount stored no learned profile"
  fresh dm
  mount_at dm s3 --prefetch model --no-learned-prefetch; drop_caches
  row "$run" d-model "$(timed load "$W/mnt-dm")"; umount_at dm
  get_s=$(parallel_get) || die "the parallel GET failed"
  row "$run" get "$get_s"

  rm -rf --one-file-system "$W/pulled"; drop_caches
  t0=$(date +%s.%N)
  SEALED_STORE="s3://$BUCKET" SEALED_STORE_ENDPOINT="http://127.0.0.1:$PROXY_PORT" \
    "$SEALED" pull "$DIGEST" "$W/pulled" --concurrency "$CONCURRENCY" 2>/dev/null
  t1=$(date +%s.%N)
  pull_s=$(awk -v a="$t0" -v z="$t1" 'BEGIN { printf "%.3f", z - a }')
  row "$run" pull "$pull_s"
  row "$run" e "$(awk -v p="$pull_s" -v l="$(timed load "$W/pulled")" 'BEGIN { printf "%.3f", p + l }')"

  fresh fr
  mount_at fr s3; drop_caches; row "$run" f-replay "$(timed load "$W/mnt-fr")"; umount_at fr
  fresh fp
  mount_at fp s3 --no-learned-prefetch; drop_caches
  row "$run" f-plain "$(timed load "$W/mnt-fp")"; umount_at fp
done
log "wrote $CSV"
"$PY" "$HACK_DIR/plot-load.py" "$CSV" "$PNG" "$BYTES" "$LATENCY"
log "wrote $PNG"
