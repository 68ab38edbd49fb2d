//! The operator's half of version attestation (`sealed_crds::attestation`): the key, kept in
//! a Secret of the operator's namespace that the operator makes on first start, and the
//! `status.attestation` it writes on the versions it makes.
//!
//! The Secret is made by the operator rather than templated by Helm so that GitOps tools
//! that re-render the chart (Argo CD cannot `lookup`) never rotate it by accident; it is
//! not deleted by `helm uninstall`, so a reinstall keeps every version mountable.

use std::collections::BTreeMap;
use std::io::Read as _;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use sealed_crds::SealedVolumeVersion;
use sealed_crds::attestation::{AttestationKey, SECRET_KEY};

use crate::error::{Error, Result};

/// Field manager of `status.attestation`.
const ATTESTATION_MANAGER: &str = "sealed-operator-attestation";

/// Reads the key from Secret `namespace/name`, making the Secret (32 random bytes) when it
/// does not exist yet. Two operators starting at once agree: the second one's create fails
/// with a conflict and it reads the first one's key.
pub async fn ensure_key(client: &Client, namespace: &str, name: &str) -> Result<AttestationKey> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret = match secrets.get_opt(name).await? {
        Some(s) => s,
        None => {
            let material = random_bytes::<32>()?;
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    namespace: Some(namespace.into()),
                    labels: Some(BTreeMap::from([(
                        crate::fleet_pki::MANAGED_BY.0.to_string(),
                        crate::fleet_pki::MANAGED_BY.1.to_string(),
                    )])),
                    annotations: Some(BTreeMap::from([(
                        "sealedvolumes.io/purpose".to_string(),
                        "The key that proves a SealedVolumeVersion was made by the operator; \
                         the node plugins read it. Deleting it makes every version unmountable \
                         until the operator re-attests them."
                            .to_string(),
                    )])),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([(
                    SECRET_KEY.to_string(),
                    ByteString(material.to_vec()),
                )])),
                type_: Some("Opaque".into()),
                ..Default::default()
            };
            crate::fleet_pki::create_or_read(&secrets, &secret).await?
        }
    };
    key_from_secret(&secret).map_err(|message| Error::Invalid {
        object: format!("Secret {namespace}/{name}"),
        message,
    })
}

fn key_from_secret(secret: &Secret) -> Result<AttestationKey, String> {
    let material = secret
        .data
        .as_ref()
        .and_then(|d| d.get(SECRET_KEY))
        .map(|b| b.0.clone())
        .ok_or_else(|| format!("has no data key {SECRET_KEY:?}"))?;
    AttestationKey::from_secret_bytes(&material).map_err(|e| e.to_string())
}

/// `N` bytes from the kernel's random source (keys, tokens).
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut buf = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| Error::Invalid {
            object: "random key material".into(),
            message: format!("cannot read /dev/urandom: {e}"),
        })?;
    Ok(buf)
}

/// Writes the attestation of `digest` as a version of `namespace/volume` on version `name`.
/// What it attests is what the operator decided, not what the object says: if the object
/// (made by someone else under that name) names another volume or digest, the attestation
/// does not verify for it and it authorizes nothing.
pub async fn attest(
    api: &Api<SealedVolumeVersion>,
    key: &AttestationKey,
    namespace: &str,
    name: &str,
    volume: &str,
    digest: &str,
) -> Result<()> {
    let patch = serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolumeVersion",
        "status": { "attestation": key.attest(namespace, volume, digest) }
    });
    api.patch_status(
        name,
        &PatchParams::apply(ATTESTATION_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

/// Whether `version` carries this key's attestation of its own namespace, volume and digest.
pub fn is_attested(version: &SealedVolumeVersion, key: &AttestationKey) -> bool {
    let namespace = version.metadata.namespace.as_deref().unwrap_or_default();
    version
        .status
        .as_ref()
        .and_then(|s| s.attestation.as_deref())
        .is_some_and(|a| key.verify(a, namespace, &version.spec.volume, &version.spec.digest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_crds::{SealedVolumeVersionSpec, SealedVolumeVersionStatus};

    const D: &str = "blake3:1111111111111111111111111111111111111111111111111111111111111111";

    fn version(ns: &str, volume: &str, attestation: Option<String>) -> SealedVolumeVersion {
        let mut v = SealedVolumeVersion::new(
            "v",
            SealedVolumeVersionSpec {
                volume: volume.into(),
                digest: D.into(),
            },
        );
        v.metadata.namespace = Some(ns.into());
        v.status = Some(SealedVolumeVersionStatus {
            attestation,
            ..Default::default()
        });
        v
    }

    #[test]
    fn a_version_is_attested_only_for_its_own_namespace_and_volume() {
        let key = AttestationKey::from_secret_bytes(&[1u8; 32]).unwrap();
        let a = key.attest("b", "private", D);
        assert!(is_attested(&version("b", "private", Some(a.clone())), &key));
        // Copied into another namespace's version, or onto another volume: worthless.
        assert!(!is_attested(
            &version("a", "private", Some(a.clone())),
            &key
        ));
        assert!(!is_attested(&version("b", "other", Some(a)), &key));
        assert!(!is_attested(&version("b", "private", None), &key));
    }

    #[test]
    fn key_from_a_secret() {
        let mut s = Secret::default();
        assert!(key_from_secret(&s).unwrap_err().contains("no data key"));
        s.data = Some(BTreeMap::from([(
            SECRET_KEY.into(),
            ByteString(vec![1; 8]),
        )]));
        assert!(key_from_secret(&s).unwrap_err().contains("at least 32"));
        s.data = Some(BTreeMap::from([(
            SECRET_KEY.into(),
            ByteString(vec![1; 32]),
        )]));
        assert!(key_from_secret(&s).is_ok());
        assert_ne!(random_bytes::<32>().unwrap(), random_bytes::<32>().unwrap());
    }
}
