//! Errors of the store crate. Each one names the thing and, where it helps, what to do.

use std::path::PathBuf;

use crate::digest::Digest;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("malformed digest '{input}': expected blake3:<64 lowercase hex characters>")]
    MalformedDigest { input: String },

    #[error("invalid manifest: {0}")]
    InvalidManifest(String),

    #[error("manifest {digest} is corrupt in the store: its bytes hash to {actual}")]
    ManifestDigestMismatch { digest: Digest, actual: Digest },

    #[error("version {digest} not found in store {store}: check the digest, or push it first")]
    UnknownVersion { digest: Digest, store: String },

    #[error("chunk {digest} is missing from store {store}")]
    MissingChunk { digest: Digest, store: String },

    #[error("chunk {digest} is corrupt in store {store}: its bytes hash to {actual}")]
    CorruptChunk {
        digest: Digest,
        actual: Digest,
        store: String,
    },

    #[error(
        "chunk {digest} is {actual} bytes but the manifest declares {declared}: the manifest \
         does not describe its chunks (corrupt); no bytes of it are served (push the version \
         again from its source)"
    )]
    ChunkLengthMismatch {
        digest: Digest,
        declared: u32,
        actual: u64,
    },

    #[error(
        "file '{path}': its pulled content hashes to {actual} but the manifest records \
         {expected}; the version is corrupt, nothing was left at the destination (run `sealed \
         verify`, push the version again from its source)"
    )]
    FileDigestMismatch {
        path: String,
        expected: Digest,
        actual: Digest,
    },

    #[error("{what} {value} is out of range: {bound}")]
    OutOfRange {
        what: String,
        value: String,
        bound: String,
    },

    #[error("store endpoint '{endpoint}' {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },

    #[error("invalid store URL '{url}': {reason}")]
    InvalidStoreUrl { url: String, reason: String },

    #[error("store {store} does not exist: {reason}")]
    StoreNotFound { store: String, reason: String },

    #[error("store {store}: {source}")]
    Backend {
        store: String,
        #[source]
        source: object_store::Error,
    },

    #[error("store {store}: timed out after {seconds}s waiting for {what}")]
    Timeout {
        store: String,
        what: String,
        seconds: u64,
    },

    #[error("{path}: {reason}")]
    BadInput { path: PathBuf, reason: String },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "{path} changed while it was being pushed ({detail}); nothing was sealed, push again once it is stable"
    )]
    FileChanged { path: PathBuf, detail: String },

    #[error("file '{path}': {source}")]
    InFile {
        path: String,
        #[source]
        source: Box<Error>,
    },

    #[error(
        "store {store}: a garbage collection (host {host}, pid {pid}, started {started_at}) still held \
         the store after waiting {waited_secs}s; wait for it to finish and try again (if it crashed, \
         its marker gc/running expires at {expires_at})"
    )]
    GcRunning {
        store: String,
        host: String,
        pid: u32,
        started_at: String,
        expires_at: String,
        waited_secs: u64,
    },

    #[error(
        "store {store}: another garbage collection (host {host}, pid {pid}, started {started_at}) is \
         running; wait for it to finish (if it crashed, its marker gc/running expires at {expires_at})"
    )]
    GcBusy {
        store: String,
        host: String,
        pid: u32,
        started_at: String,
        expires_at: String,
    },

    #[error(
        "store {store}: the writer lease {id} ({purpose}) lapsed: it could not be renewed in time, so a \
         garbage collection may have run meanwhile; nothing was sealed, run the operation again"
    )]
    LeaseLapsed {
        store: String,
        id: String,
        purpose: String,
    },

    #[error(
        "store {store}: the writer lease {id} ({purpose}) was taken away (deleted or rewritten by \
         someone else, e.g. a garbage collection whose clock runs ahead), so chunks this writer \
         reused may have been swept; if a version was sealed, check it with `sealed verify` and \
         run the operation again"
    )]
    LeaseLost {
        store: String,
        id: String,
        purpose: String,
    },

    #[error(
        "store {store}: garbage collection stopped before {what}: its gc/running marker could not \
         be renewed in time, so writers may have resumed; nothing more was deleted, run it again"
    )]
    GcMarkerLapsed { store: String, what: String },

    #[error(
        "version {digest} was deleted and garbage collection has reclaimed it from store {store}; it \
         can no longer be restored (push it again from its source)"
    )]
    VersionReclaimed { digest: Digest, store: String },

    #[error(
        "version {digest} stays live in store {store}: {volumes} wrote a reference to it while it \
         was being deleted; run the deletion again to remove that one too"
    )]
    StillReferenced {
        digest: Digest,
        store: String,
        volumes: String,
    },

    #[error("store {store}: {what} at {key} is corrupt: {reason}")]
    CorruptRecord {
        store: String,
        what: String,
        key: String,
        reason: String,
    },

    #[error(
        "store {store}: {what} is larger than it can legitimately be (more than {limit} bytes, \
         at least {got_at_least} came); reading stopped there, the store is corrupt or hostile"
    )]
    ResponseTooLarge {
        store: String,
        what: String,
        limit: u64,
        got_at_least: u64,
    },

    #[error(
        "store {store}: the listing of {prefix} has more than {limit} entries, more than this \
         store can legitimately hold; listing stopped there, the store is corrupt or hostile"
    )]
    ListingTooLong {
        store: String,
        prefix: String,
        limit: u64,
    },

    #[error("{0}")]
    Other(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn bad_input(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::BadInput {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl Error {
    /// Names the file a chunk-level error belongs to.
    pub fn in_file(self, path: &str) -> Error {
        Error::InFile {
            path: path.to_owned(),
            source: Box::new(self),
        }
    }
}
