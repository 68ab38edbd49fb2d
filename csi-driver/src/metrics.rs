//! Prometheus metrics and `/healthz`, served over HTTP on `--metrics-addr`.
//!
//! The plugin's own metrics (mounts, publish latency and errors) live in a [`Metrics`]
//! registry; the mount crate's [`MountMetrics`] (cache tiers, store fetches, verification) are
//! read at scrape time by a collector, so `sealed-mount` knows nothing about Prometheus.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Counter, Encoder as _, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};
use sealed_mount::metrics::PROFILE_IGNORE_REASONS;
use sealed_mount::{MetricsSnapshot, MountMetrics};
use tonic::Code;

use crate::cold_start::ColdStartMetrics;

/// The plugin's metrics. One per process, shared by the driver and the gRPC services.
pub struct Metrics {
    registry: Registry,
    fuse_mounts: IntGauge,
    published_volumes: IntGauge,
    publish_seconds: HistogramVec,
    publish_errors: IntCounterVec,
    unpublish_errors: IntCounterVec,
    mounts_resumed: IntCounter,
    mounts_unprotected: IntGauge,
    cold_start: ColdStartMetrics,
}

const PUBLISH_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl Metrics {
    /// `mount` is the node cache's counters ([`sealed_mount::NodeCache::metrics`]).
    pub fn new(mount: Arc<MountMetrics>) -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let fuse_mounts = IntGauge::new(
            "sealed_csi_fuse_mounts",
            "FUSE mounts on this node (one per mounted version)",
        )?;
        let published_volumes = IntGauge::new(
            "sealed_csi_published_volumes",
            "Published volumes (bind mounts into pods) on this node",
        )?;
        let publish_seconds = HistogramVec::new(
            HistogramOpts::new(
                "sealed_csi_publish_duration_seconds",
                "NodePublishVolume latency, by gRPC code (OK for a success)",
            )
            .buckets(PUBLISH_BUCKETS.to_vec()),
            &["code"],
        )?;
        let publish_errors = IntCounterVec::new(
            Opts::new(
                "sealed_csi_publish_errors_total",
                "Failed NodePublishVolume calls, by gRPC code",
            ),
            &["code"],
        )?;
        let unpublish_errors = IntCounterVec::new(
            Opts::new(
                "sealed_csi_unpublish_errors_total",
                "Failed NodeUnpublishVolume calls, by gRPC code",
            ),
            &["code"],
        )?;
        let mounts_resumed = IntCounter::new(
            "sealed_csi_mounts_resumed_total",
            "FUSE mounts of an earlier run of the plugin served again from the fd holder",
        )?;
        let mounts_unprotected = IntGauge::new(
            "sealed_csi_mounts_unprotected",
            "FUSE mounts whose fd the fd holder does not have: a plugin restart would break them",
        )?;
        registry.register(Box::new(mounts_resumed.clone()))?;
        registry.register(Box::new(mounts_unprotected.clone()))?;
        registry.register(Box::new(fuse_mounts.clone()))?;
        registry.register(Box::new(published_volumes.clone()))?;
        registry.register(Box::new(publish_seconds.clone()))?;
        registry.register(Box::new(publish_errors.clone()))?;
        registry.register(Box::new(unpublish_errors.clone()))?;
        registry.register(Box::new(MountCollector::new(mount)?))?;
        registry.register(Box::new(build_info()?))?;
        let cold_start = ColdStartMetrics::register(&registry)?;
        // The success series exists from the start (rate() and the dashboard see it at once).
        publish_seconds.with_label_values(&["OK"]);
        Ok(Metrics {
            registry,
            fuse_mounts,
            published_volumes,
            publish_seconds,
            publish_errors,
            unpublish_errors,
            mounts_resumed,
            mounts_unprotected,
            cold_start,
        })
    }

    /// The cold-start series (`crate::cold_start`).
    pub fn cold_start(&self) -> &ColdStartMetrics {
        &self.cold_start
    }

    pub fn add_resumed(&self, n: usize) {
        self.mounts_resumed
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }

    pub fn set_unprotected(&self, n: usize) {
        self.mounts_unprotected
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn set_counts(&self, fuse_mounts: usize, published: usize) {
        self.fuse_mounts
            .set(i64::try_from(fuse_mounts).unwrap_or(i64::MAX));
        self.published_volumes
            .set(i64::try_from(published).unwrap_or(i64::MAX));
    }

    /// One NodePublishVolume call: its latency, and its code when it failed.
    pub fn observe_publish(&self, elapsed: Duration, error: Option<Code>) {
        let code = code_label(error.unwrap_or(Code::Ok));
        self.publish_seconds
            .with_label_values(&[code.as_str()])
            .observe(elapsed.as_secs_f64());
        if error.is_some() {
            self.publish_errors
                .with_label_values(&[code.as_str()])
                .inc();
        }
    }

    pub fn observe_unpublish(&self, error: Option<Code>) {
        if let Some(code) = error {
            self.unpublish_errors
                .with_label_values(&[code_label(code).as_str()])
                .inc();
        }
    }

    /// Adds a collector read at scrape time (the peer tier's, when it is on).
    pub fn register(&self, collector: Box<dyn Collector>) -> Result<(), prometheus::Error> {
        self.registry.register(collector)
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// `sealed_csi_build_info{version,git_commit,rustc} 1`: what built this plugin.
fn build_info() -> Result<prometheus::IntGaugeVec, prometheus::Error> {
    use sealed_service::build::{BuildInfo, LABELS};
    let g = prometheus::IntGaugeVec::new(
        Opts::new(
            "sealed_csi_build_info",
            "1, labelled with the version, git commit and compiler that built the node plugin",
        ),
        &LABELS,
    )?;
    g.with_label_values(&BuildInfo::of(env!("CARGO_PKG_VERSION")).label_values())
        .set(1);
    Ok(g)
}

/// `PermissionDenied`, `Unavailable`, … as gRPC names them.
fn code_label(code: Code) -> String {
    format!("{code:?}")
}

enum Kind {
    Counter,
    Gauge,
}

/// The mount crate's counters without a label: name, help, kind, value.
type Plain = (
    &'static str,
    &'static str,
    Kind,
    fn(&MetricsSnapshot) -> u64,
);

const PLAIN: &[Plain] = &[
    (
        "sealed_store_fetches_total",
        "Chunks fetched from the object store",
        Kind::Counter,
        |s| s.store_fetches,
    ),
    (
        "sealed_store_fetched_bytes_total",
        "Bytes fetched from the object store",
        Kind::Counter,
        |s| s.store_bytes_fetched,
    ),
    (
        "sealed_store_fetch_errors_total",
        "Object-store fetches that failed after their retries",
        Kind::Counter,
        |s| s.store_errors,
    ),
    (
        "sealed_store_fetch_timeouts_total",
        "Object-store fetch attempts that hit the per-attempt timeout",
        Kind::Counter,
        |s| s.store_timeouts,
    ),
    (
        "sealed_verification_failures_total",
        "Chunks whose bytes did not match their digest (never served)",
        Kind::Counter,
        |s| s.verification_failures,
    ),
    (
        "sealed_store_breaker_opens_total",
        "Times a store's circuit breaker opened (a fetch failed on every attempt)",
        Kind::Counter,
        |s| s.breaker_opens,
    ),
    (
        "sealed_store_fast_failures_total",
        "Chunk fetches failed at once because the store's circuit breaker was open",
        Kind::Counter,
        |s| s.store_fast_failures,
    ),
    (
        "sealed_read_bytes_total",
        "Bytes returned to readers of sealed volumes",
        Kind::Counter,
        |s| s.bytes_read,
    ),
    (
        "sealed_read_errors_total",
        "Reads of sealed volumes answered with EIO",
        Kind::Counter,
        |s| s.read_errors,
    ),
    (
        "sealed_disk_cache_evictions_total",
        "Chunks evicted from the node disk cache",
        Kind::Counter,
        |s| s.disk_evictions,
    ),
    (
        "sealed_cache_free_space_guard_total",
        "Chunks and files the node disk cache did not keep because the cache filesystem was at its free-space floor (--cache-min-free-percent)",
        Kind::Counter,
        |s| s.cache_free_space_refusals,
    ),
    (
        "sealed_prefetch_issued_total",
        "Readahead chunk fetches issued",
        Kind::Counter,
        |s| s.prefetch_issued,
    ),
    (
        "sealed_prefetch_skipped_total",
        "Readahead chunks skipped because the node's prefetch budget was spent",
        Kind::Counter,
        |s| s.prefetch_skipped,
    ),
    (
        "sealed_passthrough_opens_total",
        "Opens of hydrated files answered by FUSE passthrough (the kernel serves their reads)",
        Kind::Counter,
        |s| s.passthrough_opens,
    ),
    (
        "sealed_passthrough_fallbacks_total",
        "Opens of hydrated files served by the daemon instead (passthrough unavailable or refused)",
        Kind::Counter,
        |s| s.passthrough_fallbacks,
    ),
    (
        "sealed_files_hydrated_total",
        "Files assembled complete and verified in the disk cache, for passthrough",
        Kind::Counter,
        |s| s.files_hydrated,
    ),
    (
        "sealed_hydration_failures_total",
        "Files whose assembly for passthrough failed (their reads stay daemon-served)",
        Kind::Counter,
        |s| s.hydration_failures,
    ),
    (
        "sealed_cache_files_verified_total",
        "Whole-file copies found in the disk cache that this process checked and found right (then served by passthrough)",
        Kind::Counter,
        |s| s.files_verified,
    ),
    (
        "sealed_cache_verified_bytes_total",
        "Bytes of whole-file copies in the disk cache checked by this process",
        Kind::Counter,
        |s| s.verified_bytes,
    ),
    (
        "sealed_unverified_opens_total",
        "Opens daemon-served because their disk cache copy was not checked in time",
        Kind::Counter,
        |s| s.unverified_opens,
    ),
    (
        "sealed_cache_scrubbed_files_total",
        "Disk cache entries hashed again by the background scrub",
        Kind::Counter,
        |s| s.scrub_files,
    ),
    (
        "sealed_cache_scrubbed_bytes_total",
        "Bytes hashed again by the background scrub of the disk cache",
        Kind::Counter,
        |s| s.scrub_bytes,
    ),
    (
        "sealed_cache_scrub_failures_total",
        "Disk cache entries the scrub found damaged (dropped and fetched again)",
        Kind::Counter,
        |s| s.scrub_failures,
    ),
    (
        "sealed_model_prefetch_files_total",
        "Model files (safetensors, GGUF) whose tensors the model-aware prefetch fetched",
        Kind::Counter,
        |s| s.model_prefetch_files,
    ),
    (
        "sealed_model_prefetch_chunks_total",
        "Chunks the model-aware prefetch fetched",
        Kind::Counter,
        |s| s.model_prefetch_chunks,
    ),
    (
        "sealed_model_header_failures_total",
        "Model files whose header was refused (prefetched in plain order instead)",
        Kind::Counter,
        |s| s.model_header_failures,
    ),
    (
        "sealed_learned_profiles_replayed_total",
        "Learned prefetch profiles replayed by mounts on this node",
        Kind::Counter,
        |s| s.learned_profiles_replayed,
    ),
    (
        "sealed_learned_prefetch_chunks_total",
        "Chunks learned prefetch profiles fetched ahead of readers",
        Kind::Counter,
        |s| s.learned_prefetch_chunks,
    ),
    (
        "sealed_learned_profiles_written_total",
        "Learned prefetch profiles this node recorded and stored",
        Kind::Counter,
        |s| s.learned_profiles_written,
    ),
    (
        "sealed_learned_profile_write_failures_total",
        "Learned prefetch profiles that could not be stored",
        Kind::Counter,
        |s| s.learned_profile_write_failures,
    ),
    (
        "sealed_disk_cache_bytes",
        "Bytes held by the node disk cache",
        Kind::Gauge,
        |s| s.disk_cache_bytes,
    ),
    (
        "sealed_cache_filesystem_free_bytes",
        "Free bytes of the filesystem under the node disk cache at the cache's last write",
        Kind::Gauge,
        |s| s.cache_filesystem_free_bytes,
    ),
    (
        "sealed_memory_cache_bytes",
        "Bytes held by the in-memory chunk cache",
        Kind::Gauge,
        |s| s.memory_cache_bytes,
    ),
    (
        "sealed_store_bytes_in_flight",
        "Bytes being fetched from the object store now",
        Kind::Gauge,
        |s| s.bytes_in_flight,
    ),
    (
        "sealed_store_fetches_in_flight",
        "Chunk fetches from the object store under way now",
        Kind::Gauge,
        |s| s.fetches_in_flight,
    ),
    (
        "sealed_prefetch_bytes_in_flight",
        "Readahead bytes being fetched now",
        Kind::Gauge,
        |s| s.prefetch_bytes_in_flight,
    ),
    (
        "sealed_readahead_window_bytes",
        "Largest readahead window allowed at the last read: the configured one, or twice the store link's bandwidth-delay product",
        Kind::Gauge,
        |s| s.readahead_window_bytes,
    ),
];

const HITS: (&str, &str) = (
    "sealed_cache_hits_total",
    "Chunk lookups answered by a cache tier (memory, disk)",
);
const MISSES: (&str, &str) = (
    "sealed_cache_misses_total",
    "Chunk lookups a cache tier could not answer (memory, disk)",
);
const PROFILES_IGNORED: (&str, &str) = (
    "sealed_learned_profiles_ignored_total",
    "Stored learned prefetch profiles not used, by reason (foreign, corrupt, oversized, stale)",
);
const CHUNK_FETCH_SECONDS: (&str, &str) = (
    "sealed_chunk_fetch_seconds",
    "Latency of chunk lookups answered by each tier (memory, disk, peer, origin)",
);
const FETCH_SECONDS: (&str, &str) = (
    "sealed_store_fetch_seconds_total",
    "Time spent in successful object-store fetches (divide by sealed_store_fetches_total)",
);

/// Reads [`MountMetrics`] at scrape time.
struct MountCollector {
    metrics: Arc<MountMetrics>,
    descs: Vec<Desc>,
}

impl MountCollector {
    fn new(metrics: Arc<MountMetrics>) -> Result<Self, prometheus::Error> {
        let mut descs = Vec::new();
        for (name, help, _, _) in PLAIN {
            descs.push(Desc::new(
                (*name).into(),
                (*help).into(),
                vec![],
                Default::default(),
            )?);
        }
        for (name, help) in [HITS, MISSES] {
            descs.push(Desc::new(
                name.into(),
                help.into(),
                vec!["tier".into()],
                Default::default(),
            )?);
        }
        descs.push(Desc::new(
            PROFILES_IGNORED.0.into(),
            PROFILES_IGNORED.1.into(),
            vec!["reason".into()],
            Default::default(),
        )?);
        descs.push(Desc::new(
            CHUNK_FETCH_SECONDS.0.into(),
            CHUNK_FETCH_SECONDS.1.into(),
            vec!["tier".into()],
            Default::default(),
        )?);
        descs.push(Desc::new(
            FETCH_SECONDS.0.into(),
            FETCH_SECONDS.1.into(),
            vec![],
            Default::default(),
        )?);
        Ok(MountCollector { metrics, descs })
    }

    fn families(&self) -> Result<Vec<MetricFamily>, prometheus::Error> {
        let s = self.metrics.snapshot();
        let mut families = Vec::new();
        for (name, help, kind, value) in PLAIN {
            let v = value(&s);
            families.extend(match kind {
                Kind::Counter => {
                    let c = IntCounter::new(*name, *help)?;
                    c.inc_by(v);
                    c.collect()
                }
                Kind::Gauge => {
                    let g = IntGauge::new(*name, *help)?;
                    g.set(i64::try_from(v).unwrap_or(i64::MAX));
                    g.collect()
                }
            });
        }
        for ((name, help), memory, disk) in [
            (HITS, s.memory_hits, s.disk_hits),
            (MISSES, s.memory_misses, s.disk_misses),
        ] {
            let c = IntCounterVec::new(Opts::new(name, help), &["tier"])?;
            c.with_label_values(&["memory"]).inc_by(memory);
            c.with_label_values(&["disk"]).inc_by(disk);
            families.extend(c.collect());
        }
        let c = IntCounterVec::new(
            Opts::new(PROFILES_IGNORED.0, PROFILES_IGNORED.1),
            &["reason"],
        )?;
        for (reason, n) in PROFILE_IGNORE_REASONS
            .iter()
            .zip(s.learned_profiles_ignored)
        {
            c.with_label_values(&[reason]).inc_by(n);
        }
        families.extend(c.collect());
        let c = Counter::new(FETCH_SECONDS.0, FETCH_SECONDS.1)?;
        c.inc_by(s.fetch_latency_us_sum as f64 / 1e6);
        families.extend(c.collect());
        families.push(chunk_fetch_family(&self.metrics));
        Ok(families)
    }
}

/// `sealed_chunk_fetch_seconds{tier}`: the mount crate's fixed-bucket histograms as one
/// Prometheus histogram family.
fn chunk_fetch_family(metrics: &MountMetrics) -> MetricFamily {
    use prometheus::proto;
    let mut family = MetricFamily::default();
    family.set_name(CHUNK_FETCH_SECONDS.0.into());
    family.set_help(CHUNK_FETCH_SECONDS.1.into());
    family.set_field_type(proto::MetricType::HISTOGRAM);
    let mut series = Vec::new();
    for tier in sealed_mount::Tier::ALL {
        let snapshot = metrics.chunk_fetch_histogram(tier);
        let mut h = proto::Histogram::default();
        h.set_sample_count(snapshot.count);
        h.set_sample_sum(snapshot.sum_seconds);
        let buckets = sealed_mount::metrics::LATENCY_BUCKETS
            .iter()
            .zip(snapshot.cumulative)
            .map(|(&le, count)| {
                let mut b = proto::Bucket::default();
                b.set_upper_bound(le);
                b.set_cumulative_count(count);
                b
            })
            .collect();
        h.set_bucket(buckets);
        let mut label = proto::LabelPair::default();
        label.set_name("tier".into());
        label.set_value(tier.label().into());
        let mut m = proto::Metric::default();
        m.set_label(vec![label]);
        m.set_histogram(h);
        series.push(m);
    }
    family.set_metric(series);
    family
}

impl Collector for MountCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.families().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "collecting mount metrics failed");
            Vec::new()
        })
    }
}

/// What `/healthz` checks.
pub struct Health {
    /// The CSI socket: healthy only while Identity.Probe answers on it.
    pub csi_socket: PathBuf,
    /// The kubelet registration socket, when the plugin registers itself: it must exist.
    pub registration_socket: Option<PathBuf>,
    /// Cleared when the plugin starts shutting down.
    pub serving: AtomicBool,
}

impl Health {
    pub fn new(csi_socket: PathBuf, registration_socket: Option<PathBuf>) -> Self {
        Health {
            csi_socket,
            registration_socket,
            serving: AtomicBool::new(true),
        }
    }

    /// `Ok` with a short text when healthy, else why not.
    async fn check_now(&self) -> Result<String, String> {
        if !self.serving.load(Ordering::Relaxed) {
            return Err("shutting down".into());
        }
        if let Some(path) = &self.registration_socket
            && !path.exists()
        {
            return Err(format!(
                "the kubelet registration socket {} is gone",
                path.display()
            ));
        }
        let probe = tokio::time::timeout(Duration::from_secs(3), probe(&self.csi_socket)).await;
        match probe {
            Ok(Ok(())) => Ok("ok: the CSI gRPC server answers Probe".into()),
            Ok(Err(e)) => Err(format!(
                "the CSI gRPC server on {} does not answer Probe: {e}",
                self.csi_socket.display()
            )),
            Err(_) => Err(format!(
                "the CSI gRPC server on {} did not answer Probe within 3 s",
                self.csi_socket.display()
            )),
        }
    }
}

/// Identity.Probe over the CSI socket, as kubelet's liveness-probe sidecar would.
async fn probe(socket: &std::path::Path) -> Result<(), String> {
    let socket = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = crate::proto::csi::identity_client::IdentityClient::new(channel);
    let response = client
        .probe(crate::proto::csi::ProbeRequest {})
        .await
        .map_err(|e| e.message().to_string())?;
    match response.into_inner().ready {
        Some(false) => Err("Probe says not ready".into()),
        _ => Ok(()),
    }
}

impl sealed_service::http::HealthCheck for Health {
    fn check(&self) -> futures::future::BoxFuture<'_, Result<String, String>> {
        Box::pin(self.check_now())
    }
}

impl sealed_service::http::RenderMetrics for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
}
