#!/usr/bin/env bash
# The README's first command: build `sealed`, push a sample model (48 MiB of safetensors) into
# a store of the demo's own (a temporary directory, removed at the end: never your default
# store nor SEALED_STORE), inspect it, change 4 KiB of weights and the config and push again
# (only the changed chunks upload), diff the two, pull the first back verified, and mount it
# by digest: the mount is ready before any byte is read, then a file is read through it.
# Needs only the Rust toolchain; the mount needs /dev/fuse and root or fusermount3 (without
# them the demo says why in one line and skips it).
#   hack/demo.sh [DIR]     (default: a generated sample model)
#   SEALED_BIN=path/to/sealed hack/demo.sh   (use that binary instead of building one)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n ${SEALED_BIN:-} ]]; then
    sealed=$SEALED_BIN
else
    # Cargo's own progress, not silence: a cold release build takes 10-20 minutes on 2 cores.
    echo "building sealed (cargo build --release -p sealed-cli; a first build takes minutes)" >&2
    cargo build --release -p sealed-cli
    # Wherever cargo puts it (CARGO_TARGET_DIR or .cargo/config.toml may move target/).
    target=$(cargo metadata --format-version 1 --no-deps |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    sealed=${target:-target}/release/sealed
fi

work=$(mktemp -d)
mnt=$work/mnt
cleanup() {
    if grep -qs " $mnt " /proc/self/mounts; then
        "$sealed" umount --lazy "$mnt" >/dev/null 2>&1 || umount -l "$mnt" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# The demo's own store: a user's SEALED_STORE (or endpoint, region) must not receive it.
export SEALED_STORE="file://$work/store"
unset SEALED_STORE_ENDPOINT SEALED_STORE_REGION
echo "store: $SEALED_STORE (the demo's own, removed at the end)" >&2

step() { printf '\n\033[1m$ %s\033[0m\n' "$*" >&2; }
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

# N pseudo-random bytes, the same on every run (so the digest is too) where openssl exists.
random_bytes() {
    if command -v openssl >/dev/null; then
        # head closes the pipe once it has N bytes: openssl's SIGPIPE is the normal end.
        { openssl enc -aes-128-ctr -nosalt -pbkdf2 -pass pass:sealed-demo </dev/zero 2>/dev/null || true; } |
            head -c "$1"
    else
        { cat /dev/urandom || true; } | head -c "$1"
    fi
}

# A safetensors file: an 8-byte little-endian header length, the JSON header (padded with
# spaces to 8 bytes), then three 16 MiB F32 tensors.
sample_model() {
    local dir=$1 mib16=$((16 << 20))
    mkdir -p "$dir/tokenizer"
    cp cli/examples/tiny-model/config.json "$dir/config.json"
    cp -r cli/examples/tiny-model/tokenizer/. "$dir/tokenizer/"
    local header='{"__metadata__":{"format":"pt"}' i
    for i in 0 1 2; do
        header+=",\"layers.$i.weight\":{\"dtype\":\"F32\",\"shape\":[4096,1024],"
        header+="\"data_offsets\":[$((i * mib16)),$(((i + 1) * mib16))]}"
    done
    header+='}'
    while ((${#header} % 8)); do header+=' '; done
    {
        local n=${#header} b
        for b in 0 1 2 3 4 5 6 7; do printf "\\x$(printf %02x $(((n >> (8 * b)) & 255)))"; done
        printf '%s' "$header"
        random_bytes $((3 * mib16))
    } >"$dir/model.safetensors"
}

if [[ $# -gt 0 ]]; then
    src=$1
else
    src=$work/sample-model
    sample_model "$src"
fi

step "sealed push $src"
first=$("$sealed" push "$src")
echo "$first"
step "sealed inspect $first"
"$sealed" inspect "$first"

cp -r "$src" "$work/next"
echo '{"note": "fine-tuned"}' >"$work/next/config.json"
if [[ -f $work/next/model.safetensors ]]; then
    # A fine-tuning step that touched 4 KiB of weights in the middle of the file.
    random_bytes 4096 | dd of="$work/next/model.safetensors" bs=4096 seek=5000 conv=notrunc status=none
fi
step "sealed push (4 KiB of weights and config.json changed)"
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

# The main job: mount by digest, read through the mount, unmount.
why_not=""
if [[ ! -e /dev/fuse ]]; then
    why_not="no /dev/fuse on this machine"
elif [[ $(id -u) -ne 0 ]] && ! command -v fusermount3 >/dev/null; then
    why_not="FUSE mounts need root or fusermount3 (Debian: apt install fuse3)"
fi
if [[ -n $why_not ]]; then
    echo "skipped the mount: $why_not" >&2
    exit 0
fi
mkdir -p "$mnt"
step "sealed mount $first $mnt --background"
t0=$(now)
if ! "$sealed" mount "$first" "$mnt" --background --cache-dir "$work/cache" 2>"$work/mount.err"; then
    echo "skipped the mount: $(tail -n 1 "$work/mount.err")" >&2
    exit 0
fi
t1=$(now)
echo "mounted in $(seconds "$t0" "$t1") s, before any byte of the files was fetched"
ls -l "$mnt"
file=$(cd "$src" && find . -type f -printf '%s %P\n' | sort -rn | head -n 1 | cut -d' ' -f2-)
step "cmp $src/$file $mnt/$file"
t0=$(now)
cmp "$src/$file" "$mnt/$file"
t1=$(now)
echo "read $(stat -c %s "$src/$file") bytes of $file through the mount in $(seconds "$t0" "$t1") s, verified chunk by chunk"
step "sealed umount $mnt"
"$sealed" umount "$mnt"
