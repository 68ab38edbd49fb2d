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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use parking_lot::Mutex;
use sealed_store::retry::RetryPolicy;
use sealed_store::{ChunkRef, ChunkStore, Digest, Error as StoreError, StoreOptions};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::breaker::{Admission, Breakers};
use crate::cache::{DiskCache, MemoryCache};
use crate::cold_start::ColdStart;
use crate::error::{FetchError, MountError};
use crate::link::{Link, Links};
use crate::metrics::{MountMetrics, Tier};
use crate::peer::{PeerAnswer, PeerTier, Route};
use crate::readahead::ReadaheadBudget;
use crate::verify::{Integrity, ScrubOptions};

/// How long to wait for the object store, and how often to try.
#[derive(Clone, Copy, Debug)]
pub struct FetchPolicy {
    /// Bound on one attempt to fetch one chunk.
    pub attempt_timeout: Duration,
    /// Further attempts after a timeout or a backend error (not after a missing or corrupt
    /// chunk: those are answers, not accidents).
    pub retries: u32,
    /// Bound on the first pause between attempts; the bound doubles each time, up to 2 s.
    /// Each pause is drawn in the upper half of its bound (jittered: `sealed_store::retry`),
    /// so that a fleet whose store failed at one instant does not retry in lockstep.
    pub backoff: Duration,
    /// Circuit breaker: after a fetch from a store fails by timeout or backend error (after
    /// its retries), fetches from that store fail at once (EIO) for this long, then one probe
    /// goes through. Zero turns the breaker off. See `crate::breaker`.
    pub breaker_open: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            attempt_timeout: Duration::from_secs(20),
            retries: 2,
            backoff: Duration::from_millis(200),
            breaker_open: Duration::from_secs(5),
        }
    }
}

impl FetchPolicy {
    /// The policy for the store options the user gave (`--store-timeout`,
    /// `--store-retries`): an attempt per request timeout, and the retries asked for.
    pub fn for_store(store: &StoreOptions) -> FetchPolicy {
        FetchPolicy {
            attempt_timeout: store.timeout,
            retries: u32::try_from(store.retries).unwrap_or(u32::MAX),
            ..FetchPolicy::default()
        }
    }

    /// The options to open the store a mount reads through: `store` without the client's
    /// own retries, which this policy owns. Retried in both layers, `--store-retries N` made
    /// up to (N+1)² requests of one chunk, and [`FetchPolicy::worst_case`] was not the bound.
    pub fn store_options(store: &StoreOptions) -> StoreOptions {
        StoreOptions {
            retries: 0,
            ..store.clone()
        }
    }

    /// The longest one chunk fetch from the store can take before it fails: every attempt
    /// timing out, plus the pauses between them. With the breaker on, this is also the bound
    /// on one read request of uncached data while the store is down (docs/mount.md).
    /// Saturates rather than overflows for absurd policies (callers bound them; see
    /// `sealed_store::limits`).
    pub fn worst_case(&self) -> Duration {
        let attempts = self.retries.saturating_add(1);
        let mut total = self.attempt_timeout.saturating_mul(attempts);
        let pauses = self.pauses();
        // Pause n is below min(2^(n+1) * first, cap) (`RetryPolicy`).
        let mut bound = pauses.first().saturating_mul(2);
        for _ in 0..self.retries.min(1000) {
            total = total.saturating_add(bound.min(pauses.cap()));
            bound = bound.saturating_mul(2);
        }
        total
    }

    /// The jittered pauses between attempts: pause n in `[b/2, b)` for the bound
    /// `b = min(backoff * 2^n, 2 s)` (the unjittered schedule this replaced paused `b`).
    pub(crate) fn pauses(&self) -> RetryPolicy {
        RetryPolicy::new(self.backoff / 2, MAX_PAUSE)
    }
}

/// The bound on one pause between attempts.
const MAX_PAUSE: Duration = Duration::from_secs(2);

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

type Flight = Shared<BoxFuture<'static, Result<Bytes, FetchError>>>;

struct Inner {
    memory: MemoryCache,
    disk: Option<DiskCache>,
    inflight: Mutex<HashMap<Digest, Flight>>,
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

/// A background assembly in progress; see [`NodeCache::background_assembly`].
pub(crate) struct AssemblyGuard {
    cache: NodeCache,
}

impl Drop for AssemblyGuard {
    fn drop(&mut self) {
        let inner = &self.cache.inner;
        if inner.background_assemblies.fetch_sub(1, Ordering::AcqRel) == 1 {
            inner.assemblies_done.notify_waiters();
        }
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

    /// The largest readahead window this cache holds without refetching: without a disk
    /// tier, a quarter of the memory tier and half the readahead budget; with one, no limit
    /// (chunks read ahead are on disk when memory lets them go). A quarter, because by the
    /// time the reader reaches a chunk fetched at the window's far end, a window's worth of
    /// later chunks was fetched and a window's worth of earlier ones was read (both more
    /// recently used in the LRU), plus up to two partly covered chunks: at half the memory,
    /// a chunk was now and then evicted just before it was read (`tests/readahead.rs`).
    /// See [`crate::ReadaheadPolicy::fitted`].
    pub fn readahead_ceiling(&self) -> Option<u64> {
        self.inner.readahead_ceiling
    }

    /// The most a readahead window may grow to when its store's link needs it: the ceiling
    /// above, or with a disk tier the node's readahead budget (`crate::link`).
    pub(crate) fn readahead_limit(&self) -> u64 {
        self.inner
            .readahead_ceiling
            .unwrap_or_else(|| self.inner.budget.cap())
    }

    /// The measured link to `store`.
    pub(crate) fn link(&self, store: &str) -> Arc<Link> {
        self.inner.links.get(store)
    }

    /// Sets the peer tier chunks are asked from before the store (once; false if one was
    /// set already). Set after construction, because the tier's server serves from this
    /// cache.
    pub fn set_peers(&self, peers: Arc<dyn PeerTier>) -> bool {
        self.inner.peers.set(peers).is_ok()
    }

    /// The verified bytes of a chunk for another node that asked this one (its owner): from
    /// memory, disk or the store, never from the peer tier, once however many ask. Fetched
    /// chunks land on disk (not in memory, which is this node's readers').
    pub async fn serve_peer(
        &self,
        store: &ChunkStore,
        chunk: &ChunkRef,
    ) -> Result<Bytes, FetchError> {
        self.fetch(store, chunk, Request::new(Want::Peer)).await
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

    /// Assemblies of whole files under way (`crate::hydrate`), by file BLAKE3.
    pub(crate) fn assembling(&self) -> &Mutex<std::collections::HashSet<Digest>> {
        &self.inner.assembling
    }

    /// True if the chunk is on disk, in memory or being fetched: an assembly of its file
    /// would not have to wait on the store for it.
    pub(crate) fn is_local_or_coming(&self, digest: &Digest) -> bool {
        self.is_hot(digest) || self.inner.disk.as_ref().is_some_and(|d| d.contains(digest))
    }

    /// The verified bytes of a chunk for assembling its file: memory, disk, then the store
    /// (joining a flight in flight), without filling memory.
    pub(crate) async fn get_for_assembly(
        &self,
        store: &ChunkStore,
        chunk: &ChunkRef,
    ) -> Result<Bytes, FetchError> {
        self.fetch(store, chunk, Request::new(Want::Assembly)).await
    }

    pub(crate) fn budget(&self) -> &ReadaheadBudget {
        &self.inner.budget
    }

    /// True if the chunk is in memory or being fetched: readahead need not ask for it.
    pub(crate) fn is_hot(&self, digest: &Digest) -> bool {
        self.inner.memory.contains(digest) || self.inner.inflight.lock().contains_key(digest)
    }

    /// The manifest of `digest`, verified against it ([`ChunkStore::get_manifest_bytes`]),
    /// with the policy's timeouts and retries. Only a store that fails (a backend error, a
    /// timeout) is asked again; an answer (unknown version, wrong digest, too large) is final.
    pub(crate) async fn manifest_bytes(
        &self,
        store: &ChunkStore,
        digest: &Digest,
    ) -> Result<Bytes, StoreError> {
        let policy = self.inner.policy;
        let mut pauses = policy.pauses().schedule();
        let attempts = policy.retries.saturating_add(1);
        let mut attempt = 1;
        loop {
            let error = match tokio::time::timeout(
                policy.attempt_timeout,
                store.get_manifest_bytes(digest),
            )
            .await
            {
                Ok(Ok(bytes)) => return Ok(bytes),
                Ok(Err(e @ (StoreError::Backend { .. } | StoreError::Timeout { .. }))) => e,
                Ok(Err(answer)) => return Err(answer),
                Err(_) => StoreError::Timeout {
                    store: store.name().to_owned(),
                    what: format!("manifest {digest}"),
                    seconds: policy.attempt_timeout.as_secs(),
                },
            };
            if attempt >= attempts {
                return Err(error);
            }
            tracing::warn!(%digest, attempt, error = %error, "manifest fetch failed");
            tokio::time::sleep(pauses.next_delay()).await;
            attempt += 1;
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

    /// Joins the fetch of `chunk` in flight, or starts one (disk, then peers unless `want` is
    /// a peer's, then the store), filling memory if `want` keeps its bytes there. A fetch it
    /// starts holds `slot` until readers have their answer, and counts its bytes in `tally`
    /// (the cold start of the mount that asked) by the tier that answered; joining drops the
    /// slot at once. (A peer's request that joins a local flight bound for the peer tier waits
    /// at most that tier's bound before the flight falls back to the origin.) What
    /// [`NodeCache::fetch`] and readahead, which does not wait for it, start.
    pub(crate) fn flight(
        &self,
        store: &ChunkStore,
        chunk: &ChunkRef,
        want: Want,
        slot: Option<OwnedSemaphorePermit>,
        tally: Option<Arc<ColdStart>>,
    ) -> impl Future<Output = Result<Bytes, FetchError>> + use<> {
        let route = want.route();
        let into_memory = match want {
            Want::Reader | Want::Readahead => true,
            Want::Prefetch => self.inner.disk.is_none(),
            Want::Peer | Want::Assembly => false,
        };
        let mut inflight = self.inner.inflight.lock();
        if let Some(flight) = inflight.get(&chunk.digest) {
            return flight.clone();
        }
        // A flight fills memory before it leaves the table, so a reader that missed memory
        // just before that flight ended finds the bytes here instead of fetching them again.
        if let Some(data) = self.inner.memory.get(&chunk.digest) {
            return futures::future::ready(Ok(data)).boxed().shared();
        }
        let this = self.clone();
        let store = store.clone();
        let chunk = *chunk;
        let digest = chunk.digest;
        // The fetch runs as its own task so that a reader giving up (an interrupted read)
        // does not cancel it for the others.
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let result = this.fetch_uncached(&store, &chunk, route).await;
            let result = result.map(|(data, write, tier)| {
                if let Some(t) = &tally {
                    t.record_chunk(tier, data.len() as u64);
                }
                (data, write)
            });
            // Fill memory before leaving the table, so no reader falls between the two.
            if into_memory && let Ok((data, _)) = &result {
                this.inner.memory.put(&digest, data);
            }
            // Counted before readers get their bytes, so that `flush` cannot miss it.
            let write = matches!(result, Ok((_, true)));
            if write {
                this.inner.pending_writes.fetch_add(1, Ordering::AcqRel);
            } else {
                // Failures leave before readers hear of them, so the next read tries again.
                this.inner.inflight.lock().remove(&digest);
            }
            let _ = tx.send(result.clone().map(|(data, _)| data));
            drop(slot);
            // Readers have their bytes; the disk copy is written off their path. The flight
            // stays in the table until it is on disk: a reader arriving meanwhile (a chunk
            // prefetched without filling memory) joins it instead of missing the disk and
            // fetching the chunk from the store a second time.
            if let (true, Ok((data, _))) = (write, result) {
                this.write_to_disk(digest, data).await;
                this.inner.inflight.lock().remove(&digest);
            }
        });
        let flight: Flight = async move {
            rx.await.unwrap_or_else(|_| {
                Err(FetchError::Internal {
                    digest,
                    reason: "fetch task ended without an answer".into(),
                })
            })
        }
        .boxed()
        .shared();
        inflight.insert(digest, flight.clone());
        flight
    }

    async fn fetch_uncached(
        &self,
        store: &ChunkStore,
        chunk: &ChunkRef,
        route: Route,
    ) -> Result<(Bytes, bool, Tier), FetchError> {
        let digest = &chunk.digest;
        let metrics = &self.inner.metrics;
        if self.inner.disk.is_some() {
            let started = Instant::now();
            let this = self.clone();
            let d = *digest;
            let hit = tokio::task::spawn_blocking(move || {
                this.inner.disk.as_ref().and_then(|disk| disk.get(&d))
            })
            .await
            .ok()
            .flatten();
            if let Some(data) = hit {
                MountMetrics::inc(&metrics.disk_hits);
                metrics.observe_fetch(Tier::Disk, started.elapsed());
                return Ok((data, false, Tier::Disk));
            }
            MountMetrics::inc(&metrics.disk_misses);
        }
        let peer_started = Instant::now();
        if route == Route::PeersThenOrigin
            && let Some(peers) = self.inner.peers.get()
            && let Some(data) = self.fetch_from_peer(peers.as_ref(), chunk).await
        {
            metrics.observe_fetch(Tier::Peer, peer_started.elapsed());
            return Ok((data, self.inner.disk.is_some(), Tier::Peer));
        }
        let _gauge = InFlight::new(metrics, u64::from(chunk.len));
        let origin_started = Instant::now();
        let data = self.fetch_from_store(store, digest).await?;
        metrics.observe_fetch(Tier::Origin, origin_started.elapsed());
        Ok((data, self.inner.disk.is_some(), Tier::Origin))
    }

    /// The chunk from the peer tier, verified here against its digest and length; `None`
    /// (fetch from the origin) if no peer had it or a peer's bytes were wrong.
    async fn fetch_from_peer(&self, peers: &dyn PeerTier, chunk: &ChunkRef) -> Option<Bytes> {
        let metrics = &self.inner.metrics;
        let data = match peers.fetch(*chunk).await {
            PeerAnswer::Chunk(data) => data,
            PeerAnswer::OwnedHere => return None,
            PeerAnswer::Missed => {
                MountMetrics::inc(&metrics.peer_fallbacks);
                return None;
            }
        };
        let actual = Digest::of(&data);
        if actual != chunk.digest || chunk.check_len(&data).is_err() {
            MountMetrics::inc(&metrics.peer_corrupt);
            MountMetrics::inc(&metrics.verification_failures);
            tracing::error!(
                digest = %chunk.digest,
                %actual,
                len = data.len(),
                "a peer served wrong bytes for a chunk: fetching it from the origin"
            );
            return None;
        }
        MountMetrics::inc(&metrics.peer_hits);
        MountMetrics::add(&metrics.peer_bytes_fetched, data.len() as u64);
        Some(data)
    }

    /// Writes a chunk to the disk cache; the caller has counted it in `pending_writes`.
    async fn write_to_disk(&self, digest: Digest, data: Bytes) {
        let this = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(disk) = &this.inner.disk {
                disk.put(&digest, &data);
            }
        })
        .await;
        if self.inner.pending_writes.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.writes_done.notify_waiters();
        }
    }

    /// Waits until every chunk fetched so far is written to the disk cache (before a clean
    /// exit, so that the next process finds them).
    pub async fn flush(&self) {
        loop {
            let done = self.inner.writes_done.notified();
            if self.inner.pending_writes.load(Ordering::Acquire) == 0 {
                return;
            }
            done.await;
        }
    }

    /// Counts a background assembly (`crate::hydrate`) until the guard drops, so that an
    /// unmount can let it finish ([`NodeCache::assemblies_finished`]).
    pub(crate) fn background_assembly(&self) -> AssemblyGuard {
        self.inner
            .background_assemblies
            .fetch_add(1, Ordering::AcqRel);
        AssemblyGuard {
            cache: self.clone(),
        }
    }

    /// Waits until no background assembly is under way (before a clean exit: a file read to
    /// its end just before the unmount is still assembled, and the next mount serves it by
    /// passthrough instead of chunk by chunk).
    pub async fn assemblies_finished(&self) {
        loop {
            let done = self.inner.assemblies_done.notified();
            if self.inner.background_assemblies.load(Ordering::Acquire) == 0 {
                return;
            }
            done.await;
        }
    }

    async fn fetch_from_store(
        &self,
        store: &ChunkStore,
        digest: &Digest,
    ) -> Result<Bytes, FetchError> {
        let metrics = &self.inner.metrics;
        let breakers = &self.inner.breakers;
        let (mut opened, probe) = match breakers.admit(store.name()) {
            Admission::Go { opened, probe } => (opened, probe),
            Admission::FailFast { retry_in } => {
                MountMetrics::inc(&metrics.store_fast_failures);
                return Err(FetchError::StoreFailing {
                    digest: *digest,
                    store: store.name().to_owned(),
                    retry_in,
                });
            }
        };
        let attempts = self.attempts(store, digest);
        // The breaker opening (another fetch from this store failed) ends this one too: the
        // store is down, and its readers must not wait longer than the bound from their start.
        let outcome = tokio::select! {
            outcome = attempts => outcome,
            _ = opened.changed() => Err(Attempts::Abandoned),
        };
        match outcome {
            Ok(data) => {
                breakers.success(store.name(), probe);
                Ok(data)
            }
            Err(Attempts::Answer(e)) => {
                // A missing or corrupt chunk is an answer: the store works.
                breakers.success(store.name(), probe);
                Err(e)
            }
            Err(Attempts::Failed(e)) => {
                MountMetrics::inc(&metrics.store_errors);
                if breakers.failure(store.name(), probe) {
                    MountMetrics::inc(&metrics.breaker_opens);
                    tracing::warn!(
                        store = store.name(),
                        open_for = ?self.inner.policy.breaker_open,
                        error = %e,
                        "store failing: further fetches from it fail at once for a while"
                    );
                }
                Err(e)
            }
            Err(Attempts::Abandoned) => {
                MountMetrics::inc(&metrics.store_fast_failures);
                Err(FetchError::StoreFailing {
                    digest: *digest,
                    store: store.name().to_owned(),
                    retry_in: self.inner.policy.breaker_open,
                })
            }
        }
    }

    /// The attempts of one fetch, with their timeouts and backoff.
    async fn attempts(&self, store: &ChunkStore, digest: &Digest) -> Result<Bytes, Attempts> {
        let policy = self.inner.policy;
        let metrics = &self.inner.metrics;
        let mut pauses = policy.pauses().schedule();
        let mut last = None;
        for attempt in 1..=policy.retries.saturating_add(1) {
            let started = Instant::now();
            let outcome =
                tokio::time::timeout(policy.attempt_timeout, store.get_chunk(digest)).await;
            let error = match outcome {
                Ok(Ok(data)) => {
                    MountMetrics::inc(&metrics.store_fetches);
                    MountMetrics::add(&metrics.store_bytes_fetched, data.len() as u64);
                    let took = started.elapsed();
                    metrics.record_fetch_latency(took);
                    self.inner.links.get(store.name()).record(
                        Instant::now(),
                        took,
                        data.len() as u64,
                    );
                    return Ok(data);
                }
                Ok(Err(StoreError::MissingChunk { .. })) => {
                    MountMetrics::inc(&metrics.store_errors);
                    return Err(Attempts::Answer(FetchError::Missing {
                        digest: *digest,
                        store: store.name().to_owned(),
                    }));
                }
                Ok(Err(StoreError::CorruptChunk { actual, .. })) => {
                    MountMetrics::inc(&metrics.store_errors);
                    MountMetrics::inc(&metrics.verification_failures);
                    tracing::error!(%digest, %actual, store = store.name(), "corrupt chunk in store");
                    return Err(Attempts::Answer(FetchError::Corrupt {
                        digest: *digest,
                        actual,
                        store: store.name().to_owned(),
                    }));
                }
                Ok(Err(e @ StoreError::ResponseTooLarge { .. })) => {
                    MountMetrics::inc(&metrics.store_errors);
                    MountMetrics::inc(&metrics.verification_failures);
                    tracing::error!(%digest, store = store.name(), error = %e, "oversized chunk from store");
                    return Err(Attempts::Answer(FetchError::Oversized {
                        digest: *digest,
                        store: store.name().to_owned(),
                        reason: e.to_string(),
                    }));
                }
                Ok(Err(e)) => FetchError::Unavailable {
                    digest: *digest,
                    store: store.name().to_owned(),
                    attempts: attempt,
                    reason: e.to_string(),
                },
                Err(_) => {
                    MountMetrics::inc(&metrics.store_timeouts);
                    FetchError::TimedOut {
                        digest: *digest,
                        store: store.name().to_owned(),
                        per_attempt: policy.attempt_timeout,
                        attempts: attempt,
                    }
                }
            };
            tracing::warn!(%digest, attempt, error = %error, "chunk fetch failed");
            last = Some(error);
            if attempt <= policy.retries {
                tokio::time::sleep(pauses.next_delay()).await;
            }
        }
        Err(Attempts::Failed(last.unwrap_or(FetchError::Internal {
            digest: *digest,
            reason: "no attempt made".into(),
        })))
    }
}

/// How the attempts of one fetch ended, when they did not bring the bytes.
enum Attempts {
    /// The store answered: the chunk is missing, corrupt or oversized (not retried, not a
    /// store fault).
    Answer(FetchError),
    /// Timeouts or backend errors on every attempt: the store is failing.
    Failed(FetchError),
    /// The breaker opened meanwhile.
    Abandoned,
}

/// Bytes-in-flight gauge around a store fetch.
pub(crate) struct InFlight<'a> {
    metrics: &'a MountMetrics,
    bytes: u64,
}

impl<'a> InFlight<'a> {
    pub(crate) fn new(metrics: &'a MountMetrics, bytes: u64) -> Self {
        MountMetrics::add(&metrics.bytes_in_flight, bytes);
        MountMetrics::inc(&metrics.fetches_in_flight);
        InFlight { metrics, bytes }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        MountMetrics::sub(&self.metrics.bytes_in_flight, self.bytes);
        MountMetrics::sub(&self.metrics.fetches_in_flight, 1);
    }
}

#[cfg(test)]
mod tests {
    //! The fetch core against real tiers: an in-memory object store (`object_store`'s), a
    //! disk tier in a temporary directory, and a peer tier that lies.

    use std::sync::atomic::AtomicU32;

    use super::*;

    fn chunk_of(data: &[u8]) -> ChunkRef {
        ChunkRef {
            digest: Digest::of(data),
            len: u32::try_from(data.len()).unwrap(),
        }
    }

    async fn store_with(data: &[u8]) -> (ChunkStore, ChunkRef) {
        let store = ChunkStore::memory();
        let chunk = chunk_of(data);
        store
            .put_chunk(&chunk.digest, Bytes::copy_from_slice(data))
            .await
            .unwrap();
        (store, chunk)
    }

    fn cache_on(dir: Option<&std::path::Path>) -> NodeCache {
        NodeCache::new(&NodeCacheOptions {
            disk_dir: dir.map(|d| d.to_path_buf()),
            disk_bytes: 64 << 20,
            memory_bytes: 16 << 20,
            ..NodeCacheOptions::default()
        })
        .unwrap()
    }

    /// A peer tier that answers every ask with the same wrong bytes, and counts the asks.
    #[derive(Default)]
    struct LyingPeers {
        asks: AtomicU32,
    }

    impl PeerTier for LyingPeers {
        fn fetch(&self, chunk: ChunkRef) -> BoxFuture<'static, PeerAnswer> {
            self.asks.fetch_add(1, Ordering::Relaxed);
            let wrong = vec![0x5a; chunk.len as usize];
            async move { PeerAnswer::Chunk(Bytes::from(wrong)) }.boxed()
        }
    }

    #[tokio::test]
    async fn a_reader_gets_the_chunk_from_memory_disk_or_origin_in_that_order() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (store, chunk) = store_with(&data).await;
        let dir = tempfile::tempdir().unwrap();

        let cache = cache_on(Some(dir.path()));
        let got = cache.get(&store, &chunk).await.unwrap();
        assert_eq!(got, data);
        let s = cache.metrics().snapshot();
        assert_eq!((s.store_fetches, s.memory_misses, s.disk_misses), (1, 1, 1));
        // Again: memory.
        assert_eq!(cache.get(&store, &chunk).await.unwrap(), data);
        let s = cache.metrics().snapshot();
        assert_eq!((s.store_fetches, s.memory_hits), (1, 1));
        cache.flush().await;

        // A new process on the same disk: the disk tier, verified, no store fetch.
        let cache = cache_on(Some(dir.path()));
        assert_eq!(cache.get(&store, &chunk).await.unwrap(), data);
        let s = cache.metrics().snapshot();
        assert_eq!((s.store_fetches, s.disk_hits), (0, 1));
    }

    #[tokio::test]
    async fn a_peers_wrong_bytes_are_never_served_and_a_peer_is_never_asked_for_a_peer() {
        let data = vec![7u8; 100_000];
        let (store, chunk) = store_with(&data).await;

        // A reader: the lying peer is asked, caught, and the origin serves.
        let cache = cache_on(None);
        let peers = Arc::new(LyingPeers::default());
        assert!(cache.set_peers(peers.clone()));
        assert_eq!(cache.get(&store, &chunk).await.unwrap(), data);
        assert_eq!(peers.asks.load(Ordering::Relaxed), 1);
        let s = cache.metrics().snapshot();
        assert_eq!(
            (s.peer_corrupt, s.verification_failures, s.store_fetches),
            (1, 1, 1)
        );

        // Another node's request: origin only, and memory is left to this node's readers.
        let cache = cache_on(None);
        let peers = Arc::new(LyingPeers::default());
        assert!(cache.set_peers(peers.clone()));
        assert_eq!(cache.serve_peer(&store, &chunk).await.unwrap(), data);
        assert_eq!(peers.asks.load(Ordering::Relaxed), 0);
        assert!(!cache.inner.memory.contains(&chunk.digest));
        assert_eq!(cache.metrics().snapshot().store_fetches, 1);
    }

    #[tokio::test]
    async fn prefetch_and_assembly_fill_the_disk_not_memory() {
        let data = vec![3u8; 200_000];
        let (store, chunk) = store_with(&data).await;
        let dir = tempfile::tempdir().unwrap();
        let cache = cache_on(Some(dir.path()));
        cache.prefetch(&store, &chunk).await.unwrap();
        cache.flush().await;
        assert!(cache.on_disk(&chunk.digest));
        assert!(
            !cache.inner.memory.contains(&chunk.digest),
            "a prefetch filled memory"
        );
        // The flight leaves the table just after its disk write.
        let started = Instant::now();
        while cache.is_hot(&chunk.digest) {
            assert!(started.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let got = cache
            .fetch(&store, &chunk, Request::new(Want::Assembly))
            .await
            .unwrap();
        assert_eq!(got, data);
        assert!(
            !cache.inner.memory.contains(&chunk.digest),
            "an assembly filled memory"
        );
        let s = cache.metrics().snapshot();
        assert_eq!((s.store_fetches, s.disk_hits), (1, 1));
        // Neither counts as a reader's memory miss.
        assert_eq!(s.memory_misses, 0);
    }

    #[tokio::test]
    async fn a_lying_length_and_a_missing_chunk_are_answers_at_once() {
        let data = vec![1u8; 50_000];
        let (store, chunk) = store_with(&data).await;
        let cache = NodeCache::new(&NodeCacheOptions {
            fetch: FetchPolicy {
                retries: 3,
                backoff: Duration::from_secs(1),
                ..FetchPolicy::default()
            },
            ..NodeCacheOptions::default()
        })
        .unwrap();
        let longer = ChunkRef {
            len: chunk.len + 1,
            ..chunk
        };
        assert!(matches!(
            cache.get(&store, &longer).await,
            Err(FetchError::WrongLength { .. })
        ));
        // Not retried: a missing chunk is the store's answer, not its failure.
        let started = Instant::now();
        let absent = chunk_of(b"not in the store");
        assert!(matches!(
            cache.get(&store, &absent).await,
            Err(FetchError::Missing { .. })
        ));
        assert!(started.elapsed() < Duration::from_millis(500));
        assert_eq!(cache.metrics().snapshot().store_errors, 1);
    }

    /// The pauses between attempts are jittered (two schedules differ) and stay within the
    /// unjittered schedule they replaced: pause n in [b/2, b), b = min(200 ms * 2^n, 2 s),
    /// so `worst_case` and the documented read bound hold.
    #[test]
    fn retry_pauses_are_jittered_within_the_documented_bound() {
        let policy = FetchPolicy::default();
        let a: Vec<Duration> = policy.pauses().schedule_seeded(1).take(8).collect();
        let b: Vec<Duration> = policy.pauses().schedule_seeded(2).take(8).collect();
        assert_ne!(a, b, "two nodes' retries in lockstep");
        for pauses in [&a, &b] {
            let mut bound = policy.backoff;
            for (n, pause) in pauses.iter().enumerate() {
                let cap = bound.min(MAX_PAUSE);
                assert!(
                    *pause >= cap / 2 && *pause < cap,
                    "pause {n} = {pause:?} outside [{:?}, {cap:?})",
                    cap / 2
                );
                bound = bound.saturating_mul(2);
            }
        }
        // docs/mount.md: `--timeout 3 --retries 1` gives 6.2 s.
        let documented = FetchPolicy {
            attempt_timeout: Duration::from_secs(3),
            retries: 1,
            ..FetchPolicy::default()
        };
        assert_eq!(documented.worst_case(), Duration::from_millis(6200));
        let many = FetchPolicy {
            attempt_timeout: Duration::from_secs(1),
            retries: 5,
            ..FetchPolicy::default()
        };
        // 6 s of attempts + 0.2 + 0.4 + 0.8 + 1.6 + 2 s of pauses.
        assert_eq!(many.worst_case(), Duration::from_millis(11_000));
    }
}
