//! The SealedVolumeVersion reconciler: describe the sealed manifest in status, link the
//! version to its volume, and on deletion move the manifest to the store's trash, where it
//! stays restorable (`sealed restore DIGEST`) for the volume's retention.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, Resource, ResourceExt};
use sealed_crds::validate::{
    DurationError, MAX_DURATION, MAX_DURATION_TEXT, parse_duration_checked,
};
use sealed_crds::{
    CONDITION_READY, CONDITION_VERIFIED, SealedVolume, SealedVolumeVersion, VOLUME_LABEL,
    new_condition, set_condition,
};
use sealed_store::trash::DEFAULT_RETENTION;
use sealed_store::{Digest, Error as StoreError};
use serde_json::json;

use crate::attestation::is_attested;
use crate::context::Context;
use crate::error::{Error, Result};

/// Held by every version until its manifest is in the trash.
pub const FINALIZER: &str = "sealedvolumes.io/trash";
/// Field manager of the fields this controller owns on a version's status.
const VERSION_MANAGER: &str = "sealed-operator-version";
/// The Ready reason of a version the operator did not make.
pub const NOT_ATTESTED: &str = "NotAttested";
/// The volume's `spec.retention.deletedVersions`, copied onto each of its versions by the
/// operator: a version deleted after its volume (the garbage collector deletes owned versions
/// once the volume is gone) is still kept for its own volume's retention.
pub const RETENTION_ANNOTATION: &str = "sealedvolumes.io/retention";

/// The annotations the operator gives a version it creates for `volume`: the volume's
/// retention ([`RETENTION_ANNOTATION`]) and, when `spec.warm.nodes` is set above 0 and
/// `warm_allowed` (the admin's policy, [`warming_allowed`]), the warm count
/// ([`sealed_crds::WARM_ANNOTATION`]) the node plugins warm it by. Stamped at creation only:
/// turning warming on later warms the versions sealed after, not every older one.
pub fn creation_annotations(
    volume: &SealedVolume,
    warm_allowed: bool,
) -> std::collections::BTreeMap<String, String> {
    let mut annotations = std::collections::BTreeMap::from([(
        RETENTION_ANNOTATION.to_string(),
        volume.spec.retention.deleted_versions.clone(),
    )]);
    if let Some(warm) = volume
        .spec
        .warm
        .as_ref()
        .filter(|w| w.nodes > 0 && warm_allowed)
    {
        annotations.insert(
            sealed_crds::WARM_ANNOTATION.to_string(),
            warm.nodes
                .min(sealed_crds::volume::MAX_WARM_NODES)
                .to_string(),
        );
    }
    annotations
}

/// Whether the admin's policy (`--warming`) lets `namespace` warm; why not otherwise.
pub async fn warming_allowed(ctx: &Context, namespace: &str) -> Result<(), String> {
    let policy = &ctx.config.warming;
    if !policy.needs_labels() {
        return policy.allows(namespace, None);
    }
    let labels = Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
        .get(namespace)
        .await
        .map_err(|e| format!("cannot read namespace {namespace}: {e}"))?
        .metadata
        .labels
        .unwrap_or_default();
    policy.allows(namespace, Some(&labels))
}

pub async fn reconcile(version: Arc<SealedVolumeVersion>, ctx: Arc<Context>) -> Result<Action> {
    let namespace = version.namespace().unwrap_or_default();
    if !ctx.config.watches(&namespace) {
        return Ok(Action::await_change());
    }
    let api: Api<SealedVolumeVersion> = Api::namespaced(ctx.client.clone(), &namespace);
    let result = finalizer(&api, FINALIZER, version, |event| async {
        match event {
            Finalizer::Apply(v) => apply(&v, &ctx).await,
            Finalizer::Cleanup(v) => cleanup(&v, &ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        // Our own errors stay themselves (error_policy tells a wait from a failure).
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer {
            object: format!("SealedVolumeVersion {namespace}"),
            message: other.to_string(),
        },
    });
    let outcome = if result.is_ok() { "ok" } else { "error" };
    ctx.metrics
        .reconciles
        .with_label_values(&["SealedVolumeVersion", outcome])
        .inc();
    result
}

pub fn error_policy(version: Arc<SealedVolumeVersion>, error: &Error, ctx: Arc<Context>) -> Action {
    if matches!(error, Error::InUse { .. }) {
        tracing::info!(version = %version.name_any(), %error, "waiting; looking again in 30s");
    } else {
        tracing::warn!(version = %version.name_any(), %error, "reconcile failed; retrying");
    }
    crate::guard::requeue_after(
        &ctx,
        &crate::guard::object_key(version.as_ref()),
        error,
        Duration::from_secs(30),
    )
}

/// The volume's `spec.retention.deletedVersions`, or the retention used instead and why: the
/// longest allowed ([`MAX_DURATION`]) for a value over it (what its writer wanted is "long"),
/// the default for one that is not a duration. Never a panic, whatever the API server let in.
fn retention_of(volume: &SealedVolume) -> std::result::Result<Duration, (Duration, String)> {
    parse_retention(
        &volume.spec.retention.deleted_versions,
        &format!(
            "spec.retention.deletedVersions of SealedVolume {}",
            volume.name_any()
        ),
    )
}

/// `value` (named `what` in the message) as a retention, as [`retention_of`].
fn parse_retention(value: &str, what: &str) -> std::result::Result<Duration, (Duration, String)> {
    let (used, kept) = match parse_duration_checked(value) {
        Ok(d) => return Ok(d),
        Err(DurationError::TooLong(_)) => {
            (MAX_DURATION, format!("the maximum, {MAX_DURATION_TEXT}"))
        }
        Err(DurationError::Malformed(_)) => (DEFAULT_RETENTION, "the default, 168h".to_owned()),
    };
    let shown: String = value.chars().take(64).collect();
    Err((
        used,
        format!(
            "{what} is {shown:?}, not a duration from 0 to {MAX_DURATION_TEXT} (100 years); the \
             version is kept for {kept}"
        ),
    ))
}

/// Where a deleted version's retention comes from: its volume while it exists (also while
/// it is being deleted), else the retention the operator copied onto the version
/// ([`RETENTION_ANNOTATION`]), else the default.
fn retention_for(
    version: &SealedVolumeVersion,
    volume: Option<&SealedVolume>,
) -> std::result::Result<Duration, (Duration, String)> {
    if let Some(volume) = volume {
        return retention_of(volume);
    }
    match version.annotations().get(RETENTION_ANNOTATION) {
        Some(value) => parse_retention(
            value,
            &format!(
                "annotation {RETENTION_ANNOTATION} of SealedVolumeVersion {}",
                version.name_any()
            ),
        ),
        None => Ok(DEFAULT_RETENTION),
    }
}

/// Whether `version` is owned, as controller, by the SealedVolume it names: what the operator
/// gives the versions it creates (syncs, imports, restores), and what the CSI plugin asks of
/// a version before it authorizes a mount.
pub fn operator_owned(version: &SealedVolumeVersion) -> bool {
    version.owner_references().iter().any(|o| {
        o.controller == Some(true) && o.kind == "SealedVolume" && o.name == version.spec.volume
    })
}

fn parse_digest(version: &SealedVolumeVersion) -> Result<Digest> {
    Digest::parse(&version.spec.digest).map_err(|e| Error::Invalid {
        object: format!("SealedVolumeVersion {}", version.name_any()),
        message: e.to_string(),
    })
}

async fn apply(version: &SealedVolumeVersion, ctx: &Context) -> Result<Action> {
    let namespace = version.namespace().unwrap_or_default();
    let api: Api<SealedVolumeVersion> = Api::namespaced(ctx.client.clone(), &namespace);
    link_to_volume(version, ctx, &api).await?;

    let digest = parse_digest(version)?;
    let generation = version.metadata.generation;
    let status = version.status.clone().unwrap_or_default();
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    if !is_attested(version, &ctx.attestation) && !reattest(version, ctx, &api, &digest).await? {
        return refuse_unattested(version, ctx, &api, &status, now).await;
    }
    let ready = status
        .condition(CONDITION_READY)
        .is_some_and(|c| c.status == "True");
    // A manifest another namespace's deletion raced into the trash comes back while this
    // volume still references it; a Ready version is looked at again now and then for that.
    let live = heal_if_missing(version, ctx, &digest).await?;
    if ready && live && status.observed_generation == generation {
        return Ok(Action::requeue(READY_RECHECK));
    }
    let mut conditions = status.conditions.clone();
    let (patch, requeue) = match ctx.store.get_manifest(&digest).await {
        Ok(manifest) => {
            let files = manifest
                .entries
                .iter()
                .filter(|e| matches!(e.kind, sealed_store::EntryKind::File(_)))
                .count();
            let checked = verify_version(version, ctx, &namespace, &manifest).await?;
            let verification = checked.as_ref().map(|c| &c.0);
            let (ready, reason, message) = match verification {
                None | Some(Ok(_)) => (true, "Sealed", "manifest sealed in the store".to_string()),
                Some(Err(why)) => (
                    false,
                    NOT_VERIFIED,
                    format!(
                        "manifest sealed in the store; its model signature does not verify: {why}"
                    ),
                ),
            };
            set_condition(
                &mut conditions,
                // Tenant-visible: "the store", never its URL.
                new_condition(
                    CONDITION_READY,
                    ready,
                    reason,
                    message,
                    generation,
                    now.clone(),
                ),
            );
            let mut verified_status = None;
            match verification {
                None => {}
                Some(Ok(v)) => {
                    set_condition(
                        &mut conditions,
                        new_condition(
                            CONDITION_VERIFIED,
                            true,
                            "Signed",
                            format!(
                                "signed by {}: {} files match their {} digests",
                                v.signer(),
                                v.checked.files,
                                v.checked.algorithm
                            ),
                            generation,
                            now.clone(),
                        ),
                    );
                    let path = checked.as_ref().map_or("", |c| c.1.as_str());
                    verified_status = Some(verification_status(v, path, &now));
                }
                Some(Err(why)) => {
                    let already = status
                        .condition(CONDITION_VERIFIED)
                        .is_some_and(|c| c.status == "False" && c.message == *why);
                    set_condition(
                        &mut conditions,
                        new_condition(
                            CONDITION_VERIFIED,
                            false,
                            VERIFICATION_FAILED,
                            why.clone(),
                            generation,
                            now.clone(),
                        ),
                    );
                    if !already {
                        ctx.event(
                            &version.object_ref(&()),
                            EventType::Warning,
                            VERIFICATION_FAILED,
                            "Verify",
                            why.clone(),
                        )
                        .await;
                    }
                }
            }
            let mut patch = json!({
                "apiVersion": sealed_crds::API_VERSION,
                "kind": "SealedVolumeVersion",
                "status": {
                    "conditions": conditions,
                    "observedGeneration": generation,
                    "sizeBytes": manifest.total_size(),
                    "size": crate::sync::human_bytes(manifest.total_size()),
                    "files": files,
                    "chunks": manifest.unique_chunks().len(),
                    "sealedAt": status.sealed_at.clone().unwrap_or(now),
                }
            });
            if let Some(v) = verified_status {
                patch["status"]["verification"] =
                    serde_json::to_value(v).map_err(|e| Error::Invalid {
                        object: format!("SealedVolumeVersion {}", version.name_any()),
                        message: format!("cannot encode the verification: {e}"),
                    })?;
            }
            if !ready {
                // The signers' keys may be fixed: looked at again, not every 30 s.
                api.patch_status(
                    &version.name_any(),
                    &PatchParams::apply(VERSION_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await?;
                return Ok(Action::requeue(NOT_VERIFIED_RECHECK));
            }
            (patch, Action::requeue(READY_RECHECK))
        }
        Err(StoreError::UnknownVersion { .. }) => {
            set_condition(
                &mut conditions,
                new_condition(
                    CONDITION_READY,
                    false,
                    "ManifestMissing",
                    format!(
                        "the store has no manifest {digest}: push the directory with `sealed push --volume {namespace}/{} DIR`, or bring a deleted version back with `sealed restore {digest}`",
                        version.spec.volume
                    ),
                    generation,
                    now,
                ),
            );
            let patch = json!({
                "apiVersion": sealed_crds::API_VERSION,
                "kind": "SealedVolumeVersion",
                "status": { "conditions": conditions, "observedGeneration": generation }
            });
            (patch, Action::requeue(Duration::from_secs(30)))
        }
        Err(e) => return Err(e.into()),
    };
    api.patch_status(
        &version.name_any(),
        &PatchParams::apply(VERSION_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(requeue)
}

/// The Ready reason of a version whose volume requires a signature that does not verify.
pub const NOT_VERIFIED: &str = "NotVerified";
/// The Verified reason (and Event reason) of a signature that does not verify.
pub const VERIFICATION_FAILED: &str = "VerificationFailed";
/// How often a version whose signature did not verify is checked again (its volume's keys
/// may be fixed in the meantime).
const NOT_VERIFIED_RECHECK: Duration = Duration::from_secs(300);

/// The volume's `spec.verify` checked against the version's manifest: None when the volume
/// asks for no verification (or is gone), else what the check found. Errors are the store's
/// or the API server's, retried.
async fn verify_version(
    version: &SealedVolumeVersion,
    ctx: &Context,
    namespace: &str,
    manifest: &sealed_store::manifest::Manifest,
) -> Result<
    Option<(
        std::result::Result<sealed_provenance::Verified, String>,
        String,
    )>,
> {
    let volumes: Api<SealedVolume> = Api::namespaced(ctx.client.clone(), namespace);
    let Some(volume) = volumes.get_opt(&version.spec.volume).await? else {
        return Ok(None);
    };
    let Some(spec) = &volume.spec.verify else {
        return Ok(None);
    };
    let path = spec.signature_path.clone();
    match crate::verify::check(ctx, namespace, spec, manifest).await {
        Ok(v) => Ok(Some((Ok(v), path))),
        Err(crate::verify::Failure::Refused(why)) => Ok(Some((Err(why), path))),
        Err(crate::verify::Failure::Retry(why)) => Err(Error::Invalid {
            object: format!("SealedVolumeVersion {namespace}/{}", version.name_any()),
            message: why,
        }),
    }
}

/// What goes into `status.verification`.
fn verification_status(
    v: &sealed_provenance::Verified,
    signature_path: &str,
    now: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> sealed_crds::Verification {
    sealed_crds::Verification {
        signer: v.signer(),
        mode: v.mode.into(),
        algorithm: v.checked.algorithm.clone(),
        signature_path: signature_path.to_string(),
        files: i64::try_from(v.checked.files).unwrap_or(i64::MAX),
        model: Some(v.checked.model_name.clone()).filter(|m| !m.is_empty()),
        verified_at: now.clone(),
    }
}

/// How often a Ready version's manifest is checked to still be live (one HEAD).
const READY_RECHECK: Duration = Duration::from_secs(300);

/// Whether the version's manifest is live, after putting it back from the trash when it is
/// not but this version's volume still references it (its store record holds): a deletion
/// elsewhere raced this volume's sync or push (docs/gc.md). A reclaimed trash is not live.
async fn heal_if_missing(
    version: &SealedVolumeVersion,
    ctx: &Context,
    digest: &Digest,
) -> Result<bool> {
    if ctx.store.has_manifest(digest).await? {
        return Ok(true);
    }
    let namespace = version.namespace().unwrap_or_default();
    let volume = format!("{namespace}/{}", version.spec.volume);
    match sealed_store::refs::heal_reference(&ctx.store, &volume, digest).await {
        Ok(true) => {
            ctx.event(
                &version.object_ref(&()),
                EventType::Warning,
                "ManifestRestored",
                "Heal",
                format!(
                    "{digest} was in the store's trash although {volume} still references it; \
                     put back"
                ),
            )
            .await;
            Ok(true)
        }
        Ok(false) | Err(StoreError::VersionReclaimed { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A version without a valid attestation is attested again when the store holds a record of
/// it for its volume whose proof holds (what every push and sync writes): so versions survive
/// a new attestation key. Returns whether it is attested now.
async fn reattest(
    version: &SealedVolumeVersion,
    ctx: &Context,
    api: &Api<SealedVolumeVersion>,
    digest: &Digest,
) -> Result<bool> {
    let namespace = version.namespace().unwrap_or_default();
    let volume = &version.spec.volume;
    let records = ctx
        .store
        .list_records_of_volume(&format!("{namespace}/{volume}"))
        .await?;
    let Some(record) = records.into_iter().find(|r| r.digest == *digest) else {
        return Ok(false);
    };
    if !ctx.store.verify_volume_record(&record).await? {
        return Ok(false);
    }
    crate::attestation::attest(
        api,
        &ctx.attestation,
        &namespace,
        &version.name_any(),
        volume,
        &version.spec.digest,
    )
    .await?;
    Ok(true)
}

/// `Ready=False/NotAttested` on a version the operator did not make: it authorizes no mount.
async fn refuse_unattested(
    version: &SealedVolumeVersion,
    ctx: &Context,
    api: &Api<SealedVolumeVersion>,
    status: &sealed_crds::SealedVolumeVersionStatus,
    now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> Result<Action> {
    let namespace = version.namespace().unwrap_or_default();
    let generation = version.metadata.generation;
    let already = status
        .condition(CONDITION_READY)
        .is_some_and(|c| c.reason == NOT_ATTESTED && c.observed_generation == generation);
    if already {
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    ctx.metrics.versions_unattested.inc();
    let message = format!(
        "not made by the operator: versions of {namespace}/{} come from its syncs or, for an \
         upload volume, from `sealed push --volume {namespace}/{} DIR`; a SealedVolumeVersion \
         made by hand authorizes no mount",
        version.spec.volume, version.spec.volume
    );
    let mut conditions = status.conditions.clone();
    set_condition(
        &mut conditions,
        new_condition(
            CONDITION_READY,
            false,
            NOT_ATTESTED,
            message.clone(),
            generation,
            now,
        ),
    );
    let patch = json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolumeVersion",
        "status": { "conditions": conditions, "observedGeneration": generation }
    });
    api.patch_status(
        &version.name_any(),
        &PatchParams::apply(VERSION_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    ctx.event(
        &version.object_ref(&()),
        EventType::Warning,
        NOT_ATTESTED,
        "Verify",
        message,
    )
    .await;
    // A record may still arrive (a push in flight): look again now and then.
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Labels the version with its volume and copies the volume's retention onto it. It adds no
/// ownerReference: a version someone applied (from Git, with Argo CD or Flux) stays theirs to
/// prune, and a GitOps tool leaves alone whatever has an owner. Such versions are deleted with
/// their volume by the volume's finalizer instead ([`crate::volume`]).
async fn link_to_volume(
    version: &SealedVolumeVersion,
    ctx: &Context,
    api: &Api<SealedVolumeVersion>,
) -> Result<()> {
    let labelled = version.labels().get(VOLUME_LABEL) == Some(&version.spec.volume);
    if labelled && version.annotations().contains_key(RETENTION_ANNOTATION) {
        return Ok(());
    }
    let namespace = version.namespace().unwrap_or_default();
    let volumes: Api<SealedVolume> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(volume) = volumes.get_opt(&version.spec.volume).await? else {
        return Ok(());
    };
    keep_retention(api, version, &volume).await
}

/// Sets the volume label and [`RETENTION_ANNOTATION`] of `version` to `volume`'s, unless they
/// are so already.
pub async fn keep_retention(
    api: &Api<SealedVolumeVersion>,
    version: &SealedVolumeVersion,
    volume: &SealedVolume,
) -> Result<()> {
    let retention = &volume.spec.retention.deleted_versions;
    let labelled = version.labels().get(VOLUME_LABEL) == Some(&version.spec.volume);
    if labelled && version.annotations().get(RETENTION_ANNOTATION) == Some(retention) {
        return Ok(());
    }
    let patch = json!({ "metadata": {
        "labels": { VOLUME_LABEL: version.spec.volume },
        "annotations": { RETENTION_ANNOTATION: retention },
    }});
    match api
        .patch(
            &version.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Gone in the meantime: nothing to keep.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn cleanup(version: &SealedVolumeVersion, ctx: &Context) -> Result<Action> {
    let digest = parse_digest(version)?;
    let namespace = version.namespace().unwrap_or_default();
    let volume_name = format!("{namespace}/{}", version.spec.volume);
    let reference = version.object_ref(&());
    if !is_attested(version, &ctx.attestation) && !operator_owned(version) {
        // Made by hand: it never authorized a mount and holds no reference of ours; let it
        // go without touching the store.
        return Ok(Action::await_change());
    }
    let volumes: Api<SealedVolume> = Api::namespaced(ctx.client.clone(), &namespace);
    let volume = volumes.get_opt(&version.spec.volume).await?;
    let retention = match retention_for(version, volume.as_ref()) {
        Ok(retention) => retention,
        Err((retention, problem)) => {
            // Only a CRD older than its bound (or a hand-edited annotation) admits such a
            // value: say what is used.
            ctx.event(
                &reference,
                EventType::Warning,
                "InvalidRetention",
                "Delete",
                problem,
            )
            .await;
            retention
        }
    };
    // The store's references decide (a sync or push of the same content in another
    // namespace wrote its record before its version exists); versions the API server shows
    // are one more guard for references older than records. Versions the operator owns but
    // has not attested yet count: it is attesting them.
    let others = other_versions(version, ctx).await?;
    if !others.is_empty() {
        match sealed_store::refs::release_reference(&ctx.store, &volume_name, &digest, retention)
            .await
        {
            Ok(_) | Err(StoreError::UnknownVersion { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        kept_event(ctx, &reference, &digest, &others.join(", ")).await;
        return Ok(Action::await_change());
    }
    // A version that running pods still mount keeps its chunks: wait for the nodes to let go.
    let nodes = crate::publications::nodes_publishing(ctx, &version.spec.digest).await?;
    if !nodes.is_empty() {
        ctx.metrics.trash_waits.inc();
        let message = format!(
            "{digest} is still mounted on node(s) {}; it moves to the trash when their pods are \
             gone",
            nodes.join(", ")
        );
        ctx.event(
            &reference,
            EventType::Normal,
            "WaitingForUnpublish",
            "Delete",
            message.clone(),
        )
        .await;
        return Err(Error::InUse {
            object: format!("SealedVolumeVersion {namespace}/{}", version.name_any()),
            message,
        });
    }
    match sealed_store::refs::remove_reference(&ctx.store, &volume_name, &digest, retention).await {
        Ok(report) => match report.trashed {
            Some(record) => {
                ctx.metrics.versions_trashed.inc();
                ctx.event(
                    &reference,
                    EventType::Normal,
                    "Trashed",
                    "Delete",
                    format!(
                        "{digest} moved to the trash; restorable until {} with `sealed restore {digest}`",
                        record.restorable_until
                    ),
                )
                .await;
            }
            None => {
                // Counted, not named: other namespaces' volumes are not this tenant's to see.
                let by = format!(
                    "{} other volume(s) that reference it in the store",
                    report.still_referenced_by.len()
                );
                kept_event(ctx, &reference, &digest, &by).await;
            }
        },
        // Nothing to keep: the manifest was never sealed, or is gone already.
        Err(StoreError::UnknownVersion { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Action::await_change())
}

/// The other undeleted versions of the same digest that keep it (attested, or owned by their
/// volume and so about to be), as `ns/name`.
async fn other_versions(version: &SealedVolumeVersion, ctx: &Context) -> Result<Vec<String>> {
    let all: Api<SealedVolumeVersion> = match ctx.config.single_watch_namespace() {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    Ok(all
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|v| {
            v.spec.digest == version.spec.digest
                && v.metadata.deletion_timestamp.is_none()
                && v.metadata.uid != version.metadata.uid
                // A version made by hand keeps nothing alive (it could pin anyone's data).
                && (is_attested(v, &ctx.attestation) || operator_owned(v))
        })
        .map(|v| format!("{}/{}", v.namespace().unwrap_or_default(), v.name_any()))
        .collect())
}

async fn kept_event(
    ctx: &Context,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    digest: &Digest,
    by: &str,
) {
    ctx.event(
        reference,
        EventType::Normal,
        "KeptInStore",
        "Delete",
        format!("{digest} stays in the store: still used by {by}"),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_crds::{Retention, SealedVolumeSpec, Source};

    fn volume(retention: &str) -> SealedVolume {
        SealedVolume::new(
            "llama",
            SealedVolumeSpec {
                source: Source::upload(),
                tags: Default::default(),
                retention: Retention {
                    deleted_versions: retention.into(),
                },
                shared: false,
                warm: None,
                verify: None,
            },
        )
    }

    #[test]
    fn new_versions_carry_the_warm_count_when_it_is_set() {
        let mut v = volume("72h");
        let plain = creation_annotations(&v, true);
        assert_eq!(
            plain.get(RETENTION_ANNOTATION).map(String::as_str),
            Some("72h")
        );
        assert!(!plain.contains_key(sealed_crds::WARM_ANNOTATION));
        v.spec.warm = Some(sealed_crds::Warm { nodes: 0 });
        assert!(!creation_annotations(&v, true).contains_key(sealed_crds::WARM_ANNOTATION));
        v.spec.warm = Some(sealed_crds::Warm { nodes: 3 });
        // Not allowed by the admin's policy: no warm count.
        assert!(!creation_annotations(&v, false).contains_key(sealed_crds::WARM_ANNOTATION));
        let warm = creation_annotations(&v, true);
        assert_eq!(
            sealed_crds::warm_nodes(&warm),
            Ok(Some(3)),
            "the plugins read back what the operator wrote"
        );
    }

    #[test]
    fn retention_out_of_range_is_named_and_never_panics() {
        let h = Duration::from_secs(3600);
        assert_eq!(retention_of(&volume("72h")), Ok(72 * h));
        assert_eq!(retention_of(&volume("876000h")), Ok(MAX_DURATION));
        // What once overflowed a timestamp: the longest allowed, and a message saying so.
        let (used, message) = retention_of(&volume("3000000000h")).unwrap_err();
        assert_eq!(used, MAX_DURATION);
        for part in [
            "spec.retention.deletedVersions",
            "llama",
            "\"3000000000h\"",
            "876000h",
            "kept for the maximum",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
        let (used, message) = retention_of(&volume("7d")).unwrap_err();
        assert_eq!(used, DEFAULT_RETENTION);
        assert!(message.contains("the default, 168h"), "{message}");
        // The store's bound is the same: the maximum is a retention it takes.
        assert_eq!(sealed_store::limits::MAX_DURATION, MAX_DURATION);
        let _ = retention_of(&volume(&"9".repeat(10_000)));
    }

    fn version(annotation: Option<&str>) -> SealedVolumeVersion {
        let mut v = SealedVolumeVersion::new(
            "llama-0123456789abcdef",
            sealed_crds::SealedVolumeVersionSpec {
                volume: "llama".into(),
                digest: sealed_store::Digest::of(b"v").to_string(),
            },
        );
        if let Some(a) = annotation {
            v.annotations_mut()
                .insert(RETENTION_ANNOTATION.into(), a.into());
        }
        v
    }

    #[test]
    fn a_version_deleted_after_its_volume_keeps_the_volumes_retention() {
        let h = Duration::from_secs(3600);
        // The live volume wins (it may have changed since the annotation was written).
        assert_eq!(
            retention_for(&version(Some("1h")), Some(&volume("72h"))),
            Ok(72 * h)
        );
        // The volume is gone: the retention copied onto the version.
        assert_eq!(retention_for(&version(Some("720h")), None), Ok(720 * h));
        assert_eq!(retention_for(&version(Some("0")), None), Ok(Duration::ZERO));
        // Neither: the default.
        assert_eq!(retention_for(&version(None), None), Ok(DEFAULT_RETENTION));
        // A hand-edited annotation is bounded and named like the volume's field.
        let (used, message) = retention_for(&version(Some("forever")), None).unwrap_err();
        assert_eq!(used, DEFAULT_RETENTION);
        assert!(
            message.contains(RETENTION_ANNOTATION) && message.contains("llama-0123456789abcdef"),
            "{message}"
        );
        let (used, _) = retention_for(&version(Some("3000000000h")), None).unwrap_err();
        assert_eq!(used, MAX_DURATION);
    }

    #[test]
    fn only_a_controller_reference_to_its_own_volume_is_the_operators() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let owner = |controller, name: &str| OwnerReference {
            api_version: sealed_crds::API_VERSION.into(),
            kind: "SealedVolume".into(),
            name: name.into(),
            uid: "u".into(),
            controller,
            block_owner_deletion: None,
        };
        let mut v = version(None);
        assert!(!operator_owned(&v), "applied by hand: no owner");
        v.metadata.owner_references = Some(vec![owner(Some(false), "llama")]);
        assert!(!operator_owned(&v));
        v.metadata.owner_references = Some(vec![owner(Some(true), "other")]);
        assert!(!operator_owned(&v));
        v.metadata.owner_references = Some(vec![owner(Some(true), "llama")]);
        assert!(operator_owned(&v));
    }
}
