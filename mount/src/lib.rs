//! Read-only FUSE filesystem over a sealed version, with verified cache tiers.
//!
//! The shape follows mountpoint-s3: a plain Rust read API over a manifest ([`SealedFs`]:
//! lookup, getattr, readdir, readlink, open, read at offset, statfs) that tests drive without
//! a kernel, and a thin `fuser` adapter ([`fuse`]) that turns FUSE requests into calls on it.
//!
//! Bytes come through cache tiers: the kernel page cache, a bounded in-memory chunk cache
//! (where readahead lands), the node disk cache (content-addressed, shared by every mount,
//! bounded with LRU eviction, kept across restarts) and finally the object store. Every chunk
//! is verified against its BLAKE3 digest before it is cached or served; a corrupt or missing
//! chunk is EIO, never wrong bytes.
//!
//! [`MountHandle::spawn`] fetches and verifies a version's manifest and mounts it at a path
//! in the background (the CLI's `sealed mount`); [`MountHandle::spawn_with_manifest`] does
//! the same from a manifest the caller verified (the CSI node plugin keeps one per version),
//! and `resume` / `resume_with_manifest` serve a mount another process made.
//! [`MountHandle::unmount`] ends it.

mod breaker;
mod cache;
pub mod cold_start;
pub mod error;
pub mod fetch;
pub mod fs;
pub mod fuse;
pub mod hydrate;
mod io_modes;
mod learned;
pub mod limits;
mod link;
mod lru;
pub mod metrics;
pub mod model_header;
mod model_prefetch;
mod passthrough;
pub mod peer;
pub mod prefetch;
mod profile_recorder;
pub mod readahead;
pub mod reattach;
pub mod session;
pub mod size;
pub mod tree;
mod verify;

pub use error::{FetchError, FsError, MountError};
pub use fetch::{FetchPolicy, NodeCache, NodeCacheOptions};
pub use fs::{SealedFs, StatFs};
pub use limits::MountLimits;
pub use metrics::{HistogramSnapshot, MetricsSnapshot, MountMetrics, Tier};
pub use peer::{PeerAnswer, PeerTier};
pub use prefetch::{PrefetchReport, PrefetchSelection};
pub use profile_recorder::{DIVERGENCE_RATIO, REPLAY_READ_MULTIPLE};
pub use readahead::ReadaheadPolicy;
pub use session::{MountHandle, MountOptions, unmount};
pub use size::parse_size;
pub use tree::{Attr, DirEntry, NodeType, Tree};
pub use verify::ScrubOptions;
