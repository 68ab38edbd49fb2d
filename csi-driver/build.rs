//! Compiles the vendored CSI spec (proto/csi.proto, v1.12.0) and kubelet's plugin registration
//! API (proto/pluginregistration.proto, k8s.io/kubelet v0.34.4) with protox, a pure-Rust protobuf
//! compiler, so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    println!("cargo:rerun-if-changed=proto/pluginregistration.proto");
    let descriptors = protox::compile(["csi.proto", "pluginregistration.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
