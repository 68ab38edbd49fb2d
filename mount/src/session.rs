//! Mounting and unmounting: the entry point the CLI and the CSI node plugin share.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, Session, SessionACL, SessionUnmounter};
use sealed_store::prefetch_profile::ProfileScope;
use sealed_store::{ChunkStore, Digest, Manifest};
use tokio::sync::watch;

use crate::error::MountError;
use crate::fetch::NodeCache;
use crate::fs::SealedFs;
use crate::fuse::FuseAdapter;
use crate::learned::LearnedPrefetch;
use crate::limits::MountLimits;
use crate::metrics::MountMetrics;
use crate::prefetch::PrefetchSelection;
use crate::readahead::ReadaheadPolicy;
use crate::tree::Tree;

/// How one version is mounted. The node-wide cache settings live in [`NodeCache`].
#[derive(Clone, Debug)]
pub struct MountOptions {
    pub readahead: ReadaheadPolicy,
    /// What to prefetch: in the background into the disk cache after mounting (`all`,
    /// globs), and model files' tensors on their first open (`model`). See `crate::prefetch`.
    pub prefetch: PrefetchSelection,
    /// Chunks a background prefetch fetches at once. (The model-aware prefetch fetches up to
    /// `limits.max_fetches_per_read` per file, within half of `max_fetches_per_mount`.)
    pub prefetch_concurrency: usize,
    /// FUSE worker threads (each with its own cloned /dev/fuse fd).
    pub threads: usize,
    /// Let every user read the mount (`allow_other`); default: when running as root.
    pub allow_other: Option<bool>,
    /// Kernel readahead for the mount's backing device, KiB (best effort; needs root).
    pub kernel_readahead_kb: Option<u32>,
    /// Serve the mount so another process can take it over ([`MountHandle::fuse_fd`],
    /// [`MountHandle::resume`]): every worker reads the one /dev/fuse fd instead of a clone,
    /// because requests read on a clone are failed when the clone closes, while those read
    /// on the shared fd wait for the next server.
    pub restartable: bool,
    /// Caps on the version's size, checked before mounting, and on the fetches its reads
    /// have in flight.
    pub limits: MountLimits,
    /// Serve hydrated files by FUSE passthrough where the kernel and privileges allow
    /// (`crate::passthrough`); false serves every read in the daemon.
    pub passthrough: bool,
    /// With `restartable`: the file where the mount records its inodes' io modes, which the
    /// server that resumes it must inherit (`crate::io_modes`). Without it a resumed mount
    /// cannot know the previous server's modes and serves every read itself.
    pub io_mode_record: Option<PathBuf>,
    /// Learned prefetch (`crate::learned`): replay the version's stored profile, or record
    /// one from this mount's first reads and store it. A resumed mount does neither. Off in
    /// the library's default; `sealed mount` and the CSI plugin turn it on unless told not to.
    pub learned_prefetch: bool,
    /// Whose readers a learned profile is recorded from and replayed for
    /// (`crate::learned`): a mount replays only a profile of its own scope.
    pub profile_scope: ProfileScope,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            readahead: ReadaheadPolicy::default(),
            prefetch: PrefetchSelection::None,
            prefetch_concurrency: 8,
            threads: 4,
            allow_other: None,
            kernel_readahead_kb: Some(8192),
            restartable: false,
            limits: MountLimits::default(),
            passthrough: true,
            io_mode_record: None,
            learned_prefetch: false,
            profile_scope: ProfileScope::default(),
        }
    }
}

/// A mounted version, served by background threads until [`MountHandle::unmount`] or until
/// someone unmounts the directory (`sealed umount`, `umount`). Dropping the handle unmounts.
pub struct MountHandle {
    fs: Arc<SealedFs>,
    mountpoint: PathBuf,
    unmounter: Option<Unmounter>,
    /// A duplicate of the /dev/fuse fd, for [`MountHandle::fuse_fd`] (restartable mounts).
    fuse: Option<OwnedFd>,
    thread: Option<JoinHandle<io::Result<()>>>,
    ended: watch::Receiver<bool>,
    /// The prefetches this mount runs, aborted when the mount ends.
    prefetch: Prefetches,
    learned: Option<LearnedPrefetch>,
    device: Option<u64>,
    ready_in: Duration,
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

impl MountHandle {
    /// Mounts `digest` from `store` at `mountpoint` and serves it in the background. Only the
    /// manifest is fetched (and verified against `digest`) before this returns; file bytes
    /// stream in as they are read. Must be called within a tokio runtime, which then serves
    /// the reads.
    pub async fn spawn(
        store: ChunkStore,
        digest: Digest,
        mountpoint: impl AsRef<Path>,
        cache: NodeCache,
        options: MountOptions,
    ) -> Result<MountHandle, MountError> {
        let started = Instant::now();
        let mountpoint = mountpoint.as_ref();
        // A bad directory is named before the store is asked for anything.
        check_mountpoint(mountpoint)?;
        let manifest = fetch_manifest(&store, digest, &cache, &options.limits).await?;
        let prepared = prepare(store, digest, manifest, cache, &options)?;
        spawn_prepared(started, prepared, mountpoint, options).await
    }

    /// [`MountHandle::spawn`] for a caller that already holds the version's manifest,
    /// parsed from bytes it verified against `digest` (the CSI node plugin keeps such a copy
    /// under its state dir). The store is read only for chunks, so the mount is served even
    /// where the store no longer has, or cannot now serve, the manifest object.
    pub async fn spawn_with_manifest(
        store: ChunkStore,
        digest: Digest,
        manifest: Manifest,
        mountpoint: impl AsRef<Path>,
        cache: NodeCache,
        options: MountOptions,
    ) -> Result<MountHandle, MountError> {
        let started = Instant::now();
        let mountpoint = mountpoint.as_ref();
        check_mountpoint(mountpoint)?;
        let prepared = prepare(store, digest, manifest, cache, &options)?;
        spawn_prepared(started, prepared, mountpoint, options).await
    }

    /// Serves a version that is already mounted at `mountpoint` through the FUSE connection
    /// `fuse`: a duplicate of [`MountHandle::fuse_fd`] of the process that mounted it, which
    /// is gone. Requests it read but never answered are sent again (Linux >= 6.9), and reads
    /// that waited meanwhile are answered now. `digest` must be the version mounted there.
    pub async fn resume(
        store: ChunkStore,
        digest: Digest,
        fuse: OwnedFd,
        mountpoint: impl AsRef<Path>,
        cache: NodeCache,
        options: MountOptions,
    ) -> Result<MountHandle, MountError> {
        let started = Instant::now();
        let manifest = fetch_manifest(&store, digest, &cache, &options.limits).await?;
        let prepared = prepare(store, digest, manifest, cache, &options)?;
        resume_prepared(started, prepared, fuse, mountpoint.as_ref(), options).await
    }

    /// [`MountHandle::resume`] from a manifest the caller holds, parsed from bytes it
    /// verified against `digest` (see [`MountHandle::spawn_with_manifest`]): a held mount is
    /// served again even while the store cannot serve the manifest.
    pub async fn resume_with_manifest(
        store: ChunkStore,
        digest: Digest,
        manifest: Manifest,
        fuse: OwnedFd,
        mountpoint: impl AsRef<Path>,
        cache: NodeCache,
        options: MountOptions,
    ) -> Result<MountHandle, MountError> {
        let started = Instant::now();
        let prepared = prepare(store, digest, manifest, cache, &options)?;
        resume_prepared(started, prepared, fuse, mountpoint.as_ref(), options).await
    }

    /// Adds `selection` to what this running mount prefetches (the CSI node plugin, when a
    /// later publish of the same version asks for more than the first): `model` turns the
    /// model-aware prefetch on for opens from now on (files opened before are not gone back
    /// to), and `all` or globs not asked for before start a background prefetch now. Nothing
    /// is turned off. False if it asked for nothing new. Needs a tokio runtime context.
    pub fn add_prefetch(&self, selection: &PrefetchSelection) -> bool {
        self.prefetch.add(&self.fs, selection)
    }

    /// A duplicate of the mount's /dev/fuse fd, for a holder process that keeps the mount
    /// alive while this process restarts (mounts made with `restartable` only).
    pub fn fuse_fd(&self) -> io::Result<OwnedFd> {
        match &self.fuse {
            Some(fd) => fd.try_clone(),
            None => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the mount was not made restartable",
            )),
        }
    }

    /// Leaves the mount in place when the handle goes: for a process that exits so that
    /// another one resumes the mount ([`MountHandle::resume`]). Reads wait meanwhile, as long
    /// as some process still holds the FUSE fd.
    pub fn keep_mounted(mut self) {
        self.unmounter = None;
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    pub fn fs(&self) -> &Arc<SealedFs> {
        &self.fs
    }

    pub fn metrics(&self) -> &MountMetrics {
        self.fs.metrics()
    }

    /// From the call to [`MountHandle::spawn`] to the mount serving requests.
    pub fn ready_in(&self) -> Duration {
        self.ready_in
    }

    /// This mount's cold start so far: time to first byte, bytes read, bytes per tier.
    pub fn cold_start(&self) -> &Arc<crate::cold_start::ColdStart> {
        self.fs.cold_start()
    }

    /// True once the filesystem is no longer served (unmounted by anyone).
    pub fn has_ended(&self) -> bool {
        *self.ended.borrow()
    }

    /// Waits until the directory is unmounted by someone else.
    pub async fn wait(&mut self) {
        let _ = self.ended.wait_for(|ended| *ended).await;
    }

    /// The directory was unmounted by someone else (`sealed umount`, `umount`, the kubelet):
    /// keeps what this process has for the next mount ([`MountHandle::unmount`] does the
    /// same after unmounting).
    pub async fn close(mut self) {
        self.prefetch.stop(&self.fs);
        self.settle().await;
    }

    /// Every read is in: the chunks fetched so far land in the disk cache for the next
    /// process, files read to their end are assembled for it (a 512 MiB shard takes about a
    /// second), and a learned-prefetch recording under way is stored. Each step is bounded.
    async fn settle(&mut self) {
        let cache = self.fs.cache().clone();
        let _ = tokio::time::timeout(Duration::from_secs(10), cache.flush()).await;
        let _ = tokio::time::timeout(Duration::from_secs(20), cache.assemblies_finished()).await;
        if let Some(learned) = self.learned.take() {
            learned.finish(&self.fs).await;
        }
    }

    /// Unmounts and stops serving. If files are still open (EBUSY) the mount is detached
    /// lazily and its FUSE connection aborted, so this never hangs.
    pub async fn unmount(mut self) -> Result<(), MountError> {
        self.prefetch.stop(&self.fs);
        let unmounter = self.unmounter.take();
        let path = self.mountpoint.clone();
        let device = self.device;
        let detached = tokio::task::spawn_blocking(move || -> Result<bool, MountError> {
            let Some(mut unmounter) = unmounter else {
                return Ok(false);
            };
            match unmounter.unmount() {
                Ok(()) => Ok(false),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unmount failed; detaching");
                    unmount(&path, true)?;
                    if let Some(dev) = device {
                        abort_connection(dev);
                    }
                    Ok(true)
                }
            }
        })
        .await
        .map_err(|e| MountError::Unmount {
            path: self.mountpoint.clone(),
            source: io::Error::other(e.to_string()),
        })??;
        self.settle().await;
        // The serving threads end once the kernel closes the connection.
        let wait = self.ended.wait_for(|ended| *ended);
        let limit = if detached {
            Duration::from_secs(2)
        } else {
            Duration::from_secs(10)
        };
        if tokio::time::timeout(limit, wait).await.is_ok()
            && let Some(thread) = self.thread.take()
        {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        tracing::info!(mountpoint = %self.mountpoint.display(), "unmounted");
        Ok(())
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        self.prefetch.stop(&self.fs);
        if let Some(mut unmounter) = self.unmounter.take()
            && !self.has_ended()
            && unmounter.unmount().is_err()
        {
            let _ = unmount(&self.mountpoint, true);
            if let Some(dev) = self.device {
                abort_connection(dev);
            }
        }
    }
}

/// The prefetches of a mount: the selections asked for so far, and the background tasks
/// they started.
struct Prefetches {
    concurrency: usize,
    state: parking_lot::Mutex<(Vec<PrefetchSelection>, Vec<tokio::task::JoinHandle<()>>)>,
}

impl Prefetches {
    fn new(concurrency: usize) -> Prefetches {
        Prefetches {
            concurrency,
            state: parking_lot::Mutex::new((Vec::new(), Vec::new())),
        }
    }

    /// Adds `selection` to what the mount prefetches: `model` turns the model-aware prefetch
    /// on for opens from now on, and a background part (`all`, globs) not asked for before
    /// starts now. Nothing is ever turned off. False if it asked for nothing new.
    fn add(&self, fs: &Arc<SealedFs>, selection: &PrefetchSelection) -> bool {
        let mut new = false;
        if selection.model() && !fs.model_prefetch().enabled() {
            fs.set_model_prefetch(true);
            new = true;
        }
        if !selection.background() {
            return new;
        }
        let mut state = self.state.lock();
        let (asked, tasks) = &mut *state;
        let background = |s: &PrefetchSelection| match s {
            PrefetchSelection::Model { globs } => PrefetchSelection::Globs(globs.clone()),
            other => other.clone(),
        };
        let wanted = background(selection);
        if asked
            .iter()
            .any(|s| *s == wanted || *s == PrefetchSelection::All)
        {
            return new;
        }
        asked.push(wanted.clone());
        tasks.retain(|t| !t.is_finished());
        let fs = fs.clone();
        let concurrency = self.concurrency;
        tasks.push(tokio::spawn(async move {
            match crate::prefetch::prefetch(fs, &wanted, concurrency).await {
                Ok(report) => tracing::info!(?report, "background prefetch done"),
                Err(e) => tracing::warn!(error = %e, "background prefetch failed"),
            }
        }));
        true
    }

    fn stop(&self, fs: &SealedFs) {
        fs.stop_prefetch();
        for task in self.state.lock().1.drain(..) {
            task.abort();
        }
    }
}

/// How a handle takes its mount down: through `fuser` for a mount it made, by path for one
/// it resumed (`fuser` did not mount that one, so it cannot unmount it).
enum Unmounter {
    Session(SessionUnmounter),
    Path(PathBuf),
}

impl Unmounter {
    fn unmount(&mut self) -> io::Result<()> {
        match self {
            Unmounter::Session(u) => u.unmount(),
            Unmounter::Path(path) => unmount(path, false).map_err(|e| match e {
                MountError::Unmount { source, .. } => source,
                other => io::Error::other(other.to_string()),
            }),
        }
    }
}

/// The mount point must be an existing directory; one whose server is gone gets the way out.
fn check_mountpoint(mountpoint: &Path) -> Result<(), MountError> {
    let bad_dir = |reason: String| MountError::MountPoint {
        path: mountpoint.to_path_buf(),
        reason,
    };
    match std::fs::metadata(mountpoint) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(bad_dir("not a directory".into())),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Err(bad_dir(format!(
            "{e}: a mount whose server is gone is still attached here; \
             `sealed umount --lazy {}` detaches it",
            mountpoint.display()
        ))),
        Err(e) => Err(bad_dir(e.to_string())),
    }
}

/// `digest`'s manifest from the store (retried by the cache's fetch policy), verified against
/// the digest; its encoded size is checked against `limits` before it is parsed.
async fn fetch_manifest(
    store: &ChunkStore,
    digest: Digest,
    cache: &NodeCache,
    limits: &MountLimits,
) -> Result<Manifest, MountError> {
    let bytes = cache.manifest_bytes(store, &digest).await?;
    limits.check_encoded(digest, bytes.len() as u64)?;
    Ok(Manifest::parse(&bytes)?)
}

/// A version ready to be served: its filesystem, the FUSE adapter over it, and the FUSE
/// settings every mount of it uses.
struct Prepared {
    fs: Arc<SealedFs>,
    adapter: FuseAdapter,
    config: Config,
}

/// The filesystem for `digest` (whose verified manifest is `manifest`) and its FUSE settings.
fn prepare(
    store: ChunkStore,
    digest: Digest,
    manifest: Manifest,
    cache: NodeCache,
    options: &MountOptions,
) -> Result<Prepared, MountError> {
    let limits = &options.limits;
    limits.check_manifest(digest, &manifest)?;
    let tree =
        Tree::build(manifest).map_err(|reason| MountError::BadManifest { digest, reason })?;
    let fs =
        Arc::new(SealedFs::new(digest, tree, store, cache, options.readahead).with_limits(limits));
    fs.set_model_prefetch(options.prefetch.model());
    // A damaged copy of one of its files is fetched again for this mount (`crate::verify`).
    fs.cache()
        .integrity()
        .add_mount(&fs, tokio::runtime::Handle::current());
    if options.passthrough {
        // Copies found on disk are checked before a loader opens them, in its order.
        crate::verify::walk_mount(&fs);
    }
    let adapter = FuseAdapter::with_passthrough(
        fs.clone(),
        tokio::runtime::Handle::current(),
        options.passthrough,
        options.io_mode_record.as_deref(),
    );

    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
        MountOption::DefaultPermissions,
        MountOption::FSName(format!("sealed-{}", digest.hex())),
        MountOption::Subtype("sealed".into()),
    ];
    config.acl = if options.allow_other.unwrap_or_else(is_root) {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(options.threads.max(1));
    config.clone_fd = options.threads > 1 && !options.restartable;
    Ok(Prepared {
        fs,
        adapter,
        config,
    })
}

/// Mounts a prepared version at `mountpoint` and serves it.
async fn spawn_prepared(
    started: Instant,
    prepared: Prepared,
    mountpoint: &Path,
    options: MountOptions,
) -> Result<MountHandle, MountError> {
    let Prepared {
        fs,
        adapter,
        config,
    } = prepared;
    adapter.start_fresh();
    let mountpoint = mountpoint.to_path_buf();
    let mp = mountpoint.clone();
    let session = tokio::task::spawn_blocking(move || Session::new(adapter, &mp, &config))
        .await
        .map_err(|e| MountError::Mount {
            path: mountpoint.clone(),
            source: io::Error::other(e.to_string()),
        })?
        .map_err(|source| MountError::Mount {
            path: mountpoint.clone(),
            source,
        })?;
    let mut session = session;
    let unmounter = Unmounter::Session(session.unmount_callable());
    start(session, unmounter, fs, mountpoint, options, started, false).await
}

/// Serves a prepared version over the live FUSE connection `fuse` mounted at `mountpoint`.
async fn resume_prepared(
    started: Instant,
    prepared: Prepared,
    fuse: OwnedFd,
    mountpoint: &Path,
    options: MountOptions,
) -> Result<MountHandle, MountError> {
    let Prepared {
        fs,
        adapter,
        config,
    } = prepared;
    let mountpoint = mountpoint.to_path_buf();
    let mount_err = |source: io::Error| MountError::Mount {
        path: mountpoint.clone(),
        source,
    };
    adapter.inherit_io_modes();
    let session = crate::reattach::session_for_live_fd(adapter, fuse, config)
        .map_err(|e| mount_err(io::Error::new(e.kind(), format!("re-attaching: {e}"))))?;
    // Before any worker reads: requests the old server had taken join the pending queue.
    match crate::reattach::notify_resend(session.as_fd()) {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            "this kernel cannot resend requests the previous server took (needs Linux \
             6.9); reads that were in flight when it stopped stay unanswered"
        ),
        Err(e) => return Err(mount_err(io::Error::new(e.kind(), format!("resend: {e}")))),
    }
    let unmounter = Unmounter::Path(mountpoint.clone());
    start(session, unmounter, fs, mountpoint, options, started, true).await
}

/// Runs `session` in the background and returns its handle.
async fn start(
    session: Session<FuseAdapter>,
    unmounter: Unmounter,
    fs: Arc<SealedFs>,
    mountpoint: PathBuf,
    options: MountOptions,
    started: Instant,
    resumed: bool,
) -> Result<MountHandle, MountError> {
    let digest = fs.digest();
    let fuse = if options.restartable {
        Some(
            session
                .as_fd()
                .try_clone_to_owned()
                .map_err(|source| MountError::Mount {
                    path: mountpoint.clone(),
                    source,
                })?,
        )
    } else {
        None
    };
    // Before the first request is served, so that the recording sees the first read.
    let learned = (options.learned_prefetch && !resumed)
        .then(|| LearnedPrefetch::start(fs.clone(), options.profile_scope.clone()));
    let (tx, ended) = watch::channel(false);
    let thread = std::thread::Builder::new()
        .name("sealed-fuse".into())
        .spawn(move || {
            let result = session.run();
            let _ = tx.send(true);
            result
        })
        .map_err(|source| MountError::Mount {
            path: mountpoint.clone(),
            source,
        })?;
    let ready_in = started.elapsed();
    fs.cold_start().mark_ready(started);

    // Now that requests are served, look at the mount: its device names the kernel's
    // readahead knob and the FUSE connection.
    let mp = mountpoint.clone();
    let ra = options.kernel_readahead_kb;
    let device = tokio::task::spawn_blocking(move || {
        let dev = std::fs::metadata(&mp).ok()?.dev();
        if let Some(kb) = ra {
            set_kernel_readahead(dev, kb);
        }
        Some(dev)
    })
    .await
    .ok()
    .flatten();

    let prefetching = Prefetches::new(options.prefetch_concurrency);
    prefetching.add(&fs, &options.prefetch);
    tracing::info!(
        %digest,
        mountpoint = %mountpoint.display(),
        files = fs.tree().len(),
        bytes = fs.tree().total_bytes(),
        ready_ms = ready_in.as_millis() as u64,
        resumed,
        "mounted"
    );
    Ok(MountHandle {
        fs,
        mountpoint,
        unmounter: Some(unmounter),
        fuse,
        thread: Some(thread),
        ended,
        prefetch: prefetching,
        learned,
        device,
        ready_in,
    })
}

/// Unmounts `path` (`sealed umount`). `lazy` detaches it even while files are open. Without
/// root, falls back to `fusermount3 -u` / `fusermount -u` when one is installed.
pub fn unmount(path: &Path, lazy: bool) -> Result<(), MountError> {
    let err = |source| MountError::Unmount {
        path: path.to_path_buf(),
        source,
    };
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| err(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: c_path is a valid NUL-terminated string for the duration of the call.
    let rc = unsafe { libc::umount2(c_path.as_ptr(), flags) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        for tool in ["fusermount3", "fusermount"] {
            let mut cmd = std::process::Command::new(tool);
            cmd.arg("-u");
            if lazy {
                cmd.arg("-z");
            }
            if let Ok(status) = cmd.arg(path).status()
                && status.success()
            {
                return Ok(());
            }
        }
    }
    Err(err(e))
}

fn split_dev(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// Raises the kernel's readahead for the mount so that sequential reads arrive as large
/// requests (the FUSE default is 128 KiB). Best effort.
fn set_kernel_readahead(dev: u64, kb: u32) {
    let (major, minor) = split_dev(dev);
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&knob, kb.to_string()) {
        tracing::debug!(knob, error = %e, "cannot set kernel readahead");
    }
}

/// Aborts the FUSE connection of a detached mount so that nothing waits on it. Best effort
/// (needs the fusectl filesystem at /sys/fs/fuse/connections).
fn abort_connection(dev: u64) {
    let (major, minor) = split_dev(dev);
    let id = (major << 20) | minor;
    let knob = format!("/sys/fs/fuse/connections/{id}/abort");
    if let Err(e) = std::fs::write(&knob, "1") {
        tracing::debug!(knob, error = %e, "cannot abort FUSE connection");
    }
}
