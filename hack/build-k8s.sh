#!/usr/bin/env bash
# Builds the pinned test-cluster binaries from the Go module proxy into a cache
# directory keyed by the pins, and prints that bin directory on stdout.
#
#   hack/build-k8s.sh                # build what is missing (a warm run takes well under a second)
#   hack/build-k8s.sh --print-bin-dir  # only print where the binaries live (or would)
#   hack/build-k8s.sh --check        # exit 0 if the cache is complete, 1 otherwise
#
# Pins live in hack/tools/*/go.mod: k8s.io/kubernetes (apiserver, controller-manager,
# scheduler, kubelet, kube-proxy, kubectl), etcd, csi-sanity, helm, and a pause binary.
# Env: SEALED_CACHE (default ~/.cache/sealed-volumes), GOFLAGS/GOPROXY as usual.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# Bump when the build flags below change, so old caches are not reused.
BUILD_REV=1
TOOLS="$HACK_DIR/tools"
K8S_VERSION=$(pinned_version k8s k8s.io/kubernetes)
[[ -n $K8S_VERSION ]] || die "cannot read the k8s.io/kubernetes pin from $TOOLS/k8s/go.mod"

# The key covers every input of the build, so an edited pin gets a new directory.
cache_key() {
  {
    echo "$BUILD_REV"
    cat "$TOOLS"/*/go.mod "$TOOLS"/*/go.sum "$TOOLS"/pause/main.go 2>/dev/null
  } | sha256sum | cut -c1-12
}

CACHE_DIR="$SEALED_CACHE/k8s-$K8S_VERSION-$(cache_key)"
BIN_DIR="$CACHE_DIR/bin"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl
  etcd csi-sanity helm pause)

cache_complete() {
  local b
  [[ -f $CACHE_DIR/complete ]] || return 1
  for b in "${BINARIES[@]}"; do [[ -x $BIN_DIR/$b ]] || return 1; done
}

# Finds a Go toolchain (>= 1.21, which can fetch a newer toolchain from the module proxy).
ensure_go() {
  if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
    export PATH="/usr/local/go/bin:$PATH"
  fi
  command -v go >/dev/null || die "no Go toolchain found (need go >= 1.21 on PATH or in /usr/local/go)"
  local minor
  minor=$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')
  if ! [[ $minor =~ ^[0-9]+$ ]] || ((minor < 21)); then
    die "go $(go env GOVERSION) is too old; need >= 1.21"
  fi
}

# go_build MODULE_DIR OUT_DIR LDFLAGS PACKAGE... builds static, stripped binaries.
go_build() {
  local mod=$1 out=$2 ldflags=$3
  shift 3
  log "go build ($(basename "$mod")): $*"
  # The hundreds of "go: downloading" lines of a cold build hide real errors: drop them.
  (cd "$mod" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" \
    nice -n 10 go build -trimpath -ldflags="-s -w $ldflags" -o "$out/" "$@") 2>&1 |
    sed -u '/^go: downloading /d' >&2
}

build_all() {
  local tmp minor k8s_ldflags v
  tmp="$CACHE_DIR/tmp.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  # On failure leave no half-built directory behind.
  trap 'rm -rf "$tmp"' EXIT

  minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  k8s_ldflags=""
  for v in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean"
  done
  go_build "$TOOLS/k8s" "$tmp" "$k8s_ldflags" \
    k8s.io/kubernetes/cmd/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kube-proxy,kubectl}
  go_build "$TOOLS/etcd" "$tmp" "" go.etcd.io/etcd/server/v3
  mv "$tmp/server" "$tmp/etcd"
  go_build "$TOOLS/csi-test" "$tmp" "" github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity
  go_build "$TOOLS/helm" "$tmp" \
    "-X helm.sh/helm/v3/internal/version.version=$(pinned_version helm helm.sh/helm/v3)" helm.sh/helm/v3/cmd/helm
  go_build "$TOOLS/pause" "$tmp" "" .

  rm -rf "$BIN_DIR"
  mv "$tmp" "$BIN_DIR"
  trap - EXIT
  date -u +%FT%TZ >"$CACHE_DIR/complete"
}

main() {
  case "${1:-}" in
    --print-bin-dir) echo "$BIN_DIR"; return 0 ;;
    --check) cache_complete; return ;;
    "") ;;
    *) usage_from_header "${BASH_SOURCE[0]}" ;;
  esac
  if ! cache_complete; then
    ensure_go
    mkdir -p "$CACHE_DIR"
    local start=$SECONDS
    log "building Kubernetes $K8S_VERSION tools into $BIN_DIR (cold: ~20-30 min on 2 cores)"
    build_all
    log "built in $((SECONDS - start))s"
  fi
  echo "$BIN_DIR"
}

main "$@"
