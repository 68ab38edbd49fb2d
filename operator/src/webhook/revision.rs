//! One digest per workload revision (design invariant 9): the record of which digest each tag
//! resolved to for a revision, kept on the object that is that revision, and the protocol
//! that makes concurrent admissions agree.
//!
//! The revision of a pod is its controller owner: a ReplicaSet (one Deployment revision), a
//! Job, or for a StatefulSet or DaemonSet the ControllerRevision its `controller-revision-hash`
//! label names. A pod with no controller (or another kind of controller) is its own revision.
//!
//! The record is the annotation [`RESOLVED_ANNOTATION`] on that object: JSON
//! `{"<volume>": {"<tag>": "blake3:…"}}`. An admission reads it; a tag it lacks is resolved
//! and added with a merge patch that carries the `resourceVersion` read, so the API server
//! refuses it (409) when another admission wrote first; then the record is read again and the
//! first writer's digest wins. Entries are only ever added: a revision never changes digest.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{ControllerRevision, ReplicaSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::{Api, Client};

/// The annotation holding a revision's resolved tags.
pub const RESOLVED_ANNOTATION: &str = "sealedvolumes.io/resolved-tags";
/// Label the StatefulSet and DaemonSet controllers put on their pods.
const REVISION_LABEL: &str = "controller-revision-hash";
/// Conditional writes tried before giving up (each loses only to another writer's success).
const ATTEMPTS: usize = 8;

/// volume → tag → digest text.
pub type Resolved = BTreeMap<String, BTreeMap<String, String>>;

/// The object that stands for a pod's revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Revision {
    /// A ReplicaSet, a Job or a ControllerRevision: `kind` and `name` in the pod's namespace.
    Object { kind: &'static str, name: String },
    /// No controller the webhook knows: the pod is its own revision.
    Pod,
}

impl Revision {
    /// The revision of `pod`, from its controller owner reference and labels.
    pub fn of(pod: &Pod) -> Revision {
        let Some(owner) = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
        else {
            return Revision::Pod;
        };
        let group = owner.api_version.split('/').next().unwrap_or_default();
        let hash = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(REVISION_LABEL))
            .filter(|h| !h.is_empty());
        match (group, owner.kind.as_str(), hash) {
            ("apps", "ReplicaSet", _) => Revision::Object {
                kind: "ReplicaSet",
                name: owner.name.clone(),
            },
            ("batch", "Job", _) => Revision::Object {
                kind: "Job",
                name: owner.name.clone(),
            },
            // The StatefulSet controller labels a pod with its ControllerRevision's name.
            ("apps", "StatefulSet", Some(h)) => Revision::Object {
                kind: "ControllerRevision",
                name: h.clone(),
            },
            // The DaemonSet controller labels it with the hash; the revision is <ds>-<hash>.
            ("apps", "DaemonSet", Some(h)) => Revision::Object {
                kind: "ControllerRevision",
                name: format!("{}-{h}", owner.name),
            },
            _ => Revision::Pod,
        }
    }

    fn api(&self, client: &Client, namespace: &str) -> Option<Api<DynamicObject>> {
        let Revision::Object { kind, .. } = self else {
            return None;
        };
        let resource = match *kind {
            "ReplicaSet" => ApiResource::erase::<ReplicaSet>(&()),
            "Job" => ApiResource::erase::<Job>(&()),
            _ => ApiResource::erase::<ControllerRevision>(&()),
        };
        Some(Api::namespaced_with(client.clone(), namespace, &resource))
    }
}

impl std::fmt::Display for Revision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Revision::Object { kind, name } => write!(f, "{kind} {name}"),
            Revision::Pod => f.write_str("the pod itself"),
        }
    }
}

/// What went wrong keeping a revision's record; the admission refuses the pod with it (its
/// controller creates the pod again, with backoff).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot read {revision} in namespace {namespace}: {source}")]
    Read {
        revision: String,
        namespace: String,
        source: kube::Error,
    },
    #[error(
        "{revision} in namespace {namespace} does not exist (yet); its pods are created after it"
    )]
    Missing { revision: String, namespace: String },
    #[error("cannot record the resolved tags on {revision} in namespace {namespace}: {source}")]
    Write {
        revision: String,
        namespace: String,
        source: kube::Error,
    },
    #[error(
        "{revision} in namespace {namespace} changed {ATTEMPTS} times while its tags were recorded; try again"
    )]
    Contended { revision: String, namespace: String },
    #[error("{0}")]
    Resolve(String),
}

fn record_of(obj: &DynamicObject) -> Resolved {
    obj.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RESOLVED_ANNOTATION))
        // A record someone else garbled is treated as empty and overwritten.
        .and_then(|text| serde_json::from_str(text).ok())
        .unwrap_or_default()
}

fn lookup<'a>(record: &'a Resolved, volume: &str, tag: &str) -> Option<&'a String> {
    record.get(volume).and_then(|tags| tags.get(tag))
}

/// The digest of each `(volume, tag)` for `pod`'s revision: the recorded one when there is
/// one, else `resolve`'s, recorded first-writer-wins (nothing is written on a dry run or for
/// a pod that is its own revision).
pub async fn resolve_for_revision<F, Fut>(
    client: &Client,
    namespace: &str,
    revision: &Revision,
    wanted: &[(String, String)],
    dry_run: bool,
    mut resolve: F,
) -> Result<Resolved, RecordError>
where
    F: FnMut(String, String) -> Fut,
    Fut: std::future::Future<Output = Result<String, String>>,
{
    let Some(api) = revision.api(client, namespace) else {
        let mut out = Resolved::new();
        for (volume, tag) in wanted {
            let digest = resolve(volume.clone(), tag.clone())
                .await
                .map_err(RecordError::Resolve)?;
            out.entry(volume.clone())
                .or_default()
                .insert(tag.clone(), digest);
        }
        return Ok(out);
    };
    let Revision::Object { name, .. } = revision else {
        return Err(RecordError::Resolve(
            "unreachable: no revision object".into(),
        ));
    };
    let (rev, ns) = (revision.to_string(), namespace.to_owned());
    for _ in 0..ATTEMPTS {
        let obj = api
            .get_opt(name)
            .await
            .map_err(|source| RecordError::Read {
                revision: rev.clone(),
                namespace: ns.clone(),
                source,
            })?
            .ok_or_else(|| RecordError::Missing {
                revision: rev.clone(),
                namespace: ns.clone(),
            })?;
        let mut record = record_of(&obj);
        let mut added = false;
        for (volume, tag) in wanted {
            if lookup(&record, volume, tag).is_none() {
                let digest = resolve(volume.clone(), tag.clone())
                    .await
                    .map_err(RecordError::Resolve)?;
                record
                    .entry(volume.clone())
                    .or_default()
                    .insert(tag.clone(), digest);
                added = true;
            }
        }
        if !added || dry_run {
            return Ok(record);
        }
        let text =
            serde_json::to_string(&record).map_err(|e| RecordError::Resolve(e.to_string()))?;
        // The resourceVersion makes the patch conditional: a 409 means another admission
        // recorded first, and its digests are the revision's.
        let patch = serde_json::json!({"metadata": {
            "resourceVersion": obj.metadata.resource_version,
            "annotations": {RESOLVED_ANNOTATION: text},
        }});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(record),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(source) => {
                return Err(RecordError::Write {
                    revision: rev,
                    namespace: ns,
                    source,
                });
            }
        }
    }
    Err(RecordError::Contended {
        revision: rev,
        namespace: ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(owner: Option<(&str, &str, &str)>, hash: Option<&str>) -> Pod {
        let mut meta = serde_json::json!({"name": "p"});
        if let Some((api, kind, name)) = owner {
            meta["ownerReferences"] = serde_json::json!([{"apiVersion": api, "kind": kind,
                "name": name, "uid": "u", "controller": true}]);
        }
        if let Some(h) = hash {
            meta["labels"] = serde_json::json!({REVISION_LABEL: h});
        }
        serde_json::from_value(serde_json::json!({"metadata": meta})).expect("pod")
    }

    #[test]
    fn the_revision_is_the_controller_owner_or_its_controller_revision() {
        let obj = |kind, name: &str| Revision::Object {
            kind,
            name: name.into(),
        };
        assert_eq!(
            Revision::of(&pod(Some(("apps/v1", "ReplicaSet", "web-7f")), None)),
            obj("ReplicaSet", "web-7f")
        );
        assert_eq!(
            Revision::of(&pod(Some(("batch/v1", "Job", "train")), None)),
            obj("Job", "train")
        );
        assert_eq!(
            Revision::of(&pod(Some(("apps/v1", "StatefulSet", "db")), Some("db-5c9"))),
            obj("ControllerRevision", "db-5c9")
        );
        assert_eq!(
            Revision::of(&pod(Some(("apps/v1", "DaemonSet", "agent")), Some("6d4"))),
            obj("ControllerRevision", "agent-6d4")
        );
        assert_eq!(Revision::of(&pod(None, None)), Revision::Pod);
        assert_eq!(
            Revision::of(&pod(Some(("apps/v1", "StatefulSet", "db")), None)),
            Revision::Pod
        );
        assert_eq!(
            Revision::of(&pod(Some(("example.com/v1", "ReplicaSet", "x")), None)),
            Revision::Pod
        );
    }
}
