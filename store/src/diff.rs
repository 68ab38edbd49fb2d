//! Diff two versions: files added, removed and changed, and what pushing the second after the
//! first would upload.

use std::collections::{BTreeMap, HashSet};

use crate::manifest::{EntryKind, Manifest};

#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
pub struct Change {
    pub path: String,
    pub what: String,
}

#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
pub struct DiffReport {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<Change>,
    /// Distinct chunks of the second version that the first lacks, and their bytes: what a
    /// push of the second after the first uploads.
    pub new_chunks: u64,
    pub new_bytes: u64,
    pub total_bytes: u64,
}

fn describe(kind: &EntryKind) -> &'static str {
    match kind {
        EntryKind::Dir => "directory",
        EntryKind::File(_) => "file",
        EntryKind::Symlink { .. } => "symlink",
    }
}

pub fn diff(from: &Manifest, to: &Manifest) -> DiffReport {
    let a: BTreeMap<&str, &EntryKind> = from
        .entries
        .iter()
        .map(|e| (e.path.as_str(), &e.kind))
        .collect();
    let b: BTreeMap<&str, &EntryKind> = to
        .entries
        .iter()
        .map(|e| (e.path.as_str(), &e.kind))
        .collect();
    let added = b
        .keys()
        .filter(|p| !a.contains_key(*p))
        .map(|p| p.to_string())
        .collect();
    let removed = a
        .keys()
        .filter(|p| !b.contains_key(*p))
        .map(|p| p.to_string())
        .collect();
    let mut changed = Vec::new();
    for (path, old) in &a {
        let Some(new) = b.get(path) else { continue };
        let what = match (old, new) {
            (EntryKind::File(x), EntryKind::File(y)) => {
                let mut parts = Vec::new();
                if x.blake3 != y.blake3 {
                    parts.push(format!("content ({} -> {} bytes)", x.size, y.size));
                }
                if x.executable != y.executable {
                    parts.push(format!("executable {} -> {}", x.executable, y.executable));
                }
                parts.join(", ")
            }
            (EntryKind::Symlink { target: x }, EntryKind::Symlink { target: y }) if x != y => {
                format!("target {x} -> {y}")
            }
            (x, y) if describe(x) != describe(y) => format!("{} -> {}", describe(x), describe(y)),
            _ => String::new(),
        };
        if !what.is_empty() {
            changed.push(Change {
                path: path.to_string(),
                what,
            });
        }
    }
    let have: HashSet<_> = from.unique_chunks().into_iter().map(|c| c.digest).collect();
    let fresh: Vec<_> = to
        .unique_chunks()
        .into_iter()
        .filter(|c| !have.contains(&c.digest))
        .collect();
    DiffReport {
        added,
        removed,
        changed,
        new_chunks: fresh.len() as u64,
        new_bytes: fresh.iter().map(|c| u64::from(c.len)).sum(),
        total_bytes: to.total_size(),
    }
}
