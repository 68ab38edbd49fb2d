//! Walking a directory into a manifest: validation of every entry, then chunking and hashing
//! of every regular file on a pool of threads.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use rayon::prelude::*;

use crate::chunker::{ChunkParams, ChunkSink, chunk_reader_with_sink};
use crate::error::{Error, Result};
use crate::manifest::{
    Entry, EntryKind, FileEntry, Manifest, resolve_symlinks, validate_path, validate_symlink_target,
};
use crate::stat_cache::{StatCache, StatKey};

/// Where a file's bytes came from, so push can re-read chunk ranges for upload.
#[derive(Clone, Debug)]
pub struct FileSource {
    pub path: PathBuf,
    pub rel: String,
    pub size: u64,
    pub modified: Option<SystemTime>,
    pub inode: u64,
    /// The stat the walk saw, for the stat cache (`None`: timestamps out of range).
    pub stat: Option<StatKey>,
    pub executable: bool,
}

/// A scanned tree: the manifest and, for each file entry (by path), its source on disk.
pub struct ScannedTree {
    pub manifest: Manifest,
    pub sources: HashMap<String, FileSource>,
    /// Files whose chunks came from the stat cache, unread.
    pub cached: HashSet<String>,
    /// Bytes of file content read (and hashed).
    pub bytes_read: u64,
}

/// Options for a scan.
#[derive(Clone, Debug, Default)]
pub struct ScanOptions {
    /// Threads for chunking and hashing; `None` means every core.
    pub threads: Option<usize>,
    /// Store what symlinks point to instead of the links (a `huggingface-cli download`
    /// snapshot is links into a blob cache); `None` stores links as links.
    pub follow_symlinks: Option<FollowSymlinks>,
    /// Which files (and links) to seal, by their path in the volume.
    pub filter: PathFilter,
    /// Files whose stat matches an entry here are not read: their chunks are the entry's.
    pub stat_cache: Option<Arc<StatCache>>,
}

/// How far `--follow-symlinks` may go: a link is followed only when its target lies under
/// one of `roots` (the pushed directory is always one).
#[derive(Clone, Debug, Default)]
pub struct FollowSymlinks {
    pub roots: Vec<PathBuf>,
}

/// `--include` / `--exclude` globs over paths in the volume, matched as the operator's
/// Hugging Face sync matches them (`*` crosses `/`), so a local snapshot filtered the same
/// way seals the same digest. A directory is kept when a kept entry is inside it.
#[derive(Clone, Debug, Default)]
pub struct PathFilter {
    include: Option<globset::GlobSet>,
    exclude: Option<globset::GlobSet>,
}

impl PathFilter {
    pub fn new(include: &[String], exclude: &[String]) -> Result<Self> {
        let set = |patterns: &[String], flag: &str| -> Result<Option<globset::GlobSet>> {
            if patterns.is_empty() {
                return Ok(None);
            }
            let mut b = globset::GlobSetBuilder::new();
            for p in patterns {
                let glob = globset::GlobBuilder::new(p)
                    .literal_separator(false)
                    .build()
                    .map_err(|e| Error::Other(format!("{flag} {p:?}: {e}")))?;
                b.add(glob);
            }
            b.build()
                .map(Some)
                .map_err(|e| Error::Other(format!("{flag}: {e}")))
        };
        Ok(PathFilter {
            include: set(include, "--include")?,
            exclude: set(exclude, "--exclude")?,
        })
    }

    /// Whether any glob was given (without one every path is kept).
    pub fn is_active(&self) -> bool {
        self.include.is_some() || self.exclude.is_some()
    }

    pub fn keeps(&self, path: &str) -> bool {
        self.include.as_ref().is_none_or(|s| s.is_match(path))
            && !self.exclude.as_ref().is_some_and(|s| s.is_match(path))
    }

    /// Keeps the files and links that match and the directories that hold one of them.
    fn apply(&self, entries: &mut Vec<Entry>, files: &mut Vec<FileSource>) {
        if !self.is_active() {
            return;
        }
        files.retain(|f| self.keeps(&f.rel));
        entries.retain(|e| matches!(e.kind, EntryKind::Dir) || self.keeps(&e.path));
        let mut held = std::collections::HashSet::new();
        let leaves = entries
            .iter()
            .filter(|e| !matches!(e.kind, EntryKind::Dir))
            .map(|e| e.path.as_str())
            .chain(files.iter().map(|f| f.rel.as_str()));
        for path in leaves {
            let mut p = path;
            while let Some((parent, _)) = p.rsplit_once('/') {
                if !held.insert(parent.to_owned()) {
                    break;
                }
                p = parent;
            }
        }
        entries.retain(|e| !matches!(e.kind, EntryKind::Dir) || held.contains(&e.path));
    }
}

/// What a walk carries down: the follow policy and the directories above (by device and
/// inode), so a followed link back up the tree is a loop, not an endless walk.
struct Walk<'a> {
    follow: Option<&'a [PathBuf]>,
    ancestors: Vec<(u64, u64)>,
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
    let roots = match &opts.follow_symlinks {
        Some(f) => Some(follow_roots(root, &f.roots)?),
        None => None,
    };
    let mut w = Walk {
        follow: roots.as_deref(),
        ancestors: vec![(meta.dev(), meta.ino())],
    };
    walk(&mut w, root, "", &mut entries, &mut files)?;
    opts.filter.apply(&mut entries, &mut files);
    if entries.is_empty() && files.is_empty() && opts.filter.is_active() {
        return Err(Error::bad_input(
            root,
            "no file matches --include/--exclude: nothing to seal",
        ));
    }
    // Before any file is read: a tree whose links leave it is refused at once.
    resolve_symlinks(&entries).map_err(|e| Error::bad_input(root.join(&e.link), e.to_string()))?;
    // Files the stat cache vouches for are not read (docs/cli.md, "Re-push at metadata speed").
    let mut cached = HashSet::new();
    let mut to_read = Vec::new();
    for src in &files {
        let hit = opts
            .stat_cache
            .as_deref()
            .zip(src.stat.as_ref())
            .and_then(|(cache, key)| cache.lookup(&src.rel, key));
        match hit {
            Some(hit) => {
                cached.insert(src.rel.clone());
                entries.push(Entry {
                    path: src.rel.clone(),
                    kind: EntryKind::File(FileEntry {
                        executable: src.executable,
                        size: src.size,
                        blake3: hit.blake3,
                        chunks: hit.chunks.clone(),
                    }),
                });
            }
            None => to_read.push(src.clone()),
        }
    }
    on_total(to_read.iter().map(|f: &FileSource| f.size).sum());

    let read = AtomicU64::new(0);
    let counting = |n: u64| {
        read.fetch_add(n, Ordering::Relaxed);
        on_bytes(n);
    };
    let chunked = chunk_files(&to_read, params, opts.threads, &counting, sink)?;
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
    Ok(ScannedTree {
        manifest,
        sources,
        cached,
        bytes_read: read.into_inner(),
    })
}

/// Reads, chunks and hashes `files` on `threads` threads (`None`: every core), handing every
/// chunk to `sink`.
pub(crate) fn chunk_files(
    files: &[FileSource],
    params: &ChunkParams,
    threads: Option<usize>,
    on_bytes: &(dyn Fn(u64) + Sync),
    sink: ChunkSink<'_>,
) -> Result<Vec<(String, FileEntry)>> {
    if files.is_empty() {
        return Ok(Vec::new());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .build()
        .map_err(|e| Error::Other(format!("cannot start hashing threads: {e}")))?;
    pool.install(|| {
        files
            .par_iter()
            .map(|src| chunk_file(src, params, on_bytes, sink).map(|f| (src.rel.clone(), f)))
            .collect::<Result<_>>()
    })
}

/// The canonical roots a followed link may point into: the pushed directory, the blob cache
/// of a Hugging Face snapshot (`REPO/snapshots/REV` links into `REPO/blobs`), and `extra`.
fn follow_roots(root: &Path, extra: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let canon = |p: &Path| fs::canonicalize(p).map_err(|e| Error::io(p, e));
    let root = canon(root)?;
    let mut roots = vec![root.clone()];
    if let Some(repo) = root
        .parent()
        .filter(|p| p.ends_with("snapshots"))
        .and_then(Path::parent)
    {
        let blobs = repo.join("blobs");
        if blobs.is_dir() {
            roots.push(canon(&blobs)?);
        }
    }
    for r in extra {
        roots.push(canon(r)?);
    }
    Ok(roots)
}

fn walk(
    w: &mut Walk<'_>,
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
        let mut path = path;
        let mut meta = fs::symlink_metadata(&path).map_err(|e| Error::io(&path, e))?;
        if meta.file_type().is_symlink()
            && let Some(roots) = w.follow
        {
            path = followed(&path, roots)?;
            meta = fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
        }
        let ft = meta.file_type();
        if ft.is_dir() {
            let id = (meta.dev(), meta.ino());
            if w.ancestors.contains(&id) {
                return Err(Error::bad_input(
                    &path,
                    format!("'{rel}' leads back to a directory above it (a symlink loop)"),
                ));
            }
            entries.push(Entry {
                path: rel.clone(),
                kind: EntryKind::Dir,
            });
            w.ancestors.push(id);
            walk(w, &path, &rel, entries, files)?;
            w.ancestors.pop();
        } else if ft.is_file() {
            files.push(FileSource {
                path,
                rel,
                size: meta.len(),
                modified: meta.modified().ok(),
                inode: meta.ino(),
                stat: StatKey::of(&meta),
                executable: meta.permissions().mode() & 0o111 != 0,
            });
        } else if ft.is_symlink() {
            let target = fs::read_link(&path).map_err(|e| Error::io(&path, e))?;
            let target = target
                .to_str()
                .ok_or_else(|| Error::bad_input(&path, "symlink target is not valid UTF-8"))?;
            validate_symlink_target(&rel, target).map_err(|e| {
                Error::bad_input(
                    &path,
                    format!(
                        "{e} (to seal the target's bytes instead, push with --follow-symlinks)"
                    ),
                )
            })?;
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

/// Where the link at `link` finally points, when that is under one of `roots`: a dangling
/// link, a loop, or a target outside the roots is refused (with `--follow-symlinks` the
/// target's bytes are sealed, so a link to /etc would publish /etc).
fn followed(link: &Path, roots: &[PathBuf]) -> Result<PathBuf> {
    let target = fs::canonicalize(link).map_err(|e| {
        let why = if e.raw_os_error() == Some(libc::ELOOP) {
            "is a symlink loop".to_owned()
        } else if e.kind() == std::io::ErrorKind::NotFound {
            "is a dangling symlink: its target does not exist".to_owned()
        } else {
            format!("cannot be followed: {e}")
        };
        Error::bad_input(link, why)
    })?;
    if !roots.iter().any(|r| target.starts_with(r)) {
        return Err(Error::bad_input(
            link,
            format!(
                "points to {}, outside the pushed directory{}: with --follow-symlinks only \
                 targets under an allowed root are read (add one with --allow-root DIR)",
                target.display(),
                if roots.len() > 1 {
                    " and the allowed roots"
                } else {
                    ""
                }
            ),
        ));
    }
    Ok(target)
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
