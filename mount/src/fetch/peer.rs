//! The peer tier as the fetch core sees it: asking other nodes (their bytes verified here,
//! never trusted) and serving them (never from the peer tier again).

use std::sync::Arc;

use bytes::Bytes;
use sealed_store::{ChunkRef, ChunkStore, Digest};

use super::{NodeCache, Request, Want};
use crate::error::FetchError;
use crate::metrics::MountMetrics;
use crate::peer::{PeerAnswer, PeerTier};

impl NodeCache {
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

    /// The chunk from the peer tier, verified here against its digest and length; `None`
    /// (fetch from the origin) if no peer had it or a peer's bytes were wrong.
    pub(super) async fn fetch_from_peer(
        &self,
        peers: &dyn PeerTier,
        chunk: &ChunkRef,
    ) -> Option<Bytes> {
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
}
