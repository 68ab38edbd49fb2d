//! How far readahead may run: the node's readahead budget, the ceiling memory alone can
//! hold, and each store link's bandwidth-delay product.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::NodeCache;
use crate::link::Link;
use crate::metrics::MountMetrics;

impl NodeCache {
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

    pub(crate) fn budget(&self) -> &ReadaheadBudget {
        &self.inner.budget
    }
}

/// The node-wide bound on bytes being read ahead (`--prefetch-memory`: the flag keeps its
/// name). Its counters are the `prefetch_*` readahead metrics.
pub(crate) struct ReadaheadBudget {
    cap: u64,
    used: AtomicU64,
    metrics: Arc<MountMetrics>,
}

impl ReadaheadBudget {
    pub fn new(cap: u64, metrics: Arc<MountMetrics>) -> Self {
        ReadaheadBudget {
            cap,
            used: AtomicU64::new(0),
            metrics,
        }
    }

    /// The bound, bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    pub fn try_acquire(&self, bytes: u64) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used + bytes > self.cap {
                MountMetrics::inc(&self.metrics.prefetch_skipped);
                return false;
            }
            match self.used.compare_exchange_weak(
                used,
                used + bytes,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    MountMetrics::add(&self.metrics.prefetch_bytes_in_flight, bytes);
                    MountMetrics::inc(&self.metrics.prefetch_issued);
                    return true;
                }
                Err(now) => used = now,
            }
        }
    }

    pub fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        MountMetrics::sub(&self.metrics.prefetch_bytes_in_flight, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_global_and_bounded() {
        let budget = ReadaheadBudget::new(10, Arc::new(MountMetrics::default()));
        assert!(budget.try_acquire(6));
        assert!(!budget.try_acquire(6));
        assert!(budget.try_acquire(4));
        budget.release(6);
        assert!(budget.try_acquire(5));
    }
}
