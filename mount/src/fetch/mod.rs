//! Verified chunk fetch through the tiers, one fetch per chunk however many readers want it.
//!
//! One entry point, [`NodeCache::fetch`]: the verified bytes of a chunk for a [`Request`] that
//! says why it is wanted ([`Want`]: a reader, readahead, prefetch, a peer, an assembly), which
//! decides the tiers asked (memory, disk, peers, origin; a peer's request never goes back to
//! the peer tier), whether memory keeps the bytes, and what is counted. The public `get`,
//! `serve_peer`, `prefetch` are that entry point with a fixed request.
//!
//! Retries of what a mount reads from the store (chunks, and the manifest `spawn` fetches)
//! are this module's, by [`FetchPolicy`]: per attempt, with backoff, counted, cut short by
//! the breaker and bounded by [`FetchPolicy::worst_case`]. The store a mount reads through
//! is opened without client retries ([`FetchPolicy::store_options`]), so that one retry flag
//! is one layer of retries.
//!
//! [`NodeCache`] is made once per node (or per process) and shared by every mount: it holds
//! the memory tier, the disk tier, the single-flight table, the global readahead budget and
//! the metrics.
//!
//! One home per job: this file the request and the tiers a node holds; [`flight`] the single
//! flight through disk, peers and origin; [`origin`] the store with its retries and breaker;
//! [`peer`] asking and serving other nodes; [`assembly`] background assemblies of whole
//! files; [`budget`] how far readahead may run.

mod assembly;
mod budget;
mod flight;
mod origin;
mod peer;

use budget::ReadaheadBudget;

pub use origin::FetchPolicy;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::{ChunkRef, ChunkStore, Digest};
use tokio::sync::{Notify, Semaphore};

use crate::breaker::Breakers;
use crate::cache::{DiskCache, MemoryCache};
use crate::cold_start::ColdStart;
use crate::error::{FetchError, MountError};
use crate::link::Links;
use crate::metrics::{MountMetrics, Tier};
use crate::peer::{PeerTier, Route};
use crate::verify::{Integrity, ScrubOptions};

/// Why a chunk is wanted: which tiers a fetch of it asks, whether memory keeps its bytes,
/// and what is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// A reader's read: memory, disk, peers, origin; the bytes stay in memory for the reads
    /// that follow; memory hits and misses are counted.
    Reader,
    /// Sequential readahead for a reader: as a reader, started ahead of it.
    Readahead,
    /// Prefetch (a model's tensors, a file before assembly): disk, peers, origin, into the
    /// disk cache; memory keeps it only without a disk tier, so readers' chunks stay there.
    Prefetch,
    /// Another node asked this one (its owner): memory, disk, origin, never the peer tier (a
    /// request never bounces between nodes whose views of the membership differ); the bytes
    /// land on disk, not in memory, which is this node's readers'.
    Peer,
    /// Assembling a whole file on disk (`crate::hydrate`): memory, disk, peers, origin,
    /// without filling memory.
    Assembly,
}

impl Want {
    fn route(self) -> Route {
        match self {
            Want::Peer => Route::OriginOnly,
            _ => Route::PeersThenOrigin,
        }
    }
}

/// A request for a chunk's verified bytes ([`NodeCache::fetch`]).
#[derive(Clone, Copy)]
pub(crate) struct Request<'a> {
    pub want: Want,
    /// Starting a fetch (not joining one, not a memory hit) first takes a slot of these,
    /// held until it ends: a mount's bound on its fetches in flight.
    pub slots: Option<&'a Arc<Semaphore>>,
    /// The cold start of the mount that asked: counts the chunk by the tier that fetched it
    /// when this request starts the fetch, as memory otherwise.
    pub tally: Option<&'a Arc<ColdStart>>,
}

impl<'a> Request<'a> {
    pub(crate) fn new(want: Want) -> Self {
        Request {
            want,
            slots: None,
            tally: None,
        }
    }

    pub(crate) fn slots(self, slots: &'a Arc<Semaphore>) -> Self {
        Request {
            slots: Some(slots),
            ..self
        }
    }

    pub(crate) fn tally(self, tally: &'a Arc<ColdStart>) -> Self {
        Request {
            tally: Some(tally),
            ..self
        }
    }
}

#[derive(Clone, Debug)]
pub struct NodeCacheOptions {
    /// Node disk cache directory; `None` keeps chunks in memory only.
    pub disk_dir: Option<PathBuf>,
    /// Bound on the disk cache, bytes.
    pub disk_bytes: u64,
    /// Bound on the memory tier (recently read and read-ahead chunks), bytes, for the node.
    pub memory_bytes: u64,
    /// Bound on readahead bytes being fetched at once, for the node (`--prefetch-memory`).
    pub readahead_bytes: u64,
    pub fetch: FetchPolicy,
    /// The background scrub of the disk cache (`crate::verify`); off by default.
    pub scrub: ScrubOptions,
}

impl Default for NodeCacheOptions {
    fn default() -> Self {
        NodeCacheOptions {
            disk_dir: None,
            disk_bytes: 10 << 30,
            memory_bytes: 256 << 20,
            readahead_bytes: 256 << 20,
            fetch: FetchPolicy::default(),
            scrub: ScrubOptions::off(),
        }
    }
}

struct Inner {
    memory: MemoryCache,
    disk: Option<DiskCache>,
    inflight: Mutex<HashMap<Digest, flight::Flight>>,
    policy: FetchPolicy,
    metrics: Arc<MountMetrics>,
    budget: ReadaheadBudget,
    breakers: Breakers,
    /// Disk cache writes not yet done, and a wake-up when they reach zero.
    pending_writes: AtomicU64,
    writes_done: Notify,
    /// Other nodes' caches, asked between the disk and the store (`crate::peer`).
    peers: OnceLock<Arc<dyn PeerTier>>,
    assembling: Mutex<std::collections::HashSet<Digest>>,
    /// Background assemblies started and not ended, and a wake-up when they reach zero.
    background_assemblies: AtomicU64,
    assemblies_done: Notify,
    /// [`NodeCache::readahead_ceiling`].
    readahead_ceiling: Option<u64>,
    /// Each store link's bandwidth-delay product, from the fetches above (`crate::link`).
    links: Links,
    /// Checks of the disk tier's whole-file copies (`crate::verify`).
    integrity: Integrity,
}

/// A [`NodeCache`] that does not keep it alive (the scrub's).
pub(crate) struct WeakNodeCache(std::sync::Weak<Inner>);

impl WeakNodeCache {
    pub(crate) fn upgrade(&self) -> Option<NodeCache> {
        self.0.upgrade().map(|inner| NodeCache { inner })
    }
}

/// The node's cache tiers and fetch machinery. Cheap to clone.
#[derive(Clone)]
pub struct NodeCache {
    inner: Arc<Inner>,
}

impl NodeCache {
    pub fn new(options: &NodeCacheOptions) -> Result<NodeCache, MountError> {
        let metrics = Arc::new(MountMetrics::default());
        let disk = match &options.disk_dir {
            Some(dir) => Some(DiskCache::open(dir, options.disk_bytes, metrics.clone())?),
            None => None,
        };
        let cache = NodeCache {
            inner: Arc::new(Inner {
                memory: MemoryCache::new(options.memory_bytes, metrics.clone()),
                disk,
                inflight: Mutex::new(HashMap::new()),
                policy: options.fetch,
                budget: ReadaheadBudget::new(options.readahead_bytes, metrics.clone()),
                breakers: Breakers::new(options.fetch.breaker_open),
                metrics,
                pending_writes: AtomicU64::new(0),
                writes_done: Notify::new(),
                peers: OnceLock::new(),
                assembling: Mutex::new(std::collections::HashSet::new()),
                background_assemblies: AtomicU64::new(0),
                assemblies_done: Notify::new(),
                readahead_ceiling: options
                    .disk_dir
                    .is_none()
                    .then(|| (options.memory_bytes / 4).min(options.readahead_bytes / 2)),
                links: Links::default(),
                integrity: Integrity::default(),
            }),
        };
        crate::verify::start_scrub(&cache, options.scrub);
        Ok(cache)
    }

    pub(crate) fn integrity(&self) -> &Integrity {
        &self.inner.integrity
    }

    pub(crate) fn downgrade(&self) -> WeakNodeCache {
        WeakNodeCache(Arc::downgrade(&self.inner))
    }

    pub fn metrics(&self) -> &Arc<MountMetrics> {
        &self.inner.metrics
    }

    /// The disk tier's free-space floor, percent of its filesystem (`cache::free_space`;
    /// default 10, 0 off); nothing without a disk tier.
    pub fn set_disk_min_free_percent(&self, percent: u8) {
        if let Some(disk) = &self.inner.disk {
            disk.set_min_free_percent(percent);
        }
    }

    /// Warming (the node plugin's `spec.warm`): the chunk verified from the origin into the
    /// disk cache, evicting only entries unused for `spare_recent`; whether it is on disk now
    /// (false: no room without pushing out what was used recently). Not through the flights
    /// readers share, whose disk writes evict by plain LRU: a chunk a reader is fetching at
    /// the same moment may come from the store twice.
    pub async fn warm_chunk(
        &self,
        store: &ChunkStore,
        chunk: &ChunkRef,
        spare_recent: Duration,
    ) -> Result<bool, FetchError> {
        if !self.has_disk() {
            return Ok(false);
        }
        if self.on_disk(&chunk.digest) {
            return Ok(true);
        }
        let data = self.fetch_from_store(store, &chunk.digest).await?;
        let data = self.checked_len(chunk, data)?;
        let (this, digest) = (self.clone(), chunk.digest);
        tokio::task::spawn_blocking(move || {
            this.inner
                .disk
                .as_ref()
                .is_some_and(|d| d.put_sparing(&digest, &data, Some(spare_recent)))
        })
        .await
        .map_err(|e| FetchError::Internal {
            digest,
            reason: format!("the disk write stopped: {e}"),
        })
    }

    /// The disk tier, if this cache has one (hydrated files live there).
    pub(crate) fn disk(&self) -> Option<&DiskCache> {
        self.inner.disk.as_ref()
    }

    /// True if the chunk is in the disk tier (its own file, or an assembled file registered
    /// with [`NodeCache::register_on_disk`]): what warming a version (the node plugin) asks
    /// after a restart, so the cache itself tells what is there.
    pub fn on_disk(&self, digest: &Digest) -> bool {
        self.inner.disk.as_ref().is_some_and(|d| d.contains(digest))
    }

    /// True if this cache has a disk tier.
    pub fn has_disk(&self) -> bool {
        self.inner.disk.is_some()
    }

    /// Records where the chunks of `file` are if it is assembled on disk (a mount does this
    /// for its files; so must anyone who asks [`NodeCache::on_disk`] about them).
    pub fn register_on_disk(&self, file: &sealed_store::FileEntry) {
        if let Some(disk) = &self.inner.disk {
            disk.register(file);
        }
    }

    /// The verified bytes of a chunk, for a reader: memory, then disk, then the store. The
    /// chunk stays in memory for the reads that follow.
    ///
    /// Whatever tier they come from, the bytes are as long as `chunk` declares: a manifest
    /// whose lengths lie is an error ([`FetchError::WrongLength`], EIO), never short bytes.
    pub async fn get(&self, store: &ChunkStore, chunk: &ChunkRef) -> Result<Bytes, FetchError> {
        self.fetch(store, chunk, Request::new(Want::Reader)).await
    }

    /// The verified bytes of a chunk for `request`, from the first tier that has them:
    /// memory, disk, peers (unless a peer asked), origin, joining a fetch of the chunk in
    /// flight. Every byte is verified against the chunk's digest (by the disk tier as it
    /// reads, here for a peer's, by the store for the origin's) and its declared length.
    pub(crate) async fn fetch(
        &self,
        store: &ChunkStore,
        chunk: &ChunkRef,
        request: Request<'_>,
    ) -> Result<Bytes, FetchError> {
        let Request { want, slots, tally } = request;
        // Readers' memory hits and misses are the metrics'; the background's are not.
        let reader = matches!(want, Want::Reader | Want::Readahead);
        let digest = &chunk.digest;
        let metrics = &self.inner.metrics;
        let started = Instant::now();
        if let Some(data) = self.inner.memory.get(digest) {
            if reader {
                MountMetrics::inc(&metrics.memory_hits);
                metrics.observe_fetch(Tier::Memory, started.elapsed());
            }
            if let Some(t) = tally {
                t.record_chunk(Tier::Memory, data.len() as u64);
            }
            return self.checked_len(chunk, data);
        }
        if reader {
            MountMetrics::inc(&metrics.memory_misses);
        }
        let joined = self.inner.inflight.lock().get(digest).cloned();
        let data = match joined {
            Some(flight) => {
                let data = flight.await?;
                if let Some(t) = tally {
                    t.record_chunk(Tier::Memory, data.len() as u64);
                }
                data
            }
            None => {
                let slot = match slots {
                    Some(slots) => Some(slots.clone().acquire_owned().await.map_err(|_| {
                        FetchError::Internal {
                            digest: *digest,
                            reason: "the mount's fetch slots are closed".into(),
                        }
                    })?),
                    None => None,
                };
                self.flight(store, chunk, want, slot, tally.cloned())
                    .await?
            }
        };
        // A flight started by a prefetch does not fill memory; a reader wants it there.
        if reader && !self.inner.memory.contains(digest) {
            self.inner.memory.put(digest, &data);
        }
        self.checked_len(chunk, data)
    }

    /// Makes sure the chunk is in the disk cache (or memory, without a disk cache), for
    /// background prefetch of whole versions: does not push readers' chunks out of memory.
    pub async fn prefetch(&self, store: &ChunkStore, chunk: &ChunkRef) -> Result<(), FetchError> {
        match &self.inner.disk {
            Some(disk) if disk.contains(&chunk.digest) => Ok(()),
            Some(_) => self
                .fetch(store, chunk, Request::new(Want::Prefetch))
                .await
                .map(drop),
            None => self.get(store, chunk).await.map(drop),
        }
    }

    /// The length check of [`ChunkRef::check_len`], per reference: the bytes (verified
    /// against the digest, and shared by every reference to it) are right, the reference
    /// may not be. Checked after the single flight, so one wrong reference fails only its
    /// own readers.
    fn checked_len(&self, chunk: &ChunkRef, data: Bytes) -> Result<Bytes, FetchError> {
        match chunk.check_len(&data) {
            Ok(()) => Ok(data),
            Err(_) => {
                MountMetrics::inc(&self.inner.metrics.verification_failures);
                tracing::error!(
                    digest = %chunk.digest,
                    declared = chunk.len,
                    actual = data.len(),
                    "chunk length does not match the manifest"
                );
                Err(FetchError::WrongLength {
                    digest: chunk.digest,
                    declared: chunk.len,
                    actual: data.len() as u64,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
