//! Writer leases: how writers (push, restore, ingest) and the garbage collector stay out of each
//! other's way. See `docs/gc.md` for the whole argument.
//!
//! ```text
//! <prefix>/leases/<32 hex>    one per writer in flight: {id, purpose, host, pid, acquired_at, expires_at}
//! <prefix>/gc/running         the collector's marker (crate::gc_marker)
//! ```
//!
//! A writer writes its lease *first* and reads the GC marker *second*; the collector writes its
//! marker first and lists leases second. On a strongly consistent store (S3, GCS, Azure Blob, a
//! local directory) at least one of the two sees the other, so a collector never sweeps while a
//! writer it did not see is choosing which chunks to reuse. A writer that sees a live marker
//! marks its lease `waiting` (keeping it, so the next collection defers to it instead of
//! starving it) and polls until the marker is gone or expired.
//!
//! A lease is renewed by a [`crate::keepalive::Keepalive`]; if a renewal does not land in
//! time the lease has *lapsed* for good and [`WriterLease::ensure_live`] fails, so a writer
//! that was paused past its TTL (a collection may have run meanwhile) never seals a manifest
//! on the strength of chunks it saw before.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use object_store::path::Path as ObjectPath;

use crate::bounded::{MAX_LISTED_LEASES, MAX_RECORD_BYTES, list_capped};
pub use crate::clock::DEFAULT_LEASE_TTL;
use crate::clock::{chrono_duration, judged_expiry, store_expiry};
use crate::error::{Error, Result};
use crate::gc_marker::read_gc_marker;
use crate::identity::{hostname, random_id};
use crate::keepalive::{Keepalive, Renewable};
use crate::layout::{self, Prefix};
use crate::retry::RetryPolicy;
use crate::store::ChunkStore;

/// How long a writer waits for a running garbage collection before giving up.
pub const DEFAULT_GC_WAIT: Duration = Duration::from_secs(15 * 60);

#[derive(Clone, Debug)]
pub struct LeaseOptions {
    /// Lifetime of the lease object without renewal; it is renewed every `ttl / 3`.
    pub ttl: Duration,
    /// Longest wait for a running garbage collection before [`Error::GcRunning`].
    pub max_wait: Duration,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        LeaseOptions {
            ttl: DEFAULT_LEASE_TTL,
            max_wait: DEFAULT_GC_WAIT,
        }
    }
}

/// The lease object's body.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct LeaseRecord {
    pub id: String,
    pub purpose: String,
    pub host: String,
    pub pid: u32,
    pub acquired_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Set while the writer waits for a running collection; it has read nothing yet.
    #[serde(default)]
    pub waiting: bool,
    /// The lease's lifetime after each write. Others judge expiry by the store's clock:
    /// the object's last-modified time plus this (see [`list_leases`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
}

impl Renewable for LeaseRecord {
    fn renew(&mut self, expires_at: DateTime<Utc>) {
        self.expires_at = expires_at;
    }
}

/// Runs `op` under a writer lease for `purpose` and releases the lease after it, whatever
/// the outcome: the operation's error wins over a release error (see
/// [`WriterLease::release_keeping`]).
pub(crate) async fn with_writer_lease<T>(
    store: &ChunkStore,
    purpose: &str,
    op: impl AsyncFnOnce(&WriterLease) -> Result<T>,
) -> Result<T> {
    let lease = WriterLease::acquire(store, purpose).await?;
    let result = op(&lease).await;
    lease.release_keeping(result).await
}

/// A writer's claim on the store: while it is held, no garbage collection starts.
/// Release it with [`WriterLease::release`]; dropping it stops the renewal and deletes the
/// lease object in the background (or it expires after its TTL if the process dies).
pub struct WriterLease {
    store: ChunkStore,
    record: LeaseRecord,
    key: ObjectPath,
    ttl: Duration,
    keepalive: Keepalive,
    released: bool,
}

impl WriterLease {
    /// Takes a lease with the default TTL (10 min), waiting up to 15 min for a running garbage
    /// collection to end. `purpose` says who holds it ("push", "restore blake3:…", "ingest …").
    pub async fn acquire(store: &ChunkStore, purpose: &str) -> Result<WriterLease> {
        Self::acquire_with(store, purpose, &LeaseOptions::default()).await
    }

    pub async fn acquire_with(
        store: &ChunkStore,
        purpose: &str,
        opts: &LeaseOptions,
    ) -> Result<WriterLease> {
        let ttl = opts.ttl.max(Duration::from_millis(300));
        let id = random_id();
        let key = layout::lease_key(&id);
        let host = hostname();
        let pid = std::process::id();
        let started = Instant::now();
        // Jittered: writers that found one collection wait out of step with each other.
        let mut backoff =
            RetryPolicy::new(Duration::from_millis(50), Duration::from_secs(1)).schedule();
        // If this future is dropped mid-wait (Ctrl-C), the lease object goes too.
        let mut pending = PendingLease {
            store: store.clone(),
            key: key.clone(),
            armed: true,
        };
        loop {
            // 1. Our lease first …
            let write_start = Instant::now();
            let now = Utc::now();
            let record = LeaseRecord {
                id: id.clone(),
                purpose: purpose.to_owned(),
                host: host.clone(),
                pid,
                acquired_at: now,
                expires_at: now + chrono_duration(ttl),
                waiting: false,
                ttl_secs: Some(ttl.as_secs().max(1)),
            };
            let etag = store.write_json(&key, &record).await?;
            // 2. … then the collector's marker, judged by the store's clock: ours just
            //    landed, so its last-modified time is the store's "now" (our own clock may
            //    be minutes off; the collector's too).
            let checked = async {
                let store_now = store
                    .raw()
                    .head(&key)
                    .await
                    .map_err(|e| store.backend(e))?
                    .last_modified;
                Ok::<_, Error>((read_gc_marker(store).await?, store_now))
            };
            let (marker, store_now) = match checked.await {
                Ok(m) => m,
                Err(e) => {
                    store.delete_quietly(&key).await;
                    return Err(e);
                }
            };
            let live_marker = marker.filter(|m| m.expires_at > store_now);
            let Some(marker) = live_marker else {
                let keepalive =
                    Keepalive::start(store, key.clone(), record.clone(), ttl, write_start, etag);
                pending.armed = false;
                tracing::debug!(lease = %id, purpose, "writer lease acquired");
                return Ok(WriterLease {
                    store: store.clone(),
                    record,
                    key,
                    ttl,
                    keepalive,
                    released: false,
                });
            };
            // A collection is running: let it finish, and wait. The lease stays (marked
            // waiting), so the next collection sees a writer and defers to it.
            let waited = started.elapsed();
            if waited >= opts.max_wait {
                store.delete_quietly(&key).await;
                return Err(Error::GcRunning {
                    store: store.name().to_owned(),
                    host: marker.host,
                    pid: marker.pid,
                    started_at: marker.started_at.to_rfc3339(),
                    expires_at: marker.expires_at.to_rfc3339(),
                    waited_secs: waited.as_secs(),
                });
            }
            tracing::info!(
                gc_host = %marker.host,
                gc_pid = marker.pid,
                "garbage collection running; waiting for it to finish"
            );
            let waiting = LeaseRecord {
                waiting: true,
                ..record
            };
            if let Err(e) = store.write_json(&key, &waiting).await.map(drop) {
                store.delete_quietly(&key).await;
                return Err(e);
            }
            let remaining = opts.max_wait.saturating_sub(waited);
            tokio::time::sleep(backoff.next_delay().min(remaining)).await;
        }
    }

    pub fn id(&self) -> &str {
        &self.record.id
    }

    pub fn record(&self) -> &LeaseRecord {
        &self.record
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Fails with [`Error::LeaseLapsed`] unless the lease has been continuously held since it
    /// was acquired. Call it just before writing anything that makes chunks reachable (a
    /// manifest): a lapsed lease means a garbage collection may have swept meanwhile.
    pub fn ensure_live(&self) -> Result<()> {
        if self.keepalive.is_live() {
            return Ok(());
        }
        Err(Error::LeaseLapsed {
            store: self.store.name().to_owned(),
            id: self.record.id.clone(),
            purpose: self.record.purpose.clone(),
        })
    }

    /// [`ensure_live`](Self::ensure_live), and also that the lease object in the store is
    /// still the one this writer last wrote (same ETag): a collector that judged it expired
    /// (a clock far ahead, a bug) and deleted it may be sweeping the chunks this writer
    /// reuses. Call it before writing a manifest, and after (a lease lost in between means
    /// the manifest may name swept chunks: the writer must say so, not report success).
    pub async fn confirm(&self) -> Result<()> {
        self.ensure_live()?;
        if self.keepalive.confirm(&self.store).await? {
            return Ok(());
        }
        self.keepalive.mark_lapsed();
        Err(Error::LeaseLost {
            store: self.store.name().to_owned(),
            id: self.record.id.clone(),
            purpose: self.record.purpose.clone(),
        })
    }

    /// Stops renewing and deletes the lease object.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        // Wait until renewal has stopped, so none in flight rewrites the object after the
        // delete below.
        self.keepalive.stop().await;
        self.store.delete_if_exists(&self.key).await?;
        tracing::debug!(lease = %self.record.id, "writer lease released");
        Ok(())
    }

    /// Releases the lease after an operation and returns the operation's outcome: its error
    /// wins over a release error (an unreleased lease only expires).
    pub(crate) async fn release_keeping<T>(self, result: Result<T>) -> Result<T> {
        match self.release().await {
            Ok(()) => result,
            Err(e) if result.is_err() => {
                tracing::warn!(error = %e, "cannot release writer lease; it will expire");
                result
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for WriterLease {
    fn drop(&mut self) {
        self.keepalive.abort();
        if !self.released {
            delete_in_background(&self.store, &self.key);
        }
    }
}

/// Deletes a lease whose acquisition did not complete.
struct PendingLease {
    store: ChunkStore,
    key: ObjectPath,
    armed: bool,
}

impl Drop for PendingLease {
    fn drop(&mut self) {
        if self.armed {
            delete_in_background(&self.store, &self.key);
        }
    }
}

/// Best effort from a destructor: without a runtime the lease simply expires after its TTL.
fn delete_in_background(store: &ChunkStore, key: &ObjectPath) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        let (store, key) = (store.clone(), key.clone());
        handle.spawn(async move { store.delete_quietly(&key).await });
    }
}

impl std::fmt::Debug for WriterLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterLease")
            .field("record", &self.record)
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// Every lease object in the store (live or expired), for the collector and for operators.
/// A lease that does not parse is reported with `purpose = "<unreadable>"` and treated as live
/// until its object is 2×TTL old, by the caller's choice.
pub async fn list_leases(store: &ChunkStore) -> Result<Vec<LeaseRecord>> {
    let metas = list_capped(store, &Prefix::Leases.path(), MAX_LISTED_LEASES).await?;
    let mut out = Vec::with_capacity(metas.len());
    for meta in metas {
        let what = format!("writer lease {}", meta.location);
        let Some(body) = store
            .read_optional(&meta.location, &what, MAX_RECORD_BYTES)
            .await?
        else {
            continue; // released between the listing and the read
        };
        let mut record = serde_json::from_slice::<LeaseRecord>(&body).unwrap_or_else(|_| {
            // Unreadable: assume a writer is behind it until the default TTL after it was
            // last written.
            LeaseRecord {
                id: meta.location.filename().unwrap_or_default().to_owned(),
                purpose: "<unreadable lease>".into(),
                host: String::new(),
                pid: 0,
                acquired_at: meta.last_modified,
                expires_at: store_expiry(meta.last_modified, None),
                waiting: false,
                ttl_secs: None,
            }
        });
        // Expiry by the store's clock: last written + TTL. The writer's own `expires_at` is
        // by its clock, which may be minutes off ours.
        record.expires_at = judged_expiry(record.expires_at, meta.last_modified, record.ttl_secs);
        out.push(record);
    }
    Ok(out)
}
