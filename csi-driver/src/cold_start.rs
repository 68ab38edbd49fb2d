//! The cold-start record of each FUSE mount this plugin makes (docs/csi.md): time to mount,
//! time to first byte, bytes read and the effective rate, and the bytes each tier supplied.
//! It is taken when the mount's readers go quiet (or after [`LONGEST`]), then recorded as
//! `sealed_cold_start_*` metrics, a log line, and a Normal `ColdStart` Event on the pod the
//! mount was made for, so a team can see why its cold start was slow.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use sealed_crds::human_bytes as bytes;
use sealed_mount::Tier;
use sealed_mount::cold_start::{ColdStart, ColdStartSnapshot};
use sealed_store::Digest;

use crate::kube_access::{KubeAccess, PodInfo};

pub use sealed_mount::cold_start::{LONGEST, QUIET};

const POLL: Duration = Duration::from_millis(500);

/// The `sealed_cold_start_*` series.
#[derive(Clone)]
pub struct ColdStartMetrics {
    seconds: HistogramVec,
    rate: Histogram,
    bytes: IntCounterVec,
}

const SECONDS_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// 10 MB/s to 100 GB/s.
const RATE_BUCKETS: &[f64] = &[
    1e7, 2.5e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11,
];

impl ColdStartMetrics {
    pub fn register(registry: &Registry) -> Result<ColdStartMetrics, prometheus::Error> {
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "sealed_cold_start_seconds",
                "Per FUSE mount: seconds from the start of the mount to it serving requests \
                 (phase=mount) and to the first byte a reader got (phase=first_byte)",
            )
            .buckets(SECONDS_BUCKETS.to_vec()),
            &["phase"],
        )?;
        let rate = Histogram::with_opts(
            HistogramOpts::new(
                "sealed_cold_start_read_bytes_per_second",
                "Per FUSE mount: bytes read during its cold start over the time from ready \
                 to the last read (waits on cold chunks included)",
            )
            .buckets(RATE_BUCKETS.to_vec()),
        )?;
        let bytes = IntCounterVec::new(
            Opts::new(
                "sealed_cold_start_bytes_total",
                "Chunk bytes the cold starts of FUSE mounts got, by tier (memory, disk, peer, \
                 origin)",
            ),
            &["tier"],
        )?;
        registry.register(Box::new(seconds.clone()))?;
        registry.register(Box::new(rate.clone()))?;
        registry.register(Box::new(bytes.clone()))?;
        // Every series exists from the start, so dashboards and alerts see zeroes.
        for phase in ["mount", "first_byte"] {
            seconds.with_label_values(&[phase]);
        }
        for tier in Tier::ALL {
            bytes.with_label_values(&[tier.label()]);
        }
        Ok(ColdStartMetrics {
            seconds,
            rate,
            bytes,
        })
    }

    fn observe(&self, s: &ColdStartSnapshot) {
        if let Some(ready) = s.ready {
            self.seconds
                .with_label_values(&["mount"])
                .observe(ready.as_secs_f64());
        }
        if let Some(first) = s.first_byte {
            self.seconds
                .with_label_values(&["first_byte"])
                .observe(first.as_secs_f64());
        }
        if let Some(rate) = s.effective_bytes_per_second() {
            self.rate.observe(rate);
        }
        for tier in Tier::ALL {
            self.bytes
                .with_label_values(&[tier.label()])
                .inc_by(s.tier(tier));
        }
    }
}

/// Follows a new mount's cold start in the background and records it when it is over, with
/// an Event on `pod` (the pod the mount was made for; none in standalone mode). A mount
/// unmounted first is recorded with what it read by then.
pub fn follow(
    record: Arc<ColdStart>,
    digest: Digest,
    metrics: ColdStartMetrics,
    pod: Option<(Arc<KubeAccess>, PodInfo)>,
) {
    tokio::spawn(async move {
        let snapshot = wait_until_over(&record).await;
        metrics.observe(&snapshot);
        let message = describe(&digest, &snapshot);
        tracing::info!(%digest, ?snapshot, "{message}");
        if let Some((kube, pod)) = pod {
            kube.record_event(&pod, "ColdStart", message).await;
        }
    });
}

/// The record once readers went quiet after reading, or at [`LONGEST`], or when the mount
/// went: the filesystem holds the other reference to `record`, and the last read is in.
async fn wait_until_over(record: &Arc<ColdStart>) -> ColdStartSnapshot {
    loop {
        let s = record.snapshot();
        if s.is_over() || Arc::strong_count(record) == 1 {
            return s;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The Event's message: one line a person reads in `kubectl describe pod`.
pub fn describe(digest: &Digest, s: &ColdStartSnapshot) -> String {
    let secs = |d: Option<Duration>| {
        d.map_or_else(|| "-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()))
    };
    let short = digest.to_string();
    let short = short.get(..15).unwrap_or(&short);
    let mut out = format!("cold start of {short}: mounted in {}", secs(s.ready));
    match s.first_byte {
        None => out.push_str(&format!(", nothing read in {:.0} s", s.age.as_secs_f64())),
        Some(_) => {
            let span = s.last_read.zip(s.ready).and_then(|(l, r)| l.checked_sub(r));
            out.push_str(&format!(
                ", first byte after {}, {} read in {}",
                secs(s.first_byte),
                bytes(s.bytes_read),
                secs(span)
            ));
            if let Some(rate) = s.effective_bytes_per_second() {
                out.push_str(&format!(" ({:.2} GB/s)", rate / 1e9));
            }
        }
    }
    let tiers: Vec<String> = Tier::ALL
        .iter()
        .map(|t| format!("{} {}", t.label(), bytes(s.tier(*t))))
        .collect();
    out.push_str(&format!("; chunks from {}", tiers.join(", ")));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> ColdStartSnapshot {
        ColdStartSnapshot {
            ready: Some(Duration::from_millis(120)),
            first_byte: Some(Duration::from_millis(500)),
            last_read: Some(Duration::from_millis(2120)),
            age: Duration::from_secs(9),
            bytes_read: 2 << 30,
            tier_bytes: [0, 1 << 20, 3 << 29, 1 << 29],
        }
    }

    #[test]
    fn the_message_says_where_the_time_and_bytes_went() {
        let digest = Digest::of(b"x");
        let m = describe(&digest, &snapshot());
        let short = &digest.to_string()[..15];
        assert_eq!(
            m,
            format!(
                "cold start of {short}: mounted in 0.12 s, first byte after 0.50 s, 2.0 GiB read \
                 in 2.00 s (1.07 GB/s); chunks from memory 0 B, disk 1.0 MiB, peer 1.5 GiB, \
                 origin 512.0 MiB"
            )
        );
        let unread = ColdStartSnapshot {
            first_byte: None,
            last_read: None,
            bytes_read: 0,
            ..snapshot()
        };
        assert!(describe(&digest, &unread).contains("nothing read in 9 s"));
    }

    #[test]
    fn over_when_quiet_after_reading_or_too_old() {
        let s = snapshot();
        assert!(s.is_over(), "quiet for 6.9 s after reading");
        let busy = ColdStartSnapshot {
            last_read: Some(Duration::from_secs(8)),
            ..s
        };
        assert!(!busy.is_over());
        let unread = ColdStartSnapshot {
            first_byte: None,
            last_read: None,
            ..s
        };
        assert!(!unread.is_over(), "nobody read yet: wait for a reader");
        let old = ColdStartSnapshot {
            age: LONGEST,
            ..unread
        };
        assert!(old.is_over());
    }

    #[test]
    fn metrics_count_each_tier() {
        let registry = Registry::new();
        let m = ColdStartMetrics::register(&registry).unwrap();
        m.observe(&snapshot());
        let text = {
            use prometheus::Encoder as _;
            let mut buf = Vec::new();
            prometheus::TextEncoder::new()
                .encode(&registry.gather(), &mut buf)
                .unwrap();
            String::from_utf8(buf).unwrap()
        };
        assert!(text.contains("sealed_cold_start_bytes_total{tier=\"peer\"} 1610612736"));
        assert!(text.contains("sealed_cold_start_seconds_count{phase=\"first_byte\"} 1"));
        assert!(text.contains("sealed_cold_start_read_bytes_per_second_count 1"));
    }
}
