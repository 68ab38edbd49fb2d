//! Chunk cache tiers below the kernel page cache: memory (where readahead lands) and the node
//! disk cache. Both are content-addressed by chunk digest and bounded in bytes with LRU
//! eviction; both verify before they serve.

mod disk;
mod memory;

use bytes::Bytes;
use sealed_store::Digest;

pub use disk::DiskCache;
pub use memory::MemoryCache;

/// A tier that holds verified chunks by digest.
pub trait ChunkCache: Send + Sync {
    /// The chunk's bytes, already verified against `digest`, or `None`.
    fn get(&self, digest: &Digest) -> Option<Bytes>;
    /// Stores a chunk the caller has verified.
    fn put(&self, digest: &Digest, data: &Bytes);
    fn contains(&self, digest: &Digest) -> bool;
    /// Bytes held now.
    fn bytes(&self) -> u64;
}
