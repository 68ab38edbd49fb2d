//! The manifest: a sorted list of entries (directories, regular files with their chunk lists,
//! symlinks) with a deterministic binary encoding. The version digest is BLAKE3 over the encoded
//! bytes. The byte layout is specified in `docs/format.md`; change it only with a new version.

use std::collections::{HashMap, HashSet};

use crate::chunker::ChunkParams;
use crate::digest::Digest;
use crate::error::{Error, Result};

/// First bytes of every manifest.
pub const MAGIC: &[u8; 8] = b"SEALEDVM";
/// The encoding version written by this crate.
pub const FORMAT_VERSION: u16 = 1;

/// Bounds checked before anything is allocated from untrusted bytes.
pub const MAX_PATH_BYTES: usize = 4096;
pub const MAX_COMPONENT_BYTES: usize = 255;
pub const MAX_ENTRIES: u64 = 10_000_000;
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;
const MAX_NAME_BYTES: usize = 255;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub chunking: ChunkParams,
    /// Sorted by path (bytewise), unique; every parent directory appears before its children.
    pub entries: Vec<Entry>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Relative, `/`-separated, normalised UTF-8 path.
    pub path: String,
    pub kind: EntryKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    Dir,
    File(FileEntry),
    Symlink { target: String },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    pub executable: bool,
    pub size: u64,
    /// BLAKE3 of the whole content, so `b3sum` can check a pulled file.
    pub blake3: Digest,
    pub chunks: Vec<ChunkRef>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkRef {
    pub digest: Digest,
    pub len: u32,
}

impl ChunkRef {
    /// Checks that `data`, the verified bytes of this chunk's digest, are as long as the
    /// manifest declares. A manifest whose lengths lie about its chunks would have readers
    /// serve short or shifted files; every consumer of chunk bytes (verify, pull, the mount)
    /// calls this, and a mismatch is corruption ([`Error::ChunkLengthMismatch`]).
    pub fn check_len(&self, data: &[u8]) -> Result<()> {
        if data.len() as u64 == u64::from(self.len) {
            Ok(())
        } else {
            Err(Error::ChunkLengthMismatch {
                digest: self.digest,
                declared: self.len,
                actual: data.len() as u64,
            })
        }
    }
}

const KIND_DIR: u8 = 0;
const KIND_FILE: u8 = 1;
const KIND_SYMLINK: u8 = 2;
const FLAG_EXECUTABLE: u8 = 1;

impl Manifest {
    /// Encodes and names the manifest: `(bytes, digest)`.
    pub fn seal(&self) -> Result<(Vec<u8>, Digest)> {
        let bytes = self.encode()?;
        let digest = Digest::of(&bytes);
        Ok((bytes, digest))
    }

    /// The canonical encoding. Fails if the manifest breaks an invariant, so an invalid
    /// manifest can never be sealed.
    pub fn encode(&self) -> Result<Vec<u8>> {
        self.validate()?;
        Ok(self.encode_unchecked())
    }

    /// The encoding without the validity checks, for tests and fuzzers that need the bytes
    /// of a manifest a reader must refuse. Never use it to seal: [`Manifest::encode`] checks.
    /// Lengths that do not fit their fields are truncated (the result is then garbage, which
    /// is what a fuzzer wants).
    #[doc(hidden)]
    pub fn encode_unchecked(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.entries.len() * 64);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        put_name(&mut out, &self.chunking.algorithm);
        put_name(&mut out, &self.chunking.implementation);
        out.push(self.chunking.normalization);
        out.extend_from_slice(&self.chunking.min_size.to_le_bytes());
        out.extend_from_slice(&self.chunking.avg_size.to_le_bytes());
        out.extend_from_slice(&self.chunking.max_size.to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for entry in &self.entries {
            match &entry.kind {
                EntryKind::Dir => {
                    out.push(KIND_DIR);
                    put_path(&mut out, &entry.path);
                }
                EntryKind::File(file) => {
                    out.push(KIND_FILE);
                    put_path(&mut out, &entry.path);
                    out.push(if file.executable { FLAG_EXECUTABLE } else { 0 });
                    out.extend_from_slice(&file.size.to_le_bytes());
                    out.extend_from_slice(file.blake3.as_bytes());
                    out.extend_from_slice(&(file.chunks.len() as u32).to_le_bytes());
                    for chunk in &file.chunks {
                        out.extend_from_slice(chunk.digest.as_bytes());
                        out.extend_from_slice(&chunk.len.to_le_bytes());
                    }
                }
                EntryKind::Symlink { target } => {
                    out.push(KIND_SYMLINK);
                    put_path(&mut out, &entry.path);
                    put_path(&mut out, target);
                }
            }
        }
        out
    }

    /// Parses and validates untrusted bytes. Every length is checked against the bytes left
    /// before anything is allocated.
    pub fn parse(bytes: &[u8]) -> Result<Manifest> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(invalid(format!(
                "{} bytes is over the {} byte limit",
                bytes.len(),
                MAX_MANIFEST_BYTES
            )));
        }
        let mut r = Reader { bytes, pos: 0 };
        if r.take(8)? != MAGIC {
            return Err(invalid("not a sealed manifest (bad magic bytes)".into()));
        }
        let version = r.u16()?;
        if version != FORMAT_VERSION {
            return Err(invalid(format!(
                "format version {version} is not supported (this build reads version {FORMAT_VERSION}); upgrade sealed"
            )));
        }
        let algorithm = r.name()?;
        let implementation = r.name()?;
        let normalization = r.u8()?;
        let min_size = r.u32()?;
        let avg_size = r.u32()?;
        let max_size = r.u32()?;
        let chunking = ChunkParams {
            algorithm,
            implementation,
            normalization,
            min_size,
            avg_size,
            max_size,
        };
        let count = r.u64()?;
        // The smallest entry is 1 (kind) + 2 (path length) + 1 (path) bytes.
        if count > MAX_ENTRIES || count > (r.remaining() / 4) as u64 {
            return Err(invalid(format!(
                "entry count {count} is impossible for {} remaining bytes",
                r.remaining()
            )));
        }
        let mut entries = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let kind = r.u8()?;
            let path = r.path()?;
            let kind = match kind {
                KIND_DIR => EntryKind::Dir,
                KIND_FILE => {
                    let flags = r.u8()?;
                    if flags & !FLAG_EXECUTABLE != 0 {
                        return Err(invalid(format!("{path}: unknown file flags {flags:#x}")));
                    }
                    let size = r.u64()?;
                    let blake3 = r.digest()?;
                    let n = r.u32()? as usize;
                    if n > r.remaining() / 36 {
                        return Err(invalid(format!(
                            "{path}: chunk count {n} is impossible for {} remaining bytes",
                            r.remaining()
                        )));
                    }
                    let mut chunks = Vec::with_capacity(n);
                    for _ in 0..n {
                        let digest = r.digest()?;
                        let len = r.u32()?;
                        chunks.push(ChunkRef { digest, len });
                    }
                    EntryKind::File(FileEntry {
                        executable: flags & FLAG_EXECUTABLE != 0,
                        size,
                        blake3,
                        chunks,
                    })
                }
                KIND_SYMLINK => EntryKind::Symlink { target: r.path()? },
                other => return Err(invalid(format!("{path}: unknown entry kind {other}"))),
            };
            entries.push(Entry { path, kind });
        }
        if r.remaining() != 0 {
            return Err(invalid(format!(
                "{} trailing bytes after the last entry",
                r.remaining()
            )));
        }
        let manifest = Manifest { chunking, entries };
        manifest.validate()?;
        Ok(manifest)
    }

    /// Checks every invariant of the format (see `docs/format.md`, "Validity").
    pub fn validate(&self) -> Result<()> {
        self.chunking.validate()?;
        if self.entries.len() as u64 > MAX_ENTRIES {
            return Err(invalid(format!(
                "{} entries is over the {MAX_ENTRIES} entry limit",
                self.entries.len()
            )));
        }
        let mut dirs: HashSet<&str> = HashSet::new();
        let mut previous: Option<&str> = None;
        for entry in &self.entries {
            validate_path(&entry.path)?;
            if let Some(prev) = previous
                && prev.as_bytes() >= entry.path.as_bytes()
            {
                return Err(invalid(format!(
                    "entries out of order or duplicated: '{prev}' then '{}'",
                    entry.path
                )));
            }
            previous = Some(&entry.path);
            if let Some((parent, _)) = entry.path.rsplit_once('/')
                && !dirs.contains(parent)
            {
                return Err(invalid(format!(
                    "'{}' has no directory entry for its parent '{parent}'",
                    entry.path
                )));
            }
            match &entry.kind {
                EntryKind::Dir => {
                    dirs.insert(&entry.path);
                }
                EntryKind::File(file) => {
                    if u32::try_from(file.chunks.len()).is_err() {
                        return Err(invalid(format!(
                            "'{}': {} chunks do not fit the format's u32 count",
                            entry.path,
                            file.chunks.len()
                        )));
                    }
                    let mut sum: u64 = 0;
                    for chunk in &file.chunks {
                        if chunk.len == 0 || chunk.len > self.chunking.max_size {
                            return Err(invalid(format!(
                                "'{}': chunk length {} outside 1..={}",
                                entry.path, chunk.len, self.chunking.max_size
                            )));
                        }
                        sum = sum.checked_add(u64::from(chunk.len)).ok_or_else(|| {
                            invalid(format!("'{}': chunk lengths overflow", entry.path))
                        })?;
                    }
                    if sum != file.size {
                        return Err(invalid(format!(
                            "'{}': chunk lengths sum to {sum}, file size is {}",
                            entry.path, file.size
                        )));
                    }
                }
                EntryKind::Symlink { target } => validate_symlink_target(&entry.path, target)?,
            }
        }
        resolve_symlinks(&self.entries).map_err(|e| invalid(e.to_string()))
    }

    pub fn files(&self) -> impl Iterator<Item = (&str, &FileEntry)> {
        self.entries.iter().filter_map(|e| match &e.kind {
            EntryKind::File(f) => Some((e.path.as_str(), f)),
            _ => None,
        })
    }

    pub fn total_size(&self) -> u64 {
        self.files().map(|(_, f)| f.size).sum()
    }

    /// Every distinct chunk the version needs, with its length, in first-use order.
    pub fn unique_chunks(&self) -> Vec<ChunkRef> {
        let mut seen = HashSet::new();
        self.files()
            .flat_map(|(_, f)| f.chunks.iter().copied())
            .filter(|c| seen.insert(c.digest))
            .collect()
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidManifest(msg)
}

/// A path is relative, `/`-separated, UTF-8 (guaranteed by `str`), without empty, `.` or `..`
/// components, without NUL, and bounded in length.
pub fn validate_path(path: &str) -> Result<()> {
    let bad = |why: &str| invalid(format!("path '{}': {why}", path.escape_debug()));
    if path.is_empty() {
        return Err(bad("empty"));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(bad("longer than 4096 bytes"));
    }
    if path.contains('\0') {
        return Err(bad("contains NUL"));
    }
    if path.starts_with('/') {
        return Err(bad("absolute"));
    }
    for component in path.split('/') {
        match component {
            "" => return Err(bad("empty component (leading, trailing or double '/')")),
            "." | ".." => return Err(bad("'.' or '..' component")),
            c if c.len() > MAX_COMPONENT_BYTES => return Err(bad("component over 255 bytes")),
            _ => {}
        }
    }
    Ok(())
}

/// Symlinks are stored as links and never point out of the volume: the target is relative and,
/// resolved lexically from the link's directory, stays inside the root.
pub fn validate_symlink_target(link: &str, target: &str) -> Result<()> {
    let bad = |why: &str| {
        invalid(format!(
            "symlink '{}' -> '{}': {why}",
            link.escape_debug(),
            target.escape_debug()
        ))
    };
    if target.is_empty() || target.len() > MAX_PATH_BYTES || target.contains('\0') {
        return Err(bad("target empty, over 4096 bytes or containing NUL"));
    }
    if target.starts_with('/') {
        return Err(bad("absolute target points outside the volume"));
    }
    let mut depth: i64 = link.matches('/').count() as i64;
    for component in target.split('/') {
        match component {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return Err(bad("target points outside the volume"));
                }
            }
            _ => depth += 1,
        }
    }
    Ok(())
}

/// Linux follows at most 40 symlinks while resolving one path (`MAXSYMLINKS`); so do we.
pub const MAX_LINK_HOPS: u32 = 40;

/// Why a symlink was refused by [`resolve_symlinks`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("symlink '{}' -> '{}': {why}", .link.escape_debug(), .target.escape_debug())]
pub struct SymlinkError {
    /// The link's path in the tree.
    pub link: String,
    /// Its target, as stored.
    pub target: String,
    pub why: String,
}

/// Resolves every symlink of `entries` through the others, as the kernel would inside the
/// mount or a pulled tree, and refuses the first that leaves the volume or never settles.
///
/// Resolution walks the target one component at a time from the link's directory: a name
/// that is a symlink is replaced by that link's own resolution, `..` goes to the parent of
/// where the walk has got to, and `..` at the root leaves the volume (an escape). A name
/// that does not exist, or that follows a file, is taken lexically (as if it were a
/// directory that might be created later), so a dangling link stays allowed but can never
/// climb out through `..` either. Following more than [`MAX_LINK_HOPS`] links, counted as
/// the kernel counts them (every link followed, nested ones included), is a loop.
///
/// Each link is resolved once (its resolution does not depend on how it was reached), so
/// the work is linear in the bytes of the targets however the links chain. Entries whose
/// parent directory is not among `entries` are refused too (no panic on unchecked input).
/// Regular files may be left out of `entries`: a file resolves as a missing name would.
pub fn resolve_symlinks(entries: &[Entry]) -> std::result::Result<(), SymlinkError> {
    if !entries
        .iter()
        .any(|e| matches!(e.kind, EntryKind::Symlink { .. }))
    {
        return Ok(());
    }
    Resolver::new(entries)?.check_all()
}

/// A node of the resolver: `ROOT`, or an index into the entries.
type NodeId = usize;
const ROOT: NodeId = usize::MAX;

/// Where a walk has got to: an existing node, then `dangling` names below it that do not
/// exist in the tree (they contain no links, so only their count matters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    node: NodeId,
    dangling: usize,
}

#[derive(Clone, Copy)]
enum LinkState {
    Unvisited,
    InProgress,
    /// Where the link leads and how many links following it takes (itself included).
    Done(Place, u32),
}

enum Failure {
    Escape { via: Option<NodeId> },
    Loop,
    Malformed(String),
}

struct Resolver<'a> {
    entries: &'a [Entry],
    /// Parent of every entry.
    parents: Vec<NodeId>,
    /// (parent, name) → entry.
    children: HashMap<(NodeId, &'a str), NodeId>,
    /// Per entry: resolution state, for symlinks.
    links: Vec<LinkState>,
}

impl<'a> Resolver<'a> {
    fn new(entries: &'a [Entry]) -> std::result::Result<Self, SymlinkError> {
        let mut by_path: HashMap<&str, NodeId> = HashMap::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            by_path.insert(e.path.as_str(), i);
        }
        let mut parents = Vec::with_capacity(entries.len());
        let mut children = HashMap::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let (parent, name) = match e.path.rsplit_once('/') {
                None => (ROOT, e.path.as_str()),
                Some((dir, name)) => match by_path.get(dir) {
                    Some(&p) if matches!(entries[p].kind, EntryKind::Dir) => (p, name),
                    _ => {
                        return Err(SymlinkError {
                            link: e.path.clone(),
                            target: String::new(),
                            why: format!("parent '{dir}' is not a directory entry"),
                        });
                    }
                },
            };
            parents.push(parent);
            children.insert((parent, name), i);
        }
        Ok(Resolver {
            entries,
            parents,
            children,
            links: vec![LinkState::Unvisited; entries.len()],
        })
    }

    fn check_all(&mut self) -> std::result::Result<(), SymlinkError> {
        for i in 0..self.entries.len() {
            let EntryKind::Symlink { target } = &self.entries[i].kind else {
                continue;
            };
            let error = |culprit: &Entry, why: String| {
                let target = match &culprit.kind {
                    EntryKind::Symlink { target } => target.clone(),
                    _ => String::new(),
                };
                SymlinkError {
                    link: culprit.path.clone(),
                    target,
                    why,
                }
            };
            match self.resolve_link(i, 0) {
                Ok(_) => {}
                Err((culprit, Failure::Escape { via })) => {
                    let why = match via {
                        Some(v) => format!(
                            "resolved through the symlink '{}' it points outside the volume \
                             ('..' above the root); links are never followed out of the volume",
                            self.entries[v].path.escape_debug()
                        ),
                        None => "target points outside the volume ('..' above the root)".into(),
                    };
                    return Err(error(&self.entries[culprit], why));
                }
                Err((_, Failure::Loop)) => {
                    let why = format!(
                        "symlink loop: resolving it follows more than {MAX_LINK_HOPS} links \
                         without reaching a file or directory"
                    );
                    return Err(SymlinkError {
                        link: self.entries[i].path.clone(),
                        target: target.clone(),
                        why,
                    });
                }
                Err((culprit, Failure::Malformed(why))) => {
                    return Err(error(&self.entries[culprit], why));
                }
            }
        }
        Ok(())
    }

    /// Where link `i` leads, and how many links that takes. `depth` is how many links are
    /// being resolved around this one: more than [`MAX_LINK_HOPS`] is a loop whatever the
    /// counts say, which also bounds the recursion.
    fn resolve_link(
        &mut self,
        i: NodeId,
        depth: u32,
    ) -> std::result::Result<(Place, u32), (NodeId, Failure)> {
        match self.links[i] {
            LinkState::Done(place, hops) => return Ok((place, hops)),
            LinkState::InProgress => return Err((i, Failure::Loop)),
            LinkState::Unvisited => {}
        }
        if depth >= MAX_LINK_HOPS {
            return Err((i, Failure::Loop));
        }
        let entries = self.entries;
        let EntryKind::Symlink { target } = &entries[i].kind else {
            return Err((i, Failure::Malformed("not a symlink".into())));
        };
        if target.starts_with('/') {
            return Err((i, Failure::Escape { via: None }));
        }
        self.links[i] = LinkState::InProgress;
        let mut at = Place {
            node: self.parents[i],
            dangling: 0,
        };
        let mut hops: u32 = 1;
        let mut via = None;
        for component in target.split('/') {
            match component {
                "" | "." => {}
                ".." => {
                    if at.dangling > 0 {
                        at.dangling -= 1;
                    } else if at.node == ROOT {
                        return Err((i, Failure::Escape { via }));
                    } else {
                        at.node = self.parents[at.node];
                    }
                }
                name => {
                    let child = if at.dangling == 0 {
                        self.children.get(&(at.node, name)).copied()
                    } else {
                        None
                    };
                    match child.map(|c| (c, &entries[c].kind)) {
                        Some((c, EntryKind::Dir)) => at.node = c,
                        Some((c, EntryKind::Symlink { .. })) => {
                            let (place, n) = self.resolve_link(c, depth + 1)?;
                            hops = hops.saturating_add(n);
                            if hops > MAX_LINK_HOPS {
                                return Err((i, Failure::Loop));
                            }
                            at = place;
                            via = Some(c);
                        }
                        // A file, or a name that is not there: nothing below it exists.
                        Some((_, EntryKind::File(_))) | None => at.dangling += 1,
                    }
                }
            }
        }
        self.links[i] = LinkState::Done(at, hops);
        Ok((at, hops))
    }
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    // Validated by ChunkParams::validate to be at most 255 bytes.
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn put_path(out: &mut Vec<u8>, s: &str) {
    // Validated to be at most 4096 bytes.
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(invalid(format!(
                "truncated: needed {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn digest(&mut self) -> Result<Digest> {
        Ok(Digest::from_bytes(self.array()?))
    }
    fn utf8(&mut self, n: usize) -> Result<String> {
        let at = self.pos;
        let raw = self.take(n)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| invalid(format!("string at offset {at} is not UTF-8")))
    }
    fn name(&mut self) -> Result<String> {
        let n = self.u8()? as usize;
        if n > MAX_NAME_BYTES {
            return Err(invalid("name too long".into()));
        }
        self.utf8(n)
    }
    fn path(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        if n == 0 || n > MAX_PATH_BYTES {
            return Err(invalid(format!(
                "path length {n} at offset {} outside 1..=4096",
                self.pos
            )));
        }
        self.utf8(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, data: &[u8]) -> Entry {
        let chunks = if data.is_empty() {
            vec![]
        } else {
            vec![ChunkRef {
                digest: Digest::of(data),
                len: data.len() as u32,
            }]
        };
        Entry {
            path: path.into(),
            kind: EntryKind::File(FileEntry {
                executable: false,
                size: data.len() as u64,
                blake3: Digest::of(data),
                chunks,
            }),
        }
    }

    fn sample() -> Manifest {
        Manifest {
            chunking: ChunkParams::default(),
            entries: vec![
                Entry {
                    path: "a".into(),
                    kind: EntryKind::Dir,
                },
                file("a/b.bin", b"hello"),
                Entry {
                    path: "a/link".into(),
                    kind: EntryKind::Symlink {
                        target: "b.bin".into(),
                    },
                },
                file("empty", b""),
            ],
        }
    }

    #[test]
    fn encode_parse_round_trip() {
        let m = sample();
        let bytes = m.encode().unwrap();
        assert_eq!(Manifest::parse(&bytes).unwrap(), m);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().encode().unwrap();
        for n in 0..bytes.len() {
            assert!(Manifest::parse(&bytes[..n]).is_err(), "prefix {n} parsed");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(Manifest::parse(&extra).is_err());
    }

    #[test]
    fn rejects_bad_paths() {
        for p in ["", "/abs", "a/../b", "./a", "a//b", "a/", "a\0b"] {
            assert!(validate_path(p).is_err(), "{p:?} accepted");
        }
        validate_path("dir/ünïcødé/file.safetensors").unwrap();
    }

    #[test]
    fn rejects_escaping_symlinks() {
        validate_symlink_target("a/b", "../c").unwrap();
        validate_symlink_target("a/b", "c/../../d").unwrap();
        validate_symlink_target("a/b", "c/../../../d").unwrap_err();
        validate_symlink_target("b", "/etc/passwd").unwrap_err();
        validate_symlink_target("b", "../x").unwrap_err();
    }

    fn links(dirs: &[&str], links: &[(&str, &str)]) -> Manifest {
        let mut entries: Vec<Entry> = dirs
            .iter()
            .map(|d| Entry {
                path: (*d).into(),
                kind: EntryKind::Dir,
            })
            .chain(links.iter().map(|(p, t)| Entry {
                path: (*p).into(),
                kind: EntryKind::Symlink {
                    target: (*t).into(),
                },
            }))
            .collect();
        entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
        Manifest {
            chunking: ChunkParams::default(),
            entries,
        }
    }

    #[test]
    fn chained_symlinks_that_leave_the_volume_are_refused() {
        // The example: each is lexically fine, together `esc` leads out.
        validate_symlink_target("a/up", "..").unwrap();
        validate_symlink_target("esc", "a/up/../..").unwrap();
        let err = links(&["a"], &[("a/up", ".."), ("esc", "a/up/../..")])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("symlink 'esc' -> 'a/up/../..'")
                && err.contains("through the symlink 'a/up'")
                && err.contains("outside the volume"),
            "{err}"
        );
        // `a/up` alone stays inside.
        links(&["a"], &[("a/up", "..")]).validate().unwrap();
        // Through a dangling name after the link: conservatively refused too (creating
        // `missing` in a pulled tree would open the way out).
        links(&["a"], &[("a/up", ".."), ("x", "a/up/missing/../..")])
            .validate()
            .unwrap_err();
        // Through two links, and with a loop-free chain back down: fine.
        links(
            &["a", "a/b", "c"],
            &[
                ("a/b/top", "../.."),
                ("c/t", "../a/b/top/c"),
                ("d", "c/t/t"),
            ],
        )
        .validate()
        .unwrap();
        // Lexically fine, but the resolved link is shallower than its name.
        let err = links(
            &["a", "a/b"],
            &[("a/b/top", "../.."), ("x", "a/b/top/a/b/top/../..")],
        )
        .validate()
        .unwrap_err()
        .to_string();
        assert!(err.contains("symlink 'x'"), "{err}");
    }

    #[test]
    fn loops_are_refused_and_dangling_links_kept() {
        for (ls, culprit) in [
            (&[("a", "b"), ("b", "a")][..], "'a'"),
            (&[("self", "self")][..], "'self'"),
            (&[("d/l", "l")][..], "'d/l'"),
            (&[("x", "y/z"), ("y", "x/..")][..], "'x'"),
        ] {
            let err = links(&["d"], ls).validate().unwrap_err().to_string();
            assert!(
                err.contains("symlink loop") && err.contains(culprit),
                "{err}"
            );
        }
        links(
            &["d"],
            &[
                ("d/l", "missing"),
                ("x", "d/l/deeper/.."),
                ("y", "nope/../d"),
            ],
        )
        .validate()
        .unwrap();
    }

    #[test]
    fn link_chains_are_bounded_at_forty_hops() {
        let chain = |n: usize| {
            let names: Vec<String> = (0..n).map(|i| format!("l{i:03}")).collect();
            let pairs: Vec<(String, String)> = (0..n)
                .map(|i| {
                    let target = if i == 0 {
                        "file".to_string()
                    } else {
                        names[i - 1].clone()
                    };
                    (names[i].clone(), target)
                })
                .collect();
            let refs: Vec<(&str, &str)> = pairs
                .iter()
                .map(|(a, b)| (a.as_str(), b.as_str()))
                .collect();
            links(&[], &refs)
        };
        chain(40).validate().unwrap();
        let err = chain(41).validate().unwrap_err().to_string();
        assert!(
            err.contains("symlink 'l040'") && err.contains("40 links"),
            "{err}"
        );
        // A long chain is refused without deep recursion, whatever its length.
        chain(100_000).validate().unwrap_err();
    }

    #[test]
    fn each_link_is_resolved_once() {
        // 100,000 links to one `hub` whose target has 2,000 components: walked once (then
        // remembered), not once per link (2 × 10^8 steps, a hostile manifest's CPU bomb).
        let long = vec!["d/."; 1000].join("/");
        let mut ls: Vec<(String, String)> = vec![("hub".into(), long)];
        for i in 0..100_000 {
            ls.push((format!("l{i:06}"), "hub/x/..".into()));
        }
        let refs: Vec<(&str, &str)> = ls.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let m = links(&["d"], &refs);
        let started = std::time::Instant::now();
        m.validate().unwrap();
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    }

    #[test]
    fn resolver_refuses_entries_without_a_parent_directory() {
        let entries = vec![Entry {
            path: "nodir/l".into(),
            kind: EntryKind::Symlink { target: "x".into() },
        }];
        let err = resolve_symlinks(&entries).unwrap_err();
        assert!(err.why.contains("parent 'nodir'"), "{err}");
    }

    #[test]
    fn declared_lengths_are_checked_against_the_bytes() {
        let c = ChunkRef {
            digest: Digest::of(b"hello"),
            len: 5,
        };
        c.check_len(b"hello").unwrap();
        let err = ChunkRef { len: 11, ..c }.check_len(b"hello").unwrap_err();
        assert!(matches!(
            err,
            Error::ChunkLengthMismatch {
                declared: 11,
                actual: 5,
                ..
            }
        ));
    }

    #[test]
    fn lengths_that_do_not_add_up_are_refused_by_parse() {
        let mut m = sample();
        if let EntryKind::File(f) = &mut m.entries[1].kind {
            f.chunks[0].len = 4;
        }
        let err = Manifest::parse(&m.encode_unchecked())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("chunk lengths sum to 4, file size is 5"),
            "{err}"
        );
    }

    #[test]
    fn rejects_missing_parent_unsorted_and_bad_sizes() {
        let mut m = sample();
        m.entries.remove(0);
        assert!(m.encode().unwrap_err().to_string().contains("parent"));

        let mut m = sample();
        m.entries.swap(1, 2);
        assert!(m.encode().unwrap_err().to_string().contains("order"));

        let mut m = sample();
        if let EntryKind::File(f) = &mut m.entries[1].kind {
            f.size += 1;
        }
        assert!(m.encode().unwrap_err().to_string().contains("sum"));
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut bytes = sample().encode().unwrap();
        // Overwrite the entry count (after magic, version and chunking params) with u64::MAX.
        let params_len = 8
            + 2
            + 1
            + "fastcdc-v2020".len()
            + 1
            + ChunkParams::default().implementation.len()
            + 1
            + 12;
        bytes[params_len..params_len + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(
            Manifest::parse(&bytes)
                .unwrap_err()
                .to_string()
                .contains("impossible")
        );
    }
}
