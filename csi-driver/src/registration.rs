//! kubelet plugin registration (`pluginregistration.Registration`), served on
//! `<kubelet-dir>/plugins_registry/csi.sealedvolumes.io-reg.sock`: kubelet's plugin watcher
//! finds the socket, asks `GetInfo` where the CSI endpoint is, and reports the result. This
//! replaces the node-driver-registrar sidecar.

use std::path::{Path, PathBuf};

use tonic::{Request, Response, Status};

use crate::identity::DRIVER_NAME;
use crate::proto::pluginregistration::registration_server::Registration;
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};

/// The CSI versions kubelet may speak to us (what node-driver-registrar announces).
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// Where kubelet's plugin watcher looks for this plugin's registration socket.
pub fn registration_socket(kubelet_dir: &Path) -> PathBuf {
    kubelet_dir
        .join("plugins_registry")
        .join(format!("{DRIVER_NAME}-reg.sock"))
}

pub struct RegistrationService {
    /// The CSI socket as kubelet sees it (a host path when the plugin runs in a container).
    endpoint: String,
}

impl RegistrationService {
    pub fn new(endpoint: impl Into<String>) -> Self {
        RegistrationService {
            endpoint: endpoint.into(),
        }
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        tracing::debug!(endpoint = %self.endpoint, "kubelet asked for plugin info");
        Ok(Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: DRIVER_NAME.into(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(endpoint = %self.endpoint, "registered with kubelet");
        } else {
            // kubelet retries while the socket exists; say why so the operator can fix it.
            tracing::error!(error = %status.error, "kubelet refused the registration");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
