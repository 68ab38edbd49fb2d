#!/usr/bin/env bash
# Peer transport: HTTP/2 against iroh-blobs (docs/peer.md, "Transport"; docs/benchmarks.md,
# "Peer transport: HTTP/2 vs iroh-blobs"). Builds hack/peer-transport-bench (its own cargo
# workspace, so iroh stays out of the main Cargo.lock) in release and runs its `compare`: per
# chunk size, one server process per transport holding BENCH_MIB of pseudo-random chunks in
# memory, then BENCH_RUNS interleaved rounds (HTTP/2, iroh, HTTP/2, iroh, ...) of a fetch
# process getting every chunk at BENCH_CONCURRENCY and BENCH_SERIAL_CHUNKS of them one at a
# time, all on 127.0.0.1. HTTP/2 is the peer tier's own code, linked by path: its router over
# a NodeCache holding the chunks in memory, server::serve (h2c) or server::serve_tls (mTLS,
# PeerTls::from_pem, the fleet name checked), and a PeerClient asking it for every chunk, each
# answer BLAKE3-checked; iroh-blobs is a MemStore behind an endpoint bound to 127.0.0.1 with
# no relay and no address lookup, read with get_blob. Transports: BENCH_TRANSPORTS
# (http2,iroh,http2-tls; also http2-nagle, the server before TCP_NODELAY).
# Prints Markdown on stdout (best and median GB/s, CPU seconds per GB of both processes,
# p50/p99 per chunk, and iroh/HTTP/2 ratios); each run on stderr.
#
#   hack/bench-peer-transport.sh                     # 256K, 1M and 4M chunks; 1 GiB each; 3 runs
#   BENCH_SIZES=1M BENCH_RUNS=5 hack/bench-peer-transport.sh
#
# Env: BENCH_TRANSPORTS, BENCH_SIZES (256K,1M,4M), BENCH_MIB (1024), BENCH_CONCURRENCY (64), BENCH_RUNS (3),
# BENCH_SERIAL_CHUNKS (256), BENCH_DIR (/tmp/sealed-peer-transport-bench), BENCH_CSV (every
# run as CSV; none by default), CARGO_TARGET_DIR (default under $SEALED_CACHE, never in the
# repository).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

[[ ${1:-} == -h || ${1:-} == --help ]] && usage_from_header "$0"

W=${BENCH_DIR:-/tmp/sealed-peer-transport-bench}
CRATE=$HACK_DIR/peer-transport-bench
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$SEALED_CACHE/peer-transport-target}
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

# Someone else's benchmark holds the machine: wait for it.
while [[ -e /tmp/sealed-quiet ]]; do
  log "waiting: /tmp/sealed-quiet exists"
  sleep 30
done
log "cargo build --release (hack/peer-transport-bench)"
nice -n 19 cargo build --release --locked --quiet --manifest-path "$CRATE/Cargo.toml"
BENCH=$CARGO_TARGET_DIR/release/peer-transport-bench

busy=$(pgrep -fc 'cargo|rustc|nextest' || true)
((busy == 0)) || log "note: $busy cargo/rustc/nextest processes running: the machine is loaded"
log "$(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"

rm -rf --one-file-system "$W"
mkdir -p "$W"
trap 'rm -rf --one-file-system "$W"' EXIT
args=(compare --transports "${BENCH_TRANSPORTS:-http2,iroh,http2-tls}"
  --sizes "${BENCH_SIZES:-256K,1M,4M}" --total-mib "${BENCH_MIB:-1024}"
  --concurrency "${BENCH_CONCURRENCY:-64}" --runs "${BENCH_RUNS:-3}"
  --serial-chunks "${BENCH_SERIAL_CHUNKS:-256}" --dir "$W")
[[ -n ${BENCH_CSV:-} ]] && args+=(--csv "$BENCH_CSV")
"$BENCH" "${args[@]}"
