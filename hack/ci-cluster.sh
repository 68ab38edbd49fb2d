#!/usr/bin/env bash
# What CI calls around the tests that need the real cluster.
#
#   hack/ci-cluster.sh up     install prerequisites, build (or reuse cached) binaries, start the
#                             cluster; prints `export KUBECONFIG=...` and `export PATH=...` lines
#   hack/ci-cluster.sh down   stop the cluster and fail if anything is left behind
#
# Typical use:  eval "$(hack/ci-cluster.sh up)"; trap 'hack/ci-cluster.sh down' EXIT
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# Callers run `eval "$(hack/ci-cluster.sh up)"`, which would swallow our exit status:
# on failure, hand them a line that makes their eval fail too.
fail_for_eval() {
  local rc=$?
  ((rc == 0)) || printf 'echo "hack/ci-cluster.sh up failed (exit %d); see its log above" >&2; exit %d\n' "$rc" "$rc"
}

cmd_up() {
  trap fail_for_eval EXIT
  need_root "hack/ci-cluster.sh"
  local start=$SECONDS bin kubeconfig
  apt_ensure containerd runc containernetworking-plugins iptables conntrack umoci skopeo \
    busybox-static openssl curl iproute2 util-linux
  bin=$("$HACK_DIR/build-k8s.sh")
  log "binaries ready in $((SECONDS - start))s: $bin"
  kubeconfig=$("$HACK_DIR/cluster.sh" up | tail -n 1)
  "$bin/kubectl" --kubeconfig "$kubeconfig" get nodes -o wide >&2
  log "cluster ready in $((SECONDS - start))s"
  # The cluster's own kubectl/helm/csi-sanity first on PATH: the system kubectl may be too old.
  # shellcheck disable=SC2016 # $PATH is for the caller's eval to expand
  printf 'export KUBECONFIG=%q\nexport PATH=%q:"$PATH"\n' "$kubeconfig" "$bin"
}

cmd_down() {
  "$HACK_DIR/cluster.sh" down
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  *) usage_from_header "${BASH_SOURCE[0]}" ;;
esac
