//! References: which volumes keep a sealed version live, and how removing one works.
//! See the reference model and its interleavings in `docs/gc.md`.
//!
//! ```text
//! <prefix>/volumes/<ns>/<name>/<hex>   a reference: {volume, digest, pushed_at, proof}
//!                                      a removed one (a tombstone) adds {removed: {at, restorable_until}}
//! ```
//!
//! (keys from [`crate::layout`])
//!
//! Content addressing makes two namespaces that push or sync the same tree share one
//! manifest. A volume record whose proof holds ([`ChunkStore::record_proof`]) is that
//! volume's *reference* to the version. Removing a reference turns the record into a
//! tombstone (it is no longer a reference, is not imported again, and remembers the
//! retention asked for); the manifest goes to the trash only when no reference is left, kept
//! for the longest retention any removed reference asked for.
//!
//! Ordering against a concurrent new reference, without a lock: both sides *write, then
//! read*, as the writer leases do against the collector. A remover deletes `manifests/<hex>`
//! and then lists references again, putting the manifest back (it holds its bytes) if one
//! appeared; a writer writes its record and then checks `manifests/<hex>`, putting it back if
//! it is gone ([`keep_live`]). At least one of the two sees the other.

use std::time::Duration;

use chrono::{DateTime, Utc};
use object_store::PutPayload;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::layout::{self, trash_manifest_key, trash_record_key};
use crate::store::{ChunkStore, Removal, VolumeRecord, validate_volume_name};
use crate::trash::{TrashRecord, read_record, read_trashed_manifest};
use crate::writer_lease::{WriterLease, with_writer_lease};

/// What a removal did.
#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
pub struct RemoveReport {
    pub digest: String,
    /// References (volume names) this call removed.
    pub removed: Vec<String>,
    /// Volumes that still reference the version: it stays live for them.
    pub still_referenced_by: Vec<String>,
    /// The trash record when the version is in the trash after this call.
    pub trashed: Option<TrashRecord>,
}

/// Which references a removal takes.
#[derive(Clone, Copy)]
enum Which<'a> {
    /// One volume's (what deleting a SealedVolumeVersion does).
    One(&'a str),
    /// One volume's, never trashing the version.
    Release(&'a str),
    /// Every one (an admin's `sealed rm DIGEST`).
    All,
}

impl Which<'_> {
    fn covers(&self, volume: &str) -> bool {
        match self {
            Which::One(v) | Which::Release(v) => *v == volume,
            Which::All => true,
        }
    }

    fn volume(&self) -> Option<&str> {
        match self {
            Which::One(v) | Which::Release(v) => Some(v),
            Which::All => None,
        }
    }
}

/// Removes `volume`'s reference to `digest`, asking for `retention`. The version stays live
/// while another volume references it; removing the last reference moves it to the trash,
/// restorable for the longest retention any removed reference asked for. A digest the store
/// has neither live nor in the trash is [`Error::UnknownVersion`] (the volume's record, if
/// any, is deleted first).
pub async fn remove_reference(
    store: &ChunkStore,
    volume: &str,
    digest: &Digest,
    retention: Duration,
) -> Result<RemoveReport> {
    validate_volume_name(volume)?;
    let purpose = format!("delete {digest} from {volume}");
    remove_under_lease(store, digest, Which::One(volume), retention, &purpose).await
}

/// Removes `volume`'s reference to `digest` as [`remove_reference`] does (its retention is
/// remembered for the version's trash), but never trashes the version: for a caller that
/// knows of other users the store has no record of (versions older than records).
pub async fn release_reference(
    store: &ChunkStore,
    volume: &str,
    digest: &Digest,
    retention: Duration,
) -> Result<RemoveReport> {
    validate_volume_name(volume)?;
    let purpose = format!("release {digest} from {volume}");
    remove_under_lease(store, digest, Which::Release(volume), retention, &purpose).await
}

/// Removes every reference to `digest` and moves it to the trash (an admin's `sealed rm`);
/// the report names the references removed. A reference written concurrently (a push that
/// finished meanwhile) keeps it live: then `trashed` is `None`.
pub async fn remove_all_references(
    store: &ChunkStore,
    digest: &Digest,
    retention: Duration,
) -> Result<RemoveReport> {
    let purpose = format!("delete {digest}");
    remove_under_lease(store, digest, Which::All, retention, &purpose).await
}

/// Checks the retention before taking a writer lease (a bad value costs no lease), then
/// removes `which` references under it.
async fn remove_under_lease(
    store: &ChunkStore,
    digest: &Digest,
    which: Which<'_>,
    retention: Duration,
    purpose: &str,
) -> Result<RemoveReport> {
    crate::limits::later(Utc::now(), retention, "retention")?;
    with_writer_lease(store, purpose, async |lease| {
        remove_leased(store, digest, which, retention, lease).await
    })
    .await
}

async fn remove_leased(
    store: &ChunkStore,
    digest: &Digest,
    which: Which<'_>,
    retention: Duration,
    lease: &WriterLease,
) -> Result<RemoveReport> {
    let now = Utc::now();
    let until = crate::limits::later(now, retention, "retention")?;
    let live = match store.get_manifest_bytes(digest).await {
        Ok(bytes) => Some(bytes),
        Err(Error::UnknownVersion { .. }) => None,
        Err(e) => return Err(e),
    };
    // The bytes prove references (and put the manifest back if a new one races us).
    let bytes = match &live {
        Some(b) => b.clone(),
        None => match read_trashed_manifest(store, digest).await? {
            Some(b) => b,
            None => {
                // Nothing to keep; the volume's record names nothing now.
                if let Some(volume) = which.volume() {
                    store.delete_volume_record(volume, digest).await?;
                }
                return Err(Error::UnknownVersion {
                    digest: *digest,
                    store: store.name().to_owned(),
                });
            }
        },
    };

    // 1. Our tombstones first (writes) …
    let mut removed = Vec::new();
    let mut own_seen = false;
    for record in store.list_references(digest).await? {
        if !which.covers(&record.volume) {
            continue;
        }
        own_seen = true;
        if record.removed.is_none() && ChunkStore::proof_holds(&record, &bytes) {
            tombstone(store, record.clone(), &bytes, now, until).await?;
            removed.push(record.volume);
        }
    }
    if let Some(volume) = which.volume()
        && !own_seen
    {
        // No record (a version older than records): leave a tombstone so its retention
        // still counts.
        let record = VolumeRecord {
            volume: volume.to_owned(),
            digest: *digest,
            pushed_at: now,
            proof: Some(ChunkStore::record_proof(volume, &bytes)),
            removed: None,
        };
        tombstone(store, record, &bytes, now, until).await?;
        removed.push(volume.to_owned());
    }

    // 2. … the references left second (a read after our writes).
    let refs = References::read(store, digest, &bytes, now).await?;
    if !refs.live.is_empty() || matches!(which, Which::Release(_)) {
        tracing::info!(%digest, removed = ?removed, still = ?refs.live, "reference removed; version stays live");
        return Ok(RemoveReport {
            digest: digest.to_string(),
            removed,
            still_referenced_by: refs.live,
            trashed: None,
        });
    }
    let until = refs.longest.map_or(until, |l| l.max(until));

    // 3. The last reference is gone: to the trash, kept for the longest retention asked.
    let record = match live {
        Some(bytes) => {
            let record = TrashRecord {
                digest: *digest,
                deleted_at: now,
                restorable_until: until,
            };
            // Copy first, record second, delete last: a crash leaves the version live, or
            // live and in the trash, never in neither.
            store
                .raw()
                .put(&trash_manifest_key(digest), PutPayload::from(bytes))
                .await
                .map_err(|e| store.backend(e))?;
            store.write_json(&trash_record_key(digest), &record).await?;
            store.sync().await?;
            store
                .delete_if_exists(&layout::manifest_key(digest))
                .await?;
            tracing::info!(%digest, restorable_until = %record.restorable_until, "version moved to trash");
            record
        }
        None => {
            // In the trash already: a removal never shortens its window, and only one that
            // removed a reference may lengthen it (a repeated `rm` is a no-op).
            let existing = read_record(store, digest).await?;
            match existing {
                Some(r) if removed.is_empty() || r.restorable_until >= until => r,
                other => {
                    let record = TrashRecord {
                        digest: *digest,
                        deleted_at: other.map_or(now, |r| r.deleted_at),
                        restorable_until: until,
                    };
                    store.write_json(&trash_record_key(digest), &record).await?;
                    record
                }
            }
        }
    };

    // 4. Read again after the delete: a reference written after step 2 is seen here, or its
    //    writer sees the manifest gone and puts it back itself (`keep_live`).
    let late = References::read(store, digest, &bytes, now).await?;
    if !late.live.is_empty() {
        lease.confirm().await?;
        store.put_manifest(bytes.to_vec()).await?;
        untrash(store, digest).await?;
        tracing::info!(%digest, by = ?late.live, "a new reference arrived during the deletion; version kept live");
        return Ok(RemoveReport {
            digest: digest.to_string(),
            removed,
            still_referenced_by: late.live,
            trashed: None,
        });
    }
    Ok(RemoveReport {
        digest: digest.to_string(),
        removed,
        still_referenced_by: Vec::new(),
        trashed: Some(record),
    })
}

/// Writes `record` as a tombstone: no longer a reference, restorable until `until`.
async fn tombstone(
    store: &ChunkStore,
    mut record: VolumeRecord,
    bytes: &[u8],
    now: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<()> {
    record.proof = Some(ChunkStore::record_proof(&record.volume, bytes));
    record.removed = Some(Removal {
        at: now,
        restorable_until: until,
    });
    store.write_volume_record(&record).await
}

/// The references of a digest as read at one moment.
struct References {
    /// Volumes holding a reference whose proof holds.
    live: Vec<String>,
    /// The latest `restorable_until` of a tombstone still within its window.
    longest: Option<DateTime<Utc>>,
}

impl References {
    async fn read(
        store: &ChunkStore,
        digest: &Digest,
        bytes: &[u8],
        now: DateTime<Utc>,
    ) -> Result<References> {
        let mut live = Vec::new();
        let mut longest: Option<DateTime<Utc>> = None;
        for record in store.list_references(digest).await? {
            // A record without a valid proof was not written by a holder of the manifest: it
            // keeps nothing alive (it could pin anyone's data).
            if !ChunkStore::proof_holds(&record, bytes) {
                continue;
            }
            match &record.removed {
                None => live.push(record.volume),
                Some(r) if r.restorable_until >= now => {
                    longest =
                        Some(longest.map_or(r.restorable_until, |l| l.max(r.restorable_until)));
                }
                Some(_) => {}
            }
        }
        live.sort();
        live.dedup();
        Ok(References { live, longest })
    }
}

/// Called by a writer right after it wrote its volume record for the manifest `bytes`: if a
/// deletion raced it and moved the manifest to the trash, the manifest goes back (the
/// writer's lease kept every chunk) and the trash entry goes. See `docs/gc.md`.
pub(crate) async fn keep_live(store: &ChunkStore, bytes: &[u8], lease: &WriterLease) -> Result<()> {
    let digest = Digest::of(bytes);
    if store.has_manifest(&digest).await? {
        return Ok(());
    }
    lease.confirm().await?;
    store.put_manifest(bytes.to_vec()).await?;
    untrash(store, &digest).await?;
    tracing::info!(%digest, "a deletion raced this push; version put back from the trash");
    Ok(())
}

/// Removes the trash entry of a version that is live again (record first, copy second, as
/// `restore` does). Only after the manifest is back: a remover that deleted the manifest
/// meanwhile reads the references after its delete and puts it back itself.
async fn untrash(store: &ChunkStore, digest: &Digest) -> Result<()> {
    store.sync().await?;
    store.delete_if_exists(&trash_record_key(digest)).await?;
    store.delete_if_exists(&trash_manifest_key(digest)).await
}

/// Puts back the manifest of a version `volume` still references (its record holds and is
/// not a tombstone) from the trash: what the operator does for a Ready version whose manifest
/// is gone. Returns whether it put it back; `false` when the version is live already or the
/// volume holds no reference. A reclaimed trash is [`Error::VersionReclaimed`].
pub async fn heal_reference(store: &ChunkStore, volume: &str, digest: &Digest) -> Result<bool> {
    validate_volume_name(volume)?;
    with_writer_lease(
        store,
        &format!("heal {digest} for {volume}"),
        async |lease| {
            if store.has_manifest(digest).await? {
                return Ok(false);
            }
            let Some(bytes) = read_trashed_manifest(store, digest).await? else {
                return Err(Error::VersionReclaimed {
                    digest: *digest,
                    store: store.name().to_owned(),
                });
            };
            let holds = store.list_references(digest).await?.into_iter().any(|r| {
                r.volume == volume && r.removed.is_none() && ChunkStore::proof_holds(&r, &bytes)
            });
            if !holds {
                return Ok(false);
            }
            crate::manifest::Manifest::parse(&bytes)?;
            keep_live(store, &bytes, lease).await?;
            Ok(true)
        },
    )
    .await
}

/// Turns the tombstones of `digest` still within their window back into references: what
/// an admin's `sealed restore` undoes. Returns the volumes revived.
pub(crate) async fn revive_tombstones(
    store: &ChunkStore,
    digest: &Digest,
    bytes: &[u8],
) -> Result<Vec<String>> {
    let now = Utc::now();
    let mut revived = Vec::new();
    for mut record in store.list_references(digest).await? {
        let within = record
            .removed
            .as_ref()
            .is_some_and(|r| r.restorable_until >= now);
        if within && ChunkStore::proof_holds(&record, bytes) {
            record.removed = None;
            store.write_volume_record(&record).await?;
            revived.push(record.volume);
        }
    }
    Ok(revived)
}
