//! Tag-following rollouts (opt-in): a Deployment or StatefulSet annotated
//! `sealedvolumes.io/follow-tags: "true"` gets a normal rollout when a tag its pod template
//! names moves. The operator writes the digests the tags name into the pod template
//! (annotation [`TEMPLATE_DIGESTS`]): a changed template is a new revision, which Kubernetes
//! rolls out with the workload's own gates, and whose pods the admission gives exactly those
//! digests (`pods`). A tag moved back writes the earlier digests back: the template is the
//! earlier one again, and the rollout goes back to it (a Deployment reuses its earlier
//! ReplicaSet and its recorded digest). Each change is an Event on the workload naming the
//! old and new digest. Workloads without the annotation never change.
//!
//! Run by the leader only: a SealedVolume change looks at that namespace's workloads at once,
//! and every [`RESYNC`] all of them (a workload annotated after its tags last moved).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use sealed_crds::SealedVolume;
use serde::de::DeserializeOwned;

use super::pods::{resolve_tag, tags_named};
use super::revision::Resolved;

/// The workload's opt-in annotation (value `"true"`).
pub const FOLLOW_ANNOTATION: &str = "sealedvolumes.io/follow-tags";
/// On the pod template (and so on its pods): the digest each tag named when the operator last
/// wrote it, `{"<volume>": {"<tag>": "blake3:…"}}`.
pub const TEMPLATE_DIGESTS: &str = "sealedvolumes.io/tag-digests";
/// How often every following workload is looked at, besides SealedVolume changes.
pub const RESYNC: Duration = Duration::from_secs(300);

/// The digests a pod's (or template's) annotation pins; empty when none or unreadable.
pub fn template_digests(annotations: Option<&BTreeMap<String, String>>) -> Resolved {
    annotations
        .and_then(|a| a.get(TEMPLATE_DIGESTS))
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}

/// Follows tags in every namespace until the task is dropped.
pub async fn run(client: Client) {
    run_in(client, None).await
}

/// Follows tags until the task is dropped, in `namespaces` only when given (the operator's
/// `--watch-namespace`: an operator confined to some namespaces never rolls out workloads of
/// another). Failures are logged and tried again.
pub async fn run_in(client: Client, namespaces: Option<Vec<String>>) {
    let reporter = Reporter {
        controller: crate::context::MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let volumes = Api::<SealedVolume>::all(client.clone());
    let mut changes = watcher(volumes, watcher::Config::default())
        .default_backoff()
        .touched_objects()
        .boxed();
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        let scope: Vec<Option<String>> = tokio::select! {
            change = changes.try_next() => match change {
                Ok(Some(volume)) => {
                    let ns = volume.namespace();
                    let ours = match (&namespaces, &ns) {
                        (None, _) => true,
                        (Some(list), Some(ns)) => list.contains(ns),
                        (Some(_), None) => false,
                    };
                    if !ours {
                        continue;
                    }
                    vec![ns]
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "watching SealedVolumes to follow tags");
                    continue;
                }
            },
            _ = resync.tick() => match &namespaces {
                None => vec![None],
                Some(list) => list.iter().cloned().map(Some).collect(),
            },
        };
        for namespace in scope {
            if let Err(e) = follow(&client, &reporter, namespace.as_deref()).await {
                tracing::warn!(error = %e, "following tags");
            }
        }
    }
}

/// Brings every following workload of `namespace` (`None`: every namespace) up to date.
pub async fn follow(
    client: &Client,
    reporter: &Reporter,
    namespace: Option<&str>,
) -> Result<(), kube::Error> {
    follow_kind::<Deployment>(client, reporter, namespace, |d| {
        d.spec.as_ref().map(|s| &s.template)
    })
    .await?;
    follow_kind::<StatefulSet>(client, reporter, namespace, |s| {
        s.spec.as_ref().map(|s| &s.template)
    })
    .await
}

async fn follow_kind<K>(
    client: &Client,
    reporter: &Reporter,
    namespace: Option<&str>,
    template: impl Fn(&K) -> Option<&PodTemplateSpec>,
) -> Result<(), kube::Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    for workload in api.list(&ListParams::default()).await? {
        if workload
            .annotations()
            .get(FOLLOW_ANNOTATION)
            .map(String::as_str)
            != Some("true")
        {
            continue;
        }
        let Some(template) = template(&workload) else {
            continue;
        };
        let ns = workload.namespace().unwrap_or_default();
        let name = workload.name_any();
        let mut wanted = Resolved::new();
        let mut unresolved = None;
        for (volume, tag) in tags_named(template.spec.as_ref()) {
            match resolve_tag(client, &ns, &volume, &tag).await {
                Ok(d) => {
                    wanted.entry(volume).or_default().insert(tag, d);
                }
                Err(e) => unresolved = Some(e),
            }
        }
        if let Some(e) = unresolved {
            // Half a move is no move: the workload stays as it is until every tag resolves.
            tracing::warn!(workload = %format!("{ns}/{name}"), error = %e, "a followed tag does not resolve");
            continue;
        }
        let current = template_digests(
            template
                .metadata
                .as_ref()
                .and_then(|m| m.annotations.as_ref()),
        );
        if wanted == current {
            continue;
        }
        let text = serde_json::to_string(&wanted).unwrap_or_default();
        let patch = serde_json::json!({"spec": {"template": {"metadata": {"annotations": {TEMPLATE_DIGESTS: text}}}}});
        Api::<K>::namespaced(client.clone(), &ns)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let note = moves(&current, &wanted);
        tracing::info!(workload = %format!("{ns}/{name}"), %note, "following tags");
        let event = Event {
            type_: EventType::Normal,
            reason: "TagFollowed".into(),
            note: Some(note),
            action: "Rollout".into(),
            secondary: None,
        };
        // A recorder of its own for each move: one Recorder folds events of the same reason
        // and action into a series that keeps the first note, so the second move's "old ->
        // new" would never be shown.
        let recorder = Recorder::new(client.clone(), reporter.clone());
        if let Err(e) = recorder.publish(&event, &workload.object_ref(&())).await {
            tracing::warn!(error = %e, "cannot record event");
        }
    }
    Ok(())
}

/// "tag prod of llama: blake3:old -> blake3:new" for each tag that changed.
fn moves(old: &Resolved, new: &Resolved) -> String {
    let mut out = Vec::new();
    for (volume, tags) in new {
        for (tag, digest) in tags {
            let before = old.get(volume).and_then(|t| t.get(tag));
            if before != Some(digest) {
                out.push(format!(
                    "tag {tag} of {volume}: {} -> {digest}",
                    before.map(String::as_str).unwrap_or("(not followed yet)")
                ));
            }
        }
    }
    format!("{}; rolling out", out.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_names_old_and_new_digest() {
        let r = |d: &str| {
            Resolved::from([("llama".into(), BTreeMap::from([("prod".into(), d.into())]))])
        };
        assert_eq!(
            moves(&r("blake3:aa"), &r("blake3:bb")),
            "tag prod of llama: blake3:aa -> blake3:bb; rolling out"
        );
        assert!(
            moves(&Resolved::new(), &r("blake3:bb")).contains("(not followed yet) -> blake3:bb")
        );
    }
}
