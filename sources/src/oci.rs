//! A model in an OCI registry as a source (`oci://REGISTRY/REPO:TAG` or `@sha256:…`), over the
//! registry's pull API (OCI distribution spec):
//!
//! - `GET {endpoint}/v2/{repo}/manifests/{tag|digest}` → a manifest (or an index, whose entry
//!   for linux on this machine's architecture, or its only entry, is taken), read up to
//!   [`MAX_MANIFEST_BYTES`]; its SHA-256 is the source revision, and it must equal the digest
//!   the reference pinned.
//! - `GET {endpoint}/v2/{repo}/blobs/{digest}` → one layer, streamed through the ingest while
//!   its SHA-256 is computed; a layer whose bytes do not hash to its digest fails the sync
//!   naming the layer, and nothing is sealed (never a second read).
//! - A `401` with `WWW-Authenticate: Basic` is answered with the docker config's credentials for
//!   the registry; `Bearer realm=…` with a token from the realm (the credentials go there only
//!   over https or to the registry's own origin).
//!
//! Two kinds of object become a version:
//!
//! - **CNCF ModelPack artifacts** (`artifactType application/vnd.cncf.model.manifest.v1+json`,
//!   or a config of `application/vnd.cncf.model.config.v1+json`): every layer is one file at
//!   the path of its `org.cncf.model.filepath` annotation. A layer whose media type ends in
//!   `.raw` is the file's bytes; `.tar` / `.tar+gzip` is a tar archive whose entries must be
//!   that path or under it. Layers stream several at once.
//! - **Images**: the directory [`OciArtifact::path`] of the image's filesystem (the layers
//!   applied in order, with `.wh.` whiteouts and `.wh..wh..opq` opaque directories), relative
//!   to that directory. Layers are read top-down, one after the other: an entry an upper layer
//!   has, hides or replaced with a non-directory is skipped in the lower ones, which gives the
//!   same tree as applying them bottom-up, without holding anything on disk.
//!
//! Paths are checked before anything is stored: relative, no `..`, no absolute path, no
//! duplicates (ModelPack), at most [`MAX_LAYERS`] layers and [`SourceLimits::max_entries`]
//! tar entries. Hard links and devices in a layer are refused (a model directory has none).
//! Connections go through the guarded client of [`crate::egress`] as the other readers'.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use futures::{StreamExt, TryStreamExt};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderMap, WWW_AUTHENTICATE};
use sealed_store::ingest::Ingest;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, BufReader};
use tokio_util::io::StreamReader;
use url::Url;

use crate::credentials::SourceCredentials;
use crate::download::{RemoteFile, Tap, backoff, send_failure, short, size_mismatch};
use crate::egress::{GuardedResolver, refused_in};
use crate::error::SourceError;
use crate::limits::{
    BodyError, MAX_ERROR_BODY_BYTES, MAX_METADATA_BYTES, read_capped, read_prefix,
};
use crate::options::SyncOptions;
use crate::progress::SyncReporter;
use crate::redact::{error_chain, redact, redact_url};
use crate::spec::OciArtifact;

/// Most bytes of a manifest or index (the distribution spec's registries refuse more than
/// 4 MiB).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Most layers of one manifest (a ModelPack artifact has one a file).
pub const MAX_LAYERS: usize = 10_000;
/// Redirects followed at most (a registry sends blobs to its storage).
const MAX_REDIRECTS: usize = 10;

/// The ModelPack artifact type and config media type.
pub const MODELPACK_ARTIFACT_TYPE: &str = "application/vnd.cncf.model.manifest.v1+json";
pub const MODELPACK_CONFIG_TYPE: &str = "application/vnd.cncf.model.config.v1+json";
/// The annotation of a ModelPack layer naming its file's path.
pub const FILEPATH_ANNOTATION: &str = "org.cncf.model.filepath";

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// A parsed `REGISTRY/REPO[:TAG][@sha256:HEX]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 lowercase hex>`.
    pub digest: Option<String>,
}

impl Reference {
    /// Parses a reference; an `oci://` prefix is accepted. The registry is always written
    /// (`docker.io/library/x`, not `x`), so nothing is guessed.
    pub fn parse(raw: &str) -> Result<Reference, SourceError> {
        let bad = |why: &str| SourceError::Invalid(format!("spec.source.oci.ref {raw:?} {why}"));
        let s = raw.strip_prefix("oci://").unwrap_or(raw);
        if s.len() > 1024 {
            return Err(bad("is longer than 1024 characters"));
        }
        let (name, digest) = match s.split_once('@') {
            Some((n, d)) => (n, Some(d)),
            None => (s, None),
        };
        if let Some(d) = digest
            && !is_sha256_digest(d)
        {
            return Err(bad("has a digest that is not sha256:<64 lowercase hex>"));
        }
        let (registry, rest) = name
            .split_once('/')
            .ok_or_else(|| bad("names no repository: write REGISTRY/REPO:TAG"))?;
        let valid_host = !registry.is_empty()
            && registry.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']')
            })
            && Url::parse(&format!("https://{registry}/")).is_ok_and(|u| u.host().is_some());
        if !valid_host {
            return Err(bad("has no registry host: write REGISTRY/REPO:TAG"));
        }
        // The tag follows the last ':' after the last '/'.
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let at = last_slash + i;
                (&rest[..at], Some(&rest[at + 1..]))
            }
            None => (rest, None),
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
                })
                && c.as_bytes()[0].is_ascii_alphanumeric()
                && c.as_bytes()[c.len() - 1].is_ascii_alphanumeric()
        };
        if repository.len() > 255 || !repository.split('/').all(component_ok) {
            return Err(bad(
                "has a repository that is not lowercase letters, digits and . _ - between slashes",
            ));
        }
        if let Some(t) = tag {
            let ok = !t.is_empty()
                && t.len() <= 128
                && (t.as_bytes()[0].is_ascii_alphanumeric() || t.as_bytes()[0] == b'_')
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if !ok {
                return Err(bad(
                    "has a tag that is not [A-Za-z0-9_][A-Za-z0-9._-]{0,127}",
                ));
            }
        }
        let tag = match (tag, digest) {
            (None, None) => Some("latest".to_owned()),
            (t, _) => t.map(str::to_owned),
        };
        Ok(Reference {
            registry: registry.to_ascii_lowercase(),
            repository: repository.to_owned(),
            tag,
            digest: digest.map(str::to_owned),
        })
    }

    /// What a manifest request names: the digest when pinned, else the tag.
    fn manifest_ref(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oci://{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The registry's API base: `spec.source.oci.endpoint`, or `https://REGISTRY`. http(s), a
/// host, no user, password, query or fragment.
pub(crate) fn endpoint(src: &OciArtifact) -> Result<Url, SourceError> {
    let reference = Reference::parse(&src.reference)?;
    let raw = match src.endpoint.as_deref().filter(|e| !e.is_empty()) {
        Some(e) => e.to_owned(),
        None => format!("https://{}", reference.registry),
    };
    let bad = |why: &str| {
        SourceError::Invalid(format!(
            "spec.source.oci.endpoint {:?} {why}",
            redact_url(&raw)
        ))
    };
    let url = Url::parse(&raw).map_err(|_| bad("is not an http(s) URL"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(bad("is not an http(s) URL"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(
            "must not carry a user or password: put them in a kubernetes.io/dockerconfigjson Secret",
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("must not have a query or fragment"));
    }
    Ok(url)
}

/// The docker config's secrets (passwords, `auth` values and what they decode to), for
/// scrubbing messages.
pub(crate) fn docker_config_secrets(config: &str) -> Vec<String> {
    let Ok(parsed) = serde_json::from_str::<DockerConfig>(config) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in parsed.auths.into_values() {
        if let Some(auth) = entry.auth {
            if let Some((_, pass)) = decode_auth(&auth) {
                out.push(pass);
            }
            out.push(auth);
        }
        out.extend(entry.password);
        out.extend(entry.identitytoken);
    }
    out
}

#[derive(Deserialize, Default)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    identitytoken: Option<String>,
}

fn decode_auth(auth: &str) -> Option<(String, String)> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let (user, pass) = text.split_once(':')?;
    Some((user.to_owned(), pass.to_owned()))
}

/// The `user:password` of `registry` in a docker config JSON. Keys are matched as docker
/// does: `host[:port]`, with or without a scheme and a `/v1/`-style path.
fn registry_credentials(
    config: &str,
    registry: &str,
) -> Result<Option<(String, String)>, SourceError> {
    let parsed: DockerConfig = serde_json::from_str(config).map_err(|e| {
        SourceError::InvalidCredentials {
            url: format!("oci://{registry}"),
            detail: format!(
                "the pull secret is not docker config JSON ({{\"auths\": {{...}}}}): line {}, column {}",
                e.line(),
                e.column()
            ),
        }
    })?;
    let host_of = |key: &str| {
        let k = key
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        k.split('/').next().unwrap_or(k).to_ascii_lowercase()
    };
    let Some(entry) = parsed
        .auths
        .into_iter()
        .find(|(k, _)| host_of(k) == registry)
        .map(|(_, v)| v)
    else {
        return Ok(None);
    };
    if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
        return Ok(Some((u.clone(), p.clone())));
    }
    match entry.auth.as_deref().map(decode_auth) {
        Some(Some(pair)) => Ok(Some(pair)),
        Some(None) => Err(SourceError::InvalidCredentials {
            url: format!("oci://{registry}"),
            detail: "the pull secret's auth for the registry is not base64 of user:password".into(),
        }),
        None => Ok(None),
    }
}

/// A descriptor: a manifest's config or layer, an index's manifest.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Clone, Debug, Deserialize)]
struct Platform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    artifact_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

/// How a layer's bytes are packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Packing {
    Raw,
    Tar,
    TarGzip,
}

fn packing(media_type: &str) -> Result<Packing, String> {
    let m = media_type.to_ascii_lowercase();
    if m.ends_with(".raw") {
        Ok(Packing::Raw)
    } else if m.ends_with("+gzip")
        || m.ends_with(".tar.gzip")
        || m == "application/vnd.docker.image.rootfs.diff.tar.gzip"
    {
        Ok(Packing::TarGzip)
    } else if m.ends_with(".tar") || m == "application/vnd.docker.image.rootfs.diff.tar" {
        Ok(Packing::Tar)
    } else {
        Err(format!(
            "media type {media_type:?} is not a raw, tar or tar+gzip layer (zstd and foreign \
             layers are not read yet)"
        ))
    }
}

/// One layer to stream.
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    digest: String,
    size: u64,
    packing: Packing,
    /// ModelPack: the file's path (a raw layer) or the path the tar's entries live at.
    path: Option<String>,
}

/// What a resolved reference is, and the layers to stream.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// ModelPack layers stream several at once; image layers top-down, one at a time.
    modelpack: bool,
    layers: Vec<Layer>,
}

impl Plan {
    pub fn layers(&self) -> u64 {
        self.layers.len() as u64
    }

    /// The sum of the layer sizes (what the registry will send).
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .fold(0u64, |sum, l| sum.saturating_add(l.size))
    }
}

pub(crate) struct OciSource {
    http: reqwest::Client,
    endpoint: Url,
    reference: Reference,
    /// The directory of an image to take, without leading or trailing `/`; `Some("")` for
    /// the whole filesystem.
    path: Option<String>,
    credentials: Option<(String, String)>,
    /// The bearer token a realm gave (or `Basic …` once a registry asked for it).
    authorization: Mutex<Option<String>>,
    retries: u32,
    max_entries: u64,
    secrets: Vec<String>,
}

impl OciSource {
    pub(crate) fn open(
        src: &OciArtifact,
        creds: &SourceCredentials,
        opts: &SyncOptions,
    ) -> Result<OciSource, SourceError> {
        let reference = Reference::parse(&src.reference)?;
        let endpoint = endpoint(src)?;
        let path = match src.path.as_deref() {
            None => None,
            Some(p) => Some(image_dir(p)?),
        };
        let credentials = match creds.docker_config.as_deref().filter(|c| !c.is_empty()) {
            Some(config) => registry_credentials(config, &reference.registry)?,
            None => None,
        };
        let egress = Arc::new(opts.policy.egress.clone());
        let hops = egress.clone();
        let http = reqwest::Client::builder()
            .connect_timeout(opts.timeout)
            .read_timeout(opts.timeout)
            .user_agent(concat!("sealed-volumes/", env!("CARGO_PKG_VERSION")))
            .no_proxy()
            .dns_resolver(Arc::new(GuardedResolver::new(egress)))
            // Blobs redirect to the registry's storage: every hop's address is checked, never
            // https to http. reqwest drops Authorization when the host or port changes.
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.url().scheme() != "https"
                    && attempt.previous().iter().any(|u| u.scheme() == "https")
                {
                    let scheme = attempt.url().scheme().to_owned();
                    return attempt.error(format!("redirect from https to {scheme} refused"));
                }
                if attempt.previous().len() >= MAX_REDIRECTS {
                    return attempt.error(format!("more than {MAX_REDIRECTS} redirects"));
                }
                match hops.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(refused) => attempt.error(refused),
                }
            }))
            .build()
            .map_err(|e| SourceError::Invalid(format!("HTTP client: {e}")))?;
        Ok(OciSource {
            http,
            endpoint,
            reference,
            path,
            credentials,
            authorization: Mutex::new(None),
            retries: opts.retries,
            max_entries: opts.limits.max_entries,
            secrets: creds.secrets(),
        })
    }

    pub(crate) fn describe(&self) -> String {
        self.reference.to_string()
    }

    fn url(&self, segments: &[&str]) -> Result<Url, SourceError> {
        let mut url = self.endpoint.clone();
        url.path_segments_mut()
            .map_err(|_| SourceError::Invalid(format!("endpoint {} has no path", self.endpoint)))?
            .pop_if_empty()
            .push("v2")
            .extend(self.reference.repository.split('/'))
            .extend(segments);
        Ok(url)
    }

    /// The digest of the manifest the reference names now (the source revision), without
    /// reading a layer.
    pub(crate) async fn resolve(&self) -> Result<String, SourceError> {
        Ok(self.fetch_manifest(self.reference.manifest_ref()).await?.0)
    }

    /// Resolves the reference and plans what to stream: the revision is the digest of the
    /// manifest (or index) the reference names.
    pub(crate) async fn plan(&self) -> Result<(String, Plan), SourceError> {
        let (digest, mut manifest) = self.fetch_manifest(self.reference.manifest_ref()).await?;
        if is_index(&manifest) {
            let chosen = choose_platform(&manifest.manifests)
                .ok_or_else(|| {
                    self.protocol(format!(
                        "{digest} is an index of {} manifests and none is for linux/{}; pin the \
                     platform's manifest digest",
                        manifest.manifests.len(),
                        arch()
                    ))
                })?
                .digest
                .clone();
            let (_, inner) = self.fetch_manifest(&chosen).await?;
            if is_index(&inner) {
                return Err(self.protocol(format!("{chosen} is an index inside an index")));
            }
            manifest = inner;
        }
        if manifest.layers.len() > MAX_LAYERS {
            return Err(SourceError::TooLarge {
                what: self.describe(),
                detail: format!(
                    "the manifest has {} layers, more than {MAX_LAYERS}",
                    manifest.layers.len()
                ),
            });
        }
        let modelpack = manifest.artifact_type.as_deref() == Some(MODELPACK_ARTIFACT_TYPE)
            || manifest
                .config
                .as_ref()
                .is_some_and(|c| c.media_type == MODELPACK_CONFIG_TYPE);
        let mut layers = Vec::with_capacity(manifest.layers.len());
        let mut paths = BTreeSet::new();
        for l in &manifest.layers {
            if !is_sha256_digest(&l.digest) {
                return Err(self.protocol(format!(
                    "layer {:?} has no sha256:<64 hex> digest",
                    l.digest
                )));
            }
            let packing = packing(&l.media_type)
                .map_err(|d| self.protocol(format!("layer {}: {d}", l.digest)))?;
            let path = if modelpack {
                let raw = l.annotations.get(FILEPATH_ANNOTATION).ok_or_else(|| {
                    self.protocol(format!(
                        "ModelPack layer {} has no {FILEPATH_ANNOTATION} annotation",
                        l.digest
                    ))
                })?;
                let p = clean_path(raw).map_err(|why| {
                    SourceError::Invalid(format!(
                        "{}: layer {} path {raw:?} {why}",
                        self.describe(),
                        l.digest
                    ))
                })?;
                if !paths.insert(p.clone()) {
                    return Err(SourceError::Invalid(format!(
                        "{}: layer {} names path {p:?}, which another layer has too",
                        self.describe(),
                        l.digest
                    )));
                }
                Some(p)
            } else {
                if packing == Packing::Raw {
                    return Err(
                        self.protocol(format!("layer {} of an image is not a tar layer", l.digest))
                    );
                }
                None
            };
            layers.push(Layer {
                digest: l.digest.clone(),
                size: l.size,
                packing,
                path,
            });
        }
        if modelpack && self.path.is_some() {
            return Err(SourceError::Invalid(format!(
                "{} is a ModelPack artifact: spec.source.oci.path (--oci-path) applies to images only",
                self.describe()
            )));
        }
        if !modelpack && self.path.is_none() {
            return Err(SourceError::Invalid(format!(
                "{} is an image, not a ModelPack artifact: set spec.source.oci.path (--oci-path) \
                 to the directory of its filesystem that holds the model, e.g. /models",
                self.describe()
            )));
        }
        if layers.is_empty() {
            return Err(SourceError::NoFiles {
                what: format!("{}@{digest}", self.describe()),
                detail: "the manifest has no layers".into(),
            });
        }
        Ok((digest, Plan { modelpack, layers }))
    }

    /// Streams every layer of `plan` into `ingest`.
    pub(crate) async fn stream(
        &self,
        ingest: &Ingest,
        plan: &Plan,
        parallel: usize,
        progress: &Arc<dyn SyncReporter>,
    ) -> Result<(), SourceError> {
        if plan.modelpack {
            futures::stream::iter(plan.layers.iter().map(Ok))
                .try_for_each_concurrent(parallel.max(1), |layer| async move {
                    match layer.packing {
                        Packing::Raw => self.fetch_raw(ingest, layer, progress).await?,
                        _ => {
                            let mut tree = Tree::default();
                            self.fetch_tar(ingest, layer, &mut tree, progress).await?;
                        }
                    }
                    if let Some(p) = &layer.path {
                        progress.file_done(p, layer.size);
                    }
                    Ok::<_, SourceError>(())
                })
                .await
        } else {
            let mut tree = Tree::default();
            for layer in plan.layers.iter().rev() {
                self.fetch_tar(ingest, layer, &mut tree, progress).await?;
                tree.end_layer();
            }
            if tree.files == 0 {
                return Err(SourceError::NoFiles {
                    what: self.describe(),
                    detail: format!(
                        "the image has nothing under /{}",
                        self.path.as_deref().unwrap_or_default()
                    ),
                });
            }
            Ok(())
        }
    }

    /// A raw ModelPack layer: the file's bytes, retried when the download broke off.
    async fn fetch_raw(
        &self,
        ingest: &Ingest,
        layer: &Layer,
        progress: &Arc<dyn SyncReporter>,
    ) -> Result<(), SourceError> {
        let path = layer.path.clone().unwrap_or_default();
        let file = RemoteFile {
            path: path.clone(),
            key: layer.digest.clone(),
            size: layer.size,
            sha256: layer.digest.strip_prefix("sha256:").map(str::to_owned),
            git_oid: None,
            etag: None,
        };
        let mut attempt = 0;
        loop {
            let resp = self.blob(&layer.digest).await?;
            let body = resp.bytes_stream().map_err(std::io::Error::other);
            let mut tap = Tap::new(StreamReader::new(Box::pin(body)), layer.size);
            let added = ingest
                .add_file(&file.path, false, Some(file.size), &mut tap)
                .await;
            match added {
                Ok(_) => return self.check_layer(layer, tap.finish().sha256),
                Err(_) if tap.overflowed => {
                    return Err(self.protocol(format!(
                        "layer {}: {}",
                        layer.digest,
                        tap.overflow_detail()
                    )));
                }
                Err(e) if (tap.failed || short(&e)) && attempt < self.retries => {
                    attempt += 1;
                    tracing::warn!(source = %self.describe(), layer = %layer.digest, attempt,
                        error = %redact(&e.to_string(), &self.secrets), "layer download broke off; retrying");
                    progress.retry(&path);
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(e) if tap.failed => {
                    return Err(SourceError::Unavailable {
                        what: format!("{} layer {}", self.describe(), layer.digest),
                        detail: redact(&error_chain(&e), &self.secrets),
                    });
                }
                Err(sealed_store::Error::FileChanged { .. }) => {
                    return Err(SourceError::SourceChanged {
                        what: format!("{} layer {}", self.describe(), layer.digest),
                        path,
                        detail: size_mismatch(layer.size),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn check_layer(&self, layer: &Layer, actual: String) -> Result<(), SourceError> {
        if layer.digest.strip_prefix("sha256:") == Some(actual.as_str()) {
            return Ok(());
        }
        Err(SourceError::IntegrityMismatch {
            what: format!("{} layer {}", self.describe(), layer.digest),
            path: layer
                .path
                .clone()
                .unwrap_or_else(|| format!("layer {}", layer.digest)),
            expected: layer.digest.clone(),
            actual: format!("sha256:{actual}"),
        })
    }

    /// A tar layer (a ModelPack tar layer, or an image layer): every wanted entry streams
    /// into the ingest while the layer's bytes are hashed; the rest of the layer is read
    /// through so the hash covers all of it. Not retried: entries may already be recorded,
    /// the sync fails and the next one starts over.
    async fn fetch_tar(
        &self,
        ingest: &Ingest,
        layer: &Layer,
        tree: &mut Tree,
        progress: &Arc<dyn SyncReporter>,
    ) -> Result<(), SourceError> {
        let resp = self.blob(&layer.digest).await?;
        let body = resp.bytes_stream().map_err(std::io::Error::other);
        let mut tap = Tap::new(StreamReader::new(Box::pin(body)), layer.size);
        let what = || format!("{} layer {}", self.describe(), layer.digest);
        let result = {
            let reader: Box<dyn AsyncRead + Unpin + Send + '_> = match layer.packing {
                Packing::TarGzip => Box::new(async_compression::tokio::bufread::GzipDecoder::new(
                    BufReader::new(&mut tap),
                )),
                _ => Box::new(&mut tap),
            };
            self.entries(ingest, layer, reader, tree, progress).await
        };
        if let Err(e) = result {
            if tap.overflowed {
                return Err(self.protocol(format!(
                    "layer {}: {}",
                    layer.digest,
                    tap.overflow_detail()
                )));
            }
            return Err(e);
        }
        // The tar's end blocks and padding, and whatever follows: hashed too.
        let mut sink = [0u8; 64 << 10];
        loop {
            match tap.read(&mut sink).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(_) if tap.overflowed => {
                    return Err(self.protocol(format!(
                        "layer {}: {}",
                        layer.digest,
                        tap.overflow_detail()
                    )));
                }
                Err(e) => {
                    return Err(SourceError::Unavailable {
                        what: what(),
                        detail: redact(&error_chain(&e), &self.secrets),
                    });
                }
            }
        }
        if tap.bytes_read() != layer.size {
            return Err(SourceError::SourceChanged {
                what: what(),
                path: format!("layer {}", layer.digest),
                detail: size_mismatch(layer.size),
            });
        }
        self.check_layer(layer, tap.finish().sha256)
    }

    async fn entries<R: AsyncRead + Unpin + Send>(
        &self,
        ingest: &Ingest,
        layer: &Layer,
        reader: R,
        tree: &mut Tree,
        progress: &Arc<dyn SyncReporter>,
    ) -> Result<(), SourceError> {
        use tokio_tar::EntryType;
        let what = || format!("{} layer {}", self.describe(), layer.digest);
        let bad_tar = |e: std::io::Error| SourceError::Protocol {
            what: what(),
            detail: format!(
                "not a readable tar{}: {}",
                if layer.packing == Packing::TarGzip {
                    " (gzip)"
                } else {
                    ""
                },
                redact(&error_chain(&e), &self.secrets)
            ),
        };
        let mut archive = tokio_tar::Archive::new(reader);
        let mut entries = archive.entries().map_err(bad_tar)?;
        while let Some(entry) = entries.next().await {
            let mut entry = entry.map_err(bad_tar)?;
            tree.entries = tree.entries.saturating_add(1);
            if tree.entries > self.max_entries {
                return Err(SourceError::TooLarge {
                    what: what(),
                    detail: format!("more than {} tar entries", self.max_entries),
                });
            }
            let raw_path = entry.path_bytes().map_err(bad_tar)?.into_owned();
            let raw_path = String::from_utf8(raw_path).map_err(|_| SourceError::Protocol {
                what: what(),
                detail: "a tar entry's path is not UTF-8".into(),
            })?;
            let kind = entry.header().entry_type();
            let trimmed = raw_path.trim_start_matches("./").trim_start_matches('/');
            let trimmed = trimmed.trim_end_matches('/');
            if trimmed.is_empty() || trimmed == "." {
                continue;
            }
            let full = clean_path(trimmed).map_err(|why| SourceError::Protocol {
                what: what(),
                detail: format!("tar entry {raw_path:?} {why}"),
            })?;
            // Whiteouts (images only).
            let (parent, name) = match full.rsplit_once('/') {
                Some((p, n)) => (p, n),
                None => ("", full.as_str()),
            };
            if layer.path.is_none() && name.starts_with(".wh.") {
                if name == ".wh..wh..opq" {
                    tree.pending_opaque.push(parent.to_owned());
                } else {
                    let hidden = &name[".wh.".len()..];
                    let hidden = if parent.is_empty() {
                        hidden.to_owned()
                    } else {
                        format!("{parent}/{hidden}")
                    };
                    tree.pending_whiteouts.push(hidden);
                }
                continue;
            }
            if tree.hidden(&full) {
                continue;
            }
            let is_dir = matches!(kind, EntryType::Directory);
            tree.record(&full, is_dir);
            // Where it lands in the version.
            let dest = match (&layer.path, &self.path) {
                (Some(annotated), _) => {
                    if full != *annotated && !full.starts_with(&format!("{annotated}/")) {
                        return Err(SourceError::Protocol {
                            what: what(),
                            detail: format!(
                                "tar entry {full:?} is outside the layer's path {annotated:?}"
                            ),
                        });
                    }
                    full.clone()
                }
                (None, Some(dir)) if dir.is_empty() => full.clone(),
                (None, Some(dir)) => match full
                    .strip_prefix(dir.as_str())
                    .and_then(|r| r.strip_prefix('/'))
                {
                    Some(rel) => rel.to_owned(),
                    None => continue,
                },
                (None, None) => continue,
            };
            match kind {
                EntryType::Directory => ingest.add_dir(&dest)?,
                EntryType::Regular | EntryType::Continuous => {
                    let size = entry.effective_size();
                    let mode = entry.header().mode().unwrap_or(0o644);
                    ingest
                        .add_file(&dest, mode & 0o111 != 0, Some(size), &mut entry)
                        .await
                        .map_err(|e| match e {
                            sealed_store::Error::Io { .. } => SourceError::Unavailable {
                                what: what(),
                                detail: redact(&error_chain(&e), &self.secrets),
                            },
                            other => other.into(),
                        })?;
                    tree.files = tree.files.saturating_add(1);
                    progress.file_done(&dest, size);
                }
                EntryType::Symlink => {
                    let target = entry
                        .link_name_bytes()
                        .ok()
                        .flatten()
                        .map(|t| String::from_utf8_lossy(&t).into_owned())
                        .unwrap_or_default();
                    ingest.add_symlink(&dest, &target)?;
                }
                other => {
                    return Err(SourceError::Protocol {
                        what: what(),
                        detail: format!(
                            "tar entry {full:?} is a {other:?}; hard links, devices and fifos are not read"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// A manifest or index: its digest (checked against the one asked for or announced) and
    /// its content.
    async fn fetch_manifest(&self, reference: &str) -> Result<(String, Manifest), SourceError> {
        let url = self.url(&["manifests", reference])?;
        let accept = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST].join(", ");
        let resp = self.get(url, Some(&accept), "the manifest").await?;
        let announced = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(|s| s.trim().to_ascii_lowercase());
        let body = match read_capped(resp, MAX_MANIFEST_BYTES).await {
            Ok(b) => b,
            Err(BodyError::TooLarge) => {
                return Err(SourceError::TooLarge {
                    what: self.describe(),
                    detail: format!("the manifest is larger than {MAX_MANIFEST_BYTES} bytes"),
                });
            }
            Err(BodyError::Http(e)) => {
                return Err(SourceError::Unavailable {
                    what: format!("{} (the manifest)", self.describe()),
                    detail: redact(&error_chain(&e), &self.secrets),
                });
            }
        };
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        if reference.starts_with("sha256:") && reference != digest {
            return Err(SourceError::IntegrityMismatch {
                what: self.describe(),
                path: "the manifest".into(),
                expected: reference.to_owned(),
                actual: digest,
            });
        }
        if let Some(a) = announced.filter(|a| a.starts_with("sha256:"))
            && a != digest
        {
            return Err(SourceError::IntegrityMismatch {
                what: self.describe(),
                path: "the manifest".into(),
                expected: a,
                actual: digest,
            });
        }
        let manifest: Manifest = serde_json::from_slice(&body)
            .map_err(|e| self.protocol(format!("the manifest is not OCI manifest JSON: {e}")))?;
        if let Some(mt) = &manifest.media_type
            && ![OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST].contains(&mt.as_str())
        {
            return Err(self.protocol(format!("manifest media type {mt:?} is not read")));
        }
        if manifest.manifests.len() > MAX_LAYERS {
            return Err(SourceError::TooLarge {
                what: self.describe(),
                detail: format!("the index has more than {MAX_LAYERS} manifests"),
            });
        }
        Ok((digest, manifest))
    }

    async fn blob(&self, digest: &str) -> Result<reqwest::Response, SourceError> {
        let url = self.url(&["blobs", digest])?;
        self.get(url, None, &format!("layer {digest}")).await
    }

    /// A GET with the registry's authorization, answering one `401` challenge, retried with
    /// backoff on connection errors, 429 and 5xx.
    async fn get(
        &self,
        url: Url,
        accept: Option<&str>,
        what: &str,
    ) -> Result<reqwest::Response, SourceError> {
        let mut attempt = 0;
        let mut challenged = false;
        loop {
            let mut req = self.http.get(url.clone());
            if let Some(a) = accept {
                req = req.header(ACCEPT, a);
            }
            let auth = self.authorization.lock().ok().and_then(|a| a.clone());
            if let Some(a) = &auth {
                req = req.header(AUTHORIZATION, a);
            }
            let failure = match req.send().await {
                Ok(resp) if resp.status().is_success() => return Ok(resp),
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !challenged => {
                    challenged = true;
                    let header = challenge(resp.headers());
                    let authorization = self.answer(header.as_deref()).await?;
                    if let Ok(mut a) = self.authorization.lock() {
                        *a = Some(authorization);
                    }
                    continue;
                }
                Ok(resp) => {
                    let status = resp.status();
                    if !(status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS)
                        || attempt >= self.retries
                    {
                        return Err(self.status_error(resp, what).await);
                    }
                    format!("HTTP {status}")
                }
                Err(e) => send_failure(
                    &e,
                    &format!("{} ({what})", self.describe()),
                    &self.secrets,
                    attempt >= self.retries,
                )?,
            };
            attempt += 1;
            tracing::debug!(source = %self.describe(), what, attempt, failure = %failure, "retrying");
            tokio::time::sleep(backoff(attempt)).await;
        }
    }

    /// The `Authorization` value that answers a registry's challenge.
    async fn answer(&self, challenge: Option<&str>) -> Result<String, SourceError> {
        let denied = |detail: String| SourceError::AccessDenied {
            what: self.describe(),
            detail,
        };
        let no_creds = || {
            denied(
                "the registry asks for credentials: name a kubernetes.io/dockerconfigjson \
                 Secret with an entry for the registry"
                    .into(),
            )
        };
        let basic = |(u, p): &(String, String)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        };
        let Some(challenge) = challenge else {
            return Err(denied(
                "HTTP 401 without a WWW-Authenticate challenge".into(),
            ));
        };
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return self.credentials.as_ref().map(basic).ok_or_else(no_creds);
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(denied(format!("unknown authentication scheme {scheme:?}")));
        }
        let params = challenge_params(params);
        let realm = params
            .get("realm")
            .ok_or_else(|| denied("a Bearer challenge without a realm".into()))?;
        let mut realm = Url::parse(realm)
            .map_err(|_| denied(format!("the token realm {realm:?} is not a URL")))?;
        {
            let mut q = realm.query_pairs_mut();
            if let Some(service) = params.get("service") {
                q.append_pair("service", service);
            }
            q.append_pair(
                "scope",
                &format!("repository:{}:pull", self.reference.repository),
            );
        }
        let mut req = self.http.get(realm.clone());
        // The pull secret goes to the realm only over https or at the registry's own origin.
        if let Some(c) = &self.credentials
            && (realm.scheme() == "https" || realm.origin() == self.endpoint.origin())
        {
            req = req.header(AUTHORIZATION, basic(c));
        }
        let resp = req.send().await.map_err(|e| match refused_in(&e) {
            Some(r) => SourceError::Refused(format!("{} (token realm): {r}", self.describe())),
            None => SourceError::Unavailable {
                what: format!("{} (token realm)", self.describe()),
                detail: redact(&error_chain(&e), &self.secrets),
            },
        })?;
        if !resp.status().is_success() {
            return Err(denied(format!(
                "the token realm {} answered HTTP {}{}",
                redact_url(realm.as_str()),
                resp.status(),
                if self.credentials.is_some() {
                    "; check the pull secret's credentials for the registry"
                } else {
                    "; the repository may be private: name a pull secret"
                }
            )));
        }
        #[derive(Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let body = read_capped(resp, MAX_METADATA_BYTES)
            .await
            .map_err(|_| denied("the token realm's answer is unreadable or too large".into()))?;
        let token: Token = serde_json::from_slice(&body)
            .map_err(|_| denied("the token realm's answer is not JSON".into()))?;
        token
            .token
            .or(token.access_token)
            .filter(|t| !t.is_empty())
            .map(|t| format!("Bearer {t}"))
            .ok_or_else(|| denied("the token realm gave no token".into()))
    }

    async fn status_error(&self, resp: reqwest::Response, what: &str) -> SourceError {
        let status = resp.status();
        let body = read_prefix(resp, MAX_ERROR_BODY_BYTES).await;
        let detail = redact(
            body.chars().take(300).collect::<String>().trim(),
            &self.secrets,
        );
        let detail = if detail.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {detail}")
        };
        match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => SourceError::AccessDenied {
                what: format!("{} ({what})", self.describe()),
                detail: if self.credentials.is_some() {
                    format!("{detail}; the pull secret's credentials have no access")
                } else {
                    format!("{detail}; the repository may be private: name a pull secret")
                },
            },
            StatusCode::NOT_FOUND => SourceError::Invalid(format!(
                "{} ({what}) not found in the registry ({detail}); check the reference",
                self.describe()
            )),
            s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => {
                SourceError::Unavailable {
                    what: format!("{} ({what})", self.describe()),
                    detail,
                }
            }
            _ => self.protocol(format!("{what}: {detail}")),
        }
    }

    fn protocol(&self, detail: String) -> SourceError {
        SourceError::Protocol {
            what: self.describe(),
            detail,
        }
    }
}

fn is_index(m: &Manifest) -> bool {
    matches!(m.media_type.as_deref(), Some(OCI_INDEX | DOCKER_LIST))
        || (m.layers.is_empty() && !m.manifests.is_empty())
}

fn arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The index entry for linux on this architecture, or the only entry.
fn choose_platform(entries: &[Descriptor]) -> Option<&Descriptor> {
    if let [only] = entries {
        return Some(only);
    }
    entries.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == arch())
    })
}

fn challenge(headers: &HeaderMap) -> Option<String> {
    headers
        .get(WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_owned())
}

/// `realm="…",service="…",scope="…"` → a map (quoted values may hold commas).
fn challenge_params(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            match q.find('"') {
                Some(end) => (&q[..end], &q[end + 1..]),
                None => (q, ""),
            }
        } else {
            match after.find(',') {
                Some(end) => (&after[..end], &after[end..]),
                None => (after, ""),
            }
        };
        out.insert(key, value.to_owned());
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    out
}

/// A path as a version holds it: relative, `/`-separated, no empty, `.` or `..` component,
/// no NUL or backslash, at most 4096 bytes.
fn clean_path(raw: &str) -> Result<String, &'static str> {
    if raw.starts_with('/') {
        return Err("is absolute");
    }
    if raw.len() > 4096 {
        return Err("is longer than 4096 bytes");
    }
    if raw.contains(['\0', '\\']) {
        return Err("holds a NUL or a backslash");
    }
    let trimmed = raw.trim_end_matches('/');
    let mut parts = Vec::new();
    for c in trimmed.split('/') {
        match c {
            "" | "." => continue,
            ".." => return Err("has a '..' component"),
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        return Err("is empty");
    }
    Ok(parts.join("/"))
}

/// `spec.source.oci.path` as a prefix: `/models/` → `models`, `/` → ``.
fn image_dir(raw: &str) -> Result<String, SourceError> {
    if !raw.starts_with('/') {
        return Err(SourceError::Invalid(format!(
            "spec.source.oci.path {raw:?} must be absolute in the image (e.g. /models)"
        )));
    }
    let inner = raw.trim_matches('/');
    if inner.is_empty() {
        return Ok(String::new());
    }
    clean_path(inner)
        .map_err(|why| SourceError::Invalid(format!("spec.source.oci.path {raw:?} {why}")))
}

/// What the upper layers of an image already decided, as the layers are read top-down.
#[derive(Default)]
struct Tree {
    /// Every path an upper layer had, and whether it was a directory.
    seen: BTreeMap<String, bool>,
    /// Hidden in every lower layer: whiteouts of upper layers (the path and everything under
    /// it) and opaque directories (everything under it).
    whiteouts: BTreeSet<String>,
    opaque: BTreeSet<String>,
    /// This layer's whiteouts, which apply from the next layer down.
    pending_whiteouts: Vec<String>,
    pending_opaque: Vec<String>,
    /// Files stored, and tar entries read over all layers.
    files: u64,
    entries: u64,
}

impl Tree {
    /// Whether `path` of the current layer is covered by an upper layer.
    fn hidden(&self, path: &str) -> bool {
        if self.seen.contains_key(path) {
            return true;
        }
        // An ancestor an upper layer whited out, made opaque, or replaced with a non-directory.
        let mut at = path;
        loop {
            if self.whiteouts.contains(at) {
                return true;
            }
            let Some((parent, _)) = at.rsplit_once('/') else {
                return false;
            };
            if self.opaque.contains(parent) || self.seen.get(parent) == Some(&false) {
                return true;
            }
            at = parent;
        }
    }

    fn record(&mut self, path: &str, is_dir: bool) {
        self.seen.insert(path.to_owned(), is_dir);
    }

    fn end_layer(&mut self) {
        self.whiteouts.extend(self.pending_whiteouts.drain(..));
        self.opaque.extend(self.pending_opaque.drain(..));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = Reference::parse("oci://127.0.0.1:5000/models/llama:v1").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "models/llama");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("ghcr.io/acme/m@{d}")).unwrap();
        assert_eq!(r.digest.as_deref(), Some(d.as_str()));
        assert_eq!(r.tag, None);
        assert_eq!(
            Reference::parse("reg.example/a/b").unwrap().tag.as_deref(),
            Some("latest")
        );
        for bad in [
            "llama",
            "reg.example/A/b",
            "reg.example/a@sha256:12",
            "reg.example/a:-x",
            "reg.example/../x",
            "/a/b",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn paths_are_cleaned_or_refused() {
        assert_eq!(clean_path("a/./b/").unwrap(), "a/b");
        for bad in ["/etc/passwd", "a/../../b", "..", "", "a\\b"] {
            assert!(clean_path(bad).is_err(), "{bad}");
        }
        assert_eq!(image_dir("/models/").unwrap(), "models");
        assert!(image_dir("models").is_err());
    }

    #[test]
    fn whiteouts_hide_lower_layers() {
        let mut t = Tree::default();
        // Top layer: a file, a whiteout, an opaque dir and a file that replaces a directory.
        t.record("m/keep", false);
        t.record("m/x", false);
        t.pending_whiteouts.push("m/gone".into());
        t.pending_opaque.push("m/opq".into());
        t.record("m/opq", true);
        t.record("m/opq/new", false);
        t.end_layer();
        assert!(t.hidden("m/keep"));
        assert!(t.hidden("m/gone"));
        assert!(t.hidden("m/gone/deep"));
        assert!(t.hidden("m/opq/old"));
        assert!(t.hidden("m/x/below"));
        assert!(!t.hidden("m/other"));
        // A lower entry at a path the upper layer holds is hidden (the upper one stands); a
        // sibling whose name merely starts like the opaque directory's is not.
        assert!(t.hidden("m/opq"));
        assert!(!t.hidden("m/opqx"));
        assert!(!t.hidden("m/opqx/file"));
    }

    #[test]
    fn docker_config_entries() {
        let auth = base64::engine::general_purpose::STANDARD.encode("bob:s3cret");
        let cfg = format!(r#"{{"auths":{{"https://reg.example:5000/v1/":{{"auth":"{auth}"}}}}}}"#);
        assert_eq!(
            registry_credentials(&cfg, "reg.example:5000").unwrap(),
            Some(("bob".into(), "s3cret".into()))
        );
        assert_eq!(registry_credentials(&cfg, "other.example").unwrap(), None);
        assert!(docker_config_secrets(&cfg).contains(&"s3cret".to_owned()));
        assert!(registry_credentials("nope", "x").is_err());
    }

    #[test]
    fn bearer_challenge() {
        let p = challenge_params(
            r#"realm="https://auth.example/token",service="reg.example",scope="repository:a,b:pull""#,
        );
        assert_eq!(p["realm"], "https://auth.example/token");
        assert_eq!(p["service"], "reg.example");
        assert_eq!(p["scope"], "repository:a,b:pull");
    }

    #[test]
    fn layer_packing() {
        assert_eq!(
            packing("application/vnd.cncf.model.weight.v1.raw").unwrap(),
            Packing::Raw
        );
        assert_eq!(
            packing("application/vnd.cncf.model.weight.v1.tar").unwrap(),
            Packing::Tar
        );
        assert_eq!(
            packing("application/vnd.oci.image.layer.v1.tar+gzip").unwrap(),
            Packing::TarGzip
        );
        assert_eq!(
            packing("application/vnd.docker.image.rootfs.diff.tar.gzip").unwrap(),
            Packing::TarGzip
        );
        assert!(packing("application/vnd.oci.image.layer.v1.tar+zstd").is_err());
    }
}
