//! The sync itself: check the source against the policy, open it, resolve its revision, list
//! it, stream every file through the store's ingest and seal the version.

use std::sync::Arc;

use futures::TryStreamExt;
use sealed_store::ingest::{Ingest, IngestOptions};
use sealed_store::{ChunkStore, Digest};
use serde::{Deserialize, Serialize};

use crate::credentials::SourceCredentials;
use crate::download::RemoteFile;
use crate::error::SourceError;
use crate::options::SyncOptions;
use crate::progress::{IngestProgress, SyncReporter};
use crate::spec::SourceSpec;
use crate::{bucket, huggingface, oci, policy};

/// What a finished sync sealed. Also the success line a sync Job writes to its termination
/// log, so it is serializable (camelCase, as the API's status fields).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncOutcome {
    /// The version's digest, exactly what `sealed push` of the same files gives.
    pub digest: Digest,
    /// The immutable source revision: the Hub commit (40 hex), for an object store
    /// `etags:<64 hex>`, a BLAKE3 over the sorted (path, ETag, size) listing, for an OCI
    /// registry the manifest's (or index's) digest, `sha256:<64 hex>`.
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

/// Whether `creds` hold anything for `source` (a token, object-store keys).
fn has_credentials(source: &SourceSpec, creds: &SourceCredentials) -> bool {
    match source {
        SourceSpec::HuggingFace(_) => creds.hf_token.as_deref().is_some_and(|t| !t.is_empty()),
        SourceSpec::ObjectStore(_) => !creds.object_store.is_empty(),
        SourceSpec::Oci(_) => creds
            .docker_config
            .as_deref()
            .is_some_and(|c| !c.is_empty()),
        SourceSpec::Upload => false,
    }
}

/// An opened source, ready to list and stream.
enum Opened {
    Hub(Box<huggingface::HubSource>),
    Bucket(bucket::BucketSource),
    Oci(Box<oci::OciSource>),
}

/// What a sync streams: files from a listing, or an OCI manifest's layers.
enum Planned {
    Files(Vec<RemoteFile>),
    Layers(oci::Plan),
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
            SourceSpec::Oci(o) => Ok(Opened::Oci(Box::new(oci::OciSource::open(o, creds, opts)?))),
            SourceSpec::Upload => Err(SourceError::NotSyncable),
        }
    }

    fn describe(&self) -> String {
        match self {
            Opened::Hub(h) => h.describe(),
            Opened::Bucket(b) => b.describe(),
            Opened::Oci(o) => o.describe(),
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
            Opened::Oci(oci) => oci.resolve().await,
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
    progress: Arc<dyn SyncReporter>,
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
    progress: Arc<dyn SyncReporter>,
) -> Result<SyncOutcome, SourceError> {
    let opened = Opened::open(source, creds, opts, Some(store))?;
    let what = opened.describe();
    let (revision, planned) = match &opened {
        Opened::Hub(hub) => {
            let commit = hub.resolve().await?;
            let files = hub.list(&commit).await?;
            (commit, Planned::Files(files))
        }
        Opened::Bucket(bucket) => {
            let (revision, files) = bucket.list().await?;
            (revision, Planned::Files(files))
        }
        Opened::Oci(oci) => {
            let (digest, plan) = oci.plan().await?;
            (digest, Planned::Layers(plan))
        }
    };
    // Sizes are the listing's claims: a sum that cannot overflow. For an OCI source, the
    // layers and their sizes.
    let (file_count, bytes) = match &planned {
        Planned::Files(files) => (
            files.len() as u64,
            files.iter().fold(0u64, |sum, f| sum.saturating_add(f.size)),
        ),
        Planned::Layers(plan) => (plan.layers(), plan.bytes()),
    };
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
    let streamed = match (planned, &opened) {
        (Planned::Layers(plan), Opened::Oci(oci)) => {
            oci.stream(&ingest, &plan, opts.parallel_files, &progress)
                .await
        }
        (Planned::Layers(_), _) => Err(SourceError::Invalid("layers of a non-OCI source".into())),
        (Planned::Files(files), opened) => {
            let (ingest, revision, progress) = (&ingest, &revision, &progress);
            futures::stream::iter(files.into_iter().map(Ok))
                .try_for_each_concurrent(
                    opts.parallel_files.max(1),
                    |file: RemoteFile| async move {
                        match opened {
                            Opened::Hub(hub) => {
                                hub.fetch(ingest, revision, &file, progress).await?
                            }
                            Opened::Bucket(bucket) => bucket.fetch(ingest, &file, progress).await?,
                            Opened::Oci(_) => {
                                return Err(SourceError::Invalid("files of an OCI source".into()));
                            }
                        }
                        progress.file_done(&file.path, file.size);
                        Ok::<_, SourceError>(())
                    },
                )
                .await
        }
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
