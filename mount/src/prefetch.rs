//! Background prefetch of a whole version, or of the files matching globs, into the node disk
//! cache (`--prefetch all|none|GLOB`). It shares the single-flight table with readers, so a
//! reader that gets there first never causes a second fetch.

use std::sync::Arc;

use futures::StreamExt;
use globset::{Glob, GlobSet, GlobSetBuilder};
use sealed_store::{ChunkRef, FileEntry};

use crate::error::MountError;
use crate::fs::SealedFs;

/// What to prefetch in the background after mounting.
#[derive(Clone, Debug, Default)]
pub enum PrefetchSelection {
    #[default]
    None,
    All,
    /// Files whose path (relative to the root) matches any of these globs.
    Globs(Vec<String>),
}

impl PrefetchSelection {
    /// Parses `all`, `none`, or comma-separated globs (`*.safetensors,tokenizer*`).
    pub fn parse(text: &str) -> Result<PrefetchSelection, MountError> {
        match text.trim() {
            "" | "none" => Ok(PrefetchSelection::None),
            "all" => Ok(PrefetchSelection::All),
            globs => {
                let globs: Vec<String> = globs
                    .split(',')
                    .map(|g| g.trim().to_owned())
                    .filter(|g| !g.is_empty())
                    .collect();
                build(&globs)?;
                Ok(PrefetchSelection::Globs(globs))
            }
        }
    }
}

fn build(globs: &[String]) -> Result<GlobSet, MountError> {
    let mut set = GlobSetBuilder::new();
    for g in globs {
        let glob = Glob::new(g).map_err(|e| MountError::BadPattern {
            pattern: g.clone(),
            reason: e.to_string(),
        })?;
        set.add(glob);
    }
    set.build().map_err(|e| MountError::BadPattern {
        pattern: globs.join(","),
        reason: e.to_string(),
    })
}

/// What a background prefetch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchReport {
    pub files: u64,
    pub chunks: u64,
    pub bytes: u64,
    pub failed_chunks: u64,
}

/// Fetches every chunk of the selected files into the cache, `concurrency` at a time.
pub async fn prefetch(
    fs: Arc<SealedFs>,
    selection: &PrefetchSelection,
    concurrency: usize,
) -> Result<PrefetchReport, MountError> {
    let matcher = match selection {
        PrefetchSelection::None => return Ok(PrefetchReport::default()),
        PrefetchSelection::All => None,
        PrefetchSelection::Globs(globs) => Some(build(globs)?),
    };
    let mut report = PrefetchReport::default();
    let mut chunks: Vec<ChunkRef> = Vec::new();
    let mut files: Vec<FileEntry> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (ino, file) in fs.tree().files() {
        if let Some(m) = &matcher {
            let path = fs.tree().path(ino).unwrap_or_default();
            let name = path.rsplit('/').next().unwrap_or_default();
            if !m.is_match(&path) && !m.is_match(name) {
                continue;
            }
        }
        report.files += 1;
        files.push(file.clone());
        for c in &file.chunks {
            if seen.insert(c.digest) {
                chunks.push(*c);
            }
        }
    }
    let results: Vec<_> = futures::stream::iter(chunks)
        .map(|c| {
            let fs = fs.clone();
            async move { (c, fs.cache().prefetch(fs.store(), &c).await) }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    fs.cache().flush().await;
    // Complete files are assembled for passthrough (`crate::hydrate`).
    for file in &files {
        if let Err(e) = crate::hydrate::assemble(fs.cache(), fs.store(), file).await {
            tracing::warn!(blake3 = %file.blake3, error = %e, "assembling a prefetched file failed");
        }
    }
    for (c, r) in results {
        match r {
            Ok(()) => {
                report.chunks += 1;
                report.bytes += u64::from(c.len);
            }
            Err(e) => {
                report.failed_chunks += 1;
                tracing::warn!(error = %e, "background prefetch of a chunk failed");
            }
        }
    }
    Ok(report)
}
