#!/usr/bin/env bash
# Prints a CycloneDX 1.5 SBOM (JSON) of a binary's Rust dependencies, from `cargo metadata`
# (no network: the lock file has every package):
#
#   hack/sbom.sh sealed-csi > sealed-csi.cdx.json
#
# Components are the packages `cargo tree` resolves for the binary's package on this target,
# with their version, license expression and purl (pkg:cargo/NAME@VERSION).
set -euo pipefail
pkg=${1:?usage: hack/sbom.sh PACKAGE}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=$(cargo metadata --format-version 1 --no-deps --locked |
  jq -r --arg p "$pkg" '.packages[] | select(.name == $p) | .version')
[[ -n $version ]] || { echo "sbom.sh: no package $pkg in the workspace" >&2; exit 1; }
# name@version of everything the package links (normal dependencies, this target).
# SEALED_SBOM_TARGET: another target triple than this machine's (hack/release.sh's musl builds).
target_args=()
[[ -n ${SEALED_SBOM_TARGET:-} ]] && target_args=(--target "$SEALED_SBOM_TARGET")
deps=$(cargo tree --locked -p "$pkg" -e normal --prefix none --format '{p}' "${target_args[@]}" |
  awk '{print $1 "@" substr($2, 2)}' | sort -u)
cargo metadata --format-version 1 --locked |
  jq --arg p "$pkg" --arg v "$version" --arg deps "$deps" '
    ($deps | split("\n") | map(select(. != "")) | map({(.): true}) | add) as $want
    | {
        bomFormat: "CycloneDX", specVersion: "1.5", version: 1,
        metadata: { component: { type: "application", name: $p, version: $v,
                                 purl: "pkg:cargo/\($p)@\($v)" } },
        components: [ .packages[]
          | select($want["\(.name)@\(.version)"] and .name != $p)
          | { type: "library", name, version, purl: "pkg:cargo/\(.name)@\(.version)" }
            + (if .license then { licenses: [{ expression: .license }] } else {} end) ]
        | sort_by(.name, .version) }'
