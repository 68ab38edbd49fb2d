//! What a sync reads, as plain data: a Hugging Face repository or an object-store prefix.
//!
//! These mirror the `SealedVolume` API's `spec.source` without its Kubernetes parts (the
//! Secret references: the secrets themselves arrive as [`crate::SourceCredentials`]). The
//! operator converts its API type into a [`SourceSpec`]; error messages name the API fields
//! (`spec.source.huggingFace.endpoint`, ...) because that is where a tenant fixes them.

use crate::error::SourceError;

/// The one source of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    /// A Hugging Face Hub repository.
    HuggingFace(HubRepo),
    /// Objects under a prefix of a bucket or container.
    ObjectStore(BucketPrefix),
    /// A model in an OCI registry: a CNCF ModelPack artifact, or a directory of an image.
    Oci(OciArtifact),
    /// Versions arrive from `sealed push`: nothing to sync.
    Upload,
}

/// A Hugging Face Hub repository at a revision, with the files to take from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubRepo {
    /// The repository id, `org/name` (or `name`).
    pub repo: String,
    /// Branch, tag or commit; a sync pins it to a commit.
    pub revision: String,
    pub repo_type: HubRepoType,
    /// Glob patterns of files to sync; empty means every file.
    pub include: Vec<String>,
    /// Glob patterns of files to leave out; applied after include.
    pub exclude: Vec<String>,
    /// The Hub's URL; `None` means <https://huggingface.co>.
    pub endpoint: Option<String>,
}

/// Kind of Hub repository.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HubRepoType {
    #[default]
    Model,
    Dataset,
}

/// A prefix of a bucket or container: `s3://`, `gs://`, `az://`, an `https://` S3-compatible
/// or Azure URL, or (with the operator's flag) `file://`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPrefix {
    pub url: String,
    /// The S3-compatible API endpoint; `None` means the provider's default.
    pub endpoint: Option<String>,
    /// The region (S3); `None` means the provider's default.
    pub region: Option<String>,
}

/// A model in an OCI registry ([`crate::oci`]): a CNCF ModelPack artifact (every file
/// layer), or a directory of an image's filesystem (`path`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OciArtifact {
    /// `REGISTRY/REPO:TAG` or `REGISTRY/REPO@sha256:<64 hex>`, optionally written with an
    /// `oci://` prefix; no tag and no digest means `:latest`.
    pub reference: String,
    /// For an image: the directory of its filesystem that becomes the version (`/models`).
    /// `None` for a ModelPack artifact (an image without it is refused).
    pub path: Option<String>,
    /// The registry's API base URL (`http://127.0.0.1:5000` for a test registry); `None`
    /// means `https://REGISTRY`.
    pub endpoint: Option<String>,
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
