//! Pull: materialise a version into a directory, verifying every chunk.
//!
//! Into a new (or empty) directory everything is written into a hidden staging directory
//! beside the destination and renamed into place at the end, so a failed pull leaves nothing
//! that looks complete. Into a directory that already holds files the pull resumes: a file
//! whose content already hashes to the manifest's BLAKE3 is kept, every other one is written
//! beside its place and renamed over it once verified, so an interrupted pull loses at most
//! the files in flight and a pull run again fetches only what is missing or different. Files
//! the version does not name are left alone.

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use tokio::sync::Semaphore;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::manifest::{EntryKind, FileEntry, Manifest};
use crate::progress::{Phase, Progress};
use crate::scan::PathFilter;
use crate::store::ChunkStore;

#[derive(Clone, Debug)]
pub struct PullOptions {
    /// Chunks in flight at once across all files: fetched or fetched and waiting to be
    /// written. It bounds memory (at most this many chunks held) and, divided by the store's
    /// round trip, the rate: 64 chunks of ~1 MiB over 50 ms is ~1.3 GB/s.
    pub concurrency: usize,
    /// Which files and links to pull (`--include`, matched as push matches it); directories
    /// come with what they hold. Default: everything.
    pub filter: PathFilter,
}

/// The default [`PullOptions::concurrency`]: the mount's per-read fetch bound, so that a pull
/// keeps as many chunks in flight as the mount reading one file does.
pub const DEFAULT_CONCURRENCY: usize = 64;

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            concurrency: DEFAULT_CONCURRENCY,
            filter: PathFilter::default(),
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct PullReport {
    pub digest: Digest,
    pub destination: PathBuf,
    /// Files of the version the pull covered (all, or those `--include` selects).
    pub files: u64,
    pub bytes: u64,
    /// Of those, files already in the destination with the right content (hashed), kept.
    pub files_kept: u64,
    pub bytes_kept: u64,
}

pub async fn pull(
    store: &ChunkStore,
    digest: &Digest,
    dest: &Path,
    opts: &PullOptions,
    progress: Arc<dyn Progress>,
) -> Result<PullReport> {
    let manifest = store.get_manifest(digest).await?;
    let selection = Selection::of(&manifest, &opts.filter);
    let mut report = PullReport {
        digest: *digest,
        destination: dest.to_path_buf(),
        files: selection.files.len() as u64,
        bytes: selection.files.iter().map(|(_, f)| f.size).sum(),
        files_kept: 0,
        bytes_kept: 0,
    };
    let Some(replace_empty_dir) = check_destination(dest)? else {
        let (files, bytes) = resume(store, &selection, dest, opts, progress).await?;
        report.files_kept = files;
        report.bytes_kept = bytes;
        return Ok(report);
    };
    let staging = staging_path(dest)?;
    let result = materialise(store, &selection, &staging, opts, progress).await;
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    if replace_empty_dir {
        fs::remove_dir(dest).map_err(|e| Error::io(dest, e))?;
    }
    fs::rename(&staging, dest).map_err(|e| Error::io(dest, e))?;
    Ok(report)
}

/// The entries a pull writes: directories (parents first), files and symlinks.
struct Selection<'a> {
    dirs: Vec<&'a str>,
    files: Vec<(&'a str, &'a FileEntry)>,
    links: Vec<(&'a str, &'a str)>,
}

impl<'a> Selection<'a> {
    fn of(manifest: &'a Manifest, filter: &PathFilter) -> Self {
        let files: Vec<(&str, &FileEntry)> = manifest
            .files()
            .filter(|(path, _)| filter.keeps(path))
            .collect();
        let links: Vec<(&str, &str)> = manifest
            .entries
            .iter()
            .filter_map(|e| match &e.kind {
                EntryKind::Symlink { target } => Some((e.path.as_str(), target.as_str())),
                _ => None,
            })
            .filter(|(path, _)| filter.keeps(path))
            .collect();
        // Without a filter every directory, empty ones too; with one, those holding a pick.
        let held: std::collections::HashSet<&str> = files
            .iter()
            .map(|(p, _)| *p)
            .chain(links.iter().map(|(p, _)| *p))
            .flat_map(|p| p.match_indices('/').map(move |(i, _)| &p[..i]))
            .collect();
        // Entries are sorted, so parents come before children.
        let dirs = manifest
            .entries
            .iter()
            .filter(|e| matches!(e.kind, EntryKind::Dir))
            .map(|e| e.path.as_str())
            .filter(|p| !filter.is_active() || held.contains(p))
            .collect();
        Selection { dirs, files, links }
    }
}

/// `Some(true)`: the destination is an empty directory (replaced at the end); `Some(false)`:
/// it does not exist; `None`: a directory with entries, which the pull resumes into.
fn check_destination(dest: &Path) -> Result<Option<bool>> {
    match fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Some(false)),
        Err(e) => Err(Error::io(dest, e)),
        Ok(m) if m.is_dir() => {
            let mut it = fs::read_dir(dest).map_err(|e| Error::io(dest, e))?;
            Ok(it.next().is_none().then_some(true))
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
    selection: &Selection<'_>,
    root: &Path,
    opts: &PullOptions,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    fs::create_dir(root).map_err(|e| Error::io(root, e))?;
    for dir in &selection.dirs {
        let p = root.join(dir);
        fs::create_dir(&p).map_err(|e| Error::io(&p, e))?;
    }
    progress.start(
        Phase::Download,
        selection.files.iter().map(|(_, f)| f.size).sum(),
    );
    let writes = selection
        .files
        .iter()
        .map(|(rel, file)| (*rel, *file, root.join(rel)))
        .collect();
    write_files(store, writes, opts, progress.clone()).await?;
    for (rel, target) in &selection.links {
        let p = root.join(rel);
        std::os::unix::fs::symlink(target, &p).map_err(|e| Error::io(&p, e))?;
    }
    progress.finish();
    Ok(())
}

/// Into a directory with entries: keeps each file that already has the version's content
/// (hashed, not trusted by size or time), writes the others beside their place and renames
/// them over it. Returns the files and bytes kept.
async fn resume(
    store: &ChunkStore,
    selection: &Selection<'_>,
    root: &Path,
    opts: &PullOptions,
    progress: Arc<dyn Progress>,
) -> Result<(u64, u64)> {
    for dir in &selection.dirs {
        let p = root.join(dir);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::bad_input(
                    &p,
                    "the version has a directory here; move this file away and pull again",
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir(&p).map_err(|e| Error::io(&p, e))?;
            }
            Err(e) => return Err(Error::io(&p, e)),
        }
    }
    // Hashing reads whole files: off the async threads, a few at once.
    let checks = futures::stream::iter(selection.files.iter().copied())
        .map(|(rel, file)| {
            let path = root.join(rel);
            async move {
                let same = tokio::task::spawn_blocking({
                    let path = path.clone();
                    let file = file.clone();
                    move || has_content(&path, &file)
                })
                .await
                .map_err(|e| Error::Other(format!("pull: hashing {rel} stopped: {e}")))??;
                Ok::<_, Error>((rel, file, path, same))
            }
        })
        .buffered(FILES_AT_ONCE)
        .try_collect::<Vec<_>>()
        .await?;
    let (mut kept_files, mut kept_bytes) = (0u64, 0u64);
    let mut writes = vec![];
    for (rel, file, path, same) in checks {
        if same {
            kept_files = kept_files.saturating_add(1);
            kept_bytes = kept_bytes.saturating_add(file.size);
            let mode = if file.executable { 0o755 } else { 0o644 };
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io(&path, e))?;
        } else {
            writes.push((rel, file, path));
        }
    }
    progress.start(Phase::Download, writes.iter().map(|(_, f, _)| f.size).sum());
    let temps: Vec<(PathBuf, PathBuf)> = writes
        .iter()
        .map(|(_, _, path)| Ok((partial_path(path)?, path.clone())))
        .collect::<Result<_>>()?;
    let staged = writes
        .iter()
        .zip(&temps)
        .map(|((rel, file, _), (temp, _))| (*rel, *file, temp.clone()))
        .collect();
    if let Err(e) = write_files(store, staged, opts, progress.clone()).await {
        for (temp, _) in &temps {
            let _ = fs::remove_file(temp);
        }
        return Err(e);
    }
    for (temp, path) in &temps {
        fs::rename(temp, path).map_err(|e| Error::io(path, e))?;
    }
    for (rel, target) in &selection.links {
        let p = root.join(rel);
        match fs::read_link(&p) {
            Ok(have) if have.as_os_str() == std::ffi::OsStr::new(target) => continue,
            Ok(_) => fs::remove_file(&p).map_err(|e| Error::io(&p, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // Something that is not a link: a file is replaced, a directory is not ours.
            Err(_) if p.is_file() => fs::remove_file(&p).map_err(|e| Error::io(&p, e))?,
            Err(e) => return Err(Error::io(&p, e)),
        }
        std::os::unix::fs::symlink(target, &p).map_err(|e| Error::io(&p, e))?;
    }
    progress.finish();
    Ok((kept_files, kept_bytes))
}

/// Whether `path` is a regular file (not a link) whose size and BLAKE3 are `file`'s.
fn has_content(path: &Path, file: &FileEntry) -> Result<bool> {
    let meta = match fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(path, e)),
        Ok(m) => m,
    };
    if meta.is_dir() {
        return Err(Error::bad_input(
            path,
            "the version has a file here; move this directory away and pull again",
        ));
    }
    if !meta.is_file() || meta.len() != file.size {
        return Ok(false);
    }
    let mut hasher = blake3::Hasher::new();
    let mut f = fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(Digest::from(hasher.finalize()) == file.blake3)
}

/// Where a file is written before it is renamed over `path`: beside it, hidden.
fn partial_path(path: &Path) -> Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::bad_input(path, "a file needs a final path component"))?;
    Ok(path.with_file_name(format!(
        ".{}.sealed-partial-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Writes each `(path in the version, file, where)`: small files in parallel, a large file's
/// chunks in parallel too. One pool of slots across files: a single large file gets all of
/// them, many small files share them.
async fn write_files(
    store: &ChunkStore,
    writes: Vec<(&str, &FileEntry, PathBuf)>,
    opts: &PullOptions,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    let concurrency = opts.concurrency.max(1);
    let slots = Arc::new(Semaphore::new(concurrency));
    let per_file = concurrency.min(FILES_AT_ONCE);
    futures::stream::iter(writes)
        .map(|(rel, file, path)| {
            let progress = progress.clone();
            let slots = slots.clone();
            async move {
                write_file(store, &path, rel, file, &slots, concurrency, progress)
                    .await
                    .map_err(|e| match e {
                        Error::Io { .. } | Error::FileDigestMismatch { .. } => e,
                        other => other.in_file(rel),
                    })
            }
        })
        .buffer_unordered(per_file)
        .try_collect::<()>()
        .await
}

/// Files written at once (each with its own open file and hasher).
const FILES_AT_ONCE: usize = 8;

async fn write_file(
    store: &ChunkStore,
    path: &Path,
    rel: &str,
    file: &FileEntry,
    slots: &Semaphore,
    concurrency: usize,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
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
                .map_err(|e| Error::io(path, e))?;
        } else {
            out.write_all(&data).map_err(|e| Error::io(path, e))?;
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
    out.set_len(file.size).map_err(|e| Error::io(path, e))?;
    let mode = if file.executable { 0o755 } else { 0o644 };
    out.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(path, e))?;
    out.sync_all().map_err(|e| Error::io(path, e))
}
