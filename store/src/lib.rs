//! The sealed format and the chunk store.
//!
//! A directory tree is split into content-defined chunks (FastCDC v2020) keyed by BLAKE3 and
//! described by a [`Manifest`]; the BLAKE3 of the manifest's canonical bytes names the sealed
//! version. [`ChunkStore`] keeps chunks and manifests in any `object_store` backend.

pub mod aws_credentials;
pub mod aws_profile;
mod backend;
pub mod bounded;
pub mod chunker;
mod clock;
mod cloud;
pub mod diff;
pub mod digest;
pub mod error;
pub mod gc;
pub mod gc_marker;
mod http_cap;
mod identity;
pub mod ingest;
mod keepalive;
pub mod layout;
pub mod limits;
pub mod manifest;
mod objects;
pub mod prefetch_profile;
pub mod progress;
pub mod pull;
pub mod push;
pub mod refs;
pub mod retry;
pub mod scan;
mod seal;
pub mod stat_cache;
pub mod store;
pub mod trash;
mod upload;
pub mod verify;
pub mod writer_lease;

pub use backend::StoreOptions;
pub use chunker::ChunkParams;
pub use digest::Digest;
pub use error::{Error, Result};
pub use http_cap::{CappedConnector, MAX_LISTING_PAGE_BYTES, cap_response};
pub use manifest::{ChunkRef, Entry, EntryKind, FileEntry, Manifest};
pub use prefetch_profile::{Profile, ProfileError};
pub use progress::{NoProgress, Progress};
pub use store::{ChunkStore, Removal, VolumeRecord};
pub use writer_lease::WriterLease;

/// Environment variables `SEALED_STORE_CRED_<KEY>` are the store's credentials: applied by
/// [`ChunkStore::open`] as `<key>` (lowercased) builder settings after the backend's own
/// environment variables. Sync Jobs get the store's Secret under this prefix, so that no
/// source reader (which reads `SEALED_SOURCE_*`, and `AWS_*`/`AZURE_*`/`GOOGLE_*` only for a
/// source allow-listed for ambient credentials) can use the store's credentials.
pub const STORE_CREDENTIAL_ENV_PREFIX: &str = "SEALED_STORE_CRED_";
