//! CSI node plugin for Sealed Volumes.
//!
//! Shaped like csi-driver-host-path: one file per CSI service ([`identity`], [`node`]), the
//! driver state apart from the gRPC layer ([`state`], with the kernel calls in [`mounts`]),
//! and errors mapped to gRPC status codes in one place ([`error`]).

pub mod attest;
pub mod authority;
pub mod digest_locks;
pub mod error;
pub mod fd_holder;
pub mod gpu;
pub mod identity;
pub mod kube_access;
pub mod lease;
pub mod manifest_cache;
pub mod metrics;
pub mod mounts;
pub mod node;
pub mod registration;
pub mod state;
pub mod store_access;
pub mod targets;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use tokio::net::UnixListener;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;

pub use error::CsiError;
pub use identity::{DRIVER_NAME, IdentityService};
pub use kube_access::KubeAccess;
pub use node::NodeService;
pub use state::{Driver, DriverConfig};

/// Generated from the vendored CSI spec, `proto/csi.proto` (v1.12.0).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// The socket path of a `unix:///path` (or `unix:/path`, or plain path) endpoint.
pub fn socket_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if endpoint.contains("://") && !endpoint.starts_with("unix://") {
        anyhow::bail!("endpoint {endpoint}: only unix:///path/csi.sock endpoints are supported");
    }
    if !path.starts_with('/') {
        anyhow::bail!("endpoint {endpoint}: the socket path must be absolute (unix:///path)");
    }
    Ok(PathBuf::from(path))
}

/// Binds the socket, removing a stale socket file a previous run left behind.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed stale socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot remove {}", path.display())),
    }
    UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))
}

/// Generated from kubelet's plugin registration API, `proto/pluginregistration.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// Serves kubelet's plugin registration on `listener` until `shutdown` completes;
/// `endpoint` is the CSI socket path kubelet should dial.
pub async fn serve_registration(
    listener: UnixListener,
    endpoint: String,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    tonic::transport::Server::builder()
        .add_service(
            pluginregistration::registration_server::RegistrationServer::new(
                registration::RegistrationService::new(endpoint),
            ),
        )
        // Through the authority shim: kubelet's plugin watcher sends the socket path as
        // :authority, which h2 would refuse (see `authority`).
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener).map(|conn| conn.map(authority::shim)),
            shutdown,
        )
        .await
        .context("registration gRPC server failed")
}

/// Serves Identity and Node on `listener` until `shutdown` completes; `kube` is `None` in
/// standalone mode, `reporter` without `--publications-namespace`.
pub async fn serve(
    driver: Arc<Driver>,
    kube: Option<Arc<KubeAccess>>,
    reporter: Option<Arc<lease::Reporter>>,
    listener: UnixListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::new(IdentityService))
        .add_service(csi::node_server::NodeServer::new(NodeService::new(
            driver, kube, reporter,
        )))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await
        .context("gRPC server failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            socket_path("/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(socket_path("tcp://1.2.3.4:5").is_err());
        assert!(socket_path("unix://relative").is_err());
    }
}
