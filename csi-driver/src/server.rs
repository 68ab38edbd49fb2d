//! The gRPC servers on their unix sockets: CSI Identity + Node for kubelet, and kubelet's
//! plugin registration. Every RPC runs in its own tracing span ([`rpc_span`]) that names
//! the method and, once the handler records them, the request's volume, target and digest.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use tokio::net::UnixListener;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;

use crate::authority;
use crate::driver::Driver;
use crate::identity::IdentityService;
use crate::kube_access::KubeAccess;
use crate::lease::Reporter;
use crate::node::NodeService;
use crate::proto::{csi, pluginregistration};
use crate::registration::RegistrationService;

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

/// The span of one RPC, `rpc{method=NodePublishVolume ...}`: every line logged while it is
/// served carries it. Its request fields are empty until the handler records them
/// (`crate::node::record_request`, `record_digest`).
pub fn rpc_span(request: &http::Request<()>) -> tracing::Span {
    let method = request.uri().path().rsplit('/').next().unwrap_or_default();
    tracing::info_span!(
        "rpc",
        method = %method,
        volume_id = tracing::field::Empty,
        target = tracing::field::Empty,
        digest = tracing::field::Empty,
    )
}

/// Serves kubelet's plugin registration on `listener` until `shutdown` completes;
/// `endpoint` is the CSI socket path kubelet should dial.
pub async fn serve_registration(
    listener: UnixListener,
    endpoint: String,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    tonic::transport::Server::builder()
        .trace_fn(rpc_span)
        .add_service(
            pluginregistration::registration_server::RegistrationServer::new(
                RegistrationService::new(endpoint),
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
    reporter: Option<Arc<Reporter>>,
    listener: UnixListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    tonic::transport::Server::builder()
        .trace_fn(rpc_span)
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
