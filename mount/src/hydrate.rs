//! Hydrated files: once every chunk of a file is on the node, the file is assembled into one
//! cache file (`files/<BLAKE3>` in the disk cache, so every version with the same content
//! shares it), checked against the manifest's whole-file BLAKE3, and then served to new opens
//! by FUSE passthrough (`crate::passthrough`): reads, `mmap` and `O_DIRECT` no longer enter
//! the daemon.
//!
//! The assembled file *is* the disk cache of its chunks (`DiskCache::finish_file` drops their
//! own copies), so nothing is held twice. It is written from verified chunks only (each comes
//! through the cache tiers, checked against its digest and length), sparse until complete,
//! and renamed into place only when the BLAKE3 of everything written matches: a corrupt chunk
//! fails the assembly, it is never assembled. Until then the file is served chunk by chunk as
//! before, so partial files read as they always did.
//!
//! Assembly starts when a file is released with all its chunks local (on disk, in memory or
//! arriving), and after a background prefetch; one assembly per file BLAKE3 at a time.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use futures::StreamExt;
use sealed_store::{ChunkStore, FileEntry};

use crate::error::FetchError;
use crate::fetch::NodeCache;
use crate::metrics::MountMetrics;

/// Chunks an assembly reads at once (most come from memory or disk).
const ASSEMBLY_CONCURRENCY: usize = 16;

/// Why an assembly did not produce a file.
#[derive(Debug, thiserror::Error)]
pub enum HydrateError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error("assembled file is not the manifest's content: BLAKE3 {actual}, manifest {expected}")]
    WrongContent {
        expected: sealed_store::Digest,
        actual: sealed_store::Digest,
    },
    #[error("writing the assembled file: {0}")]
    Io(#[from] std::io::Error),
}

/// True if `file` has a complete copy on disk (assembled, or its only chunk).
pub(crate) fn is_hydrated(cache: &NodeCache, file: &FileEntry) -> bool {
    cache.disk().is_some_and(|d| d.whole_file(file).is_some())
}

/// Worth assembling now: more than one chunk, not assembled, every chunk local or arriving.
pub(crate) fn ready_to_assemble(cache: &NodeCache, file: &FileEntry) -> bool {
    cache.disk().is_some()
        && file.chunks.len() > 1
        && !is_hydrated(cache, file)
        && file
            .chunks
            .iter()
            .all(|c| cache.is_local_or_coming(&c.digest))
}

/// Starts the assembly of `file` in the background if it is ready and not under way.
pub(crate) fn spawn_if_ready(cache: &NodeCache, store: &ChunkStore, file: &FileEntry) {
    if !ready_to_assemble(cache, file) {
        return;
    }
    let (cache, store, file) = (cache.clone(), store.clone(), file.clone());
    let guard = cache.background_assembly();
    tokio::spawn(async move {
        let _guard = guard;
        if let Err(e) = assemble(&cache, &store, &file).await {
            tracing::warn!(blake3 = %file.blake3, error = %e, "assembling a hydrated file failed");
        }
    });
}

/// Assembles `file` into the disk cache; `Ok(true)` once it is there (now or before),
/// `Ok(false)` if there is no disk cache, no room, or another assembly of it is under way.
pub async fn assemble(
    cache: &NodeCache,
    store: &ChunkStore,
    file: &FileEntry,
) -> Result<bool, HydrateError> {
    let Some(disk) = cache.disk() else {
        return Ok(false);
    };
    if disk.whole_file(file).is_some() {
        return Ok(true);
    }
    if file.chunks.len() < 2 {
        // A file of one chunk is its chunk file; an empty one needs nothing.
        if let Some(chunk) = file.chunks.first() {
            cache.prefetch(store, chunk).await?;
        }
        return Ok(disk.whole_file(file).is_some());
    }
    if !cache.assembling().lock().insert(file.blake3) {
        return Ok(false);
    }
    let result = assemble_once(cache, store, file).await;
    cache.assembling().lock().remove(&file.blake3);
    let metrics = cache.metrics();
    match &result {
        Ok(true) => MountMetrics::inc(&metrics.files_hydrated),
        Ok(false) => {}
        Err(_) => MountMetrics::inc(&metrics.hydration_failures),
    }
    result
}

async fn assemble_once(
    cache: &NodeCache,
    store: &ChunkStore,
    file: &FileEntry,
) -> Result<bool, HydrateError> {
    let Some(disk) = cache.disk() else {
        return Ok(false);
    };
    let Some(tmp) = disk.begin_file(file) else {
        return Ok(false);
    };
    let written = write_file(cache, store, file, &tmp).await;
    let cache2 = cache.clone();
    let file2 = file.clone();
    let tmp2 = tmp.clone();
    match written {
        Ok(()) => {
            tokio::task::spawn_blocking(move || {
                let Some(disk) = cache2.disk() else {
                    return Ok(());
                };
                disk.finish_file(&file2, &tmp2)
            })
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))??;
            tracing::debug!(blake3 = %file.blake3, bytes = file.size, "file hydrated");
            Ok(true)
        }
        Err(e) => {
            let _ = tokio::task::spawn_blocking(move || {
                if let Some(disk) = cache2.disk() {
                    disk.abandon_file(&file2, &tmp2);
                }
            })
            .await;
            Err(e)
        }
    }
}

/// Writes every chunk of `file` at its offset in `tmp` (in order, a few fetched at once),
/// hashing as it goes, and checks the whole against the manifest's BLAKE3.
async fn write_file(
    cache: &NodeCache,
    store: &ChunkStore,
    file: &FileEntry,
    tmp: &std::path::Path,
) -> Result<(), HydrateError> {
    let out = crate::cache::create_private(tmp)?;
    // Sparse until written: the space is reserved in the cache's bound already.
    out.set_len(file.size)?;
    let out = Arc::new(out);
    let mut chunks = futures::stream::iter(file.chunks.iter().copied())
        .map(|c| async move { cache.get_for_assembly(store, &c).await })
        .buffered(ASSEMBLY_CONCURRENCY);
    let mut hasher = blake3::Hasher::new();
    let mut offset = 0u64;
    while let Some(data) = chunks.next().await {
        let data = data?;
        hasher.update(&data);
        let at = offset;
        offset = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| std::io::Error::other("file offset overflows"))?;
        let out = out.clone();
        tokio::task::spawn_blocking(move || out.write_all_at(&data, at))
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))??;
    }
    let actual = sealed_store::Digest::from_bytes(*hasher.finalize().as_bytes());
    if actual != file.blake3 || offset != file.size {
        return Err(HydrateError::WrongContent {
            expected: file.blake3,
            actual,
        });
    }
    let out = out.clone();
    tokio::task::spawn_blocking(move || out.sync_data())
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))??;
    Ok(())
}
