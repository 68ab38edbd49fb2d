//! Counters for the node plugin's metrics: a plain struct of atomics, so the CSI driver can
//! export them to Prometheus without this crate knowing about Prometheus.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Shared by every mount that uses the same [`crate::NodeCache`].
#[derive(Debug, Default)]
pub struct MountMetrics {
    /// Chunk lookups answered by the in-memory tier (readahead lands there).
    pub memory_hits: AtomicU64,
    pub memory_misses: AtomicU64,
    /// Chunk lookups answered by the node disk cache.
    pub disk_hits: AtomicU64,
    pub disk_misses: AtomicU64,
    /// Chunks and bytes fetched from the object store.
    pub store_fetches: AtomicU64,
    pub store_bytes_fetched: AtomicU64,
    /// Fetches from the object store that ended in an error (after retries).
    pub store_errors: AtomicU64,
    /// Single attempts that hit the per-attempt timeout.
    pub store_timeouts: AtomicU64,
    /// Fetches failed at once because the store's circuit breaker was open (or opened while
    /// they waited), instead of waiting out the timeout again.
    pub store_fast_failures: AtomicU64,
    /// Times a store's circuit breaker opened.
    pub breaker_opens: AtomicU64,
    /// Fetches from the object store under way right now (a gauge, bounded per mount by
    /// `MountLimits::max_fetches_per_mount`).
    pub fetches_in_flight: AtomicU64,
    /// Sum and count of successful object-store fetch latencies, in microseconds.
    pub fetch_latency_us_sum: AtomicU64,
    pub fetch_latency_us_max: AtomicU64,
    /// Chunks whose bytes did not match their digest (store or disk); never served.
    pub verification_failures: AtomicU64,
    /// Bytes being fetched from the object store right now (a gauge).
    pub bytes_in_flight: AtomicU64,
    /// Readahead bytes fetched ahead of readers right now (a gauge, bounded by the budget).
    pub prefetch_bytes_in_flight: AtomicU64,
    /// The largest readahead window a read was allowed last (a gauge): the configured one,
    /// or twice the store link's bandwidth-delay product when larger (`crate::link`).
    pub readahead_window_bytes: AtomicU64,
    /// Readahead chunks skipped because the global prefetch budget was spent.
    pub prefetch_skipped: AtomicU64,
    /// Readahead chunks issued.
    pub prefetch_issued: AtomicU64,
    /// Bytes held by the disk cache and evictions it made (gauge, counter).
    pub disk_cache_bytes: AtomicU64,
    pub disk_evictions: AtomicU64,
    /// The cache filesystem's free bytes at the last check (a gauge), and entries not cached
    /// because writing them would have left less than its free-space floor (`cache::free_space`).
    pub cache_filesystem_free_bytes: AtomicU64,
    pub cache_free_space_refusals: AtomicU64,
    /// Bytes held by the memory tier (a gauge).
    pub memory_cache_bytes: AtomicU64,
    /// Bytes returned to readers through `read`.
    pub bytes_read: AtomicU64,
    /// Reads answered with EIO.
    pub read_errors: AtomicU64,
    /// Chunks and bytes the peer tier served (verified), chunks a peer was asked for and did
    /// not serve (fetched from the origin instead; chunks this node owns are not counted),
    /// and chunks a peer served wrong (refetched from the origin).
    pub peer_hits: AtomicU64,
    pub peer_bytes_fetched: AtomicU64,
    pub peer_fallbacks: AtomicU64,
    pub peer_corrupt: AtomicU64,
    /// Opens of hydrated files answered with FUSE passthrough (reads never enter the daemon).
    pub passthrough_opens: AtomicU64,
    /// Opens of hydrated files served by the daemon because passthrough is unavailable (no
    /// kernel support, not root, the backing file refused).
    pub passthrough_fallbacks: AtomicU64,
    /// Files assembled into the disk cache and checked against their BLAKE3, and assemblies
    /// that failed (a chunk failed or the whole-file BLAKE3 did not match: nothing kept).
    pub files_hydrated: AtomicU64,
    pub hydration_failures: AtomicU64,
    /// Whole-file copies found on disk (hydrated files, single-chunk files' chunk files) that
    /// this process hashed and found right, their bytes, and the wall time of those checks
    /// (`crate::verify`); a copy found wrong counts in `verification_failures`.
    pub files_verified: AtomicU64,
    pub verified_bytes: AtomicU64,
    pub verify_micros: AtomicU64,
    /// Opens of a file whose copy on disk this process had not verified yet: served by the
    /// daemon at once, every chunk verified as it is read, while the copy's check runs in the
    /// background (`crate::verify`), instead of by passthrough.
    pub unverified_opens: AtomicU64,
    /// The background scrub of the disk cache: entries hashed again, their bytes, and those
    /// found damaged (dropped and fetched again; also in `verification_failures`).
    pub scrub_files: AtomicU64,
    pub scrub_bytes: AtomicU64,
    pub scrub_failures: AtomicU64,
    /// Chunks the model-aware prefetch fetched ahead of readers (chunks already local or in
    /// flight are not counted).
    pub model_prefetch_chunks: AtomicU64,
    /// Model files (`*.safetensors`, `*.gguf`) whose model-aware prefetch started fetching,
    /// once per file per mount (again after a failed attempt).
    pub model_prefetch_files: AtomicU64,
    /// Model headers refused (malformed, out of bounds, over a cap): those files were
    /// prefetched in plain order instead.
    pub model_header_failures: AtomicU64,
    /// Learned prefetch (`crate::learned`): stored profiles replayed by mounts, chunks they
    /// fetched ahead of readers (chunks already local or in flight are not counted), profiles
    /// this node recorded and stored (first writer only), and stores that failed.
    pub learned_profiles_replayed: AtomicU64,
    pub learned_prefetch_chunks: AtomicU64,
    pub learned_profiles_written: AtomicU64,
    pub learned_profile_write_failures: AtomicU64,
    /// Replays that stopped before the end of their profile: readers diverged from it, or
    /// went quiet before asking for enough to pay for the rest (`crate::learned`).
    pub learned_replays_stopped: AtomicU64,
    /// Stored profiles not used, by [`PROFILE_IGNORE_REASONS`].
    pub learned_profiles_ignored: [AtomicU64; 4],
    /// Latency of chunk lookups answered by each tier ([`Tier`]), successful ones only.
    pub chunk_fetch_seconds: [LatencyHistogram; 4],
}

/// Why a stored learned prefetch profile was not used (`ProfileError::reason`), as the
/// `reason` label of `sealed_learned_profiles_ignored_total`.
pub const PROFILE_IGNORE_REASONS: [&str; 4] = ["foreign", "corrupt", "oversized", "stale"];

/// The tiers a chunk comes from, as the `tier` label of `sealed_chunk_fetch_seconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Memory = 0,
    Disk = 1,
    Peer = 2,
    Origin = 3,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Memory, Tier::Disk, Tier::Peer, Tier::Origin];

    pub fn label(self) -> &'static str {
        match self {
            Tier::Memory => "memory",
            Tier::Disk => "disk",
            Tier::Peer => "peer",
            Tier::Origin => "origin",
        }
    }
}

/// Upper bounds of the latency buckets, seconds (Prometheus `le`; `+Inf` is implied): from
/// 10 µs (a memory hit) to 10 s (a store timing out).
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.00001, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 10.0,
];

/// A fixed-bucket latency histogram of atomics (no Prometheus dependency here).
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Observations per bucket (not cumulative); the last slot is above every bound.
    buckets: [AtomicU64; 17],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A copy of a [`LatencyHistogram`]: cumulative counts per bound of [`LATENCY_BUCKETS`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    pub cumulative: [u64; 16],
    pub count: u64,
    pub sum_seconds: f64,
}

impl LatencyHistogram {
    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        let slot = LATENCY_BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = [0u64; 16];
        let mut total = 0u64;
        for (i, c) in cumulative.iter_mut().enumerate() {
            total = total.saturating_add(self.buckets[i].load(Ordering::Relaxed));
            *c = total;
        }
        HistogramSnapshot {
            cumulative,
            count: self.count.load(Ordering::Relaxed),
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// A point-in-time copy of [`MountMetrics`], for printing and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MetricsSnapshot {
    pub memory_hits: u64,
    pub memory_misses: u64,
    pub disk_hits: u64,
    pub disk_misses: u64,
    pub store_fetches: u64,
    pub store_bytes_fetched: u64,
    pub store_errors: u64,
    pub store_timeouts: u64,
    pub store_fast_failures: u64,
    pub breaker_opens: u64,
    pub fetches_in_flight: u64,
    pub fetch_latency_us_sum: u64,
    pub fetch_latency_us_max: u64,
    pub verification_failures: u64,
    pub bytes_in_flight: u64,
    pub prefetch_bytes_in_flight: u64,
    pub readahead_window_bytes: u64,
    pub prefetch_skipped: u64,
    pub prefetch_issued: u64,
    pub disk_cache_bytes: u64,
    pub disk_evictions: u64,
    pub cache_filesystem_free_bytes: u64,
    pub cache_free_space_refusals: u64,
    pub memory_cache_bytes: u64,
    pub bytes_read: u64,
    pub read_errors: u64,
    pub peer_hits: u64,
    pub peer_bytes_fetched: u64,
    pub peer_fallbacks: u64,
    pub peer_corrupt: u64,
    pub passthrough_opens: u64,
    pub passthrough_fallbacks: u64,
    pub files_hydrated: u64,
    pub hydration_failures: u64,
    pub files_verified: u64,
    pub verified_bytes: u64,
    pub verify_micros: u64,
    pub unverified_opens: u64,
    pub scrub_files: u64,
    pub scrub_bytes: u64,
    pub scrub_failures: u64,
    pub model_prefetch_chunks: u64,
    pub model_prefetch_files: u64,
    pub model_header_failures: u64,
    pub learned_profiles_replayed: u64,
    pub learned_prefetch_chunks: u64,
    pub learned_profiles_written: u64,
    pub learned_profile_write_failures: u64,
    pub learned_replays_stopped: u64,
    /// By [`PROFILE_IGNORE_REASONS`].
    pub learned_profiles_ignored: [u64; 4],
}

impl MountMetrics {
    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        counter.fetch_sub(n, Ordering::Relaxed);
    }

    pub(crate) fn record_fetch_latency(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.fetch_latency_us_sum.fetch_add(us, Ordering::Relaxed);
        self.fetch_latency_us_max.fetch_max(us, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            memory_hits: g(&self.memory_hits),
            memory_misses: g(&self.memory_misses),
            disk_hits: g(&self.disk_hits),
            disk_misses: g(&self.disk_misses),
            store_fetches: g(&self.store_fetches),
            store_bytes_fetched: g(&self.store_bytes_fetched),
            store_errors: g(&self.store_errors),
            store_timeouts: g(&self.store_timeouts),
            store_fast_failures: g(&self.store_fast_failures),
            breaker_opens: g(&self.breaker_opens),
            fetches_in_flight: g(&self.fetches_in_flight),
            fetch_latency_us_sum: g(&self.fetch_latency_us_sum),
            fetch_latency_us_max: g(&self.fetch_latency_us_max),
            verification_failures: g(&self.verification_failures),
            bytes_in_flight: g(&self.bytes_in_flight),
            prefetch_bytes_in_flight: g(&self.prefetch_bytes_in_flight),
            readahead_window_bytes: g(&self.readahead_window_bytes),
            prefetch_skipped: g(&self.prefetch_skipped),
            prefetch_issued: g(&self.prefetch_issued),
            disk_cache_bytes: g(&self.disk_cache_bytes),
            disk_evictions: g(&self.disk_evictions),
            cache_filesystem_free_bytes: g(&self.cache_filesystem_free_bytes),
            cache_free_space_refusals: g(&self.cache_free_space_refusals),
            memory_cache_bytes: g(&self.memory_cache_bytes),
            bytes_read: g(&self.bytes_read),
            read_errors: g(&self.read_errors),
            peer_hits: g(&self.peer_hits),
            peer_bytes_fetched: g(&self.peer_bytes_fetched),
            peer_fallbacks: g(&self.peer_fallbacks),
            peer_corrupt: g(&self.peer_corrupt),
            passthrough_opens: g(&self.passthrough_opens),
            passthrough_fallbacks: g(&self.passthrough_fallbacks),
            files_hydrated: g(&self.files_hydrated),
            hydration_failures: g(&self.hydration_failures),
            files_verified: g(&self.files_verified),
            verified_bytes: g(&self.verified_bytes),
            verify_micros: g(&self.verify_micros),
            unverified_opens: g(&self.unverified_opens),
            scrub_files: g(&self.scrub_files),
            scrub_bytes: g(&self.scrub_bytes),
            scrub_failures: g(&self.scrub_failures),
            model_prefetch_chunks: g(&self.model_prefetch_chunks),
            model_prefetch_files: g(&self.model_prefetch_files),
            model_header_failures: g(&self.model_header_failures),
            learned_profiles_replayed: g(&self.learned_profiles_replayed),
            learned_prefetch_chunks: g(&self.learned_prefetch_chunks),
            learned_profiles_written: g(&self.learned_profiles_written),
            learned_profile_write_failures: g(&self.learned_profile_write_failures),
            learned_replays_stopped: g(&self.learned_replays_stopped),
            learned_profiles_ignored: self.learned_profiles_ignored.each_ref().map(g),
        }
    }

    /// A stored profile was ignored for `reason` (one of [`PROFILE_IGNORE_REASONS`]).
    pub(crate) fn count_ignored_profile(&self, reason: &str) {
        let slot = PROFILE_IGNORE_REASONS
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(1);
        Self::inc(&self.learned_profiles_ignored[slot]);
    }

    /// The chunk-fetch latency histogram of one tier.
    pub fn chunk_fetch_histogram(&self, tier: Tier) -> HistogramSnapshot {
        self.chunk_fetch_seconds[tier as usize].snapshot()
    }

    pub(crate) fn observe_fetch(&self, tier: Tier, elapsed: Duration) {
        self.chunk_fetch_seconds[tier as usize].observe(elapsed);
    }
}
