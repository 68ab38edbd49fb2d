//! Source credentials: read from the volume's Secrets by the operator, handed to the sync
//! (inline) or to the sync Job (as a Secret of its own, then environment variables).
//!
//! A Secret is used as source credentials only if it opts in with the label
//! `sealedvolumes.io/source-credentials: "true"` ([`SOURCE_CREDENTIALS_LABEL`]), so a tenant
//! cannot make the operator send some other Secret of its namespace (a registry password, a
//! service account token) to an endpoint of its choosing. The annotation
//! `sealedvolumes.io/allowed-hosts: "host1,*.example.com"` ([`ALLOWED_HOSTS_ANNOTATION`])
//! further restricts which hosts it may be sent to.

use std::collections::BTreeMap;
use std::str::FromStr;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use sealed_crds::{ALLOWED_HOSTS_ANNOTATION, SOURCE_CREDENTIALS_LABEL, Source, SourceKind};

use sealed_sources::policy::credential_target;
use sealed_sources::{SourcePolicy, redact_urls_in};

use super::SyncFailure;
use crate::source_spec::source_spec;

/// The source readers' credentials type; this module adds how the operator gets them.
pub use sealed_sources::SourceCredentials;
pub use sealed_sources::credentials::{ENV_PREFIX, HF_TOKEN_KEY};

/// What a sync of `source` needs before it starts: the policy's verdict (`SourceRefused`,
/// `CredentialsRequired`, `InvalidSource` when it does not admit the source), then the
/// credentials ([`read`]). Nothing is requested from the source.
pub async fn prepare(
    client: &Client,
    namespace: &str,
    source: &Source,
    policy: &SourcePolicy,
) -> Result<SourceCredentials, SyncFailure> {
    source_spec(source)
        .and_then(|spec| policy.check(&spec, names_secret(source)))
        .map_err(|e| SyncFailure::new(e.reason(), redact_urls_in(&e.to_string())))?;
    read(client, namespace, source).await
}

/// Reads what `source` refers to from Secrets in `namespace`. A missing Secret or key is
/// a failure with reason `SecretNotFound` naming it; a Secret without the opt-in label is
/// `SecretNotOptedIn`; one whose allowed-hosts annotation does not name the host the
/// source would send it to is `SecretHostNotAllowed`.
pub async fn read(
    client: &Client,
    namespace: &str,
    source: &Source,
) -> Result<SourceCredentials, SyncFailure> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let get = |name: String| {
        let secrets = secrets.clone();
        async move {
            match secrets.get_opt(&name).await {
                Ok(Some(s)) => {
                    opted_in(&s, namespace, &name)?;
                    Ok(s)
                }
                Ok(None) => Err(SyncFailure::new(
                    "SecretNotFound",
                    format!(
                        "Secret {namespace}/{name} does not exist; create it or fix the reference"
                    ),
                )),
                Err(e) => Err(SyncFailure::new(
                    "SecretUnreadable",
                    format!(
                        "cannot read Secret {namespace}/{name}: {}",
                        redact_urls_in(&e.to_string())
                    ),
                )),
            }
        }
    };
    let mut creds = SourceCredentials::default();
    match source.kind() {
        Ok(SourceKind::HuggingFace(hf)) => {
            if let Some(r) = &hf.token_secret_ref {
                let secret = get(r.name.clone()).await?;
                allowed_host(&secret, namespace, &r.name, source, &BTreeMap::new())?;
                let value = secret_value(&secret, &r.key).ok_or_else(|| {
                    SyncFailure::new(
                        "SecretNotFound",
                        format!(
                            "Secret {namespace}/{} has no key {:?} (spec.source.huggingFace.tokenSecretRef)",
                            r.name, r.key
                        ),
                    )
                })?;
                creds.hf_token = Some(value.trim().to_string());
            }
        }
        Ok(SourceKind::ObjectStore(os)) => {
            if let Some(r) = &os.credentials_secret_ref {
                let secret = get(r.name.clone()).await?;
                for key in secret_keys(&secret) {
                    if let Some(v) = secret_value(&secret, &key) {
                        creds.object_store.insert(key, v);
                    }
                }
                allowed_host(&secret, namespace, &r.name, source, &creds.object_store)?;
            }
        }
        Ok(SourceKind::Upload(_)) => {}
        Err(e) => return Err(SyncFailure::new("InvalidSpec", e.to_string())),
    }
    Ok(creds)
}

/// Whether `source` names a Secret (token or credentials).
fn names_secret(source: &Source) -> bool {
    match source.kind() {
        Ok(SourceKind::HuggingFace(hf)) => hf.token_secret_ref.is_some(),
        Ok(SourceKind::ObjectStore(os)) => os.credentials_secret_ref.is_some(),
        _ => false,
    }
}

/// A Secret is source credentials only if it says so.
fn opted_in(secret: &Secret, namespace: &str, name: &str) -> Result<(), SyncFailure> {
    let label = secret
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SOURCE_CREDENTIALS_LABEL));
    if label.map(String::as_str) == Some("true") {
        return Ok(());
    }
    Err(SyncFailure::new(
        "SecretNotOptedIn",
        format!(
            "Secret {namespace}/{name} is not marked for use as source credentials; if it is \
             meant for this, label it: kubectl label secret -n {namespace} {name} \
             {SOURCE_CREDENTIALS_LABEL}=true (and optionally restrict where it may be sent: \
             kubectl annotate secret -n {namespace} {name} {ALLOWED_HOSTS_ANNOTATION}=HOST,...)"
        ),
    ))
}

/// The Secret's allowed-hosts annotation, when it has one, must admit the host `source`
/// sends it to (see [`credential_target`]). `keys` are the Secret's (the Azure account name
/// decides the blob host).
fn allowed_host(
    secret: &Secret,
    namespace: &str,
    name: &str,
    source: &Source,
    keys: &BTreeMap<String, String>,
) -> Result<(), SyncFailure> {
    let Some(allowed) = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ALLOWED_HOSTS_ANNOTATION))
    else {
        return Ok(());
    };
    let account = keys.iter().find_map(|(k, v)| {
        (object_store::azure::AzureConfigKey::from_str(&k.to_ascii_lowercase()).ok()
            == Some(object_store::azure::AzureConfigKey::AccountName))
        .then_some(v.as_str())
    });
    let target = source_spec(source)
        .and_then(|spec| credential_target(&spec, account))
        .map_err(|e| SyncFailure::new(e.reason(), redact_urls_in(&e.to_string())))?;
    let Some(target) = target else {
        return Ok(());
    };
    let entries: Vec<&str> = allowed
        .split([',', ' ', '\n', '\t'])
        .filter(|e| !e.trim().is_empty())
        .collect();
    if entries.iter().any(|e| target.allowed_by(e)) {
        return Ok(());
    }
    Err(SyncFailure::new(
        "SecretHostNotAllowed",
        format!(
            "Secret {namespace}/{name} may be sent only to {} (annotation \
             {ALLOWED_HOSTS_ANNOTATION}); this source would send it to {}: fix the source's \
             endpoint or the annotation",
            if entries.is_empty() {
                "no host".to_owned()
            } else {
                entries.join(", ")
            },
            target.display()
        ),
    ))
}

fn secret_keys(secret: &Secret) -> Vec<String> {
    let mut keys: Vec<String> = secret
        .data
        .iter()
        .flat_map(|d| d.keys().cloned())
        .chain(secret.string_data.iter().flat_map(|d| d.keys().cloned()))
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

fn secret_value(secret: &Secret, key: &str) -> Option<String> {
    if let Some(v) = secret.data.as_ref().and_then(|d| d.get(key)) {
        return String::from_utf8(v.0.clone()).ok();
    }
    secret
        .string_data
        .as_ref()
        .and_then(|d| d.get(key))
        .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use sealed_crds::{HuggingFaceRepoType, HuggingFaceSource, ObjectStoreSource};

    fn secret(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Secret {
        let map = |pairs: &[(&str, &str)]| {
            (!pairs.is_empty()).then(|| {
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
        };
        Secret {
            metadata: ObjectMeta {
                name: Some("creds".into()),
                labels: map(labels),
                annotations: map(annotations),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn os(url: &str, endpoint: Option<&str>) -> Source {
        Source::object_store(ObjectStoreSource {
            url: url.into(),
            endpoint: endpoint.map(Into::into),
            region: None,
            credentials_secret_ref: None,
        })
    }

    fn hub(endpoint: Option<&str>) -> Source {
        Source::hugging_face(HuggingFaceSource {
            repo: "org/m".into(),
            revision: "main".into(),
            repo_type: HuggingFaceRepoType::Model,
            include: vec![],
            exclude: vec![],
            token_secret_ref: None,
            endpoint: endpoint.map(Into::into),
        })
    }

    #[test]
    fn secrets_must_opt_in() {
        let err = opted_in(&secret(&[], &[]), "ml", "creds").unwrap_err();
        assert_eq!(err.reason, "SecretNotOptedIn");
        assert!(err.permanent);
        assert!(
            err.message.contains("ml/creds")
                && err.message.contains(
                    "kubectl label secret -n ml creds sealedvolumes.io/source-credentials=true"
                ),
            "{}",
            err.message
        );
        let err = opted_in(
            &secret(&[(SOURCE_CREDENTIALS_LABEL, "yes")], &[]),
            "ml",
            "creds",
        )
        .unwrap_err();
        assert_eq!(err.reason, "SecretNotOptedIn");
        opted_in(
            &secret(&[(SOURCE_CREDENTIALS_LABEL, "true")], &[]),
            "ml",
            "creds",
        )
        .unwrap();
    }

    #[test]
    fn allowed_hosts_annotation() {
        let none = BTreeMap::new();
        let only = |hosts: &str| secret(&[], &[(ALLOWED_HOSTS_ANNOTATION, hosts)]);
        // No annotation: anywhere.
        allowed_host(
            &secret(&[], &[]),
            "ml",
            "c",
            &os("s3://b/p", Some("https://evil.example.com")),
            &none,
        )
        .unwrap();
        // The endpoint host, the https URL host, the provider's canonical host.
        for (hosts, source) in [
            (
                "minio.example.com",
                os("s3://b/p", Some("https://minio.example.com:9000")),
            ),
            (
                "minio.example.com:9000",
                os("s3://b/p", Some("https://minio.example.com:9000")),
            ),
            (
                "*.r2.cloudflarestorage.com",
                os("https://acct.r2.cloudflarestorage.com/b/p", None),
            ),
            ("s3.amazonaws.com", os("s3://b/p", None)),
            ("other.example.com, *.amazonaws.com", os("s3://b/p", None)),
            ("storage.googleapis.com", os("gs://b/p", None)),
            ("huggingface.co", hub(None)),
            ("hub.internal", hub(Some("https://hub.internal/"))),
        ] {
            allowed_host(&only(hosts), "ml", "c", &source, &none)
                .unwrap_or_else(|e| panic!("{hosts}: {}", e.message));
        }
        let account =
            BTreeMap::from([("AZURE_STORAGE_ACCOUNT_NAME".to_string(), "acct".to_string())]);
        allowed_host(
            &only("*.blob.core.windows.net"),
            "ml",
            "c",
            &os("az://c/p", None),
            &account,
        )
        .unwrap();
        allowed_host(
            &only("acct.blob.core.windows.net"),
            "ml",
            "c",
            &os("az://c/p", None),
            &account,
        )
        .unwrap();
        for (hosts, source) in [
            (
                "minio.example.com",
                os("s3://b/p", Some("https://evil.example.com")),
            ),
            (
                "minio.example.com:9001",
                os("s3://b/p", Some("https://minio.example.com:9000")),
            ),
            ("huggingface.co", hub(Some("https://evil.example.com"))),
            ("*.example.com", hub(None)),
            ("", os("s3://b/p", None)),
        ] {
            let err = allowed_host(&only(hosts), "ml", "c", &source, &none).unwrap_err();
            assert_eq!(err.reason, "SecretHostNotAllowed", "{hosts}");
            assert!(err.message.contains("ml/c"), "{}", err.message);
        }
        let err = allowed_host(
            &only("other.blob.core.windows.net"),
            "ml",
            "c",
            &os("az://c/p", None),
            &account,
        )
        .unwrap_err();
        assert!(
            err.message.contains("acct.blob.core.windows.net"),
            "{}",
            err.message
        );
    }
}
