//! The manifest of every version this node mounts, kept under `<state-dir>/manifests/<hex>`
//! so that a restarted plugin resumes its held mounts without the store.
//!
//! Files are written atomically (temporary file, fsync, rename, fsync of the directory),
//! mode 0600 in a 0700 directory. A copy is trusted only after it is checked again: its
//! BLAKE3 must be the digest, as the store checks what it fetches
//! (`ChunkStore::get_manifest_bytes`); a copy that fails is deleted.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use sealed_store::{ChunkStore, Digest};

use crate::error::CsiError;
use crate::state_dir;

pub struct ManifestCache {
    dir: PathBuf,
}

impl ManifestCache {
    pub fn new(state_dir: &Path) -> Self {
        ManifestCache {
            dir: state_dir.join("manifests"),
        }
    }

    /// Creates the directory (0700).
    pub fn prepare(&self) -> Result<(), CsiError> {
        state_dir::private_dir(&self.dir)
    }

    fn path(&self, digest: &Digest) -> PathBuf {
        self.dir.join(digest.hex())
    }

    /// The verified bytes of `digest`, if a good copy is here.
    pub fn read(&self, digest: &Digest) -> Option<Bytes> {
        let path = self.path(digest);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read a kept manifest");
                return None;
            }
        };
        let actual = Digest::of(&bytes);
        if actual != *digest {
            tracing::error!(path = %path.display(), %digest, %actual,
                "a kept manifest does not match its digest; deleting it");
            let _ = std::fs::remove_file(&path);
            return None;
        }
        Some(Bytes::from(bytes))
    }

    /// Keeps `bytes` (already verified against `digest`). Best effort: a failure only means
    /// that a restart during a store outage cannot resume this mount, so it is logged.
    pub fn write(&self, digest: &Digest, bytes: &[u8]) {
        let path = self.path(digest);
        if let Err(e) = state_dir::write_atomically(&path, bytes) {
            tracing::warn!(path = %path.display(), error = %e,
                "cannot keep the manifest; a plugin restart while the store is down would not resume this mount");
        }
    }

    pub fn remove(&self, digest: &Digest) {
        let _ = std::fs::remove_file(self.path(digest));
    }

    /// Deletes every kept manifest but those of `keep` (and leftover temporary files).
    pub fn retain(&self, keep: &BTreeSet<Digest>) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let kept = name
                .to_str()
                .and_then(|n| Digest::parse(n).ok())
                .is_some_and(|d| keep.contains(&d));
            if !kept {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// The verified manifest bytes of `digest` from the store: its normal key, else, with
/// `trash`, the trash (a version deleted while this node mounts it is still served to the
/// pods that have it; a new mount of it is refused). Errors are the store's, for
/// `CsiError::from_store`.
pub async fn fetch(
    store: &ChunkStore,
    digest: &Digest,
    trash: bool,
) -> Result<Bytes, sealed_store::Error> {
    match store.get_manifest_bytes(digest).await {
        Ok(bytes) => Ok(bytes),
        Err(missing @ sealed_store::Error::UnknownVersion { .. }) if trash => {
            match sealed_store::trash::read_trashed_manifest(store, digest).await {
                Ok(Some(bytes)) => {
                    tracing::info!(%digest, "manifest found in the trash");
                    Ok(bytes)
                }
                Ok(None) => Err(missing),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn kept_manifests_are_private_and_checked_when_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ManifestCache::new(dir.path());
        cache.prepare().unwrap();
        let bytes = b"manifest bytes".to_vec();
        let digest = Digest::of(&bytes);
        cache.write(&digest, &bytes);
        let path = cache.path(&digest);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(cache.read(&digest).as_deref(), Some(&bytes[..]));

        // A copy changed on disk is not trusted, and goes.
        std::fs::write(&path, b"manifest bytez").unwrap();
        assert_eq!(cache.read(&digest), None);
        assert!(!path.exists());

        let other = b"other".to_vec();
        let other_digest = Digest::of(&other);
        cache.write(&digest, &bytes);
        cache.write(&other_digest, &other);
        cache.retain(&BTreeSet::from([other_digest]));
        assert_eq!(cache.read(&digest), None);
        assert!(cache.read(&other_digest).is_some());
    }
}
