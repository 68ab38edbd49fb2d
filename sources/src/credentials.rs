//! A source's secrets as the readers take them, and how a sync Job carries them: as
//! environment variables under [`ENV_PREFIX`], apart from the store's own.

use std::collections::BTreeMap;

/// Environment variables of a sync Job carrying the source's credentials. A prefix keeps
/// them apart from the store's own (both may be AWS_ACCESS_KEY_ID).
pub const ENV_PREFIX: &str = "SEALED_SOURCE_";
/// The Hugging Face token, under [`ENV_PREFIX`].
pub const HF_TOKEN_KEY: &str = "HF_TOKEN";
/// An OCI registry's docker config JSON (a `kubernetes.io/dockerconfigjson` Secret's
/// `.dockerconfigjson`), under [`ENV_PREFIX`].
pub const DOCKER_CONFIG_KEY: &str = "DOCKER_CONFIG_JSON";

/// Secrets for one source. `Debug` never prints values.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SourceCredentials {
    /// The Hugging Face access token (`Authorization: Bearer`).
    pub hf_token: Option<String>,
    /// Object-store settings as environment-style keys: AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AZURE_STORAGE_ACCOUNT_NAME,
    /// AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, GOOGLE_SERVICE_ACCOUNT_KEY, ...
    /// Empty means none: such a source is refused unless the [`crate::SourcePolicy`] allow-lists it
    /// for the ambient credentials of the process (its environment, workload identity).
    pub object_store: BTreeMap<String, String>,
    /// An OCI registry's docker config JSON (`{"auths": {"REGISTRY": {"auth": base64
    /// user:password}}}`, or `username`/`password`), as a `kubernetes.io/dockerconfigjson`
    /// Secret holds it. Only the entry of the source's registry is used, and only there.
    pub docker_config: Option<String>,
}

impl std::fmt::Debug for SourceCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceCredentials")
            .field("hf_token", &self.hf_token.as_ref().map(|_| "<redacted>"))
            .field(
                "docker_config",
                &self.docker_config.as_ref().map(|_| "<redacted>"),
            )
            .field(
                "object_store_keys",
                &self.object_store.keys().collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl SourceCredentials {
    /// Every secret value, longest first, for scrubbing messages.
    pub(crate) fn secrets(&self) -> Vec<String> {
        // Names, places and regions are not secrets; keeping them makes messages useful.
        let public = ["ACCOUNT_NAME", "REGION", "ENDPOINT", "BUCKET", "CONTAINER"];
        let secret_values = self
            .object_store
            .iter()
            .filter(|(k, _)| {
                let k = k.to_ascii_uppercase();
                !public.iter().any(|p| k.contains(p))
            })
            .map(|(_, v)| v);
        let docker = self
            .docker_config
            .as_deref()
            .map(crate::oci::docker_config_secrets)
            .unwrap_or_default();
        let mut out: Vec<String> = self
            .hf_token
            .iter()
            .chain(secret_values)
            .chain(docker.iter())
            .chain(self.docker_config.iter())
            .filter(|v| v.len() >= 4)
            .cloned()
            .collect();
        out.sort_by_key(|s| std::cmp::Reverse(s.len()));
        out
    }
}

impl SourceCredentials {
    /// As environment variables (`SEALED_SOURCE_<KEY>`), for a sync Job's Secret.
    pub fn to_env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        if let Some(token) = &self.hf_token {
            env.insert(format!("{ENV_PREFIX}{HF_TOKEN_KEY}"), token.clone());
        }
        if let Some(config) = &self.docker_config {
            env.insert(format!("{ENV_PREFIX}{DOCKER_CONFIG_KEY}"), config.clone());
        }
        for (k, v) in &self.object_store {
            env.insert(format!("{ENV_PREFIX}{k}"), v.clone());
        }
        env
    }

    /// Back from the environment, in the sync Job.
    pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut creds = SourceCredentials::default();
        for (k, v) in vars {
            let Some(key) = k.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            if key == HF_TOKEN_KEY {
                creds.hf_token = Some(v);
            } else if key == DOCKER_CONFIG_KEY {
                creds.docker_config = Some(v);
            } else if !key.is_empty() {
                creds.object_store.insert(key.to_string(), v);
            }
        }
        creds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_round_trip_and_debug_hides_values() {
        let mut c = SourceCredentials {
            hf_token: Some("hf_secret".into()),
            ..Default::default()
        };
        c.object_store
            .insert("AWS_SECRET_ACCESS_KEY".into(), "s3cret".into());
        let env = c.to_env();
        assert_eq!(env["SEALED_SOURCE_HF_TOKEN"], "hf_secret");
        let back =
            SourceCredentials::from_env(env.into_iter().chain([("PATH".into(), "/bin".into())]));
        assert_eq!(back, c);
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("hf_secret") && !dbg.contains("s3cret"),
            "{dbg}"
        );
    }
}
