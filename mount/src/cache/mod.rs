//! Chunk cache tiers below the kernel page cache: memory (where readahead lands) and the node
//! disk cache. Both are content-addressed by chunk digest and bounded in bytes with LRU
//! eviction; both verify before they serve.
//!
//! The tiers are composed by `NodeCache` (`fetch.rs`), not through a common trait: each is
//! used its own way there (memory inline on the read path and filled by readers, the disk on
//! a blocking thread and written after readers have their bytes, the store async behind the
//! single flight and the breaker), so one interface over the three would hide exactly what
//! the composition has to get right.

mod disk;
mod memory;

pub(crate) use disk::create_private;
pub use disk::{Checked, DiskCache, Hashing, Key, WholeFile};
pub use memory::MemoryCache;
