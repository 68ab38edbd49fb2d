//! The chunk store: one layout ([`crate::layout`]) over any `object_store` backend, chosen by
//! URL. Chunks, manifests and volume records are read and written here.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

use crate::backend::{self, Backend, StoreOptions};
use crate::bounded::{MAX_CHUNK_BYTES, MAX_LISTED_OBJECTS, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES};
use crate::digest::{Digest, verify_digest};
use crate::error::{Error, Result};
/// Volume names are checked where their keys are made (`layout`); re-exported here, where
/// callers found it first.
pub use crate::layout::validate_volume_name;
use crate::layout::{self, Prefix};
use crate::manifest::Manifest;
use crate::objects::found;

#[derive(Clone, Debug)]
pub struct ChunkStore {
    inner: Arc<dyn ObjectStore>,
    /// The URL as the user gave it, for messages (it never carries credentials).
    name: String,
    /// For `file://` stores: the directory, so writes can be made durable with syncfs.
    local_root: Option<PathBuf>,
    /// How long one request may take with its retries; the collector keeps this much of its
    /// marker's window in hand before each delete batch.
    request_bound: Duration,
}

/// A pushed-version record under `volumes/`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct VolumeRecord {
    pub volume: String,
    pub digest: Digest,
    pub pushed_at: chrono::DateTime<chrono::Utc>,
    /// Proof that the writer held the manifest's bytes, not only its digest (digests are
    /// public: Events, status, pod specs). See [`ChunkStore::record_proof`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<String>,
    /// Set when the volume's reference was removed (its version deleted): a tombstone, no
    /// longer a reference, kept for the retention it asked for (`crate::refs`). Records
    /// written before references existed have none: they are references.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed: Option<Removal>,
}

/// When a volume's reference was removed and how long the removal asked the version to stay
/// restorable.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Removal {
    pub at: chrono::DateTime<chrono::Utc>,
    pub restorable_until: chrono::DateTime<chrono::Utc>,
}

/// A manifest present in the store.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StoredVersion {
    pub digest: Digest,
    pub stored_at: chrono::DateTime<chrono::Utc>,
}

impl ChunkStore {
    /// `file://` under the user's data directory (`~/.local/share/sealed-volumes/store`).
    pub fn default_url() -> String {
        let base = dirs::data_dir().unwrap_or_else(|| PathBuf::from("/var/lib"));
        format!(
            "file://{}",
            base.join("sealed-volumes").join("store").display()
        )
    }

    pub fn memory() -> Self {
        ChunkStore {
            inner: Arc::new(InMemory::new()),
            name: "memory://".into(),
            local_root: None,
            request_bound: Duration::from_secs(30),
        }
    }

    /// Wraps an already-built backend (tests, embedding).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, name: impl Into<String>) -> Self {
        ChunkStore {
            inner,
            name: name.into(),
            local_root: None,
            request_bound: Duration::from_secs(30),
        }
    }

    /// Opens the store at `url` and checks it answers, so a wrong bucket, endpoint or
    /// credential fails here with a message rather than halfway through a push.
    pub async fn open(url: &str, opts: &StoreOptions) -> Result<Self> {
        let store = Self::connect(url, opts)?;
        store.probe(opts.timeout).await?;
        Ok(store)
    }

    /// [`ChunkStore::open`] without the check: builds the client and asks the store
    /// nothing, so it works while the store is down (its requests then fail within their
    /// bounds). For a reader that must be served whenever the store comes back (the CSI
    /// plugin's mounts); everything else should `open`.
    pub fn connect(url: &str, opts: &StoreOptions) -> Result<Self> {
        let Backend { inner, local_root } = backend::open(url, opts)?;
        Ok(ChunkStore {
            inner,
            name: url.into(),
            local_root,
            request_bound: opts.timeout.saturating_mul(
                u32::try_from(opts.retries)
                    .unwrap_or(u32::MAX)
                    .saturating_add(1),
            ),
        })
    }

    async fn probe(&self, timeout: Duration) -> Result<()> {
        let prefix = Prefix::Manifests.path();
        let list = self.inner.list_with_delimiter(Some(&prefix));
        match tokio::time::timeout(timeout * 2, list).await {
            Err(_) => Err(Error::Timeout {
                store: self.name.clone(),
                what: "the first listing (is the endpoint reachable?)".into(),
                seconds: (timeout * 2).as_secs(),
            }),
            Ok(listed) => found(listed).map(drop).map_err(|e| self.backend(e)),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long one request may take, retries included (timeout × (retries + 1)).
    pub fn request_bound(&self) -> Duration {
        self.request_bound
    }

    /// Test-only (the `test-util` feature): the backend, for tests that need raw access (they
    /// corrupt chunks and forge records through it). Everything else goes through the methods
    /// of `ChunkStore`, which name their keys by [`crate::layout`].
    #[cfg(any(test, feature = "test-util"))]
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The backend, for this crate's modules (each reads and writes the keys of
    /// [`crate::layout`] through [`crate::objects`]).
    pub(crate) fn raw(&self) -> &dyn ObjectStore {
        self.inner.as_ref()
    }

    /// [`layout::chunk_key`].
    pub fn chunk_key(digest: &Digest) -> ObjectPath {
        layout::chunk_key(digest)
    }

    /// [`layout::manifest_key`].
    pub fn manifest_key(digest: &Digest) -> ObjectPath {
        layout::manifest_key(digest)
    }

    pub(crate) fn backend(&self, source: object_store::Error) -> Error {
        // A response the HTTP layer cut off is the store's answer being too large, not a
        // transient failure.
        if let Some(cap) = crate::http_cap::cap_exceeded(&source) {
            return Error::ResponseTooLarge {
                store: self.name.clone(),
                what: cap.what.clone(),
                limit: cap.limit,
                got_at_least: cap.got_at_least,
            };
        }
        Error::Backend {
            store: self.name.clone(),
            source,
        }
    }

    pub async fn has_chunk(&self, digest: &Digest) -> Result<bool> {
        self.exists(&layout::chunk_key(digest)).await
    }

    /// Stores a chunk. Content-addressed, so rewriting an existing chunk is harmless.
    pub async fn put_chunk(&self, digest: &Digest, data: Bytes) -> Result<()> {
        self.inner
            .put(&layout::chunk_key(digest), PutPayload::from(data))
            .await
            .map_err(|e| self.backend(e))?;
        Ok(())
    }

    /// Fetches a chunk and verifies it against its digest: a corrupt chunk is an error,
    /// never bytes.
    /// At most [`MAX_CHUNK_BYTES`] are read: a larger body is [`Error::ResponseTooLarge`].
    pub async fn get_chunk(&self, digest: &Digest) -> Result<Bytes> {
        self.get_chunk_within(digest, MAX_CHUNK_BYTES).await
    }

    /// [`ChunkStore::get_chunk`], reading at most `limit` bytes.
    async fn get_chunk_within(&self, digest: &Digest, limit: u64) -> Result<Bytes> {
        let what = format!("chunk {digest}");
        let data = self
            .read_optional(&layout::chunk_key(digest), &what, limit)
            .await?
            .ok_or_else(|| Error::MissingChunk {
                digest: *digest,
                store: self.name.clone(),
            })?;
        verify_digest(digest, &data).map_err(|actual| Error::CorruptChunk {
            digest: *digest,
            actual,
            store: self.name.clone(),
        })?;
        Ok(data)
    }

    /// Makes every write so far durable before a manifest may name it. Object stores
    /// acknowledge a PUT only once it is durable; a local directory needs a syncfs.
    pub async fn sync(&self) -> Result<()> {
        let Some(root) = self.local_root.clone() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || {
            let dir = std::fs::File::open(&root).map_err(|e| Error::io(&root, e))?;
            // SAFETY: syncfs takes a valid open descriptor, which `dir` holds for the call.
            let rc = unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) };
            if rc != 0 {
                return Err(Error::io(&root, std::io::Error::last_os_error()));
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::Other(format!("sync task failed: {e}")))?
    }

    /// Writes a manifest once (conditional create) and returns its digest. Writing the same
    /// manifest again succeeds without changing the stored object.
    pub async fn put_manifest(&self, bytes: Vec<u8>) -> Result<Digest> {
        let digest = Digest::of(&bytes);
        let key = layout::manifest_key(&digest);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .inner
            .put_opts(&key, PutPayload::from(bytes.clone()), opts)
            .await
        {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(digest),
            // Some S3-compatible servers lack conditional writes: a manifest's name is the
            // hash of its bytes, so writing it when absent cannot change a sealed version.
            Err(object_store::Error::NotImplemented) => {
                if !self.has_manifest(&digest).await? {
                    self.inner
                        .put(&key, PutPayload::from(bytes))
                        .await
                        .map_err(|e| self.backend(e))?;
                }
                Ok(digest)
            }
            Err(e) => Err(self.backend(e)),
        }
    }

    /// Writes the learned prefetch profile of `scope` once (conditional create, first writer
    /// wins). `Ok(false)` when one was there already: that is not an error.
    pub async fn put_profile(
        &self,
        profile: &crate::prefetch_profile::Profile,
        scope: &crate::prefetch_profile::ProfileScope,
    ) -> Result<bool> {
        let key = layout::profile_key(&profile.manifest, &scope.id());
        let body = profile.encode();
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .inner
            .put_opts(&key, PutPayload::from(body.clone()), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            // Without conditional writes: write only when absent (a race loses one profile
            // of two equally good ones, never a manifest).
            Err(object_store::Error::NotImplemented) => {
                if self.exists(&key).await? {
                    return Ok(false);
                }
                self.inner
                    .put(&key, PutPayload::from(body))
                    .await
                    .map_err(|e| self.backend(e))?;
                Ok(true)
            }
            Err(e) => Err(self.backend(e)),
        }
    }

    /// The raw bytes of a manifest's profile learned in `scope`, or `None`. At most
    /// [`crate::prefetch_profile::MAX_PROFILE_BYTES`] are read: a larger one is
    /// [`Error::ResponseTooLarge`]. Decode with [`crate::prefetch_profile::Profile::decode`].
    pub async fn get_profile_bytes(
        &self,
        manifest: &Digest,
        scope: &crate::prefetch_profile::ProfileScope,
    ) -> Result<Option<Bytes>> {
        let what = format!("profile of {manifest}");
        self.read_optional(
            &layout::profile_key(manifest, &scope.id()),
            &what,
            crate::prefetch_profile::MAX_PROFILE_BYTES,
        )
        .await
    }

    pub async fn has_manifest(&self, digest: &Digest) -> Result<bool> {
        self.exists(&layout::manifest_key(digest)).await
    }

    /// The manifest's raw bytes, verified against the digest. At most [`MAX_MANIFEST_BYTES`]
    /// are read: a larger body is [`Error::ResponseTooLarge`].
    pub async fn get_manifest_bytes(&self, digest: &Digest) -> Result<Bytes> {
        let what = format!("manifest {digest}");
        let data = self
            .read_optional(&layout::manifest_key(digest), &what, MAX_MANIFEST_BYTES)
            .await?
            .ok_or_else(|| Error::UnknownVersion {
                digest: *digest,
                store: self.name.clone(),
            })?;
        verify_digest(digest, &data).map_err(|actual| Error::ManifestDigestMismatch {
            digest: *digest,
            actual,
        })?;
        Ok(data)
    }

    /// Fetches, verifies and parses a manifest.
    pub async fn get_manifest(&self, digest: &Digest) -> Result<Manifest> {
        let data = self.get_manifest_bytes(digest).await?;
        Manifest::parse(&data)
    }

    /// Every sealed version in the store, oldest first.
    pub async fn list_versions(&self) -> Result<Vec<StoredVersion>> {
        let metas =
            crate::bounded::list_capped(self, &Prefix::Manifests.path(), MAX_LISTED_OBJECTS)
                .await?;
        let mut out: Vec<StoredVersion> = metas
            .into_iter()
            .filter_map(|m| {
                let digest = layout::parse_manifest_key(&m.location)?;
                Some(StoredVersion {
                    digest,
                    stored_at: m.last_modified,
                })
            })
            .collect();
        out.sort_by_key(|v| (v.stored_at, v.digest));
        Ok(out)
    }

    /// Records that the version sealed from `manifest_bytes` was pushed to `volume` (a name
    /// like `ns/name`), with the proof that the writer held those bytes.
    pub async fn put_volume_record(
        &self,
        volume: &str,
        manifest_bytes: &[u8],
    ) -> Result<VolumeRecord> {
        validate_volume_name(volume)?;
        let record = VolumeRecord {
            volume: volume.into(),
            digest: Digest::of(manifest_bytes),
            pushed_at: chrono::Utc::now(),
            proof: Some(Self::record_proof(volume, manifest_bytes)),
            removed: None,
        };
        self.write_volume_record(&record).await?;
        Ok(record)
    }

    /// Writes `record` at its key (a reference, or a tombstone of one).
    pub(crate) async fn write_volume_record(&self, record: &VolumeRecord) -> Result<()> {
        validate_volume_name(&record.volume)?;
        let body = serde_json::to_vec(record).map_err(|e| Error::Other(e.to_string()))?;
        self.inner
            .put(
                &layout::volume_record_key(&record.volume, &record.digest),
                PutPayload::from(body),
            )
            .await
            .map_err(|e| self.backend(e))?;
        Ok(())
    }

    /// The proof in a volume record: a BLAKE3 MAC of the volume name keyed by a key derived
    /// from the manifest's bytes. Only a writer that had the manifest (not just its public
    /// digest) can make it, so a tenant who may write records under its own namespace's
    /// prefix cannot claim another namespace's version by naming its digest. (A writer who
    /// can read every manifest can read every chunk too, so the proof takes nothing from it.)
    pub fn record_proof(volume: &str, manifest_bytes: &[u8]) -> String {
        let key = blake3::derive_key("sealedvolumes.io volume record proof v1", manifest_bytes);
        blake3::keyed_hash(&key, volume.as_bytes())
            .to_hex()
            .to_string()
    }

    /// Every volume record, newest first. Tombstones (removed references) are not listed.
    pub async fn list_volume_records(&self) -> Result<Vec<VolumeRecord>> {
        let records = self.volume_records(Prefix::Volumes.path(), None).await?;
        Ok(records
            .into_iter()
            .filter(|r| r.removed.is_none())
            .collect())
    }

    /// The records of one volume (`ns/name`), newest first. Records that do not parse, or
    /// that name another volume or digest than their key, are skipped; so are tombstones:
    /// a deleted version is not imported again.
    pub async fn list_records_of_volume(&self, volume: &str) -> Result<Vec<VolumeRecord>> {
        validate_volume_name(volume)?;
        let records = self
            .volume_records(layout::volume_prefix(volume), None)
            .await?;
        Ok(records
            .into_iter()
            .filter(|r| r.volume == volume && r.removed.is_none())
            .collect())
    }

    /// Every record of `digest`, in any volume, tombstones included (`crate::refs`). One
    /// listing of `volumes/`; only the records of this digest are read.
    pub async fn list_references(&self, digest: &Digest) -> Result<Vec<VolumeRecord>> {
        self.volume_records(Prefix::Volumes.path(), Some(digest))
            .await
    }

    /// Every record in every volume, tombstones included (the collector's one listing).
    pub(crate) async fn list_all_references(&self) -> Result<Vec<VolumeRecord>> {
        self.volume_records(Prefix::Volumes.path(), None).await
    }

    /// Whether `record`'s proof holds: the writer had the bytes of the manifest it names.
    /// A record without a proof, or naming a manifest that is not live, does not hold.
    pub async fn verify_volume_record(&self, record: &VolumeRecord) -> Result<bool> {
        let bytes = match self.get_manifest_bytes(&record.digest).await {
            Ok(b) => b,
            Err(Error::UnknownVersion { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        Ok(Self::proof_holds(record, &bytes))
    }

    /// Whether `record`'s proof was made from `manifest_bytes` (already read, live or from
    /// the trash). A record without a proof never holds.
    pub fn proof_holds(record: &VolumeRecord, manifest_bytes: &[u8]) -> bool {
        let Some(proof) = &record.proof else {
            return false;
        };
        if Digest::of(manifest_bytes) != record.digest {
            return false;
        }
        let expected = Self::record_proof(&record.volume, manifest_bytes);
        // Both are 64 hex characters of a MAC; compare as hashes (constant time).
        match blake3::Hash::from_hex(proof) {
            Ok(given) => blake3::Hash::from_hex(&expected).is_ok_and(|e| e == given),
            Err(_) => false,
        }
    }

    /// Deletes the record of `digest` in `volume`; a missing one is fine.
    pub async fn delete_volume_record(&self, volume: &str, digest: &Digest) -> Result<()> {
        validate_volume_name(volume)?;
        self.delete_if_exists(&layout::volume_record_key(volume, digest))
            .await
    }

    async fn volume_records(
        &self,
        prefix: ObjectPath,
        of: Option<&Digest>,
    ) -> Result<Vec<VolumeRecord>> {
        let metas = crate::bounded::list_capped(self, &prefix, MAX_LISTED_OBJECTS).await?;
        let mut out = Vec::new();
        for meta in metas {
            if let Some(digest) = of
                && layout::parse_volume_record_key(&meta.location).map(|(_, d)| d) != Some(*digest)
            {
                continue;
            }
            // A record is a few hundred bytes; anything larger is not one of ours.
            if meta.size > MAX_RECORD_BYTES {
                continue;
            }
            let what = format!("volume record {}", meta.location);
            let body = match self
                .read_optional(&meta.location, &what, MAX_RECORD_BYTES)
                .await
            {
                Ok(Some(body)) => body,
                // Deleted between the listing and the read.
                Ok(None) => continue,
                // Larger than its listing said: not one of ours either.
                Err(Error::ResponseTooLarge { .. }) => continue,
                Err(e) => return Err(e),
            };
            // A record that does not parse, or whose key disagrees with its content, names
            // nothing we can trust.
            let Ok(record) = serde_json::from_slice::<VolumeRecord>(&body) else {
                continue;
            };
            let named = layout::parse_volume_record_key(&meta.location);
            if named.as_ref() != Some(&(record.volume.clone(), record.digest)) {
                continue;
            }
            out.push(record);
        }
        out.sort_by_key(|r| std::cmp::Reverse(r.pushed_at));
        Ok(out)
    }

    /// Fetches the chunk a manifest names and checks it all: its bytes hash to the digest
    /// ([`ChunkStore::get_chunk`]) and are as long as the manifest declares
    /// ([`crate::manifest::ChunkRef::check_len`], else [`Error::ChunkLengthMismatch`]).
    /// Verify and pull read chunks through this; the mount applies the same check to every
    /// tier.
    /// At most the declared length is read: a longer body is [`Error::ChunkLengthMismatch`],
    /// or [`Error::ResponseTooLarge`] when it is longer than any chunk can be.
    pub async fn get_chunk_checked(&self, chunk: &crate::manifest::ChunkRef) -> Result<Bytes> {
        let data = match self
            .get_chunk_within(&chunk.digest, u64::from(chunk.len))
            .await
        {
            // Longer than declared but no longer than a chunk can be: the manifest lies about
            // its chunk (as a short one is caught below).
            Err(Error::ResponseTooLarge { got_at_least, .. })
                if got_at_least <= MAX_CHUNK_BYTES =>
            {
                return Err(Error::ChunkLengthMismatch {
                    digest: chunk.digest,
                    declared: chunk.len,
                    actual: got_at_least,
                });
            }
            other => other?,
        };
        chunk.check_len(&data)?;
        Ok(data)
    }
}
