//! One lock per digest: mounting, resuming and releasing a version's FUSE mount are ordered
//! per digest, so that the store I/O of one version (its manifest) never holds up another
//! version, or any unpublish.
//!
//! Lock order: a digest's lock before the driver's lock on its tables, never the reverse.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use sealed_store::Digest;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

#[derive(Default)]
pub struct DigestLocks {
    locks: Mutex<HashMap<Digest, Weak<AsyncMutex<()>>>>,
}

/// Held while a version is being mounted, resumed or released.
pub type DigestGuard = OwnedMutexGuard<()>;

impl DigestLocks {
    pub async fn lock(&self, digest: Digest) -> DigestGuard {
        self.lock_of(digest).lock_owned().await
    }

    /// The lock of `digest` if nobody holds it now (for tests of the lock's semantics).
    #[cfg(test)]
    fn try_lock(&self, digest: Digest) -> Option<DigestGuard> {
        self.lock_of(digest).try_lock_owned().ok()
    }

    fn lock_of(&self, digest: Digest) -> Arc<AsyncMutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        // Locks nobody holds or waits for are gone; forget their entries.
        locks.retain(|_, weak| weak.strong_count() > 0);
        if let Some(lock) = locks.get(&digest).and_then(Weak::upgrade) {
            return lock;
        }
        let lock = Arc::new(AsyncMutex::new(()));
        locks.insert(digest, Arc::downgrade(&lock));
        lock
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_per_digest_and_none_across_digests() {
        let locks = DigestLocks::default();
        let a = Digest::of(b"a");
        let b = Digest::of(b"b");
        let held = locks.lock(a).await;
        assert!(locks.try_lock(a).is_none());
        assert!(locks.try_lock(b).is_some());
        drop(held);
        assert!(locks.try_lock(a).is_some());
    }
}
