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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::chunker::ChunkParams;
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::lease::{WriterLease, with_writer_lease};
use crate::manifest::{ChunkRef, EntryKind, Manifest};
use crate::progress::{Phase, Progress};
use crate::scan::{FollowSymlinks, PathFilter, ScanOptions, ScannedTree, ensure_unchanged, scan};
use crate::store::{ChunkStore, validate_volume_name};
use crate::upload::{ChunkSender, UploadStats, Uploader};

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
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct PushReport {
    pub digest: Digest,
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Bytes of file content in the version.
    pub bytes: u64,
    pub chunks: u64,
    pub unique_chunks: u64,
    pub chunks_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Bytes of distinct chunks the store already had.
    pub bytes_reused: u64,
    pub manifest_bytes: u64,
}

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
    let (mut uploader, sender) = Uploader::start(store, opts.concurrency, progress.clone());
    let scanned = scan_blocking(dir.to_path_buf(), opts, progress.clone(), sender).await;
    // An upload failure stops the scan too; report the cause, not the symptom.
    let stats = uploader.finish().await?;
    let tree = scanned?;
    progress.finish();

    // A file that moved under us after its scan must not be sealed.
    for src in tree.sources.values() {
        let now = std::fs::metadata(&src.path).map_err(|e| Error::io(&src.path, e))?;
        ensure_unchanged(src, &now, src.size)?;
    }
    seal_manifest(store, &tree.manifest, lease, opts.volume.as_deref(), &stats).await
}

/// Seals `manifest` once every chunk it names is uploaded: makes the chunks durable, checks
/// that the writer lease still holds (chunks found present were safe from collection only
/// while it did), writes the manifest with a conditional create and the volume record.
pub(crate) async fn seal_manifest(
    store: &ChunkStore,
    manifest: &Manifest,
    lease: &WriterLease,
    volume: Option<&str>,
    stats: &UploadStats,
) -> Result<PushReport> {
    let (manifest_bytes, digest) = manifest.seal()?;
    store.sync().await?;
    let manifest_len = manifest_bytes.len() as u64;
    // The lease must still be ours, in the store too: a collector that took it for expired
    // may be sweeping the chunks this manifest reuses.
    lease.confirm().await?;
    let record_of = volume.map(|v| (v, manifest_bytes.clone()));
    store.put_manifest(manifest_bytes).await?;
    // And still ours after: lost in between, the manifest may name swept chunks. Say so
    // (the error names `sealed verify`) rather than report success.
    lease.confirm().await?;
    if let Some((volume, bytes)) = record_of {
        store.put_volume_record(volume, &bytes).await?;
    }

    let mut report = PushReport {
        digest,
        files: 0,
        directories: 0,
        symlinks: 0,
        bytes: manifest.total_size(),
        chunks: 0,
        unique_chunks: manifest.unique_chunks().len() as u64,
        chunks_uploaded: stats.chunks_uploaded,
        bytes_uploaded: stats.bytes_uploaded,
        bytes_reused: stats.bytes_reused,
        manifest_bytes: manifest_len,
    };
    for entry in &manifest.entries {
        match &entry.kind {
            EntryKind::Dir => report.directories += 1,
            EntryKind::Symlink { .. } => report.symlinks += 1,
            EntryKind::File(f) => {
                report.files += 1;
                report.chunks += f.chunks.len() as u64;
            }
        }
    }
    tracing::info!(
        %digest,
        files = report.files,
        bytes = report.bytes,
        chunks_uploaded = report.chunks_uploaded,
        bytes_uploaded = report.bytes_uploaded,
        "sealed"
    );
    Ok(report)
}

async fn scan_blocking(
    dir: PathBuf,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
    sender: ChunkSender,
) -> Result<ScannedTree> {
    let params = opts.params.clone();
    let scan_opts = ScanOptions {
        threads: opts.threads,
        follow_symlinks: opts.follow_symlinks.clone(),
        filter: opts.filter.clone(),
    };
    tokio::task::spawn_blocking(move || {
        let sink = |chunk: &ChunkRef, bytes: &[u8]| sender.send_blocking(chunk, bytes);
        let p = progress.clone();
        scan(
            &dir,
            &params,
            &scan_opts,
            &|total| p.start(Phase::Scan, total),
            &|n| progress.advance(n),
            &sink,
        )
    })
    .await
    .map_err(|e| Error::Other(format!("scan task failed: {e}")))?
}
