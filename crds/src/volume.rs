//! `SealedVolume`: a named stream of sealed versions, filled from a source.
// Each `printcolumn(...)` repeats keys such as `type_ = "string"`; clippy reads them as
// duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::condition::{Condition, find_condition};
use crate::schema;
use crate::validate::InvalidSpec;

/// The desired state of a SealedVolume: where versions come from, which names point at
/// which versions, and how long deleted versions stay restorable.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "sealedvolumes.io",
    version = "v1alpha1",
    kind = "SealedVolume",
    namespaced,
    shortname = "svol",
    category = "sealed",
    status = "SealedVolumeStatus",
    derive = "PartialEq",
    doc = "A named stream of immutable model versions. The operator syncs spec.source into the store in the background, seals each result as a SealedVolumeVersion named by its content digest (blake3:<64 hex>), and keeps spec.tags (movable names) pointing at those versions. Pods mount a version by digest (recommended) or by volume and tag.",
    printcolumn(
        name = "Source",
        type_ = "string",
        json_path = ".status.source",
        description = "Where versions come from (hf://org/repo@revision, s3://bucket/prefix, upload)"
    ),
    printcolumn(
        name = "Latest",
        type_ = "string",
        json_path = ".status.latestShort",
        description = "Digest of the newest sealed version, shortened (blake3:8f3a1c2d); the full one is the Latest Digest column of -o wide"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Synced",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Synced\")].status"
    ),
    printcolumn(
        name = "Progress",
        type_ = "string",
        json_path = ".status.sync.progress",
        priority = 1,
        description = "Progress of a running sync"
    ),
    printcolumn(
        name = "Latest Digest",
        type_ = "string",
        json_path = ".status.latestDigest",
        priority = 1,
        description = "Digest of the newest sealed version"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct SealedVolumeSpec {
    /// Where versions come from: exactly one of huggingFace, objectStore or upload.
    pub source: Source,

    /// Movable names for versions: tag name → version digest (blake3:<64 hex>). Each digest
    /// must be a version of this volume, or the volume's Ready condition turns False. Tag names
    /// are lowercase letters, digits, '-' and '.', start and end with a letter or digit, and
    /// have at most 63 characters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "schema::tags")]
    #[x_kube(validation = kube::core::Rule::new(
        "self.all(k, size(k) <= 63 && k.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$'))"
    ).message("invalid tag name: a tag name has lowercase letters, digits, '-' and '.', starts and ends with a letter or digit, and is at most 63 characters"))]
    pub tags: BTreeMap<String, String>,

    /// How long deleted versions are kept.
    #[serde(default)]
    pub retention: Retention,

    /// When true, pods in other namespaces may mount this volume's versions. By default only
    /// pods in the volume's own namespace may.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,

    /// Warm each new version after it is sealed: its bytes are fetched into the node disk
    /// caches of `nodes` node plugins (picked by rendezvous hashing of the version's digest
    /// over the live node plugins) before any pod asks. Unset: versions are fetched when a
    /// pod first reads them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<Warm>,

    /// Who must have signed each version: an OpenSSF model signature (`model_signing`'s
    /// `model.sig`) in the version is checked against its sealed manifest when the version is
    /// sealed. A version whose signature is missing or does not verify is not Ready, and an
    /// Event names the file or signer that failed. Unset: versions are not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Verify>,
}

/// Signature verification of new versions (`spec.verify`): keys, certificates, or both (a
/// signature verifying with any one is accepted).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "(has(self.keys) ? size(self.keys) : 0) + (has(self.certificates) ? 1 : 0) > 0"
).message("spec.verify names no signer: give keys or certificates"))]
pub struct Verify {
    /// Key mode: the signers' public keys (PEM, ECDSA P-256 or P-384), each a key of a Secret
    /// or ConfigMap of this namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub keys: Vec<KeyRef>,

    /// Certificate mode: the signing certificate chains to the CA bundle and names one of
    /// the identities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificates: Option<CertificateVerify>,

    /// Where the signature is in the version, relative to its root. Default model.sig, where
    /// model_signing writes it.
    #[serde(default = "default_signature_path")]
    #[schemars(length(min = 1, max = 1024))]
    pub signature_path: String,

    /// Paths of the version the signature need not cover (files, or directories with
    /// everything below them), besides the signature itself and the signature's own
    /// ignore paths: as model_signing's --ignore-paths.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub ignore_paths: Vec<String>,
}

/// The default `spec.verify.signaturePath`.
pub const DEFAULT_SIGNATURE_PATH: &str = "model.sig";

fn default_signature_path() -> String {
    DEFAULT_SIGNATURE_PATH.into()
}

/// A PEM value from a key of a Secret or a ConfigMap of this namespace: set exactly one.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "(has(self.secretKeyRef) ? 1 : 0) + (has(self.configMapKeyRef) ? 1 : 0) == 1"
).message("set exactly one of secretKeyRef or configMapKeyRef"))]
pub struct KeyRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_key_ref: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_key_ref: Option<ConfigMapKeyRef>,
}

/// A key of a ConfigMap in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub struct ConfigMapKeyRef {
    /// Name of the ConfigMap.
    #[schemars(schema_with = "schema::object_name")]
    pub name: String,
    /// Key within the ConfigMap.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// Certificate mode of `spec.verify`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CertificateVerify {
    /// The CA bundle (PEM certificates) the signing certificate must chain to.
    pub ca: KeyRef,
    /// Accepted signers: an email, URI or DNS name (subject alternative name) of the signing
    /// certificate; any one matches.
    #[schemars(length(min = 1, max = 64))]
    pub identities: Vec<String>,
    /// Check the chain when the version is sealed, refusing an expired signing certificate.
    /// Default false: checked when the signing certificate was issued, as model_signing does
    /// (the signature carries no trusted time).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_valid_now: bool,
}

/// Warming of new versions (`spec.warm`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Warm {
    /// On how many nodes (0 to 1000) a new version is fetched into the disk cache. All the
    /// node plugins when there are fewer; 0 warms none.
    #[schemars(range(min = 0, max = 1000))]
    pub nodes: u32,
}

/// Most nodes `spec.warm.nodes` may name.
pub const MAX_WARM_NODES: u32 = 1000;

/// Where a volume's versions come from. Set exactly one field.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "(has(self.huggingFace) ? 1 : 0) + (has(self.objectStore) ? 1 : 0) + (has(self.upload) ? 1 : 0) == 1"
).message("set exactly one of huggingFace, objectStore or upload"))]
pub struct Source {
    /// Sync from a Hugging Face Hub repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    /// Sync from an object store prefix (S3 and S3-compatible such as R2 and CoreWeave, GCS,
    /// Azure Blob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_store: Option<ObjectStoreSource>,
    /// No sync: versions arrive from `sealed push --volume NAMESPACE/NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload: Option<UploadSource>,
}

/// The one source a valid [`Source`] has.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SourceKind<'a> {
    HuggingFace(&'a HuggingFaceSource),
    ObjectStore(&'a ObjectStoreSource),
    Upload(&'a UploadSource),
}

impl Source {
    /// The source that is set, or an error when none or more than one is (the API server
    /// rejects such objects; this is for objects built in code).
    pub fn kind(&self) -> Result<SourceKind<'_>, InvalidSpec> {
        match (&self.hugging_face, &self.object_store, &self.upload) {
            (Some(hf), None, None) => Ok(SourceKind::HuggingFace(hf)),
            (None, Some(os), None) => Ok(SourceKind::ObjectStore(os)),
            (None, None, Some(up)) => Ok(SourceKind::Upload(up)),
            _ => Err(InvalidSpec::new(
                "spec.source",
                "set exactly one of huggingFace, objectStore or upload",
            )),
        }
    }

    /// A Hugging Face source.
    pub fn hugging_face(src: HuggingFaceSource) -> Self {
        Self {
            hugging_face: Some(src),
            ..Self::default()
        }
    }

    /// An object store source.
    pub fn object_store(src: ObjectStoreSource) -> Self {
        Self {
            object_store: Some(src),
            ..Self::default()
        }
    }

    /// An upload source.
    pub fn upload() -> Self {
        Self {
            upload: Some(UploadSource {}),
            ..Self::default()
        }
    }

    /// Parses the one-line form `sealed sync` takes and `status.source` shows:
    /// `hf://org/name[@revision]`, `hf://datasets/org/name[@revision]`, an object store URL
    /// (`s3://bucket/prefix`, `gs://…`, `az://…`, `https://…`), or `upload`.
    pub fn from_uri(uri: &str) -> Result<Self, InvalidSpec> {
        if uri == "upload" {
            return Ok(Self::upload());
        }
        if let Some(rest) = uri.strip_prefix("hf://") {
            let (repo_type, rest) = match rest.strip_prefix("datasets/") {
                Some(r) => (HuggingFaceRepoType::Dataset, r),
                None => (HuggingFaceRepoType::Model, rest),
            };
            let (repo, revision) = match rest.split_once('@') {
                Some((repo, rev)) => (repo, rev),
                None => (rest, "main"),
            };
            let source = Self::hugging_face(HuggingFaceSource {
                repo: repo.into(),
                revision: revision.into(),
                repo_type,
                include: vec![],
                exclude: vec![],
                token_secret_ref: None,
                endpoint: None,
            });
            return source.checked(uri);
        }
        Self::object_store(ObjectStoreSource {
            url: uri.into(),
            endpoint: None,
            region: None,
            credentials_secret_ref: None,
        })
        .checked(uri)
    }

    fn checked(self, uri: &str) -> Result<Self, InvalidSpec> {
        let spec = SealedVolumeSpec {
            source: self,
            tags: BTreeMap::new(),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: None,
        };
        match spec.validate().into_iter().next() {
            None => Ok(spec.source),
            Some(e) => Err(InvalidSpec::new(
                "source",
                format!(
                    "{uri:?} is not a source ({}); use hf://org/name[@revision], s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or upload",
                    e.message
                ),
            )),
        }
    }

    /// The source in one line (the inverse of [`Source::from_uri`]), for `status.source`.
    pub fn summary(&self) -> String {
        match self.kind() {
            Ok(SourceKind::HuggingFace(hf)) => {
                let prefix = match hf.repo_type {
                    HuggingFaceRepoType::Model => "",
                    HuggingFaceRepoType::Dataset => "datasets/",
                };
                format!("hf://{prefix}{}@{}", hf.repo, hf.revision)
            }
            Ok(SourceKind::ObjectStore(os)) => os.url.clone(),
            Ok(SourceKind::Upload(_)) => "upload".into(),
            Err(_) => "invalid".into(),
        }
    }
}

/// A Hugging Face Hub repository.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HuggingFaceSource {
    /// The repository id, `org/name` (or `name`), e.g. meta-llama/Meta-Llama-3-8B.
    #[x_kube(validation = kube::core::Rule::new(
        "self.matches('^[A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)?$')"
    ).message("must be a Hugging Face repository id: org/name"))]
    #[schemars(length(min = 1, max = 256))]
    pub repo: String,

    /// Branch, tag or commit to sync. The operator pins it to a commit for each sync; the
    /// commit is recorded in the version's status.sourceRevision.
    #[serde(default = "default_revision")]
    #[schemars(length(min = 1, max = 256))]
    pub revision: String,

    /// Kind of repository.
    #[serde(default)]
    pub repo_type: HuggingFaceRepoType,

    /// Glob patterns of files to sync (e.g. "*.safetensors"); empty means every file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 1024)))]
    pub include: Vec<String>,

    /// Glob patterns of files to leave out; applied after include.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 1024)))]
    pub exclude: Vec<String>,

    /// A Secret key holding an access token, for gated and private repositories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,

    /// Base URL of the Hub API; empty means https://huggingface.co. Set for a mirror or a
    /// private Hub endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self.matches('^https?://[^/]+')")
        .message("must be an http(s) URL such as https://huggingface.co"))]
    #[schemars(length(max = 2048))]
    pub endpoint: Option<String>,
}

fn default_revision() -> String {
    "main".into()
}

/// The kind of Hugging Face repository.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum HuggingFaceRepoType {
    /// A model repository (the default).
    #[default]
    Model,
    /// A dataset repository.
    Dataset,
}

/// Objects under a prefix of a bucket or container.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectStoreSource {
    /// The prefix to sync: s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, or an
    /// https:// URL of an S3-compatible or Azure endpoint (R2, CoreWeave, ...).
    #[x_kube(validation = kube::core::Rule::new(
        "self.matches('^(s3|s3a|gs|az|azure|abfs|abfss|adl|http|https|file)://.+')"
    ).message("must be a URL such as s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or https://host/bucket/prefix"))]
    #[schemars(length(min = 1, max = 2048))]
    pub url: String,

    /// The S3-compatible API endpoint (e.g. https://<account>.r2.cloudflarestorage.com); empty
    /// means the provider's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self.matches('^https?://[^/]+')")
        .message("must be an http(s) URL such as https://s3.example.com"))]
    #[schemars(length(max = 2048))]
    pub endpoint: Option<String>,

    /// The region (S3); empty means the provider's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub region: Option<String>,

    /// A Secret in the volume's namespace with the credentials, as environment-style keys:
    /// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (S3), GOOGLE_SERVICE_ACCOUNT_KEY (GCS),
    /// AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY (Azure). Empty means the
    /// ambient credentials of the sync Job (workload identity, instance role).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretRef>,
}

/// Versions arrive from `sealed push`; the operator does not sync anything.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
pub struct UploadSource {}

/// A key of a Secret in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(schema_with = "schema::object_name")]
    pub name: String,
    /// Key within the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A Secret in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub struct SecretRef {
    /// Name of the Secret.
    #[schemars(schema_with = "schema::object_name")]
    pub name: String,
}

/// Retention of deleted versions.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// How long a deleted version stays restorable (`sealed restore DIGEST`) before garbage
    /// collection may reclaim its chunks, as a Go duration: 168h, 72h, 30m, 0; at most
    /// 876000h (100 years).
    // The bound is `validate::MAX_DURATION` (longer would overflow the timestamps it is
    // added to). A value too large for CEL's `duration()` (Go's int64 nanoseconds) fails the
    // rule's evaluation, which the API server reports as invalid with the same message.
    #[serde(default = "default_deleted_versions")]
    #[x_kube(validation = kube::core::Rule::new(
        "self.matches('^(0|([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+)$') && duration(self) <= duration('876000h')"
    ).message("must be a duration such as 168h, 72h, 1h30m or 0 (units: h, m, s, ms, us, ns), at most 876000h (100 years)"))]
    #[schemars(length(min = 1, max = 64))]
    pub deleted_versions: String,
}

/// The default retention of deleted versions: 7 days.
pub const DEFAULT_DELETED_VERSIONS: &str = "168h";

fn default_deleted_versions() -> String {
    DEFAULT_DELETED_VERSIONS.into()
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            deleted_versions: default_deleted_versions(),
        }
    }
}

impl Retention {
    /// `deletedVersions` as a duration.
    pub fn deleted_versions(&self) -> Result<std::time::Duration, InvalidSpec> {
        crate::validate::parse_duration_checked(&self.deleted_versions).map_err(|e| {
            InvalidSpec::new(
                "spec.retention.deletedVersions",
                format!("{}: {e}", crate::validate::DURATION_HELP),
            )
        })
    }
}

/// What the operator last saw and did.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SealedVolumeStatus {
    /// Synced (the last sync finished) and Ready (a version exists and every tag resolves).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,

    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// The source in one line, for `kubectl get`: hf://org/repo@revision,
    /// s3://bucket/prefix, upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,

    /// Digest of the newest sealed version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_digest: Option<String>,

    /// latestDigest shortened to its first 8 hex digits (blake3:8f3a1c2d), for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_short: Option<String>,

    /// Name of the SealedVolumeVersion holding latestDigest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_version: Option<String>,

    /// The running (or last) sync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<SyncProgress>,

    /// What each tag in spec.tags resolves to.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, TagStatus>,
}

impl SealedVolume {
    /// What asks for a sync: `source=<12 hex of spec.source>,resync=<annotation>`. The operator
    /// syncs once per trigger (recorded in `status.sync.trigger`), so changing the source or
    /// the `sealedvolumes.io/resync` annotation starts a sync, and moving a tag does not.
    pub fn sync_trigger(&self) -> String {
        let source = serde_json::to_vec(&self.spec.source).unwrap_or_default();
        let hash = blake3::hash(&source).to_hex();
        let resync = self
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::RESYNC_ANNOTATION))
            .map(String::as_str)
            .unwrap_or("");
        format!("source={},resync={resync}", &hash.as_str()[..12])
    }
}

impl SealedVolumeSpec {
    /// The digest a tag names, if the tag exists.
    pub fn tag(&self, name: &str) -> Option<&str> {
        self.tags.get(name).map(String::as_str)
    }
}

impl SealedVolumeStatus {
    /// The condition of this type, if set.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        find_condition(&self.conditions, type_)
    }
}

/// Progress of a sync.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SyncProgress {
    /// What started this sync: a hash of spec.source and the value of the
    /// `sealedvolumes.io/resync` annotation, e.g. "source=3f2a9c01d4e5,resync=2026-11-30T10:00:00Z".
    /// The operator starts a new sync when this differs from the current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// The source revision being synced (a Hugging Face commit, or a summary of object ETags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The digest the sync sealed, once it has succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The Job running the sync (empty with the inline executor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// When the sync started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub started_at: Option<Time>,
    /// When the sync finished (empty while it runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub finished_at: Option<Time>,
    /// Bytes read from the source so far.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub bytes_done: i64,
    /// Bytes to read in all (0 until the listing is done).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub bytes_total: i64,
    /// Files read so far.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub files_done: i64,
    /// Files to read in all (0 until the listing is done).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub files_total: i64,
    /// Progress in one line, for `kubectl get -o wide`, e.g. "41% (3.1 GiB of 7.5 GiB, 4/9 files)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
}

/// What one tag resolves to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TagStatus {
    /// The digest the tag names.
    pub digest: String,
    /// The SealedVolumeVersion of this volume with that digest; empty when there is none
    /// (the tag does not resolve, and Ready is False).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_trigger_follows_source_and_resync_not_tags() {
        let mut v = SealedVolume::new(
            "v",
            SealedVolumeSpec {
                source: Source::from_uri("hf://org/name@main").unwrap(),
                tags: BTreeMap::new(),
                retention: Retention::default(),
                shared: false,
                warm: None,
                verify: None,
            },
        );
        let first = v.sync_trigger();
        v.spec.tags.insert("prod".into(), "blake3:00".into());
        assert_eq!(v.sync_trigger(), first, "a tag move must not sync");
        v.metadata.annotations = Some(BTreeMap::from([(
            crate::RESYNC_ANNOTATION.to_string(),
            "1".to_string(),
        )]));
        let resynced = v.sync_trigger();
        assert_ne!(resynced, first);
        assert!(resynced.ends_with(",resync=1"), "{resynced}");
        v.spec.source = Source::from_uri("hf://org/name@v2").unwrap();
        assert_ne!(v.sync_trigger(), resynced, "a new source must sync");
    }

    #[test]
    fn source_uris_round_trip() {
        for (uri, summary) in [
            (
                "hf://meta-llama/Meta-Llama-3-8B",
                "hf://meta-llama/Meta-Llama-3-8B@main",
            ),
            ("hf://org/name@8afc5e2", "hf://org/name@8afc5e2"),
            ("hf://datasets/org/data@v1.0", "hf://datasets/org/data@v1.0"),
            ("hf://gpt2", "hf://gpt2@main"),
            ("s3://models/llama", "s3://models/llama"),
            ("gs://b/p", "gs://b/p"),
            ("az://container/prefix", "az://container/prefix"),
            ("upload", "upload"),
        ] {
            let s = Source::from_uri(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
            assert_eq!(s.summary(), summary);
            assert_eq!(Source::from_uri(summary).unwrap(), s);
        }
        let hf = Source::from_uri("hf://datasets/org/data@v1").unwrap();
        let SourceKind::HuggingFace(hf) = hf.kind().unwrap() else {
            panic!()
        };
        assert_eq!(hf.repo_type, HuggingFaceRepoType::Dataset);
        assert_eq!((hf.repo.as_str(), hf.revision.as_str()), ("org/data", "v1"));
        for bad in [
            "hf://a/b/c",
            "hf://",
            "hf://org/name@",
            "models/llama",
            "ftp://x/y",
            "",
        ] {
            let e = Source::from_uri(bad).unwrap_err();
            assert!(e.message.contains("is not a source"), "{bad}: {e}");
        }
    }
}
