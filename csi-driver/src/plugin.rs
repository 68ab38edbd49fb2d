//! The node plugin's lifecycle, for `sealed-csi`'s `main`: the start order, the background
//! tasks, and a shutdown that leaves held mounts to the next run.
//!
//! Start: the API server is checked first (bad credentials, RBAC or node name fail the
//! start, not every publish), then the CSI socket is bound before any store I/O (a restart
//! while the store is down must not keep kubelet and the liveness probe waiting), the last
//! run's state is taken over (`Driver::recover`; held mounts resume in the background), and
//! the store is opened in the background to report a bad URL early.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sealed_mount::{MountOptions, NodeCache, NodeCacheOptions};

use crate::attest::SecretRef;
use crate::driver::{Driver, DriverConfig};
use crate::error::CsiError;
use crate::gpu::GpuExclusion;
use crate::identity::DRIVER_NAME;
use crate::kube_access::{AttestationConfig, KubeAccess};
use crate::lease::{PublicationsLease, Reporter};
use crate::metrics::Health;
use crate::warm::{WarmConfig, WarmSettings};
use crate::{registration, server, state_dir};

/// Everything the plugin is started with (`sealed-csi`'s flags).
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// The CSI endpoint kubelet talks to (`unix:///path`).
    pub endpoint: String,
    pub driver: DriverConfig,
    /// The node cache; its `disk_dir` is made private (0700).
    pub cache: NodeCacheOptions,
    /// The disk cache's free-space floor, percent of its filesystem (0: off).
    pub cache_min_free_percent: u8,
    pub mount: MountOptions,
    /// API-server mode; `None` is `--standalone` (no authorization, no node checks).
    pub api: Option<ApiConfig>,
    /// kubelet's root directory: when set, the plugin registers itself with kubelet.
    pub kubelet_dir: Option<PathBuf>,
    /// The CSI socket as kubelet sees it, when the plugin's container mounts it elsewhere.
    pub kubelet_registration_path: Option<PathBuf>,
    /// Where `/metrics` and `/healthz` are served; off when `None`.
    pub metrics_addr: Option<SocketAddr>,
    /// The metrics port's connection bounds.
    pub metrics_limits: sealed_service::listen::ConnLimits,
    /// The peer tier (docs/peer.md); off when `None`.
    pub peer: Option<crate::peer::PeerConfig>,
    /// What warming (`spec.warm`) may do on this node.
    pub warm: WarmSettings,
}

/// How the plugin uses the API server.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// Comma-separated `nvidia.com/gpu.product` values not to publish on (`gpu`).
    pub excluded_gpu_products: String,
    /// The operator's attestation Secret.
    pub attestation_secret: Option<SecretRef>,
    /// Authorize without checking that the operator made a version (labs only).
    pub insecure_skip_attestation: bool,
    /// Namespace of the node publications Lease; off when unset or empty.
    pub publications_namespace: Option<String>,
}

/// Runs the plugin until SIGTERM or Ctrl-C. When mounts were left to the fd holder, the
/// process exits here without unwinding (see the end).
pub async fn run(config: PluginConfig) -> anyhow::Result<()> {
    let node_id = config.driver.node_id.clone();
    let kube = match &config.api {
        None => {
            tracing::warn!(
                "STANDALONE MODE: no API server; every digest is mounted for any caller, with NO \
                 authorization and NO node-label (GPU exclusion) checks. For conformance runs and \
                 local testing only."
            );
            None
        }
        Some(api) => Some(Arc::new(connect_kube(&node_id, api).await?)),
    };
    let socket = server::socket_path(&config.endpoint)?;
    tracing::info!(kubelet_root = %config.driver.kubelet_root.display(),
        "targets must be under <kubelet-root>/pods");
    // The node cache holds the bytes of every version mounted here: root only.
    let cache_dir = config.cache.disk_dir.clone();
    if let Some(dir) = &cache_dir {
        state_dir::private_dir(dir)?;
    }
    let cache = NodeCache::new(&config.cache).with_context(|| {
        let dir = cache_dir.as_deref().unwrap_or(Path::new("(memory only)"));
        format!("cannot open the node cache {}", dir.display())
    })?;
    cache.set_disk_min_free_percent(config.cache_min_free_percent);
    let fd_holder = config.driver.fd_holder.is_some();
    let store_url = config.driver.store_url.clone();
    let state_dir = config.driver.state_dir.clone();
    let peer_cache = cache.clone();
    let driver = Driver::new(config.driver.clone(), cache, config.mount.clone())
        .context("cannot set up the metrics registry")?;
    // Before serving: a pod's first reads already ask the fleet.
    let _peer = match &config.peer {
        Some(peer) => Some(start_peer_tier(peer, &config, &peer_cache, &driver).await?),
        None => None,
    };
    // Versions whose volume asks for warm nodes (`warm`): needs the API server.
    if let Some(kube) = &kube {
        let warm = WarmConfig {
            cache: peer_cache.clone(),
            disk_bytes: config.cache.disk_bytes,
            settings: config.warm.clone(),
            record_dir: Some(config.driver.state_dir.join("warmed")),
            limits: config.mount.limits,
            // This node's name in the membership: its peer address, or the node name alone.
            me: match &config.peer {
                Some(p) => p.advertise.clone(),
                None => config.driver.node_id.clone(),
            },
            ring: _peer.as_ref().map(|p| p.ring.clone()),
        };
        crate::warm::start(kube, &driver, warm)?;
    }
    if !fd_holder {
        tracing::warn!(
            "no --fd-holder: restarting this plugin will break the mounts of running pods"
        );
    }
    // The socket first, and no store I/O before serving: a restart while the store is down
    // must not keep kubelet and the liveness probe waiting (held mounts resume in the
    // background, each under its own version's lock).
    let listener = server::bind(&socket)?;
    driver.recover().await?;
    let reporter = publications_reporter(&kube, &config, &driver)?;
    if fd_holder {
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
        tokio::spawn(async move {
            match driver.store().await {
                Ok(_) => {
                    tracing::info!(store = %store_url, "store reachable");
                    Ok(())
                }
                Err(e @ CsiError::Store(sealed_store::Error::InvalidStoreUrl { .. })) => Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "store not reachable yet; retrying on publish");
                    Ok(())
                }
            }
        })
    };
    tokio::pin!(store_check);
    tracing::info!(
        endpoint = %config.endpoint,
        node_id = %node_id,
        state_dir = %state_dir.display(),
        "serving {} {}",
        DRIVER_NAME,
        env!("CARGO_PKG_VERSION")
    );
    let registration = start_registration(&config, &socket)?;
    let health = Arc::new(Health::new(
        socket.clone(),
        registration.as_ref().map(|(_, _, path)| path.clone()),
    ));
    let (http_stop, http_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(addr) = config.metrics_addr {
        let listener = sealed_service::http::bind(addr)
            .await
            .context("--metrics-addr")?;
        tokio::spawn(sealed_service::http::serve_with_limits(
            listener,
            driver.metrics().clone(),
            health.clone(),
            config.metrics_limits.clone(),
            async {
                let _ = http_stopped.await;
            },
        ));
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = server::serve(driver.clone(), kube, reporter, listener, async {
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

/// The peer tier over this node's cache, its series added to the plugin's metrics.
async fn start_peer_tier(
    peer: &crate::peer::PeerConfig,
    config: &PluginConfig,
    cache: &NodeCache,
    driver: &Driver,
) -> anyhow::Result<sealed_peer::PeerNode> {
    // A client that asks the store nothing when made, as the mounts' (`store_slot`).
    let store = crate::store_slot::StoreSlot::new(
        config.driver.store_url.clone(),
        config.driver.store_options.clone(),
    )
    .for_mount()
    .context("the peer tier's store")?;
    let node = crate::peer::start(peer, cache, store)
        .await
        .context("cannot start the peer tier")?;
    let collector = crate::peer::PeerCollector::new(cache.metrics().clone(), &node)?;
    driver.metrics().register(Box::new(collector))?;
    Ok(node)
}

/// The API-server client; reads this node's labels once so bad credentials, missing RBAC or
/// a wrong node name fail the start instead of every publish.
async fn connect_kube(node_id: &str, api: &ApiConfig) -> anyhow::Result<KubeAccess> {
    let excluded = GpuExclusion::parse(&api.excluded_gpu_products);
    let attestation = match (&api.attestation_secret, api.insecure_skip_attestation) {
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
    let kube = KubeAccess::connect(node_id.to_string(), excluded, attestation).await?;
    match kube.check_node().await {
        Ok(()) => tracing::info!(node = %node_id, "API server reachable; node not excluded"),
        Err(e @ CsiError::FailedPrecondition(_)) => {
            tracing::warn!("every publish on this node will be refused: {e}")
        }
        Err(e) => return Err(e).context("API-server mode (use --standalone to run without it)"),
    }
    match kube.load_key().await {
        Ok(true) => tracing::info!(secret = ?api.attestation_secret, "attestation key read"),
        Ok(false) => {}
        // The operator may not have made it yet: publishes are refused until it has.
        Err(e) => tracing::warn!("publishes will be refused until the key can be read: {e}"),
    }
    Ok(kube)
}

/// The node publications Lease, renewed in the background, when the API server is used and
/// a namespace is set.
fn publications_reporter(
    kube: &Option<Arc<KubeAccess>>,
    config: &PluginConfig,
    driver: &Arc<Driver>,
) -> anyhow::Result<Option<Arc<Reporter>>> {
    let namespace = config
        .api
        .as_ref()
        .and_then(|api| api.publications_namespace.as_deref());
    match (kube, namespace) {
        (Some(kube), Some(ns)) if !ns.is_empty() => {
            anyhow::ensure!(
                sealed_crds::validate::is_dns_label(ns),
                "--publications-namespace {ns:?} is not a namespace name"
            );
            let lease = PublicationsLease::new(
                kube.client().clone(),
                ns.into(),
                config.driver.node_id.clone(),
            );
            tracing::info!(lease = %lease.name(), namespace = ns, "node publications Lease");
            let reporter = Reporter::new(lease, driver.clone());
            reporter.spawn_renewals();
            Ok(Some(reporter))
        }
        (Some(_), _) => {
            tracing::warn!(
                "no --publications-namespace (POD_NAMESPACE): no node publications Lease, so the \
                 operator cannot tell which versions this node's pods use"
            );
            Ok(None)
        }
        (None, _) => Ok(None),
    }
}

type Registration = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    PathBuf,
);

/// Serves kubelet plugin registration in the background when a kubelet directory is set.
fn start_registration(
    config: &PluginConfig,
    socket: &Path,
) -> anyhow::Result<Option<Registration>> {
    let Some(kubelet_dir) = &config.kubelet_dir else {
        tracing::info!(
            "no --kubelet-dir: not registering with kubelet (node-driver-registrar must)"
        );
        return Ok(None);
    };
    let path = registration::registration_socket(kubelet_dir);
    let listener = server::bind(&path)?;
    let endpoint = config
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
        if let Err(e) = server::serve_registration(listener, endpoint, shutdown).await {
            tracing::error!(error = %format!("{e:#}"), "kubelet registration stopped");
        }
    });
    Ok(Some((stop, task, path)))
}
