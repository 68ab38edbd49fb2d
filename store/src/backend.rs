//! Opening a store's backend from its URL: `file://`, `memory://`, `s3://`, `gs://`, `az://`.
//! Each cloud builder is configured by [`crate::cloud`] the way its own CLI is; here every
//! backend gets the same client bounds, retries, response caps ([`CappedConnector`]) and the
//! store's own credentials. [`crate::ChunkStore`] wraps what this returns.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::prefix::PrefixStore;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use url::Url;

use crate::cloud;
use crate::error::{Error, Result};
use crate::http_cap::CappedConnector;

/// How to reach a store. Credentials come from the environment as each backend documents
/// (`AWS_ACCESS_KEY_ID`, `AZURE_STORAGE_ACCOUNT_KEY`, `GOOGLE_SERVICE_ACCOUNT`, …).
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Custom endpoint for S3-compatible servers (MinIO, R2, CoreWeave) or Azure emulators.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// Per-request timeout; a request that does not answer in time is retried.
    pub timeout: Duration,
    /// Retries of a failed request before the error is returned.
    pub retries: usize,
    /// Create a `file://` store's directory when it does not exist.
    pub create: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            endpoint: None,
            region: None,
            timeout: Duration::from_secs(30),
            retries: 3,
            create: false,
        }
    }
}

/// An opened backend.
pub(crate) struct Backend {
    pub inner: Arc<dyn ObjectStore>,
    /// For `file://` stores: the directory, so writes can be made durable with syncfs.
    pub local_root: Option<PathBuf>,
}

/// Builds the backend for `url` without asking it anything (no request is made here).
pub(crate) fn open(url: &str, opts: &StoreOptions) -> Result<Backend> {
    // Bad options are refused here, before they can overflow a retry timeout.
    opts.validate()?;
    let bad = |reason: &str| Error::InvalidStoreUrl {
        url: url.into(),
        reason: reason.into(),
    };
    let parsed = Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    let backend_err = |e: object_store::Error| Error::Backend {
        store: url.into(),
        source: e,
    };
    let cloud = |built: (Box<dyn CloudBuilder>, Option<String>)| -> Result<Backend> {
        let (builder, endpoint) = built;
        let inner = builder
            .finish(url, opts, endpoint.as_deref())
            .map_err(backend_err)?;
        let prefix = parsed.path().trim_matches('/');
        let inner: Arc<dyn ObjectStore> = if prefix.is_empty() {
            inner
        } else {
            Arc::new(PrefixStore::new(inner, prefix))
        };
        Ok(Backend {
            inner,
            local_root: None,
        })
    };
    match parsed.scheme() {
        "file" => {
            let dir = parsed
                .to_file_path()
                .map_err(|_| bad("a file:// URL needs an absolute path"))?;
            if !dir.is_dir() {
                if opts.create {
                    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
                } else {
                    return Err(Error::StoreNotFound {
                        store: url.into(),
                        reason: format!(
                            "directory {} does not exist (create it with mkdir -p)",
                            dir.display()
                        ),
                    });
                }
            }
            let fs = LocalFileSystem::new_with_prefix(&dir).map_err(backend_err)?;
            Ok(Backend {
                inner: Arc::new(fs),
                local_root: Some(dir),
            })
        }
        "memory" => Ok(Backend {
            inner: Arc::new(InMemory::new()),
            local_root: None,
        }),
        "s3" | "s3a" => cloud(boxed(cloud::s3_builder(opts)?)),
        "gs" => cloud(boxed(cloud::gcs_builder(opts)?)),
        "az" | "azure" | "abfs" | "abfss" => cloud(boxed(cloud::azure_builder(opts)?)),
        other => Err(bad(&format!(
            "unsupported scheme '{other}': use file://, s3://, gs://, az:// or memory:// \
             (for R2 or CoreWeave use s3://bucket with --endpoint)"
        ))),
    }
}

fn boxed<B: CloudBuilder + 'static>(
    (builder, endpoint): (B, Option<String>),
) -> (Box<dyn CloudBuilder>, Option<String>) {
    (Box::new(builder), endpoint)
}

/// The store's own credentials as `SEALED_STORE_CRED_<KEY>` (how sync Jobs get the store's
/// Secret, so that source readers never see it under the standard names), as lowercased
/// builder keys.
fn store_credentials() -> Vec<(String, String)> {
    std::env::vars()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(crate::STORE_CREDENTIAL_ENV_PREFIX)?;
            (!key.is_empty()).then(|| (key.to_ascii_lowercase(), v))
        })
        .collect()
}

/// Client bounds: plain HTTP only to an endpoint that asks for it (a local server or
/// emulator).
fn client_options(opts: &StoreOptions, endpoint: Option<&str>) -> ClientOptions {
    ClientOptions::new()
        .with_timeout(opts.timeout)
        .with_connect_timeout(opts.timeout.min(Duration::from_secs(10)))
        .with_allow_http(endpoint.is_some_and(|e| e.starts_with("http://")))
}

fn retry_config(opts: &StoreOptions) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: opts.retries,
        retry_timeout: opts.timeout * (opts.retries as u32 + 1),
    }
}

/// What the three cloud builders share, so each is finished the same way.
trait CloudBuilder {
    /// Applies the store's credentials (after the backend's standard environment), the URL,
    /// the client bounds and retries, then builds.
    fn finish(
        self: Box<Self>,
        url: &str,
        opts: &StoreOptions,
        endpoint: Option<&str>,
    ) -> object_store::Result<Arc<dyn ObjectStore>>;
}

/// Keys a backend does not know are left out, as its `from_env` leaves them out.
macro_rules! cloud_builder {
    ($builder:ty, $key:ty, |$b:ident, $endpoint:ident| $after_url:expr) => {
        impl CloudBuilder for $builder {
            fn finish(
                self: Box<Self>,
                url: &str,
                opts: &StoreOptions,
                $endpoint: Option<&str>,
            ) -> object_store::Result<Arc<dyn ObjectStore>> {
                let mut b = *self;
                for (k, v) in store_credentials() {
                    if let Ok(key) = k.parse::<$key>() {
                        b = b.with_config(key, v);
                    }
                }
                let $b = b
                    .with_url(url)
                    .with_client_options(client_options(opts, $endpoint))
                    .with_http_connector(CappedConnector)
                    .with_retry(retry_config(opts));
                Ok(Arc::new($after_url.build()?))
            }
        }
    };
}

cloud_builder!(AmazonS3Builder, AmazonS3ConfigKey, |b, _endpoint| b);
cloud_builder!(GoogleCloudStorageBuilder, GoogleConfigKey, |b, _endpoint| b);
// The URL's account would otherwise win over the endpoint's.
cloud_builder!(
    MicrosoftAzureBuilder,
    AzureConfigKey,
    |b, endpoint| match endpoint {
        Some(e) => b.with_endpoint(e.to_owned()),
        None => b,
    }
);
