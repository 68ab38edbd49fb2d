//! The in-memory tier: recently read and prefetched chunks, bounded in bytes for the whole
//! node (not per file).

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::Digest;

use crate::lru::LruIndex;
use crate::metrics::MountMetrics;

pub struct MemoryCache {
    index: Mutex<LruIndex<Digest, Bytes>>,
    metrics: Arc<MountMetrics>,
}

impl MemoryCache {
    pub fn new(capacity: u64, metrics: Arc<MountMetrics>) -> Self {
        MemoryCache {
            index: Mutex::new(LruIndex::new(capacity)),
            metrics,
        }
    }

    fn publish(&self, bytes: u64) {
        self.metrics
            .memory_cache_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// The chunk's bytes (verified before they were put here), or `None`.
    pub fn get(&self, digest: &Digest) -> Option<Bytes> {
        self.index.lock().get(digest).cloned()
    }

    /// Keeps a chunk the caller has verified, evicting the least recently used.
    pub fn put(&self, digest: &Digest, data: &Bytes) {
        let mut index = self.index.lock();
        index.insert(*digest, data.clone(), data.len() as u64);
        let bytes = index.bytes();
        drop(index);
        self.publish(bytes);
    }

    pub fn contains(&self, digest: &Digest) -> bool {
        self.index.lock().contains(digest)
    }
}
