//! A Hugging Face Hub repository as a source, over the Hub's HTTP API:
//!
//! - `GET {endpoint}/api/{models|datasets}/{repo}/revision/{revision}` → `{"sha": <commit>}`
//! - `GET {endpoint}/api/{models|datasets}/{repo}/tree/{commit}?recursive=true`, following
//!   `Link: <…>; rel="next"` pages → `[{type, path, size, oid, lfs?: {oid, size}}]`
//! - `GET {endpoint}[/datasets]/{repo}/resolve/{commit}/{path}` → the bytes (LFS files through
//!   a redirect to the CDN, which reqwest follows; it drops `Authorization` across hosts).
//!
//! The token goes only to the endpoint's origin. Pagination (`Link: rel="next"`) is followed
//! only within the endpoint's origin (scheme, host, port); anything else is a `Protocol` error,
//! never a request. Redirects: reqwest 0.12's default policy
//! (`redirect::remove_sensitive_headers`) drops `Authorization` when the host or the port
//! (`port_or_known_default`) changes, but keeps it when only the scheme does, e.g.
//! `https://h:8443` → `http://h:8443`; [`redirect_allowed`] refuses every https → http
//! redirect and every scheme change on the same host and port, so the token never leaves its
//! origin and never travels in the clear after an https start.
//!
//! Every answer is read within a bound ([`super::limits`]): tree pages are streamed up to a
//! byte cap before they are parsed and counted over all pages, error bodies are read only for
//! their first KiBs, and a file only up to the size the tree declared.
//!
//! Everything is pinned to the commit the revision resolved to, so a branch that moves during
//! the sync cannot mix two commits. LFS files are checked against the SHA-256 the tree
//! publishes (and the ETag) while they stream.

use std::sync::Arc;

use crate::spec::{HubRepo, HubRepoType};
use futures::TryStreamExt;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LINK};
use sealed_store::ingest::Ingest;
use serde::Deserialize;
use tokio_util::io::StreamReader;
use url::Url;

use super::egress::GuardedResolver;
use super::limits::{
    BodyError, ListingBudget, MAX_ERROR_BODY_BYTES, MAX_METADATA_BYTES, read_capped, read_prefix,
};
use crate::credentials::SourceCredentials;
use crate::download::{RemoteFile, Tap, backoff, send_failure, short, size_mismatch};
use crate::error::SourceError;
use crate::limits::SourceLimits;
use crate::options::SyncOptions;
use crate::progress::SyncReporter;
use crate::redact::{error_chain, redact, redact_url};
use crate::spec::globset;

/// Redirects followed at most (reqwest's default limit).
const MAX_REDIRECTS: usize = 10;

/// The public Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

pub struct HubSource {
    http: reqwest::Client,
    endpoint: Url,
    repo: String,
    repo_type: HubRepoType,
    revision: String,
    token: Option<String>,
    include: Option<globset::GlobSet>,
    exclude: Option<globset::GlobSet>,
    retries: u32,
    limits: SourceLimits,
    secrets: Vec<String>,
}

#[derive(Deserialize)]
struct RevisionInfo {
    sha: String,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    oid: String,
    size: u64,
}

/// What a request is for, so a 404 names the right thing.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Revision,
    Tree,
    File,
}

impl HubSource {
    pub(crate) fn open(
        src: &HubRepo,
        creds: &SourceCredentials,
        opts: &SyncOptions,
    ) -> Result<HubSource, SourceError> {
        // http(s), a host, no user, password, query or fragment.
        let endpoint = super::policy::hub_endpoint(src)?;
        let valid_part = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                && !p.starts_with(['-', '.'])
        };
        let parts: Vec<&str> = src.repo.split('/').collect();
        if parts.is_empty() || parts.len() > 2 || !parts.iter().all(|p| valid_part(p)) {
            return Err(SourceError::Invalid(format!(
                "spec.source.huggingFace.repo {:?} is not a repository id (org/name)",
                src.repo
            )));
        }
        if src.revision.is_empty() {
            return Err(SourceError::Invalid(
                "spec.source.huggingFace.revision is empty".into(),
            ));
        }
        let egress = Arc::new(opts.policy.egress.clone());
        let http = reqwest::Client::builder()
            .connect_timeout(opts.timeout)
            .read_timeout(opts.timeout)
            .user_agent(concat!("sealed-volumes/", env!("CARGO_PKG_VERSION")))
            // Every name resolves only to addresses the policy admits, and every hop's
            // literal address is checked (`crate::egress`); a proxy would connect for us.
            .no_proxy()
            .dns_resolver(Arc::new(GuardedResolver::new(egress.clone())))
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if let Err(why) = redirect_allowed(attempt.url(), attempt.previous()) {
                    return attempt.error(why);
                }
                match egress.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(refused) => attempt.error(refused),
                }
            }))
            .build()
            .map_err(|e| SourceError::Invalid(format!("HTTP client: {e}")))?;
        Ok(HubSource {
            http,
            endpoint,
            repo: src.repo.clone(),
            repo_type: src.repo_type,
            revision: src.revision.clone(),
            token: creds.hf_token.clone().filter(|t| !t.is_empty()),
            include: globset(&src.include, "spec.source.huggingFace.include")?,
            exclude: globset(&src.exclude, "spec.source.huggingFace.exclude")?,
            retries: opts.retries,
            limits: opts.limits,
            secrets: creds.secrets(),
        })
    }

    /// `hf://org/name` or `hf://datasets/org/name` (plus the endpoint when not the public Hub).
    pub(crate) fn describe(&self) -> String {
        let kind = match self.repo_type {
            HubRepoType::Model => "",
            HubRepoType::Dataset => "datasets/",
        };
        let shown = redact_url(self.endpoint.as_str());
        let host = shown.trim_end_matches('/');
        if host == DEFAULT_ENDPOINT {
            format!("hf://{kind}{}", self.repo)
        } else {
            format!("hf://{kind}{} at {host}", self.repo)
        }
    }

    fn url(&self, segments: &[&str]) -> Result<Url, SourceError> {
        let mut url = self.endpoint.clone();
        url.path_segments_mut()
            .map_err(|_| SourceError::Invalid(format!("endpoint {} has no path", self.endpoint)))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    fn api_url(&self, tail: &[&str]) -> Result<Url, SourceError> {
        let kind = match self.repo_type {
            HubRepoType::Model => "models",
            HubRepoType::Dataset => "datasets",
        };
        let mut segments = vec!["api", kind];
        segments.extend(self.repo.split('/'));
        segments.extend(tail);
        self.url(&segments)
    }

    /// The commit the revision names now.
    pub(crate) async fn resolve(&self) -> Result<String, SourceError> {
        let url = self.api_url(&["revision", &self.revision])?;
        let resp = self.get(url, Stage::Revision, "the revision").await?;
        let body = match read_capped(resp, MAX_METADATA_BYTES).await {
            Ok(body) => body,
            Err(BodyError::TooLarge) => {
                return Err(SourceError::Protocol {
                    what: self.describe(),
                    detail: format!(
                        "the revision answer is larger than {MAX_METADATA_BYTES} bytes; not read"
                    ),
                });
            }
            Err(BodyError::Http(e)) => return Err(self.unavailable("the revision", &e)),
        };
        let info: RevisionInfo =
            serde_json::from_slice(&body).map_err(|e| SourceError::Protocol {
                what: self.describe(),
                detail: format!("the revision answer is not the Hub's JSON: {e}"),
            })?;
        let sha = info.sha.to_ascii_lowercase();
        if sha.len() != 40 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(SourceError::Protocol {
                what: self.describe(),
                detail: format!(
                    "revision {:?} resolved to {sha:?}, not a commit",
                    self.revision
                ),
            });
        }
        Ok(sha)
    }

    /// Every file of the commit that passes include/exclude, sorted by path. The listing is
    /// counted as it arrives ([`ListingBudget`]): each page is read up to its byte bound
    /// before it is parsed, and entries, bytes and pages over all pages have bounds too.
    pub(crate) async fn list(&self, commit: &str) -> Result<Vec<RemoteFile>, SourceError> {
        let mut url = self.api_url(&["tree", commit])?;
        url.query_pairs_mut().append_pair("recursive", "true");
        let mut files = Vec::new();
        let mut budget = ListingBudget::new(self.limits);
        loop {
            budget.page().map_err(|d| self.too_large(d))?;
            let resp = self.get(url.clone(), Stage::Tree, "the file tree").await?;
            let next = next_link(resp.headers(), &url);
            if let Some(n) = &next
                && !same_origin(n, &self.endpoint)
            {
                // The token would follow the link: never to another origin.
                return Err(SourceError::Protocol {
                    what: self.describe(),
                    detail: format!(
                        "the tree listing's next page is at another origin ({}); not followed: \
                         pagination must stay at {}",
                        redact_url(n.as_str()),
                        self.endpoint.origin().ascii_serialization()
                    ),
                });
            }
            let page = match read_capped(resp, budget.page_cap()).await {
                Ok(page) => page,
                Err(BodyError::TooLarge) => return Err(self.too_large(budget.page_exceeded())),
                Err(BodyError::Http(e)) => return Err(self.unavailable("the file tree", &e)),
            };
            let entries: Vec<TreeEntry> =
                serde_json::from_slice(&page).map_err(|e| SourceError::Protocol {
                    what: self.describe(),
                    detail: format!("the tree listing is not the Hub's JSON: {e}"),
                })?;
            budget
                .add(entries.len() as u64, page.len() as u64)
                .map_err(|d| self.too_large(d))?;
            drop(page);
            for e in entries {
                if e.kind != "file" || !self.wanted(&e.path) {
                    continue;
                }
                let (size, sha256, git_oid) = match e.lfs {
                    Some(lfs) => (lfs.size, Some(lfs.oid.to_ascii_lowercase()), None),
                    None => (
                        e.size,
                        None,
                        e.oid
                            .map(|o| o.to_ascii_lowercase())
                            .filter(|o| o.len() == 40 && o.bytes().all(|b| b.is_ascii_hexdigit())),
                    ),
                };
                files.push(RemoteFile {
                    path: e.path.clone(),
                    key: e.path,
                    size,
                    sha256,
                    git_oid,
                    etag: None,
                });
            }
            match next {
                Some(n) => url = n,
                None => break,
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        files.dedup_by(|a, b| a.path == b.path);
        if files.is_empty() {
            return Err(SourceError::NoFiles {
                what: format!("{}@{commit}", self.describe()),
                detail: if self.include.is_some() || self.exclude.is_some() {
                    "no file matches include/exclude".into()
                } else {
                    "the repository has no files".into()
                },
            });
        }
        Ok(files)
    }

    fn wanted(&self, path: &str) -> bool {
        self.include.as_ref().is_none_or(|s| s.is_match(path))
            && !self.exclude.as_ref().is_some_and(|s| s.is_match(path))
    }

    /// Streams one file of `commit` into the ingest, retrying a download that broke off and
    /// checking an LFS file against its published SHA-256.
    pub(crate) async fn fetch(
        &self,
        ingest: &Ingest,
        commit: &str,
        file: &RemoteFile,
        progress: &Arc<dyn SyncReporter>,
    ) -> Result<(), SourceError> {
        let mut segments = Vec::new();
        if self.repo_type == HubRepoType::Dataset {
            segments.push("datasets");
        }
        segments.extend(self.repo.split('/'));
        segments.extend(["resolve", commit]);
        segments.extend(file.key.split('/'));
        let url = self.url(&segments)?;
        let mut attempt = 0;
        loop {
            let resp = self.get(url.clone(), Stage::File, &file.path).await?;
            let etag = etag(resp.headers());
            let body = resp.bytes_stream().map_err(std::io::Error::other);
            let mut tap = Tap::new(StreamReader::new(Box::pin(body)), file.size);
            if file.git_oid.is_some() {
                tap = tap.with_git_blob(file.size);
            }
            let added = ingest
                .add_file(&file.path, false, Some(file.size), &mut tap)
                .await;
            match added {
                Ok(_) => {
                    let tapped = tap.finish();
                    if let (Some(expected), Some(actual)) = (&file.git_oid, &tapped.git_oid)
                        && expected != actual
                    {
                        return Err(SourceError::IntegrityMismatch {
                            what: self.describe(),
                            path: file.path.clone(),
                            expected: format!("git blob {expected}"),
                            actual: format!("git blob {actual}"),
                        });
                    }
                    let actual = tapped.sha256;
                    let expected = file.sha256.clone().or_else(|| {
                        // A 64-hex ETag on a non-LFS file is a SHA-256 too (some mirrors).
                        etag.clone()
                            .filter(|e| e.len() == 64 && e.bytes().all(|b| b.is_ascii_hexdigit()))
                    });
                    if let Some(expected) = expected
                        && expected != actual
                    {
                        return Err(self.mismatch(file, expected, actual));
                    }
                    if file.sha256.is_some()
                        && let Some(etag) = etag.filter(|e| e.len() == 64)
                        && etag != actual
                    {
                        return Err(self.mismatch(file, etag, actual));
                    }
                    return Ok(());
                }
                // More than the listing declared: a broken server, not a broken transfer.
                Err(_) if tap.overflowed => {
                    return Err(SourceError::Protocol {
                        what: format!("{} file '{}'", self.describe(), file.path),
                        detail: tap.overflow_detail(),
                    });
                }
                // A download that broke off, or ended short of the listed size: try again.
                Err(e) if (tap.failed || short(&e)) && attempt < self.retries => {
                    attempt += 1;
                    tracing::warn!(
                        source = %self.describe(),
                        path = %file.path,
                        attempt,
                        error = %redact(&e.to_string(), &self.secrets),
                        "download broke off; retrying the file"
                    );
                    progress.retry(&file.path);
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(e) if tap.failed => {
                    return Err(SourceError::Unavailable {
                        what: format!("{} file '{}'", self.describe(), file.path),
                        detail: redact(&error_chain(&e), &self.secrets),
                    });
                }
                // The store's detail names the size that came: not the tenant's to know.
                Err(sealed_store::Error::FileChanged { .. }) => {
                    return Err(SourceError::SourceChanged {
                        what: self.describe(),
                        path: file.path.clone(),
                        detail: size_mismatch(file.size),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn mismatch(&self, file: &RemoteFile, expected: String, actual: String) -> SourceError {
        SourceError::IntegrityMismatch {
            what: self.describe(),
            path: file.path.clone(),
            expected: format!("sha256:{expected}"),
            actual: format!("sha256:{actual}"),
        }
    }

    fn unavailable(&self, what: &str, e: &reqwest::Error) -> SourceError {
        SourceError::Unavailable {
            what: format!("{} ({what})", self.describe()),
            detail: redact(&error_chain(e), &self.secrets),
        }
    }

    fn too_large(&self, detail: String) -> SourceError {
        SourceError::TooLarge {
            what: self.describe(),
            detail,
        }
    }

    /// A GET with the token, retried with backoff on connection errors, 429 and 5xx.
    async fn get(
        &self,
        url: Url,
        stage: Stage,
        what: &str,
    ) -> Result<reqwest::Response, SourceError> {
        let mut attempt = 0;
        loop {
            let mut req = self.http.get(url.clone());
            if let Some(token) = &self.token {
                req = req.bearer_auth(token);
            }
            let failure = match req.send().await {
                Ok(resp) if resp.status().is_success() => return Ok(resp),
                Ok(resp) => {
                    let status = resp.status();
                    if !(status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS)
                        || attempt >= self.retries
                    {
                        return Err(self.status_error(resp, stage, what).await);
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

    async fn status_error(&self, resp: reqwest::Response, stage: Stage, what: &str) -> SourceError {
        let status = resp.status();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let code = header("x-error-code").unwrap_or_default();
        let message = header("x-error-message");
        // An error page is read only as far as a message needs.
        let body = read_prefix(resp, MAX_ERROR_BODY_BYTES).await;
        let mut detail = message.unwrap_or_else(|| body.chars().take(300).collect());
        detail = redact(detail.trim(), &self.secrets);
        let detail = if detail.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {detail}")
        };
        let repo_not_found = || SourceError::RepoNotFound {
            repo: self.repo.clone(),
            endpoint: redact_url(self.endpoint.as_str())
                .trim_end_matches('/')
                .to_owned(),
        };
        match (status, code.as_str()) {
            (_, "RevisionNotFound") => SourceError::RevisionNotFound {
                repo: self.repo.clone(),
                revision: self.revision.clone(),
            },
            (_, "GatedRepo") => SourceError::AccessDenied {
                what: self.describe(),
                detail: format!(
                    "{detail}; the repository is gated: accept its conditions on the Hub with the account whose token is in tokenSecretRef"
                ),
            },
            (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) => SourceError::AccessDenied {
                what: self.describe(),
                detail: if self.token.is_some() {
                    format!(
                        "{detail}; the token in tokenSecretRef has no access to this private or gated repository (or it does not exist)"
                    )
                } else {
                    format!(
                        "{detail}; the repository is private or gated (or does not exist): set spec.source.huggingFace.tokenSecretRef"
                    )
                },
            },
            (StatusCode::NOT_FOUND, "EntryNotFound") => SourceError::SourceChanged {
                what: self.describe(),
                path: what.to_owned(),
                detail,
            },
            (StatusCode::NOT_FOUND, _) if stage == Stage::File => SourceError::SourceChanged {
                what: self.describe(),
                path: what.to_owned(),
                detail,
            },
            (StatusCode::NOT_FOUND, _) => repo_not_found(),
            (s, _) if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => {
                SourceError::Unavailable {
                    what: format!("{} ({what})", self.describe()),
                    detail,
                }
            }
            _ => SourceError::Protocol {
                what: format!("{} ({what})", self.describe()),
                detail,
            },
        }
    }
}

/// The ETag without quotes or weak marker, lowercased (`X-Linked-Etag` first: on the Hub it
/// is the LFS SHA-256 when the answer is a redirect).
fn etag(headers: &HeaderMap) -> Option<String> {
    ["x-linked-etag", "etag"].iter().find_map(|name| {
        let v = headers.get(*name)?.to_str().ok()?;
        let v = v.trim().trim_start_matches("W/").trim_matches('"');
        (!v.is_empty()).then(|| v.to_ascii_lowercase())
    })
}

/// Same scheme, host and port: where the token may go.
fn same_origin(a: &Url, b: &Url) -> bool {
    a.origin() == b.origin() && a.origin().is_tuple()
}

/// Whether a redirect to `next` may be followed after `previous` (the original URL first):
/// never from https to http, never a scheme change on the same host and port (reqwest would
/// keep `Authorization` there), at most [`MAX_REDIRECTS`]. reqwest itself drops
/// `Authorization` when the host or port changes.
fn redirect_allowed(next: &Url, previous: &[Url]) -> Result<(), String> {
    if previous.len() >= MAX_REDIRECTS {
        return Err(format!("more than {MAX_REDIRECTS} redirects"));
    }
    if next.scheme() != "https" && previous.iter().any(|u| u.scheme() == "https") {
        return Err(format!(
            "redirect from https to {} refused: {}",
            next.scheme(),
            redact_url(next.as_str())
        ));
    }
    if let Some(last) = previous.last()
        && last.scheme() != next.scheme()
        && last.host_str() == next.host_str()
        && last.port_or_known_default() == next.port_or_known_default()
    {
        return Err(format!(
            "redirect to another scheme on the same host and port refused: {}",
            redact_url(next.as_str())
        ));
    }
    Ok(())
}

/// The `rel="next"` target of a `Link` header, resolved against the current URL.
fn next_link(headers: &HeaderMap, base: &Url) -> Option<Url> {
    for value in headers.get_all(LINK) {
        let Ok(value) = value.to_str() else { continue };
        for link in value.split(',') {
            let mut parts = link.split(';');
            let target = parts.next()?.trim();
            let is_next = parts.any(|p| {
                let p = p.trim().replace(' ', "");
                p == "rel=\"next\"" || p == "rel=next"
            });
            if is_next
                && let Some(inner) = target.strip_prefix('<').and_then(|t| t.strip_suffix('>'))
            {
                return base.join(inner).ok();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn link_header() {
        let base = Url::parse("http://h/api/models/a/b/tree/x?recursive=true").unwrap();
        let mut h = HeaderMap::new();
        h.insert(
            LINK,
            HeaderValue::from_static(
                "<http://h/api/models/a/b/tree/x?recursive=true&cursor=abc>; rel=\"next\"",
            ),
        );
        assert_eq!(
            next_link(&h, &base).unwrap().as_str(),
            "http://h/api/models/a/b/tree/x?recursive=true&cursor=abc"
        );
        h.insert(LINK, HeaderValue::from_static("</p2>; rel=\"prev\""));
        assert!(next_link(&h, &base).is_none());
    }

    #[test]
    fn pagination_stays_at_the_origin() {
        let endpoint = Url::parse("https://hub.example.com").unwrap();
        let base =
            Url::parse("https://hub.example.com/api/models/a/b/tree/c?recursive=true").unwrap();
        let next = |link: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(LINK, reqwest::header::HeaderValue::from_static(link));
            next_link(&h, &base).unwrap()
        };
        assert!(same_origin(
            &next("</api/models/a/b/tree/c?cursor=2>; rel=\"next\""),
            &endpoint
        ));
        assert!(same_origin(
            &next("<https://hub.example.com:443/api/x?cursor=2>; rel=\"next\""),
            &endpoint
        ));
        for foreign in [
            "<http://hub.example.com/api/x?cursor=2>; rel=\"next\"",
            "<https://hub.example.com:8443/api/x>; rel=\"next\"",
            "<https://attacker.example.com/api/x>; rel=\"next\"",
            "<//attacker.example.com/api/x>; rel=\"next\"",
        ] {
            assert!(!same_origin(&next(foreign), &endpoint), "{foreign}");
        }
    }

    #[test]
    fn redirects_keep_the_token_at_home() {
        let u = |s: &str| Url::parse(s).unwrap();
        // The Hub's LFS redirect to its CDN: followed (reqwest drops the token across hosts).
        assert!(
            redirect_allowed(
                &u("https://cdn-lfs.hf.co/x"),
                &[u("https://huggingface.co/a/b/resolve/c/f")]
            )
            .is_ok()
        );
        assert!(
            redirect_allowed(&u("http://127.0.0.1:1/cdn/x"), &[u("http://127.0.0.1:1/r")]).is_ok()
        );
        // https -> http, directly or later in the chain: refused.
        let err = redirect_allowed(
            &u("http://cdn.example.com/x?sig=s3cret"),
            &[u("https://hub/r")],
        )
        .unwrap_err();
        assert!(
            err.contains("https to http") && !err.contains("s3cret"),
            "{err}"
        );
        assert!(
            redirect_allowed(&u("http://c/x"), &[u("https://hub/r"), u("https://cdn/y")]).is_err()
        );
        // Same host and port, other scheme: reqwest would keep Authorization.
        assert!(redirect_allowed(&u("https://h:8443/x"), &[u("http://h:8443/r")]).is_err());
        // Too many.
        let chain: Vec<Url> = (0..MAX_REDIRECTS)
            .map(|i| u(&format!("https://h/{i}")))
            .collect();
        assert!(redirect_allowed(&u("https://h/last"), &chain).is_err());
    }

    #[test]
    fn etag_forms() {
        let mut h = HeaderMap::new();
        h.insert("etag", HeaderValue::from_static("W/\"ABC\""));
        assert_eq!(etag(&h).as_deref(), Some("abc"));
        h.insert("x-linked-etag", HeaderValue::from_static("\"def\""));
        assert_eq!(etag(&h).as_deref(), Some("def"));
    }
}
