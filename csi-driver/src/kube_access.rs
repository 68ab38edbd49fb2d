//! Everything the plugin asks the API server, in one place: may this pod mount this digest
//! (operator-attested versions, see `attest`), which digest does a tag name, is this node
//! excluded, does the CSIDriver object make kubelet say which pod mounts, is that pod real,
//! and the Event that says a tag moved into a pod. `node.rs` only calls these.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference, Pod};
use k8s_openapi::api::storage::v1::CSIDriver;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use sealed_crds::attestation::AttestationKey;
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_store::Digest;

use crate::attest::{KeyCache, SecretRef, Unfit, check_version, owner_uid};
use crate::error::CsiError;
use crate::gpu::{GPU_PRODUCT_LABEL, GpuExclusion};
use crate::identity::DRIVER_NAME;

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

/// How versions prove the operator made them.
#[derive(Clone, Debug)]
pub enum AttestationConfig {
    /// `status.attestation` is verified with the key in this Secret (`--attestation-secret`).
    Secret(SecretRef),
    /// `--insecure-skip-attestation`: any version that names its volume as controller owner
    /// authorizes its digest. Single-tenant labs only: a tenant who can create a
    /// SealedVolumeVersion can mount any digest.
    InsecureSkip,
}

/// A CSIDriver object found with `podInfoOnMount: true` is trusted this long.
pub const CSIDRIVER_CACHE: Duration = Duration::from_secs(10);

/// kubelet marks the mirror pod of a static pod with the static pod's UID.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

enum Keys {
    Cache(KeyCache),
    Skip,
}

/// A client for the API server, bound to this node.
pub struct KubeAccess {
    client: Client,
    node_name: String,
    excluded: GpuExclusion,
    keys: Keys,
    /// When the CSIDriver object was last seen with `podInfoOnMount: true`.
    csidriver_ok: std::sync::Mutex<Option<Instant>>,
}

impl KubeAccess {
    pub fn new(
        client: Client,
        node_name: String,
        excluded: GpuExclusion,
        attestation: AttestationConfig,
    ) -> Self {
        let keys = match attestation {
            AttestationConfig::Secret(secret) => {
                Keys::Cache(KeyCache::from_secret(client.clone(), secret))
            }
            AttestationConfig::InsecureSkip => Keys::Skip,
        };
        KubeAccess {
            client,
            node_name,
            excluded,
            keys,
            csidriver_ok: std::sync::Mutex::new(None),
        }
    }

    /// In-cluster config, or `KUBECONFIG` / `~/.kube/config`.
    pub async fn connect(
        node_name: String,
        excluded: GpuExclusion,
        attestation: AttestationConfig,
    ) -> Result<Self, CsiError> {
        let client = Client::try_default()
            .await
            .map_err(|e| CsiError::kube("building a Kubernetes client", e))?;
        Ok(KubeAccess::new(client, node_name, excluded, attestation))
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// Reads the attestation key now (at start, to report a problem early); `Ok(false)`
    /// under `--insecure-skip-attestation`.
    pub async fn load_key(&self) -> Result<bool, CsiError> {
        match &self.keys {
            Keys::Cache(c) => c.current().await.map(|_| true),
            Keys::Skip => Ok(false),
        }
    }

    async fn key(&self) -> Result<Option<AttestationKey>, CsiError> {
        match &self.keys {
            Keys::Cache(c) => c.current().await.map(Some),
            Keys::Skip => Ok(None),
        }
    }

    async fn refreshed_key(&self) -> Result<Option<AttestationKey>, CsiError> {
        match &self.keys {
            Keys::Cache(c) => c.refreshed().await,
            Keys::Skip => Ok(None),
        }
    }

    /// Whether `v` was made by the operator, as a mount would judge it (see
    /// [`check_version`]); a key that cannot be read is a no. For warming (`warm`).
    pub async fn made_by_operator(&self, v: &SealedVolumeVersion) -> bool {
        match self.key().await {
            Ok(key) => check_version(v, key.as_ref()).is_ok(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the attestation key");
                false
            }
        }
    }

    /// `FailedPrecondition` unless the CSIDriver object of this driver sets
    /// `podInfoOnMount: true`: without it kubelet does not put the pod into the volume
    /// context, and a namespace found there was written by whoever wrote the volume's
    /// attributes. A positive answer is cached for [`CSIDRIVER_CACHE`].
    pub async fn check_csidriver(&self) -> Result<(), CsiError> {
        let fresh = self
            .csidriver_ok
            .lock()
            .ok()
            .and_then(|t| *t)
            .is_some_and(|t| t.elapsed() < CSIDRIVER_CACHE);
        if fresh {
            return Ok(());
        }
        let found = Api::<CSIDriver>::all(self.client.clone())
            .get_opt(DRIVER_NAME)
            .await
            .map_err(|e| CsiError::kube(format!("reading CSIDriver {DRIVER_NAME}"), e))?;
        csidriver_verdict(found.as_ref())?;
        if let Ok(mut t) = self.csidriver_ok.lock() {
            *t = Some(Instant::now());
        }
        Ok(())
    }

    /// `PermissionDenied` unless the pod named in the volume context exists in its namespace
    /// with that UID and is bound to this node (a cross-check of what kubelet says).
    pub async fn check_pod(&self, pod: &PodInfo) -> Result<(), CsiError> {
        if pod.name.is_empty() || pod.uid.is_empty() {
            return Err(CsiError::InvalidArgument(format!(
                "volume context has no {POD_NAME} or {POD_UID}: the CSIDriver {DRIVER_NAME} must                  set spec.podInfoOnMount: true"
            )));
        }
        let found = Api::<Pod>::namespaced(self.client.clone(), &pod.namespace)
            .get_opt(&pod.name)
            .await
            .map_err(|e| {
                CsiError::kube(format!("reading Pod {}/{}", pod.namespace, pod.name), e)
            })?;
        pod_verdict(pod, found.as_ref(), &self.node_name)
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

    /// Judges `versions` with the attestation key; when none fits because an attestation did
    /// not verify, once more with the key read again (it may have been rotated).
    async fn judge_all<'a>(
        &self,
        namespace: &str,
        versions: &[&'a SealedVolumeVersion],
    ) -> Result<Verdict<'a>, CsiError> {
        let key = self.key().await?;
        let verdict = judge(namespace, versions, key.as_ref());
        if verdict.own.is_some() || !verdict.bad_attestation {
            return Ok(verdict);
        }
        match self.refreshed_key().await? {
            Some(key) => Ok(judge(namespace, versions, Some(&key))),
            None => Ok(verdict),
        }
    }

    /// Allowed when a SealedVolumeVersion with this digest made by the operator for a volume
    /// of `namespace` exists there (see [`check_version`]), or one made for a volume
    /// elsewhere whose SealedVolume has `spec.shared: true`; `PermissionDenied` otherwise,
    /// saying what is missing. `Ok` names the SealedVolume that allows it (`name` in
    /// `namespace`, `owner-namespace/name` for a shared one).
    pub async fn authorize(&self, namespace: &str, digest: &Digest) -> Result<String, CsiError> {
        let versions = Api::<SealedVolumeVersion>::all(self.client.clone())
            .list(&ListParams::default().fields(&format!("spec.digest={digest}")))
            .await
            .map_err(|e| CsiError::kube(format!("listing SealedVolumeVersions of {digest}"), e))?;
        // The field selector is the server's; the digest is checked here too.
        let candidates: Vec<&SealedVolumeVersion> = versions
            .items
            .iter()
            .filter(|v| v.spec.digest == digest.to_string())
            .collect();
        if candidates.is_empty() {
            return Err(CsiError::PermissionDenied(denial(namespace, digest, &[])));
        }
        let verdict = self.judge_all(namespace, &candidates).await?;
        if let Some(v) = verdict.own {
            tracing::debug!(%digest, namespace, version = ?v.metadata.name, "allowed");
            return Ok(v.spec.volume.clone());
        }
        for v in &verdict.others {
            let Some(ns) = v.metadata.namespace.as_deref() else {
                continue;
            };
            let volume = Api::<SealedVolume>::namespaced(self.client.clone(), ns)
                .get_opt(&v.spec.volume)
                .await
                .map_err(|e| {
                    CsiError::kube(format!("reading SealedVolume {ns}/{}", v.spec.volume), e)
                })?;
            // The owner the version names must be this very volume (not an earlier one of
            // the same name).
            let same = |sv: &SealedVolume| {
                sv.metadata
                    .uid
                    .as_deref()
                    .is_some_and(|u| Some(u) == owner_uid(v))
            };
            if volume.is_some_and(|sv| sv.spec.shared && same(&sv)) {
                tracing::debug!(%digest, namespace, owner = ns, "allowed: shared volume");
                return Ok(format!("{ns}/{}", v.spec.volume));
            }
        }
        Err(CsiError::PermissionDenied(denial(
            namespace,
            digest,
            &verdict.own_unfit,
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
        // A tag may only name a version of its own volume (a digest copied from another
        // volume: the volume's Ready condition says TagUnresolved), and one the operator made.
        let versions = Api::<SealedVolumeVersion>::namespaced(self.client.clone(), namespace)
            .list(&ListParams::default().fields(&format!("spec.digest={digest}")))
            .await
            .map_err(|e| CsiError::kube(format!("listing SealedVolumeVersions of {digest}"), e))?;
        let of_this_volume: Vec<&SealedVolumeVersion> = versions
            .items
            .iter()
            .filter(|v| v.spec.volume == volume && v.spec.digest == digest.to_string())
            .collect();
        if of_this_volume.is_empty() {
            return Err(CsiError::FailedPrecondition(format!(
                "tag '{tag}' of SealedVolume {namespace}/{volume} names {digest}, which is not a \
                 version of {namespace}/{volume}; point the tag at one of its versions \
                 (kubectl get svv -n {namespace} -l sealedvolumes.io/volume={volume})"
            )));
        }
        let verdict = self.judge_all(namespace, &of_this_volume).await?;
        if verdict.own.is_none() {
            let reasons: Vec<String> = verdict
                .own_unfit
                .iter()
                .map(|(v, why)| why.explain(v))
                .collect();
            return Err(CsiError::PermissionDenied(format!(
                "tag '{tag}' of SealedVolume {namespace}/{volume} names {digest}, which no \
                 version the operator made of {namespace}/{volume} has: {}",
                reasons.join("; ")
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
        self.record_event(pod, "TagResolved", message).await;
    }

    /// A Normal Event on the pod. Best effort: a failure is logged, never fails the mount.
    pub async fn record_event(&self, pod: &PodInfo, reason: &str, message: String) {
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
            reason: Some(reason.into()),
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
            tracing::warn!(error = %e, pod = %pod.name, namespace = %pod.namespace, reason,
                "cannot record an event on the pod");
        }
    }
}

/// What the versions of a digest say about a pod namespace.
#[derive(Debug, Default)]
struct Verdict<'a> {
    /// A version of the pod's namespace that authorizes the digest.
    own: Option<&'a SealedVolumeVersion>,
    /// The pod namespace's versions that do not, and why.
    own_unfit: Vec<(&'a SealedVolumeVersion, Unfit)>,
    /// Versions of other namespaces that would authorize it there: allowed here if their
    /// volume is shared.
    others: Vec<&'a SealedVolumeVersion>,
    /// Some attestation did not verify (a rotated key would explain it).
    bad_attestation: bool,
}

fn judge<'a>(
    namespace: &str,
    versions: &[&'a SealedVolumeVersion],
    key: Option<&AttestationKey>,
) -> Verdict<'a> {
    let mut verdict = Verdict::default();
    for &v in versions {
        let fit = check_version(v, key);
        if fit == Err(Unfit::BadAttestation) {
            verdict.bad_attestation = true;
        }
        let here = v.metadata.namespace.as_deref() == Some(namespace);
        match (here, fit) {
            (true, Ok(())) => {
                verdict.own.get_or_insert(v);
            }
            (true, Err(why)) => verdict.own_unfit.push((v, why)),
            (false, Ok(())) => verdict.others.push(v),
            (false, Err(_)) => {}
        }
    }
    verdict
}

/// The `PermissionDenied` message: what is missing for pods of `namespace`.
fn denial(namespace: &str, digest: &Digest, unfit: &[(&SealedVolumeVersion, Unfit)]) -> String {
    if unfit.is_empty() {
        return format!(
            "pods in namespace {namespace} may not mount {digest}: no SealedVolumeVersion with \
             that digest exists in {namespace} and no shared SealedVolume has it; create the \
             version in {namespace}, or set spec.shared: true on the SealedVolume that owns it"
        );
    }
    let reasons: Vec<String> = unfit.iter().map(|(v, why)| why.explain(v)).collect();
    format!(
        "pods in namespace {namespace} may not mount {digest}: {}; and no shared SealedVolume \
         has it. Only versions the operator made authorize a mount (it attests the versions \
         of syncs and of `sealed push --volume`): have the operator make the version in \
         {namespace}, or set spec.shared: true on the SealedVolume that owns it",
        reasons.join("; ")
    )
}

/// `FailedPrecondition` unless the CSIDriver exists with `podInfoOnMount: true`.
fn csidriver_verdict(found: Option<&CSIDriver>) -> Result<(), CsiError> {
    let Some(driver) = found else {
        return Err(CsiError::FailedPrecondition(format!(
            "CSIDriver {DRIVER_NAME} does not exist: install it (the Helm chart does) with \
             spec.podInfoOnMount: true, so that kubelet says which pod mounts a volume; \
             without it no publish can be authorized"
        )));
    };
    if driver.spec.pod_info_on_mount != Some(true) {
        return Err(CsiError::FailedPrecondition(format!(
            "CSIDriver {DRIVER_NAME} does not set spec.podInfoOnMount: true (it is {}), so \
             kubelet does not say which pod mounts a volume and the pod namespace in the volume \
             context cannot be trusted; set it to true (the Helm chart does)",
            driver
                .spec
                .pod_info_on_mount
                .map_or("unset".to_string(), |b| b.to_string())
        )));
    }
    Ok(())
}

/// `PermissionDenied` unless `found` is the pod `info` names, bound to `node`.
fn pod_verdict(info: &PodInfo, found: Option<&Pod>, node: &str) -> Result<(), CsiError> {
    let who = format!("pod {}/{} (uid {})", info.namespace, info.name, info.uid);
    let Some(pod) = found else {
        return Err(CsiError::PermissionDenied(format!(
            "{who} named in the volume context does not exist"
        )));
    };
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let mirror_of = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(MIRROR_ANNOTATION))
        .map(String::as_str);
    if uid != info.uid && mirror_of != Some(info.uid.as_str()) {
        return Err(CsiError::PermissionDenied(format!(
            "{who} named in the volume context does not exist: that pod has uid {uid}"
        )));
    }
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if bound != Some(node) {
        return Err(CsiError::PermissionDenied(format!(
            "{who} is not bound to this node {node} (it is on {})",
            bound.unwrap_or("no node")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::attest::tests::{D, key, version};

    fn digest() -> Digest {
        Digest::parse(D).unwrap()
    }

    #[test]
    fn a_version_of_the_pods_namespace_authorizes() {
        let k = key(1);
        let mine = version("team-a", "llama", Some(&k));
        let verdict = judge("team-a", &[&mine], Some(&k));
        assert!(verdict.own.is_some() && !verdict.bad_attestation);
    }

    #[test]
    fn tenant_made_versions_do_not_authorize_and_the_message_says_why() {
        let k = key(1);
        let victim = version("team-a", "llama", Some(&k));
        // The tenant's own SVV with the victim's digest: no attestation, a forged one, one
        // copied from the victim's namespace.
        let none = version("team-b", "llama", None);
        let forged = version("team-b", "llama", Some(&key(9)));
        let mut copied = version("team-b", "llama", None);
        copied.status.as_mut().unwrap().attestation = victim.status.clone().unwrap().attestation;
        for (tenant, bad) in [(&none, false), (&forged, true), (&copied, true)] {
            let verdict = judge("team-b", &[&victim, tenant], Some(&k));
            assert!(verdict.own.is_none());
            assert_eq!(verdict.bad_attestation, bad);
            // The victim's version fits in its own namespace: allowed here only if shared.
            assert_eq!(verdict.others.len(), 1);
            let text = denial("team-b", &digest(), &verdict.own_unfit);
            assert!(
                text.contains("a SealedVolumeVersion exists (team-b/")
                    && text.contains("was not made by the operator (no valid attestation")
                    && text.contains("spec.shared"),
                "{text}"
            );
        }
        // A version being deleted.
        let mut going = version("team-a", "llama", Some(&k));
        going.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        let verdict = judge("team-a", &[&going], Some(&k));
        assert!(verdict.own.is_none() && verdict.others.is_empty());
        let text = denial("team-a", &digest(), &verdict.own_unfit);
        assert!(text.contains("is being deleted"), "{text}");
        // Nothing at all: the message of old.
        let text = denial("team-c", &digest(), &[]);
        assert!(
            text.contains("no SealedVolumeVersion with that digest exists in team-c")
                && text.contains("spec.shared: true"),
            "{text}"
        );
        // Other namespaces' unattested versions are not even shared candidates.
        let verdict = judge("team-c", &[&none], Some(&k));
        assert!(verdict.others.is_empty() && verdict.own_unfit.is_empty());
    }

    fn csidriver(pod_info: Option<bool>) -> CSIDriver {
        let mut d = CSIDriver::default();
        d.metadata.name = Some(DRIVER_NAME.into());
        d.spec.pod_info_on_mount = pod_info;
        d
    }

    #[test]
    fn the_csidriver_must_set_pod_info_on_mount() {
        csidriver_verdict(Some(&csidriver(Some(true)))).unwrap();
        for (found, needle) in [
            (None, "does not exist"),
            (Some(csidriver(None)), "it is unset"),
            (Some(csidriver(Some(false))), "it is false"),
        ] {
            let e = csidriver_verdict(found.as_ref()).unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition);
            let text = e.to_string();
            assert!(
                text.contains(needle) && text.contains("podInfoOnMount: true"),
                "{text}"
            );
        }
    }

    fn pod(uid: &str, node: Option<&str>) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        p.metadata.namespace = Some("ml".into());
        p.metadata.uid = Some(uid.into());
        p.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: node.map(String::from),
            ..Default::default()
        });
        p
    }

    #[test]
    fn the_pod_must_exist_with_its_uid_on_this_node() {
        let info = PodInfo {
            namespace: "ml".into(),
            name: "p".into(),
            uid: "u1".into(),
            service_account: "default".into(),
        };
        pod_verdict(&info, Some(&pod("u1", Some("n1"))), "n1").unwrap();
        for (found, needle) in [
            (None, "does not exist"),
            (Some(pod("u2", Some("n1"))), "has uid u2"),
            (
                Some(pod("u1", Some("n2"))),
                "not bound to this node n1 (it is on n2)",
            ),
            (Some(pod("u1", None)), "no node"),
        ] {
            let e = pod_verdict(&info, found.as_ref(), "n1").unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert!(e.to_string().contains(needle), "{e}");
        }
        // A static pod: its mirror pod has another UID and names the static pod's.
        let mut mirror = pod("mirror-uid", Some("n1"));
        mirror.metadata.annotations = Some(
            [(MIRROR_ANNOTATION.to_string(), "u1".to_string())]
                .into_iter()
                .collect(),
        );
        pod_verdict(&info, Some(&mirror), "n1").unwrap();
    }

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
