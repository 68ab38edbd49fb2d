//! `sealed-csi`: the CSI node plugin binary. It parses flags and calls the library
//! (`sealed_csi::plugin::run`), which holds the lifecycle.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use sealed_csi::DriverConfig;
use sealed_csi::attest::SecretRef;
use sealed_csi::peer::{PeerConfig, PeerMembers};
use sealed_csi::plugin::{ApiConfig, PluginConfig};
use sealed_mount::{
    FetchPolicy, MountLimits, MountOptions, NodeCacheOptions, PrefetchSelection, ScrubOptions,
    parse_size,
};
use sealed_service::store_args::StoreArgs;

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
    /// The store: --store, --store-endpoint, --store-region, --store-timeout, --store-retries
    #[command(flatten)]
    store: StoreArgs,
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
    /// Per mount: most memory the mounted tree may need (bytes, or a quantity: 512Mi, 1G)
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
    /// Bound on the disk cache: a Kubernetes quantity (10Gi = 10·2^30, 10G = 10·10^9) or bytes
    #[arg(long, env = "SEALED_CACHE_SIZE", default_value = "10Gi", value_parser = parse_size)]
    cache_size: u64,
    /// Percent of the cache's filesystem kept free: below it the disk cache evicts its own
    /// least recently used entries, or stops caching new ones (reads are still served).
    /// 0 turns the guard off (0 to 90)
    #[arg(long, env = "SEALED_CACHE_MIN_FREE_PERCENT", default_value_t = 10,
          value_parser = clap::value_parser!(u8).range(0..=90))]
    cache_min_free_percent: u8,
    /// Bound on chunks held in memory, for the node
    #[arg(long, default_value = "256Mi", value_parser = parse_size)]
    memory: u64,
    /// Background scrub of the disk cache, MiB per second: every cached file and chunk is
    /// hashed again (a pass at most every 10 minutes) and one that no longer matches its
    /// digest is dropped and fetched again. 0 turns it off
    #[arg(long, env = "SEALED_SCRUB_RATE", default_value_t = ScrubOptions::DEFAULT_MIB_PER_SECOND)]
    scrub_rate: u64,
    /// What a volume without a `prefetch` attribute prefetches: none, model, all, or
    /// comma-separated globs ('model,*.json' adds globs to model)
    #[arg(long, env = "SEALED_PREFETCH", default_value = "none", value_parser = parse_prefetch)]
    prefetch: PrefetchSelection,
    /// Learned prefetch for volumes without a `learnedPrefetch` attribute: a version's first
    /// mount records the order its readers ask for chunks and stores it beside the manifest;
    /// later mounts on any node fetch those chunks in that order before they are asked for
    #[arg(long, env = "SEALED_LEARNED_PREFETCH", default_value_t = true, action = clap::ArgAction::Set)]
    learned_prefetch: bool,
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
    #[arg(long, default_value_t = sealed_csi::driver::DEFAULT_RESUME_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    resume_deadline: u64,
    /// Serve Prometheus /metrics and /healthz over HTTP on this address (e.g. 0.0.0.0:9809);
    /// off when unset
    #[arg(long, env = "SEALED_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Serve this node's cache to its peers on this address and ask them before the store
    /// (docs/peer.md); off when unset
    #[arg(long, env = "SEALED_PEER_LISTEN")]
    peer_listen: Option<std::net::SocketAddr>,
    /// This node's peer address as the others see it (the chart: $(POD_IP):port)
    /// [default: --peer-listen]
    #[arg(long, env = "SEALED_PEER_ADVERTISE")]
    peer_advertise: Option<String>,
    /// File with the fleet's shared peer token
    #[arg(
        long,
        env = "SEALED_PEER_TOKEN_FILE",
        default_value = "/etc/sealed-volumes/peer/token"
    )]
    peer_token_file: PathBuf,
    /// NAMESPACE/NAME of the plugins' headless Service: its EndpointSlices are the peers
    #[arg(long, env = "SEALED_PEER_SERVICE", conflicts_with = "peers")]
    peer_service: Option<String>,
    /// A fixed peer list instead (host:port, comma-separated)
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Milliseconds for a peer to start answering (its headers come at once, before it has
    /// the chunk) before reading the chunk from the store and not asking it for 5 s; once it
    /// answered it has 10 s (or this bound, if longer) to send the chunk
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    peer_timeout_ms: u64,
    /// Most nodes one owner serves a chunk to; the owners per chunk widen beyond that
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    peer_fanout: u64,
    /// Cap on the bytes per second this node sends to all peers together (e.g. 100Mi; at
    /// least 1Mi) [default: none, the link's speed]
    #[arg(long, value_parser = parse_size)]
    peer_upload_rate: Option<u64>,
    /// TLS between peers (mTLS; all three files or none): this node's certificate chain
    /// (PEM), for --peer-tls-name under the fleet's CA, with server and client use
    #[arg(long, env = "SEALED_PEER_TLS_CERT")]
    peer_tls_cert: Option<PathBuf>,
    /// Its private key (PEM)
    #[arg(long, env = "SEALED_PEER_TLS_KEY")]
    peer_tls_key: Option<PathBuf>,
    /// The fleet's CA certificates (PEM)
    #[arg(long, env = "SEALED_PEER_TLS_CA")]
    peer_tls_ca: Option<PathBuf>,
    /// The name every peer's certificate is checked for (peers are dialled by pod IP)
    #[arg(long, env = "SEALED_PEER_TLS_NAME", default_value = sealed_peer::tls::DEFAULT_NAME)]
    peer_tls_name: String,
    /// Connections the peer port holds at once; more are closed at accept
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    peer_max_connections: u64,
    /// Connections the peer port holds at once from one address
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    peer_max_connections_per_source: u64,
    /// Connections the metrics port holds at once
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    metrics_max_connections: u64,
    /// Connections the metrics port holds at once from one address
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    metrics_max_connections_per_source: u64,
    /// Milliseconds a connection to the peer or metrics port has for its first request head
    /// (and, on HTTP/1.1, each next one); also bounds a TLS handshake's
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    connection_header_timeout_ms: u64,
    /// Milliseconds without a request (or without a byte either way) after which a
    /// connection to the peer or metrics port is closed
    #[arg(long, default_value_t = 120_000, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    connection_idle_timeout_ms: u64,
    /// Which namespaces' versions this node warms (spec.warm): off, all, or labelled (those
    /// with --warming-namespace-label)
    #[arg(long, env = "SEALED_WARMING", default_value = "off")]
    warming: String,
    /// The label (KEY=VALUE) of namespaces allowed to warm, with --warming labelled
    #[arg(long, env = "SEALED_WARMING_NAMESPACE_LABEL", default_value = sealed_crds::warming::DEFAULT_NAMESPACE_LABEL)]
    warming_namespace_label: String,
    /// Percent of the disk cache one warmed version may take
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u8).range(1..=100))]
    warm_cache_share: u8,
    /// Seconds: warming evicts no cache entry used within this long (a cache full of such
    /// entries ends a warm early)
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(0..=604_800))]
    warm_spare_recent_secs: u64,
    /// Bytes per second all warming on this node fetches from the store (e.g. 32Mi); 0: no bound
    #[arg(long, default_value = "32Mi", value_parser = parse_size)]
    warm_rate: u64,
    /// Log more (-v info, -vv debug); SEALED_LOG overrides
    #[arg(long, short = 'v', action = clap::ArgAction::Count)]
    verbose: u8,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    sealed_service::logging::init(
        sealed_service::logging::verbosity("info", args.verbose),
        false,
    );
    // Before any listener: the soft open-files limit up to the hard one, and the share
    // connections may hold fixed from it (the rest stays for FUSE and the cache).
    sealed_service::listen::prepare_descriptors();
    let config = plugin_config(args)?;
    sealed_csi::plugin::run(config).await
}

/// The peer tier's flags: off without --peer-listen.
fn peer_config(args: &Args) -> anyhow::Result<Option<PeerConfig>> {
    let Some(listen) = args.peer_listen else {
        return Ok(None);
    };
    let members = match &args.peer_service {
        Some(service) => {
            let (namespace, name) = service.split_once('/').ok_or_else(|| {
                anyhow::anyhow!("--peer-service {service:?} is not NAMESPACE/NAME")
            })?;
            PeerMembers::Service {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                port: listen.port(),
            }
        }
        None if !args.peers.is_empty() => {
            PeerMembers::Fixed(sealed_peer::membership::parse_addrs(&args.peers.join(","))?)
        }
        None => anyhow::bail!("--peer-listen needs --peer-service NAMESPACE/NAME or --peers"),
    };
    Ok(Some(PeerConfig {
        listen,
        advertise: args
            .peer_advertise
            .clone()
            .unwrap_or_else(|| listen.to_string()),
        files: sealed_peer::PeerFiles::new(
            &args.peer_token_file,
            args.peer_tls_cert.as_deref(),
            args.peer_tls_key.as_deref(),
            args.peer_tls_ca.as_deref(),
        ),
        members,
        request_timeout: Duration::from_millis(args.peer_timeout_ms),
        fanout: usize::try_from(args.peer_fanout).unwrap_or(usize::MAX),
        upload_rate: sealed_peer::pace::checked_rate(args.peer_upload_rate)
            .map_err(anyhow::Error::msg)?,
        // Loaded now: a certificate its peers would refuse stops the plugin at start.
        tls: sealed_peer::PeerTls::from_flags(
            args.peer_tls_cert.as_deref(),
            args.peer_tls_key.as_deref(),
            args.peer_tls_ca.as_deref(),
            &args.peer_tls_name,
        )?,
        limits: connection_limits(
            args,
            sealed_service::listen::ConnLimits::peer(),
            args.peer_max_connections,
            args.peer_max_connections_per_source,
        ),
    }))
}

/// A listener's bounds from the flags (the timeouts are shared by both listeners).
fn connection_limits(
    args: &Args,
    defaults: sealed_service::listen::ConnLimits,
    max: u64,
    per_source: u64,
) -> sealed_service::listen::ConnLimits {
    defaults.with_flags(
        max,
        per_source,
        args.connection_header_timeout_ms,
        args.connection_idle_timeout_ms,
    )
}

/// The library's configuration from the flags.
fn plugin_config(args: Args) -> anyhow::Result<PluginConfig> {
    let peer = peer_config(&args)?;
    let warm = sealed_csi::warm::WarmSettings {
        policy: sealed_crds::warming::WarmingPolicy::parse(
            &args.warming,
            &args.warming_namespace_label,
        )
        .map_err(anyhow::Error::msg)?,
        cache_share: args.warm_cache_share,
        spare_recent: Duration::from_secs(args.warm_spare_recent_secs),
        rate: args.warm_rate,
    };
    let metrics_limits = connection_limits(
        &args,
        sealed_service::listen::ConnLimits::metrics(),
        args.metrics_max_connections,
        args.metrics_max_connections_per_source,
    );
    let api = if args.standalone {
        if args.attestation_secret.is_some()
            || args.insecure_skip_attestation
            || args.publications_namespace.is_some()
        {
            tracing::warn!(
                "--standalone: --attestation-secret, --insecure-skip-attestation and \
                 --publications-namespace need the API server; ignored"
            );
        }
        None
    } else {
        Some(ApiConfig {
            excluded_gpu_products: args.excluded_gpu_products,
            attestation_secret: args.attestation_secret,
            insecure_skip_attestation: args.insecure_skip_attestation,
            publications_namespace: args.publications_namespace,
        })
    };
    let store_options = args.store.options();
    // The mounts' retries are the store flags' (`FetchPolicy::for_store`), plus the breaker.
    let fetch = FetchPolicy {
        breaker_open: Duration::from_secs(args.breaker_open),
        ..FetchPolicy::for_store(&store_options)
    };
    let driver = DriverConfig {
        node_id: args.node_id,
        state_dir: args.state_dir,
        store_url: args.store.store.clone(),
        store_options,
        max_volumes: args.max_volumes,
        standalone: args.standalone,
        fd_holder: args.fd_holder,
        kubelet_root: args
            .kubelet_root
            .or_else(|| args.kubelet_dir.clone())
            .unwrap_or_else(|| PathBuf::from(sealed_csi::targets::DEFAULT_KUBELET_ROOT)),
        resume_deadline: Duration::from_secs(args.resume_deadline),
    };
    let cache = NodeCacheOptions {
        disk_dir: Some(args.cache_dir),
        disk_bytes: args.cache_size,
        memory_bytes: args.memory,
        fetch,
        scrub: ScrubOptions::at_mib_per_second(args.scrub_rate),
        ..NodeCacheOptions::default()
    };
    let mount = MountOptions {
        limits: MountLimits {
            max_entries: args.max_mount_entries,
            max_chunks: args.max_mount_chunks,
            max_manifest_bytes: args.max_mount_memory,
            max_fetches_per_read: args.max_fetches_per_read,
            max_fetches_per_mount: args.max_fetches_per_mount,
        },
        prefetch: args.prefetch,
        learned_prefetch: args.learned_prefetch,
        ..MountOptions::default()
    };
    Ok(PluginConfig {
        endpoint: args.endpoint,
        driver,
        cache,
        cache_min_free_percent: args.cache_min_free_percent,
        mount,
        api,
        kubelet_dir: args.kubelet_dir,
        kubelet_registration_path: args.kubelet_registration_path,
        metrics_addr: args.metrics_addr,
        metrics_limits,
        peer,
        warm,
    })
}

fn parse_prefetch(text: &str) -> Result<PrefetchSelection, String> {
    PrefetchSelection::parse(text).map_err(|e| e.to_string())
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
