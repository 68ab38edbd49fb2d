//! The inode tree of a sealed version, built once from its manifest.
//!
//! Inode numbers are derived from the manifest: the root is 1 and entry `i` is `i + 2`, so
//! they are stable for the life of the mount (and across remounts of the same digest).

use std::collections::HashMap;

use sealed_store::{EntryKind, FileEntry, Manifest};

pub const ROOT_INO: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeType {
    Dir,
    File,
    Symlink,
}

/// What `getattr` answers. Times are the epoch: a sealed version has no meaningful mtime,
/// and a fixed value keeps listings identical on every node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: NodeType,
    pub size: u64,
    /// Permission bits: 0o555 for directories and executables, 0o444 for files, 0o777 links.
    pub perm: u16,
    pub nlink: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    pub name: String,
    pub kind: NodeType,
}

#[derive(Debug)]
pub(crate) enum Node {
    Dir {
        /// Child inodes sorted by name, for binary-search lookup.
        children: Vec<u64>,
        subdirs: u32,
    },
    File {
        file: FileEntry,
        /// `starts[i]` is the offset of chunk `i`; the last element is the file size.
        starts: Vec<u64>,
    },
    Symlink {
        target: String,
    },
}

#[derive(Debug)]
pub(crate) struct NodeSlot {
    pub parent: u64,
    pub name: String,
    pub node: Node,
}

/// The whole namespace, immutable once built.
#[derive(Debug)]
pub struct Tree {
    nodes: Vec<NodeSlot>,
    total_bytes: u64,
}

impl Tree {
    /// Builds the tree; fails (with a reason) if the manifest breaks any rule of the format
    /// ([`Manifest::validate`], which [`sealed_store::ChunkStore::get_manifest`] applies
    /// too, checked again here for manifests built in code): paths, parents, chunk lengths
    /// that do not add up to the file size, symlinks that lead out of the volume through
    /// each other or never settle.
    pub fn build(manifest: Manifest) -> Result<Tree, String> {
        manifest.validate().map_err(|e| e.to_string())?;
        let mut nodes = Vec::with_capacity(manifest.entries.len() + 1);
        nodes.push(NodeSlot {
            parent: ROOT_INO,
            name: String::new(),
            node: Node::Dir {
                children: Vec::new(),
                subdirs: 0,
            },
        });
        let mut dirs: HashMap<String, u64> = HashMap::new();
        dirs.insert(String::new(), ROOT_INO);
        let mut total_bytes = 0u64;
        for (i, entry) in manifest.entries.into_iter().enumerate() {
            let ino = i as u64 + 2;
            let (parent_path, name) = match entry.path.rsplit_once('/') {
                Some((p, n)) => (p, n),
                None => ("", entry.path.as_str()),
            };
            let Some(&parent) = dirs.get(parent_path) else {
                return Err(format!(
                    "{}: parent directory is not in the manifest",
                    entry.path
                ));
            };
            let name = name.to_owned();
            let node = match entry.kind {
                EntryKind::Dir => {
                    dirs.insert(entry.path.clone(), ino);
                    Node::Dir {
                        children: Vec::new(),
                        subdirs: 0,
                    }
                }
                EntryKind::File(file) => {
                    let mut starts = Vec::with_capacity(file.chunks.len() + 1);
                    let mut offset = 0u64;
                    for chunk in &file.chunks {
                        starts.push(offset);
                        offset = offset
                            .checked_add(u64::from(chunk.len))
                            .ok_or_else(|| format!("{}: chunk lengths overflow", entry.path))?;
                    }
                    starts.push(offset);
                    if offset != file.size {
                        return Err(format!(
                            "{}: chunks add up to {offset} bytes but the size is {}",
                            entry.path, file.size
                        ));
                    }
                    total_bytes = total_bytes.saturating_add(file.size);
                    Node::File { file, starts }
                }
                EntryKind::Symlink { target } => Node::Symlink { target },
            };
            let is_dir = matches!(node, Node::Dir { .. });
            nodes.push(NodeSlot { parent, name, node });
            let parent_slot = &mut nodes[(parent - 1) as usize];
            if let Node::Dir { children, subdirs } = &mut parent_slot.node {
                children.push(ino);
                if is_dir {
                    *subdirs += 1;
                }
            }
        }
        // Children arrive in path order, which is not name order ("a-b" < "a/c"); sort by name.
        let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
        for slot in &mut nodes {
            if let Node::Dir { children, .. } = &mut slot.node {
                children.sort_by(|a, b| {
                    names[(*a - 1) as usize]
                        .as_bytes()
                        .cmp(names[(*b - 1) as usize].as_bytes())
                });
            }
        }
        Ok(Tree { nodes, total_bytes })
    }

    pub(crate) fn slot(&self, ino: u64) -> Option<&NodeSlot> {
        let index = usize::try_from(ino.checked_sub(1)?).ok()?;
        self.nodes.get(index)
    }

    /// Inodes including the root.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes of file content in the version.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub fn attr(&self, ino: u64) -> Option<Attr> {
        let slot = self.slot(ino)?;
        Some(match &slot.node {
            Node::Dir { subdirs, .. } => Attr {
                ino,
                kind: NodeType::Dir,
                size: 4096,
                perm: 0o555,
                nlink: 2 + subdirs,
            },
            Node::File { file, .. } => Attr {
                ino,
                kind: NodeType::File,
                size: file.size,
                perm: if file.executable { 0o555 } else { 0o444 },
                nlink: 1,
            },
            Node::Symlink { target } => Attr {
                ino,
                kind: NodeType::Symlink,
                size: target.len() as u64,
                perm: 0o777,
                nlink: 1,
            },
        })
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Option<u64> {
        let Node::Dir { children, .. } = &self.slot(parent)?.node else {
            return None;
        };
        let at = children
            .binary_search_by(|c| {
                self.slot(*c)
                    .map(|s| s.name.as_bytes())
                    .unwrap_or_default()
                    .cmp(name)
            })
            .ok()?;
        children.get(at).copied()
    }

    pub(crate) fn children(&self, ino: u64) -> Option<&[u64]> {
        match &self.slot(ino)?.node {
            Node::Dir { children, .. } => Some(children),
            _ => None,
        }
    }

    pub fn kind(&self, ino: u64) -> Option<NodeType> {
        self.attr(ino).map(|a| a.kind)
    }

    /// Every regular file with its path, for prefetch selection.
    pub(crate) fn files(&self) -> impl Iterator<Item = (u64, &FileEntry)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| match &slot.node {
                Node::File { file, .. } => Some((i as u64 + 1, file)),
                _ => None,
            })
    }

    /// The `/`-separated path of an inode, relative to the root.
    pub fn path(&self, ino: u64) -> Option<String> {
        let mut parts = Vec::new();
        let mut cur = ino;
        while cur != ROOT_INO {
            let slot = self.slot(cur)?;
            parts.push(slot.name.as_str());
            cur = slot.parent;
        }
        parts.reverse();
        Some(parts.join("/"))
    }
}

/// Indices of the chunks that hold `[offset, end)`; `starts` are the chunk offsets followed
/// by the file size.
pub(crate) fn chunk_range(starts: &[u64], offset: u64, end: u64) -> std::ops::Range<usize> {
    let chunks = starts.len().saturating_sub(1);
    if offset >= end {
        return 0..0;
    }
    // The chunk containing `offset`: the last start <= offset.
    let first = starts[..chunks]
        .partition_point(|&s| s <= offset)
        .saturating_sub(1);
    // The chunks starting before `end`.
    let last = starts[..chunks].partition_point(|&s| s < end);
    first..last.max(first)
}

#[cfg(test)]
mod tests {
    use sealed_store::{ChunkParams, ChunkRef, Digest, Entry};

    use super::*;

    fn file(size: u32) -> EntryKind {
        EntryKind::File(FileEntry {
            executable: false,
            size: u64::from(size),
            blake3: Digest::of(b"x"),
            chunks: vec![ChunkRef {
                digest: Digest::of(b"x"),
                len: size,
            }],
        })
    }

    #[test]
    fn lookup_follows_name_order_not_path_order() {
        let entries = vec![
            Entry {
                path: "a".into(),
                kind: EntryKind::Dir,
            },
            Entry {
                path: "a-b".into(),
                kind: file(3),
            },
            Entry {
                path: "a/c".into(),
                kind: file(5),
            },
            Entry {
                path: "a/c-d".into(),
                kind: EntryKind::Symlink { target: "c".into() },
            },
        ];
        let tree = Tree::build(Manifest {
            chunking: ChunkParams::default(),
            entries,
        })
        .unwrap();
        let a = tree.lookup(ROOT_INO, b"a").unwrap();
        assert_eq!(tree.kind(a), Some(NodeType::Dir));
        assert_eq!(tree.lookup(ROOT_INO, b"a-b"), Some(3));
        let c = tree.lookup(a, b"c").unwrap();
        assert_eq!(tree.attr(c).unwrap().size, 5);
        assert_eq!(tree.path(c).as_deref(), Some("a/c"));
        assert_eq!(tree.lookup(a, b"missing"), None);
        assert_eq!(tree.lookup(c, b"x"), None);
        assert_eq!(tree.attr(0), None);
        assert_eq!(tree.attr(99), None);
        assert_eq!(tree.attr(ROOT_INO).unwrap().nlink, 3);
        assert_eq!(tree.total_bytes(), 8);
    }

    #[test]
    fn rejects_chunks_that_do_not_add_up() {
        let mut kind = file(3);
        if let EntryKind::File(f) = &mut kind {
            f.size = 4;
        }
        let entries = vec![Entry {
            path: "f".into(),
            kind,
        }];
        let err = Tree::build(Manifest {
            chunking: ChunkParams::default(),
            entries,
        })
        .unwrap_err();
        assert!(err.contains("sum to 3, file size is 4"), "{err}");
    }

    #[test]
    fn chunk_range_maps_offsets() {
        let starts = [0, 10, 20, 25];
        assert_eq!(chunk_range(&starts, 0, 1), 0..1);
        assert_eq!(chunk_range(&starts, 9, 11), 0..2);
        assert_eq!(chunk_range(&starts, 10, 20), 1..2);
        assert_eq!(chunk_range(&starts, 0, 25), 0..3);
        assert_eq!(chunk_range(&starts, 24, 25), 2..3);
        assert_eq!(chunk_range(&starts, 5, 5), 0..0);
        assert_eq!(chunk_range(&[0], 0, 0), 0..0);
    }
}
