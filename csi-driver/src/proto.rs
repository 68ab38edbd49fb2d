//! The generated gRPC code (build.rs compiles the vendored protos with protox).

/// Generated from the vendored CSI spec, `proto/csi.proto` (v1.12.0).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// Generated from kubelet's plugin registration API, `proto/pluginregistration.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}
