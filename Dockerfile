# syntax=docker/dockerfile:1
# Release images for people who build with Docker or Buildah (the project's own path needs no
# daemon: `cargo build --release` + `SEALED_PROFILE=release hack/images.sh sealed`).
#
#   docker build --target operator -t sealed-operator .
#   docker build --target csi -t sealed-csi .
#
# Build args: GIT_COMMIT (sealed_*_build_info, org.opencontainers.image.revision), VERSION.

FROM rust:1-bookworm AS build
ARG GIT_COMMIT=unknown
ENV SEALED_GIT_COMMIT=${GIT_COMMIT} CARGO_TARGET_DIR=/target
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/target,sharing=locked \
    cargo build --release --locked -p sealed-operator -p sealed-csi -p sealed-fd-holder \
 && mkdir /out && cp /target/release/sealed-operator /target/release/sealed-csi \
    /target/release/sealed-fd-holder /out/

# glibc, libgcc_s and the CA bundle, nothing else (no shell, no package manager).
FROM gcr.io/distroless/cc-debian12:nonroot AS operator
ARG GIT_COMMIT=unknown
ARG VERSION=dev
LABEL org.opencontainers.image.title=sealed-operator \
      org.opencontainers.image.version=${VERSION} \
      org.opencontainers.image.revision=${GIT_COMMIT} \
      org.opencontainers.image.licenses=Apache-2.0
COPY --from=build /out/sealed-operator /sealed-operator
# Sync Jobs run this image too; neither needs root.
USER 65532:65532
ENTRYPOINT ["/sealed-operator"]

# The node plugin mounts FUSE and bind-mounts into pods: it runs as root (the chart makes it
# privileged); the fd holder ships in the same image.
FROM gcr.io/distroless/cc-debian12 AS csi
ARG GIT_COMMIT=unknown
ARG VERSION=dev
LABEL org.opencontainers.image.title=sealed-csi \
      org.opencontainers.image.version=${VERSION} \
      org.opencontainers.image.revision=${GIT_COMMIT} \
      org.opencontainers.image.licenses=Apache-2.0
COPY --from=build /out/sealed-csi /sealed-csi
COPY --from=build /out/sealed-fd-holder /sealed-fd-holder
ENTRYPOINT ["/sealed-csi"]
