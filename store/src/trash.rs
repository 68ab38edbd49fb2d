//! Deleting a version to the trash, and restoring it.
//!
//! ```text
//! <prefix>/trash/<64 hex>        the deleted manifest's bytes (still named by their BLAKE3)
//! <prefix>/trash/<64 hex>.json   {digest, deleted_at, restorable_until}
//! ```
//!
//! A trashed version keeps every chunk until it expires: the garbage collector marks the
//! chunks of every trash manifest it does not itself expire (docs/gc.md). Deleting and
//! restoring both hold a writer lease, so neither interleaves with a collection.

use std::time::Duration;

use chrono::{DateTime, Utc};
use object_store::PutPayload;
use object_store::path::Path as ObjectPath;

use crate::bounded::{
    MAX_LISTED_OBJECTS, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES, list_capped, read_capped,
};
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::lease::{WriterLease, write_json};
use crate::manifest::Manifest;
use crate::store::ChunkStore;

pub(crate) const TRASH_PREFIX: &str = "trash";

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
    /// False when the version was live already and nothing needed restoring.
    pub restored: bool,
    /// The trash record the version was restored from, if there was one.
    pub deleted_at: Option<DateTime<Utc>>,
    pub restorable_until: Option<DateTime<Utc>>,
}

pub(crate) fn trash_key(digest: &Digest) -> ObjectPath {
    ObjectPath::from(format!("{TRASH_PREFIX}/{}", digest.hex()))
}

pub(crate) fn trash_record_key(digest: &Digest) -> ObjectPath {
    ObjectPath::from(format!("{TRASH_PREFIX}/{}.json", digest.hex()))
}

/// Moves a version to the trash: it disappears from `ls`, mounts and pulls of it fail, and it
/// stays restorable (all its chunks kept) for `retention`. Deleting a version already in the
/// trash returns its existing record; an unknown digest is [`Error::UnknownVersion`].
pub async fn trash_version(
    store: &ChunkStore,
    digest: &Digest,
    retention: Duration,
) -> Result<TrashRecord> {
    // A retention that overflows the calendar is refused before anything is taken or moved.
    crate::limits::later(Utc::now(), retention, "retention")?;
    let lease = WriterLease::acquire(store, &format!("delete {digest}")).await?;
    let result = trash_leased(store, digest, retention).await;
    finish_lease(lease, result).await
}

async fn trash_leased(
    store: &ChunkStore,
    digest: &Digest,
    retention: Duration,
) -> Result<TrashRecord> {
    let bytes = match store.get_manifest_bytes(digest).await {
        Ok(b) => b,
        Err(Error::UnknownVersion { .. }) => {
            // Already trashed (idempotent), or never here.
            if let Some(record) = read_record(store, digest).await?
                && exists(store, &trash_key(digest)).await?
            {
                return Ok(record);
            }
            return Err(Error::UnknownVersion {
                digest: *digest,
                store: store.name().to_owned(),
            });
        }
        Err(e) => return Err(e),
    };
    let now = Utc::now();
    let record = TrashRecord {
        digest: *digest,
        deleted_at: now,
        restorable_until: crate::limits::later(now, retention, "retention")?,
    };
    // Copy first, record second, delete last: a crash leaves the version live, or live and
    // in the trash, never in neither.
    store
        .object_store()
        .put(&trash_key(digest), PutPayload::from(bytes))
        .await
        .map_err(|e| store.backend(e))?;
    write_json(store, &trash_record_key(digest), &record).await?;
    store.sync().await?;
    match store
        .object_store()
        .delete(&ChunkStore::manifest_key(digest))
        .await
    {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(store.backend(e)),
    }
    tracing::info!(%digest, restorable_until = %record.restorable_until, "version moved to trash");
    Ok(record)
}

/// Brings a trashed version back. A version that is live already is left alone
/// (`restored: false`); one whose trash the garbage collector has reclaimed is
/// [`Error::VersionReclaimed`].
pub async fn restore_version(store: &ChunkStore, digest: &Digest) -> Result<RestoreReport> {
    let lease = WriterLease::acquire(store, &format!("restore {digest}")).await?;
    let result = restore_leased(store, digest, &lease).await;
    finish_lease(lease, result).await
}

async fn restore_leased(
    store: &ChunkStore,
    digest: &Digest,
    lease: &WriterLease,
) -> Result<RestoreReport> {
    let record = read_record(store, digest).await?;
    let bytes = match store.object_store().get(&trash_key(digest)).await {
        Ok(r) => {
            let what = format!("the trashed manifest of {digest}");
            read_capped(store, r, &what, MAX_MANIFEST_BYTES).await?
        }
        Err(object_store::Error::NotFound { .. }) => {
            if store.has_manifest(digest).await? {
                return Ok(RestoreReport {
                    digest: *digest,
                    restored: false,
                    deleted_at: None,
                    restorable_until: None,
                });
            }
            return Err(Error::VersionReclaimed {
                digest: *digest,
                store: store.name().to_owned(),
            });
        }
        Err(e) => return Err(store.backend(e)),
    };
    let actual = Digest::of(&bytes);
    if actual != *digest {
        return Err(Error::CorruptRecord {
            store: store.name().to_owned(),
            what: format!("the trashed manifest of {digest}"),
            key: trash_key(digest).to_string(),
            reason: format!(
                "its bytes hash to {actual}; it cannot be restored (remove the object by hand)"
            ),
        });
    }
    Manifest::parse(&bytes)?;
    // While the lease holds no collection runs, so every chunk the trash kept is still there.
    lease.confirm().await?;
    store.put_manifest(bytes.to_vec()).await?;
    store.sync().await?;
    // Record first, bytes second: a crash in between leaves only an unlisted copy that keeps
    // chunks the live manifest needs anyway.
    delete_if_present(store, &trash_record_key(digest)).await?;
    delete_if_present(store, &trash_key(digest)).await?;
    tracing::info!(%digest, "version restored from trash");
    Ok(RestoreReport {
        digest: *digest,
        restored: true,
        deleted_at: record.as_ref().map(|r| r.deleted_at),
        restorable_until: record.as_ref().map(|r| r.restorable_until),
    })
}

/// Every trash record, newest deletion first. Records that do not parse are skipped with a
/// warning (the collector keeps their manifests).
pub async fn list_trash(store: &ChunkStore) -> Result<Vec<TrashRecord>> {
    let metas = list_capped(store, TRASH_PREFIX, MAX_LISTED_OBJECTS).await?;
    let mut out = Vec::new();
    for meta in metas {
        let Some(digest) = record_digest(&meta.location) else {
            continue;
        };
        if let Some(record) = read_record(store, &digest).await? {
            out.push(record);
        }
    }
    out.sort_by_key(|r| (std::cmp::Reverse(r.deleted_at), r.digest));
    Ok(out)
}

/// The digest a `trash/<hex>.json` key names.
pub(crate) fn record_digest(location: &ObjectPath) -> Option<Digest> {
    let hex = location.filename()?.strip_suffix(".json")?;
    Digest::parse(hex).ok()
}

/// The manifest bytes of a version in the trash, verified against `digest` and read within
/// the manifest bound; `None` when the trash has no manifest of it. For a reader that must
/// keep serving a version deleted under it (the node plugin resuming a held mount); a new
/// mount or pull of a trashed version is refused elsewhere.
pub async fn read_trashed_manifest(
    store: &ChunkStore,
    digest: &Digest,
) -> Result<Option<bytes::Bytes>> {
    let bytes = match store.object_store().get(&trash_key(digest)).await {
        Ok(r) => {
            let what = format!("the trashed manifest of {digest}");
            read_capped(store, r, &what, MAX_MANIFEST_BYTES).await?
        }
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(store.backend(e)),
    };
    let actual = Digest::of(&bytes);
    if actual != *digest {
        return Err(Error::ManifestDigestMismatch {
            digest: *digest,
            actual,
        });
    }
    Ok(Some(bytes))
}

/// The digest a `trash/<hex>` key names.
pub(crate) fn manifest_digest(location: &ObjectPath) -> Option<Digest> {
    Digest::parse(location.filename()?).ok()
}

/// The trash record of `digest`, if any. One that does not parse is skipped with a warning.
pub async fn read_record(store: &ChunkStore, digest: &Digest) -> Result<Option<TrashRecord>> {
    let key = trash_record_key(digest);
    let body = match store.object_store().get(&key).await {
        Ok(r) => read_capped(store, r, &format!("trash record {key}"), MAX_RECORD_BYTES).await?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(store.backend(e)),
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

async fn exists(store: &ChunkStore, key: &ObjectPath) -> Result<bool> {
    match store.object_store().head(key).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(store.backend(e)),
    }
}

pub(crate) async fn delete_if_present(store: &ChunkStore, key: &ObjectPath) -> Result<()> {
    match store.object_store().delete(key).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(store.backend(e)),
    }
}

/// Releases the lease after an operation: the operation's error wins over a release error.
pub(crate) async fn finish_lease<T>(lease: WriterLease, result: Result<T>) -> Result<T> {
    match lease.release().await {
        Ok(()) => result,
        Err(e) if result.is_err() => {
            tracing::warn!(error = %e, "cannot release writer lease; it will expire");
            result
        }
        Err(e) => Err(e),
    }
}
