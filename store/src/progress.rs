//! Progress reporting, so the CLI can draw bars without the store knowing about terminals.

/// What a long operation is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading, chunking and hashing local files.
    Scan,
    /// Uploading chunks the store lacks.
    Upload,
    /// Downloading and verifying chunks into files.
    Download,
    /// Fetching and verifying chunks in the store.
    Verify,
}

/// Receives progress events. Every method has a no-op default.
pub trait Progress: Send + Sync {
    /// A phase begins; `total_bytes` is its amount of work.
    fn start(&self, _phase: Phase, _total_bytes: u64) {}
    /// `bytes` more of the current phase are done.
    fn advance(&self, _bytes: u64) {}
    /// A chunk of `bytes` had to be uploaded.
    fn uploaded(&self, _bytes: u64) {}
    /// A chunk of `bytes` was already in the store.
    fn reused(&self, _bytes: u64) {}
    /// The current phase is over.
    fn finish(&self) {}
}

/// Reports nothing.
pub struct NoProgress;
impl Progress for NoProgress {}
