//! The SealedVolume reconciler: start syncs when the source changes, record their outcome as
//! SealedVolumeVersions, pick up versions pushed with `sealed push --volume` (and restored
//! ones), and resolve tags.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};
use sealed_crds::{
    CONDITION_READY, CONDITION_SYNCED, Condition, SealedVolume, SealedVolumeStatus,
    SealedVolumeVersion, SealedVolumeVersionSpec, SourceKind, SyncProgress, TagStatus,
    VOLUME_LABEL, new_condition, set_condition,
};
use serde_json::json;

use crate::context::{Context, MANAGER};
use crate::error::{Error, Result};
use crate::sync::{
    CountersSnapshot, SyncFailure, SyncOutcome, SyncRequest, SyncState, credentials, human_bytes,
};

/// Field manager of the sync outcome fields the volume controller writes on a version.
const SYNC_MANAGER: &str = "sealed-operator-sync";
/// Held by a volume while it has versions someone applied (they have no ownerReference, so
/// the garbage collector would not delete them with the volume): on deletion it deletes
/// them, and each goes to the trash for the volume's retention.
pub const FINALIZER: &str = "sealedvolumes.io/versions";

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
        // Its versions go with it: the ones the operator made through their owner
        // references, the ones someone applied through the finalizer. A running sync is
        // pointless now.
        ctx.executor.forget(&namespace, &name);
        if volume.finalizers().iter().any(|f| f == FINALIZER) {
            delete_applied_versions(volume, ctx).await?;
            set_finalizer(volume, ctx, false).await?;
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

/// What the reconciler does about the sync the volume's trigger asks for, decided from the
/// status alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SyncStep {
    /// The sync of this trigger is recorded as finished.
    Done,
    /// The sync of this trigger was started (or waits for its Secret): ask the executor.
    Follow,
    /// No sync of this trigger is recorded: start one.
    Start,
}

fn next_step(sync: Option<&SyncProgress>, trigger: &str) -> SyncStep {
    match sync {
        Some(s) if s.trigger.as_deref() == Some(trigger) => {
            if s.finished_at.is_some() {
                SyncStep::Done
            } else {
                SyncStep::Follow
            }
        }
        _ => SyncStep::Start,
    }
}

/// Starts, follows and concludes the sync the volume's current trigger asks for. Returns
/// how soon to look again while it runs.
async fn drive_sync(
    volume: &SealedVolume,
    ctx: &Context,
    status: &mut SealedVolumeStatus,
) -> Result<Option<Duration>> {
    let request = SyncRequest {
        namespace: volume.namespace().unwrap_or_default(),
        name: volume.name_any(),
        source: volume.spec.source.clone(),
        trigger: volume.sync_trigger(),
        policy: ctx.config.source_policy.clone(),
    };
    let state = match next_step(status.sync.as_ref(), &request.trigger) {
        SyncStep::Done => return Ok(None),
        SyncStep::Follow => ctx.executor.state(&request).await?,
        SyncStep::Start => SyncState::Unknown,
    };
    match state {
        SyncState::Unknown => start_sync(volume, ctx, status, &request).await,
        SyncState::Running { job, progress } => {
            record_running(status, job, progress);
            Ok(Some(ctx.executor.poll_interval()))
        }
        SyncState::Finished { job, result } => {
            ctx.executor.forget(&request.namespace, &request.name);
            conclude_sync(volume, ctx, status, job, result).await?;
            Ok(None)
        }
    }
}

/// Checks the source and reads its credentials, then starts the sync; a sync that cannot
/// start yet waits (and is looked at again in 30 s).
async fn start_sync(
    volume: &SealedVolume,
    ctx: &Context,
    status: &mut SealedVolumeStatus,
    request: &SyncRequest,
) -> Result<Option<Duration>> {
    let generation = volume.metadata.generation;
    let reference = volume.object_ref(&());
    // The source policy first (a refused source starts no Job and reads no Secret), then
    // the credentials.
    let prepared = credentials::prepare(
        &ctx.client,
        &request.namespace,
        &volume.spec.source,
        &request.policy,
    );
    let credentials = match prepared.await {
        Ok(c) => c,
        Err(failure) => {
            if record_waiting(status, &request.trigger, &failure, generation) {
                ctx.event(
                    &reference,
                    EventType::Warning,
                    &failure.reason,
                    "Sync",
                    failure.message.clone(),
                )
                .await;
            }
            return Ok(Some(Duration::from_secs(30)));
        }
    };
    let job = ctx.executor.start(request, credentials).await?;
    let summary = volume.spec.source.summary();
    let restarted = record_started(status, &request.trigger, job.clone(), &summary, generation);
    if !restarted {
        ctx.metrics.syncs_started.inc();
        let place = match &job {
            Some(j) => format!(" in Job {}/{j}", ctx.config.namespace),
            None => String::new(),
        };
        ctx.event(
            &reference,
            EventType::Normal,
            "SyncStarted",
            "Sync",
            format!("syncing {summary}{place}"),
        )
        .await;
    }
    Ok(Some(ctx.executor.poll_interval()))
}

/// Records a finished sync: its version (on success), status, metrics and Event.
async fn conclude_sync(
    volume: &SealedVolume,
    ctx: &Context,
    status: &mut SealedVolumeStatus,
    job: Option<String>,
    result: std::result::Result<SyncOutcome, SyncFailure>,
) -> Result<()> {
    let generation = volume.metadata.generation;
    let reference = volume.object_ref(&());
    let summary = volume.spec.source.summary();
    record_finished(status, job, &result, &summary, generation);
    match result {
        Ok(outcome) => {
            let version = record_version(volume, ctx, &outcome).await?;
            ctx.metrics
                .syncs_finished
                .with_label_values(&["Succeeded"])
                .inc();
            ctx.metrics.sync_bytes_new.inc_by(outcome.bytes_new);
            ctx.metrics.sync_bytes_reused.inc_by(outcome.bytes_reused);
            ctx.event(
                &reference,
                EventType::Normal,
                "SyncSucceeded",
                "Sync",
                format!("{}; version {version}", synced_message(&summary, &outcome)),
            )
            .await;
        }
        Err(failure) => {
            ctx.metrics
                .syncs_finished
                .with_label_values(&[failure.reason.as_str()])
                .inc();
            ctx.event(
                &reference,
                EventType::Warning,
                "SyncFailed",
                "Sync",
                format!("{}: {}", failure.reason, failure.message),
            )
            .await;
        }
    }
    Ok(())
}

/// The sync of `trigger` cannot start (`failure`): it waits, neither started nor finished,
/// so a Secret created or labelled later, or an operator restarted with other flags, is
/// picked up by the next look without a hot loop, and `sealed sync` sees this trigger's
/// reason. Returns false when it already waited for the same reason (its Event is recorded
/// once per trigger and reason).
fn record_waiting(
    status: &mut SealedVolumeStatus,
    trigger: &str,
    failure: &SyncFailure,
    generation: Option<i64>,
) -> bool {
    let waiting = format!("waiting: {}", failure.reason);
    let repeated = status.sync.as_ref().is_some_and(|s| {
        s.trigger.as_deref() == Some(trigger) && s.progress.as_deref() == Some(waiting.as_str())
    });
    status.sync = Some(SyncProgress {
        trigger: Some(trigger.to_owned()),
        progress: Some(waiting),
        ..Default::default()
    });
    record_failure(status, failure, generation);
    !repeated
}

/// The sync of `trigger` started (in `job`, if it runs in one). Returns true when this
/// trigger's sync had started before (one lost to an operator restart): it keeps its start
/// time and is not counted again.
fn record_started(
    status: &mut SealedVolumeStatus,
    trigger: &str,
    job: Option<String>,
    summary: &str,
    generation: Option<i64>,
) -> bool {
    let before = status
        .sync
        .as_ref()
        .filter(|s| s.trigger.as_deref() == Some(trigger));
    let restarted = before.is_some_and(|s| s.started_at.is_some());
    let started_at = if restarted {
        before.and_then(|s| s.started_at.clone())
    } else {
        Some(now())
    };
    status.sync = Some(SyncProgress {
        trigger: Some(trigger.to_owned()),
        job,
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
            format!("syncing {summary}"),
            generation,
        ),
    );
    restarted
}

/// A running sync's Job and progress.
fn record_running(
    status: &mut SealedVolumeStatus,
    job: Option<String>,
    progress: Option<CountersSnapshot>,
) {
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
}

/// A finished sync's numbers and `Synced` condition.
fn record_finished(
    status: &mut SealedVolumeStatus,
    job: Option<String>,
    result: &std::result::Result<SyncOutcome, SyncFailure>,
    summary: &str,
    generation: Option<i64>,
) {
    let sync = status.sync.get_or_insert_with(Default::default);
    sync.job = job.or(sync.job.take());
    sync.finished_at = Some(now());
    match result {
        Ok(outcome) => {
            sync.revision = outcome_revision(outcome);
            sync.digest = Some(outcome.digest.to_string());
            sync.bytes_done = status_count(outcome.bytes);
            sync.bytes_total = status_count(outcome.bytes);
            sync.files_done = status_count(outcome.files);
            sync.files_total = status_count(outcome.files);
            sync.progress = Some(format!(
                "done: {} ({} new, {} reused)",
                human_bytes(outcome.bytes),
                human_bytes(outcome.bytes_new),
                human_bytes(outcome.bytes_reused)
            ));
            set_condition(
                &mut status.conditions,
                condition(
                    CONDITION_SYNCED,
                    true,
                    "Synced",
                    synced_message(summary, outcome),
                    generation,
                ),
            );
        }
        Err(failure) => {
            sync.progress = Some(format!("failed: {}", failure.reason));
            record_failure(status, failure, generation);
        }
    }
}

/// "sealed SOURCE as DIGEST (N uploaded, M reused)": the `Synced` message and the Event's.
fn synced_message(summary: &str, outcome: &SyncOutcome) -> String {
    format!(
        "sealed {summary} as {} ({} uploaded, {} reused)",
        outcome.digest,
        human_bytes(outcome.bytes_new),
        human_bytes(outcome.bytes_reused)
    )
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
    let warm_allowed = match volume.spec.warm.as_ref().filter(|w| w.nodes > 0) {
        None => false,
        Some(_) => {
            let namespace = volume.namespace().unwrap_or_default();
            match crate::version::warming_allowed(ctx, &namespace).await {
                Ok(()) => true,
                Err(why) => {
                    // Said on the volume, where spec.warm was written; the version is made
                    // without the warm count, and no node warms it.
                    ctx.event(
                        &volume.object_ref(&()),
                        EventType::Warning,
                        "WarmNotAllowed",
                        "Warm",
                        format!("version {name} ({digest}) is not warmed: {why}"),
                    )
                    .await;
                    false
                }
            }
        }
    };
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
        annotations: Some(crate::version::creation_annotations(volume, warm_allowed)),
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

/// The owner of the versions the operator creates: deleting the volume deletes them (which
/// moves them to the trash). It is a controller reference because the CSI plugin mounts only
/// versions controlled by their volume; such versions are not in Git, so no GitOps tool needs
/// to prune them. Versions someone applies get none ([`crate::version`]).
pub fn owner_reference(volume: &SealedVolume) -> Option<OwnerReference> {
    volume.controller_owner_ref(&())
}

/// Adds (`true`) or removes [`FINALIZER`] on the volume, unless it is so already. The
/// resourceVersion in the patch makes it conditional: a list changed meanwhile is a conflict,
/// and the change that made it brings the volume back for another look.
async fn set_finalizer(volume: &SealedVolume, ctx: &Context, on: bool) -> Result<()> {
    let held = volume.finalizers().iter().any(|f| f == FINALIZER);
    if held == on {
        return Ok(());
    }
    let mut finalizers: Vec<String> = volume
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    if on {
        finalizers.push(FINALIZER.to_owned());
    }
    let patch = json!({ "metadata": {
        "finalizers": finalizers,
        "resourceVersion": volume.resource_version(),
    }});
    let api: Api<SealedVolume> =
        Api::namespaced(ctx.client.clone(), &volume.namespace().unwrap_or_default());
    match api
        .patch(
            &volume.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Deletes the versions of a volume being deleted that the garbage collector would not (no
/// ownerReference: someone applied them), after copying the volume's retention onto them.
async fn delete_applied_versions(volume: &SealedVolume, ctx: &Context) -> Result<()> {
    let namespace = volume.namespace().unwrap_or_default();
    let name = volume.name_any();
    let versions: Api<SealedVolumeVersion> = Api::namespaced(ctx.client.clone(), &namespace);
    let applied = versions
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|v| {
            v.spec.volume == name
                && v.metadata.deletion_timestamp.is_none()
                && !crate::version::operator_owned(v)
        });
    for v in applied {
        crate::version::keep_retention(&versions, &v, volume).await?;
        match versions
            .delete(&v.name_any(), &kube::api::DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
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
                    EventType::Warning,
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
            EventType::Normal,
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
    // Every version carries the volume's retention (for a deletion after the volume's), and
    // the volume holds its finalizer while versions someone applied need it.
    for v in &mine {
        crate::version::keep_retention(&versions, v, volume).await?;
    }
    let applied = mine.iter().any(|v| !crate::version::operator_owned(v));
    set_finalizer(volume, ctx, applied).await?;
    mine.sort_by_key(|v| (sealed_at(v), v.name_any()));
    let latest = mine.last();
    status.latest_digest = latest.map(|v| v.spec.digest.clone());
    status.latest_short = latest.map(|v| sealed_crds::short_digest(&v.spec.digest));
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

    const T: &str = "generation=2,resync=";

    fn failure() -> SyncFailure {
        SyncFailure::new("SecretNotFound", "Secret ml/hf does not exist")
    }

    fn synced(status: &SealedVolumeStatus) -> &Condition {
        sealed_crds::find_condition(&status.conditions, CONDITION_SYNCED).expect("Synced")
    }

    fn outcome() -> SyncOutcome {
        SyncOutcome {
            digest: sealed_store::Digest::of(b"v"),
            source_revision: "0123abc".into(),
            files: 3,
            bytes: 3 << 30,
            chunks: 7,
            bytes_new: 1 << 30,
            bytes_reused: 2 << 30,
        }
    }

    #[test]
    fn the_step_follows_from_the_recorded_trigger() {
        assert_eq!(next_step(None, T), SyncStep::Start);
        let mut sync = SyncProgress {
            trigger: Some("generation=1,resync=".into()),
            finished_at: Some(now()),
            ..Default::default()
        };
        // A new trigger starts a sync, whatever the old one did.
        assert_eq!(next_step(Some(&sync), T), SyncStep::Start);
        sync.trigger = Some(T.into());
        assert_eq!(next_step(Some(&sync), T), SyncStep::Done);
        sync.finished_at = None;
        assert_eq!(next_step(Some(&sync), T), SyncStep::Follow);
    }

    #[test]
    fn a_waiting_sync_tells_once_per_reason() {
        let mut status = SealedVolumeStatus::default();
        assert!(record_waiting(&mut status, T, &failure(), Some(2)));
        let sync = status.sync.as_ref().unwrap();
        assert_eq!(sync.progress.as_deref(), Some("waiting: SecretNotFound"));
        assert!(sync.started_at.is_none() && sync.finished_at.is_none());
        assert_eq!(synced(&status).status, "False");
        assert_eq!(synced(&status).reason, "SecretNotFound");
        assert_eq!(synced(&status).observed_generation, Some(2));
        // The same reason again: no second Event; another reason or trigger: one more.
        assert!(!record_waiting(&mut status, T, &failure(), Some(2)));
        let other = SyncFailure::new("SecretNotOptedIn", "label it");
        assert!(record_waiting(&mut status, T, &other, Some(2)));
        assert!(record_waiting(
            &mut status,
            "generation=3,resync=",
            &other,
            Some(3)
        ));
    }

    #[test]
    fn a_restarted_sync_keeps_its_start() {
        let mut status = SealedVolumeStatus::default();
        assert!(!record_started(
            &mut status,
            T,
            Some("sync-a".into()),
            "hf://acme/llm",
            Some(2)
        ));
        let first = status.sync.clone().unwrap();
        assert_eq!(first.job.as_deref(), Some("sync-a"));
        assert_eq!(first.progress.as_deref(), Some("starting"));
        assert!(first.started_at.is_some());
        assert_eq!(synced(&status).reason, "Syncing");
        assert_eq!(synced(&status).message, "syncing hf://acme/llm");
        // The same trigger again (lost to a restart): the start time stays.
        let mut earlier = first.clone();
        earlier.started_at = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        status.sync = Some(earlier.clone());
        assert!(record_started(
            &mut status,
            T,
            None,
            "hf://acme/llm",
            Some(2)
        ));
        assert_eq!(status.sync.as_ref().unwrap().started_at, earlier.started_at);
        // After waiting for a Secret (never started): a new start.
        record_waiting(&mut status, T, &failure(), Some(2));
        assert!(!record_started(
            &mut status,
            T,
            None,
            "hf://acme/llm",
            Some(2)
        ));
        // A new trigger: a new start.
        status.sync = Some(earlier);
        assert!(!record_started(
            &mut status,
            "generation=3,resync=",
            None,
            "x",
            Some(3)
        ));
        assert_ne!(
            status.sync.as_ref().unwrap().started_at,
            Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
        );
    }

    #[test]
    fn a_running_sync_shows_its_progress() {
        let mut status = SealedVolumeStatus::default();
        record_started(&mut status, T, Some("sync-a".into()), "x", Some(2));
        record_running(&mut status, None, None);
        let sync = status.sync.as_ref().unwrap();
        assert_eq!(sync.job.as_deref(), Some("sync-a"), "the Job is kept");
        assert_eq!(sync.progress.as_deref(), Some("running"));
        let progress = CountersSnapshot {
            bytes_done: 3 << 30,
            bytes_total: 6 << 30,
            files_done: 4,
            files_total: 9,
        };
        record_running(&mut status, Some("sync-b".into()), Some(progress));
        let sync = status.sync.as_ref().unwrap();
        assert_eq!(sync.job.as_deref(), Some("sync-b"));
        assert_eq!((sync.bytes_done, sync.bytes_total), (3 << 30, 6 << 30));
        assert_eq!((sync.files_done, sync.files_total), (4, 9));
        assert_eq!(sync.progress.as_deref(), Some(progress.describe().as_str()));
    }

    #[test]
    fn a_finished_sync_records_its_outcome() {
        let mut status = SealedVolumeStatus::default();
        record_started(&mut status, T, None, "hf://acme/llm", Some(2));
        let outcome = outcome();
        record_finished(
            &mut status,
            Some("sync-a".into()),
            &Ok(outcome.clone()),
            "hf://acme/llm",
            Some(2),
        );
        let sync = status.sync.as_ref().unwrap();
        assert!(sync.finished_at.is_some());
        assert_eq!(sync.digest, Some(outcome.digest.to_string()));
        assert_eq!(sync.revision.as_deref(), Some("0123abc"));
        assert_eq!((sync.bytes_done, sync.bytes_total), (3 << 30, 3 << 30));
        assert_eq!((sync.files_done, sync.files_total), (3, 3));
        assert_eq!(
            sync.progress.as_deref(),
            Some("done: 3.0 GiB (1.0 GiB new, 2.0 GiB reused)")
        );
        let c = synced(&status);
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Synced"));
        assert_eq!(
            c.message,
            format!(
                "sealed hf://acme/llm as {} (1.0 GiB uploaded, 2.0 GiB reused)",
                outcome.digest
            )
        );

        let mut status = SealedVolumeStatus::default();
        record_finished(&mut status, None, &Err(failure()), "x", Some(2));
        assert_eq!(
            status.sync.as_ref().unwrap().progress.as_deref(),
            Some("failed: SecretNotFound")
        );
        assert_eq!(synced(&status).status, "False");
        assert_eq!(synced(&status).message, "Secret ml/hf does not exist");
        // An outcome without a revision (an older Job's) records none.
        let mut old = outcome;
        old.source_revision.clear();
        assert_eq!(outcome_revision(&old), None);
    }

    #[test]
    fn status_counts_never_go_negative() {
        assert_eq!(status_count(7), 7);
        assert_eq!(status_count(i64::MAX as u64), i64::MAX);
        assert_eq!(status_count(u64::MAX), i64::MAX);
    }
}
