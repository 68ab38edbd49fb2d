//! The collector's marker `gc/running`: while it is live no writer starts choosing which
//! chunks to reuse, and the collector deletes only while it knows the marker is live. Reading
//! it (writers, `sealed gc`), taking it (conditional create, or taking over an expired one),
//! fencing deletes on it and removing it all live here; the argument is in `docs/gc.md`.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use object_store::path::Path as ObjectPath;
use object_store::{PutMode, PutOptions, PutPayload, UpdateVersion};

use crate::bounded::MAX_RECORD_BYTES;
use crate::clock::{StoreClock, judged_expiry, store_expiry};
use crate::error::{Error, Result};
use crate::identity::{hostname, random_id};
use crate::keepalive::{Keepalive, Renewable};
use crate::layout::gc_marker_key;
use crate::store::ChunkStore;

/// The collector's marker body (`gc/running`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct GcMarker {
    pub id: String,
    pub host: String,
    pub pid: u32,
    pub started_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// The marker's lifetime after each write; expiry is judged by the store's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
}

impl Renewable for GcMarker {
    fn renew(&mut self, expires_at: DateTime<Utc>) {
        self.expires_at = expires_at;
    }
}

/// The collector's marker, if one is present (expired or not), its expiry judged by the
/// store's clock.
pub async fn read_gc_marker(store: &ChunkStore) -> Result<Option<GcMarker>> {
    let Some(got) = store.get_optional(&gc_marker_key()).await? else {
        return Ok(None);
    };
    let last_modified = got.meta.last_modified;
    let what = "the gc/running marker";
    let body = crate::bounded::read_capped(store, got, what, MAX_RECORD_BYTES).await?;
    Ok(Some(marker_from_body(&body, last_modified)))
}

/// The marker a body says, its expiry by the store's clock (as for leases; a marker of an
/// older collector, without its TTL, keeps the expiry it wrote). An unreadable marker still
/// means "a collector is running": keep out of its way until it would have expired.
fn marker_from_body(body: &[u8], last_modified: DateTime<Utc>) -> GcMarker {
    let mut marker = serde_json::from_slice::<GcMarker>(body).unwrap_or_else(|_| GcMarker {
        id: String::new(),
        host: "<unreadable marker>".into(),
        pid: 0,
        started_at: last_modified,
        expires_at: store_expiry(last_modified, None),
        ttl_secs: None,
    });
    marker.expires_at = judged_expiry(marker.expires_at, last_modified, marker.ttl_secs);
    marker
}

/// The `gc/running` marker this collection holds, renewed until [`HeldMarker::remove`].
pub(crate) struct HeldMarker {
    store: ChunkStore,
    record: GcMarker,
    keepalive: Keepalive,
    ttl: Duration,
}

impl HeldMarker {
    /// Takes the marker: created if absent, taken over if expired (by `clock`),
    /// [`Error::GcBusy`] if another collection holds it.
    pub(crate) async fn take(
        store: &ChunkStore,
        clock: &StoreClock,
        ttl: Duration,
    ) -> Result<HeldMarker> {
        let ttl = ttl.max(Duration::from_millis(300));
        let key = gc_marker_key();
        let id = random_id();
        let host = hostname();
        let pid = std::process::id();
        for _ in 0..3 {
            let written_at = Instant::now();
            let now = Utc::now();
            let record = GcMarker {
                id: id.clone(),
                host: host.clone(),
                pid,
                started_at: now,
                expires_at: crate::limits::later(now, ttl, "garbage-collection marker TTL")?,
                ttl_secs: Some(ttl.as_secs().max(1)),
            };
            let body =
                serde_json::to_vec(&record).map_err(|e| Error::Other(format!("{key}: {e}")))?;
            let create = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            let taken = match store
                .raw()
                .put_opts(&key, PutPayload::from(body.clone()), create)
                .await
            {
                Ok(put) => Some(put.e_tag),
                Err(object_store::Error::AlreadyExists { .. }) => {
                    take_over(store, clock, &key, &body).await?
                }
                // No conditional create on this server: check, then write.
                Err(object_store::Error::NotImplemented) => {
                    ensure_not_live(store, clock).await?;
                    let put = store
                        .raw()
                        .put(&key, PutPayload::from(body))
                        .await
                        .map_err(|e| store.backend(e))?;
                    Some(put.e_tag)
                }
                Err(e) => return Err(store.backend(e)),
            };
            if let Some(etag) = taken {
                let keepalive = Keepalive::start(store, key, record.clone(), ttl, written_at, etag);
                tracing::info!(marker = %id, "garbage collection started");
                return Ok(HeldMarker {
                    store: store.clone(),
                    record,
                    keepalive,
                    ttl,
                });
            }
        }
        Err(Error::Other(format!(
            "store {}: could not take the garbage-collection marker {key} after 3 \
             attempts (another collection keeps starting?); try again",
            store.name()
        )))
    }

    /// Ok while the marker is known to stay unexpired for longer than one batch of store
    /// requests can take (the store's request bound, at most a quarter of the TTL): only
    /// then may anything be deleted, so no delete lands after a writer could see the marker
    /// expired and start reusing chunks.
    pub(crate) fn fence(&self, what: &str) -> Result<()> {
        let margin = self.store.request_bound().min(self.ttl / 4);
        if self.keepalive.is_live_for(margin) {
            return Ok(());
        }
        Err(Error::GcMarkerLapsed {
            store: self.store.name().to_owned(),
            what: what.to_owned(),
        })
    }

    /// Stops renewal and deletes the marker if it is still ours.
    pub(crate) async fn remove(&mut self) -> Result<()> {
        self.keepalive.stop().await;
        match read_gc_marker(&self.store).await? {
            Some(m) if m.id == self.record.id => {
                self.store.delete_if_exists(&gc_marker_key()).await
            }
            _ => {
                tracing::warn!("the gc/running marker is no longer ours; leaving it");
                Ok(())
            }
        }
    }
}

/// [`Error::GcBusy`] when a marker is present and live by `clock`.
async fn ensure_not_live(store: &ChunkStore, clock: &StoreClock) -> Result<()> {
    match read_gc_marker(store).await? {
        Some(existing) if existing.expires_at > clock.now() => Err(busy(store, existing)),
        _ => Ok(()),
    }
}

/// The marker exists: busy if it is live, else replace it. `Some(etag)` when ours now;
/// `None` to retry the create.
async fn take_over(
    store: &ChunkStore,
    clock: &StoreClock,
    key: &ObjectPath,
    body: &[u8],
) -> Result<Option<Option<String>>> {
    let Some(meta) = store.head_optional(key).await? else {
        return Ok(None);
    };
    // Its expiry by the store's clock (read_gc_marker judges it so).
    let Some(existing) = read_gc_marker(store).await? else {
        return Ok(None);
    };
    if existing.expires_at > clock.now() {
        return Err(busy(store, existing));
    }
    tracing::warn!(
        host = %existing.host,
        pid = existing.pid,
        "taking over the expired marker of a garbage collection that did not finish"
    );
    let update = PutOptions {
        mode: PutMode::Update(UpdateVersion {
            e_tag: meta.e_tag.clone(),
            version: meta.version.clone(),
        }),
        ..Default::default()
    };
    match store
        .raw()
        .put_opts(key, PutPayload::from(body.to_vec()), update)
        .await
    {
        Ok(put) => Ok(Some(put.e_tag)),
        // Someone else replaced it first.
        Err(object_store::Error::Precondition { .. }) => match read_gc_marker(store).await? {
            Some(m) => Err(busy(store, m)),
            None => Ok(None),
        },
        // No conditional update (a local directory): delete it if it is still the stale
        // one, then create again (conditionally, so of two collections doing this at
        // once only one wins).
        Err(object_store::Error::NotImplemented) => {
            if let Some(now) = store.head_optional(key).await?
                && now.e_tag == meta.e_tag
                && now.last_modified == meta.last_modified
            {
                store.delete_if_exists(key).await?;
            }
            Ok(None)
        }
        Err(e) => Err(store.backend(e)),
    }
}

fn busy(store: &ChunkStore, m: GcMarker) -> Error {
    Error::GcBusy {
        store: store.name().to_owned(),
        host: m.host,
        pid: m.pid,
        started_at: m.started_at.to_rfc3339(),
        expires_at: m.expires_at.to_rfc3339(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_marker_is_live_for_the_default_ttl_after_its_write() {
        let modified = DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::seconds(50);
        let marker = marker_from_body(b"not json", modified);
        assert_eq!(marker.host, "<unreadable marker>");
        assert_eq!(marker.started_at, modified);
        assert_eq!(marker.expires_at, store_expiry(modified, None));
    }

    #[test]
    fn a_marker_expires_by_the_store_clock_when_it_declares_its_ttl() {
        let written = DateTime::<Utc>::UNIX_EPOCH;
        let modified = written + chrono::Duration::seconds(1000);
        let mut marker = GcMarker {
            id: "x".into(),
            host: "h".into(),
            pid: 1,
            started_at: written,
            expires_at: written + chrono::Duration::seconds(5),
            ttl_secs: Some(30),
        };
        let body = serde_json::to_vec(&marker).unwrap();
        let read = marker_from_body(&body, modified);
        assert_eq!(read.expires_at, modified + chrono::Duration::seconds(30));
        marker.ttl_secs = None;
        let body = serde_json::to_vec(&marker).unwrap();
        assert_eq!(
            marker_from_body(&body, modified).expires_at,
            marker.expires_at
        );
    }
}
