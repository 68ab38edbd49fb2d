//! The CSI Identity service: who the plugin is and what it serves (no controller service).

use tonic::{Request, Response, Status};

use crate::proto::csi::identity_server::Identity;
use crate::proto::csi::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};

pub use sealed_crds::csi::DRIVER_NAME;

#[derive(Clone, Copy, Debug, Default)]
pub struct IdentityService;

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        // Node only: no CONTROLLER_SERVICE, and no topology constraints (any node can mount).
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: Vec::<PluginCapability>::new(),
        }))
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        // Ready as soon as it serves: the store is opened on first publish, so a store outage
        // shows on the publishes it breaks, not as a restart loop of the plugin.
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
