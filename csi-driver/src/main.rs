//! `sealed-csi`: the CSI node plugin binary. Wiring only; the work is in the library.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use std::sync::Arc;

use sealed_csi::attest::SecretRef;
use sealed_csi::gpu::GpuExclusion;
use sealed_csi::kube_access::AttestationConfig;
use sealed_csi::lease::{PublicationsLease, Reporter};
use sealed_csi::metrics::Health;
use sealed_csi::{Driver, DriverConfig, KubeAccess};
use sealed_mount::{
    FetchPolicy, MountLimits, MountOptions, NodeCache, NodeCacheOptions, parse_size,
};
use sealed_store::StoreOptions;

#[derive(Parser, Debug)]
#[command(
    name = "sealed-csi",
    version,
    about = "CSI node plugin for Sealed Volumes"
)]
struct Args {
    /// CSI endpoint kubelet talks to
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Name of this node (NodeGetInfo.node_id); in Kubernetes, the Node's name
    #[arg(long, env = "NODE_NAME")]
    node_id: String,
    /// Store URL: file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix
    #[arg(long, env = "SEALED_STORE")]
    store: String,
    /// Endpoint of an S3-compatible server (MinIO, R2, CoreWeave) or an Azure emulator
    #[arg(long, env = "SEALED_ENDPOINT")]
    store_endpoint: Option<String>,
    /// Region of the bucket
    #[arg(long, env = "SEALED_REGION")]
    store_region: Option<String>,
    /// Seconds before a store request is retried (1 to 86400)
    #[arg(long, env = "SEALED_TIMEOUT", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    store_timeout: u64,
    /// Retries of a failed store request (0 to 100)
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=100))]
    store_retries: u32,
    /// Seconds during which, after a chunk fetch from the store failed (timeouts or errors on
    /// every attempt), further fetches of uncached chunks fail at once instead of waiting on
    /// the store again (a circuit breaker; 0 turns it off)
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(0..=3600))]
    breaker_open: u64,
    /// Per mount: most entries (files, directories, links) a version may have
    #[arg(long, default_value_t = MountLimits::default().max_entries)]
    max_mount_entries: u64,
    /// Per mount: most chunk references a version may have
    #[arg(long, default_value_t = MountLimits::default().max_chunks)]
    max_mount_chunks: u64,
    /// Per mount: most memory the mounted tree may need (bytes; K, M, G, T suffixes)
    #[arg(long, default_value_t = MountLimits::default().max_manifest_bytes,
          value_parser = parse_size)]
    max_mount_memory: u64,
    /// Per mount: most chunk fetches one read may have in flight (1 to 4096)
    #[arg(long, default_value_t = MountLimits::default().max_fetches_per_read,
          value_parser = fetch_bound)]
    max_fetches_per_read: usize,
    /// Per mount: most chunk fetches its reads and readahead may have in flight together
    /// (1 to 4096)
    #[arg(long, default_value_t = MountLimits::default().max_fetches_per_mount,
          value_parser = fetch_bound)]
    max_fetches_per_mount: usize,
    /// Node disk cache directory, shared by every mount on the node
    #[arg(
        long,
        env = "SEALED_CACHE_DIR",
        default_value = "/var/cache/sealed-volumes"
    )]
    cache_dir: PathBuf,
    /// Bound on the disk cache (bytes; K, M, G, T suffixes are powers of 1024)
    #[arg(long, env = "SEALED_CACHE_SIZE", default_value = "10G", value_parser = parse_size)]
    cache_size: u64,
    /// Bound on chunks held in memory, for the node
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    memory: u64,
    /// Where the plugin keeps its FUSE mounts (<state-dir>/mounts/<hex>)
    #[arg(
        long,
        env = "SEALED_STATE_DIR",
        default_value = "/var/lib/sealed-volumes"
    )]
    state_dir: PathBuf,
    /// Most volumes published on this node (0: no limit)
    #[arg(long, default_value_t = 0)]
    max_volumes: i64,
    /// Run without an API server: NO authorization and NO node-label checks (conformance
    /// runs and local testing only)
    #[arg(long)]
    standalone: bool,
    /// Comma-separated `nvidia.com/gpu.product` values this plugin refuses to publish on
    /// (exact, case-insensitive, a `-SHARED` suffix ignored; empty: none)
    #[arg(long, env = "SEALED_EXCLUDED_GPU_PRODUCTS", default_value = sealed_csi::gpu::DEFAULT_EXCLUDED)]
    excluded_gpu_products: String,
    /// kubelet's root directory: when set, the plugin registers itself with kubelet through
    /// <kubelet-dir>/plugins_registry (no node-driver-registrar needed)
    #[arg(long, env = "KUBELET_DIR")]
    kubelet_dir: Option<PathBuf>,
    /// kubelet's root directory for target paths: publishes and unpublishes are only done
    /// under <kubelet-root>/pods (default: --kubelet-dir, else /var/lib/kubelet)
    #[arg(long, env = "KUBELET_ROOT")]
    kubelet_root: Option<PathBuf>,
    /// NAMESPACE/NAME of the operator's attestation Secret: only versions the operator made
    /// (status.attestation verifies with its key) authorize a mount
    #[arg(long, env = "SEALED_ATTESTATION_SECRET")]
    attestation_secret: Option<SecretRef>,
    /// Authorize by any SealedVolumeVersion owned by its volume, without checking that the
    /// operator made it. SINGLE-TENANT LABS ONLY: whoever can create a SealedVolumeVersion
    /// can then mount any digest
    #[arg(long, conflicts_with = "attestation_secret")]
    insecure_skip_attestation: bool,
    /// Namespace of this node's publications Lease (which digests its pods use, read by the
    /// operator before trashing a version); off when unset
    #[arg(long, env = "POD_NAMESPACE")]
    publications_namespace: Option<String>,
    /// The CSI socket path as kubelet sees it (default: the --endpoint path), when the
    /// plugin's container mounts it elsewhere
    #[arg(long)]
    kubelet_registration_path: Option<PathBuf>,
    /// Socket of the FUSE fd holder (`sealed-fd-holder`): with it, restarting or upgrading
    /// the plugin keeps running pods' mounts working; without it, they break
    #[arg(long, env = "SEALED_FD_HOLDER")]
    fd_holder: Option<PathBuf>,
    /// Seconds a restarted plugin keeps trying the store for the manifest of a held mount
    /// it has no copy of (readers of that mount wait meanwhile); then the mount's connection
    /// is aborted, so its readers get an error
    #[arg(long, default_value_t = sealed_csi::state::DEFAULT_RESUME_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    resume_deadline: u64,
    /// Serve Prometheus /metrics and /healthz over HTTP on this address (e.g. 0.0.0.0:9809);
    /// off when unset
    #[arg(long, env = "SEALED_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Log more (-v info, -vv debug); SEALED_LOG overrides
    #[arg(long, short = 'v', action = clap::ArgAction::Count)]
    verbose: u8,
}

/// The API-server client; reads this node's labels once so bad credentials, missing RBAC or
/// a wrong --node-id fail the start instead of every publish.
async fn connect_kube(args: &Args) -> anyhow::Result<KubeAccess> {
    let excluded = GpuExclusion::parse(&args.excluded_gpu_products);
    let attestation = match (&args.attestation_secret, args.insecure_skip_attestation) {
        (Some(secret), _) => AttestationConfig::Secret(secret.clone()),
        (None, true) => {
            tracing::warn!(
                "INSECURE: --insecure-skip-attestation: a SealedVolumeVersion authorizes its digest \
                 without proof that the operator made it, so anyone who can create one can mount \
                 any digest. For single-tenant labs only."
            );
            AttestationConfig::InsecureSkip
        }
        (None, false) => anyhow::bail!(
            "API-server mode needs --attestation-secret NAMESPACE/NAME (env \
             SEALED_ATTESTATION_SECRET): the operator's attestation Secret, whose key proves a \
             SealedVolumeVersion was made by the operator. (--insecure-skip-attestation skips \
             that proof, for single-tenant labs only; --standalone runs without an API server.)"
        ),
    };
    let kube = KubeAccess::connect(args.node_id.clone(), excluded, attestation).await?;
    match kube.check_node().await {
        Ok(()) => tracing::info!(node = %args.node_id, "API server reachable; node not excluded"),
        Err(e @ sealed_csi::CsiError::FailedPrecondition(_)) => {
            tracing::warn!("every publish on this node will be refused: {e}")
        }
        Err(e) => return Err(e).context("API-server mode (use --standalone to run without it)"),
    }
    match kube.load_key().await {
        Ok(true) => tracing::info!(secret = ?args.attestation_secret, "attestation key read"),
        Ok(false) => {}
        // The operator may not have made it yet: publishes are refused until it has.
        Err(e) => tracing::warn!("publishes will be refused until the key can be read: {e}"),
    }
    Ok(kube)
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SEALED_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: container logs and files stay plain, greppable text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logging(args.verbose);
    let kube = if args.standalone {
        if args.attestation_secret.is_some()
            || args.insecure_skip_attestation
            || args.publications_namespace.is_some()
        {
            tracing::warn!(
                "--standalone: --attestation-secret, --insecure-skip-attestation and \
                 --publications-namespace need the API server; ignored"
            );
        }
        tracing::warn!(
            "STANDALONE MODE: no API server; every digest is mounted for any caller, with NO \
             authorization and NO node-label (GPU exclusion) checks. For conformance runs and \
             local testing only."
        );
        None
    } else {
        Some(Arc::new(connect_kube(&args).await?))
    };
    let socket = sealed_csi::socket_path(&args.endpoint)?;
    let timeout = Duration::from_secs(args.store_timeout);
    let config = DriverConfig {
        node_id: args.node_id.clone(),
        state_dir: args.state_dir.clone(),
        store_url: args.store.clone(),
        store_options: StoreOptions {
            endpoint: args.store_endpoint.clone(),
            region: args.store_region.clone(),
            timeout,
            retries: args.store_retries as usize,
            create: false,
        },
        max_volumes: args.max_volumes,
        standalone: args.standalone,
        fd_holder: args.fd_holder.clone(),
        kubelet_root: args
            .kubelet_root
            .clone()
            .or_else(|| args.kubelet_dir.clone())
            .unwrap_or_else(|| PathBuf::from(sealed_csi::targets::DEFAULT_KUBELET_ROOT)),
        resume_deadline: Duration::from_secs(args.resume_deadline),
    };
    tracing::info!(kubelet_root = %config.kubelet_root.display(),
        "targets must be under <kubelet-root>/pods");
    // The node cache holds the bytes of every version mounted here: root only.
    sealed_csi::state::private_dir(&args.cache_dir)?;
    let cache = NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(args.cache_dir.clone()),
        disk_bytes: args.cache_size,
        memory_bytes: args.memory,
        fetch: FetchPolicy {
            attempt_timeout: timeout,
            retries: args.store_retries,
            breaker_open: Duration::from_secs(args.breaker_open),
            ..FetchPolicy::default()
        },
        ..NodeCacheOptions::default()
    })
    .with_context(|| format!("cannot open the node cache {}", args.cache_dir.display()))?;
    let mount_options = MountOptions {
        limits: MountLimits {
            max_entries: args.max_mount_entries,
            max_chunks: args.max_mount_chunks,
            max_manifest_bytes: args.max_mount_memory,
            max_fetches_per_read: args.max_fetches_per_read,
            max_fetches_per_mount: args.max_fetches_per_mount,
        },
        ..MountOptions::default()
    };
    let driver =
        Driver::new(config, cache, mount_options).context("cannot set up the metrics registry")?;
    if args.fd_holder.is_none() {
        tracing::warn!(
            "no --fd-holder: restarting this plugin will break the mounts of running pods"
        );
    }
    // The socket first, and no store I/O before serving: a restart while the store is down
    // must not keep kubelet and the liveness probe waiting (held mounts resume in the
    // background, each under its own version's lock).
    let listener = sealed_csi::bind(&socket)?;
    driver.recover().await?;
    let reporter = match (&kube, args.publications_namespace.as_deref()) {
        (Some(kube), Some(ns)) if !ns.is_empty() => {
            anyhow::ensure!(
                sealed_csi::node::is_dns_label(ns),
                "--publications-namespace {ns:?} is not a namespace name"
            );
            let lease =
                PublicationsLease::new(kube.client().clone(), ns.into(), args.node_id.clone());
            tracing::info!(lease = %lease.name(), namespace = ns, "node publications Lease");
            let reporter = Reporter::new(lease, driver.clone());
            reporter.spawn_renewals();
            Some(reporter)
        }
        (Some(_), _) => {
            tracing::warn!(
                "no --publications-namespace (POD_NAMESPACE): no node publications Lease, so the \
                 operator cannot tell which versions this node's pods use"
            );
            None
        }
        (None, _) => None,
    };
    if args.fd_holder.is_some() {
        // The holder may restart on its own (deleted by hand): give it the fds again.
        let driver = driver.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tick.tick().await;
                driver.refresh_holder().await;
            }
        });
    }
    // Open the store in the background to report a bad URL or credential early (a bad URL
    // stops the plugin); a store that is down is retried on the first publish rather than
    // failing the plugin.
    let store_check = {
        let driver = driver.clone();
        let store = args.store.clone();
        tokio::spawn(async move {
            match driver.store().await {
                Ok(_) => {
                    tracing::info!(%store, "store reachable");
                    Ok(())
                }
                Err(
                    e @ sealed_csi::CsiError::Store(sealed_store::Error::InvalidStoreUrl { .. }),
                ) => Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "store not reachable yet; retrying on publish");
                    Ok(())
                }
            }
        })
    };
    tokio::pin!(store_check);
    tracing::info!(
        endpoint = %args.endpoint,
        node_id = %args.node_id,
        state_dir = %args.state_dir.display(),
        "serving {} {}",
        sealed_csi::DRIVER_NAME,
        env!("CARGO_PKG_VERSION")
    );
    let registration = start_registration(&args, &socket)?;
    let health = Arc::new(Health::new(
        socket.clone(),
        registration.as_ref().map(|(_, _, path)| path.clone()),
    ));
    let (http_stop, http_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(addr) = args.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?;
        tracing::info!(%addr, "serving /metrics and /healthz");
        tokio::spawn(sealed_csi::metrics::serve_http(
            listener,
            driver.metrics().clone(),
            health.clone(),
            async {
                let _ = http_stopped.await;
            },
        ));
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = sealed_csi::serve(driver.clone(), kube, reporter, listener, async {
        let _ = stopped.await;
    });
    tokio::pin!(server);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot handle SIGTERM")?;
    tokio::select! {
        result = &mut server => result?,
        Ok(Err(e)) = &mut store_check => return Err(e.into()),
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    // Stop taking requests; give the ones in flight a moment, but do not wait for clients
    // that keep their connection open (kubelet does).
    tracing::info!("shutting down");
    health
        .serving
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = stop.send(());
    if tokio::time::timeout(Duration::from_secs(5), &mut server)
        .await
        .is_err()
    {
        tracing::info!("connections still open after 5 s; exiting");
    }
    if let Some((stop, task, path)) = registration {
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
        // kubelet deregisters the plugin when the socket goes.
        let _ = std::fs::remove_file(&path);
    }
    let _ = http_stop.send(());
    let _ = std::fs::remove_file(&socket);
    let kept = driver.keep_mounts_for_restart().await;
    if kept > 0 {
        tracing::info!(
            mounts = kept,
            "leaving the FUSE mounts to the fd holder for the next plugin"
        );
        // Exit without unwinding: dropping the runtime would drop the reads still in flight,
        // and fuser answers a dropped reply with EIO. Unanswered, the kernel keeps them for
        // the next plugin, which has them sent again.
        std::process::exit(0);
    }
    Ok(())
}

type Registration = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    PathBuf,
);

/// Serves kubelet plugin registration in the background when --kubelet-dir is set.
fn start_registration(args: &Args, socket: &Path) -> anyhow::Result<Option<Registration>> {
    let Some(kubelet_dir) = &args.kubelet_dir else {
        tracing::info!(
            "no --kubelet-dir: not registering with kubelet (node-driver-registrar must)"
        );
        return Ok(None);
    };
    let path = sealed_csi::registration::registration_socket(kubelet_dir);
    let listener = sealed_csi::bind(&path)?;
    let endpoint = args
        .kubelet_registration_path
        .as_deref()
        .unwrap_or(socket)
        .display()
        .to_string();
    tracing::info!(socket = %path.display(), %endpoint, "serving kubelet plugin registration");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(e) = sealed_csi::serve_registration(listener, endpoint, shutdown).await {
            tracing::error!(error = %format!("{e:#}"), "kubelet registration stopped");
        }
    });
    Ok(Some((stop, task, path)))
}

/// A bound on fetches in flight: at least one (zero would stop every read), at most 4096.
fn fetch_bound(text: &str) -> Result<usize, String> {
    let n: usize = text
        .parse()
        .map_err(|e| format!("{text:?} is not a count: {e}"))?;
    if (1..=4096).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} is out of range: 1 to 4096"))
    }
}
