#!/usr/bin/env bash
# Builds the kube-apiserver of the oldest supported Kubernetes minor (the pin in
# hack/tools-oldest/k8s/go.mod) into a cache directory keyed by the pin, and prints that
# bin directory on stdout. e2e/tests/oldest_apiserver.rs runs it (with the etcd of
# hack/build-k8s.sh) to test the CRDs and the node plugin's field-selector query.
#
#   hack/build-k8s-oldest.sh                  # build what is missing (a warm run takes well under a second)
#   hack/build-k8s-oldest.sh --print-bin-dir  # only print where the binary lives (or would)
#   hack/build-k8s-oldest.sh --check          # exit 0 if the cache is complete, 1 otherwise
#
# The pin lives outside hack/tools/ on purpose: hack/build-k8s.sh hashes hack/tools/*/go.mod.
# Env: SEALED_CACHE (default ~/.cache/sealed-volumes), GOFLAGS/GOPROXY as usual.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# Bump when the build flags below change, so old caches are not reused.
BUILD_REV=1
MOD="$HACK_DIR/tools-oldest/k8s"
K8S_VERSION=$(pinned_version ../tools-oldest/k8s k8s.io/kubernetes)
[[ -n $K8S_VERSION ]] || die "cannot read the k8s.io/kubernetes pin from $MOD/go.mod"

# The key covers every input of the build, so an edited pin gets a new directory.
cache_key() {
  {
    echo "$BUILD_REV"
    cat "$MOD/go.mod" "$MOD/go.sum"
  } | sha256sum | cut -c1-12
}

CACHE_DIR="$SEALED_CACHE/k8s-oldest-$K8S_VERSION-$(cache_key)"
BIN_DIR="$CACHE_DIR/bin"

cache_complete() {
  [[ -f $CACHE_DIR/complete && -x $BIN_DIR/kube-apiserver ]]
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

build() {
  local tmp minor ldflags="" v
  tmp="$CACHE_DIR/tmp.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  # On failure leave no half-built directory behind.
  trap 'rm -rf "$tmp"' EXIT

  minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  for v in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean"
  done
  log "go build (tools-oldest/k8s): k8s.io/kubernetes/cmd/kube-apiserver"
  # The hundreds of "go: downloading" lines of a cold build hide real errors: drop them.
  (cd "$MOD" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" \
    nice -n 10 go build -trimpath -ldflags="-s -w $ldflags" -o "$tmp/" k8s.io/kubernetes/cmd/kube-apiserver) 2>&1 |
    sed -u '/^go: downloading /d' >&2
  [[ ${PIPESTATUS[0]} -eq 0 && -x $tmp/kube-apiserver ]] || die "building kube-apiserver $K8S_VERSION failed"

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
    log "building kube-apiserver $K8S_VERSION into $BIN_DIR (cold: ~10 min on 2 cores)"
    build
    log "built in $((SECONDS - start))s"
  fi
  echo "$BIN_DIR"
}

main "$@"
