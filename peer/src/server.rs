//! The owning side: `GET /v1/chunks/<64 hex>?len=N` with the fleet's token (and `GET
//! /v1/ping`, 204 with the token: an asker that could not reach this node probes it with
//! that, `crate::client`). Answers from the
//! node's own tiers through [`NodeCache::serve_peer`] (memory, disk, or the origin once,
//! shared with local readers), so every byte it sends has been verified here. A secondary
//! owner of a chunk asks the primary first, through its own read path (`NodeCache::get`,
//! which verifies the primary's bytes); one hop only: a request marked as the last hop is
//! never passed on. Over h2c ([`serve`]) or TLS with client certificates ([`serve_tls`],
//! `crate::tls`); the token is required either way.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt as _;
use sealed_mount::NodeCache;
use sealed_service::listen::{self, ConnLimits, Gate, Protocols};
use sealed_store::{ChunkRef, ChunkStore, Digest};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::metrics::PeerMetrics;
use crate::pace::UploadPacer;
use crate::ring::{Member, RingView, Role};
use crate::tls::PeerTls;
use crate::token::PeerToken;
use crate::{HOP_HEADER, PeerOptions};

/// Largest chunk a peer asks for: the chunker's own bound.
const MAX_CHUNK_LEN: u64 = sealed_store::bounded::MAX_CHUNK_BYTES;
/// How long a request waits for one of the bounded answer slots before it is told 503.
const SLOT_WAIT: Duration = Duration::from_secs(1);

#[derive(Clone)]
struct ServerState {
    cache: NodeCache,
    store: ChunkStore,
    me: Member,
    ring: RingView,
    token: PeerToken,
    /// Requests being answered at once; one more is told 503 (the asker goes to the origin).
    slots: Arc<Semaphore>,
    serve_timeout: Duration,
    /// The upload cap, shared by every answer (`None`: none).
    pacer: Option<Arc<UploadPacer>>,
    metrics: Arc<PeerMetrics>,
}

#[derive(Deserialize)]
struct ChunkQuery {
    len: u64,
}

/// The router, for [`serve`] and for tests that put it behind their own listener.
pub fn router(
    options: &PeerOptions,
    cache: NodeCache,
    store: ChunkStore,
    ring: RingView,
    metrics: Arc<PeerMetrics>,
) -> Router {
    let state = ServerState {
        cache,
        store,
        me: Member::new(options.advertise.clone()),
        ring,
        token: options.token.clone(),
        slots: Arc::new(Semaphore::new(options.max_concurrent_serves.max(1))),
        serve_timeout: options.serve_timeout,
        pacer: options
            .upload_rate
            .map(|rate| Arc::new(UploadPacer::new(rate, metrics.clone()))),
        metrics,
    };
    Router::new()
        .route("/v1/chunks/{digest}", get(chunk))
        .route(crate::PING_PATH, get(ping))
        .with_state(state)
}

/// Serves `router` on `listener` (HTTP/2 with prior knowledge, and HTTP/1.1) until the
/// task is dropped or aborted, with the peer port's default connection bounds.
pub async fn serve(listener: TcpListener, router: Router) -> std::io::Result<()> {
    serve_with_limits(listener, router, ConnLimits::peer()).await
}

/// [`serve`] with these connection bounds: caps in total and per source address, the
/// descriptors' budget, header and idle deadlines ([`sealed_service::listen`]).
/// `TCP_NODELAY` on every accepted socket: without it the tail of a response waits for the
/// asker's delayed ACK (40 ms), which a lone reader hits every few chunks (p99 47 ms instead
/// of 5.9 ms for 1 MiB chunks; docs/peer.md, "Measured against iroh-blobs").
pub async fn serve_with_limits(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
) -> std::io::Result<()> {
    let gate = Gate::new("peer", limits);
    listen::accept_loop(
        listener,
        gate.clone(),
        std::future::pending(),
        move |tcp, remote, admitted| {
            let (router, gate) = (router.clone(), gate.clone());
            async move {
                let _admitted = admitted;
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY on a peer connection");
                }
                listen::serve_connection(tcp, remote, router, &gate, Protocols::Http1AndH2c).await;
            }
        },
    )
    .await
}

/// Serves `router` on `listener` over TLS (HTTP/2, ALPN `h2`; a client certificate of the
/// fleet required) until the task is dropped or aborted, with the peer port's default
/// connection bounds.
pub async fn serve_tls(
    listener: TcpListener,
    router: Router,
    tls: &PeerTls,
    metrics: Arc<PeerMetrics>,
) -> std::io::Result<()> {
    serve_tls_with_limits(listener, router, tls, metrics, ConnLimits::peer()).await
}

/// [`serve_tls`] with these connection bounds. A handshake waits for one of
/// `limits.max_handshakes` slots and must be done, the wait included, within
/// `limits.handshake_timeout` ([`crate::tls::HANDSHAKE_TIMEOUT`] by default), or the connection is closed.
pub async fn serve_tls_with_limits(
    listener: TcpListener,
    router: Router,
    tls: &PeerTls,
    metrics: Arc<PeerMetrics>,
    limits: ConnLimits,
) -> std::io::Result<()> {
    let acceptor = tls.acceptor();
    let gate = Gate::new("peer", limits);
    listen::accept_loop(
        listener,
        gate.clone(),
        std::future::pending(),
        move |tcp, remote, admitted| {
            let (acceptor, router, metrics, gate) = (
                acceptor.clone(),
                router.clone(),
                metrics.clone(),
                gate.clone(),
            );
            async move {
                let _admitted = admitted;
                let _ = tcp.set_nodelay(true);
                let Some(stream) = gate.handshake(remote, acceptor.accept(tcp)).await else {
                    PeerMetrics::inc(&metrics.tls_refused);
                    return;
                };
                listen::serve_connection(stream, remote, router, &gate, Protocols::Http2).await;
            }
        },
    )
    .await
}

/// 204 to a peer with the fleet's token: this node is up and reachable (its connection and
/// TLS work). Costs nothing else: no chunk, no origin.
async fn ping(State(state): State<ServerState>, headers: HeaderMap) -> Response {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !state.token.admits(auth) {
        PeerMetrics::inc(&state.metrics.served_rejected);
        return (StatusCode::UNAUTHORIZED, "a peer token is required\n").into_response();
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn chunk(
    State(state): State<ServerState>,
    Path(digest): Path<String>,
    query: Result<Query<ChunkQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let metrics = &state.metrics;
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !state.token.admits(auth) {
        PeerMetrics::inc(&metrics.served_rejected);
        return (StatusCode::UNAUTHORIZED, "a peer token is required\n").into_response();
    }
    let Some(chunk) = parse_request(&digest, query.ok().map(|q| q.0)) else {
        PeerMetrics::inc(&metrics.served_rejected);
        return (
            StatusCode::BAD_REQUEST,
            "want /v1/chunks/<64 hex>?len=<1..=4MiB>\n",
        )
            .into_response();
    };
    // A short wait for a slot (queued requests hold no chunk bytes), then 503.
    let slot = tokio::time::timeout(SLOT_WAIT, state.slots.clone().acquire_owned()).await;
    let Ok(Ok(slot)) = slot else {
        PeerMetrics::inc(&metrics.served_busy);
        return (StatusCode::SERVICE_UNAVAILABLE, "too many peer requests\n").into_response();
    };
    let last_hop = headers.get(HOP_HEADER).is_some();
    let pacer = state.pacer.clone();
    let role = state.ring.borrow().role(&state.me, &chunk.digest);
    // The headers go out at once and the body when the chunk is here: the asker then knows
    // this node is alive and working on it, and waits for the body (its body bound) instead
    // of taking a slow origin fetch here for a dead peer and fetching the chunk itself too.
    // A fetch that fails or overruns `serve_timeout` resets the stream: never a short body.
    let body = futures::stream::once(async move {
        let _slot = slot;
        let metrics = &state.metrics;
        let served = async {
            if !last_hop && matches!(role, Role::Secondary { .. }) {
                PeerMetrics::inc(&metrics.forwarded);
                // Through this node's own read path: memory, disk, the primary, the origin.
                state.cache.get(&state.store, &chunk).await
            } else {
                state.cache.serve_peer(&state.store, &chunk).await
            }
        };
        match tokio::time::timeout(state.serve_timeout, served).await {
            Ok(Ok(data)) if data.len() as u64 == u64::from(chunk.len) => {
                PeerMetrics::inc(&metrics.served_requests);
                PeerMetrics::add(&metrics.served_bytes, data.len() as u64);
                Ok(data)
            }
            Ok(Ok(data)) => {
                PeerMetrics::inc(&metrics.served_errors);
                Err(std::io::Error::other(format!(
                    "{} bytes here for a {}-byte chunk",
                    data.len(),
                    chunk.len
                )))
            }
            Ok(Err(e)) => {
                PeerMetrics::inc(&metrics.served_errors);
                tracing::warn!(digest = %chunk.digest, error = %e, "cannot serve a chunk to a peer");
                Err(std::io::Error::other("the chunk is not available here"))
            }
            Err(_) => {
                PeerMetrics::inc(&metrics.served_errors);
                Err(std::io::Error::other("the chunk took too long here"))
            }
        }
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, chunk.len.to_string()),
        ],
        Body::from_stream(body.flat_map(move |served| crate::pace::body(served, pacer.clone()))),
    )
        .into_response()
}

/// The chunk a request names, if its digest and length are well-formed and bounded.
fn parse_request(digest: &str, query: Option<ChunkQuery>) -> Option<ChunkRef> {
    if digest.len() != 64 {
        return None;
    }
    let digest = Digest::parse(digest).ok()?;
    let len = query?.len;
    if len == 0 || len > MAX_CHUNK_LEN {
        return None;
    }
    Some(ChunkRef {
        digest,
        len: u32::try_from(len).ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_bounded() {
        let hex = Digest::of(b"x").hex();
        let q = |len| Some(ChunkQuery { len });
        assert!(parse_request(&hex, q(1 << 20)).is_some());
        assert!(parse_request(&hex, q(0)).is_none());
        assert!(parse_request(&hex, q(MAX_CHUNK_LEN + 1)).is_none());
        assert!(parse_request(&hex, None).is_none());
        assert!(parse_request(&format!("blake3:{hex}"), q(1)).is_none());
        assert!(parse_request(&hex.to_uppercase(), q(1)).is_none());
        assert!(parse_request("../../etc/passwd", q(1)).is_none());
    }
}
