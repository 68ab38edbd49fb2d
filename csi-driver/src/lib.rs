//! CSI node plugin for Sealed Volumes.

/// Generated from the vendored CSI spec, `proto/csi.proto` (v1.12.0).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}
