#!/usr/bin/env bash
# Builds the test and benchmark tools that are not Debian, PyPI or npm packages, each into a
# cache directory keyed by its pins, and prints the PATH entries for them on stdout.
#
#   hack/build-test-tools.sh          # build what is missing, print "dir:dir:..." (warm: < 1 s)
#   hack/build-test-tools.sh --path   # only print where the tools live (or would)
#
# Go tools: one module per tool under hack/test-tools/NAME (go.mod, go.sum pin it; the file
# `build` lists "PACKAGE BINARY" lines). Rust tools: hack/test-tools/cargo/tools.txt lists
# "CRATE VERSION FEATURES BINARY" lines, installed with `cargo install --locked`.
# These are kept apart from hack/tools (the cluster binaries), so adding a test tool does not
# rebuild Kubernetes. Env: SEALED_CACHE (default ~/.cache/sealed-volumes).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

TOOLS="$HACK_DIR/test-tools"
ROOT="$SEALED_CACHE/test-tools"
# Bump when the build flags below change, so old caches are not reused.
BUILD_REV=1

go_key() { cat "$1/go.mod" "$1/go.sum" "$1/build" | { echo "$BUILD_REV"; cat; } | sha256sum | cut -c1-12; }

go_dir() { echo "$ROOT/$(basename "$1")-$(go_key "$1")"; }

cargo_dir() { echo "$ROOT/$1-$2-${3//,/+}"; }

# Every tool's bin directory, one per line.
bin_dirs() {
  local mod crate version features binary
  for mod in "$TOOLS"/*/; do
    mod=${mod%/}
    [[ -f $mod/go.mod ]] && echo "$(go_dir "$mod")/bin"
  done
  while read -r crate version features binary; do
    [[ -z $crate || $crate == \#* ]] && continue
    echo "$(cargo_dir "$crate" "$version" "$features")/bin"
  done <"$TOOLS/cargo/tools.txt"
}

build_go() {
  local mod=$1 dir tmp package binary
  dir=$(go_dir "$mod")
  [[ -f $dir/complete ]] && return 0
  tmp="$dir.tmp.$$"
  rm -rf "$tmp" && mkdir -p "$tmp/bin"
  while read -r package binary; do
    [[ -z $package || $package == \#* ]] && continue
    log "go build $package -> $binary"
    # The "go: downloading" lines of a cold build hide real errors: drop them.
    (cd "$mod" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" \
      nice -n 10 go build -trimpath -ldflags="-s -w" -o "$tmp/bin/$binary" "$package") 2>&1 |
      sed -u '/^go: downloading /d' >&2
    [[ -x $tmp/bin/$binary ]] || { rm -rf "$tmp"; die "go build $package failed"; }
  done <"$mod/build"
  rm -rf "$dir" && mv "$tmp" "$dir"
  date -u +%FT%TZ >"$dir/complete"
}

build_cargo() {
  local crate=$1 version=$2 features=$3 binary=$4 dir tmp
  dir=$(cargo_dir "$crate" "$version" "$features")
  [[ -f $dir/complete && -x $dir/bin/$binary ]] && return 0
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"
  log "cargo install $crate $version (features: $features)"
  # Its own target directory: the workspace's is locked while tests build.
  CARGO_TARGET_DIR="$tmp/target" nice -n 10 cargo install --quiet --locked --root "$tmp" \
    --version "=$version" --features "$features" "$crate" >&2 ||
    { rm -rf "$tmp"; die "cargo install $crate $version failed"; }
  rm -rf "$tmp/target"
  [[ -x $tmp/bin/$binary ]] || { rm -rf "$tmp"; die "cargo install $crate gave no $binary"; }
  rm -rf "$dir" && mv "$tmp" "$dir"
  date -u +%FT%TZ >"$dir/complete"
}

path_line() { bin_dirs | paste -sd: -; }

main() {
  case "${1:-}" in
    --path) path_line; return 0 ;;
    "") ;;
    *) usage_from_header "${BASH_SOURCE[0]}" ;;
  esac
  mkdir -p "$ROOT"
  local mod crate version features binary
  for mod in "$TOOLS"/*/; do
    mod=${mod%/}
    [[ -f $mod/go.mod ]] && build_go "$mod"
  done
  while read -r crate version features binary; do
    [[ -z $crate || $crate == \#* ]] && continue
    build_cargo "$crate" "$version" "$features" "$binary"
  done <"$TOOLS/cargo/tools.txt"
  path_line
}

main "$@"
