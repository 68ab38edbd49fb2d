//! How a sync runs: its options.

use std::time::Duration;

use crate::limits::SourceLimits;
use crate::policy::SourcePolicy;

/// How a sync runs.
#[derive(Clone, Debug)]
pub struct SyncOptions {
    /// Record the version under this volume name (`namespace/name`) in the store.
    pub volume: Option<String>,
    /// Chunk existence checks and uploads in flight at once.
    pub concurrency: usize,
    /// Files downloaded at once.
    pub parallel_files: usize,
    /// Retries of a failed request (5xx, 429, connection errors), and of a file whose
    /// download broke off, with exponential backoff.
    pub retries: u32,
    /// Connect and read timeout of each request (not of a whole download).
    pub timeout: Duration,
    /// What may be read and how; checked before any request. The default is the strictest.
    pub policy: SourcePolicy,
    /// How much listing a source may send ([`crate::limits`]).
    pub limits: SourceLimits,
}

impl Default for SyncOptions {
    fn default() -> Self {
        SyncOptions {
            volume: None,
            concurrency: 16,
            parallel_files: 4,
            retries: 5,
            timeout: Duration::from_secs(60),
            policy: SourcePolicy::default(),
            limits: SourceLimits::default(),
        }
    }
}
