//! Kubernetes API types for Sealed Volumes: [`SealedVolume`] and [`SealedVolumeVersion`]
//! (group `sealedvolumes.io`, version `v1alpha1`).
//!
//! The CRD YAML in `crds/yaml/` is generated from these types by the `crdgen` binary
//! (`cargo run -p sealed-crds --bin crdgen`) and checked in; a unit test fails when the
//! checked-in files differ from what the types generate. Validation that the API server
//! enforces at admission (digest format, tag names, exactly one source, immutable digest,
//! retention durations) is declared here as OpenAPI patterns and CEL rules; [`validate`]
//! has the same checks in Rust for clients that want to fail before they call the server.

pub mod attestation;
pub mod condition;
pub mod csi;
pub mod publications;
pub mod schema;
pub mod validate;
pub mod version;
pub mod volume;
pub mod warming;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use condition::{
    CONDITION_READY, CONDITION_SYNCED, Condition, find_condition, new_condition, set_condition,
};
pub use validate::{InvalidSpec, is_digest, is_duration, is_tag_name};
pub use version::{
    CONDITION_VERIFIED, SealedVolumeVersion, SealedVolumeVersionSpec, SealedVolumeVersionStatus,
    Verification,
};
pub use volume::{
    HuggingFaceRepoType, HuggingFaceSource, ObjectStoreSource, Retention, SealedVolume,
    SealedVolumeSpec, SealedVolumeStatus, SecretKeyRef, SecretRef, Source, SourceKind,
    SyncProgress, TagStatus, UploadSource, Verify, Warm,
};

/// The API group of both resources.
pub const GROUP: &str = "sealedvolumes.io";
/// The API version of both resources.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` as written in manifests.
pub const API_VERSION: &str = "sealedvolumes.io/v1alpha1";

/// The label the operator puts on a `SealedVolumeVersion` naming its `SealedVolume`.
pub const VOLUME_LABEL: &str = "sealedvolumes.io/volume";

/// On a `SealedVolumeVersion`: on how many nodes (0 to 1000) the node plugins warm it (fetch
/// it into their disk caches before a pod asks). The operator copies a volume's
/// `spec.warm.nodes` onto each version it creates; a version applied from Git may carry it.
pub const WARM_ANNOTATION: &str = "sealedvolumes.io/warm-nodes";

/// The warm count of a version's [`WARM_ANNOTATION`] value: `Ok(None)` without one, an error
/// naming the bound for a value that is not a count from 0 to 1000.
pub fn warm_nodes(
    annotations: &std::collections::BTreeMap<String, String>,
) -> Result<Option<u32>, String> {
    let Some(value) = annotations.get(WARM_ANNOTATION) else {
        return Ok(None);
    };
    match value.trim().parse::<u32>() {
        Ok(n) if n <= volume::MAX_WARM_NODES => Ok(Some(n)),
        _ => {
            let shown: String = value.chars().take(32).collect();
            Err(format!(
                "annotation {WARM_ANNOTATION} is {shown:?}, not a node count from 0 to {}",
                volume::MAX_WARM_NODES
            ))
        }
    }
}

/// Set this annotation on a `SealedVolume` (to any new value, e.g. the time) to sync its
/// source again although the spec did not change: `kubectl annotate svol NAME
/// sealedvolumes.io/resync="$(date -Is)" --overwrite`.
pub const RESYNC_ANNOTATION: &str = "sealedvolumes.io/resync";

/// A Secret is used as a source's credentials (`tokenSecretRef`, `credentialsSecretRef`) only
/// with this label set to `"true"`: `kubectl label secret NAME
/// sealedvolumes.io/source-credentials=true`.
pub const SOURCE_CREDENTIALS_LABEL: &str = "sealedvolumes.io/source-credentials";

/// Optional on a source credentials Secret: the hosts it may be sent to, comma-separated
/// (`host`, `host:port` or `*.domain`), e.g. `"huggingface.co"` or `"*.r2.cloudflarestorage.com"`.
pub const ALLOWED_HOSTS_ANNOTATION: &str = "sealedvolumes.io/allowed-hosts";

/// How many hex digits of a digest `kubectl get` shows (`status.latestShort`): 32 bits tell
/// apart the versions of one volume; the full digest stays in `status.latestDigest`.
pub const SHORT_DIGEST_HEX: usize = 8;

/// A digest shortened for display: `blake3:8f3a1c2d` from `blake3:8f3a1c2d…` (64 hex). Text
/// that is not a digest is returned whole, so nothing is hidden.
pub fn short_digest(digest: &str) -> String {
    let short = digest.get(.."blake3:".len() + SHORT_DIGEST_HEX);
    match short {
        Some(short) if is_digest(digest) => short.to_owned(),
        _ => digest.to_owned(),
    }
}

/// The CRDs of this crate, in a stable order.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![SealedVolume::crd(), SealedVolumeVersion::crd()]
}

/// The file name (under `crds/yaml/`) that holds a CRD: `<group>_<plural>.yaml`, as
/// controller-gen names them.
pub fn crd_file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// The YAML text of a CRD exactly as it is checked in (with a header saying it is generated).
///
/// # Errors
/// When the CRD cannot be serialized (it always can: a bug otherwise).
pub fn crd_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_saphyr::SerializeError> {
    let mut body = serde_saphyr::to_string(crd)?;
    if !body.ends_with('\n') {
        body.push('\n');
    }
    Ok(format!(
        "# Generated by `cargo run -p sealed-crds --bin crdgen` from crds/src; do not edit.\n---\n{body}"
    ))
}

/// Every generated file: `(file name, YAML text)`, in the order of [`crds`].
///
/// # Errors
/// See [`crd_yaml`].
pub fn generated_files() -> Result<Vec<(String, String)>, serde_saphyr::SerializeError> {
    crds()
        .iter()
        .map(|crd| Ok((crd_file_name(crd), crd_yaml(crd)?)))
        .collect()
}

/// Where the generated YAML is checked in.
pub fn yaml_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("yaml")
}

/// Bytes in binary units with one decimal: 3.1 GiB.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
