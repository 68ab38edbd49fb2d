//! How a failed command ends: its error chain printed once (outermost first, the cause last),
//! a line on what to do, and an exit code that tells scripts which kind of failure it was.
//! The one home of the exit-code table; `sealed --help` prints [`EXIT_CODES_HELP`].

use std::process::ExitCode;

use sealed_store::Error as StoreError;

/// The kinds of failure a script can tell apart by exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Anything else (bad input, a local I/O error, the cluster refusing a request). Also
    /// what `sealed diff --exit-code` returns when the two sides differ and `sealed pin
    /// --check` when a reference floats (as `git diff --exit-code`): a script that needs to
    /// tell those from a failure reads stderr, or `-o json`.
    Other = 1,
    /// A wrong command line, or a store URL or endpoint that cannot be right (clap exits
    /// with 2 for its own checks).
    Usage = 2,
    /// The version is corrupt or incomplete: `verify` found bad or missing chunks, or `pull`
    /// read a chunk or file that does not match its digest.
    Corrupt = 3,
    /// The version, volume or store does not exist.
    NotFound = 4,
    /// The store could not be reached, timed out, or refused the credentials.
    StoreUnavailable = 5,
    /// `verify --signature`: the model signature does not verify (a changed, added or
    /// removed file, another key, another model, a signature not made in key mode).
    Unverified = 6,
}

impl Failure {
    pub fn code(self) -> ExitCode {
        ExitCode::from(self as u8)
    }
}

/// The exit-code table as `sealed --help` shows it.
pub const EXIT_CODES_HELP: &str = "Exit codes:
  0  success
  1  any other failure; `sealed diff --exit-code`: the two differ (`pin --check`: a reference floats)
  2  usage: a wrong command line, digest, store URL or endpoint
  3  the version is corrupt or incomplete (verify found missing or bad chunks; pull read bad bytes)
  4  not found: the version, volume or store does not exist
  5  the store is unreachable, timed out, or refused the credentials
  6  the model signature does not verify (verify --signature)";

/// Prints `err` to stderr once, cause last, with a hint, and returns the exit code.
pub fn report(err: &anyhow::Error) -> ExitCode {
    let lines = chain_once(err);
    let kind = classify(err);
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i == 0 {
            out.push_str(&format!("error: {line}\n"));
        } else {
            out.push_str(&format!("  caused by: {line}\n"));
        }
    }
    if let Some(hint) = hint(kind, &lines) {
        out.push_str(&format!("hint: {hint}\n"));
    }
    eprint!("{out}");
    kind.code()
}

/// The messages of `err`'s chain, each without the text of its causes. Many errors (ours,
/// object_store's) repeat their source's message after a colon *and* return it as their
/// source, so printing every level in full says the same thing several times over.
pub fn chain_once(err: &anyhow::Error) -> Vec<String> {
    let full: Vec<String> = err.chain().map(|e| e.to_string()).collect();
    let mut lines = Vec::with_capacity(full.len());
    for (i, msg) in full.iter().enumerate() {
        let mut own = msg.as_str();
        if let Some(next) = full.get(i + 1)
            && let Some(head) = own.strip_suffix(next.as_str())
        {
            own = head.trim_end_matches([' ', ':', '-', ',']).trim_end();
        }
        let own = own.trim();
        // A level that only wrapped its cause adds nothing; one that only repeats what the
        // line before said (`store X` under `cannot open store X`) neither.
        if own.is_empty() || lines.last().is_some_and(|l: &String| l.contains(own)) {
            continue;
        }
        lines.push(own.to_owned());
    }
    if lines.is_empty() {
        lines.push(err.to_string());
    }
    lines
}

/// Which kind of failure `err` is: the first level of its chain that says.
pub fn classify(err: &anyhow::Error) -> Failure {
    // A context, which the chain's levels do not downcast to; anyhow's own downcast does.
    if err.downcast_ref::<UsageError>().is_some() {
        return Failure::Usage;
    }
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<sealed_provenance::Error>() {
            return match e {
                sealed_provenance::Error::Key { .. } => Failure::Usage,
                _ => Failure::Unverified,
            };
        }
        if let Some(kind) = cause.downcast_ref::<StoreError>().and_then(classify_store) {
            return kind;
        }
        if let Some(kind) = cause
            .downcast_ref::<object_store::Error>()
            .and_then(classify_backend)
        {
            return kind;
        }
        if let Some(e) = cause.downcast_ref::<object_store::client::HttpError>() {
            use object_store::client::HttpErrorKind as K;
            if matches!(
                e.kind(),
                K::Connect | K::Request | K::Timeout | K::Interrupted
            ) {
                return Failure::StoreUnavailable;
            }
        }
        if let Some(e) = cause.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            if matches!(
                e.kind(),
                K::ConnectionRefused
                    | K::ConnectionReset
                    | K::ConnectionAborted
                    | K::HostUnreachable
                    | K::NetworkUnreachable
                    | K::AddrNotAvailable
                    | K::TimedOut
            ) {
                return Failure::StoreUnavailable;
            }
        }
        if let Some(NotFoundError(_)) = cause.downcast_ref::<NotFoundError>() {
            return Failure::NotFound;
        }
    }
    // object_store's retry error, which carries the HTTP status, is not nameable outside the
    // crate; its message is all there is.
    let text = err.chain().map(|e| e.to_string()).collect::<Vec<_>>();
    if text.iter().any(|t| refused_credentials(t)) {
        return Failure::StoreUnavailable;
    }
    Failure::Other
}

fn classify_store(e: &StoreError) -> Option<Failure> {
    match e {
        StoreError::UnknownVersion { .. }
        | StoreError::StoreNotFound { .. }
        | StoreError::VersionReclaimed { .. } => Some(Failure::NotFound),
        StoreError::MissingChunk { .. }
        | StoreError::CorruptChunk { .. }
        | StoreError::ChunkLengthMismatch { .. }
        | StoreError::FileDigestMismatch { .. }
        | StoreError::ManifestDigestMismatch { .. } => Some(Failure::Corrupt),
        StoreError::Timeout { .. } => Some(Failure::StoreUnavailable),
        StoreError::InvalidStoreUrl { .. } | StoreError::InvalidEndpoint { .. } => {
            Some(Failure::Usage)
        }
        StoreError::Backend { source, .. } => classify_backend(source),
        // Its source is boxed, which the chain's downcasts do not see through.
        StoreError::InFile { source, .. } => classify_store(source),
        _ => None,
    }
}

fn classify_backend(e: &object_store::Error) -> Option<Failure> {
    match e {
        object_store::Error::Unauthenticated { .. }
        | object_store::Error::PermissionDenied { .. } => Some(Failure::StoreUnavailable),
        object_store::Error::NotFound { .. } => Some(Failure::NotFound),
        _ => None,
    }
}

fn refused_credentials(msg: &str) -> bool {
    [
        "401 Unauthorized",
        "403 Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthenticationFailed",
        "169.254.169.254",
    ]
    .iter()
    .any(|needle| msg.contains(needle))
}

/// A "not found" the CLI itself decides (no version matches a short digest, a volume has no
/// such tag), for [`classify`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotFoundError(pub String);

/// A command-line argument the CLI itself finds wrong (a malformed digest), for [`classify`]:
/// exit 2, as clap's own checks.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// What to do, when the messages do not already say.
fn hint(kind: Failure, lines: &[String]) -> Option<&'static str> {
    let all = lines.join("\n");
    if all.contains("169.254.169.254") {
        return Some(
            "no store credentials were found, so the cloud metadata service was asked: set \
             AWS_PROFILE (from ~/.aws/credentials or ~/.aws/config) or AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY",
        );
    }
    match kind {
        Failure::StoreUnavailable if lines.iter().any(|l| refused_credentials(l)) => Some(
            "the store refused the credentials: check AWS_PROFILE / AWS_ACCESS_KEY_ID, \
             GOOGLE_APPLICATION_CREDENTIALS or AZURE_STORAGE_ACCOUNT_KEY, and that they may \
             read and write the bucket",
        ),
        Failure::StoreUnavailable => Some(
            "check the store URL and endpoint (--store, --endpoint, SEALED_STORE_ENDPOINT, \
             AWS_ENDPOINT_URL) and that the server is up; --timeout and --retries bound the wait",
        ),
        Failure::Usage if all.contains("invalid store URL") => Some(
            "write the store as s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, \
             file:///dir, or a plain directory path (/srv/models)",
        ),
        Failure::Corrupt => Some(
            "the version in the store is damaged: push it again from its source (chunks are \
             content-addressed, only the bad ones upload)",
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {source}")]
    struct Outer {
        source: Inner,
    }
    #[derive(Debug, thiserror::Error)]
    #[error("inner failed")]
    struct Inner;

    #[test]
    fn each_level_is_printed_once_cause_last() {
        let e = anyhow::Error::new(Outer { source: Inner }).context("cannot open store x");
        assert_eq!(
            chain_once(&e),
            ["cannot open store x", "outer", "inner failed"]
        );
    }

    #[test]
    fn store_errors_map_to_their_exit_codes() {
        let d = sealed_store::Digest::of(b"x");
        let e = anyhow::Error::new(StoreError::UnknownVersion {
            digest: d,
            store: "s".into(),
        })
        .context("inspect");
        assert_eq!(classify(&e), Failure::NotFound);
        let e = anyhow::Error::new(StoreError::MissingChunk {
            digest: d,
            store: "s".into(),
        });
        assert_eq!(classify(&e), Failure::Corrupt);
        let e = anyhow::anyhow!("Server returned non-2xx status code: 403 Forbidden");
        assert_eq!(classify(&e), Failure::StoreUnavailable);
        assert_eq!(classify(&anyhow::anyhow!("bad flag")), Failure::Other);
        let e = crate::commands::parse_digest("blake3:1234")
            .unwrap_err()
            .context("cannot inspect");
        assert_eq!(classify(&e), Failure::Usage);
    }
}
