//! Everything the plugin asks the API server, in one place: may this pod mount this digest,
//! which digest does a tag name, is this node excluded, and the Event that says a tag moved
//! into a pod. `node.rs` only calls these.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_store::Digest;

use crate::error::CsiError;
use crate::gpu::{GPU_PRODUCT_LABEL, GpuExclusion};

/// Volume context keys kubelet sets when the CSIDriver has `podInfoOnMount: true`.
pub const POD_NAMESPACE: &str = "csi.storage.k8s.io/pod.namespace";
pub const POD_NAME: &str = "csi.storage.k8s.io/pod.name";
pub const POD_UID: &str = "csi.storage.k8s.io/pod.uid";
pub const POD_SERVICE_ACCOUNT: &str = "csi.storage.k8s.io/serviceAccount.name";

/// The pod a publish is for, from the volume context.
#[derive(Clone, Debug, PartialEq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub service_account: String,
}

impl PodInfo {
    /// `InvalidArgument` without a namespace: the CSIDriver object lacks `podInfoOnMount`.
    pub fn from_context(context: &HashMap<String, String>) -> Result<Self, CsiError> {
        let get = |k: &str| {
            context
                .get(k)
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        let namespace = get(POD_NAMESPACE);
        if namespace.is_empty() {
            return Err(CsiError::InvalidArgument(format!(
                "volume context has no {POD_NAMESPACE}: the CSIDriver csi.sealedvolumes.io must \
                 set spec.podInfoOnMount: true so kubelet says which pod mounts the volume \
                 (needed to authorize it)"
            )));
        }
        Ok(PodInfo {
            namespace,
            name: get(POD_NAME),
            uid: get(POD_UID),
            service_account: get(POD_SERVICE_ACCOUNT),
        })
    }
}

/// A client for the API server, bound to this node.
pub struct KubeAccess {
    client: Client,
    node_name: String,
    excluded: GpuExclusion,
}

impl KubeAccess {
    pub fn new(client: Client, node_name: String, excluded: GpuExclusion) -> Self {
        KubeAccess {
            client,
            node_name,
            excluded,
        }
    }

    /// In-cluster config, or `KUBECONFIG` / `~/.kube/config`.
    pub async fn connect(node_name: String, excluded: GpuExclusion) -> Result<Self, CsiError> {
        let client = Client::try_default()
            .await
            .map_err(|e| CsiError::kube("building a Kubernetes client", e))?;
        Ok(KubeAccess::new(client, node_name, excluded))
    }

    /// `FailedPrecondition` naming the GPU when this node's `nvidia.com/gpu.product` is
    /// excluded. Read on every call: labels change without the plugin restarting.
    pub async fn check_node(&self) -> Result<(), CsiError> {
        let node = Api::<Node>::all(self.client.clone())
            .get(&self.node_name)
            .await
            .map_err(|e| CsiError::kube(format!("reading Node {}", self.node_name), e))?;
        let product = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(GPU_PRODUCT_LABEL));
        match product {
            Some(p) if self.excluded.is_excluded(p) => Err(CsiError::FailedPrecondition(format!(
                "node {} has GPU {p} ({GPU_PRODUCT_LABEL}), which sealed volumes exclude \
                 (--excluded-gpu-products); schedule the pod on another node",
                self.node_name
            ))),
            _ => Ok(()),
        }
    }

    /// Allowed when a SealedVolumeVersion with this digest is in `namespace`, or its
    /// SealedVolume (anywhere) has `spec.shared: true`; `PermissionDenied` otherwise.
    pub async fn authorize(&self, namespace: &str, digest: &Digest) -> Result<(), CsiError> {
        let versions = Api::<SealedVolumeVersion>::all(self.client.clone())
            .list(&ListParams::default().fields(&format!("spec.digest={digest}")))
            .await
            .map_err(|e| CsiError::kube(format!("listing SealedVolumeVersions of {digest}"), e))?;
        if versions
            .items
            .iter()
            .any(|v| v.metadata.namespace.as_deref() == Some(namespace))
        {
            return Ok(());
        }
        for v in &versions.items {
            let Some(ns) = v.metadata.namespace.as_deref() else {
                continue;
            };
            let volume = Api::<SealedVolume>::namespaced(self.client.clone(), ns)
                .get_opt(&v.spec.volume)
                .await
                .map_err(|e| {
                    CsiError::kube(format!("reading SealedVolume {ns}/{}", v.spec.volume), e)
                })?;
            if volume.is_some_and(|sv| sv.spec.shared) {
                tracing::debug!(%digest, namespace, owner = ns, "allowed: shared volume");
                return Ok(());
            }
        }
        Err(CsiError::PermissionDenied(format!(
            "pods in namespace {namespace} may not mount {digest}: no SealedVolumeVersion with \
             that digest exists in {namespace} and no shared SealedVolume has it; create the \
             version in {namespace}, or set spec.shared: true on the SealedVolume that owns it"
        )))
    }

    /// The digest `tag` of SealedVolume `namespace/volume` names now.
    pub async fn resolve_tag(
        &self,
        namespace: &str,
        volume: &str,
        tag: &str,
    ) -> Result<Digest, CsiError> {
        let sv = Api::<SealedVolume>::namespaced(self.client.clone(), namespace)
            .get_opt(volume)
            .await
            .map_err(|e| CsiError::kube(format!("reading SealedVolume {namespace}/{volume}"), e))?
            .ok_or_else(|| {
                CsiError::NotFound(format!(
                    "SealedVolume {namespace}/{volume} not found (volume attribute 'volume')"
                ))
            })?;
        let Some(text) = sv.spec.tag(tag) else {
            let known: Vec<&str> = sv.spec.tags.keys().map(String::as_str).collect();
            return Err(CsiError::NotFound(format!(
                "tag '{tag}' not found on SealedVolume {namespace}/{volume} (its tags: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            )));
        };
        let digest = Digest::parse(text).map_err(|e| {
            CsiError::FailedPrecondition(format!(
                "tag '{tag}' of SealedVolume {namespace}/{volume} holds {text:?}: {e}"
            ))
        })?;
        // A tag may only name a version of its own volume: a digest copied from another
        // volume (the volume's Ready condition says TagUnresolved) is not mounted.
        let versions = Api::<SealedVolumeVersion>::namespaced(self.client.clone(), namespace)
            .list(&ListParams::default().fields(&format!("spec.digest={digest}")))
            .await
            .map_err(|e| CsiError::kube(format!("listing SealedVolumeVersions of {digest}"), e))?;
        let of_this_volume = versions
            .items
            .iter()
            .any(|v| v.spec.volume == volume && v.metadata.deletion_timestamp.is_none());
        if !of_this_volume {
            return Err(CsiError::FailedPrecondition(format!(
                "tag '{tag}' of SealedVolume {namespace}/{volume} names {digest}, which is not a \
                 version of {namespace}/{volume}; point the tag at one of its versions \
                 (kubectl get svv -n {namespace} -l sealedvolumes.io/volume={volume})"
            )));
        }
        Ok(digest)
    }

    /// A Normal `TagResolved` Event on the pod. Best effort: a failure is logged, never
    /// fails the mount.
    pub async fn record_tag_resolved(
        &self,
        pod: &PodInfo,
        volume: &str,
        tag: &str,
        digest: &Digest,
    ) {
        let message = format!(
            "tag {tag} of {}/{volume} resolved to {digest}; tags can move, pin the digest for a \
             fixed version",
            pod.namespace
        );
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!(
                    "{}.",
                    if pod.name.is_empty() {
                        "pod"
                    } else {
                        &pod.name
                    }
                )),
                namespace: Some(pod.namespace.clone()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(pod.namespace.clone()),
                name: Some(pod.name.clone()),
                uid: Some(pod.uid.clone()).filter(|u| !u.is_empty()),
                ..ObjectReference::default()
            },
            reason: Some("TagResolved".into()),
            message: Some(message),
            type_: Some("Normal".into()),
            source: Some(EventSource {
                component: Some("sealed-csi".into()),
                host: Some(self.node_name.clone()),
            }),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            ..Event::default()
        };
        let result = Api::<Event>::namespaced(self.client.clone(), &pod.namespace)
            .create(&PostParams::default(), &event)
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, pod = %pod.name, namespace = %pod.namespace,
                "cannot record the TagResolved event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_info_needs_a_namespace() {
        let mut ctx = HashMap::new();
        let e = PodInfo::from_context(&ctx).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("podInfoOnMount"), "{e}");
        ctx.insert(POD_NAMESPACE.to_string(), "ml".to_string());
        ctx.insert(POD_NAME.to_string(), "p".to_string());
        let pod = PodInfo::from_context(&ctx).unwrap();
        assert_eq!((pod.namespace.as_str(), pod.name.as_str()), ("ml", "p"));
    }
}
