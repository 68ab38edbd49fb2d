//! Walking a directory into a manifest: validation of every entry, then chunking and hashing
//! of every regular file on a pool of threads.

use std::collections::HashMap;
use std::fs::{self, File};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rayon::prelude::*;

use crate::chunker::{ChunkParams, ChunkSink, chunk_reader_with_sink};
use crate::error::{Error, Result};
use crate::manifest::{
    Entry, EntryKind, FileEntry, Manifest, resolve_symlinks, validate_path, validate_symlink_target,
};

/// Where a file's bytes came from, so push can re-read chunk ranges for upload.
#[derive(Clone, Debug)]
pub struct FileSource {
    pub path: PathBuf,
    pub rel: String,
    pub size: u64,
    pub modified: Option<SystemTime>,
    pub inode: u64,
}

/// A scanned tree: the manifest and, for each file entry (by path), its source on disk.
pub struct ScannedTree {
    pub manifest: Manifest,
    pub sources: HashMap<String, FileSource>,
}

/// Options for a scan.
#[derive(Clone, Debug, Default)]
pub struct ScanOptions {
    /// Threads for chunking and hashing; `None` means every core.
    pub threads: Option<usize>,
}

/// Walks `root` and chunks every file. `on_bytes` is told of bytes read.
pub fn scan(
    root: &Path,
    params: &ChunkParams,
    opts: &ScanOptions,
    on_total: &dyn Fn(u64),
    on_bytes: &(dyn Fn(u64) + Sync),
    sink: ChunkSink<'_>,
) -> Result<ScannedTree> {
    params.ensure_supported()?;
    let meta = fs::metadata(root).map_err(|e| Error::io(root, e))?;
    if !meta.is_dir() {
        return Err(Error::bad_input(root, "not a directory"));
    }
    let mut entries = Vec::new();
    let mut files = Vec::new();
    walk(root, "", &mut entries, &mut files)?;
    // Before any file is read: a tree whose links leave it is refused at once.
    resolve_symlinks(&entries).map_err(|e| Error::bad_input(root.join(&e.link), e.to_string()))?;
    on_total(files.iter().map(|f: &FileSource| f.size).sum());

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.unwrap_or(0))
        .build()
        .map_err(|e| Error::Other(format!("cannot start hashing threads: {e}")))?;
    let chunked: Vec<(String, FileEntry)> = pool.install(|| {
        files
            .par_iter()
            .map(|src| chunk_file(src, params, on_bytes, sink).map(|f| (src.rel.clone(), f)))
            .collect::<Result<_>>()
    })?;
    for (rel, file) in chunked {
        entries.push(Entry {
            path: rel,
            kind: EntryKind::File(file),
        });
    }
    entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let manifest = Manifest {
        chunking: params.clone(),
        entries,
    };
    manifest.validate()?;
    let sources = files.into_iter().map(|f| (f.rel.clone(), f)).collect();
    Ok(ScannedTree { manifest, sources })
}

fn walk(
    dir: &Path,
    rel_dir: &str,
    entries: &mut Vec<Entry>,
    files: &mut Vec<FileSource>,
) -> Result<()> {
    let mut children: Vec<_> = fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .collect::<std::io::Result<_>>()
        .map_err(|e| Error::io(dir, e))?;
    children.sort_by_key(|c| c.file_name());
    for child in children {
        let path = child.path();
        let name = child.file_name();
        let name = name.to_str().ok_or_else(|| {
            Error::bad_input(
                &path,
                "file name is not valid UTF-8; rename it (manifests store UTF-8 paths)",
            )
        })?;
        let rel = if rel_dir.is_empty() {
            name.to_owned()
        } else {
            format!("{rel_dir}/{name}")
        };
        validate_path(&rel).map_err(|e| Error::bad_input(&path, e.to_string()))?;
        let meta = fs::symlink_metadata(&path).map_err(|e| Error::io(&path, e))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            entries.push(Entry {
                path: rel.clone(),
                kind: EntryKind::Dir,
            });
            walk(&path, &rel, entries, files)?;
        } else if ft.is_file() {
            files.push(FileSource {
                path,
                rel,
                size: meta.len(),
                modified: meta.modified().ok(),
                inode: meta.ino(),
            });
        } else if ft.is_symlink() {
            let target = fs::read_link(&path).map_err(|e| Error::io(&path, e))?;
            let target = target
                .to_str()
                .ok_or_else(|| Error::bad_input(&path, "symlink target is not valid UTF-8"))?;
            validate_symlink_target(&rel, target)
                .map_err(|e| Error::bad_input(&path, e.to_string()))?;
            entries.push(Entry {
                path: rel,
                kind: EntryKind::Symlink {
                    target: target.to_owned(),
                },
            });
        } else {
            let what = if ft.is_socket() {
                "a socket"
            } else if ft.is_fifo() {
                "a FIFO"
            } else if ft.is_block_device() || ft.is_char_device() {
                "a device"
            } else {
                "of an unknown type"
            };
            return Err(Error::bad_input(
                &path,
                format!("is {what}: only regular files, directories and symlinks can be sealed"),
            ));
        }
    }
    Ok(())
}

/// Resolves every symlink through the others, as the kernel would inside the mount or a
/// pulled tree ([`resolve_symlinks`]), and fails on one that leaves the volume (`a/up -> ..`
/// with `esc -> a/up/../..`) or never settles (a loop). Dangling links are allowed: they
/// are stored as links. Files may be missing from `entries` (they resolve as missing names).
pub(crate) fn check_symlink_loops(entries: &[Entry]) -> Result<()> {
    resolve_symlinks(entries).map_err(|e| Error::bad_input(e.link.clone(), e.to_string()))
}

fn chunk_file(
    src: &FileSource,
    params: &ChunkParams,
    on_bytes: &(dyn Fn(u64) + Sync),
    sink: ChunkSink<'_>,
) -> Result<FileEntry> {
    let file = File::open(&src.path).map_err(|e| Error::io(&src.path, e))?;
    let before = file.metadata().map_err(|e| Error::io(&src.path, e))?;
    let content = chunk_reader_with_sink(&file, params, on_bytes, sink)
        .map_err(|e| Error::io(&src.path, e))?;
    let after = fs::metadata(&src.path).map_err(|e| Error::io(&src.path, e))?;
    ensure_unchanged(src, &after, content.size)?;
    Ok(FileEntry {
        executable: before.permissions().mode() & 0o111 != 0,
        size: content.size,
        blake3: content.blake3,
        chunks: content.chunks,
    })
}

/// A file whose size, inode or mtime moved while we read it fails the push.
pub(crate) fn ensure_unchanged(
    src: &FileSource,
    now: &fs::Metadata,
    bytes_read: u64,
) -> Result<()> {
    let changed = |detail: String| Error::FileChanged {
        path: src.path.clone(),
        detail,
    };
    if bytes_read != src.size || now.len() != src.size {
        return Err(changed(format!(
            "size was {}, read {bytes_read}, now {}",
            src.size,
            now.len()
        )));
    }
    if now.ino() != src.inode || now.modified().ok() != src.modified {
        return Err(changed("modification time or inode moved".into()));
    }
    Ok(())
}
