//! Transport A, as `sealed-peer` does it (peer/src/server.rs, peer/src/client.rs): axum
//! answering `GET /v1/chunks/<64 hex>?len=N` with a bearer token over h2c, and a reqwest
//! client with prior knowledge and the peer client's builder settings and time bounds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::data::Chunk;

pub const TOKEN: &str = "peer-transport-bench-token-0123456789abcdef";
// The peer tier's defaults (PeerOptions::new, server.rs).
const MAX_CONCURRENT_SERVES: usize = 64;
const SLOT_WAIT: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
struct ServerState {
    chunks: Arc<HashMap<blake3::Hash, Bytes>>,
    token: blake3::Hash,
    slots: Arc<Semaphore>,
}

#[derive(Deserialize)]
struct ChunkQuery {
    len: u64,
}

pub async fn listen(chunks: Vec<Chunk>) -> anyhow::Result<(TcpListener, Router)> {
    let state = ServerState {
        chunks: Arc::new(chunks.into_iter().map(|c| (c.key, c.data)).collect()),
        token: blake3::hash(TOKEN.as_bytes()),
        slots: Arc::new(Semaphore::new(MAX_CONCURRENT_SERVES)),
    };
    let router = Router::new()
        .route("/v1/chunks/{digest}", get(chunk))
        .with_state(state);
    Ok((TcpListener::bind("127.0.0.1:0").await?, router))
}

// The same steps as the peer server's handler: token, parse, a bounded slot, headers first
// and the body as a one-item stream.
async fn chunk(
    State(state): State<ServerState>,
    Path(digest): Path<String>,
    query: Result<Query<ChunkQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "));
    // Constant time in the token, as PeerToken::admits.
    if auth.map(|t| blake3::hash(t.as_bytes())) != Some(state.token) {
        return (StatusCode::UNAUTHORIZED, "a peer token is required\n").into_response();
    }
    let key = (digest.len() == 64)
        .then(|| blake3::Hash::from_hex(&digest).ok())
        .flatten();
    let (Some(key), Ok(Query(q))) = (key, query) else {
        return (StatusCode::BAD_REQUEST, "want /v1/chunks/<64 hex>?len=N\n").into_response();
    };
    let Some(data) = state.chunks.get(&key).cloned() else {
        return (StatusCode::NOT_FOUND, "no such chunk\n").into_response();
    };
    if data.len() as u64 != q.len {
        return (StatusCode::BAD_REQUEST, "wrong length\n").into_response();
    }
    let slot = tokio::time::timeout(SLOT_WAIT, state.slots.clone().acquire_owned()).await;
    let Ok(Ok(slot)) = slot else {
        return (StatusCode::SERVICE_UNAVAILABLE, "too many peer requests\n").into_response();
    };
    let len = data.len();
    let body = futures::stream::once(async move {
        let _slot = slot;
        Ok::<_, std::io::Error>(data)
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// PeerClient::new's builder, unchanged (no window sizes or keep-alive are set there), with
/// its TLS config; over TLS the fleet name resolves to the server's address.
pub fn client(
    tls: rustls::ClientConfig,
    resolve: Option<std::net::SocketAddr>,
) -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder()
        .http2_prior_knowledge()
        .use_preconfigured_tls(tls)
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(Duration::from_secs(90));
    if let Some(addr) = resolve {
        builder = builder.resolve(crate::tls::NAME, addr);
    }
    Ok(builder.build()?)
}

/// Fetches every chunk at `concurrency`, verifying each; per-chunk latencies in seconds.
pub async fn fetch_all(
    client: &reqwest::Client,
    base: &str,
    keys: &[(blake3::Hash, usize)],
    concurrency: usize,
) -> anyhow::Result<Vec<f64>> {
    let auth = format!("Bearer {TOKEN}");
    let mut latencies = Vec::with_capacity(keys.len());
    let mut results = futures::stream::iter(keys.iter().map(|&(key, len)| {
        let url = format!("{base}/v1/chunks/{}?len={len}", key.to_hex());
        let auth = auth.clone();
        async move {
            let start = Instant::now();
            let response = tokio::time::timeout(
                REQUEST_TIMEOUT,
                client.get(url).header(header::AUTHORIZATION, auth).send(),
            )
            .await
            .context("no headers within the request bound")??;
            if response.status() != StatusCode::OK {
                bail!("answered {}", response.status());
            }
            if response.content_length().is_some_and(|n| n != len as u64) {
                bail!("announced {:?} bytes", response.content_length());
            }
            let body = tokio::time::timeout(BODY_TIMEOUT, read_body(response, len))
                .await
                .context("no body within the body bound")??;
            // The asker's check: the bytes are the chunk the key names.
            if blake3::hash(&body) != key {
                bail!("chunk {key} failed verification");
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

// As the peer client's read_body: exactly `want` bytes, never more in memory.
async fn read_body(mut response: reqwest::Response, want: usize) -> anyhow::Result<Bytes> {
    let mut body = BytesMut::with_capacity(want);
    while let Some(part) = response.chunk().await? {
        if body.len().saturating_add(part.len()) > want {
            bail!("sent more than the chunk's {want} bytes");
        }
        body.extend_from_slice(&part);
    }
    if body.len() != want {
        bail!("sent {} of the chunk's {want} bytes", body.len());
    }
    Ok(body.freeze())
}
