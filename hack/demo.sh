#!/usr/bin/env bash
# The README's first command: build `sealed`, push a sample model directory into the embedded
# local store, show the version, change a file and push again (only the new chunk uploads),
# diff the two, and pull the first back, verified. Needs only the Rust toolchain.
#   hack/demo.sh [DIR]        (default: cli/examples/tiny-model)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
src=${1:-cli/examples/tiny-model}
cargo build --quiet --release -p sealed-cli
sealed=target/release/sealed
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() { printf '\n\033[1m$ %s\033[0m\n' "$*" >&2; }

step "sealed push $src"
first=$("$sealed" push "$src")
echo "$first"
step "sealed inspect $first"
"$sealed" inspect "$first"

cp -r "$src" "$work/next"
echo '{"note": "fine-tuned"}' >"$work/next/config.json"
step "sealed push (with config.json changed)"
second=$("$sealed" push "$work/next")
echo "$second"
step "sealed diff"
"$sealed" diff "$first" "$second"

step "sealed pull $first $work/pulled"
"$sealed" pull "$first" "$work/pulled"
diff -r "$src" "$work/pulled" && echo "pulled tree is byte-identical to $src"
step "sealed verify $first"
"$sealed" verify "$first"
step "sealed ls"
"$sealed" ls
