//! Errors of the mount crate. [`FsError::errno`] is the one errno table of the FUSE edge:
//! every error reply `fuse.rs` sends goes through it.

use std::path::PathBuf;
use std::time::Duration;

use sealed_store::Digest;

/// Why a chunk could not be served. Cloned to every reader waiting on the same fetch.
#[derive(Clone, Debug, thiserror::Error)]
pub enum FetchError {
    #[error("chunk {digest} is missing from store {store}")]
    Missing { digest: Digest, store: String },
    #[error("chunk {digest} is corrupt in store {store}: its bytes hash to {actual}")]
    Corrupt {
        digest: Digest,
        actual: Digest,
        store: String,
    },
    #[error(
        "chunk {digest}: store {store} did not answer within {per_attempt:?} ({attempts} attempts)"
    )]
    TimedOut {
        digest: Digest,
        store: String,
        per_attempt: Duration,
        attempts: u32,
    },
    #[error("chunk {digest}: store {store} failed after {attempts} attempts: {reason}")]
    Unavailable {
        digest: Digest,
        store: String,
        attempts: u32,
        reason: String,
    },
    #[error(
        "chunk {digest} is {actual} bytes but the manifest declares {declared}: the manifest \
         is corrupt (push the version again from its source)"
    )]
    WrongLength {
        digest: Digest,
        declared: u32,
        actual: u64,
    },
    /// The store answered with more than a chunk can be (`sealed_store::Error::ResponseTooLarge`):
    /// an answer, like a corrupt chunk, not a store that is down.
    #[error("chunk {digest}: store {store} sent a hostile answer: {reason}")]
    Oversized {
        digest: Digest,
        store: String,
        reason: String,
    },
    #[error(
        "chunk {digest}: store {store} failed moments ago, so reads of uncached data fail at \
         once instead of waiting on it again (circuit breaker: next probe in {retry_in:?}, or \
         one is under way)"
    )]
    StoreFailing {
        digest: Digest,
        store: String,
        retry_in: Duration,
    },
    #[error("chunk {digest}: internal error: {reason}")]
    Internal { digest: Digest, reason: String },
}

/// Errors of the plain read API ([`crate::SealedFs`]).
#[derive(Clone, Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("not a symlink")]
    NotSymlink,
    #[error("read-only file system")]
    ReadOnly,
    #[error("unknown file handle {0}")]
    BadHandle(u64),
    /// An operation the filesystem never implements (extended attributes): ENOSYS, which the
    /// kernel remembers, so it stops asking for the life of the mount.
    #[error("operation not supported")]
    NotSupported,
    /// The file is open by passthrough on a cache copy found damaged since: the kernel would
    /// serve a new open from it too (one backing file per inode) until its handles close.
    #[error("the cache copy this file is open on was found damaged; reopen once its handles close")]
    DamagedBacking,
    #[error(transparent)]
    Fetch(#[from] FetchError),
}

impl FsError {
    /// The errno a FUSE reply carries for this error.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotSymlink => libc::EINVAL,
            FsError::ReadOnly => libc::EROFS,
            FsError::BadHandle(_) => libc::EBADF,
            FsError::NotSupported => libc::ENOSYS,
            FsError::DamagedBacking | FsError::Fetch(_) => libc::EIO,
        }
    }
}

/// Errors setting up or tearing down a mount.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    Store(#[from] sealed_store::Error),
    #[error("manifest {digest} cannot be mounted: {reason}")]
    BadManifest { digest: Digest, reason: String },
    #[error("mount point {path}: {reason}")]
    MountPoint { path: PathBuf, reason: String },
    #[error("cannot mount {path}: {source} (mounting needs root or CAP_SYS_ADMIN and /dev/fuse)")]
    Mount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot unmount {path}: {source}")]
    Unmount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cache directory {path}: {source}")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "version {digest} cannot be mounted: it has {count} {what}, over the per-mount limit \
         of {limit} (MountLimits::{field}; raise it on the node plugin if this version is meant \
         to be mounted)"
    )]
    OverLimit {
        digest: Digest,
        /// What was counted: "entries", "chunk references", "bytes of memory (estimated)".
        what: &'static str,
        /// The [`crate::MountLimits`] field that sets the limit.
        field: &'static str,
        count: u64,
        limit: u64,
    },
    #[error("invalid prefetch pattern '{pattern}': {reason}")]
    BadPattern { pattern: String, reason: String },
}
