//! Push: scan a directory, upload only the chunks the store lacks, then seal the manifest.
//!
//! One pass over the data: as the scanner hashes each chunk it hands the bytes to the
//! [`Uploader`], which uploads the chunks the store lacks, several at once, through a bounded
//! channel (so memory stays at `concurrency` chunks however large the tree).
//!
//! Order matters for "nothing lost": every chunk is uploaded and made durable before the
//! manifest that names it is written, and the manifest is written with a conditional create.
//! An interrupted push leaves only chunks (harmless, reused by the next push), never a
//! manifest with holes. The whole push holds a writer lease, so no garbage collection sweeps
//! while it decides which chunks the store already has (docs/gc.md).
//!
//! With a stat cache ([`crate::stat_cache`]) a file whose stat has not moved since the last
//! push is not read: its chunk list comes from the cache. The cache says nothing about the
//! store, so before sealing push makes sure those chunks are there: either the store already
//! has the very manifest (a manifest is only ever written after its chunks), or each chunk
//! only cached files name is looked up, and a file with a missing chunk is read and uploaded.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use futures::StreamExt;

use crate::chunker::ChunkParams;
use crate::error::{Error, Result};
use crate::manifest::{ChunkRef, EntryKind};
use crate::progress::{Phase, Progress};
use crate::scan::{
    FileSource, FollowSymlinks, PathFilter, ScanOptions, ScannedTree, chunk_files,
    ensure_unchanged, scan,
};
use crate::stat_cache::{CachedFile, StatCache, StatCacheConfig, epoch_ns};
use crate::store::{ChunkStore, validate_volume_name};
use crate::upload::{ChunkSender, UploadStats, Uploader};
use crate::writer_lease::{WriterLease, with_writer_lease};

#[derive(Clone, Debug)]
pub struct PushOptions {
    /// Threads for chunking and hashing (`None`: every core).
    pub threads: Option<usize>,
    /// Chunk existence checks and uploads in flight at once.
    pub concurrency: usize,
    /// Record the version under this volume name (`ns/name`).
    pub volume: Option<String>,
    pub params: ChunkParams,
    /// Seal symlinks' targets instead of the links ([`FollowSymlinks`]).
    pub follow_symlinks: Option<FollowSymlinks>,
    /// Which paths to seal.
    pub filter: PathFilter,
    /// Whether unchanged files may be skipped ([`StatCachePolicy`]).
    pub stat_cache: StatCachePolicy,
}

/// How a push uses the local stat cache ([`crate::stat_cache`]).
#[derive(Clone, Debug, Default)]
pub enum StatCachePolicy {
    /// No cache: every file is read and nothing is remembered.
    #[default]
    Off,
    /// Files whose stat matches the cache are not read; the cache is rewritten after.
    Use(StatCacheConfig),
    /// Every file is read (`sealed push --rehash`); the cache is rewritten after.
    Rehash(StatCacheConfig),
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            threads: None,
            concurrency: 16,
            volume: None,
            params: ChunkParams::default(),
            follow_symlinks: None,
            filter: PathFilter::default(),
            stat_cache: StatCachePolicy::Off,
        }
    }
}

/// What a push (or an ingest) sealed; made by the sealing step both share.
pub use crate::seal::PushReport;

pub async fn push(
    store: &ChunkStore,
    dir: &Path,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
) -> Result<PushReport> {
    if let Some(volume) = &opts.volume {
        validate_volume_name(volume)?;
    }
    // No garbage collection may sweep between our first "the store has this chunk" and the
    // manifest that names it: hold a writer lease for the whole push (docs/gc.md).
    with_writer_lease(store, &push_purpose(dir, opts), async |lease| {
        push_leased(store, dir, opts, progress, lease).await
    })
    .await
}

fn push_purpose(dir: &Path, opts: &PushOptions) -> String {
    match &opts.volume {
        Some(v) => format!("push {} to {v}", dir.display()),
        None => format!("push {}", dir.display()),
    }
}

async fn push_leased(
    store: &ChunkStore,
    dir: &Path,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
    lease: &WriterLease,
) -> Result<PushReport> {
    // Taken before the walk stats anything: the racily-clean rule measures from here.
    let scan_started = epoch_ns(SystemTime::now());
    let (mut uploader, sender) = Uploader::start(store, opts.concurrency, progress.clone());
    let scanned = scan_blocking(
        dir.to_path_buf(),
        store.name(),
        opts,
        progress.clone(),
        sender,
    );
    let scanned = scanned.await;
    // An upload failure stops the scan too; report the cause, not the symptom.
    let mut stats = uploader.finish().await?;
    let (mut tree, cache) = scanned?;
    progress.finish();

    // A file that moved under us after its scan must not be sealed.
    for src in tree.sources.values() {
        let now = std::fs::metadata(&src.path).map_err(|e| Error::io(&src.path, e))?;
        ensure_unchanged(src, &now, src.size)?;
    }
    if !tree.cached.is_empty() {
        let more = upload_missing_cached(store, &mut tree, opts, progress.clone()).await?;
        stats.chunks_uploaded += more.chunks_uploaded;
        stats.bytes_uploaded += more.bytes_uploaded;
    }
    // Every distinct chunk was either uploaded or found: count the found ones once, however
    // many passes saw them.
    let unique: u64 = tree
        .manifest
        .unique_chunks()
        .iter()
        .map(|c| u64::from(c.len))
        .sum();
    stats.bytes_reused = unique.saturating_sub(stats.bytes_uploaded);
    let mut report =
        crate::seal::seal_manifest(store, &tree.manifest, lease, opts.volume.as_deref(), &stats)
            .await?;
    report.bytes_read = tree.bytes_read;
    report.files_cached = tree.cached.len() as u64;
    if let Some(cache) = cache {
        save_cache(cache, &tree, scan_started).await;
    }
    Ok(report)
}

/// Makes sure the chunks that only cached (unread) files name are in the store, reading and
/// uploading every cached file one of whose chunks is missing.
async fn upload_missing_cached(
    store: &ChunkStore,
    tree: &mut ScannedTree,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
) -> Result<UploadStats> {
    let (_, digest) = tree.manifest.seal()?;
    // Written only after every chunk it names was durable, and no collection sweeps while
    // we hold the writer lease: the store has every chunk of it.
    if store.has_manifest(&digest).await? {
        return Ok(UploadStats::default());
    }
    let mut read_chunks = HashSet::new();
    let mut cached_chunks = HashSet::new();
    for (path, file) in tree.manifest.files() {
        let set = if tree.cached.contains(path) {
            &mut cached_chunks
        } else {
            &mut read_chunks
        };
        set.extend(file.chunks.iter().map(|c| c.digest));
    }
    // Chunks a read file also names went through the uploader already.
    let to_check: Vec<_> = cached_chunks.difference(&read_chunks).copied().collect();
    let mut checks = futures::stream::iter(to_check)
        .map(|d| async move { store.has_chunk(&d).await.map(|has| (d, has)) })
        .buffer_unordered(opts.concurrency.max(1));
    let mut missing = HashSet::new();
    while let Some(checked) = checks.next().await {
        let (d, has) = checked?;
        if !has {
            missing.insert(d);
        }
    }
    if missing.is_empty() {
        return Ok(UploadStats::default());
    }
    let reread: Vec<FileSource> = tree
        .manifest
        .files()
        .filter(|(path, f)| {
            tree.cached.contains(*path) && f.chunks.iter().any(|c| missing.contains(&c.digest))
        })
        .filter_map(|(path, _)| tree.sources.get(path).cloned())
        .collect();
    tracing::info!(
        files = reread.len(),
        chunks = missing.len(),
        "chunks of unchanged files are missing from the store: reading those files"
    );
    let (mut uploader, sender) = Uploader::start(store, opts.concurrency, progress.clone());
    let params = opts.params.clone();
    let threads = opts.threads;
    let files = reread;
    let chunked = tokio::task::spawn_blocking(move || {
        let sink = |chunk: &ChunkRef, bytes: &[u8]| sender.send_blocking(chunk, bytes);
        chunk_files(&files, &params, threads, &|n| progress.advance(n), &sink)
    })
    .await
    .map_err(|e| Error::Other(format!("hashing task failed: {e}")))?;
    let stats = uploader.finish().await?;
    let chunked = chunked?;
    for (path, file) in chunked {
        tree.bytes_read += file.size;
        tree.cached.remove(&path);
        if let Some(entry) = tree.manifest.entries.iter_mut().find(|e| e.path == path) {
            entry.kind = EntryKind::File(file);
        }
    }
    Ok(stats)
}

/// Rewrites the stat cache with what this push found. A cache that cannot be written costs
/// the next push a full read, never this push its result.
async fn save_cache(cache: Arc<StatCache>, tree: &ScannedTree, scan_started: i64) {
    let entries: Vec<(String, CachedFile)> = tree
        .manifest
        .files()
        .filter_map(|(path, f)| {
            let key = tree.sources.get(path)?.stat?;
            let file = CachedFile {
                key,
                blake3: f.blake3,
                chunks: f.chunks.clone(),
            };
            Some((path.to_owned(), file))
        })
        .collect();
    let saved = tokio::task::spawn_blocking(move || {
        let path = cache.path().to_path_buf();
        cache.save(scan_started, &entries).map_err(|e| (path, e))
    })
    .await;
    match saved {
        Ok(Ok(kept)) => tracing::debug!(entries = kept, "stat cache written"),
        Ok(Err((path, e))) => tracing::warn!(
            "cannot write the stat cache {}: {e}; the next push reads every file",
            path.display()
        ),
        Err(e) => tracing::warn!("stat cache task failed: {e}"),
    }
}

async fn scan_blocking(
    dir: PathBuf,
    store_name: &str,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
    sender: ChunkSender,
) -> Result<(ScannedTree, Option<Arc<StatCache>>)> {
    let params = opts.params.clone();
    let policy = opts.stat_cache.clone();
    let store_name = store_name.to_owned();
    let mut scan_opts = ScanOptions {
        threads: opts.threads,
        follow_symlinks: opts.follow_symlinks.clone(),
        filter: opts.filter.clone(),
        stat_cache: None,
    };
    tokio::task::spawn_blocking(move || {
        let cache = match &policy {
            StatCachePolicy::Off => None,
            StatCachePolicy::Use(cfg) | StatCachePolicy::Rehash(cfg) => {
                Some(StatCache::load(cfg, &dir, &store_name, &params))
            }
        };
        let cache = cache.map(Arc::new);
        if let (StatCachePolicy::Use(_), Some(c)) = (&policy, &cache) {
            scan_opts.stat_cache = Some(c.clone());
        }
        let sink = |chunk: &ChunkRef, bytes: &[u8]| sender.send_blocking(chunk, bytes);
        let p = progress.clone();
        let tree = scan(
            &dir,
            &params,
            &scan_opts,
            &|total| p.start(Phase::Scan, total),
            &|n| progress.advance(n),
            &sink,
        )?;
        Ok((tree, cache))
    })
    .await
    .map_err(|e| Error::Other(format!("scan task failed: {e}")))?
}
