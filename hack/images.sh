#!/usr/bin/env bash
# Builds OCI images from local files without Docker (umoci + skopeo) and imports them
# into the test cluster's containerd (namespace k8s.io), so pods run them with
# imagePullPolicy Never/IfNotPresent.
#
#   hack/images.sh base                              build (cached) + import the pause and busybox images
#   hack/images.sh binary NAME:TAG BINARY [SRC[:DEST]]...
#                       a binary on an empty base (at /BASENAME, the entrypoint), plus extra
#                       files (DEST defaults to /basename of SRC); imported if the cluster runs.
#                       A dynamically linked binary gets its loader and libraries (from ldd).
#   hack/images.sh sealed [operator] [csi]           sealed.local/sealed-operator:dev and
#                       sealed.local/sealed-csi:dev (with sealed-fd-holder; default both) from the
#                       cargo-built binaries,
#                       with their glibc, the host's CA certificates and the CycloneDX SBOM of
#                       each binary (hack/sbom.sh) at /usr/share/sbom/<package>.cdx.json
#                       (the image's label io.sealedvolumes.sbom lists those paths, comma-separated);
#                       imported if the cluster runs.
#                       Env: SEALED_IMAGE_TAG (dev), SEALED_IMAGE_REPOSITORY (sealed.local),
#                       SEALED_IMAGES_IMPORT (1; 0: build the archives, import nothing),
#                       SEALED_PROFILE (debug; release for release images), SEALED_GIT_COMMIT and
#                       SEALED_SOURCE_URL (OCI labels), SEALED_OPERATOR_BIN, SEALED_CSI_BIN (default
#                       $CARGO_TARGET_DIR/<profile>/<name>, else target/<profile>/<name>). Build them first:
#                       cargo build -p sealed-operator -p sealed-csi -p sealed-fd-holder
#   hack/images.sh rootfs NAME:TAG DIR [ENTRYPOINT ARG...]   a directory as the image's root
#   hack/images.sh import ARCHIVE...                 import docker-archive tarballs
#   hack/images.sh pause-name | busybox-name         print the base image names
#
# Archives are written to $SEALED_CACHE/images/ and the path of each is printed on stdout.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

DIR="${SEALED_CLUSTER_DIR:-/var/lib/sealed-cluster}"
CONTAINERD_SOCK="$DIR/run/containerd.sock"
IMAGES="$SEALED_CACHE/images"
PAUSE_IMAGE=sealed.local/pause:v1
BUSYBOX_IMAGE=sealed.local/busybox:v1
# Bump when the way base images are built changes, so cached archives are rebuilt.
IMAGE_REV=2
# More KEY=VALUE labels for the next build_image (cmd_sealed: where the SBOMs are).
IMAGE_LABELS=()

usage() { usage_from_header "${BASH_SOURCE[0]}"; }

archive_path() { echo "$IMAGES/$(echo "$1" | tr '/:' '__').tar"; }

# build_image NAME:TAG ROOTFS_DIR OUT_TAR [ENTRYPOINT ARG... | --cmd CMD...]: one layer holding ROOTFS_DIR.
build_image() {
  local ref=$1 rootfs=$2 out=$3
  shift 3
  [[ $ref == *:* ]] || die "image name '$ref' needs a tag (NAME:TAG)"
  apt_ensure umoci skopeo
  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  umoci init --layout "$tmp/oci"
  umoci new --image "$tmp/oci:img"
  umoci insert --image "$tmp/oci:img" "$rootfs" / >/dev/null
  local cfg=(--config.env PATH=/usr/local/bin:/usr/bin:/bin:/ --config.workingdir /)
  local a
  if [[ ${1:-} == --cmd ]]; then
    shift # a default command only, like Docker's busybox: `kubectl run -- sh -c ...` works
    for a in "$@"; do cfg+=(--config.cmd "$a"); done
  elif (($# > 0)); then
    cfg+=(--config.entrypoint "$1")
    shift
    for a in "$@"; do cfg+=(--config.cmd "$a"); done
  fi
  # OCI annotations (https://github.com/opencontainers/image-spec/blob/main/annotations.md),
  # from the release's facts when given.
  cfg+=(--config.label "org.opencontainers.image.title=$(basename "${ref%:*}")")
  cfg+=(--config.label "org.opencontainers.image.version=${ref##*:}")
  cfg+=(--config.label "org.opencontainers.image.licenses=Apache-2.0")
  [[ -n ${SEALED_GIT_COMMIT:-} ]] && cfg+=(--config.label "org.opencontainers.image.revision=$SEALED_GIT_COMMIT")
  [[ -n ${SEALED_SOURCE_URL:-} ]] && cfg+=(--config.label "org.opencontainers.image.source=$SEALED_SOURCE_URL")
  for a in "${IMAGE_LABELS[@]}"; do cfg+=(--config.label "$a"); done
  umoci config --image "$tmp/oci:img" "${cfg[@]}"
  mkdir -p "$(dirname "$out")"
  rm -f "$out.part"
  skopeo copy --quiet --insecure-policy "oci:$tmp/oci:img" "docker-archive:$out.part:$ref" >/dev/null
  mv "$out.part" "$out"
  log "built $ref -> $out"
}

# SEALED_IMAGES_IMPORT=0: build only (the journey pushes to a registry and the cluster pulls).
want_import() { [[ ${SEALED_IMAGES_IMPORT:-1} == 1 ]] && cluster_running; }

cluster_running() { [[ -S $CONTAINERD_SOCK ]] && ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; }

import() {
  local tar
  cluster_running || die "containerd of the test cluster is not running ($CONTAINERD_SOCK); run hack/cluster.sh up"
  for tar in "$@"; do
    [[ -f $tar ]] || die "no such archive: $tar"
    ctr --address "$CONTAINERD_SOCK" -n k8s.io images import "$tar" >/dev/null ||
      die "ctr could not import $tar"
    log "imported $tar"
  done
}

# Archives are rebuilt only when their inputs change: the key is a hash of the inputs.
cached_archive() { echo "$IMAGES/$1-$2.tar"; }

pause_archive() {
  local bin key out root
  bin="$("$HACK_DIR/build-k8s.sh")/pause"
  key=$({ sha256sum "$bin"; echo "$IMAGE_REV"; } | sha256sum | cut -c1-12)
  out=$(cached_archive pause "$key")
  if [[ ! -f $out ]]; then
    root=$(mktemp -d) && chmod 0755 "$root"
    install -m 0755 "$bin" "$root/pause"
    build_image "$PAUSE_IMAGE" "$root" "$out" /pause
    rm -rf "$root"
  fi
  echo "$out"
}

busybox_archive() {
  apt_ensure busybox-static
  local key out root applet
  key=$({ sha256sum /bin/busybox; echo "$IMAGE_REV"; } | sha256sum | cut -c1-12)
  out=$(cached_archive busybox "$key")
  if [[ ! -f $out ]]; then
    root=$(mktemp -d) && chmod 0755 "$root"
    mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/root"
    chmod 1777 "$root/tmp"
    install -m 0755 /bin/busybox "$root/bin/busybox"
    for applet in $(/bin/busybox --list); do
      [[ $applet == busybox ]] || ln -sf busybox "$root/bin/$applet"
    done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$root/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
    build_image "$BUSYBOX_IMAGE" "$root" "$out" --cmd /bin/sh
    rm -rf "$root"
  fi
  echo "$out"
}

cmd_binary() {
  (($# >= 2)) || usage
  local ref=$1 bin=$2 root spec src dest out
  shift 2
  [[ -f $bin ]] || die "no such binary: $bin"
  root=$(mktemp -d) && chmod 0755 "$root"
  install -m 0755 "$bin" "$root/$(basename "$bin")"
  add_shared_libs "$bin" "$root"
  mkdir -p "$root/tmp" && chmod 1777 "$root/tmp"
  for spec in "$@"; do
    src=${spec%%:*}
    dest=${spec#*:}
    [[ $spec == *:* ]] || dest="/$(basename "$src")"
    [[ -e $src ]] || die "no such file: $src"
    mkdir -p "$root$(dirname "$dest")"
    cp -rL "$src" "$root$dest" # dereference: a host symlink would dangle in the image
  done
  out=$(archive_path "$ref")
  build_image "$ref" "$root" "$out" "/$(basename "$bin")"
  rm -rf "$root"
  want_import && import "$out"
  echo "$out"
}

# add_shared_libs BINARY ROOT: copies the dynamic loader and every library ldd resolves for
# BINARY into ROOT at the same paths (nothing for a static binary). glibc >= 2.34 has the
# files/dns NSS modules built in, so name resolution needs no extra libraries.
add_shared_libs() {
  local bin=$1 root=$2 lib
  command -v ldd >/dev/null || die "no ldd to find the libraries of $bin (package libc-bin)"
  ldd "$bin" >/dev/null 2>&1 || return 0 # "not a dynamic executable"
  while read -r lib; do
    [[ -e $lib ]] || die "ldd names $lib for $bin, which does not exist"
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
  log "added $(find "$root" -name '*.so*' | wc -l) shared objects (the loader included) for $(basename "$bin")"
}

# The sealed-operator and sealed-csi images from cargo-built binaries. Neither shells out to
# mount tools: sealed-csi mounts FUSE with mount(2) as root (fuser's pure-Rust mount) and
# bind-mounts/unmounts with mount(2)/umount2(2), so the images hold the binary, its glibc
# and the CA bundle (object_store's TLS uses the system roots) only, plus the SBOM of every
# binary in it (hack/sbom.sh: CycloneDX JSON) at $SBOM_DIR/<package>.cdx.json.
SBOM_DIR=/usr/share/sbom
cmd_sealed() {
  local tag=${SEALED_IMAGE_TAG:-dev} target=${CARGO_TARGET_DIR:-$HACK_DIR/../target}
  local components=("$@") c bin var ca=/etc/ssl/certs/ca-certificates.crt
  ((${#components[@]} > 0)) || components=(operator csi)
  [[ -f $ca ]] || apt_ensure ca-certificates
  command -v jq >/dev/null || apt_ensure jq
  local sboms
  sboms=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: sboms is local
  trap "rm -rf '$sboms'" RETURN
  for c in "${components[@]}"; do
    case $c in
      operator) var=SEALED_OPERATOR_BIN ;;
      csi) var=SEALED_CSI_BIN ;;
      *) die "unknown component '$c' (operator, csi)" ;;
    esac
    bin=${!var:-$target/${SEALED_PROFILE:-debug}/sealed-$c}
    [[ -f $bin ]] || die "no $bin: run 'cargo build -p sealed-$c' first (or set $var)"
    local extra=()
    if [[ $c == csi ]]; then
      # The fd holder (restart safety) ships in the plugin's image; it links the same libc.
      local holder=${SEALED_FD_HOLDER_BIN:-$(dirname "$bin")/sealed-fd-holder}
      [[ -f $holder ]] || die "no $holder: run 'cargo build -p sealed-fd-holder' first (or set SEALED_FD_HOLDER_BIN)"
      extra+=("$holder:/sealed-fd-holder")
      sbom sealed-fd-holder "$sboms" && extra+=("$sboms/sealed-fd-holder.cdx.json:$SBOM_DIR/sealed-fd-holder.cdx.json")
    fi
    sbom "sealed-$c" "$sboms" && extra+=("$sboms/sealed-$c.cdx.json:$SBOM_DIR/sealed-$c.cdx.json")
    # A label pointing at them, so a scanner finds the SBOMs from the image config alone.
    IMAGE_LABELS=("io.sealedvolumes.sbom=$(printf '%s\n' "${extra[@]}" | sed -n 's/.*:\(.*\.cdx\.json\)$/\1/p' | paste -sd, -)")
    cmd_binary "${SEALED_IMAGE_REPOSITORY:-sealed.local}/sealed-$c:$tag" "$bin" "$ca:$ca" "${extra[@]}"
    IMAGE_LABELS=()
  done
}

# sbom PACKAGE DIR: DIR/PACKAGE.cdx.json from hack/sbom.sh.
sbom() {
  "$HACK_DIR/sbom.sh" "$1" >"$2/$1.cdx.json" || die "hack/sbom.sh $1 failed"
  log "SBOM of $1: $(jq '.components | length' "$2/$1.cdx.json") components"
}

cmd_rootfs() {
  (($# >= 2)) || usage
  local ref=$1 dir=$2 out
  shift 2
  [[ -d $dir ]] || die "no such directory: $dir"
  out=$(archive_path "$ref")
  build_image "$ref" "$dir" "$out" "$@"
  want_import && import "$out"
  echo "$out"
}

main() {
  local cmd=${1:-}
  shift || true
  case "$cmd" in
    base)
      local p b
      p=$(pause_archive)
      b=$(busybox_archive)
      import "$p" "$b"
      printf '%s\n%s\n' "$p" "$b"
      ;;
    binary) cmd_binary "$@" ;;
    sealed) cmd_sealed "$@" ;;
    rootfs) cmd_rootfs "$@" ;;
    import) (($# > 0)) || usage; import "$@" ;;
    pause-name) echo "$PAUSE_IMAGE" ;;
    busybox-name) echo "$BUSYBOX_IMAGE" ;;
    *) usage ;;
  esac
}

main "$@"
