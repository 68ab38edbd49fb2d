#!/usr/bin/env bash
# Push benchmark, side by side in one run on the same file (see docs/benchmarks.md):
#   sealed push vs b3sum (all threads), cp (+sync), restic backup, casync make
#   (a) into an empty store, (b) again with every chunk present: unchanged (the stat cache
#   skips every file), with --rehash (every byte read and hashed again), and b3sum of the
#   same bytes beside them, (c) after ~10% of the file is overwritten in scattered 8 MiB
#   regions (bytes uploaded and time).
# Usage: hack/bench-push.sh [SIZE_MIB]   (default 2048); results in docs/benchmarks/push.csv
# BENCH_FILES=N splits the bytes into N shards (a checkpoint's tree; default 1 file);
# BENCH_OUT=path writes the CSV elsewhere.
# Needs: b3sum (cargo install b3sum); restic and casync (Debian) are measured when installed
# and not named in BENCH_SKIP.
# Each timing is the median of 3. SEALED_BIN=path skips the build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR
source hack/lib/common.sh
size_mib=${1:-2048}
work=${BENCH_DIR:-/var/tmp/sealed-bench-push}
out=${BENCH_OUT:-docs/benchmarks/push.csv}
shards=${BENCH_FILES:-1}
if ! [[ $shards =~ ^[1-9][0-9]*$ ]] || ((size_mib % shards != 0)); then
  die "BENCH_FILES=$shards must be a positive divisor of SIZE_MIB=$size_mib"
fi
export PATH="$SEALED_CACHE/tools/bin:$PATH"
for t in b3sum python3 bc; do command -v "$t" >/dev/null || die "$t is not installed"; done
# A peer is measured when installed and not named in BENCH_SKIP ("restic casync").
have() {
  [[ " ${BENCH_SKIP:-} " != *" $1 "* ]] || { log "skipping $1 (BENCH_SKIP)"; return 1; }
  command -v "$1" >/dev/null || { log "$1 is not installed: its rows are skipped"; return 1; }
}
# SEALED_BIN: an already built binary (else a release build of the tree).
[[ -n ${SEALED_BIN:-} ]] || cargo build --quiet --release -p sealed-cli
sealed=${SEALED_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/release/sealed}

rm -rf "$work" && mkdir -p "$work/src"
files=()
for ((i = 1; i <= shards; i++)); do
  files+=("$(printf '%s/src/model-%05d-of-%05d.safetensors' "$work" "$i" "$shards")")
done
log "writing ${size_mib} MiB of random data in $shards file(s)"
for f in "${files[@]}"; do head -c "$(((size_mib / shards) << 20))" /dev/urandom >"$f"; done
cat "${files[@]}" >/dev/null # page cache: every tool reads from memory
bytes=$((size_mib << 20))
export RESTIC_PASSWORD=bench RESTIC_CACHE_DIR=$work/restic-cache
# The stat cache of `sealed push` (~/.cache/sealed/stat) goes with the run.
export XDG_CACHE_HOME=$work/cache

# Median wall time (seconds) of 3 runs of "$@", with $setup run before each.
median() {
  local times=() i s
  for i in 1 2 3; do
    eval "$setup"
    s=$(date +%s.%N)
    "$@" >/dev/null 2>&1
    times+=("$(echo "$(date +%s.%N) - $s" | bc -l)")
  done
  printf '%s\n' "${times[@]}" | sort -n | sed -n 2p
}

echo "scenario,tool,seconds,gb_per_s,bytes_added" >"$out"
row() { # scenario tool seconds bytes_added
  local gbps
  gbps=$(echo "$bytes / $3 / 1000000000" | bc -l)
  printf '%s,%s,%.3f,%.3f,%s\n' "$1" "$2" "$3" "$gbps" "$4" | tee -a "$out"
}
du_b() { du -sb "$1" | cut -f1; }

log "(a) into an empty store"
setup=':'
row hash b3sum "$(median b3sum "${files[@]}")" 0
setup="rm -rf $work/copy"
row initial cp "$(median cp -r "$work/src" "$work/copy")" "$bytes"
row initial cp+sync "$(median sh -c "cp -r '$work/src' '$work/copy' && sync")" "$bytes"
rm -rf "$work/copy" # the disk space goes to the stores below
setup="rm -rf $work/store $work/cache && mkdir $work/store"
row initial "sealed push" "$(median "$sealed" --no-progress --store "file://$work/store" push "$work/src")" "$bytes"
if have restic; then
  setup="rm -rf $work/restic && restic init -q -r $work/restic"
  row initial "restic backup" "$(median restic -q -r "$work/restic" backup "$work/src")" "$bytes"
fi
if have casync; then
  setup="rm -rf $work/castr $work/a.caidx"
  row initial "casync make" "$(median casync make --store="$work/castr" "$work/a.caidx" "$work/src")" "$bytes"
fi

log "(b) again, every chunk present"
setup=':'
# The file is older than the stat cache's racy window (2 s) by now: the cache vouches for it.
row repush "sealed push" "$(median "$sealed" --no-progress --store "file://$work/store" push "$work/src")" 0
row repush "sealed push --rehash" "$(median "$sealed" --no-progress --store "file://$work/store" push --rehash "$work/src")" 0
row repush b3sum "$(median b3sum "${files[@]}")" 0
if have restic; then
  row repush "restic backup" "$(median restic -q -r "$work/restic" backup "$work/src")" 0
  row repush "restic backup --force" "$(median restic -q -r "$work/restic" backup --force "$work/src")" 0
fi
if have casync; then
  row repush "casync make" "$(median casync make --store="$work/castr" "$work/a.caidx" "$work/src")" 0
fi

log "(c) ~10% overwritten in scattered 8 MiB regions"
changed=$(python3 - "${files[@]}" <<'PY'
import os, sys
region = 8 << 20
changed = 0
for path in sys.argv[1:]:
    size = os.path.getsize(path)
    n = max(1, size // region // 10)
    step = size // n
    with open(path, "r+b") as f:
        for i in range(n):
            f.seek(min(i * step + 3 * region // 2 + 12345, size - region))
            f.write(os.urandom(region))
    changed += n * region
print(changed)
PY
)
cat "${files[@]}" >/dev/null
before=$(du_b "$work/store")
s=$(date +%s.%N)
json=$("$sealed" --no-progress --store "file://$work/store" push "$work/src" -o json)
t=$(echo "$(date +%s.%N) - $s" | bc -l)
uploaded=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_uploaded"])' <<<"$json")
row changed10 "sealed push" "$t" "$uploaded"
if have restic; then
  before=$(du_b "$work/restic")
  s=$(date +%s.%N)
  restic -q -r "$work/restic" backup "$work/src" >/dev/null
  t=$(echo "$(date +%s.%N) - $s" | bc -l)
  row changed10 "restic backup" "$t" "$(($(du_b "$work/restic") - before))"
fi
if have casync; then
  before=$(du_b "$work/castr")
  s=$(date +%s.%N)
  casync make --store="$work/castr" "$work/b.caidx" "$work/src" >/dev/null 2>&1
  t=$(echo "$(date +%s.%N) - $s" | bc -l)
  row changed10 "casync make" "$t" "$(($(du_b "$work/castr") - before))"
fi
echo "changed_bytes,$changed" | tee -a "$out"
log "wrote $out"
rm -rf "$work"
