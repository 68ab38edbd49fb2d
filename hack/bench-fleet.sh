#!/usr/bin/env bash
# The fleet benchmark: N nodes (hack/fleet.sh) cold-read the same version at the same moment,
# with the peer tier and without it, for N = 1, 2, 4, 8. Per node: seconds to read every file,
# bytes from the origin (the mount's store_bytes_fetched: every byte the store returned),
# bytes from peers, bytes served to peers (owner load).
#
#   hack/bench-fleet.sh                  # 1 GiB version; CSV to docs/benchmarks/fleet.csv
#   BENCH_MIB=256 BENCH_NS="1 4" hack/bench-fleet.sh
#   BENCH_ROUNDS=3 BENCH_NS="1 8" BENCH_MODES=peer BENCH_ACK_FIRST="1 0" BENCH_NIC_MBIT=200 \
#     BENCH_ORIGIN_MBIT=800 BENCH_CSV=docs/benchmarks/fleet-net-repeats.csv hack/bench-fleet.sh
#                                        # repeats, ACK-first and plain FIFO links side by side
#   hack/fleet-table.py docs/benchmarks/fleet-net.csv   # the summary table of a CSV again
#   hack/plot-fleet.py                   # docs/benchmarks/fleet.csv -> docs/benchmarks/fleet.png
#   BENCH_CPUS=0.1 BENCH_CSV=docs/benchmarks/fleet-capped-0.1.csv hack/bench-fleet.sh
#                                        # each node capped at 0.1 cores, as if on its own machine
#   BENCH_NIC_MBIT=200 BENCH_ORIGIN_MBIT=800 BENCH_CSV=docs/benchmarks/fleet-net.csv hack/bench-fleet.sh
#                                        # each node its own network namespace and 200 Mbit/s NIC,
#                                        # the origin's link 800 Mbit/s for all nodes together
#
# Env: BENCH_MIB (1024), BENCH_NS ("1 2 4 8"), BENCH_MODES ("peer origin-only"),
# BENCH_CSV (docs/benchmarks/fleet.csv), BENCH_CPUS (cores per node: hack/fleet.sh's FLEET_CPUS;
# default none), BENCH_NIC_MBIT and BENCH_ORIGIN_MBIT (hack/fleet.sh's FLEET_NIC_MBIT and
# FLEET_ORIGIN_MBIT; default none: loopback), BENCH_LEARNED (hack/fleet.sh's FLEET_LEARNED;
# default 0: no learned prefetch, so every row is a cold read of what its readers ask, and the
# N = 1 row, the version's first mount, is not the only one without a replayed profile),
# BENCH_ROUNDS (1: how many times the whole set runs, one after another; the summary gives
# each row's median over rounds, every ratio against its own round's N = 1), BENCH_ACK_FIRST
# (hack/fleet.sh's FLEET_ACK_FIRST with shaped links: 1, the default, 0, or "0 1" for both
# side by side in each round), SEALED (default: the release build, built here),
# FLEET_* as hack/fleet.sh reads them.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# A benchmark measures the optimised build (a debug build's HTTP/2 and copies cost several
# times the CPU); the tests use the debug one.
if [[ -z ${SEALED:-} ]]; then
  (cd "$HACK/.." && cargo build --release -q -p sealed-cli)
  export SEALED=${CARGO_TARGET_DIR:-$HACK/../target}/release/sealed
fi
MIB=${BENCH_MIB:-1024}
NS=${BENCH_NS:-1 2 4 8}
MODES=${BENCH_MODES:-peer origin-only}
CSV=${BENCH_CSV:-$HACK/../docs/benchmarks/fleet.csv}
export FLEET_DIR=${FLEET_DIR:-/tmp/sealed-fleet-bench}
export FLEET_CPUS=${BENCH_CPUS:-${FLEET_CPUS:-}}
export FLEET_LEARNED=${BENCH_LEARNED:-0}
export FLEET_NIC_MBIT=${BENCH_NIC_MBIT:-${FLEET_NIC_MBIT:-}}
export FLEET_ORIGIN_MBIT=${BENCH_ORIGIN_MBIT:-${FLEET_ORIGIN_MBIT:-}}
ROUNDS=${BENCH_ROUNDS:-1}
[[ $ROUNDS =~ ^[1-9][0-9]?$ ]] || { echo "BENCH_ROUNDS=$ROUNDS: want 1 to 99" >&2; exit 2; }
# Without shaped links there is no queue to order: one pass.
ACK_FIRST=${BENCH_ACK_FIRST:-1}
[[ -n $FLEET_NIC_MBIT ]] || ACK_FIRST=0
for a in $ACK_FIRST; do [[ $a =~ ^[01]$ ]] || { echo "BENCH_ACK_FIRST=$ACK_FIRST: want 0, 1 or \"0 1\"" >&2; exit 2; }; done

log() { printf '[bench-fleet] %s\n' "$*" >&2; }
trap '"$HACK/fleet.sh" down >/dev/null 2>&1 || true' EXIT

rm -rf --one-file-system "$FLEET_DIR"
echo "round,ack_first,mode,nodes,node,seconds,bytes_read,origin_bytes,peer_bytes,served_bytes,read_errors,peer_corrupt,version_bytes,cpu_seconds,machine_busy,nic_mbit,origin_mbit,cpus" >"$CSV"
for round in $(seq "$ROUNDS"); do
  for ack in $ACK_FIRST; do
    for mode in $MODES; do
      for n in $NS; do
        log "round $round${FLEET_NIC_MBIT:+, ACK-first $ack}: $mode, $n nodes, $MIB MiB"
        FLEET_ACK_FIRST=$ack FLEET_PEERS=$([[ $mode == peer ]] && echo 1 || echo 0) "$HACK/fleet.sh" up "$n" "$MIB"
        "$HACK/fleet.sh" read >"$FLEET_DIR/times"
        "$HACK/fleet.sh" down
        version=$(du -sb "$FLEET_DIR/src" | cut -f1)
        busy=$(awk '$1 == "machine" { print $2 }' "$FLEET_DIR/times")
        setup="${FLEET_NIC_MBIT:-},${FLEET_ORIGIN_MBIT:-},${FLEET_CPUS:-}"
        grep '^node-' "$FLEET_DIR/times" | while read -r node seconds bytes cpu; do
          python3 - "$FLEET_DIR/$node/stats.json" "$round,$ack,$mode,$n,$node,$seconds,$bytes" "$version,$cpu,$busy,$setup" >>"$CSV" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
peer = s.get("peer", {})
print(",".join([sys.argv[2], str(s["store_bytes_fetched"]), str(s["peer_bytes_fetched"]),
                str(peer.get("served_bytes", 0)), str(s["read_errors"]), str(s["peer_corrupt"]),
                sys.argv[3]]))
PY
        done
      done
    done
  done
done
log "wrote $CSV"
"$HACK/fleet-table.py" "$CSV"
