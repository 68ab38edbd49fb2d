//! The attestation key (`sealed_crds::attestation`), read from the operator's Secret and
//! cached, and the rules a SealedVolumeVersion must meet before it lets a pod mount its digest.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use sealed_crds::SealedVolumeVersion;
use sealed_crds::attestation::{AttestationKey, SECRET_KEY};

use crate::error::CsiError;

/// A failed verification re-reads the Secret at most this often (a rotated key is picked up).
pub const REFRESH_AFTER: Duration = Duration::from_secs(30);

/// `NAMESPACE/NAME` of the attestation Secret (`--attestation-secret`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl std::str::FromStr for SecretRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (namespace, name) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected NAMESPACE/NAME"))?;
        if !sealed_crds::validate::is_dns_label(namespace) {
            return Err(format!("{s:?}: {namespace:?} is not a namespace name"));
        }
        if !sealed_crds::validate::is_object_name(name) {
            return Err(format!("{s:?}: {name:?} is not a Secret name"));
        }
        Ok(SecretRef {
            namespace: namespace.into(),
            name: name.into(),
        })
    }
}

type Fetch =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Vec<u8>, CsiError>> + Send>> + Send + Sync>;

struct Cached {
    key: AttestationKey,
    read_at: Instant,
}

/// The attestation key, read on first use and again (at most every [`REFRESH_AFTER`]) when
/// a version's attestation does not verify with the cached one.
pub struct KeyCache {
    what: String,
    fetch: Fetch,
    refresh_after: Duration,
    cached: tokio::sync::Mutex<Option<Cached>>,
}

impl KeyCache {
    /// The key in `secret`'s data key `key`, read through the API server.
    pub fn from_secret(client: Client, secret: SecretRef) -> Self {
        let what = format!("attestation Secret {secret}");
        let fetch: Fetch = Arc::new(move || {
            let client = client.clone();
            let secret = secret.clone();
            Box::pin(async move { read_secret(client, &secret).await })
        });
        KeyCache::new(what, fetch, REFRESH_AFTER)
    }

    /// For tests: a key source and refresh interval of one's own.
    pub fn new(what: String, fetch: Fetch, refresh_after: Duration) -> Self {
        KeyCache {
            what,
            fetch,
            refresh_after,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    /// What the key is read from, for messages.
    pub fn source(&self) -> &str {
        &self.what
    }

    async fn read(&self) -> Result<AttestationKey, CsiError> {
        let bytes = (self.fetch)().await?;
        AttestationKey::from_secret_bytes(&bytes)
            .map_err(|e| CsiError::FailedPrecondition(format!("{}: {e}", self.what)))
    }

    /// The cached key, read first if there is none.
    pub async fn current(&self) -> Result<AttestationKey, CsiError> {
        let mut cached = self.cached.lock().await;
        if let Some(c) = &*cached {
            return Ok(c.key.clone());
        }
        let key = self.read().await?;
        *cached = Some(Cached {
            key: key.clone(),
            read_at: Instant::now(),
        });
        Ok(key)
    }

    /// After a failed verification: the key read again if the cached one is older than the
    /// refresh interval (`None`: too recent, verify no further).
    pub async fn refreshed(&self) -> Result<Option<AttestationKey>, CsiError> {
        let mut cached = self.cached.lock().await;
        if cached
            .as_ref()
            .is_some_and(|c| c.read_at.elapsed() < self.refresh_after)
        {
            return Ok(None);
        }
        let key = match self.read().await {
            Ok(key) => key,
            Err(e) => {
                // Keep the old key, and do not ask again before the interval is over (the
                // Secret may be between deletion and the operator making it again).
                if let Some(c) = cached.as_mut() {
                    c.read_at = Instant::now();
                }
                return Err(e);
            }
        };
        tracing::info!(source = %self.what, "attestation key read again");
        *cached = Some(Cached {
            key: key.clone(),
            read_at: Instant::now(),
        });
        Ok(Some(key))
    }
}

async fn read_secret(client: Client, secret: &SecretRef) -> Result<Vec<u8>, CsiError> {
    let found = Api::<Secret>::namespaced(client, &secret.namespace)
        .get_opt(&secret.name)
        .await
        .map_err(|e| CsiError::kube(format!("reading the attestation Secret {secret}"), e))?;
    let Some(found) = found else {
        return Err(CsiError::Unavailable(format!(
            "attestation Secret {secret} not found: the operator creates it when it starts (is \
             it running?), and --attestation-secret must name the operator's Secret"
        )));
    };
    found
        .data
        .as_ref()
        .and_then(|d| d.get(SECRET_KEY))
        .map(|b| b.0.clone())
        .ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "attestation Secret {secret} has no data key '{SECRET_KEY}' (delete it and the \
                 operator makes a new one)"
            ))
        })
}

/// Why a SealedVolumeVersion does not let pods mount its digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unfit {
    /// It has a deletionTimestamp: the version is going to the trash.
    Deleting,
    /// No controller ownerReference of kind SealedVolume named `spec.volume`.
    NotOwned,
    /// No `status.attestation`.
    NoAttestation,
    /// A `status.attestation` that does not verify for its namespace, volume and digest.
    BadAttestation,
}

impl Unfit {
    /// Says what is missing, about version `ns/name`.
    pub fn explain(self, v: &SealedVolumeVersion) -> String {
        let ns = v.metadata.namespace.as_deref().unwrap_or_default();
        let name = v.metadata.name.as_deref().unwrap_or_default();
        match self {
            Unfit::Deleting => format!("SealedVolumeVersion {ns}/{name} is being deleted"),
            Unfit::NotOwned => format!(
                "a SealedVolumeVersion exists ({ns}/{name}) but was not made by the operator (its \
                 owner is not SealedVolume {} as controller)",
                v.spec.volume
            ),
            Unfit::NoAttestation => format!(
                "a SealedVolumeVersion exists ({ns}/{name}) but was not made by the operator (no \
                 valid attestation: status.attestation is missing)"
            ),
            Unfit::BadAttestation => format!(
                "a SealedVolumeVersion exists ({ns}/{name}) but was not made by the operator (no \
                 valid attestation: status.attestation does not verify for {ns}/{})",
                v.spec.volume
            ),
        }
    }
}

/// Whether `v` lets pods of its own namespace mount its digest: not being deleted, owned (as
/// controller) by the SealedVolume it names or, for a version applied from Git, owned by
/// nothing (GitOps tools prune only what has no owner: docs/gitops.md), and attested by the
/// operator for its namespace, volume and digest. `key` `None`:
/// `--insecure-skip-attestation`, the MAC is not checked.
pub fn check_version(v: &SealedVolumeVersion, key: Option<&AttestationKey>) -> Result<(), Unfit> {
    if v.metadata.deletion_timestamp.is_some() {
        return Err(Unfit::Deleting);
    }
    let owners = v.metadata.owner_references.as_deref().unwrap_or_default();
    let owned = owners.is_empty()
        || owners.iter().any(|o| {
            o.controller == Some(true)
                && o.kind == "SealedVolume"
                && o.api_version.starts_with("sealedvolumes.io/")
                && o.name == v.spec.volume
        });
    if !owned {
        return Err(Unfit::NotOwned);
    }
    let Some(key) = key else {
        return Ok(());
    };
    let Some(attestation) = v.status.as_ref().and_then(|s| s.attestation.as_deref()) else {
        return Err(Unfit::NoAttestation);
    };
    let namespace = v.metadata.namespace.as_deref().unwrap_or_default();
    if key.verify(attestation, namespace, &v.spec.volume, &v.spec.digest) {
        Ok(())
    } else {
        Err(Unfit::BadAttestation)
    }
}

/// The controller owner's UID of a version, to compare with its SealedVolume's.
pub fn owner_uid(v: &SealedVolumeVersion) -> Option<&str> {
    v.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "SealedVolume")
        .map(|o| o.uid.as_str())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use sealed_crds::{SealedVolumeVersionSpec, SealedVolumeVersionStatus};
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub const D: &str = "blake3:2222222222222222222222222222222222222222222222222222222222222222";

    pub fn key(byte: u8) -> AttestationKey {
        AttestationKey::from_secret_bytes(&[byte; 32]).unwrap()
    }

    /// A version as the operator makes it: owned by its volume, attested with `key`.
    pub fn version(ns: &str, volume: &str, key: Option<&AttestationKey>) -> SealedVolumeVersion {
        let mut v = SealedVolumeVersion::new(
            &SealedVolumeVersionSpec::object_name(volume, D),
            SealedVolumeVersionSpec {
                volume: volume.into(),
                digest: D.into(),
            },
        );
        v.metadata.namespace = Some(ns.into());
        v.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "sealedvolumes.io/v1alpha1".into(),
            kind: "SealedVolume".into(),
            name: volume.into(),
            uid: format!("uid-{ns}-{volume}"),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        v.status = Some(SealedVolumeVersionStatus {
            attestation: key.map(|k| k.attest(ns, volume, D)),
            ..Default::default()
        });
        v
    }

    #[test]
    fn operator_made_versions_fit() {
        let k = key(1);
        let v = version("team-a", "llama", Some(&k));
        assert_eq!(check_version(&v, Some(&k)), Ok(()));
        assert_eq!(owner_uid(&v), Some("uid-team-a-llama"));
    }

    #[test]
    fn each_refusal() {
        let k = key(1);
        // No attestation (a tenant's own SVV with the victim's digest).
        let v = version("team-b", "llama", None);
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::NoAttestation));
        assert!(
            Unfit::NoAttestation
                .explain(&v)
                .contains("was not made by the operator (no valid attestation")
        );
        // Forged: another key.
        let v = version("team-b", "llama", Some(&key(2)));
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::BadAttestation));
        // Copied from another namespace: the victim's attestation in the tenant's SVV.
        let mut v = version("team-b", "llama", None);
        v.status.as_mut().unwrap().attestation = Some(k.attest("team-a", "llama", D));
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::BadAttestation));
        // Garbage.
        v.status.as_mut().unwrap().attestation = Some("v1:nothex".into());
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::BadAttestation));
        // Attested, but for another volume than spec.volume says.
        let mut v = version("team-a", "llama", None);
        v.status.as_mut().unwrap().attestation = Some(k.attest("team-a", "other", D));
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::BadAttestation));
        // Being deleted.
        let mut v = version("team-a", "llama", Some(&k));
        v.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::Deleting));
        assert!(Unfit::Deleting.explain(&v).contains("being deleted"));
        // No owner at all (applied from Git, docs/gitops.md): the attestation decides.
        let mut v = version("team-a", "llama", Some(&k));
        v.metadata.owner_references = None;
        assert_eq!(check_version(&v, Some(&k)), Ok(()));
        assert_eq!(owner_uid(&v), None, "so never through a shared volume");
        v.metadata.owner_references = Some(vec![]);
        assert_eq!(check_version(&v, Some(&k)), Ok(()));
        v.status.as_mut().unwrap().attestation = None;
        assert_eq!(check_version(&v, Some(&k)), Err(Unfit::NoAttestation));
        // Not owned: an owner that is not the controller, of another kind or name.
        for change in 0..3 {
            let mut v = version("team-a", "llama", Some(&k));
            let o = &mut v.metadata.owner_references.as_mut().unwrap()[0];
            match change {
                0 => o.controller = Some(false),
                1 => o.kind = "ConfigMap".into(),
                _ => o.name = "other".into(),
            }
            assert_eq!(
                check_version(&v, Some(&k)),
                Err(Unfit::NotOwned),
                "{change}"
            );
        }
        // --insecure-skip-attestation: the structure is still checked, the MAC is not.
        assert_eq!(check_version(&version("b", "llama", None), None), Ok(()));
        let mut v = version("b", "llama", None);
        v.metadata.owner_references.as_mut().unwrap()[0].kind = "ConfigMap".into();
        assert_eq!(check_version(&v, None), Err(Unfit::NotOwned));
    }

    #[test]
    fn secret_refs() {
        let r: SecretRef = "sealed-system/sv-attestation".parse().unwrap();
        assert_eq!(r.to_string(), "sealed-system/sv-attestation");
        for bad in ["nosl", "/x", "ns/", "NS/x", "ns/x/y", "ns/X"] {
            assert!(bad.parse::<SecretRef>().is_err(), "{bad}");
        }
    }

    fn counting(material: Arc<std::sync::Mutex<Vec<u8>>>, reads: Arc<AtomicUsize>) -> Fetch {
        Arc::new(move || {
            let material = material.lock().unwrap().clone();
            reads.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if material.is_empty() {
                    Err(CsiError::Unavailable(
                        "attestation Secret t/s not found".into(),
                    ))
                } else {
                    Ok(material)
                }
            })
        })
    }

    #[tokio::test]
    async fn the_key_is_cached_and_read_again_after_the_interval() {
        let material = Arc::new(std::sync::Mutex::new(vec![1u8; 32]));
        let reads = Arc::new(AtomicUsize::new(0));
        let cache = KeyCache::new(
            "attestation Secret t/s".into(),
            counting(material.clone(), reads.clone()),
            Duration::from_millis(200),
        );
        let k1 = cache.current().await.unwrap();
        let _ = cache.current().await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 1, "cached");
        // Rotated: a failed verification right away does not re-read (rate limit) ...
        *material.lock().unwrap() = vec![2u8; 32];
        assert!(cache.refreshed().await.unwrap().is_none());
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        // ... after the interval it does, and the new key is cached.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let k2 = cache.refreshed().await.unwrap().expect("read again");
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        let a = key(2).attest("n", "v", D);
        assert!(k2.verify(&a, "n", "v", D) && !k1.verify(&a, "n", "v", D));
        assert!(cache.current().await.unwrap().verify(&a, "n", "v", D));
        // The Secret gone for a while (a rotation by deletion): one clear error, the old key
        // kept, and no new read before the interval is over.
        material.lock().unwrap().clear();
        tokio::time::sleep(Duration::from_millis(250)).await;
        let e = cache.refreshed().await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        assert!(cache.refreshed().await.unwrap().is_none());
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        assert!(cache.current().await.unwrap().verify(&a, "n", "v", D));
    }

    #[tokio::test]
    async fn missing_or_short_keys_are_clear_errors() {
        let material = Arc::new(std::sync::Mutex::new(Vec::new()));
        let reads = Arc::new(AtomicUsize::new(0));
        let cache = KeyCache::new(
            "attestation Secret t/s".into(),
            counting(material.clone(), reads.clone()),
            Duration::from_secs(30),
        );
        let e = cache.current().await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(e.to_string().contains("t/s"), "{e}");
        // Not cached: the next publish reads again.
        *material.lock().unwrap() = b"short".to_vec();
        let e = cache.current().await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.to_string().contains("attestation Secret t/s") && e.to_string().contains("5 bytes"),
            "{e}"
        );
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }
}
