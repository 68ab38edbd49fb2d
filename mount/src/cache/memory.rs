//! The in-memory tier: recently read and prefetched chunks, bounded in bytes for the whole
//! node (not per file).

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::Digest;

use crate::cache::ChunkCache;
use crate::lru::LruIndex;
use crate::metrics::MountMetrics;

pub struct MemoryCache {
    index: Mutex<LruIndex<Bytes>>,
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
}

impl ChunkCache for MemoryCache {
    fn get(&self, digest: &Digest) -> Option<Bytes> {
        self.index.lock().get(digest).cloned()
    }

    fn put(&self, digest: &Digest, data: &Bytes) {
        let mut index = self.index.lock();
        index.insert(*digest, data.clone(), data.len() as u64);
        let bytes = index.bytes();
        drop(index);
        self.publish(bytes);
    }

    fn contains(&self, digest: &Digest) -> bool {
        self.index.lock().contains(digest)
    }

    fn bytes(&self) -> u64 {
        self.index.lock().bytes()
    }
}
