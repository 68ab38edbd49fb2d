//! The seam for a tier between the node disk cache and the origin store: other nodes' caches.
//!
//! [`NodeCache`](crate::NodeCache) asks its [`PeerTier`] (if one is set) for a chunk it has
//! in neither memory nor disk, before the store. Whatever a peer answers is checked here, in
//! the mount crate, against the chunk's BLAKE3 digest and declared length before it is used:
//! a peer can make a fetch slower, never wrong. A wrong answer is counted
//! (`peer_corrupt`, `verification_failures`) and the chunk is fetched from the origin.
//!
//! The tier itself (membership, owner choice, transport) lives in the `sealed-peer` crate,
//! so that it can be replaced (a Dragonfly backend, say) without touching the read path.

use bytes::Bytes;
use futures::future::BoxFuture;
use sealed_store::ChunkRef;

/// What the peer tier answered for a chunk.
#[derive(Debug)]
pub enum PeerAnswer {
    /// A peer's bytes (checked by the caller before use).
    Chunk(Bytes),
    /// This node owns the chunk (or has no peers): it is fetched from the origin by design.
    OwnedHere,
    /// A peer was asked and did not help (failed, too slow, down, busy): the origin instead.
    Missed,
}

/// Other nodes' caches, asked before the origin.
pub trait PeerTier: Send + Sync + 'static {
    /// A peer's bytes of `chunk`, or why the origin must serve it. An implementation bounds
    /// its own time: the reader waits for this before it falls back to the origin.
    fn fetch(&self, chunk: ChunkRef) -> BoxFuture<'static, PeerAnswer>;
}

/// Where a fetch that misses both local tiers may go next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// A local reader (or prefetch): the peer tier, then the origin.
    PeersThenOrigin,
    /// A peer asked this node for the chunk: the origin only, so that a request never
    /// bounces between nodes whose views of the membership differ.
    OriginOnly,
}
