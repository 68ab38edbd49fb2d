//! Why a sync failed: [`SourceError`], whose reason is a condition reason and whose message
//! never holds a secret.

use crate::redact::redact_urls_in;

/// Why a sync failed. [`reason`](Self::reason) is the condition reason; the message says what
/// to do and never holds a token or key.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("invalid source: {0}")]
    Invalid(String),

    /// The [`SourcePolicy`] does not admit the source (the store itself, a local path, plain
    /// http).
    #[error("source refused: {0}")]
    Refused(String),

    /// An object-store source that names no Secret and is not allow-listed for ambient
    /// credentials.
    #[error("credentials required: {0}")]
    CredentialsRequired(String),

    #[error("an upload source has nothing to sync: its versions arrive from `sealed push`")]
    NotSyncable,

    #[error(
        "Hugging Face repository {repo} not found at {endpoint}: check spec.source.huggingFace.repo and repoType"
    )]
    RepoNotFound { repo: String, endpoint: String },

    #[error(
        "revision {revision:?} not found in Hugging Face repository {repo}: use a branch, tag or commit that exists"
    )]
    RevisionNotFound { repo: String, revision: String },

    #[error("access to {what} denied: {detail}")]
    AccessDenied { what: String, detail: String },

    #[error(
        "{url}: the store rejected the credentials ({detail}); check the keys in spec.source.objectStore.credentialsSecretRef"
    )]
    CredentialsRejected { url: String, detail: String },

    #[error("{url}: credentials are unusable: {detail}")]
    InvalidCredentials { url: String, detail: String },

    #[error("bucket or container of {url} not found ({detail}); check spec.source.objectStore.url")]
    BucketNotFound { url: String, detail: String },

    #[error(
        "'{path}' from {what}: downloaded content does not match its published hash (expected {expected}, got {actual}); nothing was sealed"
    )]
    IntegrityMismatch {
        what: String,
        path: String,
        expected: String,
        actual: String,
    },

    #[error(
        "'{path}' in {what} changed or vanished during the sync ({detail}); the next sync picks up the new content"
    )]
    SourceChanged {
        what: String,
        path: String,
        detail: String,
    },

    #[error("nothing to sync in {what}: {detail}")]
    NoFiles { what: String, detail: String },

    #[error("{what} is unavailable: {detail}")]
    Unavailable { what: String, detail: String },

    /// The source sent more than a sync reads ([`limits`]): a listing too long, a page or a
    /// file larger than it may be.
    #[error("{what} is too large to sync: {detail}")]
    TooLarge { what: String, detail: String },

    #[error("{what}: unexpected answer: {detail}")]
    Protocol { what: String, detail: String },

    #[error("store: {0}")]
    Store(#[from] sealed_store::Error),
}

impl SourceError {
    /// The CamelCase reason for a condition (`RepoNotFound`, `AccessDenied`, ...).
    pub fn reason(&self) -> &'static str {
        match self {
            SourceError::Invalid(_) => "InvalidSource",
            SourceError::Refused(_) => "SourceRefused",
            SourceError::CredentialsRequired(_) => "CredentialsRequired",
            SourceError::NotSyncable => "NotSyncable",
            SourceError::RepoNotFound { .. } => "RepoNotFound",
            SourceError::RevisionNotFound { .. } => "RevisionNotFound",
            SourceError::AccessDenied { .. } => "AccessDenied",
            SourceError::CredentialsRejected { .. } => "CredentialsRejected",
            SourceError::InvalidCredentials { .. } => "InvalidCredentials",
            SourceError::BucketNotFound { .. } => "BucketNotFound",
            SourceError::IntegrityMismatch { .. } => "IntegrityMismatch",
            SourceError::SourceChanged { .. } => "SourceChanged",
            SourceError::NoFiles { .. } => "NothingToSync",
            SourceError::Unavailable { .. } => "SourceUnavailable",
            SourceError::TooLarge { .. } => "SourceTooLarge",
            SourceError::Protocol { .. } => "SourceError",
            SourceError::Store(_) => "StoreError",
        }
    }

    /// False when a later retry may succeed without anyone changing anything (network, a
    /// store hiccup, a source that changed mid-sync, a corrupted transfer).
    pub fn is_permanent(&self) -> bool {
        !matches!(
            self,
            SourceError::Unavailable { .. }
                | SourceError::Store(_)
                | SourceError::SourceChanged { .. }
                | SourceError::IntegrityMismatch { .. }
        )
    }
}

impl SourceError {
    /// The same error with every URL in its texts stripped of user, password and query
    /// ([`redact_urls_in`]).
    pub fn redacted(self) -> SourceError {
        let r = |s: String| redact_urls_in(&s);
        match self {
            SourceError::Invalid(m) => SourceError::Invalid(r(m)),
            SourceError::Refused(m) => SourceError::Refused(r(m)),
            SourceError::CredentialsRequired(m) => SourceError::CredentialsRequired(r(m)),
            SourceError::NotSyncable => SourceError::NotSyncable,
            SourceError::RepoNotFound { repo, endpoint } => SourceError::RepoNotFound {
                repo,
                endpoint: r(endpoint),
            },
            SourceError::RevisionNotFound { repo, revision } => {
                SourceError::RevisionNotFound { repo, revision }
            }
            SourceError::AccessDenied { what, detail } => SourceError::AccessDenied {
                what: r(what),
                detail: r(detail),
            },
            SourceError::CredentialsRejected { url, detail } => SourceError::CredentialsRejected {
                url: r(url),
                detail: r(detail),
            },
            SourceError::InvalidCredentials { url, detail } => SourceError::InvalidCredentials {
                url: r(url),
                detail: r(detail),
            },
            SourceError::BucketNotFound { url, detail } => SourceError::BucketNotFound {
                url: r(url),
                detail: r(detail),
            },
            SourceError::IntegrityMismatch {
                what,
                path,
                expected,
                actual,
            } => SourceError::IntegrityMismatch {
                what: r(what),
                path,
                expected,
                actual,
            },
            SourceError::SourceChanged { what, path, detail } => SourceError::SourceChanged {
                what: r(what),
                path,
                detail: r(detail),
            },
            SourceError::NoFiles { what, detail } => SourceError::NoFiles {
                what: r(what),
                detail: r(detail),
            },
            SourceError::Unavailable { what, detail } => SourceError::Unavailable {
                what: r(what),
                detail: r(detail),
            },
            SourceError::Protocol { what, detail } => SourceError::Protocol {
                what: r(what),
                detail: r(detail),
            },
            SourceError::TooLarge { what, detail } => SourceError::TooLarge {
                what: r(what),
                detail: r(detail),
            },
            SourceError::Store(e) => SourceError::Store(e),
        }
    }
}
