//! The pod admission: a pod whose inline CSI volumes (driver `csi.sealedvolumes.io`) name a
//! `volume` + `tag` gets them rewritten to the digest its revision resolved (`revision`), the
//! tag kept as the attribute [`FROM_TAG_ATTRIBUTE`]; every pod with a sealed volume gets the
//! node affinity that keeps it where the node plugin runs (`placement`). The node plugin then
//! authorizes the digest as it authorizes any digest.

use k8s_openapi::api::core::v1::{CSIVolumeSource, Pod, PodSpec};
use kube::Client;
use kube::api::{Api, ListParams};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_store::Digest;

use super::placement::Exclusion;
use super::revision::{Revision, resolve_for_revision};

use sealed_crds::csi::{DIGEST_ATTRIBUTE, TAG_ATTRIBUTE, VOLUME_ATTRIBUTE};
/// The names this admission shares with the node plugin and `sealed pin`: one home, in
/// `sealed_crds::csi`.
pub use sealed_crds::csi::{DRIVER_NAME as DRIVER, FROM_TAG_ATTRIBUTE};

/// A sealed volume of the pod that names a tag.
#[derive(Clone, Debug, PartialEq)]
struct TagUse {
    index: usize,
    volume: String,
    tag: String,
}

/// The inline CSI volumes of ours, with their index in `spec.volumes`.
fn sealed_volumes(spec: Option<&PodSpec>) -> impl Iterator<Item = (usize, &CSIVolumeSource)> {
    spec.into_iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .enumerate()
        .filter_map(|(i, v)| {
            v.csi
                .as_ref()
                .filter(|c| c.driver == DRIVER)
                .map(|c| (i, c))
        })
}

/// The `(volume, tag)` pairs a pod spec's sealed volumes name, sorted, once each.
pub fn tags_named(spec: Option<&PodSpec>) -> Vec<(String, String)> {
    let mut named: Vec<(String, String)> = tag_uses(spec)
        .into_iter()
        .map(|u| (u.volume, u.tag))
        .collect();
    named.sort();
    named.dedup();
    named
}

/// The sealed volumes naming `volume` + `tag` and no digest (anything else is the node
/// plugin's to judge, with its own messages).
fn tag_uses(spec: Option<&PodSpec>) -> Vec<TagUse> {
    sealed_volumes(spec)
        .filter_map(|(index, csi)| {
            let attrs = csi.volume_attributes.as_ref()?;
            let get = |k: &str| attrs.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
            match (
                get(DIGEST_ATTRIBUTE),
                get(VOLUME_ATTRIBUTE),
                get(TAG_ATTRIBUTE),
            ) {
                (None, Some(volume), Some(tag)) => Some(TagUse {
                    index,
                    volume: volume.into(),
                    tag: tag.into(),
                }),
                _ => None,
            }
        })
        .collect()
}

/// The digest `tag` of SealedVolume `namespace/volume` names now, if it is a version of that
/// volume (what the node plugin checks for a tag; it still authorizes the digest at mount).
pub async fn resolve_tag(
    client: &Client,
    namespace: &str,
    volume: &str,
    tag: &str,
) -> Result<String, String> {
    let sv = Api::<SealedVolume>::namespaced(client.clone(), namespace)
        .get_opt(volume)
        .await
        .map_err(|e| format!("cannot read SealedVolume {namespace}/{volume}: {e}"))?
        .ok_or_else(|| {
            format!("SealedVolume {namespace}/{volume} not found (volume attribute 'volume')")
        })?;
    let text = sv.spec.tag(tag).ok_or_else(|| {
        let known: Vec<&str> = sv.spec.tags.keys().map(String::as_str).collect();
        format!(
            "tag '{tag}' not found on SealedVolume {namespace}/{volume} (its tags: {})",
            if known.is_empty() {
                "none".into()
            } else {
                known.join(", ")
            }
        )
    })?;
    let digest = Digest::parse(text).map_err(|e| {
        format!("tag '{tag}' of SealedVolume {namespace}/{volume} holds {text:?}: {e}")
    })?;
    let versions = Api::<SealedVolumeVersion>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().fields(&format!("spec.digest={digest}")))
        .await
        .map_err(|e| format!("cannot list SealedVolumeVersions of {digest}: {e}"))?;
    if !versions.items.iter().any(|v| v.spec.volume == volume) {
        return Err(format!(
            "tag '{tag}' of SealedVolume {namespace}/{volume} names {digest}, which is not a \
             version of {namespace}/{volume}; point the tag at one of its versions"
        ));
    }
    Ok(digest.to_string())
}

/// What the admission needs besides the request.
pub struct PodAdmission {
    pub client: Client,
    pub exclusion: Exclusion,
}

impl PodAdmission {
    /// Admits `req`: allowed unchanged, allowed with a patch, or refused with a message for
    /// the pod's creator (its controller's FailedCreate Event shows it).
    pub async fn admit(&self, req: &AdmissionRequest<Pod>) -> AdmissionResponse {
        let response = AdmissionResponse::from(req);
        let (Operation::Create, Some(pod)) = (&req.operation, &req.object) else {
            return response;
        };
        if sealed_volumes(pod.spec.as_ref()).next().is_none() {
            return response;
        }
        let namespace = req
            .namespace
            .clone()
            .or_else(|| pod.metadata.namespace.clone())
            .unwrap_or_default();
        match self.patch(pod, &namespace, req.dry_run).await {
            Ok(ops) if ops.is_empty() => response,
            Ok(ops) => {
                match serde_json::from_value::<json_patch::Patch>(serde_json::Value::Array(ops))
                    .map_err(|e| e.to_string())
                    .and_then(|p| response.clone().with_patch(p).map_err(|e| e.to_string()))
                {
                    Ok(r) => r,
                    Err(e) => response.deny(format!("sealed volumes: cannot build the patch: {e}")),
                }
            }
            Err(message) => response.deny(message),
        }
    }

    /// The JSON patch operations for `pod`, or the refusal.
    async fn patch(
        &self,
        pod: &Pod,
        namespace: &str,
        dry_run: bool,
    ) -> Result<Vec<serde_json::Value>, String> {
        let mut ops = Vec::new();
        if let Some(affinity) = self.exclusion.place(pod)? {
            ops.push(serde_json::json!({"op": "add", "path": "/spec/affinity", "value": affinity}));
        }
        let uses = tag_uses(pod.spec.as_ref());
        if uses.is_empty() {
            return Ok(ops);
        }
        let revision = Revision::of(pod);
        let wanted = tags_named(pod.spec.as_ref());
        let client = &self.client;
        // A workload that follows its tags carries the digests its template was made for
        // (`follow`): the revision takes those, not what the tag names by the time its first
        // pod comes.
        let pinned = super::follow::template_digests(pod.metadata.annotations.as_ref());
        let record = resolve_for_revision(
            client,
            namespace,
            &revision,
            &wanted,
            dry_run,
            |volume, tag| {
                let pinned = pinned.get(&volume).and_then(|t| t.get(&tag)).cloned();
                async move {
                    match pinned {
                        Some(d) => Ok(d),
                        None => resolve_tag(client, namespace, &volume, &tag).await,
                    }
                }
            },
        )
        .await
        .map_err(|e| {
            format!("sealed volumes: resolving the tags of this pod's revision ({revision}): {e}")
        })?;
        let volumes = pod
            .spec
            .as_ref()
            .map(|s| s.volumes.as_deref().unwrap_or_default())
            .unwrap_or_default();
        for u in &uses {
            let digest = record
                .get(&u.volume)
                .and_then(|t| t.get(&u.tag))
                .ok_or_else(|| {
                    format!(
                        "sealed volumes: no digest recorded for {}:{}",
                        u.volume, u.tag
                    )
                })?;
            let mut attrs = volumes
                .get(u.index)
                .and_then(|v| v.csi.as_ref())
                .and_then(|c| c.volume_attributes.clone())
                .unwrap_or_default();
            attrs.remove(VOLUME_ATTRIBUTE);
            attrs.remove(TAG_ATTRIBUTE);
            attrs.insert(DIGEST_ATTRIBUTE.into(), digest.clone());
            attrs.insert(FROM_TAG_ATTRIBUTE.into(), format!("{}:{}", u.volume, u.tag));
            ops.push(serde_json::json!({
                "op": "replace",
                "path": format!("/spec/volumes/{}/csi/volumeAttributes", u.index),
                "value": attrs,
            }));
        }
        Ok(ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_volumes_that_name_a_tag_are_rewritten() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "volumes": [
                {"name": "a", "emptyDir": {}},
                {"name": "b", "csi": {"driver": DRIVER, "volumeAttributes": {"volume": "llama", "tag": "prod"}}},
                {"name": "c", "csi": {"driver": "other.csi", "volumeAttributes": {"volume": "llama", "tag": "prod"}}},
                {"name": "d", "csi": {"driver": DRIVER, "volumeAttributes": {"digest": "blake3:00"}}},
                {"name": "e", "csi": {"driver": DRIVER, "volumeAttributes": {"digest": "x", "volume": "v", "tag": "t"}}},
            ]}
        }))
        .expect("pod");
        assert_eq!(
            tag_uses(pod.spec.as_ref()),
            vec![TagUse {
                index: 1,
                volume: "llama".into(),
                tag: "prod".into()
            }]
        );
        assert_eq!(sealed_volumes(pod.spec.as_ref()).count(), 3);
    }
}
