//! An optional cap on the bytes per second this node serves to all its peers together
//! (`--peer-upload-rate`).
//!
//! Why: an owner sends each chunk it owns to every other node, so in a rollout a node sends
//! about a version's size and its uplink is the busiest link it has; on a NIC that also
//! carries the workloads' traffic the tier should not take all of it. The cap is a token
//! bucket (`governor`, in KiB cells) that each chunk's body passes in slices. It does not
//! make a fleet on FIFO-queued links faster (measured: docs/benchmarks.md, "Upload cap").

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use crate::metrics::PeerMetrics;

/// A body goes out in slices this large, each waiting for its tokens.
pub(crate) const SLICE: usize = 64 * 1024;
/// The bucket counts KiB: a u32 of them covers any NIC.
const CELL: u64 = 1024;
/// The least cap: a 4 MiB chunk (the largest) still goes out within the asker's 10 s body
/// bound with room to spare.
pub const MIN_UPLOAD_RATE: u64 = 1 << 20;
/// The bucket holds this long at the cap (at least one slice): enough to keep a link busy
/// between wake-ups, little enough not to fill a FIFO queue in one go.
const BURST_MS: u64 = 20;

/// A cap as the flags give it (`--peer-upload-rate`, bytes per second), refused below
/// [`MIN_UPLOAD_RATE`] with the least named.
pub fn checked_rate(rate: Option<u64>) -> Result<Option<u64>, String> {
    match rate {
        Some(rate) if rate < MIN_UPLOAD_RATE => Err(format!(
            "--peer-upload-rate {rate} bytes/s: want at least 1Mi (a 4 MiB chunk must reach its asker within 10 s)"
        )),
        rate => Ok(rate),
    }
}

/// The cap, shared by every answer this node sends.
pub struct UploadPacer {
    limiter: DefaultDirectRateLimiter,
    metrics: Arc<PeerMetrics>,
}

impl std::fmt::Debug for UploadPacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadPacer").finish_non_exhaustive()
    }
}

impl UploadPacer {
    /// A cap of `bytes_per_second` (at least [`MIN_UPLOAD_RATE`]: callers check that and say
    /// so; here it is only clamped).
    pub fn new(bytes_per_second: u64, metrics: Arc<PeerMetrics>) -> UploadPacer {
        let rate = bytes_per_second.max(MIN_UPLOAD_RATE);
        let kib_per_second = cells(rate);
        let burst = cells(rate.saturating_mul(BURST_MS) / 1000).max(cells(SLICE as u64));
        let quota = Quota::per_second(kib_per_second).allow_burst(burst);
        UploadPacer {
            limiter: RateLimiter::direct(quota),
            metrics,
        }
    }

    /// Waits until `bytes` (at most a slice) may go out.
    async fn take(&self, bytes: usize) {
        let n = cells(bytes.min(SLICE) as u64);
        let started = Instant::now();
        // A slice never exceeds the burst, so the bucket can always hold it.
        if self.limiter.until_n_ready(n).await.is_err() {
            return;
        }
        let waited = started.elapsed().as_micros();
        if waited > 0 {
            PeerMetrics::add(
                &self.metrics.upload_wait_us,
                u64::try_from(waited).unwrap_or(u64::MAX),
            );
        }
    }
}

/// KiB cells for `bytes`, rounded up, within what a bucket counts.
fn cells(bytes: u64) -> NonZeroU32 {
    let kib = bytes.div_ceil(CELL).clamp(1, u64::from(u32::MAX));
    NonZeroU32::new(u32::try_from(kib).unwrap_or(u32::MAX)).unwrap_or(NonZeroU32::MIN)
}

/// The body of an answer: the chunk at once without a cap, or in slices paced by it. An
/// error stays one item (the stream is reset, never a short body).
pub(crate) fn body(
    served: std::io::Result<Bytes>,
    pacer: Option<Arc<UploadPacer>>,
) -> BoxStream<'static, std::io::Result<Bytes>> {
    match (served, pacer) {
        (Ok(data), Some(pacer)) => {
            futures::stream::unfold((data, pacer), |(mut rest, pacer)| async move {
                if rest.is_empty() {
                    return None;
                }
                let slice = rest.split_to(rest.len().min(SLICE));
                pacer.take(slice.len()).await;
                Some((Ok(slice), (rest, pacer)))
            })
            .boxed()
        }
        (served, _) => futures::stream::once(async move { served }).boxed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt as _;
    use std::time::Duration;

    fn pattern(len: usize) -> Bytes {
        (0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>().into()
    }

    #[tokio::test]
    async fn a_paced_body_is_the_chunk_in_order_and_takes_its_time() {
        let metrics = Arc::new(PeerMetrics::default());
        // 2 MiB/s: the burst is one slice, so 4 MiB takes at least ~1.9 s.
        let pacer = Arc::new(UploadPacer::new(2 << 20, metrics.clone()));
        let data = pattern(4 << 20);
        let started = Instant::now();
        let slices: Vec<Bytes> = body(Ok(data.clone()), Some(pacer))
            .try_collect()
            .await
            .unwrap();
        let took = started.elapsed();
        assert!(slices.iter().all(|s| s.len() <= SLICE));
        assert_eq!(slices.concat(), data.to_vec());
        assert!(
            took >= Duration::from_millis(1800),
            "4 MiB at 2 MiB/s took {took:?}"
        );
        assert!(metrics.snapshot().upload_wait_us >= 1_500_000);
    }

    #[tokio::test]
    async fn the_cap_is_shared_by_all_answers() {
        let metrics = Arc::new(PeerMetrics::default());
        let pacer = Arc::new(UploadPacer::new(4 << 20, metrics));
        let started = Instant::now();
        // Four 1 MiB answers at once through one 4 MiB/s cap: about a second, not a quarter.
        let answers =
            (0..4).map(|_| body(Ok(pattern(1 << 20)), Some(pacer.clone())).try_collect::<Vec<_>>());
        for answer in futures::future::join_all(answers).await {
            assert_eq!(answer.unwrap().concat(), pattern(1 << 20).to_vec());
        }
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(900),
            "4 MiB at 4 MiB/s took {took:?}"
        );
    }

    #[tokio::test]
    async fn without_a_cap_the_body_is_one_piece_and_an_error_stays_an_error() {
        let data = pattern(3 << 20);
        let slices: Vec<Bytes> = body(Ok(data.clone()), None).try_collect().await.unwrap();
        assert_eq!(slices, vec![data]);
        let pacer = Arc::new(UploadPacer::new(2 << 20, Arc::new(PeerMetrics::default())));
        let failed: Vec<_> = body(Err(std::io::Error::other("gone")), Some(pacer))
            .collect()
            .await;
        assert_eq!(failed.len(), 1);
        assert!(failed[0].is_err());
    }

    #[test]
    fn a_cap_below_the_least_is_refused_with_the_least_named() {
        let err = checked_rate(Some(1000)).unwrap_err();
        assert!(err.contains("at least 1Mi"), "{err}");
        assert_eq!(
            checked_rate(Some(MIN_UPLOAD_RATE)),
            Ok(Some(MIN_UPLOAD_RATE))
        );
        assert_eq!(checked_rate(None), Ok(None));
    }

    #[test]
    fn rates_are_clamped_to_what_the_bucket_counts() {
        assert_eq!(cells(0).get(), 1);
        assert_eq!(cells(1).get(), 1);
        assert_eq!(cells(1025).get(), 2);
        assert_eq!(cells(u64::MAX).get(), u32::MAX);
    }
}
