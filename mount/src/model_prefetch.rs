//! The per-mount state of the model-aware prefetch (`crate::prefetch`): whether it is on,
//! which files had theirs, and its bounds. The filesystem holds it; the prefetch, which
//! reads through the filesystem, works on it.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;

/// Header bytes the mount holds at once while reading and parsing headers, MiB: a small
/// header never waits, one at the cap ([`model_header::MAX_HEADER_BYTES`]) waits its turn.
const HEADER_MEMORY_MIB: usize = 128;

/// The model-aware prefetch of one mount: whether it is on, which files had theirs, and the
/// bounds on what it has in flight.
pub(crate) struct ModelPrefetch {
    enabled: AtomicBool,
    /// Files (inodes) whose prefetch is running or done. One that failed to read its header
    /// or fetch a chunk (a store outage) leaves, so that a later open tries again.
    pub(crate) files: Mutex<HashSet<u64>>,
    /// Running prefetches, aborted when the mount ends.
    pub(crate) tasks: Mutex<Vec<AbortHandle>>,
    /// Model-prefetch fetches the mount may have in flight, over all files: half its fetch
    /// slots, so that readers of other files always find slots.
    pub(crate) slots: Arc<Semaphore>,
    /// [`HEADER_MEMORY_MIB`], in MiB permits.
    pub(crate) header_memory: Arc<Semaphore>,
}

impl ModelPrefetch {
    /// Off, for a mount with `fetches_per_mount` fetch slots.
    pub(crate) fn new(fetches_per_mount: usize) -> ModelPrefetch {
        ModelPrefetch {
            enabled: AtomicBool::new(false),
            files: Mutex::new(HashSet::new()),
            tasks: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new((fetches_per_mount / 2).max(1))),
            header_memory: Arc::new(Semaphore::new(HEADER_MEMORY_MIB)),
        }
    }

    pub(crate) fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Release);
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Aborts every running model prefetch (the mount is ending).
    pub(crate) fn stop(&self) {
        self.set_enabled(false);
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }
}
