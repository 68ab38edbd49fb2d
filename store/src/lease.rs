//! Writer leases: how writers (push, restore, ingest) and the garbage collector stay out of each
//! other's way. See `docs/gc.md` for the whole argument.
//!
//! ```text
//! <prefix>/leases/<32 hex>    one per writer in flight: {id, purpose, host, pid, acquired_at, expires_at}
//! <prefix>/gc/running         the collector's marker:   {id, host, pid, started_at, expires_at}
//! ```
//!
//! A writer writes its lease *first* and reads the GC marker *second*; the collector writes its
//! marker first and lists leases second. On a strongly consistent store (S3, GCS, Azure Blob, a
//! local directory) at least one of the two sees the other, so a collector never sweeps while a
//! writer it did not see is choosing which chunks to reuse. A writer that sees a live marker
//! marks its lease `waiting` (keeping it, so the next collection defers to it instead of
//! starving it) and polls until the marker is gone or expired.
//!
//! A lease is renewed by a background task every TTL/3. Renewal must land before the previous
//! expiry (less a clock-skew margin); if it does not, the lease has *lapsed* for good and
//! [`WriterLease::ensure_live`] fails, so a writer that was paused past its TTL (a collection
//! may have run meanwhile) never seals a manifest on the strength of chunks it saw before.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use object_store::PutPayload;
use object_store::path::Path as ObjectPath;

use crate::bounded::{MAX_LISTED_LEASES, MAX_RECORD_BYTES, list_capped, read_capped};
use crate::error::{Error, Result};
use crate::store::ChunkStore;

/// How long a lease lives without renewal.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10 * 60);
/// How long a writer waits for a running garbage collection before giving up.
pub const DEFAULT_GC_WAIT: Duration = Duration::from_secs(15 * 60);

pub(crate) const LEASES_PREFIX: &str = "leases";
pub(crate) const GC_MARKER_KEY: &str = "gc/running";

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

struct Shared {
    /// Local (monotonic) time until which the lease object is known to be unexpired.
    confirmed_until: Mutex<Instant>,
    lapsed: AtomicBool,
    /// The ETag of our last write of the object; held across each write and each check,
    /// so a check never compares against a write still in flight.
    etag: tokio::sync::Mutex<Option<String>>,
}

impl Shared {
    fn live_until(&self) -> Option<Instant> {
        if self.lapsed.load(Ordering::SeqCst) {
            return None;
        }
        self.confirmed_until.lock().ok().map(|t| *t)
    }
}

/// Allowance for clock skew between hosts and for request latency: a lease is treated as
/// lapsed this long before its written expiry.
pub(crate) fn skew_margin(ttl: Duration) -> Duration {
    ttl / 10
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
        let key = ObjectPath::from(format!("{LEASES_PREFIX}/{id}"));
        let host = hostname();
        let pid = std::process::id();
        let started = Instant::now();
        let mut backoff = Duration::from_millis(50);
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
            let etag = write_json(store, &key, &record).await?;
            // 2. … then the collector's marker, judged by the store's clock: ours just
            //    landed, so its last-modified time is the store's "now" (our own clock may
            //    be minutes off; the collector's too).
            let checked = async {
                let store_now = store
                    .object_store()
                    .head(&key)
                    .await
                    .map_err(|e| store.backend(e))?
                    .last_modified;
                Ok::<_, Error>((read_gc_marker(store).await?, store_now))
            };
            let (marker, store_now) = match checked.await {
                Ok(m) => m,
                Err(e) => {
                    delete_quietly(store, &key).await;
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
                delete_quietly(store, &key).await;
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
            if let Err(e) = write_json(store, &key, &waiting).await.map(drop) {
                delete_quietly(store, &key).await;
                return Err(e);
            }
            let remaining = opts.max_wait.saturating_sub(waited);
            tokio::time::sleep(backoff.min(remaining)).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
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
        self.keepalive.shared.lapsed.store(true, Ordering::SeqCst);
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
        match self.store.object_store().delete(&self.key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                tracing::debug!(lease = %self.record.id, "writer lease released");
                Ok(())
            }
            Err(e) => Err(self.store.backend(e)),
        }
    }
}

impl Drop for WriterLease {
    fn drop(&mut self) {
        self.keepalive.abort();
        if self.released {
            return;
        }
        // Best effort: without a runtime the lease simply expires after its TTL.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let store = self.store.clone();
            let key = self.key.clone();
            handle.spawn(async move { delete_quietly(&store, &key).await });
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
        if !self.armed {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (store, key) = (self.store.clone(), self.key.clone());
            handle.spawn(async move { delete_quietly(&store, &key).await });
        }
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

/// A JSON object with an expiry that a [`Keepalive`] rewrites.
pub(crate) trait Renewable: serde::Serialize + Send + Sync + 'static {
    fn renew(&mut self, expires_at: DateTime<Utc>);
}

impl Renewable for LeaseRecord {
    fn renew(&mut self, expires_at: DateTime<Utc>) {
        self.expires_at = expires_at;
    }
}

impl Renewable for GcMarker {
    fn renew(&mut self, expires_at: DateTime<Utc>) {
        self.expires_at = expires_at;
    }
}

/// Rewrites an expiring object every TTL/3 and knows, by the local monotonic clock, whether it
/// has been continuously unexpired since it was first written.
pub(crate) struct Keepalive {
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
    key: ObjectPath,
}

impl Keepalive {
    /// `written_at`: when the first write of the object *started* (its expiry was computed
    /// then).
    pub(crate) fn start<T: Renewable>(
        store: &ChunkStore,
        key: ObjectPath,
        record: T,
        ttl: Duration,
        written_at: Instant,
        etag: Option<String>,
    ) -> Self {
        let shared = Arc::new(Shared {
            confirmed_until: Mutex::new(written_at + ttl - skew_margin(ttl)),
            lapsed: AtomicBool::new(false),
            etag: tokio::sync::Mutex::new(etag),
        });
        let task = tokio::spawn(renew_loop(
            store.clone(),
            key.clone(),
            record,
            ttl,
            shared.clone(),
        ));
        Keepalive {
            shared,
            task: Some(task),
            key,
        }
    }

    /// Whether the object in the store is still our last write (by ETag; a store that
    /// gives no ETags is judged by the object's presence).
    pub(crate) async fn confirm(&self, store: &ChunkStore) -> Result<bool> {
        let ours = self.shared.etag.lock().await;
        match store.object_store().head(&self.key).await {
            Ok(meta) => Ok(match (&*ours, &meta.e_tag) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store.backend(e)),
        }
    }

    /// True while the object is known to stay unexpired for at least `margin` more.
    pub(crate) fn is_live_for(&self, margin: Duration) -> bool {
        match self.shared.live_until() {
            Some(until) if Instant::now() + margin < until => true,
            Some(_) => false,
            None => false,
        }
    }

    /// True while the object is known to be unexpired (with the skew margin to spare).
    pub(crate) fn is_live(&self) -> bool {
        match self.shared.live_until() {
            Some(until) if Instant::now() < until => true,
            _ => {
                self.shared.lapsed.store(true, Ordering::SeqCst);
                false
            }
        }
    }

    /// Stops renewing without waiting.
    pub(crate) fn abort(&mut self) {
        if let Some(h) = self.task.take() {
            h.abort();
        }
    }

    /// Stops renewing; once this returns no renewal can land any more.
    pub(crate) async fn stop(&mut self) {
        if let Some(h) = self.task.take() {
            h.abort();
            let _ = h.await;
        }
    }
}

impl Drop for Keepalive {
    fn drop(&mut self) {
        if let Some(h) = self.task.take() {
            h.abort();
        }
    }
}

async fn renew_loop<T: Renewable>(
    store: ChunkStore,
    key: ObjectPath,
    mut record: T,
    ttl: Duration,
    shared: Arc<Shared>,
) {
    let margin = skew_margin(ttl);
    loop {
        tokio::time::sleep(ttl / 3).await;
        let Some(deadline) = shared.live_until() else {
            return;
        };
        let start = Instant::now();
        if start >= deadline {
            tracing::warn!(%key, "lapsed before it could be renewed");
            shared.lapsed.store(true, Ordering::SeqCst);
            return;
        }
        record.renew(Utc::now() + chrono_duration(ttl));
        let mut etag = shared.etag.lock().await;
        let written = write_json(&store, &key, &record).await;
        if let Ok(tag) = &written {
            *etag = tag.clone();
        }
        drop(etag);
        match written.map(drop) {
            // Continuity: the renewal landed before the previous expiry.
            Ok(()) if Instant::now() < deadline => {
                if let Ok(mut until) = shared.confirmed_until.lock() {
                    *until = start + ttl - margin;
                }
            }
            Ok(()) => {
                tracing::warn!(%key, "renewed too late; it lapsed");
                shared.lapsed.store(true, Ordering::SeqCst);
                return;
            }
            Err(e) => tracing::warn!(%key, error = %e, "cannot renew; retrying"),
        }
    }
}

/// Every lease object in the store (live or expired), for the collector and for operators.
/// A lease that does not parse is reported with `purpose = "<unreadable>"` and treated as live
/// until its object is 2×TTL old, by the caller's choice.
pub async fn list_leases(store: &ChunkStore) -> Result<Vec<LeaseRecord>> {
    let metas = list_capped(store, LEASES_PREFIX, MAX_LISTED_LEASES).await?;
    let mut out = Vec::with_capacity(metas.len());
    for meta in metas {
        let what = format!("writer lease {}", meta.location);
        let body = match store.object_store().get(&meta.location).await {
            Ok(r) => read_capped(store, r, &what, MAX_RECORD_BYTES).await?,
            // Released between the listing and the read.
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(store.backend(e)),
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
                expires_at: store_expiry(meta.last_modified, Some(DEFAULT_LEASE_TTL.as_secs())),
                waiting: false,
                ttl_secs: None,
            }
        });
        // Expiry by the store's clock: last written + TTL. The writer's own `expires_at` is
        // by its clock, which may be minutes off ours (an older writer without `ttl_secs`
        // keeps the expiry it wrote).
        if record.ttl_secs.is_some() {
            record.expires_at = store_expiry(meta.last_modified, record.ttl_secs);
        }
        out.push(record);
    }
    Ok(out)
}

/// The collector's marker, if one is present (expired or not).
pub async fn read_gc_marker(store: &ChunkStore) -> Result<Option<GcMarker>> {
    let key = ObjectPath::from(GC_MARKER_KEY);
    let got = match store.object_store().get(&key).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(store.backend(e)),
    };
    let last_modified = got.meta.last_modified;
    let body = read_capped(store, got, "the gc/running marker", MAX_RECORD_BYTES).await?;
    // An unreadable marker still means "a collector is running": keep out of its way until it
    // would have expired.
    let mut marker = serde_json::from_slice::<GcMarker>(&body).unwrap_or_else(|_| GcMarker {
        id: String::new(),
        host: "<unreadable marker>".into(),
        pid: 0,
        started_at: last_modified,
        expires_at: store_expiry(last_modified, Some(DEFAULT_LEASE_TTL.as_secs())),
        ttl_secs: None,
    });
    // Expiry by the store's clock, as for leases (a marker of an older collector, without
    // its TTL, keeps the expiry it wrote).
    if marker.ttl_secs.is_some() {
        marker.expires_at = store_expiry(last_modified, marker.ttl_secs);
    }
    Ok(Some(marker))
}

/// When an object last written at `last_modified` (the store's clock) with a lifetime of
/// `ttl_secs` (the default lease TTL when unknown) expires, by the store's clock.
fn store_expiry(last_modified: DateTime<Utc>, ttl_secs: Option<u64>) -> DateTime<Utc> {
    let ttl = ttl_secs.map_or(DEFAULT_LEASE_TTL, Duration::from_secs);
    last_modified
        .checked_add_signed(chrono_duration(ttl))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The store's clock, read once (write a probe object, read its last-modified time) and
/// advanced by our monotonic clock: how the collector judges expiry and grace without
/// trusting its own wall clock.
pub(crate) struct StoreClock {
    at: DateTime<Utc>,
    read: Instant,
}

impl StoreClock {
    pub(crate) async fn read(store: &ChunkStore) -> Result<StoreClock> {
        let key = ObjectPath::from(format!("gc/clock-{}", random_id()));
        let read = Instant::now();
        write_json(store, &key, &serde_json::json!({ "probe": true })).await?;
        let meta = store.object_store().head(&key).await;
        delete_quietly(store, &key).await;
        let meta = meta.map_err(|e| store.backend(e))?;
        Ok(StoreClock {
            at: meta.last_modified,
            read,
        })
    }

    pub(crate) fn now(&self) -> DateTime<Utc> {
        self.at
            .checked_add_signed(chrono_duration(self.read.elapsed()))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

/// Writes `value` as JSON at `key`; returns the new object's ETag (when the store gives one).
pub(crate) async fn write_json<T: serde::Serialize>(
    store: &ChunkStore,
    key: &ObjectPath,
    value: &T,
) -> Result<Option<String>> {
    let body = serde_json::to_vec(value).map_err(|e| Error::Other(format!("{key}: {e}")))?;
    let put = store
        .object_store()
        .put(key, PutPayload::from(body))
        .await
        .map_err(|e| store.backend(e))?;
    Ok(put.e_tag)
}

pub(crate) async fn delete_quietly(store: &ChunkStore, key: &ObjectPath) {
    match store.object_store().delete(key).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => tracing::warn!(%key, error = %e, "cannot delete; it will expire"),
    }
}

pub(crate) fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// 32 hex characters, unique across hosts and processes for our purposes.
pub(crate) fn random_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(hostname().as_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    h.update(&nanos.to_le_bytes());
    let stack_probe = 0u8;
    h.update(&(std::ptr::addr_of!(stack_probe) as usize).to_le_bytes());
    let hash = h.finalize();
    hex::encode(&hash.as_bytes()[..16])
}

pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
