//! An object-store prefix as a source: S3 and S3-compatible stores (R2, CoreWeave, MinIO) with
//! a custom endpoint and region, GCS, Azure Blob, and `file://` directories.
//!
//! The prefix is listed once; the listing's (path, ETag, size) triples, sorted, hashed with
//! BLAKE3, are the source revision (`etags:<64 hex>`), so an unchanged prefix shows the same
//! revision. Each object is then streamed into the ingest under its path relative to the
//! prefix; an object whose ETag moved since the listing fails the sync (`SourceChanged`)
//! rather than sealing a version the revision does not describe.
//!
//! Credentials: the tenant's own Secret, reduced to the keys that say *who* reads (access
//! keys, a service-account key, an account key or SAS); keys that would change *where* or
//! *how* (endpoint, bucket, token files, instance metadata, the Azure CLI, proxies) are
//! refused, and a Secret without the credential itself is refused, so an object-store builder
//! never falls back to the process's instance role or workload identity. Only a source the
//! [`SourcePolicy`](super::SourcePolicy) allow-lists ([`Access::Ambient`]) is read with the
//! process's environment.
//!
//! The client is built as `object_store::parse_url_opts` (0.12) builds it, with
//! `<Builder>::new()`, not `from_env()`, so it reads no environment variables itself, and with
//! a guarded HTTP connector ([`GuardedConnector`]: only addresses the egress policy admits,
//! listing pages and error bodies bounded as for the store); what a builder reads at `build()` when it has
//! no static credentials (AWS_WEB_IDENTITY_TOKEN_FILE / AWS_ROLE_ARN, instance metadata,
//! `~/.config/gcloud`) is what the credential checks here rule out.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;

use crate::spec::BucketPrefix;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreScheme};
use sealed_store::ingest::Ingest;
use tokio_util::io::StreamReader;
use url::Url;

use super::egress::{GuardedConnector, refused_in};
use super::limits::ListingBudget;
use crate::credentials::SourceCredentials;
use crate::download::{RemoteFile, Tap, backoff, short, size_mismatch};
use crate::error::SourceError;
use crate::limits::SourceLimits;
use crate::options::SyncOptions;
use crate::policy::Access;
use crate::progress::SyncReporter;
use crate::redact::{error_chain, redact, redact_url};

/// Environment prefixes the ambient credentials come from, for an allow-listed source only.
const AMBIENT_PREFIXES: [&str; 3] = ["AWS_", "AZURE_", "GOOGLE_"];

pub struct BucketSource {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    /// The URL as written in the spec, redacted ([`redact_url`]), for messages.
    url: String,
    retries: u32,
    limits: SourceLimits,
    secrets: Vec<String>,
}

/// What went wrong with a request, for choosing the error.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    List,
    Get,
}

impl BucketSource {
    /// Opens the source for reading with `access` (what the policy decided): the Secret's
    /// keys, the process's environment (allow-listed only), or nothing (`file://`).
    pub(crate) fn open(
        src: &BucketPrefix,
        creds: &SourceCredentials,
        opts: &SyncOptions,
        access: Access,
    ) -> Result<BucketSource, SourceError> {
        let shown = redact_url(&src.url);
        let url = Url::parse(&src.url)
            .map_err(|e| SourceError::Invalid(format!("spec.source.objectStore.url: {e}")))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(SourceError::Invalid(
                "spec.source.objectStore.url must not carry a user or password; use credentialsSecretRef"
                    .into(),
            ));
        }
        let (mut scheme, _) = ObjectStoreScheme::parse(&url).map_err(|e| {
            SourceError::Invalid(format!(
                "{shown}: {}; use s3://, gs://, az://, file:// or an https:// URL of an S3 or Azure endpoint",
                redact_url(&e.to_string())
            ))
        })?;
        // Any other http(s) URL is an S3-compatible endpoint, path-style
        // (https://object.example.com/bucket/prefix, as CoreWeave or MinIO serve them).
        let mut url_endpoint = None;
        let url = if scheme == ObjectStoreScheme::Http {
            let rest = url.path().trim_start_matches('/');
            if rest.is_empty() {
                return Err(SourceError::Invalid(format!(
                    "{shown}: name the bucket: https://host/bucket/prefix"
                )));
            }
            url_endpoint = Some(url[..url::Position::BeforePath].to_owned());
            scheme = ObjectStoreScheme::AmazonS3;
            Url::parse(&format!("s3://{rest}")).map_err(|e| {
                SourceError::Invalid(format!("spec.source.objectStore.url {shown}: {e}"))
            })?
        } else {
            url
        };
        let mut options: BTreeMap<String, String> = match (access, &scheme) {
            (_, ObjectStoreScheme::Local) => BTreeMap::new(),
            // Only a source the policy allow-listed for the process's own identity.
            (Access::Ambient, _) => std::env::vars()
                .filter(|(k, _)| AMBIENT_PREFIXES.iter().any(|p| k.starts_with(p)))
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect(),
            (Access::Own, _) => secret_options(&scheme, &creds.object_store, &shown)?,
            (Access::Anonymous, _) => {
                return Err(SourceError::CredentialsRequired(format!(
                    "{shown}: an object-store source is read with the credentials of its own Secret (spec.source.objectStore.credentialsSecretRef)"
                )));
            }
        };
        let endpoint = src
            .endpoint
            .as_deref()
            .filter(|e| !e.is_empty())
            .or(url_endpoint.as_deref());
        match scheme {
            ObjectStoreScheme::AmazonS3 => {
                if let Some(e) = endpoint {
                    options.insert("aws_endpoint".into(), e.into());
                    options.insert("aws_virtual_hosted_style_request".into(), "false".into());
                }
                if let Some(r) = src.region.as_deref().filter(|r| !r.is_empty()) {
                    options.insert("aws_region".into(), r.into());
                }
                if access == Access::Ambient
                    && options.contains_key("aws_access_key_id")
                        != options.contains_key("aws_secret_access_key")
                {
                    return Err(SourceError::InvalidCredentials {
                        url: shown.clone(),
                        detail: "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together; one is missing".into(),
                    });
                }
            }
            ObjectStoreScheme::MicrosoftAzure => {
                if let Some(e) = endpoint {
                    options.insert("azure_storage_endpoint".into(), e.into());
                }
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                gcs_endpoint(&mut options, endpoint, access, &shown)?;
            }
            ObjectStoreScheme::Local => {}
            other => {
                return Err(SourceError::Invalid(format!(
                    "{shown}: {other:?} URLs are not a supported source; use s3://, gs://, az:// or file://"
                )));
            }
        }
        if endpoint.is_some_and(|e| e.starts_with("http://")) {
            options.insert("allow_http".into(), "true".into());
        }
        options.insert(
            "timeout".into(),
            format!("{}s", opts.timeout.as_secs().max(1)),
        );
        options.insert(
            "connect_timeout".into(),
            format!("{}s", opts.timeout.as_secs().clamp(1, 10)),
        );
        let secrets = creds.secrets();
        // parse_url_opts reads no environment (it starts from `<Builder>::new()`); the
        // options are all there is, besides what `build()` falls back to without static
        // credentials, which `secret_options` rules out.
        let connector = GuardedConnector {
            egress: Arc::new(opts.policy.egress.clone()),
            // Instance metadata (a literal link-local address) is the ambient credentials'
            // provider; a tenant's own credentials never need it.
            literals: access != Access::Ambient,
        };
        let (store, parsed_prefix) = build_source_store(&url, options, connector).map_err(|e| {
            SourceError::InvalidCredentials {
                url: shown.clone(),
                detail: redact(&error_chain(&e), &secrets),
            }
        })?;
        // `scheme://bucket/prefix`: the prefix is the URL's path (object_store reads `az://`
        // as `az://account/container/...`; the rest of Sealed Volumes, like the Azure builder,
        // reads it as `az://container/prefix`). https:// URLs keep object_store's reading.
        let prefix = match url.scheme() {
            "https" | "http" => parsed_prefix,
            _ => ObjectPath::from_url_path(url.path()).map_err(|e| {
                SourceError::Invalid(format!("spec.source.objectStore.url {shown}: {e}"))
            })?,
        };
        Ok(BucketSource {
            store: Arc::from(store),
            prefix,
            url: shown,
            retries: opts.retries,
            limits: opts.limits,
            secrets,
        })
    }

    pub(crate) fn describe(&self) -> String {
        self.url.clone()
    }

    /// Every object under the prefix (paths relative to it, sorted) and the revision. The
    /// listing is streamed and counted as it arrives ([`ListingBudget`]: entries, and the
    /// bytes of their keys and ETags), so an endless or huge prefix fails at the bound
    /// instead of filling memory.
    pub(crate) async fn list(&self) -> Result<(String, Vec<RemoteFile>), SourceError> {
        let prefix = (!self.prefix.as_ref().is_empty()).then_some(&self.prefix);
        let strip = if self.prefix.as_ref().is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix.as_ref())
        };
        let mut budget = ListingBudget::new(self.limits);
        let mut files = Vec::new();
        let mut listing = self.store.list(prefix);
        while let Some(meta) = listing
            .try_next()
            .await
            .map_err(|e| self.error(e, Stage::List, ""))?
        {
            // What an entry holds in memory: its key twice, its ETag or version, a size.
            let held = meta.location.as_ref().len() as u64 * 2
                + meta.e_tag.as_ref().map_or(0, |e| e.len() as u64)
                + meta.version.as_ref().map_or(0, |v| v.len() as u64)
                + 64;
            budget
                .add(1, held)
                .map_err(|detail| SourceError::TooLarge {
                    what: self.url.clone(),
                    detail,
                })?;
            let key = meta.location.as_ref();
            let Some(rel) = key.strip_prefix(&strip) else {
                continue;
            };
            // Zero-byte "directory" markers end in '/'.
            if rel.is_empty() || rel.ends_with('/') {
                continue;
            }
            files.push(RemoteFile {
                path: rel.to_owned(),
                key: key.to_owned(),
                size: meta.size,
                sha256: None,
                git_oid: None,
                etag: meta.e_tag.as_deref().map(normal_etag).or_else(|| {
                    meta.version
                        .clone()
                        .or_else(|| Some(meta.last_modified.to_rfc3339()))
                }),
            });
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        if files.is_empty() {
            return Err(SourceError::NoFiles {
                what: self.url.clone(),
                detail: "no objects under the prefix".into(),
            });
        }
        let mut hasher = blake3::Hasher::new();
        for f in &files {
            hasher.update(f.path.as_bytes());
            hasher.update(b"\0");
            hasher.update(f.etag.as_deref().unwrap_or("").as_bytes());
            hasher.update(b"\0");
            hasher.update(f.size.to_string().as_bytes());
            hasher.update(b"\n");
        }
        Ok((format!("etags:{}", hasher.finalize().to_hex()), files))
    }

    /// Streams one object into the ingest, retrying a download that broke off.
    pub(crate) async fn fetch(
        &self,
        ingest: &Ingest,
        file: &RemoteFile,
        progress: &Arc<dyn SyncReporter>,
    ) -> Result<(), SourceError> {
        let location = ObjectPath::from(file.key.as_str());
        let mut attempt = 0;
        loop {
            let got = self
                .store
                .get(&location)
                .await
                .map_err(|e| self.error(e, Stage::Get, &file.path))?;
            if let (Some(listed), Some(now)) = (&file.etag, got.meta.e_tag.as_deref())
                && *listed != normal_etag(now)
            {
                return Err(SourceError::SourceChanged {
                    what: self.url.clone(),
                    path: file.path.clone(),
                    detail: format!("ETag {listed} at listing, {now} now"),
                });
            }
            let body = got.into_stream().map_err(std::io::Error::other);
            let mut tap = Tap::new(StreamReader::new(body), file.size);
            match ingest
                .add_file(&file.path, false, Some(file.size), &mut tap)
                .await
            {
                Ok(_) => return Ok(()),
                // More than the listing said: the object is not what was listed.
                Err(_) if tap.overflowed => {
                    return Err(SourceError::SourceChanged {
                        what: self.url.clone(),
                        path: file.path.clone(),
                        detail: tap.overflow_detail(),
                    });
                }
                // A download that broke off, or ended short of the listed size: try again.
                Err(e) if (tap.failed || short(&e)) && attempt < self.retries => {
                    attempt += 1;
                    tracing::warn!(
                        source = %self.url,
                        path = %file.path,
                        attempt,
                        error = %redact(&e.to_string(), &self.secrets),
                        "download broke off; retrying the object"
                    );
                    progress.retry(&file.path);
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(e) if tap.failed => {
                    return Err(SourceError::Unavailable {
                        what: format!("{} object '{}'", self.url, file.path),
                        detail: redact(&error_chain(&e), &self.secrets),
                    });
                }
                // The store's detail names the size that came: not the tenant's to know.
                Err(sealed_store::Error::FileChanged { .. }) => {
                    return Err(SourceError::SourceChanged {
                        what: self.url.clone(),
                        path: file.path.clone(),
                        detail: size_mismatch(file.size),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Names what an object-store error means for the user.
    fn error(&self, e: object_store::Error, stage: Stage, path: &str) -> SourceError {
        if let Some(refused) = refused_in(&e) {
            return SourceError::Refused(format!(
                "{}: {}",
                self.url,
                redact(&refused.to_string(), &self.secrets)
            ));
        }
        let detail = redact(&error_chain(&e), &self.secrets);
        let url = self.url.clone();
        let has = |words: &[&str]| words.iter().any(|w| detail.contains(w));
        let rejected = [
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AuthenticationFailed",
            "InvalidClientTokenId",
            "invalid_grant",
            "ExpiredToken",
            "401 Unauthorized",
            "Server failed to authenticate",
        ];
        let denied = ["403 Forbidden", "AccessDenied", "AuthorizationFailure"];
        let missing = ["NoSuchBucket", "ContainerNotFound", "404 Not Found"];
        match &e {
            _ if has(&rejected) || matches!(e, object_store::Error::Unauthenticated { .. }) => {
                SourceError::CredentialsRejected { url, detail }
            }
            object_store::Error::PermissionDenied { .. } => SourceError::AccessDenied {
                what: url,
                detail: format!("{detail}; the credentials lack permission to list or read it"),
            },
            _ if has(&denied) => SourceError::AccessDenied {
                what: url,
                detail: format!("{detail}; the credentials lack permission to list or read it"),
            },
            object_store::Error::NotFound { .. } if stage == Stage::Get => {
                SourceError::SourceChanged {
                    what: url,
                    path: path.to_owned(),
                    detail: "deleted since the listing".into(),
                }
            }
            object_store::Error::NotFound { .. } => SourceError::BucketNotFound { url, detail },
            _ if has(&missing) => SourceError::BucketNotFound { url, detail },
            _ if stage == Stage::List => SourceError::Unavailable { what: url, detail },
            _ => SourceError::Unavailable {
                what: format!("{url} object '{path}'"),
                detail,
            },
        }
    }
}

/// What a key of a source Secret is to an object-store builder.
#[derive(Debug, PartialEq, Eq)]
enum SecretKey {
    /// Says who reads: passed on.
    Credential,
    /// Would change where or how the source is read (endpoint, bucket, token files, instance
    /// metadata, the Azure CLI, client settings): refused.
    Refused,
    /// Not a key of this builder (another provider's, or none at all): left out.
    Other,
}

/// Classifies `key` (lowercase) for the builder of `scheme`.
fn secret_key(scheme: &ObjectStoreScheme, key: &str) -> SecretKey {
    let credential = match scheme {
        ObjectStoreScheme::AmazonS3 => match AmazonS3ConfigKey::from_str(key) {
            Ok(
                AmazonS3ConfigKey::AccessKeyId
                | AmazonS3ConfigKey::SecretAccessKey
                | AmazonS3ConfigKey::Token
                | AmazonS3ConfigKey::Region
                | AmazonS3ConfigKey::DefaultRegion,
            ) => Some(true),
            Ok(_) => Some(false),
            Err(_) => None,
        },
        ObjectStoreScheme::GoogleCloudStorage => match GoogleConfigKey::from_str(key) {
            Ok(GoogleConfigKey::ServiceAccountKey) => Some(true),
            Ok(_) => Some(false),
            Err(_) => None,
        },
        ObjectStoreScheme::MicrosoftAzure => match AzureConfigKey::from_str(key) {
            Ok(
                AzureConfigKey::AccountName
                | AzureConfigKey::AccessKey
                | AzureConfigKey::SasKey
                | AzureConfigKey::Token
                | AzureConfigKey::ClientId
                | AzureConfigKey::ClientSecret
                | AzureConfigKey::AuthorityId,
            ) => Some(true),
            Ok(_) => Some(false),
            Err(_) => None,
        },
        _ => None,
    };
    match credential {
        Some(true) => SecretKey::Credential,
        Some(false) => SecretKey::Refused,
        None => SecretKey::Other,
    }
}

/// The builder options from a source Secret: its credential keys (lowercased); a refused key
/// or a Secret without the credential itself is an `InvalidCredentials` naming the key.
fn secret_options(
    scheme: &ObjectStoreScheme,
    secret: &BTreeMap<String, String>,
    shown: &str,
) -> Result<BTreeMap<String, String>, SourceError> {
    let invalid = |detail: String| SourceError::InvalidCredentials {
        url: shown.to_owned(),
        detail,
    };
    let (allowed, needed) = match scheme {
        ObjectStoreScheme::AmazonS3 => (
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION",
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ),
        ObjectStoreScheme::GoogleCloudStorage => {
            ("GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_SERVICE_ACCOUNT_KEY")
        }
        _ => (
            "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, AZURE_STORAGE_TOKEN, AZURE_STORAGE_CLIENT_ID, AZURE_STORAGE_CLIENT_SECRET, AZURE_STORAGE_TENANT_ID",
            "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, AZURE_STORAGE_TOKEN, or AZURE_STORAGE_CLIENT_ID with AZURE_STORAGE_CLIENT_SECRET and AZURE_STORAGE_TENANT_ID",
        ),
    };
    let mut options = BTreeMap::new();
    for (k, v) in secret {
        let key = k.to_ascii_lowercase();
        match secret_key(scheme, &key) {
            SecretKey::Credential => {
                options.insert(key, v.clone());
            }
            SecretKey::Refused => {
                return Err(invalid(format!(
                    "key {k} is not allowed in a source credentials Secret: it would change where or how the source is read (set an endpoint in spec.source.objectStore.endpoint); allowed keys: {allowed}"
                )));
            }
            SecretKey::Other => {}
        }
    }
    let has = |pred: &dyn Fn(&str) -> bool| options.keys().any(|k| pred(k));
    let complete = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let id = has(&|k| {
                AmazonS3ConfigKey::from_str(k).ok() == Some(AmazonS3ConfigKey::AccessKeyId)
            });
            let secret = has(&|k| {
                AmazonS3ConfigKey::from_str(k).ok() == Some(AmazonS3ConfigKey::SecretAccessKey)
            });
            if id != secret {
                return Err(invalid(
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together; one is missing"
                        .into(),
                ));
            }
            id
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            has(&|k| GoogleConfigKey::from_str(k).ok() == Some(GoogleConfigKey::ServiceAccountKey))
        }
        _ => {
            let is = |want: AzureConfigKey| {
                move |k: &str| AzureConfigKey::from_str(k).ok() == Some(want)
            };
            has(&is(AzureConfigKey::AccessKey))
                || has(&is(AzureConfigKey::SasKey))
                || has(&is(AzureConfigKey::Token))
                || (has(&is(AzureConfigKey::ClientId))
                    && has(&is(AzureConfigKey::ClientSecret))
                    && has(&is(AzureConfigKey::AuthorityId)))
        }
    };
    if !complete {
        return Err(invalid(format!(
            "the Secret in credentialsSecretRef has no credentials for this store: it needs {needed} (a source is never read with the operator's own identity)"
        )));
    }
    Ok(options)
}

/// Fields of a service-account key object_store reads as *where* or *how* to read
/// (`gcs_base_url`: the host every request and its bearer JWT go to; `disable_oauth`:
/// unauthenticated requests), not *who*: refused in a tenant's key, as endpoint keys are.
const GCS_KEY_REFUSED: [&str; 2] = ["gcs_base_url", "disable_oauth"];

/// The GCS endpoint: object_store takes a base URL only from the service-account key's
/// `gcs_base_url` (no builder option), so the endpoint the policy checked
/// (`spec.source.objectStore.endpoint`) is written into the key, and a tenant's key may not
/// carry its own: that would send the tenant's signed JWT to a host no check saw (around
/// the allowed-hosts annotation and the http:// rule), which is invariant 6's "a credential
/// goes only to its own endpoint's origin".
fn gcs_endpoint(
    options: &mut BTreeMap<String, String>,
    endpoint: Option<&str>,
    access: Access,
    shown: &str,
) -> Result<(), SourceError> {
    let invalid = |detail: String| SourceError::InvalidCredentials {
        url: shown.to_owned(),
        detail,
    };
    let key_name = options
        .keys()
        .find(|k| GoogleConfigKey::from_str(k).ok() == Some(GoogleConfigKey::ServiceAccountKey))
        .cloned();
    let Some(key_name) = key_name else {
        return match endpoint {
            Some(_) => Err(SourceError::Invalid(format!(
                "{shown}: a GCS endpoint (spec.source.objectStore.endpoint) needs the \
                 credentials as GOOGLE_SERVICE_ACCOUNT_KEY: the GCS client takes a base URL only \
                 with a service-account key"
            ))),
            None => Ok(()),
        };
    };
    let raw = options.get(&key_name).map(String::as_str).unwrap_or("");
    let mut key: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(raw).map_err(|e| {
            // Not serde's message: it may quote the key's text.
            invalid(format!(
                "GOOGLE_SERVICE_ACCOUNT_KEY is not a service-account key (a JSON object; \
                 unreadable at line {} column {})",
                e.line(),
                e.column()
            ))
        })?;
    if access == Access::Own
        && let Some(field) = GCS_KEY_REFUSED.iter().find(|f| key.contains_key(**f))
    {
        return Err(invalid(format!(
            "GOOGLE_SERVICE_ACCOUNT_KEY sets {field}, which would change where or how the \
             source is read: remove it (set an endpoint in spec.source.objectStore.endpoint)"
        )));
    }
    if let Some(e) = endpoint {
        key.insert(
            "gcs_base_url".into(),
            serde_json::Value::String(e.trim_end_matches('/').to_owned()),
        );
        let rewritten = serde_json::Value::Object(key).to_string();
        options.insert(key_name, rewritten);
    }
    Ok(())
}

/// An ETag without its quotes or weak marker (stores differ between listings and GETs).
fn normal_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_owned()
}

/// The client for a source URL: what `object_store::parse_url_opts` (0.12) builds — the
/// builder's `new()` (no environment), the URL, each option the builder knows, the rest
/// ignored — with [`GuardedConnector`] under S3, GCS and Azure: only addresses the egress
/// policy admits, and a hostile endpoint's endless listing page or error body ends with an
/// error instead of filling memory.
fn build_source_store(
    url: &Url,
    options: BTreeMap<String, String>,
    connector: GuardedConnector,
) -> object_store::Result<(Box<dyn ObjectStore>, ObjectPath)> {
    let (scheme, path) = ObjectStoreScheme::parse(url)?;
    let store: Box<dyn ObjectStore> = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let builder = options.iter().fold(
                AmazonS3Builder::new().with_url(url.to_string()),
                |b, (k, v)| match k.parse::<AmazonS3ConfigKey>() {
                    Ok(key) => b.with_config(key, v),
                    Err(_) => b,
                },
            );
            Box::new(builder.with_http_connector(connector).build()?)
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            let builder = options.iter().fold(
                GoogleCloudStorageBuilder::new().with_url(url.to_string()),
                |b, (k, v)| match k.parse::<GoogleConfigKey>() {
                    Ok(key) => b.with_config(key, v),
                    Err(_) => b,
                },
            );
            Box::new(builder.with_http_connector(connector).build()?)
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let builder = options.iter().fold(
                MicrosoftAzureBuilder::new().with_url(url.to_string()),
                |b, (k, v)| match k.parse::<AzureConfigKey>() {
                    Ok(key) => b.with_config(key, v),
                    Err(_) => b,
                },
            );
            Box::new(builder.with_http_connector(connector).build()?)
        }
        // file:// (and anything else the checks above let through): no HTTP.
        _ => return object_store::parse_url_opts(url, options),
    };
    Ok((store, ObjectPath::parse(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_gcs_key_says_who_and_the_endpoint_says_where() {
        let key = r#"{"client_email":"a@b","private_key":"PRIVATE-KEY-TEXT","private_key_id":"1"}"#;
        let name = "google_service_account_key";
        // The checked endpoint is written into the key (the only base URL object_store takes).
        let mut options = keys(&[(name, key)]);
        gcs_endpoint(
            &mut options,
            Some("http://127.0.0.1:4443/"),
            Access::Own,
            "gs://b",
        )
        .unwrap();
        let written: serde_json::Value = serde_json::from_str(&options[name]).unwrap();
        assert_eq!(written["gcs_base_url"], "http://127.0.0.1:4443");
        assert_eq!(written["private_key"], "PRIVATE-KEY-TEXT");
        assert_eq!(options.len(), 1, "{options:?}");
        // No endpoint: the key as it was (object_store's default, storage.googleapis.com).
        let mut options = keys(&[(name, key)]);
        gcs_endpoint(&mut options, None, Access::Own, "gs://b").unwrap();
        assert_eq!(options[name], key);

        // A tenant's key that moves the host (or turns auth off) is refused, naming the field.
        for (field, value) in [
            ("gcs_base_url", r#""http://169.254.169.254""#),
            ("disable_oauth", "true"),
        ] {
            let moved = format!(
                r#"{{"client_email":"a@b","private_key":"PRIVATE-KEY-TEXT","private_key_id":"1","{field}":{value}}}"#
            );
            for endpoint in [None, Some("https://storage.example.com")] {
                let mut options = keys(&[(name, &moved)]);
                let err = gcs_endpoint(&mut options, endpoint, Access::Own, "gs://b").unwrap_err();
                assert_eq!(err.reason(), "InvalidCredentials", "{err}");
                let msg = format!("{err} {err:?}");
                assert!(msg.contains(field), "{msg}");
                assert!(!msg.contains("PRIVATE-KEY-TEXT"), "{msg}");
            }
            // The process's own key (an allow-listed source) is the admin's: kept.
            let mut options = keys(&[(name, &moved)]);
            gcs_endpoint(&mut options, None, Access::Ambient, "gs://b").unwrap();
        }
        // Not JSON: refused without quoting it.
        let mut options = keys(&[(name, "PRIVATE-KEY-TEXT")]);
        let err = gcs_endpoint(&mut options, None, Access::Own, "gs://b").unwrap_err();
        assert_eq!(err.reason(), "InvalidCredentials", "{err}");
        assert!(
            !format!("{err} {err:?}").contains("PRIVATE-KEY-TEXT"),
            "{err:?}"
        );
        // An endpoint with no key to carry it would be ignored by the client: refused.
        let mut options = BTreeMap::new();
        let err = gcs_endpoint(
            &mut options,
            Some("http://127.0.0.1:1"),
            Access::Ambient,
            "gs://b",
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("GOOGLE_SERVICE_ACCOUNT_KEY"),
            "{err}"
        );
    }

    #[test]
    fn secret_keys_say_who_never_where() {
        let s3 = ObjectStoreScheme::AmazonS3;
        let ok = secret_options(
            &s3,
            &keys(&[
                ("AWS_ACCESS_KEY_ID", "AKIA"),
                ("AWS_SECRET_ACCESS_KEY", "s3cret"),
                ("AWS_REGION", "eu-west-1"),
                // Another provider's key, or none at all: left out.
                ("AZURE_STORAGE_ACCOUNT_KEY", "x"),
                ("README", "hello"),
            ]),
            "s3://b/p",
        )
        .unwrap();
        assert_eq!(
            ok.keys().map(String::as_str).collect::<Vec<_>>(),
            ["aws_access_key_id", "aws_region", "aws_secret_access_key"]
        );
        for refused in [
            "AWS_ENDPOINT",
            "ENDPOINT",
            "AWS_BUCKET",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_METADATA_ENDPOINT",
            "AWS_ALLOW_HTTP",
            "AWS_PROXY_URL",
        ] {
            let err = secret_options(
                &s3,
                &keys(&[
                    ("AWS_ACCESS_KEY_ID", "AKIA"),
                    ("AWS_SECRET_ACCESS_KEY", "s3cret"),
                    (refused, "x"),
                ]),
                "s3://b/p",
            )
            .unwrap_err();
            assert_eq!(err.reason(), "InvalidCredentials", "{refused}");
            assert!(err.to_string().contains(refused), "{err}");
        }
        // Without the credential itself the builder would use the instance role: refused.
        for secret in [
            keys(&[("AWS_REGION", "us-east-1")]),
            keys(&[("GOOGLE_SERVICE_ACCOUNT_KEY", "{}")]),
        ] {
            let err = secret_options(&s3, &secret, "s3://b/p").unwrap_err();
            assert_eq!(err.reason(), "InvalidCredentials", "{err}");
        }
        let err =
            secret_options(&s3, &keys(&[("AWS_ACCESS_KEY_ID", "AKIA")]), "s3://b/p").unwrap_err();
        assert!(err.to_string().contains("go together"), "{err}");

        let gcs = ObjectStoreScheme::GoogleCloudStorage;
        assert!(
            secret_options(
                &gcs,
                &keys(&[("GOOGLE_SERVICE_ACCOUNT_KEY", "{}")]),
                "gs://b"
            )
            .is_ok()
        );
        for refused in [
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_BUCKET",
        ] {
            assert!(
                secret_options(
                    &gcs,
                    &keys(&[("GOOGLE_SERVICE_ACCOUNT_KEY", "{}"), (refused, "/etc/x")]),
                    "gs://b"
                )
                .is_err(),
                "{refused}"
            );
        }

        let az = ObjectStoreScheme::MicrosoftAzure;
        assert!(
            secret_options(
                &az,
                &keys(&[
                    ("AZURE_STORAGE_ACCOUNT_NAME", "a"),
                    ("AZURE_STORAGE_ACCOUNT_KEY", "k")
                ]),
                "az://c"
            )
            .is_ok()
        );
        assert!(
            secret_options(
                &az,
                &keys(&[
                    ("AZURE_STORAGE_ACCOUNT_NAME", "a"),
                    ("AZURE_STORAGE_SAS_TOKEN", "sv=1")
                ]),
                "az://c"
            )
            .is_ok()
        );
        // A client id alone would mean the managed identity: no credential.
        assert!(
            secret_options(
                &az,
                &keys(&[
                    ("AZURE_STORAGE_ACCOUNT_NAME", "a"),
                    ("AZURE_CLIENT_ID", "id")
                ]),
                "az://c"
            )
            .is_err()
        );
        for refused in [
            "AZURE_STORAGE_USE_EMULATOR",
            "AZURE_USE_AZURE_CLI",
            "AZURE_FEDERATED_TOKEN_FILE",
            "AZURE_MSI_ENDPOINT",
            "AZURE_STORAGE_ENDPOINT",
            "AZURE_CONTAINER_NAME",
        ] {
            assert!(
                secret_options(
                    &az,
                    &keys(&[("AZURE_STORAGE_ACCOUNT_KEY", "k"), (refused, "true")]),
                    "az://c"
                )
                .is_err(),
                "{refused}"
            );
        }
    }

    #[test]
    fn without_ambient_access_the_environment_is_never_read() {
        let src = BucketPrefix {
            url: "s3://models/llm".into(),
            endpoint: None,
            region: None,
        };
        // No Secret and no ambient access: refused before any builder runs.
        let err = BucketSource::open(
            &src,
            &SourceCredentials::default(),
            &SyncOptions::default(),
            Access::Anonymous,
        )
        .err()
        .expect("refused");
        assert_eq!(err.reason(), "CredentialsRequired");
        // A Secret with only a region would fall back to the instance role: refused.
        let creds = SourceCredentials {
            hf_token: None,
            object_store: keys(&[("AWS_REGION", "us-east-1")]),
            docker_config: None,
        };
        let err = BucketSource::open(&src, &creds, &SyncOptions::default(), Access::Own)
            .err()
            .expect("refused");
        assert_eq!(err.reason(), "InvalidCredentials");
    }
}
