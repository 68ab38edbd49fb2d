//! The node's driver state, apart from the gRPC layer: which versions are FUSE-mounted and
//! which target paths are bind-mounted onto them.
//!
//! One FUSE mount per digest per node, under `<state-dir>/mounts/<hex>`, shared by every
//! target through a read-only bind mount and reference counted by its targets. Publish and
//! unpublish are idempotent.
//!
//! Two kinds of lock. The driver's tables (`mounts`) are locked only for local work (the
//! tables, bind mounts, unmounts), never across store I/O. A version's lock
//! (`digest_locks`) is held while it is mounted, resumed or released, store I/O included:
//! concurrent publishes of one digest fetch its manifest once and mount it once, and a
//! publish stuck on the store holds up only publishes of the same digest.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sealed_mount::{MountHandle, MountOptions, NodeCache};
use sealed_store::{ChunkStore, Digest, StoreOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::digest_locks::{DigestGuard, DigestLocks};
use crate::error::CsiError;
use crate::fd_holder::HolderClient;
use crate::manifest_cache::{self, FetchFailure, ManifestCache};
use crate::metrics::Metrics;
use crate::mounts;
use crate::store_access::{MountView, StoreSlot};
use crate::targets::TargetRules;

/// Default of [`DriverConfig::resume_deadline`].
pub const DEFAULT_RESUME_DEADLINE: Duration = Duration::from_secs(120);

/// Settings of the node plugin.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub node_id: String,
    pub state_dir: PathBuf,
    pub store_url: String,
    pub store_options: StoreOptions,
    /// Most volumes this node publishes (`NodeGetInfo.max_volumes_per_node`); 0: no limit.
    pub max_volumes: i64,
    /// No API server: no authorization or node-label checks.
    pub standalone: bool,
    /// The FUSE fd holder's socket: mounts survive restarts of the plugin (see `fd_holder`).
    pub fd_holder: Option<PathBuf>,
    /// kubelet's root directory: targets must be under `<kubelet-root>/pods` (see `targets`).
    pub kubelet_root: PathBuf,
    /// How long a restarted plugin keeps trying to resume a held mount whose manifest it
    /// has no copy of (the store is down), while that mount's readers wait; then it gives
    /// up and aborts the mount's connection, so they get an error.
    pub resume_deadline: Duration,
}

/// A validated publish request.
#[derive(Clone, Debug)]
pub struct Publish {
    pub volume_id: String,
    pub digest: Digest,
    pub target: PathBuf,
    /// The namespace of the pod it is for (empty in standalone mode), reported in the node
    /// publications Lease.
    pub namespace: String,
}

/// What a published volume looks like, for `NodeGetVolumeStats`.
#[derive(Clone, Copy, Debug)]
pub struct VolumeStats {
    pub bytes: u64,
    pub files: u64,
}

struct Publication {
    volume_id: String,
    digest: Digest,
    namespace: String,
}

/// A publication as written to `<state-dir>/publications/`, so that a restarted plugin knows
/// which target belongs to which volume and version.
#[derive(Debug, Serialize, Deserialize)]
struct PublicationRecord {
    volume_id: String,
    digest: String,
    target: PathBuf,
    /// Absent in records of plugins before the node publications Lease.
    #[serde(default)]
    namespace: String,
}

/// What [`Driver::recover`] found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    /// FUSE mounts whose fd the holder kept, being served again in the background.
    pub resuming: usize,
    /// Targets of an earlier run still mounted, known again.
    pub targets: usize,
    /// Mounts left by an earlier run without a held fd, detached.
    pub detached: usize,
}

/// A held mount to resume: its version, the holder's key, its directory.
struct Held {
    digest: Digest,
    key: String,
    dir: PathBuf,
}

struct VersionMount {
    handle: MountHandle,
    targets: BTreeSet<PathBuf>,
}

#[derive(Default)]
struct Mounts {
    versions: HashMap<Digest, VersionMount>,
    targets: HashMap<PathBuf, Publication>,
}

pub struct Driver {
    config: DriverConfig,
    cache: NodeCache,
    mount_options: MountOptions,
    store: Arc<StoreSlot>,
    manifests: ManifestCache,
    /// Never held across store I/O (see the module's comment).
    mounts: Mutex<Mounts>,
    digest_locks: DigestLocks,
    metrics: Arc<Metrics>,
    holder: Option<HolderClient>,
}

impl Driver {
    pub fn new(
        config: DriverConfig,
        cache: NodeCache,
        mut mount_options: MountOptions,
    ) -> Result<Arc<Self>, prometheus::Error> {
        let metrics = Arc::new(Metrics::new(cache.metrics().clone())?);
        let holder = config.fd_holder.as_ref().map(HolderClient::new);
        mount_options.restartable = holder.is_some();
        let store = StoreSlot::new(config.store_url.clone(), config.store_options.clone());
        let manifests = ManifestCache::new(&config.state_dir);
        Ok(Arc::new(Driver {
            config,
            cache,
            mount_options,
            store,
            manifests,
            mounts: Mutex::new(Mounts::default()),
            digest_locks: DigestLocks::default(),
            metrics,
            holder,
        }))
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn config(&self) -> &DriverConfig {
        &self.config
    }

    fn mounts_dir(&self) -> PathBuf {
        self.config.state_dir.join("mounts")
    }

    fn publications_dir(&self) -> PathBuf {
        self.config.state_dir.join("publications")
    }

    fn record_path(&self, target: &Path) -> PathBuf {
        let name = Digest::of(target.as_os_str().as_encoded_bytes()).hex();
        self.publications_dir().join(format!("{name}.json"))
    }

    /// Writes down a publication (atomically: temporary file, then rename).
    fn write_record(&self, target: &Path, volume_id: &str, digest: &Digest, namespace: &str) {
        let record = PublicationRecord {
            volume_id: volume_id.into(),
            digest: digest.to_string(),
            target: target.to_path_buf(),
            namespace: namespace.into(),
        };
        let path = self.record_path(target);
        let tmp = path.with_extension("tmp");
        let written = serde_json::to_vec(&record)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e,
                "cannot record the publication; a restarted plugin will not know this target");
        }
    }

    fn remove_record(&self, target: &Path) {
        let _ = std::fs::remove_file(self.record_path(target));
    }

    fn read_records(&self) -> Vec<PublicationRecord> {
        let Ok(entries) = std::fs::read_dir(self.publications_dir()) else {
            return Vec::new();
        };
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(record) => records.push(record),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "dropping an unreadable publication record");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        records
    }

    /// Takes over what a previous run of the plugin left, without the store and without
    /// waiting: the targets it published are known again, mounts nobody holds an fd of are
    /// detached, and the mounts whose fd the holder kept are resumed in the background
    /// (each under its version's lock, so a publish of that digest waits for it, while
    /// everything else is served at once). Pods reading a held mount only pause.
    pub async fn recover(self: &Arc<Self>) -> Result<Recovery, CsiError> {
        let mut report = Recovery::default();
        for dir in [
            self.config.state_dir.clone(),
            self.mounts_dir(),
            self.publications_dir(),
        ] {
            private_dir(&dir)?;
        }
        self.manifests.prepare()?;
        let records = self.read_records();
        let mut held = Vec::new();
        for entry in self.list_held().await {
            match self.check_held(&entry.key, &entry.digest) {
                // One mount per digest; a second entry for it would wait for its own lock.
                Ok(h) if held.iter().any(|o: &Held| o.digest == h.digest) => {
                    tracing::warn!(key = entry.key, "a second held fd for one digest; ignored");
                }
                Ok(h) => held.push(h),
                Err(why) => {
                    tracing::warn!(
                        key = entry.key,
                        digest = entry.digest,
                        why,
                        "not resuming a held mount"
                    );
                    self.drop_held(&entry.key).await;
                }
            }
        }
        let mut guards = Vec::with_capacity(held.len());
        for h in &held {
            guards.push(self.digest_locks.lock(h.digest).await);
        }
        {
            let mut mounts = self.mounts.lock().await;
            let live: BTreeSet<PathBuf> = mounts::mount_points().into_iter().collect();
            for record in records {
                let Ok(digest) = Digest::parse(&record.digest) else {
                    self.remove_record(&record.target);
                    continue;
                };
                if !live.contains(&mounts::absolute(&record.target)) {
                    self.remove_record(&record.target);
                    continue;
                }
                // Attached to its version once that is resumed; if it is not, kubelet's
                // unpublish takes the target down, and the record lets it match the volume id.
                report.targets += 1;
                mounts.targets.insert(
                    record.target,
                    Publication {
                        volume_id: record.volume_id,
                        digest,
                        namespace: record.namespace,
                    },
                );
            }
            self.metrics.set_counts(0, mounts.targets.len());
        }
        let keep: BTreeSet<PathBuf> = held.iter().map(|h| h.dir.clone()).collect();
        report.detached = self.clean_stale_except(&keep)?;
        self.manifests
            .retain(&held.iter().map(|h| h.digest).collect());
        report.resuming = held.len();
        tracing::info!(
            resuming = report.resuming,
            targets = report.targets,
            detached = report.detached,
            "took over the state of an earlier run; resuming its held mounts in the background"
        );
        for (h, guard) in held.into_iter().zip(guards) {
            let driver = self.clone();
            tokio::spawn(async move { driver.resume_held(h, guard).await });
        }
        Ok(report)
    }

    async fn list_held(&self) -> Vec<crate::fd_holder::HeldMount> {
        let Some(holder) = self.holder.clone() else {
            return Vec::new();
        };
        match tokio::task::spawn_blocking(move || holder.list()).await {
            Ok(Ok(held)) => held,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "fd holder not reachable: mounts of an earlier run cannot be resumed");
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(error = %e, "listing held fds failed");
                Vec::new()
            }
        }
    }

    /// The held mount at `key` if it is one of this plugin's and still mounted.
    fn check_held(&self, key: &str, digest: &str) -> Result<Held, &'static str> {
        let dir = PathBuf::from(key);
        let ours = dir.parent() == Some(self.mounts_dir().as_path());
        let digest = Digest::parse(digest)
            .ok()
            .filter(|d| ours && dir.ends_with(d.hex()))
            .ok_or("not a mount of this plugin")?;
        if !mounts::is_mount_point(&dir) {
            return Err("no longer mounted");
        }
        Ok(Held {
            digest,
            key: key.to_string(),
            dir,
        })
    }

    async fn drop_held(&self, key: &str) {
        if let Some(holder) = self.holder.clone() {
            let key = key.to_string();
            let _ = tokio::task::spawn_blocking(move || holder.drop_fd(&key)).await;
        }
    }

    /// Serves a held mount again, from the kept manifest (no store needed), else from the
    /// store's, tried until [`DriverConfig::resume_deadline`]. When it cannot be resumed,
    /// its connection is aborted (every fd of it closed) and it is detached, so that its
    /// readers get an error instead of waiting for ever.
    async fn resume_held(self: Arc<Self>, held: Held, _guard: DigestGuard) {
        let started = Instant::now();
        let Held { digest, key, dir } = held;
        let Some(holder) = self.holder.clone() else {
            return;
        };
        let fetched = {
            let key = key.clone();
            tokio::task::spawn_blocking(move || holder.get(&key)).await
        };
        let fd = match fetched {
            Ok(Ok(Some((_, fd)))) => fd,
            Ok(Ok(None)) => {
                // Nobody holds its fd any more: its connection has ended already.
                tracing::warn!(%digest, key, "the holder no longer has this mount; detaching it");
                self.abandon(&digest, &key, &dir, None).await;
                return;
            }
            Ok(Err(e)) => {
                tracing::error!(%digest, key, error = %e, "cannot take a held fd back");
                self.abandon(&digest, &key, &dir, None).await;
                return;
            }
            Err(e) => {
                tracing::error!(%digest, key, error = %e, "cannot take a held fd back");
                self.abandon(&digest, &key, &dir, None).await;
                return;
            }
        };
        let Some(manifest) = self.manifest_for_resume(&digest, started).await else {
            self.abandon(&digest, &key, &dir, Some(fd)).await;
            return;
        };
        let store = MountView::chunk_store(digest, manifest, self.store.clone());
        let resumed = MountHandle::resume(
            store,
            digest,
            fd,
            &dir,
            self.cache.clone(),
            self.mount_options.clone(),
        )
        .await;
        let handle = match resumed {
            Ok(handle) => handle,
            Err(e) => {
                tracing::error!(%digest, error = %e, "cannot resume the mount");
                self.abandon(&digest, &key, &dir, None).await;
                return;
            }
        };
        self.metrics.add_resumed(1);
        let mut mounts = self.mounts.lock().await;
        let live: BTreeSet<PathBuf> = mounts::mount_points().into_iter().collect();
        let targets: BTreeSet<PathBuf> = mounts
            .targets
            .iter()
            .filter(|(t, p)| p.digest == digest && live.contains(&mounts::absolute(t)))
            .map(|(t, _)| t.clone())
            .collect();
        tracing::info!(%digest, targets = targets.len(),
            took_ms = started.elapsed().as_millis() as u64, "resumed a held mount");
        if targets.is_empty() {
            // Its pods went while the plugin was down; nothing else would release it.
            self.unmount_version(digest, handle).await;
        } else {
            mounts
                .versions
                .insert(digest, VersionMount { handle, targets });
        }
        self.metrics
            .set_counts(mounts.versions.len(), mounts.targets.len());
    }

    /// The manifest of a held mount: the kept copy, else the store's (its normal key or the
    /// trash: a version deleted while mounted is still served to its pods), tried until
    /// the deadline.
    async fn manifest_for_resume(&self, digest: &Digest, started: Instant) -> Option<Bytes> {
        if let Some(bytes) = self.manifests.read(digest) {
            return Some(bytes);
        }
        tracing::warn!(%digest, "no kept manifest for a held mount (made by an older plugin?); asking the store");
        // Bounded by the flag's parser; a day at most here all the same, never an overflow.
        let deadline = started
            .checked_add(self.config.resume_deadline.min(Duration::from_secs(86_400)))
            .unwrap_or(started);
        let mut pause = Duration::from_millis(500);
        loop {
            let attempt = async {
                let store = self.store.get().await.map_err(|e| match e {
                    e @ sealed_store::Error::InvalidStoreUrl { .. } => FetchFailure::Answered(e),
                    other => FetchFailure::Unreachable(other),
                })?;
                manifest_cache::fetch(&store, digest, true).await
            };
            let why = match tokio::time::timeout_at(deadline, attempt).await {
                Ok(Ok(bytes)) => {
                    self.manifests.write(digest, &bytes);
                    return Some(bytes);
                }
                Ok(Err(FetchFailure::Answered(e))) => {
                    tracing::error!(%digest, error = %e, "the store has no manifest for a held mount");
                    return None;
                }
                Ok(Err(FetchFailure::Unreachable(e))) => e.to_string(),
                Err(_) => "no answer".to_string(),
            };
            if Instant::now() + pause >= deadline {
                tracing::error!(%digest, error = why, deadline_s = self.config.resume_deadline.as_secs(),
                    "store unreachable until the resume deadline: giving up on a held mount");
                return None;
            }
            tracing::warn!(%digest, error = why, "store unreachable; retrying the manifest of a held mount");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(10));
        }
    }

    /// Gives up on a held mount: closes every fd of its FUSE connection (ours and the
    /// holder's), which aborts it, so waiting and later reads fail (ENOTCONN) instead of
    /// hanging, and detaches it. Its targets stay until kubelet unpublishes them.
    async fn abandon(&self, digest: &Digest, key: &str, dir: &Path, fd: Option<OwnedFd>) {
        tracing::error!(%digest, dir = %dir.display(),
            "aborting a held mount that cannot be resumed: its readers get an error");
        drop(fd);
        self.drop_held(key).await;
        let dir = dir.to_path_buf();
        let _ = tokio::task::spawn_blocking(move || {
            let _ = sealed_mount::unmount(&dir, true);
            let _ = std::fs::remove_dir(&dir);
        })
        .await;
        self.manifests.remove(digest);
    }

    /// Puts every mount's fd with the holder again, if it lost them (it restarted), and
    /// counts the mounts it still does not have.
    pub async fn refresh_holder(&self) {
        let Some(holder) = self.holder.clone() else {
            return;
        };
        let listed = {
            let holder = holder.clone();
            tokio::task::spawn_blocking(move || holder.list()).await
        };
        let mounts = self.mounts.lock().await;
        let held: BTreeSet<String> = match listed {
            Ok(Ok(held)) => held.into_iter().map(|h| h.key).collect(),
            _ => {
                self.metrics.set_unprotected(mounts.versions.len());
                return;
            }
        };
        let mut unprotected = 0;
        for (digest, version) in &mounts.versions {
            let key = version.handle.mountpoint().display().to_string();
            if !held.contains(&key) {
                tracing::info!(%digest, "fd holder lost a mount's fd; putting it back");
                if !self.hold(&version.handle, digest).await {
                    unprotected += 1;
                }
            }
        }
        self.metrics.set_unprotected(unprotected);
    }

    /// Hands the holder a duplicate of the mount's FUSE fd; false when it could not.
    async fn hold(&self, handle: &MountHandle, digest: &Digest) -> bool {
        let Some(holder) = self.holder.clone() else {
            return false;
        };
        let key = handle.mountpoint().display().to_string();
        let digest_text = digest.to_string();
        let result = match handle.fuse_fd() {
            Ok(fd) => tokio::task::spawn_blocking(move || {
                holder
                    .put(&key, &digest_text, fd.as_fd())
                    .map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string())),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%digest, error = %e,
                    "the fd holder does not have this mount: a plugin restart would break it");
                false
            }
        }
    }

    /// Leaves every FUSE mount in place for the next run of the plugin to resume (with an fd
    /// holder), instead of unmounting at exit.
    pub async fn keep_mounts_for_restart(&self) -> usize {
        if self.holder.is_none() {
            return 0;
        }
        let mut mounts = self.mounts.lock().await;
        let n = mounts.versions.len();
        for (_, version) in mounts.versions.drain() {
            version.handle.keep_mounted();
        }
        n
    }

    /// Prepares the state directory and unmounts what a previous run left behind.
    pub fn clean_stale(&self) -> Result<(), CsiError> {
        self.clean_stale_except(&BTreeSet::new()).map(|_| ())
    }

    fn clean_stale_except(&self, keep: &BTreeSet<PathBuf>) -> Result<usize, CsiError> {
        let dir = self.mounts_dir();
        std::fs::create_dir_all(&dir).map_err(|e| CsiError::io("creating", &dir, e))?;
        let entries = std::fs::read_dir(&dir).map_err(|e| CsiError::io("reading", &dir, e))?;
        let mut detached = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            if keep.contains(&path) {
                continue;
            }
            if mounts::is_mount_point(&path) {
                tracing::warn!(path = %path.display(), "unmounting a FUSE mount left by an earlier run");
                let _ = sealed_mount::unmount(&path, true);
                detached += 1;
            }
            let _ = std::fs::remove_dir(&path);
        }
        Ok(detached)
    }

    /// The store, opened on first use: a store that is down when the plugin starts must not
    /// keep the plugin from serving, and must not be remembered as down.
    pub async fn store(&self) -> Result<ChunkStore, CsiError> {
        self.store.get().await.map_err(|e| match e {
            sealed_store::Error::InvalidStoreUrl { .. } => CsiError::Store(e),
            other => CsiError::StoreUnreachable {
                store: self.config.store_url.clone(),
                reason: other.to_string(),
            },
        })
    }

    /// `InvalidArgument` unless `target` is a place kubelet publishes volumes to (under
    /// `<kubelet-root>/pods`, outside the state directory; see `targets`).
    pub fn check_target(&self, target: &Path) -> Result<(), CsiError> {
        TargetRules::new(&self.config.kubelet_root, &self.config.state_dir).check(target)
    }

    /// What this node has published: (pod namespace, digest) of every target, sorted and
    /// without repeats, for the node publications Lease.
    pub async fn publications(&self) -> Vec<sealed_crds::publications::Publication> {
        let mounts = self.mounts.lock().await;
        let set: BTreeSet<sealed_crds::publications::Publication> = mounts
            .targets
            .values()
            .map(|p| sealed_crds::publications::Publication {
                namespace: p.namespace.clone(),
                digest: p.digest.to_string(),
            })
            .collect();
        set.into_iter().collect()
    }

    /// Mounts `digest` (once per node) and bind-mounts it read-only onto the target. A
    /// version not mounted yet is mounted under its own lock only: the driver's tables are
    /// free meanwhile, however long the store takes.
    pub async fn publish(&self, req: Publish) -> Result<(), CsiError> {
        self.check_target(&req.target)?;
        let _version = self.digest_locks.lock(req.digest).await;
        {
            let mut mounts = self.mounts.lock().await;
            if already_published(&mounts, &req)? {
                tracing::debug!(target = %req.target.display(), "already published");
                return Ok(());
            }
            self.replace_ended(&mut mounts, &req.digest).await;
            if mounts.versions.contains_key(&req.digest) {
                let result = self.bind_locked(&mut mounts, req, false).await;
                self.metrics
                    .set_counts(mounts.versions.len(), mounts.targets.len());
                return result;
            }
        }
        let handle = self.mount_version(&req.digest).await?;
        // Best effort: a mount the holder lacks is counted (and retried) by `refresh_holder`.
        self.hold(&handle, &req.digest).await;
        let mut mounts = self.mounts.lock().await;
        let result = match already_published(&mounts, &req) {
            Ok(false) => {
                mounts.versions.insert(
                    req.digest,
                    VersionMount {
                        handle,
                        targets: BTreeSet::new(),
                    },
                );
                self.bind_locked(&mut mounts, req, true).await
            }
            // The target was published meanwhile: the new mount has no target.
            other => {
                self.unmount_version(req.digest, handle).await;
                other.map(drop)
            }
        };
        self.metrics
            .set_counts(mounts.versions.len(), mounts.targets.len());
        result
    }

    /// A FUSE mount that someone else ended (umount by hand) is dropped, to be mounted again.
    async fn replace_ended(&self, mounts: &mut Mounts, digest: &Digest) {
        let ended = mounts
            .versions
            .get(digest)
            .is_some_and(|v| v.handle.has_ended());
        if ended && let Some(old) = mounts.versions.remove(digest) {
            tracing::warn!(%digest, "FUSE mount had ended; mounting again");
            let _ = old.handle.unmount().await;
        }
    }

    /// Bind-mounts the (mounted) version onto the target and records it. `mounted_here`:
    /// the version was mounted for this request, and goes again if the bind fails.
    async fn bind_locked(
        &self,
        mounts: &mut Mounts,
        req: Publish,
        mounted_here: bool,
    ) -> Result<(), CsiError> {
        let Some(version) = mounts.versions.get(&req.digest) else {
            return Err(CsiError::io(
                "bind-mounting",
                &req.target,
                std::io::Error::other("the version is not mounted"),
            ));
        };
        let source = version.handle.mountpoint().to_path_buf();
        // Written down before the bind, so that a crash right after it cannot leave a target
        // a restarted plugin does not know (a record without a mount is dropped at start).
        self.write_record(&req.target, &req.volume_id, &req.digest, &req.namespace);
        let target = req.target.clone();
        let bound =
            tokio::task::spawn_blocking(move || mounts::bind_read_only(&source, &target)).await;
        let bound = match bound {
            Ok(r) => r,
            Err(e) => Err(CsiError::io(
                "bind-mounting",
                &req.target,
                std::io::Error::other(e.to_string()),
            )),
        };
        if let Err(e) = bound {
            self.remove_record(&req.target);
            if mounted_here && let Some(v) = mounts.versions.remove(&req.digest) {
                self.unmount_version(req.digest, v.handle).await;
            }
            return Err(e);
        }
        if let Some(version) = mounts.versions.get_mut(&req.digest) {
            version.targets.insert(req.target.clone());
        }
        tracing::info!(
            volume_id = %req.volume_id,
            digest = %req.digest,
            target = %req.target.display(),
            "published"
        );
        mounts.targets.insert(
            req.target,
            Publication {
                volume_id: req.volume_id,
                digest: req.digest,
                namespace: req.namespace,
            },
        );
        Ok(())
    }

    /// Unmounts the target; the FUSE mount goes with its last target. A target that is not
    /// published (any more) is a success, as the spec asks. Never waits for the store: it
    /// takes only the driver's tables, which no store I/O holds.
    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), CsiError> {
        // Never unmount or remove anything outside kubelet's pod directories.
        self.check_target(target)?;
        let mut mounts = self.mounts.lock().await;
        let result = self.unpublish_locked(&mut mounts, volume_id, target).await;
        self.metrics
            .set_counts(mounts.versions.len(), mounts.targets.len());
        result
    }

    async fn unpublish_locked(
        &self,
        mounts: &mut Mounts,
        volume_id: &str,
        target: &Path,
    ) -> Result<(), CsiError> {
        let Some(publication) = mounts.targets.get(target) else {
            // Unknown here (already unpublished, or left by an earlier run): make sure
            // nothing stays mounted there and the directory is gone.
            let path = target.to_path_buf();
            tokio::task::spawn_blocking(move || mounts::unmount_target(&path, false))
                .await
                .map_err(|e| CsiError::io("unmounting", target, std::io::Error::other(e)))??;
            tracing::debug!(target = %target.display(), "not published; nothing to do");
            return Ok(());
        };
        if publication.volume_id != volume_id {
            return Err(CsiError::NotPublished {
                volume_id: volume_id.into(),
                path: target.to_path_buf(),
            });
        }
        let digest = publication.digest;
        let path = target.to_path_buf();
        tokio::task::spawn_blocking(move || mounts::unmount_target(&path, true))
            .await
            .map_err(|e| CsiError::io("unmounting", target, std::io::Error::other(e)))??;
        mounts.targets.remove(target);
        self.remove_record(target);
        let last = match mounts.versions.get_mut(&digest) {
            Some(v) => {
                v.targets.remove(target);
                v.targets.is_empty()
            }
            None => false,
        };
        if last && let Some(v) = mounts.versions.remove(&digest) {
            self.unmount_version(digest, v.handle).await;
        }
        tracing::info!(volume_id, %digest, target = %target.display(), last, "unpublished");
        Ok(())
    }

    /// Size of the version published at `path` under `volume_id`.
    pub async fn stats(&self, volume_id: &str, path: &Path) -> Result<VolumeStats, CsiError> {
        let mounts = self.mounts.lock().await;
        let not_found = || CsiError::NotPublished {
            volume_id: volume_id.into(),
            path: path.to_path_buf(),
        };
        let publication = mounts.targets.get(path).ok_or_else(not_found)?;
        if publication.volume_id != volume_id {
            return Err(not_found());
        }
        let version = mounts
            .versions
            .get(&publication.digest)
            .ok_or_else(not_found)?;
        let tree = version.handle.fs().tree();
        Ok(VolumeStats {
            bytes: tree.total_bytes(),
            files: tree.len() as u64,
        })
    }

    /// How many FUSE mounts and published targets this node has.
    pub async fn counts(&self) -> (usize, usize) {
        let mounts = self.mounts.lock().await;
        (mounts.versions.len(), mounts.targets.len())
    }

    /// Mounts `digest` from its kept manifest, else from the store's (fetched once, kept).
    /// The caller holds the version's lock.
    async fn mount_version(&self, digest: &Digest) -> Result<MountHandle, CsiError> {
        let manifest = match self.manifests.read(digest) {
            Some(bytes) => bytes,
            None => {
                let store = self.store().await?;
                // Not the trash: a deleted version is not mounted anew.
                let bytes =
                    manifest_cache::fetch(&store, digest, false)
                        .await
                        .map_err(|f| match f {
                            FetchFailure::Unreachable(e) => CsiError::StoreUnreachable {
                                store: self.config.store_url.clone(),
                                reason: e.to_string(),
                            },
                            FetchFailure::Answered(e) => CsiError::Store(e),
                        })?;
                self.manifests.write(digest, &bytes);
                bytes
            }
        };
        let dir = self.mounts_dir().join(digest.hex());
        if mounts::is_mount_point(&dir) {
            let _ = sealed_mount::unmount(&dir, true);
        }
        std::fs::create_dir_all(&dir).map_err(|e| CsiError::io("creating", &dir, e))?;
        let store = MountView::chunk_store(*digest, manifest, self.store.clone());
        let handle = MountHandle::spawn(
            store,
            *digest,
            &dir,
            self.cache.clone(),
            self.mount_options.clone(),
        )
        .await;
        handle.map_err(|e| {
            let _ = std::fs::remove_dir(&dir);
            self.manifests.remove(digest);
            CsiError::from(e)
        })
    }

    async fn unmount_version(&self, digest: Digest, handle: MountHandle) {
        let dir = handle.mountpoint().to_path_buf();
        if let Some(holder) = self.holder.clone() {
            let key = dir.display().to_string();
            let _ = tokio::task::spawn_blocking(move || holder.drop_fd(&key)).await;
        }
        if let Err(e) = handle.unmount().await {
            tracing::warn!(%digest, error = %e, "unmounting the FUSE mount failed");
        }
        let _ = std::fs::remove_dir(&dir);
        self.manifests.remove(&digest);
        tracing::info!(%digest, "FUSE mount released");
    }
}

/// Whether `req` is published already (true), or its target is free (false); a target
/// published for another volume or version is `TargetInUse`.
fn already_published(mounts: &Mounts, req: &Publish) -> Result<bool, CsiError> {
    match mounts.targets.get(&req.target) {
        None => Ok(false),
        Some(existing) if existing.volume_id == req.volume_id && existing.digest == req.digest => {
            Ok(true)
        }
        Some(existing) => Err(CsiError::TargetInUse {
            path: req.target.clone(),
            existing: format!("{} ({})", existing.volume_id, existing.digest),
            requested: format!("{} ({})", req.volume_id, req.digest),
        }),
    }
}

/// Creates `dir` (and its parents) with mode 0700, and sets 0700 on it if it exists with
/// another mode: the plugin's state and the node cache hold which versions the node mounts
/// and their bytes, which no other user on the node should read.
pub fn private_dir(dir: &Path) -> Result<(), CsiError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| CsiError::io("creating", dir, e))?;
    let meta = std::fs::metadata(dir).map_err(|e| CsiError::io("reading", dir, e))?;
    if meta.permissions().mode() & 0o7777 != 0o700 {
        tracing::info!(dir = %dir.display(), mode = format!("{:o}", meta.permissions().mode() & 0o7777),
            "setting mode 0700");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| CsiError::io("setting mode 0700 on", dir, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn private_dirs_are_0700_new_or_old() {
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("a/b/state");
        private_dir(&new).unwrap();
        assert_eq!(mode(&new), 0o700);
        let old = dir.path().join("cache");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(mode(&old), 0o755);
        private_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o700);
        // A file where the directory should be is an error, not a panic.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(private_dir(&file).is_err());
    }

    #[test]
    fn old_publication_records_read_without_a_namespace() {
        let r: PublicationRecord =
            serde_json::from_str(r#"{"volume_id":"v","digest":"blake3:00","target":"/t"}"#)
                .unwrap();
        assert_eq!(r.namespace, "");
    }
}
