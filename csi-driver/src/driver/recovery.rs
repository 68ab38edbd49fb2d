//! Restart safety: what a restarted plugin takes over from the last one, and the fd holder
//! that makes it possible (docs/csi.md, "Restart safety").
//!
//! While running, every FUSE mount's fd is put with the holder ([`Driver::hold`], retried by
//! [`Driver::refresh_holder`]). At exit the mounts are left in place
//! ([`Driver::keep_mounts_for_restart`]). At start, [`Driver::recover`] knows the published
//! targets again from their records, detaches mounts nobody holds, and resumes held ones in
//! the background from their kept manifests (the store only when there is none).

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sealed_mount::MountHandle;
use sealed_store::Digest;
use sealed_store::retry::RetryPolicy;
use tokio::time::Instant;

use super::{Driver, Publication, VersionMount};
use crate::digest_locks::DigestGuard;
use crate::error::{CsiError, store_unreachable};
use crate::holder::HeldMount;
use crate::manifest_cache;
use crate::mounts;
use crate::state_dir::private_dir;

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

impl Driver {
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
            self.records.dir().to_path_buf(),
        ] {
            private_dir(&dir)?;
        }
        self.manifests.prepare()?;
        let records = self.records.load_all();
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
                    self.records.delete(&record.target);
                    continue;
                };
                if !live.contains(&mounts::absolute(&record.target)) {
                    self.records.delete(&record.target);
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
            self.count(&mounts);
        }
        let keep: BTreeSet<PathBuf> = held.iter().map(|h| h.dir.clone()).collect();
        report.detached = self.detach_stale(&keep)?;
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

    async fn list_held(&self) -> Vec<HeldMount> {
        let Some(holder) = &self.holder else {
            return Vec::new();
        };
        match holder.list().await {
            Ok(held) => held,
            Err(e) => {
                tracing::warn!(error = %e, "fd holder not reachable: mounts of an earlier run cannot be resumed");
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

    /// Closes the holder's fd of the mount at `key` (best effort: a stale entry only keeps
    /// a dead connection open until the holder restarts).
    pub(super) async fn drop_held(&self, key: &str) {
        if let Some(holder) = &self.holder
            && let Err(e) = holder.drop_fd(key.to_string()).await
        {
            tracing::debug!(key, error = %e, "the fd holder did not drop an fd");
        }
    }

    /// Serves a held mount again, from the kept manifest (no store needed), else from the
    /// store's, tried until [`super::DriverConfig::resume_deadline`]. When it cannot be
    /// resumed, its connection is aborted (every fd of it closed) and it is detached, so
    /// that its readers get an error instead of waiting for ever.
    async fn resume_held(self: Arc<Self>, held: Held, _guard: DigestGuard) {
        let started = Instant::now();
        let Held { digest, key, dir } = held;
        let Some(holder) = &self.holder else {
            return;
        };
        let fd = match holder.get(key.clone()).await {
            Ok(Some((_, fd))) => fd,
            Ok(None) => {
                // Nobody holds its fd any more: its connection has ended already.
                tracing::warn!(%digest, key, "the holder no longer has this mount; detaching it");
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
        let prepared = self
            .parse_manifest(&digest, &manifest)
            .and_then(|manifest| Ok((manifest, self.mount_store()?)));
        let (manifest, store) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => {
                tracing::error!(%digest, error = %e, "cannot resume the mount");
                self.abandon(&digest, &key, &dir, Some(fd)).await;
                return;
            }
        };
        let resumed = MountHandle::resume_with_manifest(
            store,
            digest,
            manifest,
            fd,
            &dir,
            self.cache.clone(),
            self.mount_options_for(&digest),
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
        self.count(&mounts);
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
        // Jittered: the plugins of a fleet whose store went away do not come back in lockstep.
        let mut pauses =
            RetryPolicy::new(Duration::from_millis(500), Duration::from_secs(10)).schedule();
        loop {
            let attempt = async {
                let store = self.store.get().await?;
                manifest_cache::fetch(&store, digest, true).await
            };
            let why = match tokio::time::timeout_at(deadline, attempt).await {
                Ok(Ok(bytes)) => {
                    self.manifests.write(digest, &bytes);
                    return Some(bytes);
                }
                Ok(Err(e)) if store_unreachable(&e) => e.to_string(),
                Ok(Err(e)) => {
                    tracing::error!(%digest, error = %e, "the store has no manifest for a held mount");
                    return None;
                }
                Err(_) => "no answer".to_string(),
            };
            let pause = pauses.next_delay();
            if Instant::now() + pause >= deadline {
                tracing::error!(%digest, error = why, deadline_s = self.config.resume_deadline.as_secs(),
                    "store unreachable until the resume deadline: giving up on a held mount");
                return None;
            }
            tracing::warn!(%digest, error = why, "store unreachable; retrying the manifest of a held mount");
            tokio::time::sleep(pause).await;
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
        let Some(holder) = &self.holder else {
            return;
        };
        let listed = holder.list().await;
        let mounts = self.mounts.lock().await;
        let held: BTreeSet<String> = match listed {
            Ok(held) => held.into_iter().map(|h| h.key).collect(),
            Err(_) => {
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
    pub(super) async fn hold(&self, handle: &MountHandle, digest: &Digest) -> bool {
        let Some(holder) = &self.holder else {
            return false;
        };
        let key = handle.mountpoint().display().to_string();
        let result = match handle.fuse_fd() {
            Ok(fd) => holder
                .put(key, digest.to_string(), fd)
                .await
                .map_err(|e| e.to_string()),
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

    /// Unmounts (detaches) the FUSE mounts an earlier run left under `<state-dir>/mounts`,
    /// but those in `keep`, and removes their directories; how many it detached.
    fn detach_stale(&self, keep: &BTreeSet<PathBuf>) -> Result<usize, CsiError> {
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
}
