//! The origin tier: a chunk (or a manifest) from the object store, with the policy's
//! timeouts and jittered retries, cut short by the per-store breaker (`crate::breaker`), its
//! latency and bytes recorded for the link (`crate::link`).

use std::time::{Duration, Instant};

use bytes::Bytes;
use sealed_store::retry::RetryPolicy;
use sealed_store::{ChunkStore, Digest, Error as StoreError, StoreOptions};

use super::NodeCache;
use crate::breaker::Admission;
use crate::error::FetchError;
use crate::metrics::MountMetrics;

/// How long to wait for the object store, and how often to try.
#[derive(Clone, Copy, Debug)]
pub struct FetchPolicy {
    /// Bound on one attempt to fetch one chunk.
    pub attempt_timeout: Duration,
    /// Further attempts after a timeout or a backend error (not after a missing or corrupt
    /// chunk: those are answers, not accidents).
    pub retries: u32,
    /// Bound on the first pause between attempts; the bound doubles each time, up to 2 s.
    /// Each pause is drawn in the upper half of its bound (jittered: `sealed_store::retry`),
    /// so that a fleet whose store failed at one instant does not retry in lockstep.
    pub backoff: Duration,
    /// Circuit breaker: after a fetch from a store fails by timeout or backend error (after
    /// its retries), fetches from that store fail at once (EIO) for this long, then one probe
    /// goes through. Zero turns the breaker off. See `crate::breaker`.
    pub breaker_open: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            attempt_timeout: Duration::from_secs(20),
            retries: 2,
            backoff: Duration::from_millis(200),
            breaker_open: Duration::from_secs(5),
        }
    }
}

impl FetchPolicy {
    /// The policy for the store options the user gave (`--store-timeout`,
    /// `--store-retries`): an attempt per request timeout, and the retries asked for.
    pub fn for_store(store: &StoreOptions) -> FetchPolicy {
        FetchPolicy {
            attempt_timeout: store.timeout,
            retries: u32::try_from(store.retries).unwrap_or(u32::MAX),
            ..FetchPolicy::default()
        }
    }

    /// The options to open the store a mount reads through: `store` without the client's
    /// own retries, which this policy owns. Retried in both layers, `--store-retries N` made
    /// up to (N+1)² requests of one chunk, and [`FetchPolicy::worst_case`] was not the bound.
    pub fn store_options(store: &StoreOptions) -> StoreOptions {
        StoreOptions {
            retries: 0,
            ..store.clone()
        }
    }

    /// The longest one chunk fetch from the store can take before it fails: every attempt
    /// timing out, plus the pauses between them. With the breaker on, this is also the bound
    /// on one read request of uncached data while the store is down (docs/mount.md).
    /// Saturates rather than overflows for absurd policies (callers bound them; see
    /// `sealed_store::limits`).
    pub fn worst_case(&self) -> Duration {
        let attempts = self.retries.saturating_add(1);
        let mut total = self.attempt_timeout.saturating_mul(attempts);
        let pauses = self.pauses();
        // Pause n is below min(2^(n+1) * first, cap) (`RetryPolicy`).
        let mut bound = pauses.first().saturating_mul(2);
        for _ in 0..self.retries.min(1000) {
            total = total.saturating_add(bound.min(pauses.cap()));
            bound = bound.saturating_mul(2);
        }
        total
    }

    /// The jittered pauses between attempts: pause n in `[b/2, b)` for the bound
    /// `b = min(backoff * 2^n, 2 s)` (the unjittered schedule this replaced paused `b`).
    pub(crate) fn pauses(&self) -> RetryPolicy {
        RetryPolicy::new(self.backoff / 2, MAX_PAUSE)
    }
}

/// The bound on one pause between attempts.
pub(super) const MAX_PAUSE: Duration = Duration::from_secs(2);

impl NodeCache {
    /// The manifest of `digest`, verified against it ([`ChunkStore::get_manifest_bytes`]),
    /// with the policy's timeouts and retries. Only a store that fails (a backend error, a
    /// timeout) is asked again; an answer (unknown version, wrong digest, too large) is final.
    pub(crate) async fn manifest_bytes(
        &self,
        store: &ChunkStore,
        digest: &Digest,
    ) -> Result<Bytes, StoreError> {
        let policy = self.inner.policy;
        let mut pauses = policy.pauses().schedule();
        let attempts = policy.retries.saturating_add(1);
        let mut attempt = 1;
        loop {
            let error = match tokio::time::timeout(
                policy.attempt_timeout,
                store.get_manifest_bytes(digest),
            )
            .await
            {
                Ok(Ok(bytes)) => return Ok(bytes),
                Ok(Err(e @ (StoreError::Backend { .. } | StoreError::Timeout { .. }))) => e,
                Ok(Err(answer)) => return Err(answer),
                Err(_) => StoreError::Timeout {
                    store: store.name().to_owned(),
                    what: format!("manifest {digest}"),
                    seconds: policy.attempt_timeout.as_secs(),
                },
            };
            if attempt >= attempts {
                return Err(error);
            }
            tracing::warn!(%digest, attempt, error = %error, "manifest fetch failed");
            tokio::time::sleep(pauses.next_delay()).await;
            attempt += 1;
        }
    }

    pub(super) async fn fetch_from_store(
        &self,
        store: &ChunkStore,
        digest: &Digest,
    ) -> Result<Bytes, FetchError> {
        let metrics = &self.inner.metrics;
        let breakers = &self.inner.breakers;
        let (mut opened, probe) = match breakers.admit(store.name()) {
            Admission::Go { opened, probe } => (opened, probe),
            Admission::FailFast { retry_in } => {
                MountMetrics::inc(&metrics.store_fast_failures);
                return Err(FetchError::StoreFailing {
                    digest: *digest,
                    store: store.name().to_owned(),
                    retry_in,
                });
            }
        };
        let attempts = self.attempts(store, digest);
        // The breaker opening (another fetch from this store failed) ends this one too: the
        // store is down, and its readers must not wait longer than the bound from their start.
        let outcome = tokio::select! {
            outcome = attempts => outcome,
            _ = opened.changed() => Err(Attempts::Abandoned),
        };
        match outcome {
            Ok(data) => {
                breakers.success(store.name(), probe);
                Ok(data)
            }
            Err(Attempts::Answer(e)) => {
                // A missing or corrupt chunk is an answer: the store works.
                breakers.success(store.name(), probe);
                Err(e)
            }
            Err(Attempts::Failed(e)) => {
                MountMetrics::inc(&metrics.store_errors);
                if breakers.failure(store.name(), probe) {
                    MountMetrics::inc(&metrics.breaker_opens);
                    tracing::warn!(
                        store = store.name(),
                        open_for = ?self.inner.policy.breaker_open,
                        error = %e,
                        "store failing: further fetches from it fail at once for a while"
                    );
                }
                Err(e)
            }
            Err(Attempts::Abandoned) => {
                MountMetrics::inc(&metrics.store_fast_failures);
                Err(FetchError::StoreFailing {
                    digest: *digest,
                    store: store.name().to_owned(),
                    retry_in: self.inner.policy.breaker_open,
                })
            }
        }
    }

    /// The attempts of one fetch, with their timeouts and backoff.
    async fn attempts(&self, store: &ChunkStore, digest: &Digest) -> Result<Bytes, Attempts> {
        let policy = self.inner.policy;
        let metrics = &self.inner.metrics;
        let mut pauses = policy.pauses().schedule();
        let mut last = None;
        for attempt in 1..=policy.retries.saturating_add(1) {
            let started = Instant::now();
            let outcome =
                tokio::time::timeout(policy.attempt_timeout, store.get_chunk(digest)).await;
            let error = match outcome {
                Ok(Ok(data)) => {
                    MountMetrics::inc(&metrics.store_fetches);
                    MountMetrics::add(&metrics.store_bytes_fetched, data.len() as u64);
                    let took = started.elapsed();
                    metrics.record_fetch_latency(took);
                    self.inner.links.get(store.name()).record(
                        Instant::now(),
                        took,
                        data.len() as u64,
                    );
                    return Ok(data);
                }
                Ok(Err(StoreError::MissingChunk { .. })) => {
                    MountMetrics::inc(&metrics.store_errors);
                    return Err(Attempts::Answer(FetchError::Missing {
                        digest: *digest,
                        store: store.name().to_owned(),
                    }));
                }
                Ok(Err(StoreError::CorruptChunk { actual, .. })) => {
                    MountMetrics::inc(&metrics.store_errors);
                    MountMetrics::inc(&metrics.verification_failures);
                    tracing::error!(%digest, %actual, store = store.name(), "corrupt chunk in store");
                    return Err(Attempts::Answer(FetchError::Corrupt {
                        digest: *digest,
                        actual,
                        store: store.name().to_owned(),
                    }));
                }
                Ok(Err(e @ StoreError::ResponseTooLarge { .. })) => {
                    MountMetrics::inc(&metrics.store_errors);
                    MountMetrics::inc(&metrics.verification_failures);
                    tracing::error!(%digest, store = store.name(), error = %e, "oversized chunk from store");
                    return Err(Attempts::Answer(FetchError::Oversized {
                        digest: *digest,
                        store: store.name().to_owned(),
                        reason: e.to_string(),
                    }));
                }
                Ok(Err(e)) => FetchError::Unavailable {
                    digest: *digest,
                    store: store.name().to_owned(),
                    attempts: attempt,
                    reason: e.to_string(),
                },
                Err(_) => {
                    MountMetrics::inc(&metrics.store_timeouts);
                    FetchError::TimedOut {
                        digest: *digest,
                        store: store.name().to_owned(),
                        per_attempt: policy.attempt_timeout,
                        attempts: attempt,
                    }
                }
            };
            tracing::warn!(%digest, attempt, error = %error, "chunk fetch failed");
            last = Some(error);
            if attempt <= policy.retries {
                tokio::time::sleep(pauses.next_delay()).await;
            }
        }
        Err(Attempts::Failed(last.unwrap_or(FetchError::Internal {
            digest: *digest,
            reason: "no attempt made".into(),
        })))
    }
}

/// How the attempts of one fetch ended, when they did not bring the bytes.
enum Attempts {
    /// The store answered: the chunk is missing, corrupt or oversized (not retried, not a
    /// store fault).
    Answer(FetchError),
    /// Timeouts or backend errors on every attempt: the store is failing.
    Failed(FetchError),
    /// The breaker opened meanwhile.
    Abandoned,
}

/// Bytes-in-flight gauge around a store fetch.
pub(super) struct InFlight<'a> {
    metrics: &'a MountMetrics,
    bytes: u64,
}

impl<'a> InFlight<'a> {
    pub(super) fn new(metrics: &'a MountMetrics, bytes: u64) -> Self {
        MountMetrics::add(&metrics.bytes_in_flight, bytes);
        MountMetrics::inc(&metrics.fetches_in_flight);
        InFlight { metrics, bytes }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        MountMetrics::sub(&self.metrics.bytes_in_flight, self.bytes);
        MountMetrics::sub(&self.metrics.fetches_in_flight, 1);
    }
}
