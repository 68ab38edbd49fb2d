//! Credentials of AWS profiles that are not plain keys, as the AWS CLI gets them
//! ([`crate::aws_profile`] reads the profile):
//!
//! - `credential_process`: the command (run by `sh -c`, as the AWS SDKs do on Unix) prints the
//!   process-credential JSON (`Version` 1, `AccessKeyId`, `SecretAccessKey`, optional
//!   `SessionToken` and `Expiration`).
//! - IAM Identity Center (SSO) profiles (`sso_session` or `sso_start_url`): through the AWS
//!   CLI, the one tool that holds the SSO login: `aws configure export-credentials --profile
//!   NAME --format process` as the credential process (after `aws sso login`).
//! - `role_arn` with `source_profile` (or `credential_source = Environment`): STS
//!   `AssumeRole`, signed (SigV4, object_store's signer) with the source's credentials, which
//!   may themselves be any of these (role chaining).
//!
//! Credentials with an expiry are cached and fetched again five minutes before it.
//! Web identity (IRSA), EKS Pod Identity and ECS task roles come from the environment and are
//! object_store's own (docs/store.md, "AWS credentials").

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use object_store::aws::{AwsAuthorizer, AwsCredential};
use object_store::client::{HttpClient, HttpConnector, HttpRequest};
use object_store::{ClientOptions, CredentialProvider};

/// How long a credential process may run.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);
/// The most of its output read (the JSON is a few hundred bytes).
const MAX_PROCESS_OUTPUT: usize = 64 * 1024;
/// The most of an STS answer read.
const MAX_STS_ANSWER: usize = 256 * 1024;
/// Fetched again this long before they expire.
const REFRESH_BEFORE: chrono::TimeDelta = chrono::TimeDelta::minutes(5);
/// The AssumeRole session length when the profile names none (the CLI's default).
const DEFAULT_ROLE_SECONDS: u32 = 3600;

/// Where a profile's credentials come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CredentialSource {
    /// Keys (static, or a session's).
    Static {
        access_key_id: String,
        secret_access_key: String,
        session_token: Option<String>,
    },
    /// The `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN` of this process
    /// (`credential_source = Environment`).
    Environment,
    /// A command printing process-credential JSON.
    Process(String),
    /// STS AssumeRole with the source's credentials.
    AssumeRole(Box<AssumeRole>),
}

/// A role to assume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssumeRole {
    pub role_arn: String,
    pub session_name: String,
    pub external_id: Option<String>,
    pub duration_seconds: Option<u32>,
    /// The STS endpoint (`https://sts.REGION.amazonaws.com`, or an override) and region.
    pub sts_endpoint: String,
    pub region: String,
    pub source: CredentialSource,
}

/// Why credentials could not be had (the message names the profile's setting).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CredentialError(String);

fn fail<T>(message: impl Into<String>) -> Result<T, CredentialError> {
    Err(CredentialError(message.into()))
}

/// A credential and when it expires (`None`: never).
type Expiring = (Arc<AwsCredential>, Option<DateTime<Utc>>);

/// An object_store credential provider over a [`CredentialSource`], caching until shortly
/// before expiry.
#[derive(Debug)]
pub struct ProfileCredentials {
    source: CredentialSource,
    client: HttpClient,
    cache: tokio::sync::Mutex<Option<Expiring>>,
}

impl ProfileCredentials {
    /// For `source`, with a client for its STS endpoints (plain HTTP only to an endpoint
    /// that asks for it: a local emulator).
    pub fn for_source(source: CredentialSource) -> object_store::Result<Self> {
        let mut http = false;
        let mut at = &source;
        while let CredentialSource::AssumeRole(role) = at {
            http |= role.sts_endpoint.starts_with("http://");
            at = &role.source;
        }
        let options = ClientOptions::new()
            .with_timeout(Duration::from_secs(30))
            .with_connect_timeout(Duration::from_secs(10))
            .with_allow_http(http);
        Self::new(source, &options)
    }

    pub fn new(source: CredentialSource, options: &ClientOptions) -> object_store::Result<Self> {
        let client = crate::http_cap::CappedConnector.connect(options)?;
        Ok(ProfileCredentials {
            source,
            client,
            cache: tokio::sync::Mutex::new(None),
        })
    }

    /// The credential now (from the cache while it is fresh).
    pub async fn credential(&self) -> Result<Arc<AwsCredential>, CredentialError> {
        let mut cache = self.cache.lock().await;
        if let Some((credential, expiry)) = cache.as_ref()
            && expiry.is_none_or(|at| at - Utc::now() > REFRESH_BEFORE)
        {
            return Ok(credential.clone());
        }
        let fresh = Box::pin(resolve(&self.source, &self.client)).await?;
        *cache = Some(fresh.clone());
        Ok(fresh.0)
    }
}

#[async_trait]
impl CredentialProvider for ProfileCredentials {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        self.credential()
            .await
            .map_err(|e| object_store::Error::Generic {
                store: "S3",
                source: Box::new(e),
            })
    }
}

async fn resolve(
    source: &CredentialSource,
    client: &HttpClient,
) -> Result<Expiring, CredentialError> {
    match source {
        CredentialSource::Static {
            access_key_id,
            secret_access_key,
            session_token,
        } => Ok((
            Arc::new(AwsCredential {
                key_id: access_key_id.clone(),
                secret_key: secret_access_key.clone(),
                token: session_token.clone(),
            }),
            None,
        )),
        CredentialSource::Environment => {
            let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
            match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
                (Some(key_id), Some(secret_key)) => Ok((
                    Arc::new(AwsCredential {
                        key_id,
                        secret_key,
                        token: env("AWS_SESSION_TOKEN"),
                    }),
                    None,
                )),
                _ => fail(
                    "credential_source = Environment, but AWS_ACCESS_KEY_ID and \
                     AWS_SECRET_ACCESS_KEY are not both set",
                ),
            }
        }
        CredentialSource::Process(command) => run_process(command).await,
        CredentialSource::AssumeRole(role) => {
            let (source, _) = Box::pin(resolve(&role.source, client)).await?;
            assume_role(role, &source, client).await
        }
    }
}

/// The process-credential JSON.
#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ProcessCredentials {
    version: u32,
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
    expiration: Option<DateTime<Utc>>,
}

async fn run_process(command: &str) -> Result<Expiring, CredentialError> {
    use tokio::io::AsyncReadExt;
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .or_else(|e| fail(format!("credential_process: cannot run sh: {e}")))?;
    let (mut stdout, mut stderr) = match (child.stdout.take(), child.stderr.take()) {
        (Some(o), Some(e)) => (o, e),
        _ => return fail("credential_process: no pipes"),
    };
    let run = async {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let limit = u64::try_from(MAX_PROCESS_OUTPUT).unwrap_or(u64::MAX);
        let mut stdout = (&mut stdout).take(limit);
        let mut stderr = (&mut stderr).take(limit);
        let (o, e) = tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
        let status = child.wait().await;
        (o.and(e).and(status), out, err)
    };
    let (status, out, err) = tokio::time::timeout(PROCESS_TIMEOUT, run)
        .await
        .or_else(|_| {
            fail(format!(
                "credential_process did not finish within {PROCESS_TIMEOUT:?}"
            ))
        })?;
    let status = status.or_else(|e| fail(format!("credential_process: {e}")))?;
    if !status.success() {
        // Its stderr says why (an expired SSO login, a locked keychain); never its stdout.
        let why: String = String::from_utf8_lossy(&err)
            .trim()
            .chars()
            .take(500)
            .collect();
        return fail(format!("credential_process failed ({status}): {why}"));
    }
    let parsed: ProcessCredentials = serde_json::from_slice(&out).or_else(|e| {
        fail(format!(
            "credential_process printed no credential JSON: {e}"
        ))
    })?;
    if parsed.version != 1 {
        return fail(format!(
            "credential_process printed Version {}, not 1",
            parsed.version
        ));
    }
    Ok((
        Arc::new(AwsCredential {
            key_id: parsed.access_key_id,
            secret_key: parsed.secret_access_key,
            token: parsed.session_token,
        }),
        parsed.expiration,
    ))
}

/// The text of the first `<name>...</name>` in `xml` (STS answers: no attributes, no nesting
/// of the same name, no markup in the values we read).
fn xml_text<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let open = format!("<{name}>");
    let start = xml.find(&open)?.checked_add(open.len())?;
    let len = xml.get(start..)?.find(&format!("</{name}>"))?;
    xml.get(start..start.checked_add(len)?)
}

fn xml_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

async fn assume_role(
    role: &AssumeRole,
    source: &AwsCredential,
    client: &HttpClient,
) -> Result<Expiring, CredentialError> {
    let seconds = role
        .duration_seconds
        .unwrap_or(DEFAULT_ROLE_SECONDS)
        .to_string();
    // Built before any await: the serializer is not Send.
    let body = {
        let mut form = url::form_urlencoded::Serializer::new(String::new());
        form.append_pair("Action", "AssumeRole")
            .append_pair("Version", "2011-06-15")
            .append_pair("RoleArn", &role.role_arn)
            .append_pair("RoleSessionName", &role.session_name)
            .append_pair("DurationSeconds", &seconds);
        if let Some(id) = &role.external_id {
            form.append_pair("ExternalId", id);
        }
        form.finish()
    };
    let what = format!(
        "STS AssumeRole of {} at {}",
        role.role_arn, role.sts_endpoint
    );
    let mut request: HttpRequest = http::Request::builder()
        .method(http::Method::POST)
        .uri(role.sts_endpoint.as_str())
        .header(
            http::header::CONTENT_TYPE,
            "application/x-www-form-urlencoded; charset=utf-8",
        )
        .body(body.into())
        .or_else(|e| fail(format!("{what}: {e}")))?;
    // Signs a URL it parses again: a bad endpoint must fail here, not in the signer.
    url::Url::parse(&role.sts_endpoint).or_else(|e| fail(format!("{what}: bad endpoint: {e}")))?;
    AwsAuthorizer::new(source, "sts", &role.region).authorize(&mut request, None);
    let response = client
        .execute(request)
        .await
        .or_else(|e| fail(format!("{what}: {e}")))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .bytes()
        .await
        .or_else(|e| fail(format!("{what}: {e}")))?;
    if bytes.len() > MAX_STS_ANSWER {
        return fail(format!("{what}: an answer of {} bytes", bytes.len()));
    }
    let text = String::from_utf8_lossy(&bytes);
    if !status.is_success() {
        let code = xml_text(&text, "Code").unwrap_or("");
        let message = xml_text(&text, "Message").unwrap_or("");
        return fail(format!(
            "{what}: HTTP {status} {code} {}",
            xml_unescape(message)
        ));
    }
    let field = |name: &str| {
        xml_text(&text, name)
            .map(xml_unescape)
            .ok_or_else(|| CredentialError(format!("{what}: the answer has no {name}")))
    };
    let expiration = DateTime::parse_from_rfc3339(&field("Expiration")?)
        .map(|t| t.with_timezone(&Utc))
        .or_else(|e| fail(format!("{what}: bad Expiration: {e}")))?;
    Ok((
        Arc::new(AwsCredential {
            key_id: field("AccessKeyId")?,
            secret_key: field("SecretAccessKey")?,
            token: Some(field("SessionToken")?),
        }),
        Some(expiration),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_fields_are_found_and_unescaped() {
        let xml = "<AssumeRoleResponse><AssumeRoleResult><Credentials>\
            <AccessKeyId>ASIA1</AccessKeyId><SessionToken>a&amp;b</SessionToken>\
            </Credentials></AssumeRoleResult></AssumeRoleResponse>";
        assert_eq!(xml_text(xml, "AccessKeyId"), Some("ASIA1"));
        assert_eq!(
            xml_text(xml, "SessionToken").map(xml_unescape).as_deref(),
            Some("a&b")
        );
        assert_eq!(xml_text(xml, "Expiration"), None);
        assert_eq!(xml_text("<A>unclosed", "A"), None);
    }

    #[tokio::test]
    async fn a_credential_process_is_run_and_its_json_read() {
        let json = r#"{"Version":1,"AccessKeyId":"AKID","SecretAccessKey":"SECRET","SessionToken":"TOKEN","Expiration":"2999-01-01T00:00:00Z"}"#;
        let (c, expiry) = run_process(&format!("printf '%s' '{json}'")).await.unwrap();
        assert_eq!(
            (c.key_id.as_str(), c.secret_key.as_str()),
            ("AKID", "SECRET")
        );
        assert_eq!(c.token.as_deref(), Some("TOKEN"));
        assert!(expiry.is_some());
        // A failing process: its stderr is the message.
        let e = run_process("echo 'the SSO session has expired' >&2; exit 255")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("SSO session has expired"), "{e}");
        let e = run_process(r#"echo '{"Version":2,"AccessKeyId":"a","SecretAccessKey":"b"}'"#)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("Version 2"), "{e}");
    }
}
