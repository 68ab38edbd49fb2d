//! The node disk cache: verified chunks as files named by their digest, and *hydrated files*
//! (whole files assembled from verified chunks, named by the file's BLAKE3), shared by every
//! mount on the node, bounded in bytes together with LRU eviction, and rebuilt from the
//! directory when the process restarts.
//!
//! ```text
//! <dir>/chunks/<2 hex>/<64 hex>   one verified chunk
//! <dir>/files/<2 hex>/<64 hex>    one whole file, checked against its BLAKE3 when assembled
//! <dir>/tmp/                      chunks and files being written (renamed into place when complete)
//! ```
//!
//! An assembled file *is* the cache of its chunks: once it is in place, the chunk files it was
//! assembled from are deleted and those chunks are read from the file (at their offset,
//! verified again), so no byte is held twice. Chunks and files share one byte bound and one
//! LRU order. An entry can be pinned (a file served by FUSE passthrough while it is open):
//! eviction skips pinned entries.
//!
//! Space is reserved (evicting as needed) before a chunk or file is written, so the files
//! under `chunks/`, `files/` and `tmp/` never add up to more than the bound. A file's mtime is
//! its last use, so the LRU order survives a restart. Every chunk read is verified again: a
//! chunk damaged on disk is deleted and refetched, never served.
//!
//! What the kernel serves without the daemon (a whole file's copy, by FUSE passthrough) must
//! be trusted as a whole: an entry is *verified* once this process wrote it from verified
//! bytes or hashed it against its name ([`DiskCache::check`]). Entries found on disk at
//! [`DiskCache::open`] are not, until then (`crate::verify`). Directories are 0700 and files
//! 0600: the cache holds the bytes of every version the node mounted.
//!
//! Several processes may share a directory; each keeps its own index, so the bound then holds
//! per process. The CSI node plugin runs every mount in one process.

use std::collections::HashMap;
use std::fs;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::{Digest, FileEntry};

use crate::error::MountError;
use crate::lru::{Inserted, LruIndex};
use crate::metrics::MountMetrics;

#[path = "free_space.rs"]
mod free_space;

/// What the disk cache holds: a chunk by its digest, or a whole file by its BLAKE3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    Chunk(Digest),
    File(Digest),
}

/// An entry of the index. A file is `ready` once assembled, verified and renamed into place;
/// before that its bytes are reserved but nothing is served from it. `verified`: this process
/// wrote the entry from verified bytes, or hashed it since and it matched its name.
#[derive(Clone, Copy, Debug)]
enum Held {
    Chunk { verified: bool },
    File { ready: bool, verified: bool },
}

impl Held {
    fn verified(&self) -> bool {
        match self {
            Held::Chunk { verified } => *verified,
            Held::File { ready, verified } => *ready && *verified,
        }
    }
}

/// A complete copy of one file on disk: its assembled file, or its only chunk's file.
#[derive(Clone, Debug)]
pub struct WholeFile {
    pub path: PathBuf,
    /// The entry to pin while the copy is in use.
    pub key: Key,
    /// Checked by this process; only such a copy may be served without the daemon.
    pub verified: bool,
}

/// What [`DiskCache::check`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    /// The bytes match the entry's name (this many); the entry is verified now.
    Good(u64),
    /// They do not, or cannot be read: the entry was dropped and counted.
    Bad,
    /// Not in the cache (evicted, or being written).
    Gone,
}

/// How [`DiskCache::check`] reads: as fast as the machine allows (every core, through the
/// page cache, which the reader about to open the file then uses), or paced for the
/// background scrub (one thread, around the page cache, `pace(bytes)` after every block).
pub enum Hashing<'a> {
    Fast,
    Paced(&'a mut dyn FnMut(u64)),
}

/// The scrub's read size, and the alignment `O_DIRECT` needs.
const SCRUB_BLOCK: usize = 1 << 20;
const DIRECT_ALIGN: usize = 4096;
/// Below this a copy is read, not mapped (and a mapping of an empty file fails).
const FAST_MIN_MAP: u64 = 1 << 20;

/// Where a chunk held inside an assembled file is.
#[derive(Clone, Copy, Debug)]
struct Located {
    file: Digest,
    offset: u64,
    len: u32,
}

pub struct DiskCache {
    dir: PathBuf,
    index: Mutex<LruIndex<Key, Held>>,
    metrics: Arc<MountMetrics>,
    tmp_seq: AtomicU64,
    /// Held for a whole `put`: an entry evicted while another thread was still writing it
    /// could otherwise land on disk after its eviction and push the files over the bound.
    writer: Mutex<()>,
    /// Chunks read from assembled files, filled when a mount registers a file that is
    /// assembled (the chunk lists are the manifests', not on disk).
    located: Mutex<HashMap<Digest, Located>>,
    /// Entries eviction must skip, with how many holders each has.
    pins: Mutex<HashMap<Key, u32>>,
    /// Keeps a share of the filesystem free (`free_space.rs`).
    free_space: free_space::FreeSpaceGuard,
}

impl DiskCache {
    /// Opens (creating if needed) the cache at `dir`, bounded by `capacity` bytes. Existing
    /// chunks and files are indexed by last use; any over the bound are evicted now.
    pub fn open(
        dir: &Path,
        capacity: u64,
        metrics: Arc<MountMetrics>,
    ) -> Result<DiskCache, MountError> {
        let err = |path: &Path, source| MountError::Cache {
            path: path.to_path_buf(),
            source,
        };
        let tmp = dir.join("tmp");
        for sub in ["chunks", "files"] {
            let path = dir.join(sub);
            private_dir(&path).map_err(|e| err(&path, e))?;
        }
        // Leftovers of writes a crash interrupted.
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| err(&tmp, e))?;
        }
        private_dir(&tmp).map_err(|e| err(&tmp, e))?;

        let mut found: Vec<(SystemTime, Key, u64)> = Vec::new();
        for (sub, key) in [
            ("chunks", Key::Chunk as fn(Digest) -> Key),
            ("files", Key::File),
        ] {
            let top = dir.join(sub);
            for shard in fs::read_dir(&top).map_err(|e| err(&top, e))? {
                let shard = shard.map_err(|e| err(&top, e))?.path();
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
                    found.push((used, key(digest), meta.len()));
                }
            }
        }
        found.sort_by_key(|(used, _, _)| *used);
        let cache = DiskCache {
            dir: dir.to_path_buf(),
            index: Mutex::new(LruIndex::new(capacity)),
            metrics,
            tmp_seq: AtomicU64::new(0),
            writer: Mutex::new(()),
            located: Mutex::new(HashMap::new()),
            pins: Mutex::new(HashMap::new()),
            free_space: Default::default(),
        };
        for (_, key, len) in found {
            // Found, not verified: nothing is served from them as a whole until checked.
            let held = match key {
                Key::Chunk(_) => Held::Chunk { verified: false },
                Key::File(_) => Held::File {
                    ready: true,
                    verified: false,
                },
            };
            let outcome = cache.index.lock().insert(key, held, len);
            match outcome {
                Inserted::Stored(evicted) => cache.delete(evicted.into_iter().map(|(k, _)| k)),
                Inserted::TooLarge => cache.delete([key]),
                Inserted::Present => {}
            }
        }
        cache.publish();
        // One lock for both numbers: the index lock is not re-entrant.
        let (entries, bytes) = {
            let index = cache.index.lock();
            (index.len(), index.bytes())
        };
        tracing::info!(dir = %dir.display(), entries, bytes, capacity, "disk cache ready");
        Ok(cache)
    }

    fn chunk_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.hex();
        self.dir.join("chunks").join(&hex[..2]).join(hex)
    }

    fn file_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.hex();
        self.dir.join("files").join(&hex[..2]).join(hex)
    }

    fn path(&self, key: &Key) -> PathBuf {
        match key {
            Key::Chunk(d) => self.chunk_path(d),
            Key::File(d) => self.file_path(d),
        }
    }

    fn tmp_path(&self, digest: &Digest) -> PathBuf {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        self.dir
            .join("tmp")
            .join(format!("{}-{}-{seq}", digest.hex(), std::process::id()))
    }

    fn publish(&self) {
        let bytes = self.index.lock().bytes();
        self.metrics
            .disk_cache_bytes
            .store(bytes, Ordering::Relaxed);
    }

    fn delete(&self, keys: impl IntoIterator<Item = Key>) {
        for key in keys {
            MountMetrics::inc(&self.metrics.disk_evictions);
            if let Key::File(file) = key {
                self.located.lock().retain(|_, at| at.file != file);
            }
            if let Err(e) = fs::remove_file(self.path(&key))
                && e.kind() != ErrorKind::NotFound
            {
                tracing::warn!(?key, error = %e, "cannot delete evicted cache entry");
            }
        }
    }

    /// Inserts `key`, evicting unpinned entries to make room; false if there is no room.
    fn reserve(&self, key: Key, held: Held, len: u64) -> Result<bool, ()> {
        self.reserve_sparing(key, held, len, None)
    }

    /// [`DiskCache::reserve`], evicting only entries unused for `spare_recent` if given.
    fn reserve_sparing(
        &self,
        key: Key,
        held: Held,
        len: u64,
        spare_recent: Option<Duration>,
    ) -> Result<bool, ()> {
        if !self.free_space_for(key, len, spare_recent) {
            return Ok(false);
        }
        let outcome = {
            let mut index = self.index.lock();
            let pins = self.pins.lock();
            index.insert_sparing(key, held, len, |k, used| {
                pins.contains_key(k) || spare_recent.is_some_and(|w| used.elapsed() < w)
            })
        };
        match outcome {
            Inserted::Present => Err(()),
            Inserted::TooLarge => Ok(false),
            Inserted::Stored(evicted) => {
                self.delete(evicted.into_iter().map(|(k, _)| k));
                Ok(true)
            }
        }
    }

    fn write(&self, digest: &Digest, data: &[u8]) -> std::io::Result<()> {
        let tmp = self.tmp_path(digest);
        let result = (|| {
            let mut file = create_private(&tmp)?;
            file.write_all(data)?;
            let path = self.chunk_path(digest);
            if let Some(shard) = path.parent() {
                private_dir(shard)?;
            }
            fs::rename(&tmp, &path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// The chunk's bytes, verified again against `digest` (a file damaged on disk is deleted
    /// and `None`), or `None`. From its own file, or from the assembled file that holds it.
    /// Blocking I/O.
    pub fn get(&self, digest: &Digest) -> Option<Bytes> {
        if !self.index.lock().contains(&Key::Chunk(*digest)) {
            return self.get_located(digest);
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
            self.index.lock().remove(&Key::Chunk(*digest));
            let _ = fs::remove_file(&path);
            self.publish();
            return None;
        }
        {
            let mut index = self.index.lock();
            index.get(&Key::Chunk(*digest));
            // Hashed just now: its file may serve a single-chunk file as a whole.
            if let Some(Held::Chunk { verified }) = index.peek_mut(&Key::Chunk(*digest)) {
                *verified = true;
            }
        }
        touch(&path);
        Some(Bytes::from(data))
    }

    /// A chunk read from the assembled file that holds it, verified again.
    fn get_located(&self, digest: &Digest) -> Option<Bytes> {
        let at = *self.located.lock().get(digest)?;
        let key = Key::File(at.file);
        if !matches!(
            self.index.lock().get(&key),
            Some(Held::File { ready: true, .. })
        ) {
            return None;
        }
        let path = self.file_path(&at.file);
        let mut data = vec![0u8; at.len as usize];
        let read = fs::File::open(&path).and_then(|f| f.read_exact_at(&mut data, at.offset));
        if let Err(e) = read {
            tracing::warn!(path = %path.display(), error = %e, "cannot read a chunk from an assembled file");
            return None;
        }
        if Digest::of(&data) != *digest {
            tracing::warn!(path = %path.display(), "assembled file is corrupt on disk; deleting it");
            MountMetrics::inc(&self.metrics.verification_failures);
            self.remove_file_entry(&at.file);
            return None;
        }
        Some(Bytes::from(data))
    }

    fn remove_file_entry(&self, file: &Digest) {
        {
            // A reservation (not ready) is an assembly of it started since, by the refetch
            // of this very damage: it stays.
            let mut index = self.index.lock();
            if let Some(Held::File { ready: true, .. }) = index.peek(&Key::File(*file)) {
                index.remove(&Key::File(*file));
            }
        }
        self.located.lock().retain(|_, at| at.file != *file);
        let _ = fs::remove_file(self.file_path(file));
        self.publish();
    }

    /// Keeps a chunk the caller has verified, evicting to stay within the bound. Blocking I/O.
    pub fn put(&self, digest: &Digest, data: &Bytes) {
        self.put_sparing(digest, data, None);
    }

    /// [`DiskCache::put`] that evicts no entry used within `spare_recent` (warming a
    /// version must not push out what readers use); whether the chunk is in the cache now.
    pub fn put_sparing(
        &self,
        digest: &Digest,
        data: &Bytes,
        spare_recent: Option<Duration>,
    ) -> bool {
        let _writer = self.writer.lock();
        if self.located.lock().contains_key(digest) {
            return true;
        }
        match self.reserve_sparing(
            Key::Chunk(*digest),
            Held::Chunk { verified: true },
            data.len() as u64,
            spare_recent,
        ) {
            Ok(true) => {}
            Ok(false) => return false,
            Err(()) => return true,
        }
        let written = match self.write(digest, data) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%digest, error = %e, "cannot write chunk to the disk cache");
                self.index.lock().remove(&Key::Chunk(*digest));
                false
            }
        };
        self.publish();
        written
    }

    /// True if the chunk can be read from this tier (its own file or an assembled one).
    pub fn contains(&self, digest: &Digest) -> bool {
        if self.index.lock().contains(&Key::Chunk(*digest)) {
            return true;
        }
        let Some(at) = self.located.lock().get(digest).copied() else {
            return false;
        };
        matches!(
            self.index.lock().peek(&Key::File(at.file)),
            Some(Held::File { ready: true, .. })
        )
    }

    /// A complete copy of `file` on disk, verified by this process or not: its assembled
    /// file, or for a file of one chunk, that chunk's file (the same bytes).
    pub fn whole_file(&self, file: &FileEntry) -> Option<WholeFile> {
        let key = self.whole_file_key(file)?;
        let verified = self.index.lock().peek(&key)?.verified();
        Some(WholeFile {
            path: self.path(&key),
            key,
            verified,
        })
    }

    /// The entry that holds a complete copy of `file`, if there is one.
    fn whole_file_key(&self, file: &FileEntry) -> Option<Key> {
        let index = self.index.lock();
        if let Some(Held::File { ready: true, .. }) = index.peek(&Key::File(file.blake3)) {
            return Some(Key::File(file.blake3));
        }
        match file.chunks.as_slice() {
            [only] if only.digest == file.blake3 && u64::from(only.len) == file.size => {
                let key = Key::Chunk(only.digest);
                index.contains(&key).then_some(key)
            }
            _ => None,
        }
    }

    /// True if this process verified the entry `key`.
    pub fn is_verified(&self, key: &Key) -> bool {
        self.index.lock().peek(key).is_some_and(Held::verified)
    }

    /// True if the copy a passthrough open registered (inode `ino` of `key`'s path) is still
    /// the cache's: not dropped as damaged since, nor replaced by a new copy.
    pub fn still_holds(&self, key: &Key, ino: u64) -> bool {
        let held = self.index.lock().contains(key);
        held && fs::metadata(self.path(key)).is_ok_and(|m| m.ino() == ino)
    }

    /// Every entry held now (what a scrub pass walks), least recently used first.
    pub fn keys(&self) -> Vec<Key> {
        self.index.lock().keys()
    }

    /// Hashes the entry `key` and compares the digest with its name. A match marks it
    /// verified; a mismatch (or a read error: a failing disk) drops it, counted in
    /// `verification_failures`. Blocking I/O, as long as reading the whole entry takes.
    pub fn check(&self, key: Key, hashing: Hashing) -> Checked {
        let ready = match self.index.lock().peek(&key) {
            Some(Held::File { ready, .. }) => *ready,
            Some(Held::Chunk { .. }) => true,
            None => false,
        };
        if !ready {
            return Checked::Gone;
        }
        let path = self.path(&key);
        let hashed = match hashing {
            Hashing::Fast => hash_fast(&path),
            Hashing::Paced(pace) => hash_paced(&path, pace),
        };
        let (actual, bytes) = match hashed {
            Ok(hashed) => hashed,
            // Evicted meanwhile, or a chunk reserved and not yet written.
            Err(e) if e.kind() == ErrorKind::NotFound => return Checked::Gone,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot read a disk cache entry: dropping it");
                self.discard(key);
                return Checked::Bad;
            }
        };
        let expected = match key {
            Key::Chunk(d) | Key::File(d) => d,
        };
        if actual != expected {
            tracing::error!(path = %path.display(), %actual, "disk cache entry is damaged: dropping it, it is fetched again");
            self.discard(key);
            return Checked::Bad;
        }
        let mut index = self.index.lock();
        match index.peek_mut(&key) {
            Some(Held::Chunk { verified }) | Some(Held::File { verified, .. }) => {
                *verified = true;
                Checked::Good(bytes)
            }
            None => Checked::Gone,
        }
    }

    /// Drops a damaged entry: from the index, its located chunks, its file.
    fn discard(&self, key: Key) {
        MountMetrics::inc(&self.metrics.verification_failures);
        match key {
            Key::File(file) => self.remove_file_entry(&file),
            Key::Chunk(_) => {
                self.index.lock().remove(&key);
                let _ = fs::remove_file(self.path(&key));
                self.publish();
            }
        }
    }

    /// Records where the chunks of `file` are if it is assembled here (a mount of a version
    /// calls this for its files: the chunk lists come from manifests).
    pub fn register(&self, file: &FileEntry) {
        if !matches!(
            self.index.lock().peek(&Key::File(file.blake3)),
            Some(Held::File { ready: true, .. })
        ) {
            return;
        }
        let mut located = self.located.lock();
        let mut offset = 0u64;
        for chunk in &file.chunks {
            located.entry(chunk.digest).or_insert(Located {
                file: file.blake3,
                offset,
                len: chunk.len,
            });
            let Some(next) = offset.checked_add(u64::from(chunk.len)) else {
                return;
            };
            offset = next;
        }
    }

    /// Reserves room for assembling `file` and returns the temporary path to write it at;
    /// `None` if it is assembled already, being assembled, or cannot fit.
    pub fn begin_file(&self, file: &FileEntry) -> Option<PathBuf> {
        let _writer = self.writer.lock();
        match self.reserve(
            Key::File(file.blake3),
            Held::File {
                ready: false,
                verified: false,
            },
            file.size,
        ) {
            Ok(true) => {
                // Pinned while it is written: chunks the assembly fetches meanwhile must not
                // evict the room it reserved.
                self.pin(Key::File(file.blake3));
                self.publish();
                Some(self.tmp_path(&file.blake3))
            }
            Ok(false) | Err(()) => None,
        }
    }

    /// Puts an assembled file (written at `tmp`, checked against its BLAKE3 by the caller)
    /// in place, and drops the chunk files it now holds. Blocking I/O.
    pub fn finish_file(&self, file: &FileEntry, tmp: &Path) -> std::io::Result<()> {
        let path = self.file_path(&file.blake3);
        self.unpin(Key::File(file.blake3));
        if !matches!(
            self.index.lock().peek(&Key::File(file.blake3)),
            Some(Held::File { ready: false, .. })
        ) {
            // The reservation is gone (removed meanwhile): keep nothing untracked.
            let _ = fs::remove_file(tmp);
            return Err(std::io::Error::other(
                "the assembly's reservation was dropped",
            ));
        }
        let placed = (|| {
            if let Some(shard) = path.parent() {
                private_dir(shard)?;
            }
            fs::rename(tmp, &path)
        })();
        if let Err(e) = placed {
            let _ = fs::remove_file(tmp);
            self.index.lock().remove(&Key::File(file.blake3));
            self.publish();
            return Err(e);
        }
        // Its BLAKE3 was checked as it was written (`crate::hydrate`).
        if let Some(held) = self.index.lock().peek_mut(&Key::File(file.blake3)) {
            *held = Held::File {
                ready: true,
                verified: true,
            };
        }
        self.register(file);
        // The chunks are in the file now: their own copies go (unless pinned: open).
        let pins = self.pins.lock().clone();
        let mut dropped = Vec::new();
        {
            let mut index = self.index.lock();
            for chunk in &file.chunks {
                let key = Key::Chunk(chunk.digest);
                if !pins.contains_key(&key) && index.remove(&key).is_some() {
                    dropped.push(key);
                }
            }
        }
        for key in dropped {
            let _ = fs::remove_file(self.path(&key));
        }
        self.publish();
        Ok(())
    }

    /// Gives up an assembly [`DiskCache::begin_file`] reserved room for.
    pub fn abandon_file(&self, file: &FileEntry, tmp: &Path) {
        self.unpin(Key::File(file.blake3));
        let _ = fs::remove_file(tmp);
        let mut index = self.index.lock();
        if let Some(Held::File { ready: false, .. }) = index.peek(&Key::File(file.blake3)) {
            index.remove(&Key::File(file.blake3));
        }
        drop(index);
        self.publish();
    }

    /// Keeps `key` from eviction until as many [`DiskCache::unpin`]s.
    pub fn pin(&self, key: Key) {
        *self.pins.lock().entry(key).or_insert(0) += 1;
    }

    pub fn unpin(&self, key: Key) {
        let mut pins = self.pins.lock();
        if let Some(n) = pins.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                pins.remove(&key);
            }
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.index.lock().bytes()
    }
}

/// Creates `dir` (and missing parents) 0700, and tightens it if it exists looser.
pub(crate) fn private_dir(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mode = fs::metadata(dir)?.mode() & 0o7777;
    if mode & 0o077 != 0 {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(mode & 0o700))?;
    }
    Ok(())
}

/// Creates `path` for writing, 0600.
pub(crate) fn create_private(path: &Path) -> std::io::Result<fs::File> {
    fs::File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

/// BLAKE3 of the file at `path` and its length, on every core (rayon), through an mmap the
/// kernel is asked to read ahead in full (`MADV_WILLNEED`): the disk streams while the cores
/// hash, and the file is in the page cache for the reader that opens it next.
fn hash_fast(path: &Path) -> std::io::Result<(Digest, u64)> {
    let file = fs::File::open(path)?;
    let len = file.metadata()?.len();
    let mut hasher = blake3::Hasher::new();
    if len < FAST_MIN_MAP {
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut data)?;
        hasher.update(&data);
        return Ok((
            Digest::from_bytes(*hasher.finalize().as_bytes()),
            data.len() as u64,
        ));
    }
    // SAFETY: cache files are written once under tmp/ and renamed into place; nothing of ours
    // writes them after. A byte changed under the mapping by anyone else (the damage this
    // looks for) changes what is hashed, which the comparison with the name then reports.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    if let Err(e) = map.advise(memmap2::Advice::WillNeed) {
        tracing::debug!(path = %path.display(), error = %e, "madvise(WILLNEED) refused");
    }
    hasher.update_rayon(&map);
    Ok((
        Digest::from_bytes(*hasher.finalize().as_bytes()),
        map.len() as u64,
    ))
}

/// BLAKE3 of the file at `path` and its length, one block at a time on this thread, read
/// with `O_DIRECT` where the filesystem allows it: the disk's bytes, not the page cache's,
/// and no page cache pushed out for a scrub.
fn hash_paced(path: &Path, pace: &mut dyn FnMut(u64)) -> std::io::Result<(Digest, u64)> {
    let (file, direct) = match fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(file) => (file, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (fs::File::open(path)?, false),
        Err(e) => return Err(e),
    };
    let mut raw = vec![0u8; SCRUB_BLOCK + DIRECT_ALIGN];
    let skew = raw.as_ptr().align_offset(DIRECT_ALIGN);
    let buf = raw
        .get_mut(skew..skew + SCRUB_BLOCK)
        .ok_or_else(|| std::io::Error::other("cannot align the scrub buffer"))?;
    let mut hasher = blake3::Hasher::new();
    let mut offset = 0u64;
    loop {
        let n = match file.read_at(buf, offset) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            // Some filesystems take O_DIRECT at open and refuse it at read.
            Err(e) if direct && offset == 0 && e.raw_os_error() == Some(libc::EINVAL) => {
                return hash_buffered(path, pace);
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        offset = offset.saturating_add(n as u64);
        pace(n as u64);
    }
    Ok((Digest::from_bytes(*hasher.finalize().as_bytes()), offset))
}

fn hash_buffered(path: &Path, pace: &mut dyn FnMut(u64)) -> std::io::Result<(Digest, u64)> {
    let file = fs::File::open(path)?;
    let mut buf = vec![0u8; SCRUB_BLOCK];
    let mut hasher = blake3::Hasher::new();
    let mut offset = 0u64;
    loop {
        let n = match file.read_at(&mut buf, offset) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        offset = offset.saturating_add(n as u64);
        pace(n as u64);
    }
    Ok((Digest::from_bytes(*hasher.finalize().as_bytes()), offset))
}

/// The mtime records the last use so that LRU order survives a restart.
fn touch(path: &Path) {
    if let Ok(file) = fs::File::options().write(true).open(path) {
        let _ = file.set_modified(SystemTime::now());
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
