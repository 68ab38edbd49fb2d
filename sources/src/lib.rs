//! Source readers: stream a Hugging Face repository or an object-store prefix into the store
//! and seal it, with nothing staged on disk.
//!
//! [`sync_source`] is the one entry point. It first checks the source against the
//! [`SourcePolicy`] (never the store, never a local path or plain http without the operator's
//! flags, never the process's own credentials unless allow-listed), then resolves the source to an immutable revision (a
//! Hub commit, or a hash of the listing's ETags), lists the files, streams each one through
//! [`sealed_store::ingest::Ingest`] (the same chunker and manifest as `sealed push`, so the same
//! files give the same digest) and seals the version. The operator's controller calls it inline;
//! the `sealed-operator sync` Job calls it too. Errors are [`SourceError`]s whose
//! [`reason`](SourceError::reason) is a CamelCase condition reason and whose message never holds
//! a secret. See `docs/sources.md`.
//!
//! Kubernetes-free: the operator converts its API type into a [`SourceSpec`] and these
//! errors into conditions. Modules: [`spec`] (what to read), [`policy`] (what may be read,
//! and with whose credentials), [`credentials`] (the secrets, and their form in a sync Job's
//! environment), [`huggingface`] and [`bucket`] (the two readers), [`limits`] (how much a
//! source may send); this file holds the sync itself, its options, outcome and progress.

pub mod bucket;
pub mod credentials;
pub mod egress;
pub mod huggingface;
pub mod limits;
pub mod policy;
pub mod spec;

pub use credentials::SourceCredentials;
pub use egress::Egress;
pub use limits::SourceLimits;
pub use policy::{Access, SourcePolicy};
pub use spec::{BucketPrefix, HubRepo, HubRepoType, SourceSpec};

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::TryStreamExt;
use sealed_store::ingest::{Ingest, IngestOptions};
use sealed_store::progress::Phase;
use sealed_store::{ChunkStore, Digest, Progress};
use serde::{Deserialize, Serialize};
use sha1::Sha1;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncRead, ReadBuf};

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
    /// How much listing a source may send ([`limits`]).
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

/// What a finished sync sealed. Also the success line a sync Job writes to its termination
/// log, so it is serializable (camelCase, as the API's status fields).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncOutcome {
    /// The version's digest, exactly what `sealed push` of the same files gives.
    pub digest: Digest,
    /// The immutable source revision: the Hub commit (40 hex), or for an object store
    /// `etags:<64 hex>`, a BLAKE3 over the sorted (path, ETag, size) listing.
    #[serde(default)]
    pub source_revision: String,
    /// Files synced (after include/exclude).
    pub files: u64,
    /// Bytes of file content synced.
    pub bytes: u64,
    /// Distinct chunks in the version.
    pub chunks: u64,
    /// Bytes of chunks that had to be uploaded.
    pub bytes_new: u64,
    /// Bytes of distinct chunks the store already had.
    pub bytes_reused: u64,
}

/// Progress of a sync. Every method has a no-op default; calls come from several tasks.
pub trait SyncProgress: Send + Sync {
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
pub struct NoSyncProgress;
impl SyncProgress for NoSyncProgress {}

/// The store's progress events, passed on.
struct IngestProgress(Arc<dyn SyncProgress>);
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

/// Whether `creds` hold anything for `source` (a token, object-store keys).
fn has_credentials(source: &SourceSpec, creds: &SourceCredentials) -> bool {
    match source {
        SourceSpec::HuggingFace(_) => creds.hf_token.as_deref().is_some_and(|t| !t.is_empty()),
        SourceSpec::ObjectStore(_) => !creds.object_store.is_empty(),
        SourceSpec::Upload => false,
    }
}

/// One file to stream: where it lands in the version and what the source promised.
#[derive(Clone, Debug)]
pub(crate) struct RemoteFile {
    /// Path in the version (relative, `/`-separated).
    pub path: String,
    /// Where the source keeps it (the repository path, the object key).
    pub key: String,
    pub size: u64,
    /// The published SHA-256 (Hub LFS files).
    pub sha256: Option<String>,
    /// The published git blob id, SHA-1 over `blob <size>\0<content>` (Hub non-LFS files).
    pub git_oid: Option<String>,
    /// The ETag the listing showed (object stores).
    pub etag: Option<String>,
}

/// An opened source, ready to list and stream.
enum Opened {
    Hub(Box<huggingface::HubSource>),
    Bucket(bucket::BucketSource),
}

impl Opened {
    /// Checks `source` against the policy (and against `store`, the store the sync writes
    /// to), then opens it. Nothing is requested before the check.
    fn open(
        source: &SourceSpec,
        creds: &SourceCredentials,
        opts: &SyncOptions,
        store: Option<&ChunkStore>,
    ) -> Result<Opened, SourceError> {
        let access = opts.policy.check(source, has_credentials(source, creds))?;
        if let (Some(store), SourceSpec::ObjectStore(os)) = (store, source) {
            policy::refuse_store(os, store.name())?;
        }
        match source {
            SourceSpec::HuggingFace(hf) => Ok(Opened::Hub(Box::new(huggingface::HubSource::open(
                hf, creds, opts,
            )?))),
            SourceSpec::ObjectStore(os) => Ok(Opened::Bucket(bucket::BucketSource::open(
                os, creds, opts, access,
            )?)),
            SourceSpec::Upload => Err(SourceError::NotSyncable),
        }
    }

    fn describe(&self) -> String {
        match self {
            Opened::Hub(h) => h.describe(),
            Opened::Bucket(b) => b.describe(),
        }
    }
}

/// The source's current immutable revision, without syncing anything: a Hub commit, or for an
/// object store `etags:<64 hex>` over its listing. Cheap enough to poll for changes.
pub async fn resolve_revision(
    source: &SourceSpec,
    creds: &SourceCredentials,
    opts: &SyncOptions,
) -> Result<String, SourceError> {
    let resolved = async {
        match Opened::open(source, creds, opts, None)? {
            Opened::Hub(hub) => hub.resolve().await,
            Opened::Bucket(bucket) => Ok(bucket.list().await?.0),
        }
    };
    resolved.await.map_err(SourceError::redacted)
}

/// Streams `source` into `store` and seals it as one version; see the module docs.
pub async fn sync_source(
    store: &ChunkStore,
    source: &SourceSpec,
    creds: &SourceCredentials,
    opts: &SyncOptions,
    progress: Arc<dyn SyncProgress>,
) -> Result<SyncOutcome, SourceError> {
    sync_inner(store, source, creds, opts, progress)
        .await
        .map_err(SourceError::redacted)
}

async fn sync_inner(
    store: &ChunkStore,
    source: &SourceSpec,
    creds: &SourceCredentials,
    opts: &SyncOptions,
    progress: Arc<dyn SyncProgress>,
) -> Result<SyncOutcome, SourceError> {
    let opened = Opened::open(source, creds, opts, Some(store))?;
    let what = opened.describe();
    let (revision, files) = match &opened {
        Opened::Hub(hub) => {
            let commit = hub.resolve().await?;
            let files = hub.list(&commit).await?;
            (commit, files)
        }
        Opened::Bucket(bucket) => bucket.list().await?,
    };
    let file_count = files.len() as u64;
    // Sizes are the listing's claims: a sum that cannot overflow.
    let bytes = files.iter().fold(0u64, |sum, f| sum.saturating_add(f.size));
    tracing::info!(source = %what, revision = %revision, files = file_count, bytes, "syncing");
    progress.listed(file_count, bytes);

    let ingest_opts = IngestOptions {
        concurrency: opts.concurrency,
        volume: opts.volume.clone(),
        purpose: format!("sync {what} at {revision}"),
        ..Default::default()
    };
    let ingest = Ingest::new(
        store,
        &ingest_opts,
        Arc::new(IngestProgress(progress.clone())),
    )
    .await?;
    ingest.start(bytes);
    let streamed = {
        let (ingest, opened, revision, progress) = (&ingest, &opened, &revision, &progress);
        futures::stream::iter(files.into_iter().map(Ok))
            .try_for_each_concurrent(opts.parallel_files.max(1), |file: RemoteFile| async move {
                match opened {
                    Opened::Hub(hub) => hub.fetch(ingest, revision, &file, progress).await?,
                    Opened::Bucket(bucket) => bucket.fetch(ingest, &file, progress).await?,
                }
                progress.file_done(&file.path, file.size);
                Ok::<_, SourceError>(())
            })
            .await
    };
    if let Err(e) = streamed {
        ingest.abort().await;
        return Err(e);
    }
    let report = ingest.seal().await?;
    tracing::info!(source = %what, revision = %revision, digest = %report.digest, "sync sealed");
    Ok(SyncOutcome {
        digest: report.digest,
        source_revision: revision,
        files: report.files,
        bytes: report.bytes,
        chunks: report.unique_chunks,
        bytes_new: report.bytes_uploaded,
        bytes_reused: report.bytes_reused,
    })
}

/// Replaces every secret value in `text` with `***`, and strips every URL in it of user,
/// password and query ([`redact_urls_in`]).
pub(crate) fn redact(text: &str, secrets: &[String]) -> String {
    let mut out = redact_urls_in(text);
    for secret in secrets {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), "***");
        }
    }
    out
}

/// `url` without its user, password, query and fragment, for messages: what every URL that
/// goes into a condition, Event, termination message or log line passes through.
pub fn redact_url(url: &str) -> String {
    redact_urls_in(url)
}

/// `text` with every URL in it (`scheme://...` up to whitespace or a quote) stripped of user,
/// password, query and fragment. The rest of each URL (scheme, host, port, path) is kept as
/// it was, so messages still say where.
pub fn redact_urls_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let after = &rest[i + 3..];
        let end = after
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
            .unwrap_or(after.len());
        let url = &after[..end];
        let authority_end = url.find(['/', '?', '#']).unwrap_or(url.len());
        let (authority, tail) = url.split_at(authority_end);
        let host = authority
            .rfind('@')
            .map_or(authority, |j| &authority[j + 1..]);
        let path = tail.find(['?', '#']).map_or(tail, |j| &tail[..j]);
        out.push_str(&rest[..i + 3]);
        out.push_str(host);
        out.push_str(path);
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// An error's message with its causes, as one line, URLs redacted ([`redact_urls_in`]).
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let s = c.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        cause = c.source();
    }
    redact_urls_in(&text)
}

/// Whether an ingest failed because the stream ended short of (or past) the listed size.
pub(crate) fn short(e: &sealed_store::Error) -> bool {
    matches!(e, sealed_store::Error::FileChanged { .. })
}

/// Why a download that ended at another size than the listing declared failed. Only the
/// declared size, which the tenant's listing already showed: the size that came is a number
/// the tenant did not know.
pub(crate) fn size_mismatch(declared: u64) -> String {
    format!("the download's size differs from the {declared} bytes the listing declared")
}

/// The delay before retry `attempt` (1-based): exponential with jitter (the store's
/// [`RetryPolicy`](sealed_store::retry::RetryPolicy)), in [200 ms, 400 ms) for the first,
/// doubling, every delay under 10 s: sync Jobs that failed at one instant (a source's outage,
/// its 429) do not come back in lockstep.
pub(crate) fn backoff(attempt: u32) -> Duration {
    sealed_store::retry::RetryPolicy::new(Duration::from_millis(200), Duration::from_secs(10))
        .delay(attempt)
}

/// Wraps a download: hashes what passes (SHA-256, and the git blob id when asked),
/// remembers whether the source itself failed, so a broken-off download can be retried while
/// a store failure is not, and stops a download at the size the listing declared
/// ([`overflowed`](Self::overflowed)) instead of reading whatever the server sends.
pub(crate) struct Tap<R> {
    inner: R,
    sha256: Sha256,
    git: Option<Sha1>,
    /// The size the listing declared, and the bytes read so far.
    limit: u64,
    read: u64,
    pub failed: bool,
    /// The source sent more than `limit` bytes; the read failed at that point.
    pub overflowed: bool,
}

/// What a [`Tap`] saw: lowercase hex digests.
pub(crate) struct Tapped {
    pub sha256: String,
    pub git_oid: Option<String>,
}

impl<R> Tap<R> {
    /// A tap over a file the listing declared as `limit` bytes.
    pub fn new(inner: R, limit: u64) -> Self {
        Tap {
            inner,
            sha256: Sha256::new(),
            git: None,
            limit,
            read: 0,
            failed: false,
            overflowed: false,
        }
    }

    /// The message of an [`overflowed`](Self::overflowed) download.
    pub fn overflow_detail(&self) -> String {
        format!(
            "the server sent more than the {} bytes the listing declared; stopped reading there",
            self.limit
        )
    }

    /// Also computes the git blob id of content announced as `size` bytes.
    pub fn with_git_blob(mut self, size: u64) -> Self {
        let mut git = Sha1::new();
        git.update(format!("blob {size}\0").as_bytes());
        self.git = Some(git);
        self
    }

    pub fn finish(self) -> Tapped {
        Tapped {
            sha256: hex::encode(self.sha256.finalize()),
            git_oid: self.git.map(|g| hex::encode(g.finalize())),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Tap<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let fresh = &buf.filled()[before..];
                this.read = this.read.saturating_add(fresh.len() as u64);
                if this.read > this.limit {
                    this.overflowed = true;
                    return Poll::Ready(Err(io::Error::other(this.overflow_detail())));
                }
                this.sha256.update(fresh);
                if let Some(git) = &mut this.git {
                    git.update(fresh);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                this.failed = true;
                Poll::Ready(Err(e))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Compiles include/exclude patterns (fnmatch-style, as `huggingface_hub` applies them: `*`
/// matches across `/`, so `*.json` matches `sub/config.json`).
pub(crate) fn globset(
    patterns: &[String],
    field: &str,
) -> Result<Option<globset::GlobSet>, SourceError> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut set = globset::GlobSetBuilder::new();
    for p in patterns {
        let glob = globset::GlobBuilder::new(p)
            .literal_separator(false)
            .build()
            .map_err(|e| SourceError::Invalid(format!("{field}: pattern {p:?}: {e}")))?;
        set.add(glob);
    }
    set.build()
        .map(Some)
        .map_err(|e| SourceError::Invalid(format!("{field}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Downloads that broke off at one instant retry out of step, in bounds.
    #[test]
    fn retries_are_jittered_and_bounded() {
        let firsts: std::collections::BTreeSet<_> = (0..100).map(|_| backoff(1)).collect();
        assert!(firsts.len() > 10, "first retries in lockstep: {firsts:?}");
        assert!(
            firsts
                .iter()
                .all(|d| *d >= Duration::from_millis(200) && *d < Duration::from_millis(400)),
            "{firsts:?}"
        );
        for attempt in [2, 5, 9, 40, u32::MAX] {
            let d = backoff(attempt);
            assert!(
                d >= Duration::from_millis(200) && d < Duration::from_secs(10),
                "{d:?}"
            );
        }
    }

    #[test]
    fn urls_lose_userinfo_query_and_fragment() {
        assert_eq!(
            redact_urls_in(
                "GET https://user:p%40ss@hub.example.com:8443/api/x?token=abc&sig=def#frag failed"
            ),
            "GET https://hub.example.com:8443/api/x failed"
        );
        assert_eq!(
            redact_url("s3://AKIA:secret@models/llm/v1?x-amz-signature=abc"),
            "s3://models/llm/v1"
        );
        // Several URLs, quotes, and text without URLs.
        assert_eq!(
            redact_urls_in(
                "'http://a:b@h1/p?q' then \"https://h2/?sig=1\" and <ftp://u@h3>, no url here"
            ),
            "'http://h1/p' then \"https://h2/\" and <ftp://h3>, no url here"
        );
        // An '@' in a path (hf://org/name@rev) is not userinfo.
        assert_eq!(redact_urls_in("hf://acme/llm@main"), "hf://acme/llm@main");
        assert_eq!(redact_urls_in("no urls: a@b?c"), "no urls: a@b?c");
        assert_eq!(redact_urls_in("trailing ://"), "trailing ://");
        assert_eq!(
            redact_urls_in("ünïcode https://x:y@h/é?q ✓"),
            "ünïcode https://h/é ✓"
        );
    }

    #[test]
    fn redact_scrubs_secrets_and_urls() {
        let secrets = vec!["hf_secret_value".to_owned()];
        assert_eq!(
            redact(
                "token hf_secret_value sent to https://u:pw@h/x?t=hf_secret_value",
                &secrets
            ),
            "token *** sent to https://h/x"
        );
    }

    #[test]
    fn errors_are_redacted_everywhere() {
        #[derive(Debug)]
        struct Inner;
        impl std::fmt::Display for Inner {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("connecting to https://admin:hunter2@10.0.0.1/?key=k3y")
            }
        }
        impl std::error::Error for Inner {}
        #[derive(Debug)]
        struct Outer(Inner);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("request failed")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let chain = error_chain(&Outer(Inner));
        assert_eq!(chain, "request failed: connecting to https://10.0.0.1/");

        let e = SourceError::Unavailable {
            what: "http://u:hunter2@hub/x?sig=k3y".into(),
            detail: "see https://t:hunter2@cdn/y?k=k3y".into(),
        }
        .redacted();
        let text = format!("{e} {e:?}");
        assert!(!text.contains("hunter2") && !text.contains("k3y"), "{text}");
        assert!(
            text.contains("http://hub/x") && text.contains("https://cdn/y"),
            "{text}"
        );
    }
}
