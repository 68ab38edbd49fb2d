//! Verify: every chunk of a version is present and hashes to its digest.

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;

use crate::digest::Digest;
use crate::error::{Error, Result};
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
    /// Files that use the chunk.
    pub files: Vec<String>,
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
    let mut users: HashMap<Digest, Vec<String>> = HashMap::new();
    for (path, file) in manifest.files() {
        for c in &file.chunks {
            let files = users.entry(c.digest).or_default();
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
        let problem = match outcome {
            Ok(_) => continue,
            Err(Error::MissingChunk { .. }) => ProblemKind::Missing,
            Err(Error::CorruptChunk { .. }) => ProblemKind::Corrupt,
            // An unreachable store is not a verdict on the data: report it as an error.
            Err(e) => return Err(e),
        };
        problems.push(ChunkProblem {
            chunk: c.digest,
            problem,
            files: users.remove(&c.digest).unwrap_or_default(),
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
