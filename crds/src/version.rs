//! `SealedVolumeVersion`: one sealed, immutable version of a volume.
// Each `printcolumn(...)` repeats keys such as `type_ = "string"`; clippy reads them as
// duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::condition::{Condition, find_condition};
use crate::schema;

/// The identity of a SealedVolumeVersion: which volume, which digest. Both immutable.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "sealedvolumes.io",
    version = "v1alpha1",
    kind = "SealedVolumeVersion",
    namespaced,
    shortname = "svv",
    category = "sealed",
    status = "SealedVolumeVersionStatus",
    derive = "PartialEq",
    doc = "One sealed version of a SealedVolume: an immutable directory tree named by its content digest. Pods in this namespace may mount the digest (pods in any namespace when the volume is shared). Deleting it moves the version to trash; `sealed restore DIGEST` brings it back within the volume's spec.retention.deletedVersions.",
    selectable = ".spec.digest",
    selectable = ".spec.volume",
    printcolumn(name = "Volume", type_ = "string", json_path = ".spec.volume"),
    printcolumn(name = "Digest", type_ = "string", json_path = ".spec.digest"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Size",
        type_ = "string",
        json_path = ".status.size",
        description = "File content in binary units (14.9 GiB); the exact count is the Bytes column of -o wide"
    ),
    printcolumn(name = "Files", type_ = "integer", json_path = ".status.files"),
    printcolumn(
        name = "Bytes",
        type_ = "integer",
        json_path = ".status.sizeBytes",
        priority = 1,
        description = "Bytes of file content"
    ),
    printcolumn(
        name = "Reused",
        type_ = "integer",
        json_path = ".status.bytesReused",
        priority = 1,
        description = "Bytes whose chunks were already in the store"
    ),
    printcolumn(
        name = "Revision",
        type_ = "string",
        json_path = ".status.sourceRevision",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct SealedVolumeVersionSpec {
    /// Name of the SealedVolume (in this namespace) this is a version of. Immutable.
    #[schemars(schema_with = "schema::object_name")]
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("spec.volume is immutable"))]
    pub volume: String,

    /// The version's content digest, blake3:<64 lowercase hex>. Immutable: a version never
    /// changes; a new tree is a new version.
    #[schemars(schema_with = "schema::digest")]
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf")
        .message("spec.digest is immutable: a sealed version never changes; create a new SealedVolumeVersion instead"))]
    pub digest: String,
}

impl SealedVolumeVersionSpec {
    /// The object name the operator gives the version of `volume` with `digest`:
    /// `<volume>-<first 16 hex digits>`, shortened so it stays a valid name.
    pub fn object_name(volume: &str, digest: &str) -> String {
        let hex = digest.strip_prefix("blake3:").unwrap_or(digest);
        let hex: String = hex.chars().take(16).collect();
        let max_volume = 253 - 1 - hex.len();
        let cut = (0..=volume.len().min(max_volume))
            .rev()
            .find(|&i| volume.is_char_boundary(i))
            .unwrap_or(0);
        let volume = &volume[..cut];
        format!("{}-{hex}", volume.trim_end_matches(['-', '.']))
    }
}

/// What was sealed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SealedVolumeVersionStatus {
    /// Ready: the manifest is sealed in the store and every chunk it names is durable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,

    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Total bytes of file content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub size_bytes: Option<i64>,

    /// sizeBytes in binary units with one decimal (14.9 GiB), for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,

    /// Number of regular files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub files: Option<i64>,

    /// Number of distinct chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub chunks: Option<i64>,

    /// Bytes of chunks uploaded by the sync or push that sealed this version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub bytes_new: Option<i64>,

    /// Bytes of chunks that were already in the store (shared with earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub bytes_reused: Option<i64>,

    /// When the manifest was sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::time")]
    pub sealed_at: Option<Time>,

    /// What was synced: the Hugging Face commit, or for an object store a summary of the
    /// objects' ETags; empty for uploads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_revision: Option<String>,

    /// The operator's proof that it made this version (see `sealed_crds::attestation`): the
    /// node plugin mounts a digest only through a version whose attestation verifies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attestation: Option<String>,

    /// The model signature the version was checked against when its volume has
    /// `spec.verify` (condition Verified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<Verification>,
}

/// `Verified`: the version's model signature verified against its sealed manifest
/// (`True`), or did not (`False`, the message names the file or signer).
pub const CONDITION_VERIFIED: &str = "Verified";

/// A verified model signature.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Verification {
    /// Who signed: the certificate's identity, or the key (curve and SHA-256 hint).
    pub signer: String,
    /// key or certificate.
    pub mode: String,
    /// The files' digest algorithm the signature lists (blake3, sha256).
    pub algorithm: String,
    /// The signature file in the version.
    pub signature_path: String,
    /// Files signed and found with the signed digest.
    #[schemars(range(min = 0))]
    pub files: i64,
    /// The model name the signature gives (informative).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// When it was verified.
    #[schemars(schema_with = "schema::time")]
    pub verified_at: Time,
}

impl SealedVolumeVersionStatus {
    /// The condition of this type, if set.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        find_condition(&self.conditions, type_)
    }
}
