//! `sealed mount` / `sealed umount`: a version mounted read-only by digest; bytes stream in
//! from the store through the node disk cache as they are read, every chunk verified.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use sealed_mount::parse_size;
use sealed_mount::{
    FetchPolicy, MountHandle, MountOptions, NodeCache, NodeCacheOptions, PrefetchSelection,
    ReadaheadPolicy, ScrubOptions,
};
use sealed_store::prefetch_profile::ProfileScope;

use crate::context::Context;
use crate::output::{bytes, print_json};

#[derive(Args, Debug)]
pub struct MountArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// Directory to mount it on
    pub dir: PathBuf,
    /// Node disk cache directory, shared by every mount on this machine [default:
    /// /var/cache/sealed-volumes as root, else ~/.cache/sealed-volumes; none for a file:// store,
    /// which is already on a local disk, unless this is given]
    #[arg(long, env = "SEALED_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Bound on the disk cache: a Kubernetes quantity (10Gi = 10·2^30, 10G = 10·10^9) or bytes
    #[arg(long, default_value = "10Gi", value_parser = parse_size, env = "SEALED_CACHE_SIZE")]
    pub cache_size: u64,
    /// Keep chunks in memory only (no disk cache)
    #[arg(long)]
    pub no_disk_cache: bool,
    /// Background scrub of the disk cache, in MiB per second: every cached file and chunk is
    /// hashed again (a pass at most every 10 minutes, reading around the page cache), and one
    /// that no longer matches its digest is dropped and fetched again. 0 turns it off
    #[arg(long, default_value_t = ScrubOptions::DEFAULT_MIB_PER_SECOND, env = "SEALED_SCRUB_RATE")]
    pub scrub_rate: u64,
    /// Bound on recently read and prefetched chunks held in memory
    #[arg(long, default_value = "256Mi", value_parser = parse_size)]
    pub memory: u64,
    /// Bound on readahead bytes being fetched at once (for the whole process)
    #[arg(long, default_value = "256Mi", value_parser = parse_size)]
    pub prefetch_memory: u64,
    /// Largest readahead window per open file (0 turns readahead off)
    #[arg(long, default_value = "64Mi", value_parser = parse_size)]
    pub readahead: u64,
    /// What to fetch before it is read: none; model (on the first open of a *.safetensors or
    /// *.gguf file, its header is read and its tensors fetched in offset order, many at once;
    /// needs a disk cache to go past the first readahead window); all, or comma-separated
    /// globs (e.g. '*.safetensors,tokenizer*'), fetched into the disk cache in the background
    /// after mounting; or model with globs ('model,*.json')
    #[arg(long, default_value = "none")]
    pub prefetch: String,
    /// Neither replay the version's learned prefetch profile nor record one. By default a
    /// mount of a version without a profile records the order its readers first ask for
    /// chunks and stores it beside the manifest when they go quiet (or at unmount); a later
    /// mount with a disk cache fetches those chunks in that order, many at once, before they
    /// are asked for
    #[arg(long)]
    pub no_learned_prefetch: bool,
    /// Whose readers the learned prefetch profile is recorded from and replayed for: a mount
    /// replays only a profile recorded in its own scope. The CSI plugin's scopes are
    /// NAMESPACE/SEALEDVOLUME; naming one here shares that volume's profile
    #[arg(long, default_value = ProfileScope::CLI)]
    pub profile_scope: ProfileScope,
    /// FUSE worker threads
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Return once mounted and keep serving in a background process
    #[arg(long, short = 'd')]
    pub background: bool,
    /// With --background: append the serving process's log here (default: discard)
    #[arg(long)]
    pub log_file: Option<PathBuf>,
    /// Internal: this is the background process; report readiness on stdout.
    #[arg(long, hide = true)]
    pub daemon_child: bool,
    #[command(flatten)]
    pub peer: PeerArgs,
}

/// The peer tier: `sealed mount` processes that share a fleet ask each chunk's owner among
/// them before the store (see docs/peer.md).
#[derive(Args, Debug)]
pub struct PeerArgs {
    /// Peers' addresses (host:port, comma-separated; this node's own may be among them):
    /// turns the peer tier on
    #[arg(long, value_delimiter = ',', conflicts_with = "peers_file")]
    pub peers: Vec<String>,
    /// A file of peers' addresses, re-read every second (membership that changes)
    #[arg(long)]
    pub peers_file: Option<PathBuf>,
    /// Where this node serves its peers
    #[arg(long, default_value = "0.0.0.0:7070")]
    pub peer_listen: std::net::SocketAddr,
    /// This node's address in the peer list [default: --peer-listen]
    #[arg(long)]
    pub peer_advertise: Option<String>,
    /// File with the fleet's shared peer token (at least 16 characters)
    #[arg(long, env = "SEALED_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
    /// Milliseconds for a peer to start answering (its headers come at once, before it has
    /// the chunk) before reading the chunk from the store and not asking it for 5 s; once it
    /// answered it has 10 s (or this bound, if longer) to send the chunk
    #[arg(long, default_value_t = 3000)]
    pub peer_timeout_ms: u64,
    /// Most nodes one owner serves a chunk to; the owners per chunk widen beyond that
    #[arg(long, default_value_t = 64)]
    pub peer_fanout: usize,
    /// Cap on the bytes per second this node sends to all peers together (e.g. 100Mi; at
    /// least 1Mi) [default: none, the link's speed]
    #[arg(long, value_parser = parse_size)]
    pub peer_upload_rate: Option<u64>,
    /// Connections the peer port holds at once; more are closed at accept
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub peer_max_connections: u64,
    /// Connections the peer port holds at once from one address
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub peer_max_connections_per_source: u64,
    /// Milliseconds a connection to the peer port has for its first request head (and, on
    /// HTTP/1.1, each next one); also bounds a TLS handshake's
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub connection_header_timeout_ms: u64,
    /// Milliseconds without a request (or without a byte either way) after which a
    /// connection to the peer port is closed
    #[arg(long, default_value_t = 120_000, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub connection_idle_timeout_ms: u64,
    #[command(flatten)]
    pub tls: PeerTlsArgs,
}

/// TLS between peers (mTLS; off by default: h2c). All three files go together.
#[derive(Args, Debug)]
pub struct PeerTlsArgs {
    /// This node's certificate chain (PEM, leaf first), for --peer-tls-name, signed by the
    /// fleet's CA, with server and client use
    #[arg(long, env = "SEALED_PEER_TLS_CERT")]
    pub peer_tls_cert: Option<PathBuf>,
    /// Its private key (PEM)
    #[arg(long, env = "SEALED_PEER_TLS_KEY")]
    pub peer_tls_key: Option<PathBuf>,
    /// The fleet's CA certificates (PEM): peers must present a certificate under them
    #[arg(long, env = "SEALED_PEER_TLS_CA")]
    pub peer_tls_ca: Option<PathBuf>,
    /// The name every peer's certificate is checked for (peers are dialled by address)
    #[arg(long, default_value = sealed_peer::tls::DEFAULT_NAME, env = "SEALED_PEER_TLS_NAME")]
    pub peer_tls_name: String,
}

impl PeerTlsArgs {
    pub fn load(&self) -> anyhow::Result<Option<sealed_peer::PeerTls>> {
        Ok(sealed_peer::PeerTls::from_flags(
            self.peer_tls_cert.as_deref(),
            self.peer_tls_key.as_deref(),
            self.peer_tls_ca.as_deref(),
            &self.peer_tls_name,
        )?)
    }
}

#[derive(Args, Debug)]
pub struct UmountArgs {
    /// Mounted directory
    pub dir: PathBuf,
    /// Detach now even if files are still open (they keep working until closed)
    #[arg(long, short = 'l')]
    pub lazy: bool,
}

fn default_cache_dir() -> PathBuf {
    if std::env::var_os("XDG_CACHE_HOME").is_none() && is_root() {
        return PathBuf::from("/var/cache/sealed-volumes");
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("sealed-volumes")
}

/// The disk cache holds the bytes of every version mounted here: its directory is made 0700
/// (the cache writes its files 0600), and an existing one this user owns is tightened to it.
fn private_cache_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("cannot read the cache directory {}", dir.display()))?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(());
    }
    let me = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    if me != Some(meta.uid()) {
        // Not ours to change: say so, the bytes in it are readable by others.
        tracing::warn!(dir = %dir.display(), mode = format!("{mode:o}"),
            "the cache directory is readable by other users and not ours to tighten");
        return Ok(());
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700)).with_context(
        || {
            format!(
                "cannot make the cache directory {} private (0700)",
                dir.display()
            )
        },
    )?;
    tracing::info!(dir = %dir.display(), was = format!("{mode:o}"), "cache directory made private (0700)");
    Ok(())
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

pub async fn run_mount(ctx: &Context, args: MountArgs) -> anyhow::Result<ExitCode> {
    if args.background && !args.daemon_child {
        return spawn_background(&args).await;
    }
    let daemon_child = args.daemon_child;
    match serve(ctx, args).await {
        Ok(code) => Ok(code),
        Err(e) => {
            if daemon_child {
                // The parent relays this line; our stderr may be discarded.
                println!("error: {e:#}");
            }
            Err(e)
        }
    }
}

async fn serve(ctx: &Context, args: MountArgs) -> anyhow::Result<ExitCode> {
    let prefetch = PrefetchSelection::parse(&args.prefetch)?;
    // The mount retries its own reads (FetchPolicy); its store client does not retry again.
    let store_options = FetchPolicy::store_options(&ctx.store_options);
    store_options.validate()?;
    let store = sealed_store::ChunkStore::open(&ctx.store_url, &store_options)
        .await
        .with_context(|| format!("cannot open store {}", ctx.store_url))?;
    let digest = crate::context::resolve_digest(&store, &args.digest).await?;
    let cache_dir = match (&args.cache_dir, args.no_disk_cache) {
        (_, true) => None,
        (Some(dir), false) => Some(dir.clone()),
        // A local store is already a disk tier: a second copy would only cost writes.
        (None, false) if ctx.store_url.starts_with("file://") => None,
        (None, false) => Some(default_cache_dir()),
    };
    if let Some(dir) = &cache_dir {
        private_cache_dir(dir)?;
    }
    let cache = NodeCache::new(&NodeCacheOptions {
        disk_dir: cache_dir.clone(),
        disk_bytes: args.cache_size,
        memory_bytes: args.memory,
        readahead_bytes: args.prefetch_memory,
        fetch: FetchPolicy::for_store(&ctx.store_options),
        scrub: ScrubOptions::at_mib_per_second(args.scrub_rate),
    })?;
    let options = MountOptions {
        readahead: ReadaheadPolicy {
            initial: args.readahead.min(ReadaheadPolicy::default().initial),
            max: args.readahead,
        },
        prefetch,
        threads: args.threads.max(1),
        learned_prefetch: !args.no_learned_prefetch,
        profile_scope: args.profile_scope.clone(),
        ..MountOptions::default()
    };
    let peer = start_peer_tier(&args.peer, &cache, &store).await?;
    // Taken before mounting and dropped last, after the settle below: `sealed umount` waits
    // on it.
    let _serving = crate::serving_lock::ServingLock::acquire(&args.dir);
    let mut handle = MountHandle::spawn(store, digest, &args.dir, cache, options)
        .await
        .with_context(|| format!("cannot mount {digest} on {}", args.dir.display()))?;

    let tree = handle.fs().tree();
    if args.daemon_child {
        println!("ready");
        let _ = std::io::stdout().flush();
    } else {
        eprintln!(
            "mounted {digest} on {} in {:.1} ms: {} entries, {}; disk cache {}. \
             Ctrl-C or `sealed umount {}` unmounts.",
            args.dir.display(),
            handle.ready_in().as_secs_f64() * 1e3,
            tree.len().saturating_sub(1),
            bytes(tree.total_bytes()),
            cache_dir
                .as_ref()
                .map(|d| format!("{} (up to {})", d.display(), bytes(args.cache_size)))
                .unwrap_or_else(|| "off".into()),
            args.dir.display()
        );
    }

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    let by_us = tokio::select! {
        _ = tokio::signal::ctrl_c() => true,
        _ = term.recv() => true,
        _ = handle.wait() => false,
    };
    let metrics = handle.metrics().snapshot();
    if by_us {
        handle.unmount().await?;
    } else {
        // Unmounted by someone else: keep what was fetched, assembled and learned for the
        // next mount.
        handle.close().await;
    }
    if ctx.json() && !args.daemon_child {
        match &peer {
            // The peer tier's counters join the mount's, under `peer`.
            Some(peer) => {
                let mut all = serde_json::to_value(metrics)?;
                all["peer"] = serde_json::to_value(peer.metrics.snapshot())?;
                print_json(&all)?;
            }
            None => print_json(&metrics)?,
        }
    } else if !args.daemon_child {
        eprintln!(
            "unmounted {}: served {}, fetched {} from the store in {} chunks, {} verification failures",
            args.dir.display(),
            bytes(metrics.bytes_read),
            bytes(metrics.store_bytes_fetched),
            metrics.store_fetches,
            metrics.verification_failures
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// With `--peers` or `--peers-file`: serves this node's cache to the fleet and asks the
/// fleet before the store. The store's credentials stay here; peers get verified bytes only.
async fn start_peer_tier(
    args: &PeerArgs,
    cache: &NodeCache,
    store: &sealed_store::ChunkStore,
) -> anyhow::Result<Option<sealed_peer::PeerNode>> {
    use sealed_peer::{PeerOptions, PeerToken, membership};
    if args.peers.is_empty() && args.peers_file.is_none() {
        return Ok(None);
    }
    let token_file = args.peer_token_file.as_ref().context(
        "--peers needs --peer-token-file: peers serve chunks only to holders of the fleet's token",
    )?;
    let token = PeerToken::from_file(token_file)?;
    let advertise = args
        .peer_advertise
        .clone()
        .unwrap_or_else(|| args.peer_listen.to_string());
    membership::check_addr(&advertise).context("--peer-advertise")?;
    let mut options = PeerOptions::new(args.peer_listen, advertise, token);
    options.set_request_timeout(Duration::from_millis(
        args.peer_timeout_ms.clamp(1, 600_000),
    ));
    options.fanout = args.peer_fanout.max(1);
    options.upload_rate =
        sealed_peer::pace::checked_rate(args.peer_upload_rate).map_err(anyhow::Error::msg)?;
    options.tls = args.tls.load()?;
    options.limits = options.limits.clone().with_flags(
        args.peer_max_connections,
        args.peer_max_connections_per_source,
        args.connection_header_timeout_ms,
        args.connection_idle_timeout_ms,
    );
    // A rotated token or certificate is picked up without a remount.
    options.files = Some(sealed_peer::PeerFiles::new(
        token_file,
        args.tls.peer_tls_cert.as_deref(),
        args.tls.peer_tls_key.as_deref(),
        args.tls.peer_tls_ca.as_deref(),
    ));
    let members = match &args.peers_file {
        Some(path) => membership::from_file(path.clone(), options.fanout, Duration::from_secs(1))?,
        None => {
            let addrs = membership::parse_addrs(&args.peers.join(","))?;
            membership::fixed(addrs, options.fanout)
        }
    };
    let node = sealed_peer::PeerNode::start(&options, members, cache, store.clone()).await?;
    Ok(Some(node))
}

/// Starts this same command as a background process and returns once it has mounted.
async fn spawn_background(args: &MountArgs) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("cannot find the sealed executable")?;
    let stderr = match &args.log_file {
        Some(path) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot open log file {}", path.display()))?,
        ),
        None => Stdio::null(),
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .arg("--daemon-child")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr);
    // Its own process group: a Ctrl-C meant for this terminal does not unmount.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().context("cannot start the background mount")?;
    let pid = child.id();
    let stdout = child
        .stdout
        .take()
        .context("background mount has no stdout")?;
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        line
    })
    .await
    .context("waiting for the background mount")?;
    if line.trim() == "ready" {
        eprintln!(
            "mounted {} on {} (serving process {pid}; `sealed umount {}` unmounts)",
            args.digest,
            args.dir.display(),
            args.dir.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .ok()
        .and_then(|s| s.ok());
    let reason = line.trim().trim_start_matches("error: ").to_owned();
    anyhow::bail!(
        "background mount failed{}: {}",
        status.map(|s| format!(" ({s})")).unwrap_or_default(),
        if reason.is_empty() {
            "it exited before mounting (run without --background to see why)".to_owned()
        } else {
            reason
        }
    )
}

pub async fn run_umount(_ctx: &Context, args: UmountArgs) -> anyhow::Result<ExitCode> {
    let dir = args.dir.clone();
    let lazy = args.lazy;
    // Opened before unmounting: the serving process removes it as it exits.
    let serving = crate::serving_lock::open_for_wait(&args.dir);
    tokio::task::spawn_blocking(move || sealed_mount::unmount(&dir, lazy))
        .await
        .context("unmount task failed")?
        .map_err(|e| {
            let busy = matches!(&e, sealed_mount::MountError::Unmount { source, .. }
                if source.raw_os_error() == Some(16));
            let not_mounted = matches!(&e, sealed_mount::MountError::Unmount { source, .. }
                if source.raw_os_error() == Some(22));
            if busy {
                anyhow::anyhow!("{e}: files are still open there; close them or use --lazy")
            } else if not_mounted {
                anyhow::anyhow!("{} is not a mount point", args.dir.display())
            } else {
                anyhow::Error::new(e)
            }
        })?;
    let Some(serving) = serving else {
        eprintln!("unmounted {}", args.dir.display());
        return Ok(ExitCode::SUCCESS);
    };
    // The serving process now writes what it fetched, assembled and learned (bounded at 35 s
    // in all); returning before it is done would let a caller remove or reuse that cache.
    // A lazy unmount with files still open settles only when they close: do not wait.
    let bound = if lazy { Duration::ZERO } else { SETTLE_WAIT };
    let waited =
        tokio::task::spawn_blocking(move || crate::serving_lock::wait_released(&serving, bound))
            .await
            .context("waiting for the serving process")?;
    match waited {
        Some(_) => eprintln!("unmounted {}", args.dir.display()),
        None if lazy => eprintln!(
            "detached {}: its serving process exits once the files open there are closed",
            args.dir.display()
        ),
        None => eprintln!(
            "unmounted {}; its serving process was still writing its cache after {} s",
            args.dir.display(),
            SETTLE_WAIT.as_secs()
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// How long `sealed umount` waits for the serving process to settle: past its own bounds
/// (flush 10 s, assemblies 20 s, profile 5 s).
const SETTLE_WAIT: Duration = Duration::from_secs(60);
