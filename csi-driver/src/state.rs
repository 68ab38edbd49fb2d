//! The node's driver state, apart from the gRPC layer: which versions are FUSE-mounted and
//! which target paths are bind-mounted onto them.
//!
//! One FUSE mount per digest per node, under `<state-dir>/mounts/<hex>`, shared by every
//! target through a read-only bind mount and reference counted by its targets. Publish and
//! unpublish are idempotent. One lock orders all changes, so concurrent publishes of the same
//! digest never mount it twice.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sealed_mount::{MountHandle, MountOptions, NodeCache};
use sealed_store::{ChunkStore, Digest, StoreOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::error::CsiError;
use crate::fd_holder::HolderClient;
use crate::metrics::Metrics;
use crate::mounts;
use crate::targets::TargetRules;

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
    /// FUSE mounts served again through the fd the holder kept.
    pub resumed: usize,
    /// Targets of those mounts, published again.
    pub targets: usize,
    /// Mounts left by an earlier run that could not be resumed and were detached.
    pub detached: usize,
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
    store: Mutex<Option<ChunkStore>>,
    mounts: Mutex<Mounts>,
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
        Ok(Arc::new(Driver {
            config,
            cache,
            mount_options,
            store: Mutex::new(None),
            mounts: Mutex::new(Mounts::default()),
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

    /// Takes over what a previous run of the plugin left: FUSE mounts whose fd the holder
    /// kept are served again (pods reading them only paused) together with their targets;
    /// every other leftover mount is detached, as [`Driver::clean_stale`] does.
    pub async fn recover(&self) -> Result<Recovery, CsiError> {
        let mut report = Recovery::default();
        for dir in [
            self.config.state_dir.clone(),
            self.mounts_dir(),
            self.publications_dir(),
        ] {
            private_dir(&dir)?;
        }
        let records = self.read_records();
        let mut mounts = self.mounts.lock().await;
        if let Some(holder) = self.holder.clone() {
            let held = tokio::task::spawn_blocking(move || holder.list())
                .await
                .map_err(|e| CsiError::io("listing held fds", "", std::io::Error::other(e)))?;
            match held {
                Ok(held) => {
                    for entry in held {
                        if self
                            .resume_held(&mut mounts, &entry.key, &entry.digest)
                            .await
                        {
                            report.resumed += 1;
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e,
                    "fd holder not reachable: mounts of an earlier run cannot be resumed"),
            }
        }
        for record in records {
            let Ok(digest) = Digest::parse(&record.digest) else {
                self.remove_record(&record.target);
                continue;
            };
            let live = mounts::is_mount_point(&record.target);
            match mounts.versions.get_mut(&digest) {
                Some(version) if live => {
                    version.targets.insert(record.target.clone());
                    report.targets += 1;
                }
                _ if !live => {
                    self.remove_record(&record.target);
                    continue;
                }
                // Mounted onto a version that could not be resumed: kubelet's unpublish will
                // take it down; the record lets it match the volume id.
                _ => {}
            }
            mounts.targets.insert(
                record.target,
                Publication {
                    volume_id: record.volume_id,
                    digest,
                    namespace: record.namespace,
                },
            );
        }
        // A resumed version no target uses any more (its pods went while the plugin was
        // down) is released now; nothing else would.
        let unused: Vec<Digest> = mounts
            .versions
            .iter()
            .filter(|(_, v)| v.targets.is_empty())
            .map(|(d, _)| *d)
            .collect();
        for digest in unused {
            if let Some(v) = mounts.versions.remove(&digest) {
                self.unmount_version(digest, v.handle).await;
            }
        }
        let keep: BTreeSet<PathBuf> = mounts
            .versions
            .values()
            .map(|v| v.handle.mountpoint().to_path_buf())
            .collect();
        report.detached = self.clean_stale_except(&keep)?;
        self.metrics
            .set_counts(mounts.versions.len(), mounts.targets.len());
        self.metrics.add_resumed(report.resumed);
        tracing::info!(
            resumed = report.resumed,
            targets = report.targets,
            detached = report.detached,
            "recovered the mounts of an earlier run"
        );
        Ok(report)
    }

    /// Serves the held mount at `key` again; false (and the fd released) when it cannot be.
    async fn resume_held(&self, mounts: &mut Mounts, key: &str, digest: &str) -> bool {
        let Some(holder) = self.holder.clone() else {
            return false;
        };
        let dir = PathBuf::from(key);
        let ours = dir.parent() == Some(self.mounts_dir().as_path());
        let parsed = Digest::parse(digest).ok();
        let release = |why: &str| {
            tracing::warn!(key, digest, why, "not resuming a held mount");
            let holder = holder.clone();
            let key = key.to_string();
            async move {
                let _ = tokio::task::spawn_blocking(move || holder.drop_fd(&key)).await;
            }
        };
        let Some(digest) = parsed.filter(|d| ours && dir.ends_with(d.hex())) else {
            release("not a mount of this plugin").await;
            return false;
        };
        if !mounts::is_mount_point(&dir) {
            release("no longer mounted").await;
            return false;
        }
        let key_owned = key.to_string();
        let fetched = {
            let holder = holder.clone();
            tokio::task::spawn_blocking(move || holder.get(&key_owned)).await
        };
        let fd = match fetched {
            Ok(Ok(Some((_, fd)))) => fd,
            Ok(Ok(None)) => return false,
            Ok(Err(e)) => {
                tracing::warn!(key, error = %e, "cannot take a held fd back");
                return false;
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "cannot take a held fd back");
                return false;
            }
        };
        // The store holds the manifest the mount is rebuilt from; give it a moment to be
        // reachable (a node restarting everything at once), since reads wait meanwhile.
        let mut store = self.store().await;
        for _ in 0..10 {
            if store.is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            store = self.store().await;
        }
        let store = match store {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(%digest, error = %e, "store unreachable: cannot resume the mount");
                return false;
            }
        };
        let resumed = MountHandle::resume(
            store,
            digest,
            fd,
            &dir,
            self.cache.clone(),
            self.mount_options.clone(),
        )
        .await;
        match resumed {
            Ok(handle) => {
                mounts.versions.insert(
                    digest,
                    VersionMount {
                        handle,
                        targets: BTreeSet::new(),
                    },
                );
                true
            }
            Err(e) => {
                tracing::error!(%digest, error = %e, "cannot resume the mount");
                false
            }
        }
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
        let mut slot = self.store.lock().await;
        if let Some(store) = &*slot {
            return Ok(store.clone());
        }
        let store = ChunkStore::open(&self.config.store_url, &self.config.store_options)
            .await
            .map_err(|e| match e {
                sealed_store::Error::InvalidStoreUrl { .. } => CsiError::Store(e),
                other => CsiError::StoreUnreachable {
                    store: self.config.store_url.clone(),
                    reason: other.to_string(),
                },
            })?;
        *slot = Some(store.clone());
        Ok(store)
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

    /// Mounts `digest` (once per node) and bind-mounts it read-only onto the target.
    pub async fn publish(&self, req: Publish) -> Result<(), CsiError> {
        self.check_target(&req.target)?;
        let mut mounts = self.mounts.lock().await;
        let result = self.publish_locked(&mut mounts, req).await;
        self.metrics
            .set_counts(mounts.versions.len(), mounts.targets.len());
        result
    }

    async fn publish_locked(&self, mounts: &mut Mounts, req: Publish) -> Result<(), CsiError> {
        if let Some(existing) = mounts.targets.get(&req.target) {
            if existing.volume_id == req.volume_id && existing.digest == req.digest {
                tracing::debug!(target = %req.target.display(), "already published");
                return Ok(());
            }
            return Err(CsiError::TargetInUse {
                path: req.target.clone(),
                existing: format!("{} ({})", existing.volume_id, existing.digest),
                requested: format!("{} ({})", req.volume_id, req.digest),
            });
        }

        // A FUSE mount that someone else ended (umount by hand) is replaced.
        let ended = mounts
            .versions
            .get(&req.digest)
            .is_some_and(|v| v.handle.has_ended());
        if ended && let Some(old) = mounts.versions.remove(&req.digest) {
            tracing::warn!(digest = %req.digest, "FUSE mount had ended; mounting again");
            let _ = old.handle.unmount().await;
        }
        let mounted_here = !mounts.versions.contains_key(&req.digest);
        if mounted_here {
            let handle = self.mount_version(&req.digest).await?;
            // Best effort: a mount the holder lacks is counted (and retried) by
            // `refresh_holder`.
            self.hold(&handle, &req.digest).await;
            mounts.versions.insert(
                req.digest,
                VersionMount {
                    handle,
                    targets: BTreeSet::new(),
                },
            );
        }
        let source = mounts.versions[&req.digest]
            .handle
            .mountpoint()
            .to_path_buf();
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
        mounts
            .versions
            .get_mut(&req.digest)
            .expect("mounted above")
            .targets
            .insert(req.target.clone());
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
    /// published (any more) is a success, as the spec asks.
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

    async fn mount_version(&self, digest: &Digest) -> Result<MountHandle, CsiError> {
        let store = self.store().await?;
        let dir = self.mounts_dir().join(digest.hex());
        if mounts::is_mount_point(&dir) {
            let _ = sealed_mount::unmount(&dir, true);
        }
        std::fs::create_dir_all(&dir).map_err(|e| CsiError::io("creating", &dir, e))?;
        let handle = MountHandle::spawn(
            store,
            *digest,
            &dir,
            self.cache.clone(),
            self.mount_options.clone(),
        )
        .await;
        match handle {
            Ok(h) => Ok(h),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                Err(match e {
                    sealed_mount::MountError::Store(
                        s @ (sealed_store::Error::Backend { .. }
                        | sealed_store::Error::Timeout { .. }),
                    ) => CsiError::StoreUnreachable {
                        store: self.config.store_url.clone(),
                        reason: s.to_string(),
                    },
                    other => other.into(),
                })
            }
        }
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
        tracing::info!(%digest, "FUSE mount released");
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
