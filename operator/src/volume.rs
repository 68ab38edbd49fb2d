//! The SealedVolume reconciler: start syncs when the source changes, record their outcome as
//! SealedVolumeVersions, pick up versions pushed with `sealed push --volume` (and restored
//! ones), and resolve tags.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use sealed_crds::{
    CONDITION_READY, CONDITION_SYNCED, Condition, SealedVolume, SealedVolumeStatus,
    SealedVolumeVersion, SealedVolumeVersionSpec, SourceKind, SyncProgress, TagStatus,
    VOLUME_LABEL, new_condition, set_condition,
};
use serde_json::json;

use crate::context::{Context, Executor, MANAGER};
use crate::error::{Error, Result};
use crate::sync::{SyncFailure, SyncOutcome, SyncRequest, SyncState, credentials};

/// Field manager of the sync outcome fields the volume controller writes on a version.
const SYNC_MANAGER: &str = "sealed-operator-sync";

pub async fn reconcile(volume: Arc<SealedVolume>, ctx: Arc<Context>) -> Result<Action> {
    if !ctx.config.watches(&volume.namespace().unwrap_or_default()) {
        return Ok(Action::await_change());
    }
    let result = reconcile_inner(&volume, &ctx).await;
    let outcome = if result.is_ok() { "ok" } else { "error" };
    ctx.metrics
        .reconciles
        .with_label_values(&["SealedVolume", outcome])
        .inc();
    result
}

pub fn error_policy(volume: Arc<SealedVolume>, error: &Error, ctx: Arc<Context>) -> Action {
    let action = crate::guard::requeue_after(
        &ctx,
        &crate::guard::object_key(volume.as_ref()),
        error,
        Duration::from_secs(30),
    );
    tracing::warn!(volume = %volume_key(&volume), %error, ?action, "reconcile failed; retrying");
    action
}

/// A count for `status.sync` (an int64 at least 0): past `i64::MAX` (a listing's claim, not
/// a real size) it stays `i64::MAX` rather than wrapping negative, which the schema refuses.
fn status_count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn volume_key(v: &SealedVolume) -> String {
    format!("{}/{}", v.namespace().unwrap_or_default(), v.name_any())
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// A condition as of now ([`new_condition`]).
fn condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) -> Condition {
    new_condition(type_, ok, reason, message, generation, now())
}

async fn reconcile_inner(volume: &SealedVolume, ctx: &Context) -> Result<Action> {
    let namespace = volume.namespace().unwrap_or_default();
    let name = volume.name_any();
    if volume.metadata.deletion_timestamp.is_some() {
        // Its versions go with it (owner references); a running sync is pointless now.
        if let Executor::Inline(inline) = &ctx.executor {
            inline.forget(&namespace, &name);
        }
        return Ok(Action::await_change());
    }
    let generation = volume.metadata.generation;
    let old = volume.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.source = Some(volume.spec.source.summary());
    status.observed_generation = generation;

    let problems = volume.spec.validate();
    if !problems.is_empty() {
        let message = problems
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join("; ");
        set_condition(
            &mut status.conditions,
            condition(CONDITION_READY, false, "InvalidSpec", &message, generation),
        );
        set_condition(
            &mut status.conditions,
            condition(CONDITION_SYNCED, false, "InvalidSpec", &message, generation),
        );
        write_status(ctx, volume, &old, &status).await?;
        return Ok(Action::await_change());
    }

    let mut requeue = ctx.config.upload_poll;
    match volume.spec.source.kind() {
        Ok(SourceKind::Upload(_)) => {
            set_condition(
                &mut status.conditions,
                condition(
                    CONDITION_SYNCED,
                    true,
                    "Upload",
                    format!("versions arrive from `sealed push --volume {namespace}/{name} DIR`"),
                    generation,
                ),
            );
        }
        Ok(_) => {
            if let Some(after) = drive_sync(volume, ctx, &mut status).await? {
                requeue = after;
            }
        }
        Err(e) => {
            return Err(Error::Invalid {
                object: volume_key(volume),
                message: e.to_string(),
            });
        }
    }

    import_store_records(volume, ctx).await?;
    resolve_versions(volume, ctx, &mut status).await?;
    write_status(ctx, volume, &old, &status).await?;
    Ok(Action::requeue(requeue))
}

/// Starts, follows and concludes the sync the volume's current trigger asks for. Returns
/// how soon to look again while it runs.
async fn drive_sync(
    volume: &SealedVolume,
    ctx: &Context,
    status: &mut SealedVolumeStatus,
) -> Result<Option<Duration>> {
    let namespace = volume.namespace().unwrap_or_default();
    let name = volume.name_any();
    let generation = volume.metadata.generation;
    let request = SyncRequest {
        namespace: namespace.clone(),
        name: name.clone(),
        source: volume.spec.source.clone(),
        trigger: volume.sync_trigger(),
        policy: ctx.config.source_policy.clone(),
    };
    let reference = volume.object_ref(&());
    let current = status.sync.as_ref().and_then(|s| s.trigger.clone());
    let poll = match ctx.executor {
        Executor::Inline(_) => Duration::from_secs(2),
        Executor::Job(_) => Duration::from_secs(15),
    };
    let finished = status
        .sync
        .as_ref()
        .is_some_and(|s| s.finished_at.is_some());
    if current.as_deref() == Some(request.trigger.as_str()) && finished {
        return Ok(None);
    }
    let state = if current.as_deref() == Some(request.trigger.as_str()) {
        match &ctx.executor {
            Executor::Inline(inline) => inline.state(&namespace, &name, &request.trigger),
            Executor::Job(jobs) => jobs.state(&request).await?,
        }
    } else {
        SyncState::Unknown
    };
    match state {
        SyncState::Unknown => {
            // The source policy first (a refused source starts no Job and reads no Secret),
            // then the credentials.
            let prepared = credentials::prepare(
                &ctx.client,
                &namespace,
                &volume.spec.source,
                &request.policy,
            );
            let credentials = match prepared.await {
                Ok(c) => c,
                Err(failure) => {
                    // The sync waits (not started, not finished): a Secret created or
                    // labelled later, or an operator restarted with other flags, is picked up
                    // by the next look, without a hot loop, and `sealed sync` sees this
                    // trigger's reason. The Event is recorded once per trigger and reason.
                    let waiting = format!("waiting: {}", failure.reason);
                    let repeated = status.sync.as_ref().is_some_and(|s| {
                        s.trigger.as_deref() == Some(request.trigger.as_str())
                            && s.progress.as_deref() == Some(waiting.as_str())
                    });
                    status.sync = Some(SyncProgress {
                        trigger: Some(request.trigger.clone()),
                        progress: Some(waiting),
                        ..Default::default()
                    });
                    record_failure(status, &failure, generation);
                    if !repeated {
                        ctx.event(
                            &reference,
                            true,
                            &failure.reason,
                            "Sync",
                            failure.message.clone(),
                        )
                        .await;
                    }
                    return Ok(Some(Duration::from_secs(30)));
                }
            };
            let job = match &ctx.executor {
                Executor::Inline(inline) => {
                    inline.start(request.clone(), credentials);
                    None
                }
                Executor::Job(jobs) => Some(jobs.start(&request, &credentials).await?),
            };
            // The same trigger again: a sync lost to a restart (or waiting for its Secret).
            let restarted = current.as_deref() == Some(request.trigger.as_str())
                && status.sync.as_ref().is_some_and(|s| s.started_at.is_some());
            let started_at = if restarted {
                status.sync.as_ref().and_then(|s| s.started_at.clone())
            } else {
                Some(now())
            };
            status.sync = Some(SyncProgress {
                trigger: Some(request.trigger.clone()),
                job: job.clone(),
                started_at,
                progress: Some("starting".into()),
                ..Default::default()
            });
            set_condition(
                &mut status.conditions,
                condition(
                    CONDITION_SYNCED,
                    false,
                    "Syncing",
                    format!("syncing {}", volume.spec.source.summary()),
                    generation,
                ),
            );
            if !restarted {
                ctx.metrics.syncs_started.inc();
                let place = match &job {
                    Some(j) => format!(" in Job {}/{j}", ctx.config.namespace),
                    None => String::new(),
                };
                ctx.event(
                    &reference,
                    false,
                    "SyncStarted",
                    "Sync",
                    format!("syncing {}{place}", volume.spec.source.summary()),
                )
                .await;
            }
            Ok(Some(poll))
        }
        SyncState::Running { job, progress } => {
            let sync = status.sync.get_or_insert_with(Default::default);
            sync.job = job.or(sync.job.take());
            if let Some(p) = progress {
                sync.bytes_done = status_count(p.bytes_done);
                sync.bytes_total = status_count(p.bytes_total);
                sync.files_done = status_count(p.files_done);
                sync.files_total = status_count(p.files_total);
                sync.progress = Some(p.describe());
            } else {
                sync.progress = Some("running".into());
            }
            Ok(Some(poll))
        }
        SyncState::Finished { job, result } => {
            if let Executor::Inline(inline) = &ctx.executor {
                inline.forget(&namespace, &name);
            }
            let sync = status.sync.get_or_insert_with(Default::default);
            sync.job = job.or(sync.job.take());
            sync.finished_at = Some(now());
            match result {
                Ok(outcome) => {
                    sync.revision = outcome_revision(&outcome);
                    sync.digest = Some(outcome.digest.to_string());
                    sync.bytes_done = status_count(outcome.bytes);
                    sync.bytes_total = status_count(outcome.bytes);
                    sync.files_done = status_count(outcome.files);
                    sync.files_total = status_count(outcome.files);
                    sync.progress = Some(format!(
                        "done: {} ({} new, {} reused)",
                        crate::sync::human_bytes(outcome.bytes),
                        crate::sync::human_bytes(outcome.bytes_new),
                        crate::sync::human_bytes(outcome.bytes_reused)
                    ));
                    let version = record_version(volume, ctx, &outcome).await?;
                    ctx.metrics
                        .syncs_finished
                        .with_label_values(&["Succeeded"])
                        .inc();
                    ctx.metrics.sync_bytes_new.inc_by(outcome.bytes_new);
                    ctx.metrics.sync_bytes_reused.inc_by(outcome.bytes_reused);
                    let message = format!(
                        "sealed {} as {} ({} uploaded, {} reused)",
                        volume.spec.source.summary(),
                        outcome.digest,
                        crate::sync::human_bytes(outcome.bytes_new),
                        crate::sync::human_bytes(outcome.bytes_reused)
                    );
                    set_condition(
                        &mut status.conditions,
                        condition(CONDITION_SYNCED, true, "Synced", &message, generation),
                    );
                    ctx.event(
                        &reference,
                        false,
                        "SyncSucceeded",
                        "Sync",
                        format!("{message}; version {version}"),
                    )
                    .await;
                }
                Err(failure) => {
                    sync.progress = Some(format!("failed: {}", failure.reason));
                    ctx.metrics
                        .syncs_finished
                        .with_label_values(&[failure.reason.as_str()])
                        .inc();
                    record_failure(status, &failure, generation);
                    ctx.event(
                        &reference,
                        true,
                        "SyncFailed",
                        "Sync",
                        format!("{}: {}", failure.reason, failure.message),
                    )
                    .await;
                }
            }
            Ok(None)
        }
    }
}

/// `Synced=False` with the failure's reason and message.
fn record_failure(status: &mut SealedVolumeStatus, failure: &SyncFailure, generation: Option<i64>) {
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_SYNCED,
            false,
            &failure.reason,
            &failure.message,
            generation,
        ),
    );
}

/// The source revision a sync sealed; none when the outcome carries none (an older Job's).
fn outcome_revision(outcome: &SyncOutcome) -> Option<String> {
    Some(outcome.source_revision.clone()).filter(|r| !r.is_empty())
}

/// Creates the SealedVolumeVersion of a finished sync (once) and records what the sync
/// uploaded on it. Returns its name.
async fn record_version(
    volume: &SealedVolume,
    ctx: &Context,
    outcome: &SyncOutcome,
) -> Result<String> {
    let namespace = volume.namespace().unwrap_or_default();
    let digest = outcome.digest.to_string();
    let name = SealedVolumeVersionSpec::object_name(&volume.name_any(), &digest);
    let versions: Api<SealedVolumeVersion> = Api::namespaced(ctx.client.clone(), &namespace);
    create_version(volume, ctx, &versions, &name, &digest).await?;
    let patch = json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolumeVersion",
        "status": {
            "bytesNew": outcome.bytes_new,
            "bytesReused": outcome.bytes_reused,
            "sourceRevision": outcome_revision(outcome),
        }
    });
    versions
        .patch_status(
            &name,
            &PatchParams::apply(SYNC_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
    Ok(name)
}

/// Creates a version of `volume` (labelled and owned by it; an existing one is fine) and
/// attests it: only versions the operator made this way authorize mounts.
async fn create_version(
    volume: &SealedVolume,
    ctx: &Context,
    versions: &Api<SealedVolumeVersion>,
    name: &str,
    digest: &str,
) -> Result<()> {
    let mut version = SealedVolumeVersion::new(
        name,
        SealedVolumeVersionSpec {
            volume: volume.name_any(),
            digest: digest.into(),
        },
    );
    version.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: volume.namespace(),
        labels: Some(BTreeMap::from([(
            VOLUME_LABEL.to_string(),
            volume.name_any(),
        )])),
        owner_references: owner_reference(volume).map(|o| vec![o]),
        ..Default::default()
    };
    match versions.create(&PostParams::default(), &version).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    let namespace = volume.namespace().unwrap_or_default();
    crate::attestation::attest(
        versions,
        &ctx.attestation,
        &namespace,
        name,
        &volume.name_any(),
        digest,
    )
    .await
}

/// Deleting a volume deletes its versions (which moves them to the trash).
pub fn owner_reference(volume: &SealedVolume) -> Option<OwnerReference> {
    volume.controller_owner_ref(&())
}

/// Versions recorded in the store for this volume (`sealed push --volume`, syncs, restores)
/// whose manifest is live get a SealedVolumeVersion. Only records whose proof holds count: the
/// writer had the manifest's bytes, not only its public digest (`ChunkStore::record_proof`),
/// so a tenant allowed to write records under its own namespace's prefix cannot claim another
/// namespace's version by naming its digest. A trashed manifest is not imported: deleting a
/// version sticks until it is restored (which is why synced volumes import too: a restored
/// version of a synced volume comes back by itself).
async fn import_store_records(volume: &SealedVolume, ctx: &Context) -> Result<()> {
    let namespace = volume.namespace().unwrap_or_default();
    let name = volume.name_any();
    let records = ctx
        .store
        .list_records_of_volume(&format!("{namespace}/{name}"))
        .await?;
    if records.is_empty() {
        return Ok(());
    }
    let versions: Api<SealedVolumeVersion> = Api::namespaced(ctx.client.clone(), &namespace);
    let existing: Vec<String> = versions
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|v| v.spec.volume == name && crate::attestation::is_attested(v, &ctx.attestation))
        .map(|v| v.spec.digest)
        .collect();
    for record in records {
        let digest_str = record.digest.to_string();
        if existing.contains(&digest_str) {
            continue;
        }
        if !ctx.store.verify_volume_record(&record).await? {
            // Either the manifest is not live (trashed, or never sealed) or the record's
            // proof does not hold. Only the second is worth telling anyone about.
            if ctx.store.has_manifest(&record.digest).await? {
                ctx.metrics.records_rejected.inc();
                ctx.event(
                    &volume.object_ref(&()),
                    true,
                    "RecordRejected",
                    "Import",
                    format!(
                        "a store record names {digest_str} for {namespace}/{name} without proof \
                         that its writer had the version's manifest; nothing was imported (push \
                         the directory with `sealed push --volume {namespace}/{name} DIR`)"
                    ),
                )
                .await;
            }
            continue;
        }
        let version = SealedVolumeVersionSpec::object_name(&name, &digest_str);
        create_version(volume, ctx, &versions, &version, &digest_str).await?;
        ctx.event(
            &volume.object_ref(&()),
            false,
            "VersionImported",
            "Import",
            format!("{digest_str} found in the store for {namespace}/{name}: created SealedVolumeVersion {version}"),
        )
        .await;
    }
    Ok(())
}

/// Latest version, tags and Ready.
async fn resolve_versions(
    volume: &SealedVolume,
    ctx: &Context,
    status: &mut SealedVolumeStatus,
) -> Result<()> {
    let namespace = volume.namespace().unwrap_or_default();
    let name = volume.name_any();
    let generation = volume.metadata.generation;
    let versions: Api<SealedVolumeVersion> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut mine: Vec<SealedVolumeVersion> = versions
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|v| v.spec.volume == name && v.metadata.deletion_timestamp.is_none())
        .collect();
    let sealed_at = |v: &SealedVolumeVersion| {
        v.status
            .as_ref()
            .and_then(|s| s.sealed_at.clone())
            .or_else(|| v.metadata.creation_timestamp.clone())
            .map(|t| t.0)
    };
    mine.sort_by_key(|v| (sealed_at(v), v.name_any()));
    let latest = mine.last();
    status.latest_digest = latest.map(|v| v.spec.digest.clone());
    status.latest_version = latest.map(|v| v.name_any());

    let mut unresolved = Vec::new();
    status.tags = volume
        .spec
        .tags
        .iter()
        .map(|(tag, digest)| {
            let version = mine
                .iter()
                .find(|v| &v.spec.digest == digest)
                .map(|v| v.name_any());
            if version.is_none() {
                unresolved.push(format!("{tag} -> {digest}"));
            }
            (
                tag.clone(),
                TagStatus {
                    digest: digest.clone(),
                    version,
                },
            )
        })
        .collect();
    let ready = if mine.is_empty() {
        condition(
            CONDITION_READY,
            false,
            "NoVersion",
            "no sealed version yet",
            generation,
        )
    } else if !unresolved.is_empty() {
        condition(
            CONDITION_READY,
            false,
            "TagUnresolved",
            format!(
                "these tags name no version of {namespace}/{name}, so mounting them by tag is refused: {}",
                unresolved.join(", ")
            ),
            generation,
        )
    } else {
        condition(
            CONDITION_READY,
            true,
            "Ready",
            format!("{} version(s); every tag resolves", mine.len()),
            generation,
        )
    };
    set_condition(&mut status.conditions, ready);
    Ok(())
}

async fn write_status(
    ctx: &Context,
    volume: &SealedVolume,
    old: &SealedVolumeStatus,
    new: &SealedVolumeStatus,
) -> Result<()> {
    if old == new && volume.status.is_some() {
        return Ok(());
    }
    let api: Api<SealedVolume> =
        Api::namespaced(ctx.client.clone(), &volume.namespace().unwrap_or_default());
    let patch = json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolume",
        "status": new,
    });
    api.patch_status(
        &volume.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_counts_never_go_negative() {
        assert_eq!(status_count(7), 7);
        assert_eq!(status_count(i64::MAX as u64), i64::MAX);
        assert_eq!(status_count(u64::MAX), i64::MAX);
    }
}
