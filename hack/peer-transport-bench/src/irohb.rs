//! Transport B: iroh-blobs over an iroh endpoint bound to 127.0.0.1 only, with no relay and
//! no address lookup (the asker dials the server's id at its direct address). The server
//! holds the chunks in a `MemStore`; the asker uses `get_blob` on one connection, one QUIC
//! stream per chunk, BLAKE3 (bao) verified while it streams, and keeps no store of its own
//! (the mount keeps the bytes, as with HTTP/2).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use iroh::endpoint::{Connection, presets};
use iroh::protocol::Router;
use iroh::{Endpoint, EndpointAddr, EndpointId, RelayMode};
use iroh_blobs::store::mem::MemStore;
use iroh_blobs::{BlobsProtocol, Hash};

use crate::data::Chunk;

// The HTTP/2 side's request and body bounds, together.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(13);

async fn loopback_endpoint() -> anyhow::Result<Endpoint> {
    Ok(Endpoint::builder(presets::Minimal)
        .clear_ip_transports()
        .bind_addr("127.0.0.1:0")?
        .relay_mode(RelayMode::Disabled)
        .bind()
        .await?)
}

pub struct Server {
    pub router: Router,
    pub id: EndpointId,
    pub addr: SocketAddr,
    _store: MemStore,
}

pub async fn serve(chunks: Vec<Chunk>) -> anyhow::Result<Server> {
    let store = MemStore::new();
    for chunk in chunks {
        let tag = store.add_bytes(chunk.data).await?;
        // The claim that lets iroh-blobs serve our chunks unchanged: a blob's hash is the
        // plain BLAKE3 digest of its bytes, our chunk key.
        if tag.hash != Hash::from(chunk.key) {
            bail!("iroh-blobs hashed chunk {} as {}", chunk.key, tag.hash);
        }
    }
    let endpoint = loopback_endpoint().await?;
    let id = endpoint.id();
    let addr = endpoint
        .bound_sockets()
        .into_iter()
        .find(SocketAddr::is_ipv4)
        .context("the endpoint bound no IPv4 socket")?;
    let blobs = BlobsProtocol::new(&store, None);
    let router = Router::builder(endpoint)
        .accept(iroh_blobs::ALPN, blobs)
        .spawn();
    Ok(Server {
        router,
        id,
        addr,
        _store: store,
    })
}

pub async fn client() -> anyhow::Result<Endpoint> {
    loopback_endpoint().await
}

pub async fn connect(
    endpoint: &Endpoint,
    id: &str,
    addr: SocketAddr,
) -> anyhow::Result<Connection> {
    let id: EndpointId = id.parse()?;
    Ok(endpoint
        .connect(EndpointAddr::new(id).with_ip_addr(addr), iroh_blobs::ALPN)
        .await?)
}

/// Fetches every chunk at `concurrency` on `connection`; per-chunk latencies in seconds.
pub async fn fetch_all(
    connection: &Connection,
    keys: &[(blake3::Hash, usize)],
    concurrency: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut latencies = Vec::with_capacity(keys.len());
    let mut results = futures::stream::iter(keys.iter().map(|&(key, len)| {
        let connection = connection.clone();
        async move {
            let start = Instant::now();
            let get = iroh_blobs::get::request::get_blob(connection, Hash::from(key));
            let data = tokio::time::timeout(CHUNK_TIMEOUT, get.bytes())
                .await
                .context("no chunk within the bound")??;
            // Verified against `key` while streaming; only the length is left to check.
            if data.len() != len {
                bail!("chunk {key}: {} of {len} bytes", data.len());
            }
            Ok(start.elapsed().as_secs_f64())
        }
    }))
    .buffer_unordered(concurrency);
    while let Some(latency) = results.next().await {
        latencies.push(latency?);
    }
    Ok(latencies)
}
