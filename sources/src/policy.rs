//! Which sources a tenant may sync, and with which credentials (design invariant 6, "Least
//! privilege"). Checked by the volume reconciler before it starts a sync (so the tenant sees a
//! condition at once and no Job starts) and again by [`sync_source`](super::sync_source) /
//! [`resolve_revision`](super::resolve_revision) before any request, in the operator or in the
//! sync Job (which gets the policy as arguments from the operator).
//!
//! The rules (`docs/sources.md` has them for users):
//!
//! - A source is never the store, nor inside it, nor around it: same kind of store (`s3`,
//!   `gs`, `az`; an `https://host/bucket/prefix` URL counts as `s3`), same bucket or container,
//!   prefixes overlapping either way. Endpoints are ignored (conservative): a source with an
//!   endpoint is compared with the store's bucket whatever its kind, and the endpoint host's
//!   first label counts as a bucket too (virtual-hosted style).
//! - `file://` sources read the sync process's own files: refused unless `--allow-file-sources`.
//! - Plain `http://` Hub endpoints, object-store URLs and endpoints: refused unless
//!   `--allow-http-sources`.
//! - A user or password in a URL is refused (credentials go in Secrets).
//! - An object-store source without `credentialsSecretRef` is read with the process's own
//!   (ambient) credentials only when its location is under one of the allow-listed prefixes
//!   (`--ambient-credentials-source`); otherwise it is refused (`CredentialsRequired`). A Hub
//!   source without a token is fine: public repositories need none.
//! - Loopback, link-local, private, CGNAT and the cluster's own ranges (`--cluster-network`)
//!   are never reached, checked on the resolved address of every connection and redirect
//!   ([`crate::egress`]); an admin allows ranges with `--allow-source-network`. An endpoint
//!   written as such an address is refused here already, before any request.

use crate::egress::{ALLOW_NETWORK_FLAG, CLUSTER_NETWORK_FLAG, Egress};
use crate::spec::{BucketPrefix, HubRepo, SourceSpec};
use url::Url;

use super::huggingface::DEFAULT_ENDPOINT;
use crate::error::SourceError;
use crate::redact::redact_url;

/// `sealed-operator run|sync` flag: `file://` sources are allowed.
pub const ALLOW_FILE_FLAG: &str = "--allow-file-sources";
/// `sealed-operator run|sync` flag: plain-http Hub endpoints and object-store endpoints are
/// allowed.
pub const ALLOW_HTTP_FLAG: &str = "--allow-http-sources";
/// `sealed-operator run|sync` flag (repeatable): a URL prefix that may be read with the
/// process's own credentials.
pub const AMBIENT_FLAG: &str = "--ambient-credentials-source";

/// What sources may be read, and how. `Default` is the strictest policy (no store to compare
/// with, though: the operator always sets [`store_url`](Self::store_url)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourcePolicy {
    /// The store volumes are sealed into: a source may not be it or overlap it.
    pub store_url: Option<String>,
    /// The store's endpoint (for the record: the overlap check ignores endpoints).
    pub store_endpoint: Option<String>,
    /// `file://` sources are allowed (`--allow-file-sources`).
    pub allow_file: bool,
    /// Plain-http Hub and object-store endpoints are allowed (`--allow-http-sources`).
    pub allow_http: bool,
    /// URL prefixes (`s3://public-models/`, `https://minio.internal/shared/`) an object-store
    /// source may be read under with the process's own credentials (workload identity)
    /// when it names no Secret (`--ambient-credentials-source`).
    pub ambient_allowed: Vec<String>,
    /// The address ranges sources may reach (`--allow-source-network`, `--cluster-network`).
    pub egress: Egress,
}

/// With which credentials an admitted source is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// None at all: a Hub repository without a token, a `file://` directory.
    Anonymous,
    /// The tenant's own, from its Secret.
    Own,
    /// The process's own (environment, workload identity): an allow-listed prefix.
    Ambient,
}

impl SourcePolicy {
    /// The strict policy for a store: nothing allowed beyond what needs no flag.
    pub fn for_store(store_url: &str, store_endpoint: Option<&str>) -> Self {
        SourcePolicy {
            store_url: Some(store_url.to_owned()),
            store_endpoint: store_endpoint.map(str::to_owned),
            ..Default::default()
        }
    }

    /// Checks the allow-list entries parse (at start-up, so a typo fails the operator and not
    /// every sync).
    pub fn validate(&self) -> Result<(), String> {
        for entry in &self.ambient_allowed {
            let loc = Location::parse(entry, None, AMBIENT_FLAG).map_err(|e| e.to_string())?;
            if matches!(loc.kind, Kind::File | Kind::Memory) {
                return Err(format!(
                    "{AMBIENT_FLAG} {}: only object-store prefixes (s3://, gs://, az://, https://) take ambient credentials",
                    redact_url(entry)
                ));
            }
        }
        Ok(())
    }

    /// The flags that give a `sealed-operator sync` process this policy (besides `--store`
    /// and `--store-endpoint`, which it gets anyway).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.allow_file {
            args.push(ALLOW_FILE_FLAG.to_owned());
        }
        if self.allow_http {
            args.push(ALLOW_HTTP_FLAG.to_owned());
        }
        for entry in &self.ambient_allowed {
            args.push(AMBIENT_FLAG.to_owned());
            args.push(entry.clone());
        }
        for net in &self.egress.allowed {
            args.push(ALLOW_NETWORK_FLAG.to_owned());
            args.push(net.to_string());
        }
        for net in &self.egress.cluster {
            args.push(CLUSTER_NETWORK_FLAG.to_owned());
            args.push(net.to_string());
        }
        args
    }

    /// Whether `source` may be read, and with what. `has_credentials`: the source names a
    /// Secret (in the reconciler) or the Secret gave something (in the reader).
    pub fn check(&self, source: &SourceSpec, has_credentials: bool) -> Result<Access, SourceError> {
        match source {
            SourceSpec::HuggingFace(hf) => {
                self.check_hub(hf)?;
                Ok(if has_credentials {
                    Access::Own
                } else {
                    Access::Anonymous
                })
            }
            SourceSpec::ObjectStore(os) => self.check_object_store(os, has_credentials),
            SourceSpec::Oci(oci) => {
                let endpoint = crate::oci::endpoint(oci)?;
                if endpoint.scheme() == "http" && !self.allow_http {
                    return Err(SourceError::Refused(format!(
                        "spec.source.oci: the registry {} is plain http: credentials or the \
                         layers could be read or changed on the way; use https (plain http is \
                         allowed only when the operator runs with {ALLOW_HTTP_FLAG})",
                        redact_url(endpoint.as_str())
                    )));
                }
                self.egress
                    .check_url(&endpoint)
                    .map_err(|e| SourceError::Refused(format!("spec.source.oci: {e}")))?;
                Ok(if has_credentials {
                    Access::Own
                } else {
                    Access::Anonymous
                })
            }
            SourceSpec::Upload => Err(SourceError::NotSyncable),
        }
    }

    fn check_hub(&self, hf: &HubRepo) -> Result<(), SourceError> {
        let endpoint = hub_endpoint(hf)?;
        if endpoint.scheme() == "http" && !self.allow_http {
            return Err(SourceError::Refused(format!(
                "spec.source.huggingFace.endpoint {} is plain http: a token or the downloaded \
                 files could be read or changed on the way; use https (plain http is allowed \
                 only when the operator runs with {ALLOW_HTTP_FLAG})",
                redact_url(endpoint.as_str())
            )));
        }
        self.egress
            .check_url(&endpoint)
            .map_err(|e| SourceError::Refused(format!("spec.source.huggingFace.endpoint: {e}")))
    }

    fn check_object_store(
        &self,
        os: &BucketPrefix,
        has_credentials: bool,
    ) -> Result<Access, SourceError> {
        let shown = redact_url(&os.url);
        let loc = Location::parse(&os.url, os.endpoint.as_deref(), "spec.source.objectStore")?;
        match loc.kind {
            Kind::Memory => {
                return Err(SourceError::Invalid(format!(
                    "spec.source.objectStore.url {shown}: memory:// is not a source; use s3://, gs://, az:// or https://"
                )));
            }
            Kind::File if !self.allow_file => {
                return Err(SourceError::Refused(format!(
                    "spec.source.objectStore.url {shown}: file:// sources read the sync \
                     process's own files and are refused (allowed only when the operator runs \
                     with {ALLOW_FILE_FLAG}); use an object store, or `sealed push` the directory"
                )));
            }
            _ => {}
        }
        if loc.plain_http && !self.allow_http {
            return Err(SourceError::Refused(format!(
                "spec.source.objectStore {shown}: the URL or endpoint is plain http, so \
                 credentials and data could be read or changed on the way; use https (plain \
                 http is allowed only when the operator runs with {ALLOW_HTTP_FLAG})"
            )));
        }
        for (field, raw) in [
            ("url", Some(os.url.as_str())),
            ("endpoint", os.endpoint.as_deref()),
        ] {
            // An http(s) URL's host (an s3:// URL's host is a bucket name).
            if let Some(url) = raw
                .and_then(|r| Url::parse(r).ok())
                .filter(|u| matches!(u.scheme(), "http" | "https"))
            {
                self.egress.check_url(&url).map_err(|e| {
                    SourceError::Refused(format!("spec.source.objectStore.{field}: {e}"))
                })?;
            }
        }
        if let Some(store) = &self.store_url {
            refuse_store(os, store)?;
        }
        if loc.kind == Kind::File {
            return Ok(Access::Anonymous);
        }
        if has_credentials {
            return Ok(Access::Own);
        }
        if self.ambient_admits(&loc) {
            return Ok(Access::Ambient);
        }
        Err(SourceError::CredentialsRequired(format!(
            "spec.source.objectStore.url {shown} names no credentialsSecretRef: a source is \
             read only with its own credentials. Create a Secret with the keys (e.g. \
             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), label it \
             sealedvolumes.io/source-credentials=true and set \
             spec.source.objectStore.credentialsSecretRef; or ask the cluster's admin to \
             allow-list the prefix for the operator's own identity ({AMBIENT_FLAG})"
        )))
    }

    fn ambient_admits(&self, loc: &Location) -> bool {
        self.ambient_allowed.iter().any(|entry| {
            Location::parse(entry, None, AMBIENT_FLAG).is_ok_and(|allowed| {
                allowed.kind == loc.kind
                    && allowed.endpoint == loc.endpoint
                    && allowed.bucket == loc.bucket
                    && loc.prefix.starts_with(&allowed.prefix)
            })
        })
    }
}

/// The Hub endpoint of `hf`, parsed and checked: http(s), a host, no user, password, query or
/// fragment.
pub(crate) fn hub_endpoint(hf: &HubRepo) -> Result<Url, SourceError> {
    let raw = hf
        .endpoint
        .as_deref()
        .filter(|e| !e.is_empty())
        .unwrap_or(DEFAULT_ENDPOINT);
    let bad = |why: &str| {
        SourceError::Invalid(format!(
            "spec.source.huggingFace.endpoint {:?} {why}",
            redact_url(raw)
        ))
    };
    let url = Url::parse(raw).map_err(|_| bad("is not an http(s) URL"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(bad("is not an http(s) URL"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(
            "must not carry a user or password (user:pass@): put a token in a Secret and name it in tokenSecretRef",
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("must not have a query or fragment"));
    }
    Ok(url)
}

/// Refuses an object-store source that is `store_url`, lies inside it or contains it.
pub(crate) fn refuse_store(os: &BucketPrefix, store_url: &str) -> Result<(), SourceError> {
    let Ok(store) = Location::parse_store(store_url) else {
        // Not a URL we can place (memory://, a test backend): nothing can overlap it.
        return Ok(());
    };
    let source = Location::parse(&os.url, os.endpoint.as_deref(), "spec.source.objectStore")?;
    if source.overlaps(&store) {
        return Err(SourceError::Refused(format!(
            "spec.source.objectStore.url {} is the store volumes are sealed into, or overlaps \
             it; a source must be outside the store",
            redact_url(&os.url)
        )));
    }
    Ok(())
}

/// Where a source's credentials are sent: the Hub endpoint's host, the object-store endpoint's
/// host, an https URL's host, or else the provider's canonical host (`s3.amazonaws.com`,
/// `storage.googleapis.com`, `<account>.blob.core.windows.net`). `None` for `file://`.
pub fn credential_target(
    source: &SourceSpec,
    azure_account: Option<&str>,
) -> Result<Option<Target>, SourceError> {
    match source {
        SourceSpec::HuggingFace(hf) => Ok(Target::of(&hub_endpoint(hf)?)),
        SourceSpec::Oci(oci) => Ok(Target::of(&crate::oci::endpoint(oci)?)),
        SourceSpec::ObjectStore(os) => {
            let loc = Location::parse(&os.url, os.endpoint.as_deref(), "spec.source.objectStore")?;
            if let Some(t) = loc.endpoint.as_deref().and_then(|e| Url::parse(e).ok()) {
                return Ok(Target::of(&t));
            }
            if let Some(t) = &loc.url_host {
                return Ok(Some(t.clone()));
            }
            let host = match loc.kind {
                Kind::S3 => "s3.amazonaws.com".to_owned(),
                Kind::Gcs => "storage.googleapis.com".to_owned(),
                Kind::Azure => match azure_account.filter(|a| !a.is_empty()) {
                    Some(a) => format!("{}.blob.core.windows.net", a.to_ascii_lowercase()),
                    None => "blob.core.windows.net".to_owned(),
                },
                Kind::File | Kind::Memory => return Ok(None),
            };
            Ok(Some(Target { host, port: None }))
        }
        SourceSpec::Upload => Ok(None),
    }
}

/// A host credentials go to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Lowercase host name or IP address.
    pub host: String,
    /// The port when the URL names one other than the scheme's default.
    pub port: Option<u16>,
}

impl Target {
    fn of(url: &Url) -> Option<Target> {
        Some(Target {
            host: url.host_str()?.to_ascii_lowercase(),
            port: url.port(),
        })
    }

    /// `host` or `host:port`, for messages.
    pub fn display(&self) -> String {
        match self.port {
            Some(p) => format!("{}:{p}", self.host),
            None => self.host.clone(),
        }
    }

    /// Whether an allowed-hosts entry admits this target: `host`, `host:port`, or
    /// `*.suffix` (any host under `suffix`, not `suffix` itself).
    pub fn allowed_by(&self, entry: &str) -> bool {
        let entry = entry.trim().to_ascii_lowercase();
        if entry.is_empty() {
            return false;
        }
        if let Some(suffix) = entry.strip_prefix("*.") {
            return self.host.ends_with(&format!(".{suffix}"));
        }
        entry == self.host || entry == self.display()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    S3,
    Gcs,
    Azure,
    File,
    Memory,
}

/// A source or store location, normalised for comparisons.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Location {
    kind: Kind,
    /// The API endpoint (origin and path, no trailing '/'), `None` for the provider's own.
    endpoint: Option<String>,
    /// The host of an https URL (the credentials' target when no endpoint is set).
    url_host: Option<Target>,
    /// Bucket or container (empty for `file://`).
    bucket: String,
    /// Key prefix (or directory path) as segments.
    prefix: Vec<String>,
    /// The URL or the endpoint is plain http.
    plain_http: bool,
}

impl Location {
    /// The store's location. Unlike a source's, its URL may name an Azure container as
    /// `abfss://container@account.dfs.core.windows.net/prefix`.
    fn parse_store(raw: &str) -> Result<Location, SourceError> {
        let url = Url::parse(raw).map_err(|e| SourceError::Invalid(e.to_string()))?;
        if matches!(url.scheme(), "abfs" | "abfss") && !url.username().is_empty() {
            let mut loc = Location::parse(
                &format!("az://{}{}", url.username(), url.path()),
                None,
                "store",
            )?;
            loc.url_host = Target::of(&url);
            return Ok(loc);
        }
        Location::parse(raw, None, "store")
    }

    /// A source's location (or an allow-list entry's): `raw` and the spec's `endpoint`.
    fn parse(raw: &str, endpoint: Option<&str>, field: &str) -> Result<Location, SourceError> {
        let shown = redact_url(raw);
        let bad = |why: String| SourceError::Invalid(format!("{field}: {shown}: {why}"));
        let url = Url::parse(raw).map_err(|e| bad(e.to_string()))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad(
                "a URL must not carry a user or password; put credentials in a Secret".into(),
            ));
        }
        let endpoint = match endpoint.map(str::trim).filter(|e| !e.is_empty()) {
            Some(e) => Some(normal_endpoint(e, field)?),
            None => None,
        };
        let segments = |path: &str| -> Result<Vec<String>, SourceError> {
            let mut out = Vec::new();
            for s in path.split('/').filter(|s| !s.is_empty()) {
                let s = percent_decode(s);
                if s == "." || s == ".." {
                    return Err(bad("'.' and '..' are not allowed in a prefix".into()));
                }
                out.push(s);
            }
            Ok(out)
        };
        let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
        let mut loc = Location {
            kind: Kind::S3,
            endpoint: endpoint.clone(),
            url_host: None,
            bucket: host.clone(),
            prefix: segments(url.path())?,
            plain_http: endpoint
                .as_deref()
                .is_some_and(|e| e.starts_with("http://")),
        };
        match url.scheme() {
            "s3" | "s3a" => {}
            "gs" => loc.kind = Kind::Gcs,
            "az" | "azure" | "adl" | "abfs" | "abfss" => loc.kind = Kind::Azure,
            "file" => {
                if !host.is_empty() && host != "localhost" {
                    return Err(bad("a file:// URL has no host: file:///path".into()));
                }
                loc.kind = Kind::File;
                loc.bucket = String::new();
            }
            "memory" => loc.kind = Kind::Memory,
            "http" | "https" => {
                let origin = url.origin().ascii_serialization();
                loc.plain_http |= url.scheme() == "http";
                loc.url_host = Target::of(&url);
                let mut parts = loc.prefix.clone();
                let path_style = |parts: &mut Vec<String>| -> Result<String, SourceError> {
                    if parts.is_empty() {
                        return Err(bad("name the bucket: https://host/bucket/prefix".into()));
                    }
                    Ok(parts.remove(0))
                };
                let azure = [
                    ".blob.core.windows.net",
                    ".dfs.core.windows.net",
                    ".blob.fabric.microsoft.com",
                    ".dfs.fabric.microsoft.com",
                ];
                if azure.iter().any(|s| host.ends_with(s)) {
                    loc.kind = Kind::Azure;
                    loc.bucket = path_style(&mut parts)?;
                    loc.endpoint = loc.endpoint.or(Some(origin));
                } else if host == "amazonaws.com" || host.ends_with(".amazonaws.com") {
                    // AWS itself: bucket names are global, so no endpoint to tell apart.
                    if host.starts_with("s3.") || host.starts_with("s3-") {
                        loc.bucket = path_style(&mut parts)?;
                    } else {
                        let cut = host
                            .find(".s3.")
                            .or_else(|| host.find(".s3-"))
                            .or_else(|| host.find('.'))
                            .unwrap_or(host.len());
                        loc.bucket = host[..cut].to_owned();
                    }
                } else {
                    // Any other https URL is an S3-compatible endpoint, path-style.
                    loc.bucket = path_style(&mut parts)?;
                    loc.endpoint = loc.endpoint.or(Some(origin));
                }
                loc.prefix = parts;
            }
            other => {
                return Err(bad(format!(
                    "{other}:// is not supported; use s3://, gs://, az://, https:// or file://"
                )));
            }
        }
        if matches!(loc.kind, Kind::S3 | Kind::Gcs | Kind::Azure) && loc.bucket.is_empty() {
            return Err(bad("name the bucket or container".into()));
        }
        Ok(loc)
    }

    fn is_cloud(&self) -> bool {
        matches!(self.kind, Kind::S3 | Kind::Gcs | Kind::Azure)
    }

    /// Whether this (a source) and `store` may name the same objects; see the module docs.
    fn overlaps(&self, store: &Location) -> bool {
        let prefixes = |a: &[String], b: &[String]| a.starts_with(b) || b.starts_with(a);
        match (self.kind, store.kind) {
            (Kind::Memory, _) | (_, Kind::Memory) => false,
            (Kind::File, Kind::File) => prefixes(&self.prefix, &store.prefix),
            (Kind::File, _) | (_, Kind::File) => false,
            _ => {
                // With an endpoint, any S3-compatible API may front any provider's bucket.
                let kind_matches = self.kind == store.kind
                    || (self.endpoint.is_some() && self.is_cloud() && store.is_cloud());
                if kind_matches
                    && self.bucket.eq_ignore_ascii_case(&store.bucket)
                    && prefixes(&self.prefix, &store.prefix)
                {
                    return true;
                }
                // Virtual-hosted style: https://<bucket>.host/<key> reaches bucket <bucket>
                // whatever the URL's path says.
                let Some(host) = self
                    .endpoint
                    .as_deref()
                    .and_then(|e| Url::parse(e).ok())
                    .and_then(|u| u.host_str().map(str::to_owned))
                else {
                    return false;
                };
                let label = host.split('.').next().unwrap_or_default();
                let mut keys = vec![self.bucket.clone()];
                keys.extend(self.prefix.iter().cloned());
                label.eq_ignore_ascii_case(&store.bucket) && prefixes(&keys, &store.prefix)
            }
        }
    }
}

/// An endpoint URL as `scheme://host[:port][/path]`, lowercase, without a trailing '/'.
fn normal_endpoint(raw: &str, field: &str) -> Result<String, SourceError> {
    let bad =
        |why: &str| SourceError::Invalid(format!("{field}.endpoint {:?} {why}", redact_url(raw)));
    let url = Url::parse(raw).map_err(|_| bad("is not an http(s) URL"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(bad("is not an http(s) URL"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(
            "must not carry a user or password (user:pass@): put credentials in the Secret named by credentialsSecretRef",
        ));
    }
    Ok(format!(
        "{}{}",
        url.origin().ascii_serialization(),
        url.path().trim_end_matches('/')
    ))
}

/// `%xx` escapes decoded (invalid ones kept as they are).
fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_else(|| s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::HubRepoType;

    fn os(url: &str, endpoint: Option<&str>) -> SourceSpec {
        SourceSpec::ObjectStore(BucketPrefix {
            url: url.into(),
            endpoint: endpoint.map(Into::into),
            region: None,
        })
    }

    fn hub(endpoint: Option<&str>) -> SourceSpec {
        SourceSpec::HuggingFace(HubRepo {
            repo: "org/model".into(),
            revision: "main".into(),
            repo_type: HubRepoType::Model,
            include: vec![],
            exclude: vec![],
            endpoint: endpoint.map(Into::into),
        })
    }

    fn store(url: &str) -> SourcePolicy {
        SourcePolicy::for_store(url, None)
    }

    fn reason(r: Result<Access, SourceError>) -> &'static str {
        match r {
            Ok(_) => "Ok",
            Err(e) => e.reason(),
        }
    }

    #[test]
    fn the_store_is_no_source() {
        let p = store("s3://sealed-store/prod");
        for (url, endpoint) in [
            ("s3://sealed-store/prod", None),
            ("s3://sealed-store/", None),
            ("s3://sealed-store", None),
            ("s3://sealed-store/prod/chunks", None),
            ("s3a://SEALED-STORE/prod/manifests/", None),
            // https path-style and virtual-hosted forms of the same bucket.
            ("https://s3.us-east-1.amazonaws.com/sealed-store/prod", None),
            (
                "https://sealed-store.s3.eu-west-1.amazonaws.com/prod/chunks",
                None,
            ),
            ("https://minio.example.com/sealed-store/prod/chunks", None),
            ("https://acct.r2.cloudflarestorage.com/sealed-store", None),
            // An endpoint does not make it another bucket (endpoints are ignored).
            (
                "s3://sealed-store/prod",
                Some("https://attacker.example.com"),
            ),
            (
                "gs://sealed-store/prod",
                Some("https://storage.example.com"),
            ),
            // The bucket smuggled in as a virtual-hosted endpoint.
            (
                "s3://prod/chunks",
                Some("https://sealed-store.s3.amazonaws.com"),
            ),
        ] {
            let err = p.check(&os(url, endpoint), true).unwrap_err();
            assert_eq!(err.reason(), "SourceRefused", "{url} {endpoint:?}: {err}");
            let msg = err.to_string();
            assert!(msg.contains("store"), "{msg}");
        }
        // Neighbours are fine: another bucket, a sibling prefix, another kind without endpoint.
        for (url, endpoint) in [
            ("s3://models/prod", None),
            ("s3://sealed-store/production", None),
            ("s3://sealed-store/other", None),
            ("gs://sealed-store/prod", None),
            ("https://minio.example.com/models/prod", None),
            ("s3://models/x", Some("https://minio.example.com")),
        ] {
            assert_eq!(
                reason(p.check(&os(url, endpoint), true)),
                "Ok",
                "{url} {endpoint:?}"
            );
        }
        // A store at the bucket's root overlaps every prefix of it.
        let root = store("az://models");
        assert_eq!(
            reason(root.check(&os("az://models/llama", None), true)),
            "SourceRefused"
        );
        assert_eq!(
            reason(root.check(
                &os("https://acct.blob.core.windows.net/models/llama", None),
                true
            )),
            "SourceRefused"
        );
        // The message never names the store's URL.
        let err = store("s3://secret-store-bucket/p")
            .check(&os("s3://secret-store-bucket/p/x", None), true)
            .unwrap_err()
            .to_string();
        assert_eq!(err.matches("secret-store-bucket").count(), 1, "{err}");
        // file:// stores and sources, when file sources are allowed at all.
        let mut files = store("file:///var/lib/sealed/store");
        files.allow_file = true;
        for url in [
            "file:///var/lib/sealed/store",
            "file:///var/lib/sealed",
            "file:///",
            "file:///var/lib/sealed/store/chunks",
        ] {
            assert_eq!(
                reason(files.check(&os(url, None), false)),
                "SourceRefused",
                "{url}"
            );
        }
        assert_eq!(
            reason(files.check(&os("file:///var/lib/sealed/models", None), false)),
            "Ok"
        );
        // The reader checks against the store it writes to as well.
        let source = BucketPrefix {
            url: "s3://b/p".into(),
            endpoint: None,
            region: None,
        };
        assert!(refuse_store(&source, "s3://b").is_err());
        assert!(refuse_store(&source, "memory://").is_ok());
        // An Azure store written container@account.
        let azure = SourcePolicy::for_store("abfss://models@acct.dfs.core.windows.net/sv", None);
        azure.validate().unwrap();
        assert_eq!(
            reason(azure.check(&os("az://models/sv/chunks", None), true)),
            "SourceRefused"
        );
        assert_eq!(
            reason(azure.check(&os("az://models/llama", None), true)),
            "Ok"
        );
    }

    #[test]
    fn file_and_http_need_their_flags() {
        let p = store("s3://store");
        let err = p.check(&os("file:///etc", None), false).unwrap_err();
        assert_eq!(err.reason(), "SourceRefused");
        assert!(err.to_string().contains(ALLOW_FILE_FLAG), "{err}");
        for (url, endpoint) in [
            ("http://127.0.0.1:9000/models/x", None),
            ("s3://models/x", Some("http://127.0.0.1:9000")),
        ] {
            let err = p.check(&os(url, endpoint), true).unwrap_err();
            assert_eq!(err.reason(), "SourceRefused", "{url}");
            assert!(err.to_string().contains(ALLOW_HTTP_FLAG), "{err}");
        }
        let err = p.check(&hub(Some("http://hub.local")), false).unwrap_err();
        assert_eq!(err.reason(), "SourceRefused");
        assert!(err.to_string().contains(ALLOW_HTTP_FLAG), "{err}");
        assert_eq!(reason(p.check(&hub(None), false)), "Ok");
        assert_eq!(
            reason(p.check(&hub(Some("https://hub.example.com")), false)),
            "Ok"
        );

        // Loopback is refused by address unless the admin allows it.
        let loopback = os("s3://models/x", Some("http://127.0.0.1:9000"));
        let err = SourcePolicy {
            allow_http: true,
            ..store("s3://store")
        }
        .check(&loopback, true)
        .unwrap_err();
        assert_eq!(err.reason(), "SourceRefused");
        assert!(err.to_string().contains(ALLOW_NETWORK_FLAG), "{err}");
        let open = SourcePolicy {
            allow_file: true,
            allow_http: true,
            egress: Egress::allowing(&["127.0.0.0/8"]).unwrap(),
            ..store("s3://store")
        };
        assert_eq!(
            open.check(&os("file:///data/models", None), false).unwrap(),
            Access::Anonymous
        );
        assert_eq!(
            open.check(&os("s3://models/x", Some("http://127.0.0.1:9000")), true)
                .unwrap(),
            Access::Own
        );
        assert_eq!(
            open.check(&hub(Some("http://hub.local")), false).unwrap(),
            Access::Anonymous
        );
    }

    #[test]
    fn credentials_required_unless_allow_listed() {
        let mut p = store("s3://store");
        let err = p.check(&os("s3://models/llama", None), false).unwrap_err();
        assert_eq!(err.reason(), "CredentialsRequired");
        assert!(err.to_string().contains("credentialsSecretRef"), "{err}");
        assert_eq!(
            p.check(&os("s3://models/llama", None), true).unwrap(),
            Access::Own
        );

        p.ambient_allowed = vec![
            "s3://public-models/".into(),
            "gs://open/datasets".into(),
            "https://minio.internal/shared/".into(),
        ];
        p.validate().unwrap();
        for (url, endpoint) in [
            ("s3://public-models/llama", None),
            ("s3://public-models", None),
            ("gs://open/datasets/wiki", None),
            ("https://minio.internal/shared/x", None),
            ("s3://shared/x", Some("https://minio.internal/")),
        ] {
            assert_eq!(
                p.check(&os(url, endpoint), false).unwrap(),
                Access::Ambient,
                "{url}"
            );
        }
        for (url, endpoint) in [
            // Another bucket that starts the same, another prefix, another kind.
            ("s3://public-models-private/x", None),
            ("gs://open/datasets-private", None),
            ("gs://open/other", None),
            ("az://public-models/x", None),
            // The allow-listed bucket at an attacker's endpoint: the ambient credentials would go there.
            (
                "s3://public-models/llama",
                Some("https://attacker.example.com"),
            ),
            ("https://attacker.example.com/public-models/llama", None),
        ] {
            assert_eq!(
                reason(p.check(&os(url, endpoint), false)),
                "CredentialsRequired",
                "{url} {endpoint:?}"
            );
        }
        // A Hub source without a token is fine.
        assert_eq!(p.check(&hub(None), false).unwrap(), Access::Anonymous);

        let bad = SourcePolicy {
            ambient_allowed: vec!["file:///".into()],
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = SourcePolicy {
            ambient_allowed: vec!["not a url".into()],
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn userinfo_is_refused_and_never_echoed() {
        let p = SourcePolicy {
            allow_http: true,
            ..store("s3://store")
        };
        let password = "hunter2-very-secret";
        for source in [
            hub(Some(&format!("https://user:{password}@hub.example.com"))),
            os(
                "s3://models/x",
                Some(&format!("https://key:{password}@minio.example.com")),
            ),
            os(&format!("s3://key:{password}@models/x"), None),
            os(
                &format!("https://key:{password}@minio.example.com/b/x"),
                None,
            ),
        ] {
            let err = p.check(&source, true).unwrap_err();
            assert_eq!(err.reason(), "InvalidSource", "{err}");
            let text = format!("{err} {err:?}");
            assert!(!text.contains(password), "{text}");
            assert!(text.contains("user or password"), "{text}");
        }
        let err = p
            .check(&hub(Some("https://hub.example.com/?token=abc")), false)
            .unwrap_err();
        assert_eq!(err.reason(), "InvalidSource");
        assert!(!err.to_string().contains("abc"), "{err}");
    }

    #[test]
    fn upload_and_bad_kinds() {
        let p = store("s3://store");
        assert_eq!(reason(p.check(&SourceSpec::Upload, false)), "NotSyncable");
        assert_eq!(
            reason(p.check(&os("memory:///", None), true)),
            "InvalidSource"
        );
        assert_eq!(
            reason(p.check(&os("ftp://host/x", None), true)),
            "InvalidSource"
        );
        // Dot segments are resolved (as the reader resolves them) before comparing: they
        // cannot dodge the overlap check.
        let p = store("s3://store/x");
        for url in ["s3://store/y/../x/z", "s3://store/y/%2e%2e/x"] {
            assert_eq!(
                reason(p.check(&os(url, None), true)),
                "SourceRefused",
                "{url}"
            );
        }
    }

    #[test]
    fn flags_round_trip() {
        let p = SourcePolicy {
            allow_file: true,
            allow_http: false,
            ambient_allowed: vec!["s3://a/".into(), "gs://b/c".into()],
            egress: Egress {
                allowed: Egress::parse_networks(&["10.1.0.0/16".into()], "f").unwrap(),
                cluster: Egress::parse_networks(&["34.118.224.0/20".into()], "f").unwrap(),
            },
            ..store("s3://store")
        };
        assert_eq!(
            p.to_args(),
            [
                ALLOW_FILE_FLAG,
                AMBIENT_FLAG,
                "s3://a/",
                AMBIENT_FLAG,
                "gs://b/c",
                ALLOW_NETWORK_FLAG,
                "10.1.0.0/16",
                CLUSTER_NETWORK_FLAG,
                "34.118.224.0/20"
            ]
        );
        assert!(SourcePolicy::default().to_args().is_empty());
    }

    #[test]
    fn credential_targets() {
        let target = |s: &SourceSpec, account: Option<&str>| {
            credential_target(s, account).unwrap().map(|t| t.display())
        };
        assert_eq!(target(&hub(None), None).as_deref(), Some("huggingface.co"));
        assert_eq!(
            target(&hub(Some("https://Hub.Example.com:8443/api")), None).as_deref(),
            Some("hub.example.com:8443")
        );
        assert_eq!(
            target(&os("s3://b/p", None), None).as_deref(),
            Some("s3.amazonaws.com")
        );
        assert_eq!(
            target(
                &os("s3://b/p", Some("https://acct.r2.cloudflarestorage.com")),
                None
            )
            .as_deref(),
            Some("acct.r2.cloudflarestorage.com")
        );
        assert_eq!(
            target(&os("https://minio.example.com:9000/b/p", None), None).as_deref(),
            Some("minio.example.com:9000")
        );
        assert_eq!(
            target(&os("gs://b/p", None), None).as_deref(),
            Some("storage.googleapis.com")
        );
        assert_eq!(
            target(&os("az://c/p", None), Some("MyAcct")).as_deref(),
            Some("myacct.blob.core.windows.net")
        );
        assert_eq!(target(&os("file:///x", None), None), None);

        let t = Target {
            host: "acct.blob.core.windows.net".into(),
            port: None,
        };
        assert!(t.allowed_by("*.blob.core.windows.net"));
        assert!(t.allowed_by(" ACCT.blob.core.windows.net "));
        assert!(!t.allowed_by("*.acct.blob.core.windows.net"));
        assert!(!t.allowed_by("blob.core.windows.net"));
        assert!(!t.allowed_by(""));
        let t = Target {
            host: "minio.example.com".into(),
            port: Some(9000),
        };
        assert!(t.allowed_by("minio.example.com"));
        assert!(t.allowed_by("minio.example.com:9000"));
        assert!(!t.allowed_by("minio.example.com:9001"));
        assert!(!t.allowed_by("example.com"));
    }
}
