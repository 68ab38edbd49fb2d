#!/usr/bin/env bash
# Installs what the tests need beyond the Rust toolchain, from the package registries only:
#   Debian: curl, fuse3 (fusermount for unprivileged users), util-linux (setpriv),
#           faketime (libfaketime: a garbage collector whose clock runs ahead, cli/tests/gc_skew.rs)
#   PyPI:   moto's S3-compatible server          (moto_server)
#   npm:    Azurite, the Azure Blob emulator     (azurite-blob)
#   PyPI:   model-signing, the OpenSSF model signing reference (cli/tests/provenance.rs), in its
#           own venv $SEALED_CACHE/model-signing-VERSION (it brings sigstore and cryptography)
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

# model_signing, pinned; cli/tests/provenance.rs finds it at this path (or $SEALED_MODEL_SIGNING_VENV).
MODEL_SIGNING_VERSION=1.1.1
MODEL_SIGNING_VENV="$SEALED_CACHE/model-signing-$MODEL_SIGNING_VERSION"
if ! "$MODEL_SIGNING_VENV/bin/model_signing" --version >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && ! python3 -c 'import ensurepip' 2>/dev/null; then
    apt_ensure python3-venv
  fi
  log "pip install model-signing==$MODEL_SIGNING_VERSION into $MODEL_SIGNING_VENV"
  rm -rf "$MODEL_SIGNING_VENV"
  python3 -m venv "$MODEL_SIGNING_VENV" || die "python3 -m venv $MODEL_SIGNING_VENV failed"
  # 1.1.1 imports OpenSSL (pyOpenSSL) without declaring it.
  "$MODEL_SIGNING_VENV/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
    "model-signing==$MODEL_SIGNING_VERSION" "pyOpenSSL==26.4.0" || die "pip install model-signing failed"
fi
"$MODEL_SIGNING_VENV/bin/model_signing" --version >/dev/null || die "model_signing does not run"
log "test tools ready: $(command -v moto_server) $(command -v azurite-blob) $MODEL_SIGNING_VENV/bin/model_signing"
