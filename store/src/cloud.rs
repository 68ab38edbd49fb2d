//! Each backend's builder, configured the way its cloud's own CLI is: the standard environment
//! variables, the shared config files, and the emulator conventions. Returns the endpoint the
//! client will talk to (checked to have a scheme), so the caller allows plain HTTP only to an
//! endpoint that asked for it. [`crate::backend`] adds the URL, retries and the
//! store's own credentials.
//!
//! | backend | endpoint, first that is set | credentials, region |
//! |---|---|---|
//! | S3 | `--endpoint`, `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, the profile's `endpoint_url` | `AWS_*`, then `AWS_PROFILE`'s files ([`crate::aws_profile`]: keys, or a role, a credential process, SSO by [`crate::aws_credentials`]) |
//! | GCS | `--endpoint`, `STORAGE_EMULATOR_HOST` (an emulator: no OAuth) | `GOOGLE_*`, application default credentials |
//! | Azure | `--endpoint`, `AZURE_STORAGE_CONNECTION_STRING`'s `BlobEndpoint` | `AZURE_*`, the connection string |

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};

use crate::aws_profile;
use crate::backend::StoreOptions;
use crate::error::{Error, Result};
use crate::limits::check_endpoint;

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

/// The first endpoint set, checked, with the name of where it came from in any message.
fn pick_endpoint(candidates: Vec<(Option<String>, String)>) -> Result<Option<String>> {
    let Some((endpoint, from)) = candidates
        .into_iter()
        .find_map(|(v, from)| v.map(|v| (v, from)))
    else {
        return Ok(None);
    };
    check_endpoint(&endpoint).map_err(|reason| Error::InvalidEndpoint {
        endpoint: endpoint.chars().take(200).collect(),
        reason: format!("(from {from}) {reason}"),
    })?;
    Ok(Some(endpoint))
}

/// S3 as `aws` is configured: environment variables over the `AWS_PROFILE` profile.
pub fn s3_builder(opts: &StoreOptions) -> Result<(AmazonS3Builder, Option<String>)> {
    let profile = aws_profile::load()?;
    let mut b = AmazonS3Builder::new();
    if let Some(p) = &profile {
        // The environment's keys are a set: with AWS_ACCESS_KEY_ID set, the profile's keys
        // (and token) are not mixed in.
        if env("AWS_ACCESS_KEY_ID").is_none()
            && let Some(source) = &p.source
        {
            // A role, a credential process or SSO (crate::aws_credentials).
            let provider = crate::aws_credentials::ProfileCredentials::for_source(source.clone())
                .map_err(|e| Error::Other(format!("AWS profile '{}': {e}", p.name)))?;
            b = b.with_credentials(std::sync::Arc::new(provider));
        } else if env("AWS_ACCESS_KEY_ID").is_none() {
            for (key, value) in [
                (AmazonS3ConfigKey::AccessKeyId, &p.access_key_id),
                (AmazonS3ConfigKey::SecretAccessKey, &p.secret_access_key),
                (AmazonS3ConfigKey::Token, &p.session_token),
            ] {
                if let Some(v) = value {
                    b = b.with_config(key, v);
                }
            }
        }
        if let Some(region) = &p.region {
            b = b.with_region(region);
        }
    }
    // As `AmazonS3Builder::from_env`, over the profile.
    for (k, v) in std::env::vars() {
        if k.starts_with("AWS_")
            && !v.is_empty()
            && let Ok(key) = k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>()
        {
            b = b.with_config(key, v);
        }
    }
    if let Some(region) = &opts.region {
        b = b.with_region(region);
    }
    let endpoint = pick_endpoint(vec![
        (opts.endpoint.clone(), "--endpoint".into()),
        (env("AWS_ENDPOINT_URL_S3"), "AWS_ENDPOINT_URL_S3".into()),
        (env("AWS_ENDPOINT_URL"), "AWS_ENDPOINT_URL".into()),
        (env("AWS_ENDPOINT"), "AWS_ENDPOINT".into()),
        (
            profile.as_ref().and_then(|p| p.endpoint_url.clone()),
            format!(
                "endpoint_url of AWS profile {}",
                profile.as_ref().map_or("", |p| p.name.as_str())
            ),
        ),
    ])?;
    if let Some(endpoint) = &endpoint {
        // A custom server names the bucket in the path (MinIO, moto, R2 all take that).
        b = b
            .with_endpoint(endpoint)
            .with_virtual_hosted_style_request(false);
    }
    Ok((b, endpoint))
}

/// GCS from `GOOGLE_*` and the application default credentials; `STORAGE_EMULATOR_HOST` (the
/// Google client libraries' emulator variable, often written without a scheme) or
/// `--endpoint` point it at an emulator such as fake-gcs-server, which takes no OAuth token.
pub fn gcs_builder(opts: &StoreOptions) -> Result<(GoogleCloudStorageBuilder, Option<String>)> {
    let emulator = env("STORAGE_EMULATOR_HOST").map(|h| {
        if h.contains("://") {
            h
        } else {
            format!("http://{h}")
        }
    });
    let endpoint = pick_endpoint(vec![
        (opts.endpoint.clone(), "--endpoint".into()),
        (emulator, "STORAGE_EMULATOR_HOST".into()),
    ])?;
    let mut b = GoogleCloudStorageBuilder::new();
    // As `GoogleCloudStorageBuilder::from_env`; an emulator's key (below) replaces any
    // service account.
    for (k, v) in std::env::vars() {
        if k.starts_with("GOOGLE_") && !v.is_empty() {
            match k.to_ascii_lowercase().parse::<GoogleConfigKey>() {
                Ok(GoogleConfigKey::ServiceAccount | GoogleConfigKey::ServiceAccountKey)
                    if endpoint.is_some() => {}
                Ok(key) => b = b.with_config(key, v),
                Err(_) => {}
            }
        }
    }
    if let Some(endpoint) = &endpoint {
        // object_store takes a base URL only from a service-account key; an emulator's key
        // carries the URL and turns OAuth off.
        let key = serde_json::json!({
            "gcs_base_url": endpoint.trim_end_matches('/'),
            "disable_oauth": true,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        });
        b = b.with_service_account_key(key.to_string());
    }
    Ok((b, endpoint))
}

/// Azure from `AZURE_*`, and `AZURE_STORAGE_CONNECTION_STRING` as `az` reads it (account,
/// key or SAS, and `BlobEndpoint`); `UseDevelopmentStorage=true` is Azurite's.
pub fn azure_builder(opts: &StoreOptions) -> Result<(MicrosoftAzureBuilder, Option<String>)> {
    let mut b = MicrosoftAzureBuilder::new();
    let mut from_string = None;
    if let Some(cs) = env("AZURE_STORAGE_CONNECTION_STRING") {
        for part in cs.split(';').filter(|p| !p.trim().is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return Err(Error::Other(
                    "AZURE_STORAGE_CONNECTION_STRING is not Key=Value;Key=Value;…".into(),
                ));
            };
            match k.trim() {
                "AccountName" => b = b.with_config(AzureConfigKey::AccountName, v),
                "AccountKey" => b = b.with_config(AzureConfigKey::AccessKey, v),
                "SharedAccessSignature" => b = b.with_config(AzureConfigKey::SasKey, v),
                "BlobEndpoint" => from_string = Some(v.trim_end_matches('/').to_owned()),
                "UseDevelopmentStorage" if v.eq_ignore_ascii_case("true") => {
                    b = b.with_use_emulator(true)
                }
                _ => {}
            }
        }
    }
    // As `MicrosoftAzureBuilder::from_env`, over the connection string.
    for (k, v) in std::env::vars() {
        if k.starts_with("AZURE_")
            && !v.is_empty()
            && k != "AZURE_STORAGE_CONNECTION_STRING"
            && let Ok(key) = k.to_ascii_lowercase().parse::<AzureConfigKey>()
        {
            b = b.with_config(key, v);
        }
    }
    let endpoint = pick_endpoint(vec![
        (opts.endpoint.clone(), "--endpoint".into()),
        (
            from_string,
            "the BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING".into(),
        ),
    ])?;
    Ok((b, endpoint))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_without_a_scheme_is_refused_naming_where_it_came_from() {
        let e = pick_endpoint(vec![
            (None, "--endpoint".into()),
            (Some("127.0.0.1:9000".into()), "AWS_ENDPOINT_URL".into()),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("(from AWS_ENDPOINT_URL) has no scheme: write http://127.0.0.1:9000"),
            "{e}"
        );
        let ok = pick_endpoint(vec![
            (Some("https://a".into()), "--endpoint".into()),
            (Some("nonsense".into()), "AWS_ENDPOINT_URL".into()),
        ])
        .unwrap();
        assert_eq!(ok.as_deref(), Some("https://a"), "the first one set wins");
    }
}
