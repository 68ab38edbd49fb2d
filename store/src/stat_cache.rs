//! The stat cache: what a push learned about each local file (its chunk list and whole-file
//! BLAKE3), keyed by what `stat` says of it (device, inode, size, mtime and ctime in ns), so a
//! re-push of an unchanged tree reads no file bytes.
//!
//! One file per (pushed root, store) under `$XDG_CACHE_HOME/sealed/stat/` (or
//! `~/.cache/sealed/stat/`), named by the BLAKE3 of the canonical root path and the store URL.
//! It is written whole, to a temporary file renamed into place, and read as hostile input:
//! every length is bounded before use and a BLAKE3 trailer covers every byte, so a file that is
//! truncated, damaged or of another format version is ignored with a warning (every file is
//! then read), never half-trusted.
//!
//! The racily-clean rule (git's, made stricter): an entry is trusted only when its mtime and
//! its ctime are both older than the moment the push that wrote it *started its scan*, by a
//! [`StatCacheConfig::racy_window`] that covers coarse filesystem timestamps. A file written
//! within that window may change again inside one timestamp tick without its stat moving, so
//! it is hashed again next time. ctime is in the key because `utimensat` can put an mtime back
//! but not a ctime: a file rewritten to the same size with its mtime restored still misses.
//!
//! The cache never says what the store holds: push still asks the store whether a cached
//! file's chunks are there (or whether it already has the whole manifest).
//!
//! Format (little-endian), version [`FORMAT_VERSION`]:
//! `"SEALSTC\0"`, u32 version, 32-byte chunker id, i64 scan start (ns since the epoch),
//! u64 entry count, then per entry: u32 path length, path (UTF-8), u64 dev, u64 ino, u64 size,
//! i64 mtime ns, i64 ctime ns, 32-byte file BLAKE3, u32 chunk count, per chunk a 32-byte
//! digest and a u32 length; last, the 32-byte BLAKE3 of everything before it.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::chunker::ChunkParams;
use crate::digest::Digest;
use crate::manifest::ChunkRef;

pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"SEALSTC\0";
/// One cache file at most (about 3.5 million chunks: terabytes of 1 MiB chunks).
pub const MAX_FILE_BYTES: u64 = 128 << 20;
/// All cache files together; the least recently written go first.
pub const MAX_DIR_BYTES: u64 = 512 << 20;
/// Longest path an entry may have (the manifest's own bound is smaller).
const MAX_PATH_BYTES: usize = 64 * 1024;
/// How much older than the writing push's scan a file's mtime and ctime must be to be
/// trusted: ext4 stamps files from a clock that ticks every few ms, and some filesystems
/// (FAT, some network ones) keep whole or even seconds.
pub const DEFAULT_RACY_WINDOW: Duration = Duration::from_secs(2);

/// What `stat` says of a file, as the cache compares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatKey {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl StatKey {
    /// `None` for timestamps that do not fit in i64 nanoseconds (past 2262): never cached.
    pub fn of(meta: &fs::Metadata) -> Option<StatKey> {
        Some(StatKey {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: nanos(meta.mtime(), meta.mtime_nsec())?,
            ctime_ns: nanos(meta.ctime(), meta.ctime_nsec())?,
        })
    }

    fn newest_ns(&self) -> i64 {
        self.mtime_ns.max(self.ctime_ns)
    }
}

fn nanos(secs: i64, nsec: i64) -> Option<i64> {
    secs.checked_mul(1_000_000_000)?.checked_add(nsec)
}

/// Nanoseconds since the epoch of `t` (0 before the epoch: nothing is trusted then).
pub fn epoch_ns(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_nanos()).ok())
        .unwrap_or(0)
}

/// A file's content as a push found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedFile {
    pub key: StatKey,
    pub blake3: Digest,
    pub chunks: Vec<ChunkRef>,
}

/// Where the caches live and how careful they are.
#[derive(Clone, Debug)]
pub struct StatCacheConfig {
    pub dir: PathBuf,
    pub racy_window: Duration,
}

impl StatCacheConfig {
    /// `$XDG_CACHE_HOME/sealed/stat`, else `~/.cache/sealed/stat`; `None` without either.
    pub fn user_default() -> Option<Self> {
        dirs::cache_dir().map(|d| StatCacheConfig {
            dir: d.join("sealed").join("stat"),
            racy_window: DEFAULT_RACY_WINDOW,
        })
    }

    /// The cache file of `root` pushed to the store named `store`.
    pub fn file_for(&self, root: &Path, store: &str) -> PathBuf {
        let canonical = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        let mut h = blake3::Hasher::new();
        h.update(canonical.as_os_str().as_encoded_bytes());
        h.update(b"\0");
        h.update(store.as_bytes());
        self.dir.join(h.finalize().to_hex().as_str())
    }

    fn racy_window_ns(&self) -> i64 {
        i64::try_from(self.racy_window.as_nanos()).unwrap_or(i64::MAX)
    }
}

/// The chunker a cache was made with: entries from another chunker are useless.
fn chunker_id(params: &ChunkParams) -> Digest {
    let text = serde_json::to_vec(params).unwrap_or_default();
    Digest::of(&text)
}

/// One (root, store) pair's cache, loaded.
#[derive(Debug)]
pub struct StatCache {
    path: PathBuf,
    chunker: Digest,
    max_chunk: u32,
    racy_window_ns: i64,
    /// When the scan of the push that wrote the cache began.
    written_scan_ns: i64,
    entries: HashMap<String, CachedFile>,
}

impl StatCache {
    /// Loads the cache of `root` in `store`; a missing file is an empty cache, and a damaged
    /// one is ignored with a warning (every file is then read, and the cache rewritten).
    pub fn load(cfg: &StatCacheConfig, root: &Path, store: &str, params: &ChunkParams) -> Self {
        let path = cfg.file_for(root, store);
        let mut cache = StatCache {
            path,
            chunker: chunker_id(params),
            max_chunk: params.max_size,
            racy_window_ns: cfg.racy_window_ns(),
            written_scan_ns: 0,
            entries: HashMap::new(),
        };
        match read_bounded(&cache.path) {
            Ok(None) => {}
            Ok(Some(bytes)) => match decode(&bytes, &cache.chunker, cache.max_chunk) {
                Ok(Decoded::Entries { scan_ns, entries }) => {
                    cache.written_scan_ns = scan_ns;
                    cache.entries = entries;
                }
                Ok(Decoded::OtherChunker) => {
                    tracing::debug!(path = %cache.path.display(), "stat cache of another chunker")
                }
                Err(why) => tracing::warn!(
                    "ignoring the stat cache {}: {why}; every file is read and hashed",
                    cache.path.display()
                ),
            },
            Err(e) => tracing::warn!(
                "cannot read the stat cache {}: {e}; every file is read and hashed",
                cache.path.display()
            ),
        }
        cache
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The cached content of `rel`, if its stat is exactly `key` and it was old enough when
    /// it was read (the racily-clean rule).
    pub fn lookup(&self, rel: &str, key: &StatKey) -> Option<&CachedFile> {
        let hit = self.entries.get(rel)?;
        (hit.key == *key && self.settled(key, self.written_scan_ns)).then_some(hit)
    }

    /// Whether a file with this stat was settled when a scan began at `scan_ns`.
    fn settled(&self, key: &StatKey, scan_ns: i64) -> bool {
        key.newest_ns()
            .checked_add(self.racy_window_ns)
            .is_some_and(|t| t < scan_ns)
    }

    /// Replaces the cache file with `entries` as a scan begun at `scan_ns` found them: the
    /// racy ones are left out, the file is bounded by [`MAX_FILE_BYTES`] and written whole
    /// (temporary file, then rename), then the oldest cache files go while all of them
    /// together exceed [`MAX_DIR_BYTES`].
    pub fn save(&self, scan_ns: i64, entries: &[(String, CachedFile)]) -> std::io::Result<usize> {
        let settled = entries
            .iter()
            .filter(|(_, f)| self.settled(&f.key, scan_ns));
        let (bytes, kept) = encode(&self.chunker, scan_ns, settled);
        let dir = self
            .path
            .parent()
            .ok_or_else(|| std::io::Error::other("stat cache path has no directory"))?;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let tmp = dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            epoch_ns(SystemTime::now())
        ));
        let written = (|| {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&bytes)?;
            fs::rename(&tmp, &self.path)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written?;
        evict(dir, &self.path);
        Ok(kept)
    }
}

/// The file's bytes, or `None` when there is none; a file over the bound is an error.
fn read_bounded(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let f = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_FILE_BYTES} bytes"
        )));
    }
    Ok(Some(bytes))
}

/// Deletes the least recently written cache files (never `keep`) while they exceed
/// [`MAX_DIR_BYTES`], and temporary files left by a push that died an hour ago or more.
fn evict(dir: &Path, keep: &Path) {
    let Ok(listing) = fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    for entry in listing.flatten() {
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let path = entry.path();
        let modified = meta.modified().unwrap_or(UNIX_EPOCH);
        let stale = now
            .duration_since(modified)
            .is_ok_and(|age| age > Duration::from_secs(3600));
        if entry.file_name().as_encoded_bytes().starts_with(b".tmp-") {
            if stale {
                let _ = fs::remove_file(&path);
            }
            continue;
        }
        files.push((modified, meta.len(), path));
    }
    let mut total: u64 = files.iter().map(|f| f.1).fold(0, u64::saturating_add);
    files.sort();
    for (_, len, path) in files {
        if total <= MAX_DIR_BYTES {
            break;
        }
        if path != keep && fs::remove_file(&path).is_ok() {
            total = total.saturating_sub(len);
        }
    }
}

const ENTRY_FIXED: usize = 4 + 8 * 5 + 32 + 4;
const CHUNK_BYTES: usize = 32 + 4;
const TRAILER: usize = 32;

/// The file's bytes and how many entries fit under [`MAX_FILE_BYTES`].
fn encode<'a>(
    chunker: &Digest,
    scan_ns: i64,
    entries: impl Iterator<Item = &'a (String, CachedFile)>,
) -> (Vec<u8>, usize) {
    let mut body = Vec::new();
    let mut count: u64 = 0;
    let budget = MAX_FILE_BYTES as usize - TRAILER - 64;
    for (path, f) in entries {
        let path = path.as_str();
        let need = ENTRY_FIXED + path.len() + f.chunks.len() * CHUNK_BYTES;
        if path.len() > MAX_PATH_BYTES || body.len() + need > budget {
            continue;
        }
        let Ok(path_len) = u32::try_from(path.len()) else {
            continue;
        };
        let Ok(chunk_count) = u32::try_from(f.chunks.len()) else {
            continue;
        };
        body.extend_from_slice(&path_len.to_le_bytes());
        body.extend_from_slice(path.as_bytes());
        for v in [f.key.dev, f.key.ino, f.key.size] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        body.extend_from_slice(&f.key.mtime_ns.to_le_bytes());
        body.extend_from_slice(&f.key.ctime_ns.to_le_bytes());
        body.extend_from_slice(f.blake3.as_bytes());
        body.extend_from_slice(&chunk_count.to_le_bytes());
        for c in &f.chunks {
            body.extend_from_slice(c.digest.as_bytes());
            body.extend_from_slice(&c.len.to_le_bytes());
        }
        count += 1;
    }
    let mut out = Vec::with_capacity(64 + body.len() + TRAILER);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(chunker.as_bytes());
    out.extend_from_slice(&scan_ns.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&body);
    let sum = Digest::of(&out);
    out.extend_from_slice(sum.as_bytes());
    (out, count as usize)
}

enum Decoded {
    Entries {
        scan_ns: i64,
        entries: HashMap<String, CachedFile>,
    },
    /// Made with another chunker: nothing in it applies.
    OtherChunker,
}

/// A cursor that never reads past the end.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.buf.len() {
            return Err("truncated".into());
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }
    fn i64(&mut self) -> Result<i64, String> {
        self.array().map(i64::from_le_bytes)
    }
    fn digest(&mut self) -> Result<Digest, String> {
        self.array().map(Digest::from_bytes)
    }
}

fn decode(bytes: &[u8], chunker: &Digest, max_chunk: u32) -> Result<Decoded, String> {
    if bytes.len() < MAGIC.len() + 4 || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a stat cache file (bad magic)".into());
    }
    let mut r = Reader {
        buf: &bytes[MAGIC.len()..],
    };
    let version = r.u32()?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version}, this build reads {FORMAT_VERSION}"
        ));
    }
    let body_end = bytes
        .len()
        .checked_sub(TRAILER)
        .ok_or("truncated (no checksum)")?;
    let (body, sum) = bytes.split_at(body_end);
    if Digest::of(body).as_bytes()[..] != sum[..] {
        return Err("checksum mismatch (damaged or truncated)".into());
    }
    let mut r = Reader {
        buf: &body[MAGIC.len() + 4..],
    };
    if r.digest()? != *chunker {
        return Ok(Decoded::OtherChunker);
    }
    let scan_ns = r.i64()?;
    let count = r.u64()?;
    // Each entry takes at least ENTRY_FIXED bytes: a count beyond that is a lie, refused
    // before anything is allocated for it.
    if count > (r.buf.len() / ENTRY_FIXED) as u64 {
        return Err(format!("claims {count} entries in {} bytes", r.buf.len()));
    }
    let mut entries = HashMap::with_capacity(count as usize);
    for _ in 0..count {
        let path_len = r.u32()? as usize;
        if path_len > MAX_PATH_BYTES {
            return Err(format!("a path of {path_len} bytes"));
        }
        let path = std::str::from_utf8(r.take(path_len)?)
            .map_err(|_| "a path that is not UTF-8".to_string())?
            .to_owned();
        let key = StatKey {
            dev: r.u64()?,
            ino: r.u64()?,
            size: r.u64()?,
            mtime_ns: r.i64()?,
            ctime_ns: r.i64()?,
        };
        let blake3 = r.digest()?;
        let n = r.u32()? as usize;
        if n > r.buf.len() / CHUNK_BYTES {
            return Err(format!("'{path}' claims {n} chunks"));
        }
        let mut chunks = Vec::with_capacity(n);
        let mut total: u64 = 0;
        for _ in 0..n {
            let digest = r.digest()?;
            let len = r.u32()?;
            if len == 0 || len > max_chunk {
                return Err(format!("'{path}' has a chunk of {len} bytes"));
            }
            total = total
                .checked_add(u64::from(len))
                .ok_or("chunk lengths overflow")?;
            chunks.push(ChunkRef { digest, len });
        }
        if total != key.size {
            return Err(format!(
                "'{path}' is {} bytes but its chunks add up to {total}",
                key.size
            ));
        }
        let file = CachedFile {
            key,
            blake3,
            chunks,
        };
        if entries.insert(path.clone(), file).is_some() {
            return Err(format!("'{path}' appears twice"));
        }
    }
    if !r.buf.is_empty() {
        return Err("bytes after the last entry".into());
    }
    Ok(Decoded::Entries { scan_ns, entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(size: u32, mtime_ns: i64) -> CachedFile {
        CachedFile {
            key: StatKey {
                dev: 1,
                ino: 2,
                size: u64::from(size),
                mtime_ns,
                ctime_ns: mtime_ns,
            },
            blake3: Digest::of(b"whole"),
            chunks: vec![ChunkRef {
                digest: Digest::of(b"c"),
                len: size,
            }],
        }
    }

    fn cfg(dir: &Path, window: Duration) -> StatCacheConfig {
        StatCacheConfig {
            dir: dir.to_path_buf(),
            racy_window: window,
        }
    }

    const SEC: i64 = 1_000_000_000;

    #[test]
    fn round_trips_and_applies_the_racy_rule() {
        let tmp = tempfile::tempdir().unwrap();
        let params = ChunkParams::default();
        let c = cfg(tmp.path(), Duration::from_secs(2));
        let cache = StatCache::load(&c, tmp.path(), "memory://", &params);
        assert!(cache.is_empty());
        let scan = 100 * SEC;
        let old = file(10, scan - 3 * SEC);
        // Modified 1 s before the scan began: inside the window, so never trusted.
        let racy = file(10, scan - SEC);
        let kept = cache
            .save(
                scan,
                &[("old".into(), old.clone()), ("racy".into(), racy.clone())],
            )
            .unwrap();
        assert_eq!(kept, 1);
        let cache = StatCache::load(&c, tmp.path(), "memory://", &params);
        assert_eq!(cache.lookup("old", &old.key), Some(&old));
        assert_eq!(cache.lookup("racy", &racy.key), None);
        // Any field of the stat moved: a miss.
        let mut moved = old.key;
        moved.ctime_ns += 1;
        assert_eq!(cache.lookup("old", &moved), None);
        // Another store, another file.
        assert!(StatCache::load(&c, tmp.path(), "file:///x", &params).is_empty());
    }

    #[test]
    fn damaged_files_are_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        let params = ChunkParams::default();
        let c = cfg(tmp.path(), Duration::from_secs(2));
        let cache = StatCache::load(&c, tmp.path(), "s", &params);
        let old = file(10, SEC);
        cache.save(100 * SEC, &[("old".into(), old)]).unwrap();
        let good = fs::read(cache.path()).unwrap();
        let mut bad = good.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 1;
        for bytes in [
            bad,
            good[..good.len() - 1].to_vec(),
            b"garbage".to_vec(),
            Vec::new(),
        ] {
            fs::write(cache.path(), &bytes).unwrap();
            assert!(StatCache::load(&c, tmp.path(), "s", &params).is_empty());
        }
        // Another format version, even with a valid checksum.
        let mut other = good[..good.len() - TRAILER].to_vec();
        other[8..12].copy_from_slice(&2u32.to_le_bytes());
        let sum = Digest::of(&other);
        other.extend_from_slice(sum.as_bytes());
        assert!(matches!(
            decode(&other, &chunker_id(&params), params.max_size),
            Err(e) if e.contains("format version 2")
        ));
        // A chunker other than ours: nothing applies.
        let other_params = ChunkParams {
            min_size: 128 * 1024,
            ..params.clone()
        };
        fs::write(cache.path(), &good).unwrap();
        assert!(StatCache::load(&c, tmp.path(), "s", &other_params).is_empty());
        assert_eq!(StatCache::load(&c, tmp.path(), "s", &params).len(), 1);
    }

    #[test]
    fn lying_lengths_are_refused_before_allocation() {
        let params = ChunkParams::default();
        let id = chunker_id(&params);
        let forge = |count: u64, tail: &[u8]| {
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
            b.extend_from_slice(id.as_bytes());
            b.extend_from_slice(&0i64.to_le_bytes());
            b.extend_from_slice(&count.to_le_bytes());
            b.extend_from_slice(tail);
            let sum = Digest::of(&b);
            b.extend_from_slice(sum.as_bytes());
            b
        };
        assert!(decode(&forge(u64::MAX, &[]), &id, params.max_size).is_err());
        // Chunk lengths that do not add up to the size.
        let (mut good, _) = encode(&id, 0, [("f".to_string(), file(10, 0))].iter());
        good.truncate(good.len() - TRAILER);
        let size_at = 8 + 4 + 32 + 8 + 8 + 4 + 1 + 16;
        good[size_at..size_at + 8].copy_from_slice(&11u64.to_le_bytes());
        let sum = Digest::of(&good);
        good.extend_from_slice(sum.as_bytes());
        assert!(matches!(decode(&good, &id, params.max_size), Err(e) if e.contains("add up")));
    }
}
