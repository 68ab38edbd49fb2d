//! Prometheus metrics of the operator, served on `/metrics`.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use sealed_service::build::{BuildInfo, LABELS};

pub struct Metrics {
    pub registry: Registry,
    pub reconciles: IntCounterVec,
    pub reconcile_panics: IntCounterVec,
    pub syncs_started: IntCounter,
    pub syncs_finished: IntCounterVec,
    pub syncs_running: IntGauge,
    pub sync_bytes_new: IntCounter,
    pub sync_bytes_reused: IntCounter,
    pub versions_trashed: IntCounter,
    pub records_rejected: IntCounter,
    pub versions_unattested: IntCounter,
    pub trash_waits: IntCounter,
    pub gc_runs: IntCounterVec,
    pub gc_bytes_freed: IntCounter,
    pub gc_chunks_deleted: IntCounter,
    pub leader: IntGauge,
    /// 1, labelled with what built this binary (version, git commit, compiler).
    pub build_info: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry =
            Registry::new_custom(Some("sealed_operator".into()), None).unwrap_or_default();
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"));
            let _ = registry.register(Box::new(c.clone()));
            c
        };
        let vec = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
            let _ = registry.register(Box::new(c.clone()));
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"));
            let _ = registry.register(Box::new(g.clone()));
            g
        };
        Metrics {
            reconciles: vec(
                "reconciles_total",
                "Reconciles by kind and result",
                &["kind", "result"],
            ),
            reconcile_panics: vec(
                "reconcile_panics_total",
                "Reconciles that panicked (a bug), caught and retried with a backoff, by kind",
                &["kind"],
            ),
            syncs_started: counter("syncs_started_total", "Syncs started"),
            syncs_finished: vec(
                "syncs_finished_total",
                "Syncs finished, by result (Succeeded or the failure reason)",
                &["result"],
            ),
            syncs_running: gauge("syncs_running", "Inline syncs running in this process"),
            sync_bytes_new: counter(
                "sync_bytes_uploaded_total",
                "Bytes of chunks uploaded by finished syncs",
            ),
            sync_bytes_reused: counter(
                "sync_bytes_reused_total",
                "Bytes of chunks finished syncs found already in the store",
            ),
            versions_trashed: counter(
                "versions_trashed_total",
                "Deleted versions moved to the trash",
            ),
            records_rejected: counter(
                "records_rejected_total",
                "Store volume records not imported because their proof did not hold",
            ),
            versions_unattested: counter(
                "versions_unattested_total",
                "SealedVolumeVersions found that the operator did not make (they authorize no mount)",
            ),
            trash_waits: counter(
                "trash_waits_total",
                "Times a deleted version's trashing waited for nodes still publishing it",
            ),
            gc_runs: vec(
                "gc_runs_total",
                "Garbage collection runs by result",
                &["result"],
            ),
            gc_bytes_freed: counter(
                "gc_bytes_freed_total",
                "Bytes of unreferenced chunks deleted by garbage collection",
            ),
            gc_chunks_deleted: counter(
                "gc_chunks_deleted_total",
                "Unreferenced chunks deleted by garbage collection",
            ),
            leader: gauge("leader", "1 while this replica holds the leader lease"),
            build_info: build_info(&registry),
            registry,
        }
        .with_known_series()
    }

    /// Sets the label values every operator reports to 0, so their series exist from the
    /// start: `rate()` and alerts see the first increase, and the dashboard test finds them.
    fn with_known_series(self) -> Self {
        for kind in ["SealedVolume", "SealedVolumeVersion"] {
            for result in ["ok", "error", "panic"] {
                self.reconciles.with_label_values(&[kind, result]);
            }
            self.reconcile_panics.with_label_values(&[kind]);
        }
        self.syncs_finished.with_label_values(&["Succeeded"]);
        for result in ["ok", "skipped", "error"] {
            self.gc_runs.with_label_values(&[result]);
        }
        self
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let encoder = prometheus::TextEncoder::new();
        encoder
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# cannot encode metrics: {e}\n"))
    }
}

/// `sealed_operator_build_info{version,git_commit,rustc} 1`.
fn build_info(registry: &Registry) -> IntGaugeVec {
    let g = IntGaugeVec::new(
        Opts::new(
            "build_info",
            "1, labelled with the version, git commit and compiler that built the operator",
        ),
        &LABELS,
    )
    .unwrap_or_else(|e| panic!("metric build_info: {e}"));
    g.with_label_values(&BuildInfo::of(env!("CARGO_PKG_VERSION")).label_values())
        .set(1);
    let _ = registry.register(Box::new(g.clone()));
    g
}

impl sealed_service::http::RenderMetrics for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn build_info_names_the_version_and_compiler() {
        let text = super::Metrics::new().render();
        let line = text
            .lines()
            .find(|l| l.starts_with("sealed_operator_build_info{"))
            .unwrap_or_else(|| panic!("no build_info in:\n{text}"));
        assert!(line.ends_with(" 1"), "{line}");
        let version = concat!("version=\"", env!("CARGO_PKG_VERSION"), "\"");
        assert!(line.contains(version), "{line}");
        assert!(line.contains("rustc=\"rustc "), "{line}");
        assert!(line.contains("git_commit=\""), "{line}");
        // Known label values exist before anything happened.
        assert!(
            text.contains("sealed_operator_gc_runs_total{result=\"error\"} 0"),
            "{text}"
        );
    }
}
