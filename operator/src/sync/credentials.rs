//! Source credentials: read from the volume's Secrets by the operator, handed to the sync
//! (inline) or to the sync Job (as a Secret of its own, then environment variables).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use sealed_crds::{Source, SourceKind};

use super::SyncFailure;

/// Environment variables of a sync Job carrying the source's credentials. A prefix keeps
/// them apart from the store's own (both may be AWS_ACCESS_KEY_ID).
pub const ENV_PREFIX: &str = "SEALED_SOURCE_";
/// The Hugging Face token, under [`ENV_PREFIX`].
pub const HF_TOKEN_KEY: &str = "HF_TOKEN";

/// The source readers' credentials type; this module adds how the operator gets them.
pub use crate::source::SourceCredentials as Credentials;

impl Credentials {
    /// As environment variables (`SEALED_SOURCE_<KEY>`), for a sync Job's Secret.
    pub fn to_env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        if let Some(token) = &self.hf_token {
            env.insert(format!("{ENV_PREFIX}{HF_TOKEN_KEY}"), token.clone());
        }
        for (k, v) in &self.object_store {
            env.insert(format!("{ENV_PREFIX}{k}"), v.clone());
        }
        env
    }

    /// Back from the environment, in the sync Job.
    pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut creds = Credentials::default();
        for (k, v) in vars {
            let Some(key) = k.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            if key == HF_TOKEN_KEY {
                creds.hf_token = Some(v);
            } else if !key.is_empty() {
                creds.object_store.insert(key.to_string(), v);
            }
        }
        creds
    }

    /// Reads what `source` refers to from Secrets in `namespace`. A missing Secret or key is
    /// a failure with reason `SecretNotFound` naming it.
    pub async fn read(
        client: &Client,
        namespace: &str,
        source: &Source,
    ) -> Result<Credentials, SyncFailure> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let get = |name: String| {
            let secrets = secrets.clone();
            async move {
                match secrets.get_opt(&name).await {
                    Ok(Some(s)) => Ok(s),
                    Ok(None) => Err(SyncFailure::new(
                        "SecretNotFound",
                        format!(
                            "Secret {namespace}/{name} does not exist; create it or fix the reference"
                        ),
                    )),
                    Err(e) => Err(SyncFailure::new(
                        "SecretUnreadable",
                        format!("cannot read Secret {namespace}/{name}: {e}"),
                    )),
                }
            }
        };
        let mut creds = Credentials::default();
        match source.kind() {
            Ok(SourceKind::HuggingFace(hf)) => {
                if let Some(r) = &hf.token_secret_ref {
                    let secret = get(r.name.clone()).await?;
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
                }
            }
            Ok(SourceKind::Upload(_)) => {}
            Err(e) => return Err(SyncFailure::new("InvalidSpec", e.to_string())),
        }
        Ok(creds)
    }
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

    #[test]
    fn env_round_trip_and_debug_hides_values() {
        let mut c = Credentials {
            hf_token: Some("hf_secret".into()),
            ..Default::default()
        };
        c.object_store
            .insert("AWS_SECRET_ACCESS_KEY".into(), "s3cret".into());
        let env = c.to_env();
        assert_eq!(env["SEALED_SOURCE_HF_TOKEN"], "hf_secret");
        let back = Credentials::from_env(env.into_iter().chain([("PATH".into(), "/bin".into())]));
        assert_eq!(back, c);
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("hf_secret") && !dbg.contains("s3cret"),
            "{dbg}"
        );
    }
}
