//! Per-mount caps. The format allows manifests of 10 million entries and 1-byte chunks (up
//! to 1 GiB encoded), so one legal version can need gigabytes of daemon memory, and one
//! 1 MiB read over it can need a million chunk fetches. A node plugin serving many pods
//! refuses such a version at mount time, with an error that names the cap, and bounds the
//! fetches any one read (and any one mount) has in flight.

use sealed_store::{Digest, EntryKind, Manifest};

use crate::error::MountError;
use crate::tree::NodeSlot;

/// Caps on one mounted version. The defaults fit the largest model checkpoints with room to
/// spare: a 405B-parameter checkpoint in bf16 is about 810 GB in a few hundred files, about
/// 800 000 chunks at the 1 MiB average chunk; datasets of small files reach a few hundred
/// thousand entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountLimits {
    /// Files, directories and symlinks in the manifest. Default 1 000 000.
    pub max_entries: u64,
    /// Chunk references, summed over files (a chunk named twice counts twice: each
    /// reference costs memory). Default 4 000 000 (about 4 TiB at 1 MiB chunks).
    pub max_chunks: u64,
    /// Memory the mounted tree is estimated to take, bytes ([`estimate_tree_bytes`]).
    /// Default 512 MiB. The estimate is never below the manifest's encoded size, so a
    /// manifest larger than this is refused before it is parsed.
    pub max_manifest_bytes: u64,
    /// Chunk fetches one read request may have in flight at once; the rest of its chunks
    /// wait their turn. Default 64 (a 1 MiB read of default-sized chunks needs 1 to 5).
    pub max_fetches_per_read: usize,
    /// Chunk fetches the whole mount (every read and the readahead of every open file) may
    /// have in flight at once. Default 256.
    pub max_fetches_per_mount: usize,
}

impl Default for MountLimits {
    fn default() -> Self {
        MountLimits {
            max_entries: 1_000_000,
            max_chunks: 4_000_000,
            max_manifest_bytes: 512 << 20,
            max_fetches_per_read: 64,
            max_fetches_per_mount: 256,
        }
    }
}

/// Estimated memory of a chunk reference in the tree: the reference and its offset.
const CHUNK_BYTES: u64 = (size_of::<sealed_store::ChunkRef>() + size_of::<u64>()) as u64;
/// Estimated memory of an entry besides its names and chunks: its slot and its place in the
/// parent's child list.
const ENTRY_BYTES: u64 = (size_of::<NodeSlot>() + size_of::<u64>()) as u64;

/// Estimated bytes a manifest takes once mounted: per entry its slot, name and symlink
/// target, per chunk reference its digest, length and offset. Saturates.
pub fn estimate_tree_bytes(manifest: &Manifest) -> u64 {
    manifest.entries.iter().fold(0u64, |total, entry| {
        let extra = match &entry.kind {
            EntryKind::Dir => 0,
            EntryKind::File(file) => (file.chunks.len() as u64).saturating_mul(CHUNK_BYTES),
            EntryKind::Symlink { target } => target.len() as u64,
        };
        total
            .saturating_add(ENTRY_BYTES)
            .saturating_add(entry.path.len() as u64)
            .saturating_add(extra)
    })
}

impl MountLimits {
    /// Refuses a manifest whose encoded size alone is over `max_manifest_bytes` (before
    /// parsing it: the tree takes at least as many bytes as the encoding).
    pub fn check_encoded(&self, digest: Digest, encoded_bytes: u64) -> Result<(), MountError> {
        self.check(
            digest,
            "bytes of memory (estimated)",
            "max_manifest_bytes",
            encoded_bytes,
            self.max_manifest_bytes,
        )
    }

    /// Refuses a manifest over any cap, naming the first it is over.
    pub fn check_manifest(&self, digest: Digest, manifest: &Manifest) -> Result<(), MountError> {
        let entries = manifest.entries.len() as u64;
        self.check(digest, "entries", "max_entries", entries, self.max_entries)?;
        let chunks = manifest
            .files()
            .fold(0u64, |n, (_, f)| n.saturating_add(f.chunks.len() as u64));
        self.check(
            digest,
            "chunk references",
            "max_chunks",
            chunks,
            self.max_chunks,
        )?;
        self.check(
            digest,
            "bytes of memory (estimated)",
            "max_manifest_bytes",
            estimate_tree_bytes(manifest),
            self.max_manifest_bytes,
        )
    }

    fn check(
        &self,
        digest: Digest,
        what: &'static str,
        field: &'static str,
        count: u64,
        limit: u64,
    ) -> Result<(), MountError> {
        if count <= limit {
            return Ok(());
        }
        Err(MountError::OverLimit {
            digest,
            what,
            field,
            count,
            limit,
        })
    }

    /// The fetch bounds, never zero (zero would stop every read).
    pub(crate) fn fetch_bounds(&self) -> (usize, usize) {
        (
            self.max_fetches_per_read.max(1),
            self.max_fetches_per_mount.max(1),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_store::{ChunkParams, ChunkRef, Entry, FileEntry};

    fn manifest(files: usize, chunks_each: usize) -> Manifest {
        let entries = (0..files)
            .map(|i| Entry {
                path: format!("f{i:07}"),
                kind: EntryKind::File(FileEntry {
                    executable: false,
                    size: chunks_each as u64,
                    blake3: Digest::of(b""),
                    chunks: vec![
                        ChunkRef {
                            digest: Digest::of(b"x"),
                            len: 1
                        };
                        chunks_each
                    ],
                }),
            })
            .collect();
        Manifest {
            chunking: ChunkParams::default(),
            entries,
        }
    }

    #[test]
    fn each_cap_is_named_with_both_numbers() {
        let d = Digest::of(b"v");
        let limits = MountLimits {
            max_entries: 10,
            max_chunks: 100,
            max_manifest_bytes: 1 << 20,
            ..MountLimits::default()
        };
        assert!(limits.check_manifest(d, &manifest(10, 10)).is_ok());
        let e = limits.check_manifest(d, &manifest(11, 1)).unwrap_err();
        assert!(
            matches!(
                e,
                MountError::OverLimit {
                    field: "max_entries",
                    count: 11,
                    limit: 10,
                    ..
                }
            ),
            "{e}"
        );
        let e = limits.check_manifest(d, &manifest(2, 51)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("102 chunk references") && text.contains("limit of 100"),
            "{text}"
        );
        let e = limits.check_encoded(d, 2 << 20).unwrap_err();
        assert!(e.to_string().contains("max_manifest_bytes"), "{e}");
    }

    #[test]
    fn the_estimate_is_never_below_the_encoding() {
        for (files, chunks) in [(1, 0), (1, 1), (100, 3), (3, 1000)] {
            let m = manifest(files, chunks);
            let encoded = m.encode_unchecked().len() as u64;
            assert!(estimate_tree_bytes(&m) >= encoded, "{files}×{chunks}");
        }
    }
}
