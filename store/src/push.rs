//! Push: scan a directory, upload only the chunks the store lacks, then seal the manifest.
//!
//! Order matters for "nothing lost": every chunk is uploaded and made durable before the
//! manifest that names it is written, and the manifest is written with a conditional create.
//! An interrupted push leaves only chunks (harmless, reused by the next push), never a
//! manifest with holes.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::chunker::ChunkParams;
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::progress::{Phase, Progress};
use crate::scan::{FileSource, ScanOptions, ScannedTree, ensure_unchanged, scan};
use crate::store::{ChunkStore, validate_volume_name};

#[derive(Clone, Debug)]
pub struct PushOptions {
    /// Threads for chunking and hashing (`None`: every core).
    pub threads: Option<usize>,
    /// Chunk existence checks and uploads in flight at once.
    pub concurrency: usize,
    /// Record the version under this volume name (`ns/name`).
    pub volume: Option<String>,
    pub params: ChunkParams,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            threads: None,
            concurrency: 16,
            volume: None,
            params: ChunkParams::default(),
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
    pub bytes_reused: u64,
    pub manifest_bytes: u64,
}

/// Where a chunk's bytes can be read from.
#[derive(Clone)]
struct ChunkSource {
    file: Arc<FileSource>,
    offset: u64,
    len: u32,
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
    let tree = scan_blocking(dir.to_path_buf(), opts, progress.clone()).await?;
    let (manifest_bytes, digest) = tree.manifest.seal()?;

    // First place each distinct chunk appears, so it can be read back for upload.
    let mut sources: HashMap<Digest, ChunkSource> = HashMap::new();
    let (mut files, mut directories, mut symlinks, mut chunks) = (0u64, 0u64, 0u64, 0u64);
    for entry in &tree.manifest.entries {
        match &entry.kind {
            crate::EntryKind::Dir => directories += 1,
            crate::EntryKind::Symlink { .. } => symlinks += 1,
            crate::EntryKind::File(f) => {
                files += 1;
                chunks += f.chunks.len() as u64;
                let src = Arc::new(tree.sources[&entry.path].clone());
                let mut offset = 0u64;
                for c in &f.chunks {
                    sources.entry(c.digest).or_insert_with(|| ChunkSource {
                        file: src.clone(),
                        offset,
                        len: c.len,
                    });
                    offset += u64::from(c.len);
                }
            }
        }
    }
    let unique_chunks = sources.len() as u64;
    let unique_bytes: u64 = sources.values().map(|s| u64::from(s.len)).sum();
    let bytes = tree.manifest.total_size();

    // Ask the store which chunks it lacks.
    let missing: Vec<(Digest, ChunkSource)> = futures::stream::iter(sources)
        .map(|(digest, src)| async move {
            let present = store.has_chunk(&digest).await?;
            Ok::<_, Error>((digest, src, present))
        })
        .buffer_unordered(opts.concurrency.max(1) * 4)
        .try_filter_map(|(digest, src, present)| {
            let progress = progress.clone();
            async move {
                if present {
                    progress.reused(u64::from(src.len));
                    Ok(None)
                } else {
                    Ok(Some((digest, src)))
                }
            }
        })
        .try_collect()
        .await?;
    let chunks_uploaded = missing.len() as u64;
    let bytes_uploaded: u64 = missing.iter().map(|(_, s)| u64::from(s.len)).sum();

    progress.start(Phase::Upload, bytes_uploaded);
    futures::stream::iter(missing)
        .map(|(digest, src)| {
            let progress = progress.clone();
            async move {
                let len = u64::from(src.len);
                let data = read_chunk(src, digest).await?;
                store.put_chunk(&digest, data).await?;
                progress.uploaded(len);
                progress.advance(len);
                Ok::<_, Error>(())
            }
        })
        .buffer_unordered(opts.concurrency.max(1))
        .try_collect::<()>()
        .await?;
    progress.finish();

    // A file that moved under us after its scan must not be sealed.
    for src in tree.sources.values() {
        let now = std::fs::metadata(&src.path).map_err(|e| Error::io(&src.path, e))?;
        ensure_unchanged(src, &now, src.size)?;
    }
    store.sync().await?;
    let manifest_len = manifest_bytes.len() as u64;
    let sealed = store.put_manifest(manifest_bytes).await?;
    debug_assert_eq!(sealed, digest);
    if let Some(volume) = &opts.volume {
        store.put_volume_record(volume, &digest).await?;
    }
    tracing::info!(%digest, files, bytes, chunks_uploaded, bytes_uploaded, "sealed");
    Ok(PushReport {
        digest,
        files,
        directories,
        symlinks,
        bytes,
        chunks,
        unique_chunks,
        chunks_uploaded,
        bytes_uploaded,
        bytes_reused: unique_bytes - bytes_uploaded,
        manifest_bytes: manifest_len,
    })
}

async fn scan_blocking(
    dir: PathBuf,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
) -> Result<ScannedTree> {
    let params = opts.params.clone();
    let scan_opts = ScanOptions {
        threads: opts.threads,
    };
    tokio::task::spawn_blocking(move || {
        let p = progress.clone();
        let tree = scan(
            &dir,
            &params,
            &scan_opts,
            &|total| p.start(Phase::Scan, total),
            &|n| progress.advance(n),
        );
        p.finish();
        tree
    })
    .await
    .map_err(|e| Error::Other(format!("scan task failed: {e}")))?
}

/// Reads a chunk back from its file and checks it still hashes to its digest.
async fn read_chunk(src: ChunkSource, digest: Digest) -> Result<Bytes> {
    tokio::task::spawn_blocking(move || {
        let path = &src.file.path;
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut buf = vec![0u8; src.len as usize];
        file.read_exact_at(&mut buf, src.offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::FileChanged {
                    path: path.clone(),
                    detail: "it became shorter".into(),
                }
            } else {
                Error::io(path, e)
            }
        })?;
        if Digest::of(&buf) != digest {
            return Err(Error::FileChanged {
                path: path.clone(),
                detail: format!("bytes at offset {} no longer match", src.offset),
            });
        }
        Ok(Bytes::from(buf))
    })
    .await
    .map_err(|e| Error::Other(format!("read task failed: {e}")))?
}
