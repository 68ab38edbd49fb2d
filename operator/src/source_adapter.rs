//! Bridges a sync request to the source readers in [`crate::source`]: counts progress for
//! the volume's status and turns their errors into condition reasons.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sealed_store::ChunkStore;

use crate::source::{SyncOptions, SyncProgress, sync_source};
use crate::sync::{Counters, Credentials, SyncFailure, SyncOutcome, SyncRequest};

struct CountingProgress(Arc<Counters>);

impl SyncProgress for CountingProgress {
    fn listed(&self, files: u64, bytes: u64) {
        self.0.files_total.store(files, Ordering::Relaxed);
        self.0.bytes_total.store(bytes, Ordering::Relaxed);
    }
    fn advance(&self, bytes: u64) {
        self.0.bytes_done.fetch_add(bytes, Ordering::Relaxed);
    }
    fn file_done(&self, _path: &str, _bytes: u64) {
        self.0.files_done.fetch_add(1, Ordering::Relaxed);
    }
}

pub async fn sync(
    store: &ChunkStore,
    request: &SyncRequest,
    credentials: &Credentials,
    counters: Arc<Counters>,
) -> Result<SyncOutcome, SyncFailure> {
    let options = SyncOptions {
        volume: Some(request.volume()),
        ..Default::default()
    };
    let progress = Arc::new(CountingProgress(counters));
    match sync_source(store, &request.source, credentials, &options, progress).await {
        Ok(outcome) => Ok(SyncOutcome {
            digest: outcome.digest.to_string(),
            source_revision: Some(outcome.source_revision),
            files: outcome.files,
            bytes: outcome.bytes,
            chunks: outcome.report.unique_chunks,
            bytes_new: outcome.report.bytes_uploaded,
            bytes_reused: outcome.report.bytes_reused,
        }),
        Err(e) => {
            let failure = if e.is_permanent() {
                SyncFailure::new(e.reason(), e.to_string())
            } else {
                SyncFailure::transient(e.reason(), e.to_string())
            };
            Err(failure)
        }
    }
}
