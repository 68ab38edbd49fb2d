//! Progress of a sync, as the caller wants it reported (the operator's counters, a CLI's
//! bar), and the store's ingest progress passed on to it.

use std::sync::Arc;

use sealed_store::Progress;
use sealed_store::progress::Phase;

/// Progress of a sync. Every method has a no-op default; calls come from several tasks.
pub trait SyncReporter: Send + Sync {
    /// The listing is done: this many files and bytes will be streamed.
    fn listed(&self, _files: u64, _bytes: u64) {}
    /// `bytes` more were read from the source and chunked.
    fn advance(&self, _bytes: u64) {}
    /// One more file is sealed into the version.
    fn file_done(&self, _path: &str, _bytes: u64) {}
    /// A chunk of `bytes` had to be uploaded.
    fn uploaded(&self, _bytes: u64) {}
    /// A chunk of `bytes` was already in the store.
    fn reused(&self, _bytes: u64) {}
    /// A failed download of `path` is retried (its bytes are read again).
    fn retry(&self, _path: &str) {}
}

/// Reports nothing.
pub struct NoReporter;
impl SyncReporter for NoReporter {}

/// The store's progress events, passed on.
pub(crate) struct IngestProgress(pub(crate) Arc<dyn SyncReporter>);
impl Progress for IngestProgress {
    fn start(&self, _phase: Phase, _total_bytes: u64) {}
    fn advance(&self, bytes: u64) {
        self.0.advance(bytes);
    }
    fn uploaded(&self, bytes: u64) {
        self.0.uploaded(bytes);
    }
    fn reused(&self, bytes: u64) {
        self.0.reused(bytes);
    }
}
