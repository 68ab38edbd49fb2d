//! How far readahead may run: the node's readahead budget, the ceiling memory alone can
//! hold, and each store link's bandwidth-delay product.

use std::sync::Arc;

use super::NodeCache;
use crate::link::Link;
use crate::readahead::ReadaheadBudget;

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
