//! How the plugin reaches the store: opened on first use and never remembered as down.
//!
//! A mount reads its chunks through [`StoreSlot::for_mount`], which asks the store nothing:
//! with the manifest from the state dir (`manifest_cache`), a held mount resumes while the
//! store is down, and chunk reads that need the store fail within the fetch policy's bound
//! (EIO) until it answers again, instead of the mount not being served at all.

use std::sync::{Arc, Mutex};

use sealed_store::{ChunkStore, StoreOptions};

/// The store, opened (and probed) on first use. A failed open is not remembered: the next
/// caller tries again. No lock is held while opening, so a store that hangs keeps only its
/// own callers waiting.
pub struct StoreSlot {
    url: String,
    options: StoreOptions,
    opened: Mutex<Option<ChunkStore>>,
    /// The client mounts read chunks through; made once, it asks the store nothing.
    for_mounts: Mutex<Option<ChunkStore>>,
}

impl StoreSlot {
    pub fn new(url: String, options: StoreOptions) -> Arc<Self> {
        Arc::new(StoreSlot {
            url,
            options,
            opened: Mutex::new(None),
            for_mounts: Mutex::new(None),
        })
    }

    /// The store, once it has answered (`ChunkStore::open`).
    pub async fn get(&self) -> Result<ChunkStore, sealed_store::Error> {
        if let Some(store) = self.cached() {
            return Ok(store);
        }
        let store = ChunkStore::open(&self.url, &self.options).await?;
        let mut slot = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        Ok(slot.get_or_insert(store).clone())
    }

    /// The store for a mount's chunk reads: a client that asks the store nothing when made
    /// (`ChunkStore::connect`), so that a mount is served whether or not the store answers
    /// now, and without client retries: the mount's `FetchPolicy` owns them
    /// (`FetchPolicy::store_options`). Fails only on a bad URL or options.
    pub fn for_mount(&self) -> Result<ChunkStore, sealed_store::Error> {
        let mut slot = self.for_mounts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(store) = &*slot {
            return Ok(store.clone());
        }
        let options = sealed_mount::FetchPolicy::store_options(&self.options);
        let store = ChunkStore::connect(&self.url, &options)?;
        Ok(slot.insert(store).clone())
    }

    fn cached(&self) -> Option<ChunkStore> {
        self.opened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_mount_gets_a_store_while_nothing_answers() {
        // Nothing listens on port 9: opening fails, a mount's store does not.
        let slot = StoreSlot::new(
            "s3://nowhere".into(),
            StoreOptions {
                endpoint: Some("http://127.0.0.1:9".into()),
                region: Some("us-east-1".into()),
                timeout: std::time::Duration::from_secs(1),
                retries: 0,
                ..Default::default()
            },
        );
        assert!(slot.get().await.is_err());
        let store = slot.for_mount().expect("a client without asking the store");
        let digest = sealed_store::Digest::of(b"chunk");
        assert!(
            store.get_chunk(&digest).await.is_err(),
            "reads fail, bounded"
        );
        let bad = StoreSlot::new("nope://x".into(), StoreOptions::default());
        assert!(bad.for_mount().is_err());
    }
}
