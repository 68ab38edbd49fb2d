//! The requesting side: [`PeerClient`] is the mount's [`PeerTier`]. For each chunk it finds
//! the owner in its current view of the ring and asks it, within a time bound; anything but
//! the right number of bytes in time is `None`, and the mount fetches from the origin. (The
//! mount verifies the bytes; this side only bounds them.)
//!
//! Bounded over time, not only in total: an owner whose body has started must go on
//! delivering at least `min_rate` over each `stall_window` (all its answers to this node
//! together, so many slow streams of a busy owner add up), and one that sends headers and no
//! body within the body bound stalls too. A stalled owner is marked down for `down_for`:
//! its in-flight answers give up at their next window, its chunks go to the next in line,
//! so a dripping owner (a failing disk or NIC that still answers) costs a reader about one
//! stall per window, not one per chunk.
//!
//! An owner this node could not reach at all (refused, no connection or TLS handshake within
//! the connect bound: the request never got to it; or not even headers within the header
//! bound) is marked down too, and probed in the background (`GET /v1/ping`, 100 ms after,
//! then doubling up to 1 s) while it stays so: the first answer ends its down time. A plugin that is listed before its port or certificate is
//! ready, or whose first connection lost a race with a busy machine, then serves again within
//! about a probe's wait instead of the whole `down_for`, which is longer than a small version's
//! read (the fleet of pods read 96 MiB in 4 s and one node's chunks all came from the origin).
//! Readers never wait for a probe, so a dead owner still costs them one stall per window.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
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
/// The first probe of an owner found unreachable comes this long after; each next one twice
/// as long after the last, up to [`PROBE_MAX_WAIT`].
const PROBE_FIRST_WAIT: Duration = Duration::from_millis(100);
const PROBE_MAX_WAIT: Duration = Duration::from_secs(1);

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
    stall_window: Duration,
    min_rate: u64,
    /// Body bytes each owner delivered to this node (all answers): the stall check's
    /// measure. Bounded: owners that left the ring are forgotten.
    delivered: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Owners that failed recently, and until when they are not asked.
    down: Mutex<HashMap<String, Instant>>,
    /// When each owner last sent this node any bytes (headers or body, any chunk): an owner
    /// whose headers are late but whose connection delivers is busy, not dead.
    last_progress: Mutex<HashMap<String, Instant>>,
    /// Owners marked down as unreachable that a probe is watching (one probe each).
    probing: Mutex<HashSet<String>>,
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
                stall_window: options.stall_window.max(Duration::from_millis(10)),
                min_rate: options.min_rate,
                delivered: Mutex::new(HashMap::new()),
                down: Mutex::new(HashMap::new()),
                last_progress: Mutex::new(HashMap::new()),
                probing: Mutex::new(HashSet::new()),
                metrics,
            }),
        })
    }
}

impl PeerTier for PeerClient {
    fn fetch(&self, chunk: ChunkRef) -> BoxFuture<'static, PeerAnswer> {
        let inner = self.inner.clone();
        async move {
            // An owner found down by this very request (refused, reset, silent) hands the
            // chunk to the next in line at once, once: a node that is not serving yet, or
            // has just died, costs the asker a second request, not an origin fetch. Only
            // if it was found down within the header bound, so the whole stays bounded.
            let started = Instant::now();
            let mut tries = 0;
            loop {
                tries += 1;
                let asked = match inner.role(&chunk) {
                    Role::Alone | Role::Primary => {
                        PeerMetrics::inc(&inner.metrics.owned_here);
                        return PeerAnswer::OwnedHere;
                    }
                    // A secondary's request goes one hop only, in half the bounds: the
                    // requester that may be waiting on it still has time for the origin.
                    Role::Secondary { primary } => {
                        let bounds = (inner.request_timeout / 2, inner.body_timeout / 2);
                        inner.ask(&primary, chunk, true, bounds).await
                    }
                    Role::Requester { owner } => {
                        let bounds = (inner.request_timeout, inner.body_timeout);
                        inner.ask(&owner, chunk, false, bounds).await
                    }
                };
                match asked {
                    Asked::Chunk(data) => return PeerAnswer::Chunk(data),
                    Asked::OwnerDown if tries < 2 && started.elapsed() <= inner.request_timeout => {
                        continue;
                    }
                    Asked::OwnerDown | Asked::Missed => return PeerAnswer::Missed,
                }
            }
        }
        .boxed()
    }
}

impl Inner {
    /// This node's role for `chunk` in the ring without the owners marked down: a chunk
    /// whose owner is down goes to the next-best member (or comes from the origin here, if
    /// that is this node), the same one every node that saw the failure picks.
    fn role(&self, chunk: &ChunkRef) -> Role {
        let ring = self.ring.borrow().clone();
        let down = self.down_now();
        if down.is_empty() {
            return ring.role(&self.me, &chunk.digest);
        }
        let role = ring.role_skipping(&self.me, &chunk.digest, |m| down.contains(&m.addr));
        if role != ring.role(&self.me, &chunk.digest) {
            PeerMetrics::inc(&self.metrics.skipped_down);
            if matches!(role, Role::Requester { .. } | Role::Secondary { .. }) {
                PeerMetrics::inc(&self.metrics.rerouted);
            }
        }
        role
    }

    /// Asks `owner` for `chunk`: its headers within `bounds.0`, then the body within
    /// `bounds.1`. Headers late from an owner that sent this node bytes within `bounds.0`
    /// (its link or CPU is busy with other chunks: HTTP/2 queues new headers behind the
    /// data already on the connection) are waited for within the body bound instead, and
    /// the owner is not marked down; from an owner that sent nothing, they mark it down.
    async fn ask(
        self: &Arc<Self>,
        owner: &Member,
        chunk: ChunkRef,
        last_hop: bool,
        bounds: (Duration, Duration),
    ) -> Asked {
        if self.is_down(&owner.addr) {
            PeerMetrics::inc(&self.metrics.skipped_down);
            return Asked::Missed;
        }
        PeerMetrics::inc(&self.metrics.requests);
        let (header_bound, body_bound) = bounds;
        let request = self.request(owner, chunk, last_hop);
        tokio::pin!(request);
        // The body bound runs from the headers, or from the end of the header bound for an
        // owner that is late but sending: either way an ask ends within the two bounds.
        let mut deadline = tokio::time::Instant::now() + header_bound + body_bound;
        let headers = match tokio::time::timeout(header_bound, &mut request).await {
            Ok(headers) => {
                deadline = tokio::time::Instant::now() + body_bound;
                Some(headers)
            }
            Err(_) if self.progressed_within(&owner.addr, header_bound) => {
                PeerMetrics::inc(&self.metrics.slow_headers);
                tokio::time::timeout_at(deadline, &mut request).await.ok()
            }
            Err(_) => {
                PeerMetrics::inc(&self.metrics.request_timeouts);
                tracing::warn!(peer = %owner.addr, digest = %chunk.digest,
                    "peer sent nothing within {header_bound:?}; not asking it until it answers a probe (at most {:?})", self.down_for);
                self.mark_down(&owner.addr);
                self.probe(&owner.addr);
                return Asked::OwnerDown;
            }
        };
        let response = match headers {
            Some(Ok(response)) => response,
            Some(Err(failure)) => return self.failed(owner, &chunk, failure),
            None => {
                PeerMetrics::inc(&self.metrics.body_timeouts);
                tracing::debug!(peer = %owner.addr, digest = %chunk.digest,
                    "busy peer did not answer within {body_bound:?} more; fetching from the origin");
                return Asked::Missed;
            }
        };
        self.progressed(&owner.addr);
        let delivered = self.delivered(&owner.addr);
        let this_body = AtomicU64::new(0);
        let body = read_body(response, chunk.len as usize, |n| {
            self.progressed(&owner.addr);
            let n = n as u64;
            delivered.fetch_add(n, Ordering::Relaxed);
            this_body.fetch_add(n, Ordering::Relaxed);
        });
        tokio::pin!(body);
        // What the owner must deliver per window while this body is under way.
        let floor = u64::try_from(
            u128::from(self.min_rate).saturating_mul(self.stall_window.as_millis()) / 1000,
        )
        .unwrap_or(u64::MAX);
        let mut windows = tokio::time::interval_at(
            tokio::time::Instant::now() + self.stall_window,
            self.stall_window,
        );
        let mut at_last_window = delivered.load(Ordering::Relaxed);
        // Whether this body had started at the last window's end: only a whole window
        // after its first bytes is measured.
        let mut started = false;
        loop {
            tokio::select! {
                read = &mut body => {
                    return match read {
                        Ok(data) => Asked::Chunk(data),
                        Err(failure) => self.failed(owner, &chunk, failure),
                    };
                }
                _ = tokio::time::sleep_until(deadline) => {
                    PeerMetrics::inc(&self.metrics.body_timeouts);
                    if this_body.load(Ordering::Relaxed) == 0 {
                        // Headers and then nothing for the whole body bound: a stall too.
                        return self.stalled(owner, &chunk, "sent headers and no body");
                    }
                    // Delivering above the floor, only not in time for this chunk: alive.
                    tracing::debug!(peer = %owner.addr, digest = %chunk.digest,
                        "peer did not send the chunk within {body_bound:?}; fetching from the origin");
                    return Asked::Missed;
                }
                _ = windows.tick() => {
                    if self.is_down(&owner.addr) {
                        // Another answer of this owner found it stalled or broken.
                        PeerMetrics::inc(&self.metrics.skipped_down);
                        return Asked::OwnerDown;
                    }
                    let now = delivered.load(Ordering::Relaxed);
                    let in_window = now.saturating_sub(at_last_window);
                    at_last_window = now;
                    if started && in_window < floor {
                        return self.stalled(owner, &chunk, "delivered below the rate floor");
                    }
                    started = this_body.load(Ordering::Relaxed) > 0;
                }
            }
        }
    }

    /// Marks `owner` down for a stalled answer and counts it (by owner, bounded).
    fn stalled(&self, owner: &Member, chunk: &ChunkRef, why: &str) -> Asked {
        self.metrics.stalled(&owner.addr);
        tracing::warn!(peer = %owner.addr, digest = %chunk.digest, why,
            "peer answer stalled; not asking it for {:?}", self.down_for);
        self.mark_down(&owner.addr);
        Asked::OwnerDown
    }

    /// The body bytes counter of `owner` (created on first use; owners no longer in the
    /// ring are dropped when the map grows).
    fn delivered(&self, owner: &str) -> Arc<AtomicU64> {
        let mut map = self.delivered.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(owner) {
            return c.clone();
        }
        if map.len() >= 1024 {
            let ring = self.ring.borrow().clone();
            map.retain(|addr, _| ring.contains(addr));
        }
        let c = Arc::new(AtomicU64::new(0));
        map.insert(owner.to_owned(), c.clone());
        c
    }

    fn failed(self: &Arc<Self>, owner: &Member, chunk: &ChunkRef, failure: Failure) -> Asked {
        match failure {
            Failure::Busy => {
                PeerMetrics::inc(&self.metrics.request_busy);
                Asked::Missed
            }
            Failure::Unreached(reason) => {
                PeerMetrics::inc(&self.metrics.request_failures);
                tracing::warn!(peer = %owner.addr, digest = %chunk.digest, %reason,
                    "cannot reach peer; not asking it until it answers a probe (at most {:?})",
                    self.down_for);
                self.mark_down(&owner.addr);
                self.probe(&owner.addr);
                Asked::OwnerDown
            }
            Failure::Broken(reason) => {
                PeerMetrics::inc(&self.metrics.request_failures);
                tracing::warn!(peer = %owner.addr, digest = %chunk.digest, %reason,
                    "peer failed; not asking it for {:?}", self.down_for);
                self.mark_down(&owner.addr);
                Asked::OwnerDown
            }
        }
    }

    /// Notes that `owner` just sent this node bytes.
    fn progressed(&self, owner: &str) {
        let mut seen = self.last_progress.lock().unwrap_or_else(|e| e.into_inner());
        match seen.get_mut(owner) {
            Some(at) => *at = Instant::now(),
            None => {
                seen.insert(owner.to_owned(), Instant::now());
            }
        }
    }

    /// Whether `owner` sent this node any bytes in the last `window`.
    fn progressed_within(&self, owner: &str, window: Duration) -> bool {
        let seen = self.last_progress.lock().unwrap_or_else(|e| e.into_inner());
        seen.get(owner).is_some_and(|at| at.elapsed() <= window)
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
        let response = request.send().await.map_err(|e| {
            // Refused, or no connection or TLS handshake within the connect bound: the
            // request never reached the owner.
            if e.is_connect() {
                Failure::Unreached(chain(&e))
            } else {
                Failure::Broken(chain(&e))
            }
        })?;
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

    /// The owners marked down now (expired marks are dropped).
    fn down_now(&self) -> Vec<String> {
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        if down.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        down.retain(|_, until| *until > now);
        down.keys().cloned().collect()
    }

    fn mark_down(&self, addr: &str) {
        let until = Instant::now() + self.down_for;
        self.down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr.to_owned(), until);
    }

    /// Probes `owner` (marked down as unreachable or silent, not for a stalled body) in the background until it answers, its
    /// down time is up, or it leaves the ring; an answer ends its down time at once. At most
    /// one probe per owner; readers never wait for one.
    fn probe(self: &Arc<Self>, owner: &str) {
        if !self
            .probing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(owner.to_owned())
        {
            return;
        }
        let this = Arc::downgrade(self);
        let owner = owner.to_owned();
        tokio::spawn(async move {
            let mut wait = PROBE_FIRST_WAIT;
            loop {
                tokio::time::sleep(wait).await;
                let Some(inner) = this.upgrade() else {
                    return;
                };
                if !inner.is_down(&owner) || !inner.ring.borrow().contains(&owner) {
                    break;
                }
                if inner.ping(&owner).await {
                    inner.revive(&owner);
                    break;
                }
                wait = wait.saturating_mul(2).min(PROBE_MAX_WAIT);
            }
            if let Some(inner) = this.upgrade() {
                inner
                    .probing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&owner);
            }
        });
    }

    /// Whether `owner` answers a ping within the header bound: 204, or 404 from a plugin
    /// that predates the ping (it is up and speaks to this node; a rolling upgrade has both).
    /// A refused token (401) is no answer: that owner could not serve this node anyway.
    async fn ping(&self, owner: &str) -> bool {
        let url = format!("{}://{owner}{}", self.scheme, crate::PING_PATH);
        let request = self
            .http
            .get(url)
            .header(http::header::AUTHORIZATION, self.token.header_value())
            .timeout(self.request_timeout)
            .send();
        match request.await {
            Ok(r) => matches!(
                r.status(),
                http::StatusCode::NO_CONTENT | http::StatusCode::NOT_FOUND
            ),
            Err(_) => false,
        }
    }

    /// Ends `owner`'s down time: it answered a probe.
    fn revive(&self, owner: &str) {
        let was_down = self
            .down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(owner)
            .is_some();
        if was_down {
            PeerMetrics::inc(&self.metrics.revived);
            tracing::info!(peer = %owner, "peer answers again: asking it for chunks");
        }
    }
}

/// The body of a chunk's response: exactly `want` bytes, and never more than that in memory
/// whatever the peer sends. `progress` is called as bytes arrive.
async fn read_body(
    mut response: reqwest::Response,
    want: usize,
    progress: impl Fn(usize),
) -> Result<Bytes, Failure> {
    let mut body = BytesMut::with_capacity(want);
    while let Some(part) = response
        .chunk()
        .await
        .map_err(|e| Failure::Broken(chain(&e)))?
    {
        progress(part.len());
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

/// How one ask of an owner ended.
enum Asked {
    Chunk(Bytes),
    /// The owner did not serve it (busy, slow, wrong): fetch from the origin.
    Missed,
    /// The owner is down (refused, broken, silent) and now marked so: its chunks have a
    /// next-best owner.
    OwnerDown,
}

enum Failure {
    /// The owner is at its bound of concurrent requests: not a sign it is down.
    Busy,
    /// No connection to the owner (refused, connect or TLS handshake bound): the request never
    /// reached it. Marked down and probed ([`Inner::probe`]).
    Unreached(String),
    Broken(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_store::Digest;

    fn client(me: &str, members: Vec<String>, bound: Duration) -> (PeerClient, Arc<PeerMetrics>) {
        let members = crate::membership::fixed(members, 64);
        let token = PeerToken::new("a-test-token-of-enough-length-0123456789").unwrap();
        let mut options = PeerOptions::new("127.0.0.1:0".parse().unwrap(), me.to_owned(), token);
        options.set_request_timeout(bound);
        let metrics = Arc::new(PeerMetrics::default());
        // A view whose membership is dropped keeps reading its last ring.
        let client = PeerClient::new(&options, members.view.clone(), metrics.clone()).unwrap();
        (client, metrics)
    }

    fn chunk(i: u32, len: u32) -> ChunkRef {
        ChunkRef {
            digest: Digest::of(&i.to_le_bytes()),
            len,
        }
    }

    /// Chunks this node owns are not asked of anyone (and are not misses). A dead owner is
    /// asked once: refused, it is marked down, and its chunks fall to the next in line (here
    /// this node, the only other member), the first one included, with no origin fallback
    /// counted as a miss.
    #[tokio::test]
    async fn a_dead_owner_is_asked_once_and_its_chunks_fall_to_the_next_in_line() {
        let me = "127.0.0.1:1".to_string();
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other = dead.local_addr().unwrap().to_string();
        drop(dead);
        let (client, metrics) = client(&me, vec![me.clone(), other], Duration::from_secs(3));
        for i in 0u32..64 {
            match client.fetch(chunk(i, 4)).await {
                PeerAnswer::OwnedHere => {}
                PeerAnswer::Missed => panic!("chunk {i}: a dead owner's chunk was a miss"),
                PeerAnswer::Chunk(_) => panic!("nothing serves chunks here"),
            }
        }
        let seen = metrics.snapshot();
        assert_eq!(seen.owned_here, 64);
        assert_eq!(seen.request_failures, 1, "{seen:?}");
        assert!(seen.skipped_down > 0, "{seen:?}");
    }

    /// An owner this node cannot reach at first (its port not open yet: a plugin listed
    /// before it serves, or a first connection lost to a busy machine) is asked again as soon
    /// as it answers a probe, not after its whole down time. The old code left it down for
    /// all of `down_for` (60 s here), and every chunk it owns came from the origin meanwhile:
    /// with the chart's 5 s, the whole of a 96 MiB read in the fleet of pods.
    #[tokio::test]
    async fn an_owner_unreachable_at_first_is_asked_again_once_it_answers() {
        use sealed_mount::{NodeCache, NodeCacheOptions};
        use sealed_store::{ChunkStore, Digest};

        let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let owner = reserved.local_addr().unwrap();
        drop(reserved);
        let me = "127.0.0.1:1".to_string();
        let members = crate::membership::fixed(vec![me.clone(), owner.to_string()], 64);
        let token = PeerToken::new("a-test-token-of-enough-length-0123456789").unwrap();
        let mut options = PeerOptions::new("127.0.0.1:0".parse().unwrap(), me.clone(), token);
        options.down_for = Duration::from_secs(60);
        let metrics = Arc::new(PeerMetrics::default());
        let client = PeerClient::new(&options, members.view.clone(), metrics.clone()).unwrap();

        // Two chunks the owner owns, in the store it serves from.
        let store = ChunkStore::memory();
        let ring = crate::ring::Ring::new([me.clone(), owner.to_string()], 64);
        let mut theirs = Vec::new();
        for i in 0u32.. {
            let data = Bytes::from(format!("chunk {i} of the owner").into_bytes());
            let c = ChunkRef {
                digest: Digest::of(&data),
                len: u32::try_from(data.len()).unwrap(),
            };
            if ring.role(&Member::new(me.clone()), &c.digest) == Role::Primary {
                continue;
            }
            store.put_chunk(&c.digest, data).await.unwrap();
            theirs.push(c);
            if theirs.len() == 2 {
                break;
            }
        }
        // Not serving yet: refused and marked down; its chunks fall to this node.
        for c in &theirs {
            assert!(matches!(client.fetch(*c).await, PeerAnswer::OwnedHere));
        }
        assert_eq!(metrics.snapshot().request_failures, 1);

        // Now it serves on that address: a real node's router over its own cache and store.
        let owner_options = PeerOptions::new(owner, owner.to_string(), options.token.clone());
        let router = crate::server::router(
            &owner_options,
            NodeCache::new(&NodeCacheOptions::default()).unwrap(),
            store,
            members.view.clone(),
            Arc::new(PeerMetrics::default()),
        );
        let listener = tokio::net::TcpListener::bind(owner).await.unwrap();
        tokio::spawn(crate::server::serve(listener, router));
        let serving = Instant::now();
        loop {
            match client.fetch(theirs[1]).await {
                PeerAnswer::Chunk(data) => {
                    assert_eq!(Digest::of(&data), theirs[1].digest);
                    break;
                }
                PeerAnswer::OwnedHere => {}
                PeerAnswer::Missed => panic!("a miss: {:?}", metrics.snapshot()),
            }
            assert!(
                serving.elapsed() < Duration::from_secs(5),
                "the owner was still passed over 5 s after it started serving: {:?}",
                metrics.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let seen = metrics.snapshot();
        assert_eq!(seen.revived, 1, "{seen:?}");
        assert_eq!(seen.request_failures, 1, "{seen:?}");
    }

    /// An owner whose headers for one chunk are late while it streams another to this node
    /// is busy, not dead: the late chunk is waited for (within the body bound) and the owner
    /// is not marked down.
    #[tokio::test]
    async fn late_headers_from_an_owner_that_is_sending_are_waited_for() {
        use axum::body::Body;
        use axum::extract::{Path, Query};
        #[derive(serde::Deserialize)]
        struct Len {
            len: usize,
        }
        const PART: usize = 64 << 10;
        let bound = Duration::from_millis(500);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let owner = listener.local_addr().unwrap().to_string();
        let me = "127.0.0.1:1".to_string();
        let (client, metrics) = client(&me, vec![me.clone(), owner.clone()], bound);
        let ring = crate::ring::Ring::new([me.clone(), owner.clone()], 64);
        let mut owned_there = (0u32..).filter(|i| {
            ring.role(&Member::new(me.clone()), &chunk(*i, 1).digest) != crate::ring::Role::Primary
        });
        let (streamed, late) = (owned_there.next().unwrap(), owned_there.next().unwrap());
        let late_hex = chunk(late, 1).digest.hex();
        // The streamed chunk's headers come at once and its 20 parts of 64 KiB one every
        // 100 ms (above the stall floor); the late chunk's headers come after 3 header bounds.
        let app = axum::Router::new().route(
            "/v1/chunks/{digest}",
            axum::routing::get(move |Path(d): Path<String>, Query(q): Query<Len>| {
                let late = d == late_hex;
                async move {
                    if late {
                        tokio::time::sleep(bound * 3).await;
                        return Body::from(vec![7u8; q.len]);
                    }
                    let drip = futures::stream::unfold(0usize, move |sent| async move {
                        (sent < q.len).then_some(())?;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        Some((
                            Ok::<_, std::io::Error>(Bytes::from(vec![7u8; PART])),
                            sent + PART,
                        ))
                    });
                    Body::from_stream(drip)
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        let slow = tokio::spawn({
            let client = client.clone();
            async move { client.fetch(chunk(streamed, 20 * PART as u32)).await }
        });
        // The streamed chunk is under way (its headers are in) before the late one is asked.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let answer = client.fetch(chunk(late, 8)).await;
        assert!(
            matches!(answer, PeerAnswer::Chunk(ref b) if b.len() == 8),
            "the late chunk was not waited for: {:?}",
            metrics.snapshot()
        );
        assert!(matches!(slow.await.unwrap(), PeerAnswer::Chunk(ref b) if b.len() == 20 * PART));
        let seen = metrics.snapshot();
        assert_eq!(seen.slow_headers, 1, "{seen:?}");
        assert_eq!(seen.request_timeouts, 0, "{seen:?}");
        assert_eq!(
            seen.skipped_down, 0,
            "the busy owner was marked down: {seen:?}"
        );
    }

    /// An owner that answers headers at once and then drips its bodies (one byte a second:
    /// a failing disk or NIC that still answers) is marked down at its first stall: twelve
    /// chunks it owns cost a reader about one stall, not twelve body bounds.
    #[tokio::test]
    async fn a_dripping_owner_costs_one_stall_not_one_per_chunk() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let owner = listener.local_addr().unwrap().to_string();
        let app = axum::Router::new().route(
            "/v1/chunks/{digest}",
            axum::routing::get(|| async {
                let drip = futures::stream::unfold((), |()| async {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Some((Ok::<_, std::io::Error>(Bytes::from_static(&[7u8])), ()))
                });
                axum::body::Body::from_stream(drip)
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });

        let me = "127.0.0.1:1".to_string();
        let members = crate::membership::fixed(vec![me.clone(), owner.clone()], 64);
        let token = PeerToken::new("a-test-token-of-enough-length-0123456789").unwrap();
        let mut options = PeerOptions::new("127.0.0.1:0".parse().unwrap(), me.clone(), token);
        options.set_request_timeout(Duration::from_millis(500));
        // A short body bound, so that the old behaviour (a whole bound per chunk) fails fast.
        options.body_timeout = Duration::from_secs(2);
        options.stall_window = Duration::from_millis(300);
        options.down_for = Duration::from_secs(60);
        let metrics = Arc::new(PeerMetrics::default());
        let client = PeerClient::new(&options, members.view.clone(), metrics.clone()).unwrap();
        let ring = crate::ring::Ring::new([me.clone(), owner.clone()], 64);
        let theirs: Vec<ChunkRef> = (0u32..)
            .map(|i| chunk(i, 1 << 20))
            .filter(|c| ring.role(&Member::new(me.clone()), &c.digest) != Role::Primary)
            .take(12)
            .collect();

        let started = Instant::now();
        for c in &theirs {
            match client.fetch(*c).await {
                PeerAnswer::Chunk(_) => panic!("a dripping owner served a whole chunk"),
                PeerAnswer::Missed | PeerAnswer::OwnedHere => {}
            }
        }
        let took = started.elapsed();
        // One stall: a window after the first byte (about 1 s), and the next window.
        assert!(
            took < Duration::from_secs(4),
            "12 chunks of a dripping owner took {took:?}: {:?}",
            metrics.snapshot()
        );
        let seen = metrics.snapshot();
        assert_eq!(seen.stalls, 1, "{seen:?}");
        assert_eq!(metrics.owner_stalls(), vec![(owner, 1)]);
    }
}
