//! The requesting side: [`PeerClient`] is the mount's [`PeerTier`]. For each chunk it finds
//! the owner in its current view of the ring and asks it, within a time bound; anything but
//! the right number of bytes in time is `None`, and the mount fetches from the origin. (The
//! mount verifies the bytes; this side only bounds them.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::FutureExt;
use futures::future::BoxFuture;
use sealed_mount::{PeerAnswer, PeerTier};
use sealed_store::ChunkRef;

use crate::metrics::PeerMetrics;
use crate::ring::{Member, RingView, Role};
use crate::token::PeerToken;
use crate::{HOP_HEADER, PeerError, PeerOptions, chunk_path};

/// Time a TLS handshake may add to the connect bound (two round trips and a signature each
/// way, on a loaded node).
const TLS_HANDSHAKE_ALLOWANCE: Duration = Duration::from_secs(1);

/// Asks the owners. Cheap to clone.
#[derive(Clone)]
pub struct PeerClient {
    inner: Arc<Inner>,
}

struct Inner {
    me: Member,
    ring: RingView,
    http: reqwest::Client,
    /// `http` (h2c) or `https` (TLS, the peer's certificate checked for the fleet name).
    scheme: &'static str,
    token: PeerToken,
    request_timeout: Duration,
    body_timeout: Duration,
    down_for: Duration,
    /// Owners that failed recently, and until when they are not asked.
    down: Mutex<HashMap<String, Instant>>,
    metrics: Arc<PeerMetrics>,
}

impl PeerClient {
    pub fn new(
        options: &PeerOptions,
        ring: RingView,
        metrics: Arc<PeerMetrics>,
    ) -> Result<PeerClient, PeerError> {
        // The connect bound covers the TLS handshake too.
        let (scheme, tls, connect_timeout) = match &options.tls {
            Some(tls) => (
                "https",
                tls.client_config(),
                options.connect_timeout + TLS_HANDSHAKE_ALLOWANCE,
            ),
            None => (
                "http",
                crate::tls::plaintext_client_config()?,
                options.connect_timeout,
            ),
        };
        let http = reqwest::Client::builder()
            // HTTP/2 always (h2c, or ALPN h2): one connection per owner carries every
            // concurrent request.
            .http2_prior_knowledge()
            .use_preconfigured_tls(tls)
            .connect_timeout(connect_timeout)
            // No HTTP/2 keep-alive pings: an owner busy hashing may answer a ping late, and a
            // missed ping closes the connection with every request on it. The request bound
            // covers a peer that went away.
            .pool_idle_timeout(Duration::from_secs(90))
            .build()
            .map_err(|e| PeerError::Client(chain(&e)))?;
        Ok(PeerClient {
            inner: Arc::new(Inner {
                me: Member::new(options.advertise.clone()),
                ring,
                http,
                scheme,
                token: options.token.clone(),
                request_timeout: options.request_timeout,
                body_timeout: options.body_timeout,
                down_for: options.down_for,
                down: Mutex::new(HashMap::new()),
                metrics,
            }),
        })
    }
}

impl PeerTier for PeerClient {
    fn fetch(&self, chunk: ChunkRef) -> BoxFuture<'static, PeerAnswer> {
        let inner = self.inner.clone();
        async move {
            let role = inner.ring.borrow().role(&inner.me, &chunk.digest);
            let answer = match role {
                Role::Alone | Role::Primary => {
                    PeerMetrics::inc(&inner.metrics.owned_here);
                    return PeerAnswer::OwnedHere;
                }
                // A secondary's request goes one hop only, in half the bounds: the requester
                // that may be waiting on it still has time for the origin.
                Role::Secondary { primary } => {
                    let bounds = (inner.request_timeout / 2, inner.body_timeout / 2);
                    inner.ask(&primary, chunk, true, bounds).await
                }
                Role::Requester { owner } => {
                    let bounds = (inner.request_timeout, inner.body_timeout);
                    inner.ask(&owner, chunk, false, bounds).await
                }
            };
            answer.map_or(PeerAnswer::Missed, PeerAnswer::Chunk)
        }
        .boxed()
    }
}

impl Inner {
    /// Asks `owner` for `chunk`: its headers within `bounds.0`, then the body within
    /// `bounds.1`. `None` (fetch from the origin) on any failure.
    async fn ask(
        &self,
        owner: &Member,
        chunk: ChunkRef,
        last_hop: bool,
        bounds: (Duration, Duration),
    ) -> Option<Bytes> {
        if self.is_down(&owner.addr) {
            PeerMetrics::inc(&self.metrics.skipped_down);
            return None;
        }
        PeerMetrics::inc(&self.metrics.requests);
        let (header_bound, body_bound) = bounds;
        let response = match tokio::time::timeout(
            header_bound,
            self.request(owner, chunk, last_hop),
        )
        .await
        {
            Ok(Ok(response)) => response,
            Ok(Err(failure)) => {
                self.failed(owner, &chunk, failure);
                return None;
            }
            Err(_) => {
                PeerMetrics::inc(&self.metrics.request_timeouts);
                tracing::warn!(peer = %owner.addr, digest = %chunk.digest,
                    "peer did not answer within {header_bound:?}; fetching from the origin and not asking it for {:?}", self.down_for);
                self.mark_down(&owner.addr);
                return None;
            }
        };
        match tokio::time::timeout(body_bound, read_body(response, chunk.len as usize)).await {
            Ok(Ok(data)) => Some(data),
            Ok(Err(failure)) => {
                self.failed(owner, &chunk, failure);
                None
            }
            Err(_) => {
                // The owner answered, so it is alive; it is slow with this chunk (its origin
                // fetch), not necessarily with the next.
                PeerMetrics::inc(&self.metrics.body_timeouts);
                tracing::debug!(peer = %owner.addr, digest = %chunk.digest,
                    "peer did not send the chunk within {body_bound:?}; fetching from the origin");
                None
            }
        }
    }

    fn failed(&self, owner: &Member, chunk: &ChunkRef, failure: Failure) {
        match failure {
            Failure::Busy => PeerMetrics::inc(&self.metrics.request_busy),
            Failure::Broken(reason) => {
                PeerMetrics::inc(&self.metrics.request_failures);
                tracing::warn!(peer = %owner.addr, digest = %chunk.digest, %reason,
                    "peer failed; fetching from the origin and not asking it for {:?}", self.down_for);
                self.mark_down(&owner.addr);
            }
        }
    }

    /// The owner's response headers, checked: 200 with the chunk's length (or none).
    async fn request(
        &self,
        owner: &Member,
        chunk: ChunkRef,
        last_hop: bool,
    ) -> Result<reqwest::Response, Failure> {
        let url = format!("{}://{}{}", self.scheme, owner.addr, chunk_path(&chunk));
        let mut request = self
            .http
            .get(url)
            .header(http::header::AUTHORIZATION, self.token.header_value());
        if last_hop {
            request = request.header(HOP_HEADER, "1");
        }
        let response = request
            .send()
            .await
            .map_err(|e| Failure::Broken(chain(&e)))?;
        let status = response.status();
        if status == http::StatusCode::SERVICE_UNAVAILABLE {
            return Err(Failure::Busy);
        }
        if status != http::StatusCode::OK {
            return Err(Failure::Broken(format!("answered {status}")));
        }
        let want = u64::from(chunk.len);
        if response.content_length().is_some_and(|n| n != want) {
            return Err(Failure::Broken(format!(
                "announced {:?} bytes for a {want}-byte chunk",
                response.content_length()
            )));
        }
        Ok(response)
    }

    fn is_down(&self, addr: &str) -> bool {
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        match down.get(addr) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                down.remove(addr);
                false
            }
            None => false,
        }
    }

    fn mark_down(&self, addr: &str) {
        let until = Instant::now() + self.down_for;
        self.down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr.to_owned(), until);
    }
}

/// The body of a chunk's response: exactly `want` bytes, and never more than that in memory
/// whatever the peer sends.
async fn read_body(mut response: reqwest::Response, want: usize) -> Result<Bytes, Failure> {
    let mut body = BytesMut::with_capacity(want);
    while let Some(part) = response
        .chunk()
        .await
        .map_err(|e| Failure::Broken(chain(&e)))?
    {
        if body.len().saturating_add(part.len()) > want {
            return Err(Failure::Broken(format!(
                "sent more than the chunk's {want} bytes"
            )));
        }
        body.extend_from_slice(&part);
    }
    if body.len() != want {
        return Err(Failure::Broken(format!(
            "sent {} of the chunk's {want} bytes",
            body.len()
        )));
    }
    Ok(body.freeze())
}

/// An error with its causes (reqwest's own text leaves them out).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

enum Failure {
    /// The owner is at its bound of concurrent requests: not a sign it is down.
    Busy,
    Broken(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_store::Digest;

    /// Chunks this node owns are not asked of anyone (and are not misses); chunks a peer
    /// owns but cannot serve (nothing listens there) are misses.
    #[tokio::test]
    async fn owned_chunks_are_not_misses_and_a_dead_owner_is() {
        let me = "127.0.0.1:1".to_string();
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other = dead.local_addr().unwrap().to_string();
        drop(dead);
        let members = crate::membership::fixed(vec![me.clone(), other], 64);
        let token = PeerToken::new("a-test-token-of-enough-length-0123456789").unwrap();
        let options = PeerOptions::new("127.0.0.1:0".parse().unwrap(), me, token);
        let metrics = Arc::new(PeerMetrics::default());
        let client = PeerClient::new(&options, members.view.clone(), metrics.clone()).unwrap();
        let (mut owned, mut missed) = (0, 0);
        for i in 0u32..64 {
            let chunk = ChunkRef {
                digest: Digest::of(&i.to_le_bytes()),
                len: 4,
            };
            match client.fetch(chunk).await {
                PeerAnswer::OwnedHere => owned += 1,
                PeerAnswer::Missed => missed += 1,
                PeerAnswer::Chunk(_) => panic!("nothing serves chunks here"),
            }
        }
        assert!(owned > 0 && missed > 0, "owned {owned}, missed {missed}");
        let seen = metrics.snapshot();
        assert_eq!(seen.owned_here, owned);
    }
}
