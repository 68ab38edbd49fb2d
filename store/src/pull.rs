//! Pull: materialise a version into a directory, verifying every chunk.
//!
//! Everything is written into a hidden staging directory beside the destination and renamed
//! into place at the end, so a failed pull leaves nothing that looks complete.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use tokio::sync::Semaphore;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::manifest::{EntryKind, FileEntry};
use crate::progress::{Phase, Progress};
use crate::store::ChunkStore;

#[derive(Clone, Debug)]
pub struct PullOptions {
    /// Chunks in flight at once across all files: fetched or fetched and waiting to be
    /// written. It bounds memory (at most this many chunks held) and, divided by the store's
    /// round trip, the rate: 64 chunks of ~1 MiB over 50 ms is ~1.3 GB/s.
    pub concurrency: usize,
}

/// The default [`PullOptions::concurrency`]: the mount's per-read fetch bound, so that a pull
/// keeps as many chunks in flight as the mount reading one file does.
pub const DEFAULT_CONCURRENCY: usize = 64;

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            concurrency: DEFAULT_CONCURRENCY,
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct PullReport {
    pub digest: Digest,
    pub destination: PathBuf,
    pub files: u64,
    pub bytes: u64,
}

pub async fn pull(
    store: &ChunkStore,
    digest: &Digest,
    dest: &Path,
    opts: &PullOptions,
    progress: Arc<dyn Progress>,
) -> Result<PullReport> {
    let manifest = store.get_manifest(digest).await?;
    let replace_empty_dir = check_destination(dest)?;
    let staging = staging_path(dest)?;
    let result = materialise(store, &manifest, &staging, opts, progress).await;
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    if replace_empty_dir {
        fs::remove_dir(dest).map_err(|e| Error::io(dest, e))?;
    }
    fs::rename(&staging, dest).map_err(|e| Error::io(dest, e))?;
    Ok(PullReport {
        digest: *digest,
        destination: dest.to_path_buf(),
        files: manifest.files().count() as u64,
        bytes: manifest.total_size(),
    })
}

/// The destination must not exist, or be an empty directory (returns true then).
fn check_destination(dest: &Path) -> Result<bool> {
    match fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(dest, e)),
        Ok(m) if m.is_dir() => {
            let mut it = fs::read_dir(dest).map_err(|e| Error::io(dest, e))?;
            if it.next().is_some() {
                Err(Error::bad_input(
                    dest,
                    "destination is not empty; choose a new directory",
                ))
            } else {
                Ok(true)
            }
        }
        Ok(_) => Err(Error::bad_input(
            dest,
            "destination exists and is not a directory",
        )),
    }
}

fn staging_path(dest: &Path) -> Result<PathBuf> {
    let name = dest
        .file_name()
        .ok_or_else(|| Error::bad_input(dest, "destination needs a final path component"))?;
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok(parent.join(format!(
        ".{}.sealed-partial-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

async fn materialise(
    store: &ChunkStore,
    manifest: &crate::Manifest,
    root: &Path,
    opts: &PullOptions,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    fs::create_dir(root).map_err(|e| Error::io(root, e))?;
    // Directories first (entries are sorted, so parents come before children).
    for entry in &manifest.entries {
        if matches!(entry.kind, EntryKind::Dir) {
            let p = root.join(&entry.path);
            fs::create_dir(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    progress.start(Phase::Download, manifest.total_size());
    let files: Vec<(&str, &FileEntry)> = manifest.files().collect();
    // Small files in parallel; a large file's chunks are fetched in parallel too. One pool of
    // slots across files: a single large file gets all of them, many small files share them.
    let concurrency = opts.concurrency.max(1);
    let slots = Arc::new(Semaphore::new(concurrency));
    let per_file = concurrency.min(FILES_AT_ONCE);
    futures::stream::iter(files)
        .map(|(path, file)| {
            let progress = progress.clone();
            let slots = slots.clone();
            async move {
                write_file(store, root, path, file, &slots, concurrency, progress)
                    .await
                    .map_err(|e| match e {
                        Error::Io { .. } | Error::FileDigestMismatch { .. } => e,
                        other => other.in_file(path),
                    })
            }
        })
        .buffer_unordered(per_file)
        .try_collect::<()>()
        .await?;
    for entry in &manifest.entries {
        if let EntryKind::Symlink { target } = &entry.kind {
            let p = root.join(&entry.path);
            std::os::unix::fs::symlink(target, &p).map_err(|e| Error::io(&p, e))?;
        }
    }
    progress.finish();
    Ok(())
}

/// Files written at once (each with its own open file and hasher).
const FILES_AT_ONCE: usize = 8;

async fn write_file(
    store: &ChunkStore,
    root: &Path,
    rel: &str,
    file: &FileEntry,
    slots: &Semaphore,
    concurrency: usize,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    let path = root.join(rel);
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    // Every chunk is checked against its digest and its declared length, and the whole
    // content against the file's BLAKE3: a manifest that lies about either leaves nothing.
    // A chunk holds its slot from the request until it is written, so fetched chunks waiting
    // for an earlier one count against the bound too. No deadlock: a file's chunks ask for
    // slots in file order and the semaphore is fair, so each file's next chunk to write
    // always has a slot before its later ones.
    let mut chunks = futures::stream::iter(file.chunks.iter())
        .map(|c| async move {
            // The pool is never closed; a closed one would be a bug, not a reason to panic.
            let slot = slots
                .acquire()
                .await
                .map_err(|_| Error::Other("pull: the chunk slots were closed".into()))?;
            let data = store.get_chunk_checked(c).await?;
            Ok::<_, Error>((slot, data))
        })
        .buffered(concurrency);
    let mut whole = blake3::Hasher::new();
    let mut written: u64 = 0;
    while let Some((_slot, data)) = chunks.try_next().await? {
        whole.update(&data);
        written = written.saturating_add(data.len() as u64);
        // All-zero chunks become holes: a sparse 4 GiB file stays sparse.
        if data.iter().all(|&b| b == 0) {
            out.seek(SeekFrom::Current(data.len() as i64))
                .map_err(|e| Error::io(&path, e))?;
        } else {
            out.write_all(&data).map_err(|e| Error::io(&path, e))?;
        }
        progress.advance(data.len() as u64);
    }
    let actual = Digest::from(whole.finalize());
    if written != file.size || actual != file.blake3 {
        return Err(Error::FileDigestMismatch {
            path: rel.to_owned(),
            expected: file.blake3,
            actual,
        });
    }
    out.set_len(file.size).map_err(|e| Error::io(&path, e))?;
    let mode = if file.executable { 0o755 } else { 0o644 };
    out.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(&path, e))?;
    out.sync_all().map_err(|e| Error::io(&path, e))
}
