//! Source readers: stream a Hugging Face repository, an object-store prefix or an OCI
//! registry's model (a ModelPack artifact, an image's directory) into the store
//! and seal it, with nothing staged on disk.
//!
//! [`sync_source`] is the one entry point. It first checks the source against the
//! [`SourcePolicy`] (never the store, never a local path or plain http without the operator's
//! flags, never the process's own credentials unless allow-listed), then resolves the source to an immutable revision (a
//! Hub commit, a hash of the listing's ETags, an OCI manifest digest), lists the files, streams each one through
//! [`sealed_store::ingest::Ingest`] (the same chunker and manifest as `sealed push`, so the same
//! files give the same digest) and seals the version. The operator's controller calls it inline;
//! the `sealed-operator sync` Job calls it too. Errors are [`SourceError`]s whose
//! [`reason`](SourceError::reason) is a CamelCase condition reason and whose message never holds
//! a secret. See `docs/sources.md`.
//!
//! Kubernetes-free: the operator converts its API type into a [`SourceSpec`] and these
//! errors into conditions. Modules: [`spec`] (what to read), [`policy`] (what may be read,
//! and with whose credentials), [`credentials`] (the secrets, and their form in a sync Job's
//! environment), [`huggingface`], [`bucket`] and [`oci`] (the three readers), [`limits`] (how much a
//! source may send), [`options`], [`progress`], [`error`] and [`redact`]; the sync itself is in
//! `sync.rs`, one file's download (hashing, size, retries) in `download.rs`.

pub mod bucket;
pub mod credentials;
mod download;
pub mod egress;
pub mod error;
pub mod huggingface;
pub mod limits;
pub mod oci;
pub mod options;
pub mod policy;
pub mod progress;
pub mod redact;
pub mod spec;
mod sync;

pub use credentials::SourceCredentials;
pub use egress::Egress;
pub use error::SourceError;
pub use limits::SourceLimits;
pub use options::SyncOptions;
pub use policy::{Access, SourcePolicy};
pub use progress::{NoReporter, SyncReporter};
pub use redact::{redact_url, redact_urls_in};
pub use spec::{BucketPrefix, HubRepo, HubRepoType, OciArtifact, SourceSpec};
pub use sync::{SyncOutcome, resolve_revision, sync_source};
