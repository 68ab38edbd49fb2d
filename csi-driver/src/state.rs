//! The node's driver state, apart from the gRPC layer: which versions are FUSE-mounted and
//! which target paths are bind-mounted onto them.
//!
//! One FUSE mount per digest per node, under `<state-dir>/mounts/<hex>`, shared by every
//! target through a read-only bind mount and reference counted by its targets. Publish and
//! unpublish are idempotent. One lock orders all changes, so concurrent publishes of the same
//! digest never mount it twice.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sealed_mount::{MountHandle, MountOptions, NodeCache};
use sealed_store::{ChunkStore, Digest, StoreOptions};
use tokio::sync::Mutex;

use crate::error::CsiError;
use crate::metrics::Metrics;
use crate::mounts;

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
}

/// A validated publish request.
#[derive(Clone, Debug)]
pub struct Publish {
    pub volume_id: String,
    pub digest: Digest,
    pub target: PathBuf,
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
}

impl Driver {
    pub fn new(
        config: DriverConfig,
        cache: NodeCache,
        mount_options: MountOptions,
    ) -> Result<Arc<Self>, prometheus::Error> {
        let metrics = Arc::new(Metrics::new(cache.metrics().clone())?);
        Ok(Arc::new(Driver {
            config,
            cache,
            mount_options,
            store: Mutex::new(None),
            mounts: Mutex::new(Mounts::default()),
            metrics,
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

    /// Prepares the state directory and unmounts what a previous run left behind.
    pub fn clean_stale(&self) -> Result<(), CsiError> {
        let dir = self.mounts_dir();
        std::fs::create_dir_all(&dir).map_err(|e| CsiError::io("creating", &dir, e))?;
        let entries = std::fs::read_dir(&dir).map_err(|e| CsiError::io("reading", &dir, e))?;
        for entry in entries.flatten() {
            let path = entry.path();
            if mounts::is_mount_point(&path) {
                tracing::warn!(path = %path.display(), "unmounting a FUSE mount left by an earlier run");
                let _ = sealed_mount::unmount(&path, true);
            }
            let _ = std::fs::remove_dir(&path);
        }
        Ok(())
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

    /// Mounts `digest` (once per node) and bind-mounts it read-only onto the target.
    pub async fn publish(&self, req: Publish) -> Result<(), CsiError> {
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
            },
        );
        Ok(())
    }

    /// Unmounts the target; the FUSE mount goes with its last target. A target that is not
    /// published (any more) is a success, as the spec asks.
    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), CsiError> {
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
        if let Err(e) = handle.unmount().await {
            tracing::warn!(%digest, error = %e, "unmounting the FUSE mount failed");
        }
        let _ = std::fs::remove_dir(&dir);
        tracing::info!(%digest, "FUSE mount released");
    }
}
