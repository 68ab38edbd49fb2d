//! Verify: every chunk of a version is present and hashes to its digest.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use futures::StreamExt;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::manifest::ChunkRef;
use crate::progress::{Phase, Progress};
use crate::store::ChunkStore;

#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProblemKind {
    Missing,
    Corrupt,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ChunkProblem {
    pub chunk: Digest,
    pub problem: ProblemKind,
    /// Files that use the chunk (for a length mismatch: those whose reference is wrong).
    pub files: Vec<String>,
    /// What is wrong, when the kind alone does not say (a length the manifest declares
    /// that the chunk's bytes do not have).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct VerifyReport {
    pub digest: Digest,
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    pub problems: Vec<ChunkProblem>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

pub async fn verify(
    store: &ChunkStore,
    digest: &Digest,
    concurrency: usize,
    progress: Arc<dyn Progress>,
) -> Result<VerifyReport> {
    let manifest = store.get_manifest(digest).await?;
    // Who uses each chunk, by the length each reference declares: a digest fixes its bytes,
    // so two lengths for one digest mean at least one reference is wrong, and each is
    // checked against the bytes.
    let mut users: HashMap<Digest, BTreeMap<u32, Vec<String>>> = HashMap::new();
    for (path, file) in manifest.files() {
        for c in &file.chunks {
            let files = users.entry(c.digest).or_default().entry(c.len).or_default();
            if files.last().map(String::as_str) != Some(path) {
                files.push(path.to_owned());
            }
        }
    }
    let unique = manifest.unique_chunks();
    let total: u64 = unique.iter().map(|c| u64::from(c.len)).sum();
    progress.start(Phase::Verify, total);
    let outcomes: Vec<_> = futures::stream::iter(unique.iter().copied())
        .map(|c| {
            let progress = progress.clone();
            async move {
                let r = store.get_chunk(&c.digest).await;
                progress.advance(u64::from(c.len));
                (c, r)
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    progress.finish();
    let mut problems = Vec::new();
    for (c, outcome) in outcomes {
        let by_len = users.remove(&c.digest).unwrap_or_default();
        let problem = match outcome {
            Ok(data) => {
                // The same check pull and the mount make (`ChunkRef::check_len`), once per
                // declared length.
                for (len, files) in by_len {
                    let reference = ChunkRef {
                        digest: c.digest,
                        len,
                    };
                    if let Err(e) = reference.check_len(&data) {
                        problems.push(ChunkProblem {
                            chunk: c.digest,
                            problem: ProblemKind::Corrupt,
                            files,
                            detail: Some(e.to_string()),
                        });
                    }
                }
                continue;
            }
            Err(Error::MissingChunk { .. }) => ProblemKind::Missing,
            Err(Error::CorruptChunk { .. }) => ProblemKind::Corrupt,
            // An unreachable store is not a verdict on the data: report it as an error.
            Err(e) => return Err(e),
        };
        let mut files: Vec<String> = by_len.into_values().flatten().collect();
        files.sort();
        files.dedup();
        problems.push(ChunkProblem {
            chunk: c.digest,
            problem,
            files,
            detail: None,
        });
    }
    problems.sort_by(|a, b| a.files.cmp(&b.files));
    Ok(VerifyReport {
        digest: *digest,
        chunks_checked: unique.len() as u64,
        bytes_checked: total,
        problems,
    })
}
