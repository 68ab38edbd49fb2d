//! The node disk cache: verified chunks as files named by their digest, shared by every mount
//! on the node, bounded in bytes with LRU eviction, and rebuilt from the directory when the
//! process restarts.
//!
//! ```text
//! <dir>/chunks/<2 hex>/<64 hex>   one verified chunk
//! <dir>/tmp/                      chunks being written (renamed into place when complete)
//! ```
//!
//! Space is reserved (evicting as needed) before a chunk is written, so the files under
//! `chunks/` and `tmp/` never add up to more than the bound. A file's mtime is its last use,
//! so the LRU order survives a restart. Every read is verified again: a chunk damaged on disk
//! is deleted and refetched, never served.
//!
//! Several processes may share a directory; each keeps its own index, so the bound then holds
//! per process. The CSI node plugin runs every mount in one process.

use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::Digest;

use crate::error::MountError;
use crate::lru::{Inserted, LruIndex};
use crate::metrics::MountMetrics;

pub struct DiskCache {
    dir: PathBuf,
    index: Mutex<LruIndex<()>>,
    metrics: Arc<MountMetrics>,
    tmp_seq: AtomicU64,
    /// Held for a whole `put`: an entry evicted while another thread was still writing it
    /// could otherwise land on disk after its eviction and push the files over the bound.
    writer: Mutex<()>,
}

impl DiskCache {
    /// Opens (creating if needed) the cache at `dir`, bounded by `capacity` bytes. Existing
    /// chunks are indexed by last use; any over the bound are evicted now.
    pub fn open(
        dir: &Path,
        capacity: u64,
        metrics: Arc<MountMetrics>,
    ) -> Result<DiskCache, MountError> {
        let err = |path: &Path, source| MountError::Cache {
            path: path.to_path_buf(),
            source,
        };
        let chunks = dir.join("chunks");
        let tmp = dir.join("tmp");
        fs::create_dir_all(&chunks).map_err(|e| err(&chunks, e))?;
        // Leftovers of writes a crash interrupted.
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| err(&tmp, e))?;
        }
        fs::create_dir_all(&tmp).map_err(|e| err(&tmp, e))?;

        let mut found: Vec<(SystemTime, Digest, u64)> = Vec::new();
        for shard in fs::read_dir(&chunks).map_err(|e| err(&chunks, e))? {
            let shard = shard.map_err(|e| err(&chunks, e))?.path();
            if !shard.is_dir() {
                continue;
            }
            for file in fs::read_dir(&shard).map_err(|e| err(&shard, e))? {
                let file = file.map_err(|e| err(&shard, e))?;
                let path = file.path();
                let digest = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| Digest::parse(n).ok());
                let Some(digest) = digest else {
                    // Not ours: leave it alone rather than delete an unknown file.
                    continue;
                };
                let Ok(meta) = file.metadata() else { continue };
                let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                found.push((used, digest, meta.len()));
            }
        }
        found.sort();
        let cache = DiskCache {
            dir: dir.to_path_buf(),
            index: Mutex::new(LruIndex::new(capacity)),
            metrics,
            tmp_seq: AtomicU64::new(0),
            writer: Mutex::new(()),
        };
        for (_, digest, len) in found {
            let outcome = cache.index.lock().insert(digest, (), len);
            match outcome {
                Inserted::Stored(evicted) => cache.delete(evicted.into_iter().map(|(d, ())| d)),
                Inserted::TooLarge => cache.delete([digest]),
                Inserted::Present => {}
            }
        }
        cache.publish();
        // One lock for both numbers: the index lock is not re-entrant.
        let (chunks, bytes) = {
            let index = cache.index.lock();
            (index.len(), index.bytes())
        };
        tracing::info!(dir = %dir.display(), chunks, bytes, capacity, "disk cache ready");
        Ok(cache)
    }

    fn chunk_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.hex();
        self.dir.join("chunks").join(&hex[..2]).join(hex)
    }

    fn publish(&self) {
        let bytes = self.index.lock().bytes();
        self.metrics
            .disk_cache_bytes
            .store(bytes, Ordering::Relaxed);
    }

    fn delete(&self, digests: impl IntoIterator<Item = Digest>) {
        for digest in digests {
            MountMetrics::inc(&self.metrics.disk_evictions);
            if let Err(e) = fs::remove_file(self.chunk_path(&digest))
                && e.kind() != ErrorKind::NotFound
            {
                tracing::warn!(%digest, error = %e, "cannot delete evicted chunk");
            }
        }
    }

    fn write(&self, digest: &Digest, data: &[u8]) -> std::io::Result<()> {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp =
            self.dir
                .join("tmp")
                .join(format!("{}-{}-{seq}", digest.hex(), std::process::id()));
        let result = (|| {
            let mut file = fs::File::create(&tmp)?;
            file.write_all(data)?;
            let path = self.chunk_path(digest);
            if let Some(shard) = path.parent() {
                fs::create_dir_all(shard)?;
            }
            fs::rename(&tmp, &path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// The chunk's bytes, verified again against `digest` (a file damaged on disk is deleted
    /// and `None`), or `None`. Blocking I/O.
    pub fn get(&self, digest: &Digest) -> Option<Bytes> {
        if !self.index.lock().contains(digest) {
            return None;
        }
        let path = self.chunk_path(digest);
        let data = match fs::read(&path) {
            Ok(data) => data,
            // Evicted, or still being written by the fetch that reserved it.
            Err(e) if e.kind() == ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read cached chunk");
                return None;
            }
        };
        if Digest::of(&data) != *digest {
            tracing::warn!(path = %path.display(), "cached chunk is corrupt on disk; deleting it");
            MountMetrics::inc(&self.metrics.verification_failures);
            self.index.lock().remove(digest);
            let _ = fs::remove_file(&path);
            self.publish();
            return None;
        }
        self.index.lock().get(digest);
        // The mtime records the last use so that LRU order survives a restart.
        if let Ok(file) = fs::File::options().write(true).open(&path) {
            let _ = file.set_modified(SystemTime::now());
        }
        Some(Bytes::from(data))
    }

    /// Keeps a chunk the caller has verified, evicting to stay within the bound. Blocking I/O.
    pub fn put(&self, digest: &Digest, data: &Bytes) {
        let _writer = self.writer.lock();
        let outcome = self.index.lock().insert(*digest, (), data.len() as u64);
        match outcome {
            Inserted::Present | Inserted::TooLarge => return,
            Inserted::Stored(evicted) => self.delete(evicted.into_iter().map(|(d, ())| d)),
        }
        if let Err(e) = self.write(digest, data) {
            tracing::warn!(%digest, error = %e, "cannot write chunk to the disk cache");
            self.index.lock().remove(digest);
        }
        self.publish();
    }

    pub fn contains(&self, digest: &Digest) -> bool {
        self.index.lock().contains(digest)
    }

    /// Bytes held now.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.index.lock().bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(i: u8, len: usize) -> (Digest, Bytes) {
        let data = Bytes::from(vec![i; len]);
        (Digest::of(&data), data)
    }

    fn du(dir: &Path) -> u64 {
        let mut total = 0;
        for sub in ["chunks", "tmp"] {
            let mut stack = vec![dir.join(sub)];
            while let Some(d) = stack.pop() {
                for e in fs::read_dir(d).unwrap() {
                    let e = e.unwrap();
                    if e.file_type().unwrap().is_dir() {
                        stack.push(e.path());
                    } else {
                        total += e.metadata().unwrap().len();
                    }
                }
            }
        }
        total
    }

    /// Opening with info logs on must not deadlock (the "ready" event once locked the index
    /// twice). Runs the open on a thread so a regression fails in seconds instead of hanging.
    #[test]
    fn open_with_info_logging_does_not_deadlock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let subscriber = tracing_subscriber::fmt()
                .with_max_level(tracing::Level::INFO)
                .with_test_writer()
                .finish();
            tracing::subscriber::with_default(subscriber, || {
                let metrics = Arc::new(MountMetrics::default());
                let cache = DiskCache::open(&path, 1000, metrics).unwrap();
                let (d, data) = chunk(1, 10);
                cache.put(&d, &data);
                drop(cache);
                let reopened = DiskCache::open(&path, 1000, Arc::new(MountMetrics::default()));
                let _ = tx.send(reopened.is_ok());
            });
        });
        let opened = rx.recv_timeout(std::time::Duration::from_secs(20));
        assert_eq!(
            opened,
            Ok(true),
            "DiskCache::open hung or failed with info logging on"
        );
    }

    #[test]
    fn bounded_and_survives_restart() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(MountMetrics::default());
        let cache = DiskCache::open(dir.path(), 250, metrics.clone()).unwrap();
        let chunks: Vec<_> = (0..5).map(|i| chunk(i, 100)).collect();
        for (d, data) in &chunks {
            cache.put(d, data);
            assert!(du(dir.path()) <= 250);
        }
        assert_eq!(cache.bytes(), 200);
        assert!(cache.get(&chunks[0].0).is_none());
        assert_eq!(cache.get(&chunks[4].0).unwrap(), chunks[4].1);
        drop(cache);

        let cache = DiskCache::open(dir.path(), 250, metrics.clone()).unwrap();
        assert_eq!(cache.bytes(), 200);
        assert_eq!(cache.get(&chunks[3].0).unwrap(), chunks[3].1);
        // A smaller bound on restart evicts the least recently used.
        drop(cache);
        let cache = DiskCache::open(dir.path(), 150, metrics).unwrap();
        assert_eq!(cache.bytes(), 100);
        assert!(du(dir.path()) <= 150);
    }

    #[test]
    fn corrupt_file_is_deleted_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(MountMetrics::default());
        let cache = DiskCache::open(dir.path(), 1000, metrics.clone()).unwrap();
        let (d, data) = chunk(7, 100);
        cache.put(&d, &data);
        fs::write(cache.chunk_path(&d), vec![8u8; 100]).unwrap();
        assert!(cache.get(&d).is_none());
        assert!(!cache.contains(&d));
        assert_eq!(metrics.snapshot().verification_failures, 1);
    }
}
