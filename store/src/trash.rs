//! Deleting a version to the trash, and restoring it.
//!
//! ```text
//! <prefix>/trash/<64 hex>        the deleted manifest's bytes (still named by their BLAKE3)
//! <prefix>/trash/<64 hex>.json   {digest, deleted_at, restorable_until}
//! ```
//!
//! (keys from [`crate::layout`])
//!
//! A trashed version keeps every chunk until it expires: the garbage collector marks the
//! chunks of every trash manifest it does not itself expire (docs/gc.md). Deleting and
//! restoring both hold a writer lease, so neither interleaves with a collection.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::bounded::{MAX_LISTED_OBJECTS, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES, list_capped};
use crate::digest::{Digest, verify_digest};
use crate::error::{Error, Result};
use crate::layout::{self, Prefix, TrashKey, trash_manifest_key, trash_record_key};
use crate::manifest::Manifest;
use crate::store::ChunkStore;
use crate::writer_lease::{WriterLease, with_writer_lease};

/// Default time a deleted version stays restorable (7 days).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The `trash/<hex>.json` record of a deleted version.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TrashRecord {
    pub digest: Digest,
    pub deleted_at: DateTime<Utc>,
    pub restorable_until: DateTime<Utc>,
}

impl TrashRecord {
    pub fn expired_at(&self, now: DateTime<Utc>) -> bool {
        self.restorable_until < now
    }

    /// Past its retention: the next collection reclaims it.
    pub fn is_expired(&self) -> bool {
        self.expired_at(Utc::now())
    }
}

/// What [`restore_version`] did.
#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
pub struct RestoreReport {
    pub digest: Digest,
    /// Volumes whose removed references the restore brought back (their versions are
    /// listed, and imported by the operator, again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references_restored: Vec<String>,
    /// False when the version was live already and nothing needed restoring.
    pub restored: bool,
    /// The trash record the version was restored from, if there was one.
    pub deleted_at: Option<DateTime<Utc>>,
    pub restorable_until: Option<DateTime<Utc>>,
}

/// Moves a version to the trash: it disappears from `ls`, mounts and pulls of it fail, and it
/// stays restorable (all its chunks kept) for `retention`, or longer if a volume's removed
/// reference asked for longer. Every volume's reference to it is removed (an admin's `sealed
/// rm`; one volume's deletion is [`crate::refs::remove_reference`]). Deleting a version
/// already in the trash returns its existing record; an unknown digest is
/// [`Error::UnknownVersion`]; one that a push referenced again while it was being deleted
/// stays live and is [`Error::StillReferenced`].
pub async fn trash_version(
    store: &ChunkStore,
    digest: &Digest,
    retention: Duration,
) -> Result<TrashRecord> {
    let report = crate::refs::remove_all_references(store, digest, retention).await?;
    report.trashed.ok_or_else(|| Error::StillReferenced {
        digest: *digest,
        store: store.name().to_owned(),
        volumes: report.still_referenced_by.join(", "),
    })
}

/// Brings a trashed version back. A version that is live already is left alone
/// (`restored: false`); one whose trash the garbage collector has reclaimed is
/// [`Error::VersionReclaimed`].
pub async fn restore_version(store: &ChunkStore, digest: &Digest) -> Result<RestoreReport> {
    with_writer_lease(store, &format!("restore {digest}"), async |lease| {
        restore_leased(store, digest, lease).await
    })
    .await
}

async fn restore_leased(
    store: &ChunkStore,
    digest: &Digest,
    lease: &WriterLease,
) -> Result<RestoreReport> {
    let record = read_record(store, digest).await?;
    let Some(bytes) = read_trashed_bytes(store, digest).await? else {
        if store.has_manifest(digest).await? {
            return Ok(RestoreReport {
                digest: *digest,
                restored: false,
                references_restored: Vec::new(),
                deleted_at: None,
                restorable_until: None,
            });
        }
        return Err(Error::VersionReclaimed {
            digest: *digest,
            store: store.name().to_owned(),
        });
    };
    verify_digest(digest, &bytes).map_err(|actual| Error::CorruptRecord {
        store: store.name().to_owned(),
        what: format!("the trashed manifest of {digest}"),
        key: trash_manifest_key(digest).to_string(),
        reason: format!(
            "its bytes hash to {actual}; it cannot be restored (remove the object by hand)"
        ),
    })?;
    Manifest::parse(&bytes)?;
    // While the lease holds no collection runs, so every chunk the trash kept is still there.
    lease.confirm().await?;
    store.put_manifest(bytes.to_vec()).await?;
    store.sync().await?;
    // Record first, bytes second: a crash in between leaves only an unlisted copy that keeps
    // chunks the live manifest needs anyway.
    store.delete_if_exists(&trash_record_key(digest)).await?;
    store.delete_if_exists(&trash_manifest_key(digest)).await?;
    // The deletion is undone: references removed within their window are references again.
    let references_restored = crate::refs::revive_tombstones(store, digest, &bytes).await?;
    tracing::info!(%digest, references = ?references_restored, "version restored from trash");
    Ok(RestoreReport {
        digest: *digest,
        restored: true,
        references_restored,
        deleted_at: record.as_ref().map(|r| r.deleted_at),
        restorable_until: record.as_ref().map(|r| r.restorable_until),
    })
}

/// Every trash record, newest deletion first. Records that do not parse are skipped with a
/// warning (the collector keeps their manifests).
pub async fn list_trash(store: &ChunkStore) -> Result<Vec<TrashRecord>> {
    let metas = list_capped(store, &Prefix::Trash.path(), MAX_LISTED_OBJECTS).await?;
    let mut out = Vec::new();
    for meta in metas {
        let Some(TrashKey::Record(digest)) = layout::parse_trash_key(&meta.location) else {
            continue;
        };
        if let Some(record) = read_record(store, &digest).await? {
            out.push(record);
        }
    }
    out.sort_by_key(|r| (std::cmp::Reverse(r.deleted_at), r.digest));
    Ok(out)
}

/// The manifest bytes of a version in the trash, verified against `digest` and read within
/// the manifest bound; `None` when the trash has no manifest of it. For a reader that must
/// keep serving a version deleted under it (the node plugin resuming a held mount); a new
/// mount or pull of a trashed version is refused elsewhere.
pub async fn read_trashed_manifest(
    store: &ChunkStore,
    digest: &Digest,
) -> Result<Option<bytes::Bytes>> {
    let Some(bytes) = read_trashed_bytes(store, digest).await? else {
        return Ok(None);
    };
    verify_digest(digest, &bytes)
        .map_err(|actual| Error::ManifestDigestMismatch {
            digest: *digest,
            actual,
        })
        .map(|()| Some(bytes))
}

/// The bytes at `trash/<hex>` read within the manifest bound, not yet checked against
/// `digest` (each caller says in its own terms what a mismatch means); `None` when absent.
pub(crate) async fn read_trashed_bytes(
    store: &ChunkStore,
    digest: &Digest,
) -> Result<Option<bytes::Bytes>> {
    let what = format!("the trashed manifest of {digest}");
    store
        .read_optional(&trash_manifest_key(digest), &what, MAX_MANIFEST_BYTES)
        .await
}

/// The trash record of `digest`, if any. One that does not parse is skipped with a warning.
pub async fn read_record(store: &ChunkStore, digest: &Digest) -> Result<Option<TrashRecord>> {
    let key = trash_record_key(digest);
    let what = format!("trash record {key}");
    let Some(body) = store.read_optional(&key, &what, MAX_RECORD_BYTES).await? else {
        return Ok(None);
    };
    match serde_json::from_slice::<TrashRecord>(&body) {
        Ok(r) if r.digest == *digest => Ok(Some(r)),
        Ok(r) => {
            tracing::warn!(%key, named = %r.digest, "trash record names another digest; ignored");
            Ok(None)
        }
        Err(e) => {
            tracing::warn!(%key, error = %e, "unreadable trash record; ignored");
            Ok(None)
        }
    }
}
