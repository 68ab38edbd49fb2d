#!/usr/bin/env bash
# Installs what the tests need beyond the Rust toolchain, from the package registries only:
#   Debian: curl, fuse3 (fusermount for unprivileged users), util-linux (setpriv),
#           faketime (libfaketime: a garbage collector whose clock runs ahead, cli/tests/gc_skew.rs)
#   PyPI:   moto's S3-compatible server          (moto_server)
#   npm:    Azurite, the Azure Blob emulator     (azurite-blob)
# Idempotent: installed tools are left alone.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

if [[ $(id -u) -eq 0 ]]; then
  apt_ensure curl fuse3 util-linux python3-pip faketime
fi

if ! command -v moto_server >/dev/null; then
  log "pip install moto[server]"
  python3 -m pip install --quiet --disable-pip-version-check 'moto[server]==5.*' ||
    die "pip install moto[server] failed"
  hash -r
fi
command -v moto_server >/dev/null || die "moto_server is not on PATH after pip install"

if ! command -v azurite-blob >/dev/null; then
  log "npm install -g azurite"
  npm install --global --no-fund --no-audit --silent azurite@3 || die "npm install -g azurite failed"
  hash -r
fi
command -v azurite-blob >/dev/null || die "azurite-blob is not on PATH after npm install"
log "test tools ready: $(command -v moto_server) $(command -v azurite-blob)"
