//! Transports A and C: the peer tier itself, not a copy of it. The server is
//! `sealed_peer::server::router` over a `NodeCache` that holds every chunk in its memory
//! tier, served by `server::serve` (h2c, TCP_NODELAY) or `server::serve_tls` (mTLS, the
//! fleet name checked); the fetcher is a `sealed_peer::PeerClient` whose membership is the
//! server alone, so it asks the server for every chunk with the tier's own bounds, and each
//! answer is verified as the mount verifies it.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use axum::Router;
use futures::StreamExt;
use sealed_mount::{NodeCache, NodeCacheOptions, PeerAnswer, PeerTier};
use sealed_peer::membership::{self, Membership};
use sealed_peer::{PeerClient, PeerMetrics, PeerOptions, PeerTls, PeerToken};
use sealed_store::{ChunkRef, ChunkStore, Digest};
use tokio::net::TcpListener;

use crate::data::Chunk;

pub const TOKEN: &str = "peer-transport-bench-token-0123456789abcdef";
/// The fetcher's own address in the membership: not a member, so a requester of every chunk.
const FETCHER: &str = "127.0.0.1:1";

pub struct Served {
    pub listener: TcpListener,
    pub router: Router,
    pub metrics: Arc<PeerMetrics>,
    /// The server's membership source (itself alone), kept for as long as it serves.
    pub members: Membership,
}

fn chunk_ref(key: &blake3::Hash, len: usize) -> anyhow::Result<ChunkRef> {
    Ok(ChunkRef {
        digest: Digest::from_bytes(*key.as_bytes()),
        len: u32::try_from(len).context("chunk length")?,
    })
}

/// The tier's server state over `chunks`, all of them in the memory tier before it answers.
pub async fn listen(chunks: Vec<Chunk>) -> anyhow::Result<Served> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let total: u64 = chunks.iter().map(|c| c.data.len() as u64).sum();
    let cache = NodeCache::new(&NodeCacheOptions {
        memory_bytes: total + (64 << 20),
        ..Default::default()
    })?;
    let store = ChunkStore::from_object_store(
        Arc::new(object_store::memory::InMemory::new()),
        "peer-transport-bench",
    );
    for c in &chunks {
        let chunk = chunk_ref(&c.key, c.data.len())?;
        store.put_chunk(&chunk.digest, c.data.clone()).await?;
        // Through the read path, so the memory tier holds it as after a node's own read.
        cache.get(&store, &chunk).await?;
    }
    let options = PeerOptions::new(addr, addr.to_string(), PeerToken::new(TOKEN)?);
    let metrics = Arc::new(PeerMetrics::default());
    let members = membership::fixed(vec![addr.to_string()], options.fanout);
    let router = sealed_peer::server::router(
        &options,
        cache,
        store,
        members.view.clone(),
        metrics.clone(),
    );
    Ok(Served {
        listener,
        router,
        metrics,
        members,
    })
}

/// The tier's client, with the tier's default bounds, asking `server` for everything.
pub fn client(server: &str, tls: Option<PeerTls>) -> anyhow::Result<(PeerClient, Membership)> {
    let mut options = PeerOptions::new(
        "127.0.0.1:0".parse()?,
        FETCHER.to_owned(),
        PeerToken::new(TOKEN)?,
    );
    options.tls = tls;
    let members = membership::fixed(vec![server.to_owned()], options.fanout);
    let client = PeerClient::new(
        &options,
        members.view.clone(),
        Arc::new(PeerMetrics::default()),
    )?;
    Ok((client, members))
}

/// Fetches every chunk at `concurrency` through the tier's client, verifying each; per-chunk
/// latencies in seconds. A chunk the tier did not deliver is an error: the bench measures a
/// transport that answers.
pub async fn fetch_all(
    client: &PeerClient,
    keys: &[(blake3::Hash, usize)],
    concurrency: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut latencies = Vec::with_capacity(keys.len());
    let mut results = futures::stream::iter(keys.iter().map(|&(key, len)| async move {
        let chunk = chunk_ref(&key, len)?;
        let start = Instant::now();
        let data = match client.fetch(chunk).await {
            PeerAnswer::Chunk(data) => data,
            PeerAnswer::Missed => bail!("the server did not deliver chunk {key}"),
            PeerAnswer::OwnedHere => bail!("the fetcher thinks it owns chunk {key}"),
        };
        // The asker's check (sealed_mount::PeerTier's contract): the bytes are the chunk.
        if data.len() != len || blake3::hash(&data) != key {
            bail!("chunk {key} failed verification");
        }
        Ok(start.elapsed().as_secs_f64())
    }))
    .buffer_unordered(concurrency);
    while let Some(latency) = results.next().await {
        latencies.push(latency?);
    }
    Ok(latencies)
}
