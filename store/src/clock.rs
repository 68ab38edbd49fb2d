//! Expiry by the store's clock. Every host's wall clock may be minutes off; an object's
//! last-modified time is the store's, so leases and the collector's marker expire at "last
//! written + TTL" by that clock, and the collector reads the store's "now" once and advances it
//! by its own monotonic clock.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::error::Result;
use crate::store::ChunkStore;

/// How long a lease (or the collector's marker) lives without renewal, and what an unreadable
/// one is assumed to have had.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10 * 60);

/// When an object last written at `last_modified` (the store's clock) with a lifetime of
/// `ttl_secs` (the default lease TTL when unknown) expires, by the store's clock.
pub(crate) fn store_expiry(last_modified: DateTime<Utc>, ttl_secs: Option<u64>) -> DateTime<Utc> {
    let ttl = ttl_secs.map_or(DEFAULT_LEASE_TTL, Duration::from_secs);
    last_modified
        .checked_add_signed(chrono_duration(ttl))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The expiry to trust for an object that declares its TTL: by the store's clock. One without
/// (written by an older client) keeps the expiry it wrote.
pub(crate) fn judged_expiry(
    written: DateTime<Utc>,
    last_modified: DateTime<Utc>,
    ttl_secs: Option<u64>,
) -> DateTime<Utc> {
    match ttl_secs {
        Some(_) => store_expiry(last_modified, ttl_secs),
        None => written,
    }
}

pub(crate) fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
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
        let key = crate::layout::gc_clock_key(&crate::identity::random_id());
        let read = Instant::now();
        store
            .write_json(&key, &serde_json::json!({ "probe": true }))
            .await?;
        let meta = store.raw().head(&key).await;
        store.delete_quietly(&key).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_is_last_written_plus_ttl_by_the_store_clock() {
        let written = DateTime::<Utc>::UNIX_EPOCH;
        let modified = written + chrono::Duration::seconds(100);
        assert_eq!(
            judged_expiry(written, modified, Some(5)),
            modified + chrono::Duration::seconds(5)
        );
        assert_eq!(judged_expiry(written, modified, None), written);
        assert_eq!(
            store_expiry(modified, None),
            modified + chrono_duration(DEFAULT_LEASE_TTL)
        );
        assert_eq!(
            store_expiry(DateTime::<Utc>::MAX_UTC, Some(1)),
            DateTime::<Utc>::MAX_UTC
        );
    }
}
