//! The operator's settings, from its command line (see `main.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Affinity, LocalObjectReference, Toleration};
use sealed_store::StoreOptions;

use sealed_sources::SourcePolicy;

/// Where syncs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncExecutor {
    /// A Kubernetes Job per sync, in the operator's namespace (the default).
    Job,
    /// A task inside the operator process: small clusters, and tests without a kubelet.
    Inline,
}

#[derive(Clone, Debug)]
pub struct OperatorConfig {
    /// The store every volume is sealed into.
    pub store_url: String,
    pub store_options: StoreOptions,
    /// A Secret in the operator's namespace with the store's credentials (env-style keys),
    /// given to sync Jobs with `envFrom`.
    pub store_secret: Option<String>,
    pub executor: SyncExecutor,
    /// The image sync Jobs run (`sealed-operator sync`).
    pub sync_image: String,
    /// The namespace the operator runs in: sync Jobs and their Secrets live here.
    pub namespace: String,
    /// Reconcile only this namespace's volumes (`None`: every namespace); several namespaces
    /// are separated by commas (see [`watches`](Self::watches)).
    pub watch_namespace: Option<String>,
    /// CPU and memory requests and limits of sync Jobs, e.g. "500m", "1Gi".
    pub sync_resources: SyncResources,
    /// Where sync Jobs' pods run and whom they run as (`--sync-pod`).
    pub sync_pod: SyncPodSettings,
    /// The log filter and format of sync Jobs (the operator's own `SEALED_LOG`,
    /// `--log-json`).
    pub sync_log: SyncLog,
    /// How often the operator looks for versions pushed with `sealed push --volume`.
    pub upload_poll: Duration,
    /// Garbage collection: how often (zero: never), dry run, and how old an unreferenced
    /// chunk must be before it is deleted.
    pub gc_interval: Duration,
    pub gc_dry_run: bool,
    pub gc_grace: Duration,
    /// What sources tenants may sync and with which credentials (`--allow-file-sources`,
    /// `--allow-http-sources`, `--ambient-credentials-source`); its store is `store_url`.
    pub source_policy: SourcePolicy,
    /// The Secret (in [`namespace`](Self::namespace)) holding the key that attests the
    /// versions the operator makes; made on first start.
    pub attestation_secret: String,
    /// Which namespaces' volumes may warm their versions (`spec.warm`, `--warming`): the
    /// warm count is stamped only on versions of those.
    pub warming: sealed_crds::warming::WarmingPolicy,
}

/// The attestation Secret's name when none is given.
pub const DEFAULT_ATTESTATION_SECRET: &str = "sealed-attestation";

/// What a cluster needs of a sync Job's pod besides the defaults: its service account (for
/// workload identity), pull secrets (a private registry), and placement. Read from JSON
/// (`--sync-pod`, the chart's `operator.syncJobPod`); unknown fields are refused, so a typo is
/// an error at start-up, not a Job that silently lacks its setting.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SyncPodSettings {
    #[serde(default)]
    pub service_account_name: Option<String>,
    #[serde(default)]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    #[serde(default)]
    pub affinity: Option<Affinity>,
    #[serde(default)]
    pub priority_class_name: Option<String>,
}

impl SyncPodSettings {
    /// Parses `--sync-pod`'s JSON; an empty value means the defaults.
    pub fn parse(json: &str) -> Result<Self, String> {
        if json.trim().is_empty() {
            return Ok(SyncPodSettings::default());
        }
        serde_json::from_str(json).map_err(|e| {
            format!(
                "{e}; expected a JSON object with serviceAccountName, imagePullSecrets, \
                 nodeSelector, tolerations, affinity, priorityClassName"
            )
        })
    }
}

/// How sync Jobs log: `SEALED_LOG` and `SEALED_LOG_JSON` in their pods.
#[derive(Clone, Debug, PartialEq)]
pub struct SyncLog {
    pub filter: String,
    pub json: bool,
}

impl Default for SyncLog {
    fn default() -> Self {
        SyncLog {
            filter: "info".into(),
            json: false,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct SyncResources {
    pub cpu_request: Option<String>,
    pub memory_request: Option<String>,
    pub cpu_limit: Option<String>,
    pub memory_limit: Option<String>,
}

impl OperatorConfig {
    /// The single namespace to watch, when exactly one is set: its objects are listed and
    /// watched there alone (several namespaces are watched cluster-wide and filtered).
    pub fn single_watch_namespace(&self) -> Option<&str> {
        self.watch_namespace
            .as_deref()
            .filter(|ns| !ns.contains(','))
            .map(str::trim)
    }

    /// Whether objects of `namespace` are this operator's to reconcile.
    pub fn watches(&self, namespace: &str) -> bool {
        match &self.watch_namespace {
            None => true,
            Some(list) => list.split(',').map(str::trim).any(|ns| ns == namespace),
        }
    }

    /// Settings for tests: an inline executor watching one namespace, no GC loop.
    pub fn inline(store_url: &str, namespace: &str) -> Self {
        OperatorConfig {
            store_url: store_url.into(),
            store_options: StoreOptions::default(),
            store_secret: None,
            executor: SyncExecutor::Inline,
            sync_image: String::new(),
            namespace: namespace.into(),
            watch_namespace: Some(namespace.into()),
            sync_resources: SyncResources::default(),
            sync_pod: SyncPodSettings::default(),
            sync_log: SyncLog::default(),
            upload_poll: Duration::from_secs(5),
            gc_interval: Duration::ZERO,
            gc_dry_run: false,
            gc_grace: Duration::from_secs(3600),
            source_policy: SourcePolicy::for_store(store_url, None),
            attestation_secret: DEFAULT_ATTESTATION_SECRET.into(),
            warming: sealed_crds::warming::WarmingPolicy::All,
        }
    }
}
