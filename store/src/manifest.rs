//! The manifest: a sorted list of entries (directories, regular files with their chunk lists,
//! symlinks) with a deterministic binary encoding. The version digest is BLAKE3 over the encoded
//! bytes. The byte layout is specified in `docs/format.md`; change it only with a new version.

use std::collections::HashSet;

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
        Ok(out)
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
                    let mut sum: u64 = 0;
                    for chunk in &file.chunks {
                        if chunk.len == 0 || chunk.len > self.chunking.max_size {
                            return Err(invalid(format!(
                                "'{}': chunk length {} outside 1..={}",
                                entry.path, chunk.len, self.chunking.max_size
                            )));
                        }
                        sum += u64::from(chunk.len);
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
        Ok(())
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
