//! The CSI Node service: validates requests and hands them to the driver state.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use sealed_crds::validate::is_object_name;
use sealed_mount::PrefetchSelection;
use sealed_store::Digest;
use sealed_store::prefetch_profile::ProfileScope;
use tonic::{Request, Response, Status};

use crate::driver::{Driver, Publish};
use crate::error::CsiError;
use crate::kube_access::{KubeAccess, PodInfo};
use crate::lease::Reporter;
use crate::proto::csi::node_server::Node;
use crate::proto::csi::node_service_capability::{Rpc, rpc};
use crate::proto::csi::volume_capability::AccessType;
use crate::proto::csi::volume_capability::access_mode::Mode;
use crate::proto::csi::volume_usage::Unit;
use crate::proto::csi::{
    NodeExpandVolumeRequest, NodeExpandVolumeResponse, NodeGetCapabilitiesRequest,
    NodeGetCapabilitiesResponse, NodeGetInfoRequest, NodeGetInfoResponse,
    NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse, NodePublishVolumeRequest,
    NodePublishVolumeResponse, NodeServiceCapability, NodeStageVolumeRequest,
    NodeStageVolumeResponse, NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
    NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, VolumeCapability, VolumeUsage,
};

pub use sealed_crds::csi::{
    DIGEST_ATTRIBUTE, EPHEMERAL_ATTRIBUTE, LEARNED_PREFETCH_ATTRIBUTE, PREFETCH_ATTRIBUTE,
    TAG_ATTRIBUTE, VOLUME_ATTRIBUTE,
};

pub struct NodeService {
    driver: Arc<Driver>,
    /// `None` in standalone mode: no authorization, tags or node checks.
    kube: Option<Arc<KubeAccess>>,
    /// The node publications Lease (`--publications-namespace`), if any.
    reporter: Option<Arc<Reporter>>,
}

impl NodeService {
    pub fn new(
        driver: Arc<Driver>,
        kube: Option<Arc<KubeAccess>>,
        reporter: Option<Arc<Reporter>>,
    ) -> Self {
        NodeService {
            driver,
            kube,
            reporter,
        }
    }

    /// Resolves and authorizes the version (API-server mode), then publishes it.
    async fn publish(&self, req: &NodePublishVolumeRequest) -> Result<(), CsiError> {
        let checked = check_publish(req)?;
        record_request(&checked.volume_id, &checked.target);
        // Before any API call: a target outside kubelet's pod directories is refused.
        self.driver.check_target(&checked.target)?;
        let Some(kube) = &self.kube else {
            let VersionRef::Digest(digest) = checked.version else {
                return Err(CsiError::InvalidArgument(
                    "volume attributes name a volume/tag, which needs the API server; this \
                     plugin runs --standalone: set volumeAttributes.digest to blake3:<64 hex>"
                        .into(),
                ));
            };
            // No API server, no namespace: every standalone publish shares one scope.
            let scope = ProfileScope::new(STANDALONE_SCOPE).map_err(invalid_scope)?;
            return self
                .mount(checked.volume_id, digest, checked.target, None, scope, req)
                .await;
        };
        kube.check_csidriver().await?;
        let pod = PodInfo::from_context(&req.volume_context)?;
        kube.check_pod(&pod).await?;
        kube.check_node().await?;
        let digest = match &checked.version {
            VersionRef::Digest(d) => *d,
            VersionRef::Tag { volume, tag } => {
                kube.resolve_tag(&pod.namespace, volume, tag).await?
            }
        };
        let allowed_by = kube.authorize(&pod.namespace, &digest).await?;
        let volume = match &checked.version {
            VersionRef::Tag { volume, .. } => volume.as_str(),
            VersionRef::Digest(_) => allowed_by.as_str(),
        };
        let scope = profile_scope(&pod.namespace, volume)?;
        self.mount(
            checked.volume_id,
            digest,
            checked.target,
            Some((kube.clone(), pod.clone())),
            scope,
            req,
        )
        .await?;
        if let VersionRef::Tag { volume, tag } = &checked.version {
            kube.record_tag_resolved(&pod, volume, tag, &digest).await;
        }
        Ok(())
    }

    async fn mount(
        &self,
        volume_id: String,
        digest: Digest,
        target: PathBuf,
        pod: Option<(Arc<KubeAccess>, PodInfo)>,
        profile_scope: ProfileScope,
        req: &NodePublishVolumeRequest,
    ) -> Result<(), CsiError> {
        let ephemeral = req
            .volume_context
            .get(EPHEMERAL_ATTRIBUTE)
            .is_some_and(|v| v == "true");
        record_digest(&digest);
        tracing::debug!(ephemeral, "version resolved");
        let namespace = pod
            .as_ref()
            .map(|(_, p)| p.namespace.clone())
            .unwrap_or_default();
        let mounted = self
            .driver
            .publish(Publish {
                volume_id,
                digest,
                target,
                namespace,
                // Checked in `check_publish` already, before any API call.
                prefetch: prefetch_from_context(&req.volume_context)?,
                learned_prefetch: learned_prefetch_from_context(&req.volume_context)?,
                profile_scope,
            })
            .await?;
        // A mount this publish made: its cold start is recorded once its readers go quiet.
        if let Some(record) = mounted {
            let metrics = self.driver.metrics().cold_start().clone();
            crate::cold_start::follow(record, digest, metrics, pod);
        }
        // The operator must see the digest in use before the pod reads it.
        if let Some(reporter) = &self.reporter {
            reporter.report("publish").await;
        }
        Ok(())
    }

    async fn unpublish(&self, req: &NodeUnpublishVolumeRequest) -> Result<(), CsiError> {
        let volume_id = required(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        record_request(volume_id, &target);
        self.driver.check_target(&target)?;
        self.driver.unpublish(volume_id, &target).await?;
        if let Some(reporter) = &self.reporter {
            reporter.report("unpublish").await;
        }
        Ok(())
    }
}

fn required<'a>(value: &'a str, name: &'static str) -> Result<&'a str, CsiError> {
    if value.is_empty() {
        Err(CsiError::Missing(name))
    } else {
        Ok(value)
    }
}

/// Sealed volumes are mounted read-only, always. The request must say `readonly`; its access
/// mode may be a single-node writer mode because kubelet sends SINGLE_NODE_WRITER for every
/// inline volume and for ReadWriteOnce volumes (the mount is read-only all the same), but a
/// multi-node writer mode asks for shared writes, which a sealed version cannot give.
pub fn check_capability(cap: Option<&VolumeCapability>, readonly: bool) -> Result<(), CsiError> {
    let cap = cap.ok_or(CsiError::Missing("volume_capability"))?;
    match &cap.access_type {
        Some(AccessType::Mount(_)) => {}
        Some(AccessType::Block(_)) => {
            return Err(CsiError::InvalidArgument(
                "block access is not supported: a sealed volume is a filesystem (use a mount volume)"
                    .into(),
            ));
        }
        None => return Err(CsiError::Missing("volume_capability.access_type")),
    }
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or(CsiError::Missing("volume_capability.access_mode"))?
        .mode();
    match mode {
        Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly => {}
        Mode::SingleNodeWriter | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter => {}
        Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter => {
            return Err(CsiError::Writable(format!(
                "access mode {} asks for writes",
                mode.as_str_name()
            )));
        }
        Mode::Unknown => {
            return Err(CsiError::InvalidArgument(
                "volume_capability.access_mode is UNKNOWN".into(),
            ));
        }
    }
    if !readonly {
        return Err(CsiError::Writable("the request has readonly=false".into()));
    }
    Ok(())
}

/// Which version a publish names: a digest, or a tag of a SealedVolume resolved at publish time.
#[derive(Clone, Debug, PartialEq)]
pub enum VersionRef {
    Digest(Digest),
    Tag { volume: String, tag: String },
}

/// The version to mount, from the volume attributes (inline ephemeral volumes and static
/// persistent volumes carry them the same way): `digest`, or `volume` + `tag`.
pub fn version_from_context(context: &HashMap<String, String>) -> Result<VersionRef, CsiError> {
    let get = |k: &str| context.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    match (
        get(DIGEST_ATTRIBUTE),
        get(VOLUME_ATTRIBUTE),
        get(TAG_ATTRIBUTE),
    ) {
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => Err(CsiError::InvalidArgument(
            "volume attributes name both a digest and a volume/tag: set either digest, or \
             volume + tag"
                .into(),
        )),
        (Some(text), None, None) => Digest::parse(text)
            .map(VersionRef::Digest)
            .map_err(|e| CsiError::InvalidArgument(format!("volume attribute 'digest': {e}"))),
        (None, Some(volume), Some(tag)) => {
            // Both go into API paths: only what the API server itself would accept.
            if !is_object_name(volume) {
                return Err(CsiError::InvalidArgument(format!(
                    "volume attribute 'volume': {volume:?} is not a SealedVolume name (a \
                     DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting and \
                     ending with a letter or digit, at most 253 characters)"
                )));
            }
            if !sealed_crds::is_tag_name(tag) {
                return Err(CsiError::InvalidArgument(format!(
                    "volume attribute 'tag': {tag:?} is not a tag name: {}",
                    sealed_crds::validate::TAG_NAME_HELP
                )));
            }
            Ok(VersionRef::Tag {
                volume: volume.into(),
                tag: tag.into(),
            })
        }
        (None, Some(_), None) | (None, None, Some(_)) => Err(CsiError::InvalidArgument(
            "volume attributes 'volume' and 'tag' go together: name the SealedVolume and its tag"
                .into(),
        )),
        (None, None, None) => Err(CsiError::InvalidArgument(
            "volume attribute 'digest' is required (volumeAttributes: {digest: blake3:<64 hex>}, \
             or volume + tag)"
                .into(),
        )),
    }
}

/// What the volume asks to prefetch (attribute `prefetch`: `none`, `model`, `all`, globs,
/// or `model` with globs), `None` when unset (the plugin's `--prefetch` then applies). A value
/// that does not parse is `InvalidArgument` naming the attribute and what it may be.
pub fn prefetch_from_context(
    context: &HashMap<String, String>,
) -> Result<Option<PrefetchSelection>, CsiError> {
    let Some(text) = context.get(PREFETCH_ATTRIBUTE) else {
        return Ok(None);
    };
    PrefetchSelection::parse(text).map(Some).map_err(|e| {
        CsiError::InvalidArgument(format!(
            "volume attribute 'prefetch': {e}; expected none, model, all, or comma-separated \
             globs ('model,*.json' adds globs to model)"
        ))
    })
}

/// The learned-profile scope of standalone publishes (no API server, no namespace).
pub const STANDALONE_SCOPE: &str = "standalone";

/// The learned-profile scope of a pod of `namespace` reading SealedVolume `volume`: a profile
/// its readers record steers only mounts of the same namespace and volume (docs/mount.md,
/// "Learned prefetch").
pub fn profile_scope(namespace: &str, volume: &str) -> Result<ProfileScope, CsiError> {
    ProfileScope::new(&format!("{namespace}/{volume}")).map_err(invalid_scope)
}

fn invalid_scope(e: sealed_store::prefetch_profile::ScopeError) -> CsiError {
    CsiError::InvalidArgument(format!("learned prefetch: {e}"))
}

/// Whether the volume lets its mount replay and record learned prefetch profiles (attribute
/// `learnedPrefetch`: `true` or `false`), `None` when unset (the plugin's
/// `--learned-prefetch` then applies). Anything else is `InvalidArgument`.
pub fn learned_prefetch_from_context(
    context: &HashMap<String, String>,
) -> Result<Option<bool>, CsiError> {
    match context.get(LEARNED_PREFETCH_ATTRIBUTE).map(|v| v.trim()) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(other) => Err(CsiError::InvalidArgument(format!(
            "volume attribute '{LEARNED_PREFETCH_ATTRIBUTE}': '{}' is neither true nor false",
            other.chars().take(64).collect::<String>()
        ))),
    }
}

/// A checked publish request whose version is not resolved yet.
struct CheckedPublish {
    volume_id: String,
    target: PathBuf,
    version: VersionRef,
}

fn check_publish(req: &NodePublishVolumeRequest) -> Result<CheckedPublish, CsiError> {
    let volume_id = required(&req.volume_id, "volume_id")?;
    let target = required(&req.target_path, "target_path")?;
    check_capability(req.volume_capability.as_ref(), req.readonly)?;
    let version = version_from_context(&req.volume_context)?;
    prefetch_from_context(&req.volume_context)?;
    learned_prefetch_from_context(&req.volume_context)?;
    let target = PathBuf::from(target);
    if !target.is_absolute() {
        return Err(CsiError::InvalidArgument(format!(
            "target_path {} is not absolute",
            target.display()
        )));
    }
    Ok(CheckedPublish {
        volume_id: volume_id.into(),
        target,
        version,
    })
}

fn capability(rpc: rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(crate::proto::csi::node_service_capability::Type::Rpc(Rpc {
            r#type: rpc as i32,
        })),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        _request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        Err(CsiError::Unimplemented("NodeStageVolume").into())
    }

    async fn node_unstage_volume(
        &self,
        _request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        Err(CsiError::Unimplemented("NodeUnstageVolume").into())
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let started = std::time::Instant::now();
        let result = self.publish(&req).await;
        self.driver
            .metrics()
            .observe_publish(started.elapsed(), result.as_ref().err().map(CsiError::code));
        result?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let result = self.unpublish(&req).await;
        self.driver
            .metrics()
            .observe_unpublish(result.as_ref().err().map(CsiError::code));
        result?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let volume_id = required(&req.volume_id, "volume_id")?;
        let path = required(&req.volume_path, "volume_path")?;
        let stats = self.driver.stats(volume_id, &PathBuf::from(path)).await?;
        let bytes = i64::try_from(stats.bytes).unwrap_or(i64::MAX);
        let files = i64::try_from(stats.files).unwrap_or(i64::MAX);
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage: vec![
                VolumeUsage {
                    available: 0,
                    total: bytes,
                    used: bytes,
                    unit: Unit::Bytes as i32,
                },
                VolumeUsage {
                    available: 0,
                    total: files,
                    used: files,
                    unit: Unit::Inodes as i32,
                },
            ],
            volume_condition: None,
        }))
    }

    async fn node_expand_volume(
        &self,
        _request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        Err(CsiError::Unimplemented("NodeExpandVolume").into())
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: vec![capability(rpc::Type::GetVolumeStats)],
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        let config = self.driver.config();
        Ok(Response::new(NodeGetInfoResponse {
            node_id: config.node_id.clone(),
            max_volumes_per_node: config.max_volumes,
            accessible_topology: None,
        }))
    }
}

/// Names the request in its RPC's span and logs its arrival.
pub(crate) fn record_request(volume_id: &str, target: &std::path::Path) {
    let span = tracing::Span::current();
    span.record("volume_id", tracing::field::display(volume_id));
    span.record("target", tracing::field::display(target.display()));
    tracing::info!("request");
}

/// Names the version a request is for, once it is known (a tag is resolved first).
pub(crate) fn record_digest(digest: &sealed_store::Digest) {
    tracing::Span::current().record("digest", tracing::field::display(digest));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::csi::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }
    }

    #[test]
    fn read_only_modes_and_single_node_writer_pass_when_readonly() {
        for mode in [
            Mode::SingleNodeReaderOnly,
            Mode::MultiNodeReaderOnly,
            Mode::SingleNodeWriter,
        ] {
            check_capability(Some(&cap(mode)), true).unwrap();
        }
    }

    #[test]
    fn writes_are_refused() {
        let e = check_capability(Some(&cap(Mode::SingleNodeReaderOnly)), false).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("read-only"), "{e}");
        let e = check_capability(Some(&cap(Mode::MultiNodeMultiWriter)), true).unwrap_err();
        assert!(e.to_string().contains("MULTI_NODE_MULTI_WRITER"), "{e}");
        let block = VolumeCapability {
            access_type: Some(AccessType::Block(BlockVolume::default())),
            ..cap(Mode::MultiNodeReaderOnly)
        };
        let e = check_capability(Some(&block), true).unwrap_err();
        assert!(e.to_string().contains("block"), "{e}");
        let e = check_capability(None, true).unwrap_err();
        assert_eq!(e.to_string(), "volume_capability is required");
    }

    #[test]
    fn digest_attribute() {
        let mut ctx = HashMap::new();
        assert!(
            version_from_context(&ctx)
                .unwrap_err()
                .to_string()
                .contains("'digest' is required")
        );
        ctx.insert("digest".into(), "blake3:xyz".into());
        let e = version_from_context(&ctx).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("malformed digest"), "{e}");
        let d = Digest::of(b"x");
        ctx.insert("digest".into(), d.to_string());
        assert_eq!(version_from_context(&ctx).unwrap(), VersionRef::Digest(d));
        ctx.insert("tag".into(), "prod".into());
        let e = version_from_context(&ctx).unwrap_err();
        assert!(e.to_string().contains("either digest"), "{e}");
    }

    #[test]
    fn volume_and_tag_attributes_are_names() {
        for (volume, tag, needle) in [
            ("../../secrets", "prod", "volume attribute 'volume'"),
            ("Llama", "prod", "volume attribute 'volume'"),
            ("llama/x", "prod", "volume attribute 'volume'"),
            ("llama?watch=1", "prod", "volume attribute 'volume'"),
            ("-llama", "prod", "volume attribute 'volume'"),
            ("llama", "../x", "volume attribute 'tag'"),
            ("llama", "Prod", "volume attribute 'tag'"),
            ("llama", "a/b", "volume attribute 'tag'"),
            ("llama", &"t".repeat(64), "volume attribute 'tag'"),
        ] {
            let ctx = HashMap::from([
                ("volume".to_string(), volume.to_string()),
                ("tag".to_string(), tag.to_string()),
            ]);
            let e = version_from_context(&ctx).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{volume} {tag}");
            assert!(e.to_string().contains(needle), "{e}");
        }
        let long = format!("{}.{}", "a".repeat(63), "b".repeat(63));
        let ctx = HashMap::from([
            ("volume".to_string(), long.clone()),
            ("tag".to_string(), "v1.2-rc".to_string()),
        ]);
        assert!(matches!(
            version_from_context(&ctx).unwrap(),
            VersionRef::Tag { volume, .. } if volume == long
        ));
    }

    #[test]
    fn profile_scopes_are_per_namespace_and_volume() {
        let a = profile_scope("team-a", "llama").unwrap();
        assert_eq!(a.as_str(), "team-a/llama");
        assert_ne!(a.id(), profile_scope("team-b", "llama").unwrap().id());
        assert_ne!(a.id(), profile_scope("team-a", "llama-2").unwrap().id());
        // A shared volume of another namespace: still the reader's namespace first.
        let shared = profile_scope("team-b", "team-a/llama").unwrap();
        assert_eq!(shared.as_str(), "team-b/team-a/llama");
        assert_ne!(a.as_str(), STANDALONE_SCOPE);
    }

    #[test]
    fn learned_prefetch_attribute() {
        let mut ctx = HashMap::new();
        assert_eq!(learned_prefetch_from_context(&ctx).unwrap(), None);
        for (text, want) in [("true", true), ("false", false), (" false ", false)] {
            ctx.insert(LEARNED_PREFETCH_ATTRIBUTE.into(), text.into());
            assert_eq!(learned_prefetch_from_context(&ctx).unwrap(), Some(want));
        }
        for bad in ["no", "", "FALSE0"] {
            ctx.insert(LEARNED_PREFETCH_ATTRIBUTE.into(), bad.into());
            let e = learned_prefetch_from_context(&ctx).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}");
            assert!(e.to_string().contains("learnedPrefetch"), "{e}");
        }
    }

    #[test]
    fn prefetch_attribute() {
        let mut ctx = HashMap::new();
        assert_eq!(prefetch_from_context(&ctx).unwrap(), None);
        for (text, want) in [
            ("none", PrefetchSelection::None),
            ("", PrefetchSelection::None),
            ("model", PrefetchSelection::Model { globs: vec![] }),
            ("all", PrefetchSelection::All),
            (
                "model,*.json",
                PrefetchSelection::Model {
                    globs: vec!["*.json".into()],
                },
            ),
            (
                "*.safetensors, tokenizer*",
                PrefetchSelection::Globs(vec!["*.safetensors".into(), "tokenizer*".into()]),
            ),
        ] {
            ctx.insert(PREFETCH_ATTRIBUTE.into(), text.into());
            assert_eq!(prefetch_from_context(&ctx).unwrap(), Some(want), "{text}");
        }
        for bad in ["[", "all,model", "none,*.json", "model,{a"] {
            ctx.insert(PREFETCH_ATTRIBUTE.into(), bad.into());
            let e = prefetch_from_context(&ctx).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}");
            let text = e.to_string();
            assert!(
                text.contains("volume attribute 'prefetch'")
                    && text.contains("expected none, model"),
                "{text}"
            );
        }
        // A publish with a bad value is refused before anything else is looked at.
        let req = NodePublishVolumeRequest {
            volume_id: "v".into(),
            target_path: "/pods/x".into(),
            volume_capability: Some(cap(Mode::SingleNodeReaderOnly)),
            readonly: true,
            volume_context: HashMap::from([
                ("digest".to_string(), Digest::of(b"x").to_string()),
                ("prefetch".to_string(), "all,*.json".to_string()),
            ]),
            ..Default::default()
        };
        let e = check_publish(&req).err().expect("refused");
        assert!(e.to_string().contains("'all' stands alone"), "{e}");
    }

    #[test]
    fn volume_and_tag_attributes() {
        let mut ctx = HashMap::from([("volume".to_string(), "llama".to_string())]);
        let e = version_from_context(&ctx).unwrap_err();
        assert!(e.to_string().contains("go together"), "{e}");
        ctx.insert("tag".into(), "prod".into());
        assert_eq!(
            version_from_context(&ctx).unwrap(),
            VersionRef::Tag {
                volume: "llama".into(),
                tag: "prod".into()
            }
        );
    }
}
