//! The operator's settings, from its command line (see `main.rs`).

use std::time::Duration;

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
}

/// The attestation Secret's name when none is given.
pub const DEFAULT_ATTESTATION_SECRET: &str = "sealed-attestation";

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
            upload_poll: Duration::from_secs(5),
            gc_interval: Duration::ZERO,
            gc_dry_run: false,
            gc_grace: Duration::from_secs(3600),
            source_policy: SourcePolicy::for_store(store_url, None),
            attestation_secret: DEFAULT_ATTESTATION_SECRET.into(),
        }
    }
}
