#!/usr/bin/env bash
# The project's test command (the README's second command, and what CI runs):
#   1. installs the test tools (hack/install-test-deps.sh, hack/build-test-tools.sh),
#   2. starts the real single-node cluster (hack/ci-cluster.sh) unless SEALED_E2E_CLUSTER=0,
#   3. checks formatting and lints, then runs every test of the workspace.
# Tests start their own moto and Azurite servers on loopback ports and stop them after.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR
source hack/lib/common.sh

hack/install-test-deps.sh
# Go and crates.io tools (toxiproxy, s3s-fs, ...), built once per pin into the cache.
TEST_TOOLS_PATH=$(hack/build-test-tools.sh)
export PATH="$TEST_TOOLS_PATH:$PATH"
# The v1.31 kube-apiserver for e2e/tests/oldest_apiserver.rs (the oldest supported minor).
SEALED_OLDEST_APISERVER="$(hack/build-k8s-oldest.sh)/kube-apiserver"
export SEALED_OLDEST_APISERVER
# Missing servers fail the tests instead of skipping them.
export SEALED_REQUIRE_SERVERS=1

if [[ ${SEALED_E2E_CLUSTER:-1} == 1 ]]; then
  eval "$(hack/ci-cluster.sh up)"
  trap 'hack/ci-cluster.sh down' EXIT
  export SEALED_E2E_CLUSTER=1
else
  log "SEALED_E2E_CLUSTER=0: tests that need the cluster will say they are skipped"
fi

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
log "cargo test"
cargo test --workspace
