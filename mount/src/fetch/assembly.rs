//! Background assemblies of whole files on disk (`crate::hydrate`): their chunks fetched
//! without filling memory, and counted so that an unmount can let them finish.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::{ChunkRef, ChunkStore, Digest};

use super::{NodeCache, Request, Want};
use crate::error::FetchError;

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

impl NodeCache {
    /// Assemblies of whole files under way (`crate::hydrate`), by file BLAKE3.
    pub(crate) fn assembling(&self) -> &Mutex<HashSet<Digest>> {
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
}
