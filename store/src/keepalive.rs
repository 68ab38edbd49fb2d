//! Keeping an expiring object alive: a background task rewrites it every TTL/3 and the holder
//! knows, by the local monotonic clock, whether it has been continuously unexpired since it
//! was first written. Writer leases and the collector's marker are both held this way.
//!
//! Renewal must land before the previous expiry (less a clock-skew margin); if it does not,
//! the object has *lapsed* for good: its holder must stop relying on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use object_store::path::Path as ObjectPath;

use crate::clock::chrono_duration;
use crate::error::Result;
use crate::store::ChunkStore;

/// A JSON object with an expiry that a [`Keepalive`] rewrites.
pub(crate) trait Renewable: serde::Serialize + Send + Sync + 'static {
    fn renew(&mut self, expires_at: DateTime<Utc>);
}

/// Allowance for clock skew between hosts and for request latency: an object is treated as
/// lapsed this long before its written expiry.
pub(crate) fn skew_margin(ttl: Duration) -> Duration {
    ttl / 10
}

struct Shared {
    /// Local (monotonic) time until which the object is known to be unexpired.
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

/// The renewal of one expiring object.
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
        Ok(match store.head_optional(&self.key).await? {
            Some(meta) => match (&*ours, &meta.e_tag) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            },
            None => false,
        })
    }

    /// Marks the object lapsed for good (its holder found it lost).
    pub(crate) fn mark_lapsed(&self) {
        self.shared.lapsed.store(true, Ordering::SeqCst);
    }

    /// True while the object is known to stay unexpired for at least `margin` more.
    pub(crate) fn is_live_for(&self, margin: Duration) -> bool {
        self.shared
            .live_until()
            .is_some_and(|until| Instant::now() + margin < until)
    }

    /// True while the object is known to be unexpired (with the skew margin to spare).
    pub(crate) fn is_live(&self) -> bool {
        match self.shared.live_until() {
            Some(until) if Instant::now() < until => true,
            _ => {
                self.mark_lapsed();
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
        self.abort();
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
        let written = store.write_json(&key, &record).await;
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
