//! The peer tier: nodes' caches serve each other chunks, so that a fleet reads each chunk
//! from the origin about once.
//!
//! Each chunk has owners among the live members by rendezvous hashing ([`ring`]); a node
//! missing a chunk asks an owner ([`client`]), which answers from its own tiers or fetches
//! from the origin once, single flight shared with its own readers ([`server`]). Membership
//! comes from a list, a file or the node plugins' EndpointSlices ([`membership`]). Every
//! answer is verified by the asking node's mount (`sealed_mount::PeerTier`); a peer can make
//! a read slower (bounded), never wrong. See `docs/peer.md`.

pub mod client;
pub mod membership;
pub mod metrics;
pub mod pace;
pub mod reload;
pub mod ring;
pub mod server;
pub mod tls;
pub mod token;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sealed_mount::NodeCache;
use sealed_store::{ChunkRef, ChunkStore};
use tokio::task::JoinHandle;

pub use sealed_service::listen::ConnLimits;

pub use client::PeerClient;
pub use membership::Membership;
pub use metrics::{PeerMetrics, PeerSnapshot};
pub use reload::PeerFiles;
pub use ring::{Member, Ring, RingView, Role};
pub use tls::PeerTls;
pub use token::PeerToken;

/// Marks a request as the last hop: the owner answers from its tiers or the origin, never
/// asks another peer.
pub const HOP_HEADER: &str = "x-sealed-last-hop";

/// `GET` with the fleet's token: 204 from a node that is up ([`server`]); what an asker probes
/// an owner it could not reach with ([`client`]).
pub const PING_PATH: &str = "/v1/ping";

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("peer token: {0}")]
    Token(String),
    #[error("peer membership: {0}")]
    Membership(String),
    #[error("peer TLS: {0}")]
    Tls(String),
    #[error("peer client: {0}")]
    Client(String),
    #[error("cannot listen for peers on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// How a node takes part in the peer tier.
#[derive(Clone, Debug)]
pub struct PeerOptions {
    /// Where this node's peer server listens.
    pub listen: SocketAddr,
    /// This node's address as the others see it in the membership (`host:port`).
    pub advertise: String,
    pub token: PeerToken,
    /// TLS on the peer port, both ways (mTLS); `None`: h2c. Every member of a fleet must
    /// agree: a TLS node and an h2c node cannot talk, and each reads from the origin.
    pub tls: Option<PeerTls>,
    /// Bound on an owner's answer to start (its headers, sent before it has the chunk),
    /// after which the reader fetches from the origin itself and the owner is marked down.
    pub request_timeout: Duration,
    /// Bound on the body once the headers came (the owner may be fetching the chunk from the
    /// origin): then the reader fetches from the origin itself, the owner not marked down.
    pub body_timeout: Duration,
    pub connect_timeout: Duration,
    /// How long an owner that failed, timed out or stalled is not asked.
    pub down_for: Duration,
    /// A body that has started must keep coming: over each window of this length after its
    /// first bytes, the owner must deliver at least [`min_rate`](Self::min_rate) (all its
    /// answers to this node together), or it is marked down as stalled (a dripping body, a
    /// failing disk or NIC that still answers).
    pub stall_window: Duration,
    /// Bytes per second an owner delivers at least while a body of its is under way.
    pub min_rate: u64,
    /// Most peer requests this node answers at once; more are told to go to the origin.
    pub max_concurrent_serves: usize,
    /// Bound on answering one peer request (the origin fetch included).
    pub serve_timeout: Duration,
    /// Most nodes one owner serves a chunk to: the owner set widens to members / fanout.
    pub fanout: usize,
    /// Cap on the bytes per second this node sends to all peers together (`None`: the
    /// link's speed); see [`pace`].
    pub upload_rate: Option<u64>,
    /// The peer port's connection bounds: caps in total and per source, header and idle
    /// deadlines, TLS handshake slots ([`sealed_service::listen`]).
    pub limits: ConnLimits,
    /// The files `token` and `tls` came from: read again while the node runs, and a change
    /// (a rotated Secret) used for new requests and connections ([`reload`]). `None`: fixed.
    pub files: Option<PeerFiles>,
}

impl PeerOptions {
    /// Sets the bound on an owner's headers (`--peer-timeout-ms`); the body bound is never
    /// shorter than it.
    pub fn set_request_timeout(&mut self, bound: Duration) {
        self.request_timeout = bound;
        self.body_timeout = self.body_timeout.max(bound);
    }

    /// The defaults for a node listening on `listen`, known to the others as `advertise`.
    pub fn new(listen: SocketAddr, advertise: String, token: PeerToken) -> PeerOptions {
        PeerOptions {
            listen,
            advertise,
            token,
            tls: None,
            request_timeout: Duration::from_secs(3),
            body_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_millis(500),
            down_for: Duration::from_secs(5),
            stall_window: Duration::from_secs(1),
            min_rate: 32 * 1024,
            max_concurrent_serves: 64,
            serve_timeout: Duration::from_secs(10),
            fanout: 64,
            upload_rate: None,
            limits: ConnLimits::peer(),
            files: None,
        }
    }
}

/// The request path for a chunk.
pub(crate) fn chunk_path(chunk: &ChunkRef) -> String {
    format!("/v1/chunks/{}?len={}", chunk.digest.hex(), chunk.len)
}

/// A node's part of the tier, running: its server, and its client installed in its cache.
/// Dropping it stops the server (the client stays installed, and with no server the others
/// fall back to the origin for this node's chunks).
pub struct PeerNode {
    pub metrics: Arc<PeerMetrics>,
    pub local_addr: SocketAddr,
    /// The current membership, as this node sees it.
    pub ring: RingView,
    server: JoinHandle<()>,
    reloader: Option<JoinHandle<()>>,
    _membership: Membership,
}

impl Drop for PeerNode {
    fn drop(&mut self) {
        self.server.abort();
        if let Some(r) = &self.reloader {
            r.abort();
        }
    }
}

impl PeerNode {
    /// Listens, serves, and installs the client as `cache`'s peer tier.
    pub async fn start(
        options: &PeerOptions,
        membership: Membership,
        cache: &NodeCache,
        store: ChunkStore,
    ) -> Result<PeerNode, PeerError> {
        let metrics = Arc::new(PeerMetrics::default());
        // `sealed mount` and the node plugin alike: the open-files limit raised, and the
        // share connections may hold fixed, before the port opens (a no-op when done already).
        sealed_service::listen::prepare_descriptors();
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|source| PeerError::Listen {
                addr: options.listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| PeerError::Listen {
            addr: options.listen,
            source,
        })?;
        let router = server::router(
            options,
            cache.clone(),
            store,
            membership.view.clone(),
            metrics.clone(),
        );
        let tls = options.tls.clone();
        let server_metrics = metrics.clone();
        let limits = options.limits.clone();
        let server = tokio::spawn(async move {
            let served = match &tls {
                Some(tls) => {
                    server::serve_tls_with_limits(listener, router, tls, server_metrics, limits)
                        .await
                }
                None => server::serve_with_limits(listener, router, limits).await,
            };
            if let Err(e) = served {
                tracing::error!(error = %e, "the peer server stopped");
            }
        });
        let client = PeerClient::new(options, membership.view.clone(), metrics.clone())?;
        if !cache.set_peers(Arc::new(client)) {
            tracing::warn!("this cache already had a peer tier; keeping that one");
        }
        tracing::info!(listen = %local_addr, advertise = %options.advertise,
            tls = options.tls.as_ref().map(|t| t.name()), members = membership.view.borrow().len(), "peer tier on");
        let reloader = options.files.clone().map(|files| {
            reload::spawn(
                files,
                options.token.clone(),
                options.tls.clone(),
                reload::DEFAULT_PERIOD,
            )
        });
        Ok(PeerNode {
            metrics,
            local_addr,
            ring: membership.view.clone(),
            server,
            reloader,
            _membership: membership,
        })
    }
}
