//! An object-store prefix as a source: S3 and S3-compatible stores (R2, CoreWeave, MinIO) with
//! a custom endpoint and region, GCS, Azure Blob, and `file://` directories.
//!
//! The prefix is listed once; the listing's (path, ETag, size) triples, sorted, hashed with
//! BLAKE3, are the source revision (`etags:<64 hex>`), so an unchanged prefix shows the same
//! revision. Each object is then streamed into the ingest under its path relative to the
//! prefix; an object whose ETag moved since the listing fails the sync (`SourceChanged`)
//! rather than sealing a version the revision does not describe.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreScheme};
use sealed_crds::ObjectStoreSource;
use sealed_store::ingest::Ingest;
use tokio_util::io::StreamReader;
use url::Url;

use super::{
    RemoteFile, SourceCredentials, SourceError, SyncOptions, SyncProgress, Tap, backoff,
    error_chain, redact, short,
};

/// Environment prefixes the ambient credentials come from when no Secret is given.
const AMBIENT_PREFIXES: [&str; 3] = ["AWS_", "AZURE_", "GOOGLE_"];

pub struct BucketSource {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    /// The URL as written in the spec (it never carries credentials), for messages.
    url: String,
    retries: u32,
    secrets: Vec<String>,
}

/// What went wrong with a request, for choosing the error.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    List,
    Get,
}

impl BucketSource {
    pub(crate) fn open(
        src: &ObjectStoreSource,
        creds: &SourceCredentials,
        opts: &SyncOptions,
    ) -> Result<BucketSource, SourceError> {
        let url = Url::parse(&src.url)
            .map_err(|e| SourceError::Invalid(format!("spec.source.objectStore.url: {e}")))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(SourceError::Invalid(
                "spec.source.objectStore.url must not carry credentials; use credentialsSecretRef"
                    .into(),
            ));
        }
        let (mut scheme, _) = ObjectStoreScheme::parse(&url).map_err(|e| {
            SourceError::Invalid(format!(
                "{}: {e}; use s3://, gs://, az://, file:// or an https:// URL of an S3 or Azure endpoint",
                src.url
            ))
        })?;
        // Any other http(s) URL is an S3-compatible endpoint, path-style
        // (https://object.example.com/bucket/prefix, as CoreWeave or MinIO serve them).
        let mut url_endpoint = None;
        let url = if scheme == ObjectStoreScheme::Http {
            let rest = url.path().trim_start_matches('/');
            if rest.is_empty() {
                return Err(SourceError::Invalid(format!(
                    "{}: name the bucket: https://host/bucket/prefix",
                    src.url
                )));
            }
            url_endpoint = Some(url[..url::Position::BeforePath].to_owned());
            scheme = ObjectStoreScheme::AmazonS3;
            Url::parse(&format!("s3://{rest}")).map_err(|e| {
                SourceError::Invalid(format!("spec.source.objectStore.url {}: {e}", src.url))
            })?
        } else {
            url
        };
        let mut options: BTreeMap<String, String> = BTreeMap::new();
        if creds.object_store.is_empty() {
            for (k, v) in std::env::vars() {
                if AMBIENT_PREFIXES.iter().any(|p| k.starts_with(p)) {
                    options.insert(k.to_ascii_lowercase(), v);
                }
            }
        } else {
            for (k, v) in &creds.object_store {
                options.insert(k.to_ascii_lowercase(), v.clone());
            }
        }
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
                if options.contains_key("aws_access_key_id")
                    != options.contains_key("aws_secret_access_key")
                {
                    return Err(SourceError::InvalidCredentials {
                        url: src.url.clone(),
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
                if let Some(e) = endpoint {
                    options.insert("google_base_url".into(), e.into());
                }
            }
            ObjectStoreScheme::Local => {}
            other => {
                return Err(SourceError::Invalid(format!(
                    "{}: {other:?} URLs are not a supported source; use s3://, gs://, az:// or file://",
                    src.url
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
        let (store, parsed_prefix) = object_store::parse_url_opts(&url, options).map_err(|e| {
            SourceError::InvalidCredentials {
                url: src.url.clone(),
                detail: redact(&error_chain(&e), &secrets),
            }
        })?;
        // `scheme://bucket/prefix`: the prefix is the URL's path (object_store reads `az://`
        // as `az://account/container/...`; the rest of Sealed Volumes, like the Azure builder,
        // reads it as `az://container/prefix`). https:// URLs keep object_store's reading.
        let prefix = match url.scheme() {
            "https" | "http" => parsed_prefix,
            _ => ObjectPath::from_url_path(url.path()).map_err(|e| {
                SourceError::Invalid(format!("spec.source.objectStore.url {}: {e}", src.url))
            })?,
        };
        Ok(BucketSource {
            store: Arc::from(store),
            prefix,
            url: src.url.clone(),
            retries: opts.retries,
            secrets,
        })
    }

    pub(crate) fn describe(&self) -> String {
        self.url.clone()
    }

    /// Every object under the prefix (paths relative to it, sorted) and the revision.
    pub(crate) async fn list(&self) -> Result<(String, Vec<RemoteFile>), SourceError> {
        let prefix = (!self.prefix.as_ref().is_empty()).then_some(&self.prefix);
        let metas: Vec<_> = self
            .store
            .list(prefix)
            .try_collect()
            .await
            .map_err(|e| self.error(e, Stage::List, ""))?;
        let strip = if self.prefix.as_ref().is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix.as_ref())
        };
        let mut files = Vec::new();
        for meta in metas {
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
        progress: &Arc<dyn SyncProgress>,
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
            let mut tap = Tap::new(StreamReader::new(body));
            match ingest
                .add_file(&file.path, false, Some(file.size), &mut tap)
                .await
            {
                Ok(_) => return Ok(()),
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
                Err(sealed_store::Error::FileChanged { detail, .. }) => {
                    return Err(SourceError::SourceChanged {
                        what: self.url.clone(),
                        path: file.path.clone(),
                        detail,
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Names what an object-store error means for the user.
    fn error(&self, e: object_store::Error, stage: Stage, path: &str) -> SourceError {
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

/// An ETag without its quotes or weak marker (stores differ between listings and GETs).
fn normal_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_owned()
}
