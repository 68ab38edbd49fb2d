#!/usr/bin/env bash
# Builds the `sealed` CLI for a release: a static binary per Linux architecture (musl), each
# as dist/sealed-VERSION-linux-ARCH.tar.gz (the binary, and LICENSE when there is one) with a CycloneDX SBOM
# (hack/sbom.sh), then dist/SHA256SUMS over everything in dist/ and the krew plugin manifest
# dist/sealed.yaml (`kubectl krew install --manifest=dist/sealed.yaml`, or the krew index).
#
#   hack/release.sh                      # this machine's architecture (x86_64 or aarch64)
#   hack/release.sh --target aarch64-unknown-linux-musl   # cross: needs cargo-zigbuild + zig
#   hack/release.sh --no-build           # only SHA256SUMS and the krew manifest, over the
#                                        # archives already in dist/ (the workflow's last job)
#
# Environment: SEALED_VERSION (default: the workspace version; a leading v is dropped),
# SEALED_RELEASE_DIR (default dist), SEALED_RELEASE_URL (where the archives are downloaded
# from; default the GitHub release of vVERSION), SEALED_GIT_COMMIT (stamped into --version),
# CARGO_TARGET_DIR. .github/workflows/release.yml runs it on an amd64 and an arm64 runner,
# each building its own architecture natively, and once more with --no-build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

targets=()
build=1
while (($#)); do
  case $1 in
    --target) targets+=("${2:?--target needs a value}"); shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "release.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if ((build)) && ((${#targets[@]} == 0)); then
  targets=("$(uname -m)-unknown-linux-musl")
fi

version=${SEALED_VERSION:-$(cargo metadata --format-version 1 --no-deps --locked |
  jq -r '.packages[] | select(.name == "sealed-cli") | .version')}
version=${version#v}
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || { echo "release.sh: bad version '$version'" >&2; exit 1; }
dist=${SEALED_RELEASE_DIR:-dist}
url=${SEALED_RELEASE_URL:-https://github.com/sealed-volumes/sealed-volumes/releases/download/v$version}
target_dir=${CARGO_TARGET_DIR:-target}
mkdir -p "$dist"

arch_of() {
  case $1 in
    x86_64-*) echo amd64 ;;
    aarch64-*) echo arm64 ;;
    *) echo "release.sh: no release architecture for $1" >&2; return 1 ;;
  esac
}

for target in "${targets[@]}"; do
  arch=$(arch_of "$target")
  host=$(uname -m)-unknown-linux-musl
  if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$target"; then
    rustup target add "$target"
  fi
  echo "release.sh: building sealed $version for $target" >&2
  if [[ $target == "$host" ]]; then
    # musl-gcc (musl-tools) compiles the C parts (ring, blake3's assembly) against musl.
    command -v musl-gcc >/dev/null || {
      echo "release.sh: musl-gcc missing (apt-get install musl-tools)" >&2; exit 1; }
    cargo build --release --locked -p sealed-cli --target "$target"
  elif command -v cargo-zigbuild >/dev/null; then
    cargo zigbuild --release --locked -p sealed-cli --target "$target"
  else
    echo "release.sh: $target is not this machine's ($host): install cargo-zigbuild and zig," \
      "or build on a $arch machine" >&2
    exit 1
  fi
  bin=$target_dir/$target/release/sealed
  # Static: no program interpreter, so it runs on any Linux without a libc of its own.
  if readelf -l "$bin" | grep -q 'Requesting program interpreter'; then
    echo "release.sh: $bin is dynamically linked" >&2
    exit 1
  fi
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  cp "$bin" "$stage/sealed"
  files=(sealed)
  if [[ -f LICENSE ]]; then cp LICENSE "$stage/"; files+=(LICENSE); fi
  # Reproducible archive: fixed owner, order and mtime (the commit's, else 0).
  mtime=$(git log -1 --format=%ct 2>/dev/null || echo 0)
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$mtime" \
    -C "$stage" -cf - "${files[@]}" | gzip -n >"$dist/sealed-$version-linux-$arch.tar.gz"
  rm -rf "$stage"
  trap - EXIT
  SEALED_SBOM_TARGET=$target hack/sbom.sh sealed-cli >"$dist/sealed-$version-linux-$arch.cdx.json"
  echo "release.sh: $dist/sealed-$version-linux-$arch.tar.gz" >&2
done

# Sums of every artifact (archives and SBOMs), then the krew manifest from the archives'.
(cd "$dist" && find . -maxdepth 1 -type f \( -name '*.tar.gz' -o -name '*.cdx.json' \) -printf '%f\n' |
  sort | xargs -r sha256sum) >"$dist/SHA256SUMS"
platforms=""
for arch in amd64 arm64; do
  archive=sealed-$version-linux-$arch.tar.gz
  [[ -f $dist/$archive ]] || continue
  sum=$(sha256sum "$dist/$archive" | cut -d' ' -f1)
  platforms+="  - selector:
      matchLabels:
        os: linux
        arch: $arch
    uri: $url/$archive
    sha256: $sum
    bin: sealed
    files:
      - from: \"*\"
        to: .
"
done
[[ -n $platforms ]] || { echo "release.sh: no archive in $dist" >&2; exit 1; }
cat >"$dist/sealed.yaml" <<EOF
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: sealed
spec:
  version: v$version
  homepage: https://github.com/sealed-volumes/sealed-volumes
  shortDescription: Push, pull and inspect content-addressed model versions
  description: |
    sealed publishes a directory once as an immutable version named by its digest
    (uploading only new chunks), and pulls, lists, diffs and mounts versions from an
    object store. As a kubectl plugin: kubectl sealed push ./model s3://bucket/prefix.
  platforms:
$(printf '%s' "$platforms" | sed 's/^/  /')
EOF
echo "release.sh: $dist/SHA256SUMS and $dist/sealed.yaml" >&2
