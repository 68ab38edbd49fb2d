//! Single flight: one fetch per chunk however many readers want it, run as its own task
//! (a reader giving up does not cancel it for the others), through the disk, peer and origin
//! tiers in that order, and the disk write that follows off the readers' path.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use sealed_store::{ChunkRef, ChunkStore, Digest};
use tokio::sync::OwnedSemaphorePermit;

use super::origin::InFlight;
use super::{NodeCache, Want};
use crate::cold_start::ColdStart;
use crate::error::FetchError;
use crate::metrics::{MountMetrics, Tier};
use crate::peer::Route;

/// A fetch in flight, shared by every request that joins it.
pub(super) type Flight = Shared<BoxFuture<'static, Result<Bytes, FetchError>>>;

impl NodeCache {
    /// True if the chunk is in memory or being fetched: readahead need not ask for it.
    pub(crate) fn is_hot(&self, digest: &Digest) -> bool {
        self.inner.memory.contains(digest) || self.inner.inflight.lock().contains_key(digest)
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

    pub(super) async fn fetch_uncached(
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
}
