//! The peer tier's own counters: what this node asked of others, and what it served them
//! (its load as an owner). The chunk bytes by tier are the mount's (`MountMetrics`).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

#[derive(Debug, Default)]
pub struct PeerMetrics {
    /// Requests this node sent to an owner, and those that failed (error, refused,
    /// wrong length), found the owner busy (503: too many requests at once there), got no
    /// headers within the request bound (the owner is then marked down), or got headers but
    /// not the body within the body bound (the owner is alive: not marked down); requests
    /// whose headers were late from an owner that was sending other bytes (busy, waited for
    /// within the body bound, not marked down); chunks
    /// whose best owner was marked down, and of those the ones asked of the next-best member
    /// instead (the others this node fetched from the origin itself, as the next in line).
    pub requests: AtomicU64,
    pub request_failures: AtomicU64,
    pub request_busy: AtomicU64,
    pub request_timeouts: AtomicU64,
    pub body_timeouts: AtomicU64,
    pub skipped_down: AtomicU64,
    pub rerouted: AtomicU64,
    pub slow_headers: AtomicU64,
    /// Chunks this node owns itself (primary, or alone): fetched from the origin here.
    pub owned_here: AtomicU64,
    /// Owner load: requests and bytes this node served to peers; requests it turned away
    /// (bad token, bad request), told to go elsewhere (too many at once: 503) or could not
    /// answer (origin error, the serve bound).
    pub served_requests: AtomicU64,
    pub served_bytes: AtomicU64,
    pub served_rejected: AtomicU64,
    pub served_busy: AtomicU64,
    pub served_errors: AtomicU64,
    /// Requests this node (a secondary owner) passed on to a chunk's primary.
    pub forwarded: AtomicU64,
    /// Connections to this node's TLS peer port whose handshake failed or stalled: a client
    /// without a certificate of this fleet (another CA, another name, h2c), or a slowloris.
    pub tls_refused: AtomicU64,
    /// Microseconds answers waited for the upload cap (`--peer-upload-rate`), summed over
    /// answers: how much the cap held this node's serving back.
    pub upload_wait_us: AtomicU64,
    /// Answers whose body stalled (below the rate floor over a window, or headers and no
    /// body within the body bound): the owner was marked down.
    pub stalls: AtomicU64,
    /// Owners marked down as unreachable (refused, no connection or handshake in time) that
    /// answered a probe before their down time was up, and were asked again from then on.
    pub revived: AtomicU64,
    /// The same, by owner address: at most [`MAX_OWNERS_COUNTED`] owners by name, the rest
    /// under [`OTHER_OWNERS`] (pod IPs are reused and churn: the labels stay bounded).
    owner_stalls: Mutex<BTreeMap<String, u64>>,
}

/// Owners counted by name in [`PeerMetrics::owner_stalls`].
pub const MAX_OWNERS_COUNTED: usize = 64;
/// The label of stalls of owners past [`MAX_OWNERS_COUNTED`].
pub const OTHER_OWNERS: &str = "other";

/// A point-in-time copy, for JSON and tests.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct PeerSnapshot {
    pub requests: u64,
    pub request_failures: u64,
    pub request_busy: u64,
    pub request_timeouts: u64,
    pub body_timeouts: u64,
    pub skipped_down: u64,
    #[serde(default)]
    pub rerouted: u64,
    #[serde(default)]
    pub slow_headers: u64,
    pub owned_here: u64,
    pub served_requests: u64,
    pub served_bytes: u64,
    pub served_rejected: u64,
    pub served_busy: u64,
    pub served_errors: u64,
    pub forwarded: u64,
    pub tls_refused: u64,
    #[serde(default)]
    pub upload_wait_us: u64,
    #[serde(default)]
    pub stalls: u64,
    #[serde(default)]
    pub revived: u64,
}

impl PeerMetrics {
    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a stall of `owner`'s answer.
    pub(crate) fn stalled(&self, owner: &str) {
        Self::inc(&self.stalls);
        let mut by_owner = self.owner_stalls.lock().unwrap_or_else(|e| e.into_inner());
        let key = if by_owner.contains_key(owner) || by_owner.len() < MAX_OWNERS_COUNTED {
            owner
        } else {
            OTHER_OWNERS
        };
        let n = by_owner.entry(key.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
    }

    /// Stalls by owner address (and [`OTHER_OWNERS`]).
    pub fn owner_stalls(&self) -> Vec<(String, u64)> {
        self.owner_stalls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    pub fn snapshot(&self) -> PeerSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PeerSnapshot {
            requests: g(&self.requests),
            request_failures: g(&self.request_failures),
            request_busy: g(&self.request_busy),
            request_timeouts: g(&self.request_timeouts),
            body_timeouts: g(&self.body_timeouts),
            skipped_down: g(&self.skipped_down),
            rerouted: g(&self.rerouted),
            slow_headers: g(&self.slow_headers),
            owned_here: g(&self.owned_here),
            served_requests: g(&self.served_requests),
            served_bytes: g(&self.served_bytes),
            served_rejected: g(&self.served_rejected),
            served_busy: g(&self.served_busy),
            served_errors: g(&self.served_errors),
            forwarded: g(&self.forwarded),
            tls_refused: g(&self.tls_refused),
            upload_wait_us: g(&self.upload_wait_us),
            stalls: g(&self.stalls),
            revived: g(&self.revived),
        }
    }
}
