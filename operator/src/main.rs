//! `sealed-operator`: `run` the controllers, or `sync` one volume (what a sync Job runs).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use kube_lease_manager::LeaseManagerBuilder;
use sealed_crds::Source;
use sealed_operator::config::{
    OperatorConfig, SyncExecutor, SyncLog, SyncPodSettings, SyncResources,
};
use sealed_operator::sync::{SourceCredentials, SyncRequest};
use sealed_operator::webhook::placement::Exclusion;
use sealed_operator::webhook::{AbortOnDrop, WebhookConfig, follow};
use sealed_operator::{controller, metrics::Metrics};
use sealed_service::http::{self, Switch};
use sealed_service::store_args::StoreArgs;
use sealed_sources::SourcePolicy;
use sealed_sources::egress::{ALLOW_NETWORK_FLAG, CLUSTER_NETWORK_FLAG, Egress};
use sealed_store::ChunkStore;

#[derive(Parser)]
#[command(name = "sealed-operator", version, about = "Sealed Volumes operator")]
struct Cli {
    /// Log as JSON lines (for log collectors) instead of text
    #[arg(long, global = true, env = "SEALED_LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controllers (SealedVolume, SealedVolumeVersion, garbage collection)
    Run(Box<RunArgs>),
    /// Sync one volume's source into the store and report the digest (run by sync Jobs)
    Sync(Box<SyncArgs>),
}

/// Opens the store the flags name, with the URL in the error.
async fn open_store(args: &StoreArgs) -> anyhow::Result<ChunkStore> {
    ChunkStore::open(&args.store, &args.options())
        .await
        .with_context(|| format!("cannot open store {}", args.store))
}

/// What tenants' sources may be (see `sealed_sources::policy` and docs/sources.md).
/// `run` takes them from its flags or environment; a sync Job gets them as flags.
#[derive(Args)]
struct PolicyArgs {
    /// Allow file:// sources (they read the sync process's own files: tests and single-tenant
    /// setups only)
    #[arg(long = "allow-file-sources", env = "SEALED_ALLOW_FILE_SOURCES")]
    allow_file_sources: bool,
    /// Allow plain-http Hugging Face endpoints and object-store URLs and endpoints
    #[arg(long = "allow-http-sources", env = "SEALED_ALLOW_HTTP_SOURCES")]
    allow_http_sources: bool,
    /// A URL prefix (s3://public-models/, https://minio.internal/shared/) whose sources may be
    /// read with this process's own credentials (workload identity) when they name no Secret;
    /// repeatable, or comma-separated in the environment
    #[arg(
        long = "ambient-credentials-source",
        value_name = "PREFIX",
        env = "SEALED_AMBIENT_CREDENTIALS_SOURCES",
        value_delimiter = ','
    )]
    ambient_credentials_sources: Vec<String>,
    /// An address range (CIDR) sources may reach although it is loopback, link-local,
    /// private or a cluster range (an in-cluster MinIO, a Hub mirror); repeatable, or
    /// comma-separated in the environment
    #[arg(
        long = "allow-source-network",
        value_name = "CIDR",
        env = "SEALED_ALLOW_SOURCE_NETWORKS",
        value_delimiter = ','
    )]
    allow_source_networks: Vec<String>,
    /// The cluster's service and pod ranges (CIDR), refused to sources like the private
    /// ranges are; repeatable, or comma-separated in the environment
    #[arg(
        long = "cluster-network",
        value_name = "CIDR",
        env = "SEALED_CLUSTER_NETWORKS",
        value_delimiter = ','
    )]
    cluster_networks: Vec<String>,
}

impl PolicyArgs {
    fn policy(&self, store: &StoreArgs) -> anyhow::Result<SourcePolicy> {
        let policy = SourcePolicy {
            store_url: Some(store.store.clone()),
            store_endpoint: store.store_endpoint.clone().filter(|s| !s.is_empty()),
            allow_file: self.allow_file_sources,
            allow_http: self.allow_http_sources,
            ambient_allowed: self
                .ambient_credentials_sources
                .iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
            egress: Egress {
                allowed: Egress::parse_networks(&self.allow_source_networks, ALLOW_NETWORK_FLAG)
                    .map_err(anyhow::Error::msg)?,
                cluster: Egress::parse_networks(&self.cluster_networks, CLUSTER_NETWORK_FLAG)
                    .map_err(anyhow::Error::msg)?,
            },
        };
        policy.validate().map_err(anyhow::Error::msg)?;
        Ok(policy)
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    policy: PolicyArgs,
    /// Secret (in the operator's namespace) with the store's credentials, given to sync Jobs
    #[arg(long, env = "SEALED_STORE_SECRET")]
    store_secret: Option<String>,
    /// Where syncs run
    #[arg(long, value_enum, default_value_t = SyncExecutor::Job, env = "SEALED_SYNC_EXECUTOR")]
    sync_executor: SyncExecutor,
    /// Image of sync Jobs (the operator's own image)
    #[arg(long, env = "SEALED_SYNC_IMAGE", default_value = "")]
    sync_image: String,
    #[arg(long, env = "SEALED_SYNC_CPU_REQUEST")]
    sync_cpu_request: Option<String>,
    #[arg(long, env = "SEALED_SYNC_MEMORY_REQUEST")]
    sync_memory_request: Option<String>,
    #[arg(long, env = "SEALED_SYNC_CPU_LIMIT")]
    sync_cpu_limit: Option<String>,
    #[arg(long, env = "SEALED_SYNC_MEMORY_LIMIT")]
    sync_memory_limit: Option<String>,
    /// Sync Jobs' pods: JSON with serviceAccountName, imagePullSecrets, nodeSelector,
    /// tolerations, affinity, priorityClassName (e.g. '{"serviceAccountName":"sync"}')
    #[arg(long, env = "SEALED_SYNC_POD", default_value = "", value_parser = SyncPodSettings::parse)]
    sync_pod: SyncPodSettings,
    /// The operator's namespace: sync Jobs and the leader Lease live here
    #[arg(long, env = "POD_NAMESPACE", default_value = "sealed-volumes")]
    namespace: String,
    /// Reconcile only this namespace's volumes (default: every namespace)
    #[arg(long, env = "SEALED_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// Run only while holding the leader Lease (for more than one replica)
    #[arg(long, env = "SEALED_LEADER_ELECT")]
    leader_elect: bool,
    /// Name of the leader Lease
    #[arg(long, default_value = "sealed-operator")]
    lease_name: String,
    /// Address of /metrics and /healthz
    #[arg(long, default_value = "0.0.0.0:8080", env = "SEALED_METRICS_ADDR")]
    metrics_addr: SocketAddr,
    /// How often garbage collection runs (a duration such as 1h; 0 turns it off)
    #[arg(long, default_value = "1h", value_parser = parse_duration, env = "SEALED_GC_INTERVAL")]
    gc_interval: Duration,
    /// Report what garbage collection would delete, delete nothing
    #[arg(long, env = "SEALED_GC_DRY_RUN")]
    gc_dry_run: bool,
    /// Unreferenced chunks younger than this are kept
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    gc_grace: Duration,
    /// How often to look for versions pushed with `sealed push --volume`
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    upload_poll: Duration,
    /// Secret (in the operator's namespace) with the key that attests the versions the
    /// operator makes; created on first start. The node plugins read it.
    #[arg(long, env = "SEALED_ATTESTATION_SECRET", default_value = sealed_operator::config::DEFAULT_ATTESTATION_SECRET)]
    attestation_secret: String,
    /// Secret (in the operator's namespace) with the node plugins' peer token (key `token`),
    /// made on first start and kept; empty: not the operator's to make
    #[arg(long, env = "SEALED_PEER_TOKEN_SECRET", default_value = "")]
    peer_token_secret: String,
    /// Secret (in the operator's namespace) with the plugins' fleet certificate for mutual
    /// TLS (tls.crt, tls.key, ca.crt), its CA kept in `<name>-ca`; made on first start,
    /// renewed; empty: not the operator's to make
    #[arg(long, env = "SEALED_PEER_TLS_SECRET", default_value = "")]
    peer_tls_secret: String,
    /// The fleet name in that certificate (the plugins' --peer-tls-name)
    #[arg(long, env = "SEALED_PEER_TLS_NAME", default_value = "sealed-peer")]
    peer_tls_name: String,
    /// Days the fleet certificate is valid (renewed with a third left)
    #[arg(long, env = "SEALED_PEER_TLS_DAYS", default_value_t = 365,
          value_parser = clap::value_parser!(u32).range(3..=3650))]
    peer_tls_days: u32,
    /// Which namespaces' volumes may warm their versions (spec.warm): off, all, or labelled
    /// (those with --warming-namespace-label)
    #[arg(long, env = "SEALED_WARMING", default_value = "off")]
    warming: String,
    /// The label (KEY=VALUE) of namespaces allowed to warm, with --warming labelled
    #[arg(long, env = "SEALED_WARMING_NAMESPACE_LABEL", default_value = sealed_crds::warming::DEFAULT_NAMESPACE_LABEL)]
    warming_namespace_label: String,
    #[command(flatten)]
    webhook: WebhookArgs,
}

/// The pod admission webhook (`sealed_operator::webhook`; docs/csi.md, "Tags and rollouts").
#[derive(Args)]
struct WebhookArgs {
    /// Serve the pod admission webhook (HTTPS) on this address; unset: no webhook
    #[arg(long, env = "SEALED_WEBHOOK_ADDR")]
    webhook_addr: Option<SocketAddr>,
    /// Secret (in the operator's namespace) with the webhook's serving certificate, its CA
    /// kept in `<name>-ca`; made on first start, renewed when expiring
    #[arg(
        long,
        env = "SEALED_WEBHOOK_SECRET",
        default_value = "sealed-webhook-tls"
    )]
    webhook_secret: String,
    /// The MutatingWebhookConfiguration whose caBundle the operator keeps
    #[arg(
        long,
        env = "SEALED_WEBHOOK_CONFIGURATION",
        default_value = "sealed-volumes-pods"
    )]
    webhook_configuration: String,
    /// A name (DNS, or an IP address) the serving certificate is for: the webhook Service's
    /// names; repeatable, or comma-separated in the environment
    #[arg(long, env = "SEALED_WEBHOOK_CERT_NAMES", value_delimiter = ',')]
    webhook_cert_name: Vec<String>,
    /// nvidia.com/gpu.product values the node plugin does not run on (the plugin's own
    /// --excluded-gpu-products): pods with sealed volumes get a node affinity that avoids them
    #[arg(
        long,
        env = "SEALED_EXCLUDED_GPU_PRODUCTS",
        default_value = "Tesla-T4,NVIDIA-T4,T4,NVIDIA-L4,L4"
    )]
    excluded_gpu_products: String,
}

#[derive(Args)]
struct SyncArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The operator's source policy, checked again here
    #[command(flatten)]
    policy: PolicyArgs,
    /// The volume, NAMESPACE/NAME
    #[arg(long)]
    volume: String,
    /// spec.source of the SealedVolume, as JSON
    #[arg(long)]
    source: String,
    /// What started the sync (recorded in logs)
    #[arg(long, default_value = "")]
    trigger: String,
    /// Where the outcome is written for the operator to read
    #[arg(long, default_value = "/dev/termination-log")]
    termination_log: std::path::PathBuf,
}

/// A duration flag: 0 to 876000h; clap's message names the flag and the value, this one
/// what is wrong and the range.
fn parse_duration(s: &str) -> Result<Duration, String> {
    sealed_crds::validate::parse_duration_checked(s).map_err(|e| {
        format!(
            "{e}; allowed: 0 to {} (100 years)",
            sealed_crds::validate::MAX_DURATION_TEXT
        )
    })
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    sealed_service::logging::init("info", cli.log_json);
    let result = match cli.command {
        Command::Run(args) => run(*args, cli.log_json).await.map(|()| 0),
        Command::Sync(args) => sync(*args).await,
    };
    match result {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            eprintln!("sealed-operator: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

async fn run(args: RunArgs, log_json: bool) -> anyhow::Result<()> {
    if args.sync_executor == SyncExecutor::Job && args.sync_image.is_empty() {
        anyhow::bail!(
            "--sync-image is required with --sync-executor job (the operator's own image)"
        );
    }
    let source_policy = args.policy.policy(&args.store)?;
    let store = open_store(&args.store).await?;
    let config = OperatorConfig {
        store_url: args.store.store.clone(),
        store_options: args.store.options(),
        store_secret: args.store_secret.filter(|s| !s.is_empty()),
        executor: args.sync_executor,
        sync_image: args.sync_image,
        namespace: args.namespace,
        watch_namespace: args.watch_namespace.filter(|s| !s.is_empty()),
        sync_resources: SyncResources {
            cpu_request: args.sync_cpu_request,
            memory_request: args.sync_memory_request,
            cpu_limit: args.sync_cpu_limit,
            memory_limit: args.sync_memory_limit,
        },
        sync_pod: args.sync_pod,
        sync_log: SyncLog {
            filter: std::env::var(sealed_service::logging::LOG_ENV)
                .ok()
                .filter(|f| !f.is_empty())
                .unwrap_or_else(|| "info".into()),
            json: log_json,
        },
        upload_poll: args.upload_poll.max(Duration::from_secs(1)),
        gc_interval: args.gc_interval,
        gc_dry_run: args.gc_dry_run,
        gc_grace: args.gc_grace,
        source_policy,
        attestation_secret: args.attestation_secret,
        warming: sealed_crds::warming::WarmingPolicy::parse(
            &args.warming,
            &args.warming_namespace_label,
        )
        .map_err(anyhow::Error::msg)?,
    };
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API server (in-cluster config or KUBECONFIG)")?;
    let fleet = sealed_operator::fleet_pki::FleetSecrets {
        token: Some(args.peer_token_secret).filter(|s| !s.is_empty()),
        tls: Some(args.peer_tls_secret).filter(|s| !s.is_empty()),
        tls_name: args.peer_tls_name,
        tls_days: args.peer_tls_days,
    };
    if fleet.token.is_some() || fleet.tls.is_some() {
        // Every replica keeps them, leader or not: the plugins wait on them at install.
        tokio::spawn(sealed_operator::fleet_pki::keep_fleet(
            client.clone(),
            config.namespace.clone(),
            fleet,
        ));
    }
    let follow_tags = args.webhook.webhook_addr.is_some();
    // Tag-following rollouts stay in the namespaces the operator watches.
    let follow_namespaces: Option<Vec<String>> = config.watch_namespace.as_ref().map(|list| {
        list.split(',')
            .map(|ns| ns.trim().to_owned())
            .filter(|ns| !ns.is_empty())
            .collect()
    });
    // Every replica serves the webhook, leader or not: the Service picks any.
    let _webhook = match args.webhook.webhook_addr {
        Some(addr) => {
            let names: Vec<String> = args
                .webhook
                .webhook_cert_name
                .iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect();
            anyhow::ensure!(
                !names.is_empty(),
                "--webhook-cert-name is required with --webhook-addr (the webhook Service's DNS names)"
            );
            let config = WebhookConfig {
                addr,
                namespace: config.namespace.clone(),
                secret: args.webhook.webhook_secret.clone(),
                configuration: args.webhook.webhook_configuration.clone(),
                names,
                exclusion: Exclusion::parse(&args.webhook.excluded_gpu_products),
            };
            Some(sealed_operator::webhook::start(client.clone(), config).await?)
        }
        None => None,
    };
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Switch::new("controllers not running"));
    let listener = http::bind(args.metrics_addr).await?;
    tokio::spawn(http::serve(
        listener,
        metrics.clone(),
        health.clone(),
        std::future::pending(),
    ));

    if args.leader_elect {
        let identity = std::env::var("POD_NAME")
            .unwrap_or_else(|_| format!("sealed-operator-{}", std::process::id()));
        let manager = LeaseManagerBuilder::new(client.clone(), &args.lease_name)
            .with_namespace(&config.namespace)
            .with_identity(&identity)
            .with_duration(15)
            .with_grace(5)
            .build()
            .await
            .context("cannot set up leader election")?;
        let (mut leader, _task) = manager.watch().await;
        health.set(true);
        tracing::info!(lease = %args.lease_name, %identity, "waiting to become leader");
        while !*leader.borrow_and_update() {
            leader.changed().await.context("leader election stopped")?;
        }
        metrics.leader.set(1);
        tracing::info!("became leader");
        // Tag-following rollouts write workloads: the leader's job, with the webhook.
        let _follow = follow_tags.then(|| {
            AbortOnDrop(tokio::spawn(follow::run_in(
                client.clone(),
                follow_namespaces.clone(),
            )))
        });
        tokio::select! {
            r = controller::run(client, config, store, metrics.clone()) => r?,
            _ = async {
                loop {
                    if leader.changed().await.is_err() || !*leader.borrow_and_update() {
                        break;
                    }
                }
            } => {
                metrics.leader.set(0);
                // Another replica leads now; stopping is safer than racing it.
                anyhow::bail!("lost the leader lease; exiting so that one replica runs the controllers");
            }
        }
    } else {
        health.set(true);
        metrics.leader.set(1);
        let _follow = follow_tags.then(|| {
            AbortOnDrop(tokio::spawn(follow::run_in(
                client.clone(),
                follow_namespaces.clone(),
            )))
        });
        controller::run(client, config, store, metrics).await?;
    }
    health.set(false);
    Ok(())
}

/// One sync, as a Job runs it (`sealed_operator::sync::runner`).
async fn sync(args: SyncArgs) -> anyhow::Result<u8> {
    let (namespace, name) = args
        .volume
        .split_once('/')
        .with_context(|| format!("--volume {:?} must be NAMESPACE/NAME", args.volume))?;
    let source: Source =
        serde_json::from_str(&args.source).context("--source is not a spec.source JSON object")?;
    let request = SyncRequest {
        namespace: namespace.into(),
        name: name.into(),
        source,
        trigger: args.trigger.clone(),
        policy: args.policy.policy(&args.store)?,
    };
    let credentials = SourceCredentials::from_env(std::env::vars());
    let store = open_store(&args.store).await;
    sealed_operator::sync::runner::run_in_job(
        store,
        &args.store.store,
        &request,
        &credentials,
        &args.termination_log,
    )
    .await
}
