//! Publish and unpublish: the FUSE mount of a version (once per node) and the read-only
//! bind mounts of its targets, with their records. Both are idempotent, as the CSI spec asks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sealed_mount::cold_start::ColdStart;

use sealed_mount::{MountHandle, PrefetchSelection};
use sealed_store::Digest;
use sealed_store::prefetch_profile::ProfileScope;

use super::{Driver, Mounts, Publication, VersionMount};
use crate::error::CsiError;
use crate::manifest_cache;
use crate::mounts;
use crate::records::PublicationRecord;

/// A validated publish request.
#[derive(Clone, Debug)]
pub struct Publish {
    pub volume_id: String,
    pub digest: Digest,
    pub target: PathBuf,
    /// The namespace of the pod it is for (empty in standalone mode), reported in the node
    /// publications Lease.
    pub namespace: String,
    /// The volume's `prefetch` attribute, if set (else the plugin's `--prefetch`). Selections
    /// of the publishes of one version add up on its shared mount (docs/csi.md).
    pub prefetch: Option<PrefetchSelection>,
    /// The volume's `learnedPrefetch` attribute, if set (else the plugin's
    /// `--learned-prefetch`). The publish that makes a version's shared mount decides.
    pub learned_prefetch: Option<bool>,
    /// Whose readers the version's mount learns a prefetch profile from and replays one for
    /// (`<pod namespace>/<SealedVolume>`). The publish that makes the shared mount decides.
    pub profile_scope: ProfileScope,
}

/// What a published volume looks like, for `NodeGetVolumeStats`.
#[derive(Clone, Copy, Debug)]
pub struct VolumeStats {
    pub bytes: u64,
    pub files: u64,
}

impl Driver {
    /// Mounts `digest` (once per node) and bind-mounts it read-only onto the target. A
    /// version not mounted yet is mounted under its own lock only: the driver's tables are
    /// free meanwhile, however long the store takes. Returns the new mount's cold-start record
    /// when this call made the FUSE mount (`None` when the version was mounted already).
    pub async fn publish(&self, req: Publish) -> Result<Option<Arc<ColdStart>>, CsiError> {
        self.check_target(&req.target)?;
        let _version = self.digest_locks.lock(req.digest).await;
        {
            let mut mounts = self.mounts.lock().await;
            if already_published(&mounts, &req)? {
                tracing::debug!(target = %req.target.display(), "already published");
                return Ok(None);
            }
            self.replace_ended(&mut mounts, &req.digest).await;
            if let Some(version) = mounts.versions.get(&req.digest) {
                // The mount is shared: what this publish asks to prefetch is added to it.
                let selection = req
                    .prefetch
                    .as_ref()
                    .unwrap_or(&self.mount_options.prefetch);
                if version.handle.add_prefetch(selection) {
                    tracing::info!(digest = %req.digest, ?selection,
                        "prefetch added to the running mount");
                }
                let result = self.bind_locked(&mut mounts, req, false).await;
                self.count(&mounts);
                return result.map(|()| None);
            }
        }
        let handle = self.mount_version(&req.digest, &req).await?;
        let cold_start = handle.cold_start().clone();
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
                self.bind_locked(&mut mounts, req, true)
                    .await
                    .map(|()| Some(cold_start))
            }
            // The target was published meanwhile: the new mount has no target.
            other => {
                self.unmount_version(req.digest, handle).await;
                other.map(|_| None)
            }
        };
        self.count(&mounts);
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
        let record = PublicationRecord {
            volume_id: req.volume_id.clone(),
            digest: req.digest.to_string(),
            target: req.target.clone(),
            namespace: req.namespace.clone(),
        };
        if let Err(e) = self.records.save(&record) {
            tracing::warn!(error = %e,
                "cannot record the publication; a restarted plugin will not know this target");
        }
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
            self.records.delete(&req.target);
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
        self.count(&mounts);
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
            unmount_target(target, false).await?;
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
        unmount_target(target, true).await?;
        mounts.targets.remove(target);
        self.records.delete(target);
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

    /// Mounts `digest` from its kept manifest, else from the store's (fetched once, kept).
    /// The caller holds the version's lock.
    async fn mount_version(&self, digest: &Digest, req: &Publish) -> Result<MountHandle, CsiError> {
        let manifest = match self.manifests.read(digest) {
            Some(bytes) => bytes,
            None => {
                let store = self.store().await?;
                // Not the trash: a deleted version is not mounted anew.
                let bytes = manifest_cache::fetch(&store, digest, false)
                    .await
                    .map_err(|e| CsiError::from_store(&self.config.store_url, e))?;
                self.manifests.write(digest, &bytes);
                bytes
            }
        };
        let dir = self.mounts_dir().join(digest.hex());
        if mounts::is_mount_point(&dir) {
            let _ = sealed_mount::unmount(&dir, true);
        }
        std::fs::create_dir_all(&dir).map_err(|e| CsiError::io("creating", &dir, e))?;
        let mounted = async {
            let manifest = self.parse_manifest(digest, &manifest)?;
            let store = self.mount_store()?;
            let handle = MountHandle::spawn_with_manifest(
                store,
                *digest,
                manifest,
                &dir,
                self.cache.clone(),
                self.mount_options_with(digest, req),
            )
            .await?;
            Ok(handle)
        };
        mounted.await.inspect_err(|_| {
            let _ = std::fs::remove_dir(&dir);
            self.manifests.remove(digest);
        })
    }

    /// Unmounts a version's FUSE mount (its last target went) and forgets its fd and
    /// manifest.
    pub(super) async fn unmount_version(&self, digest: Digest, handle: MountHandle) {
        let dir = handle.mountpoint().to_path_buf();
        self.drop_held(&dir.display().to_string()).await;
        if let Err(e) = handle.unmount().await {
            tracing::warn!(%digest, error = %e, "unmounting the FUSE mount failed");
        }
        let _ = std::fs::remove_dir(&dir);
        self.manifests.remove(&digest);
        let _ = std::fs::remove_file(self.io_mode_record(&digest));
        tracing::info!(%digest, "FUSE mount released");
    }
}

/// Takes whatever is mounted at `target` off, off the async threads (see
/// `mounts::unmount_target`).
async fn unmount_target(target: &Path, ours: bool) -> Result<(), CsiError> {
    let path = target.to_path_buf();
    tokio::task::spawn_blocking(move || mounts::unmount_target(&path, ours))
        .await
        .map_err(|e| CsiError::io("unmounting", target, std::io::Error::other(e)))?
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
