//! One file's download: what the listing promised ([`RemoteFile`]), the [`Tap`] that hashes it
//! and stops it at the declared size, and whether and when a failed download is retried.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use sha1::Sha1;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncRead, ReadBuf};

use crate::error::SourceError;

/// One file to stream: where it lands in the version and what the source promised.
#[derive(Clone, Debug)]
pub(crate) struct RemoteFile {
    /// Path in the version (relative, `/`-separated).
    pub path: String,
    /// Where the source keeps it (the repository path, the object key).
    pub key: String,
    pub size: u64,
    /// The published SHA-256 (Hub LFS files).
    pub sha256: Option<String>,
    /// The published git blob id, SHA-1 over `blob <size>\0<content>` (Hub non-LFS files).
    pub git_oid: Option<String>,
    /// The ETag the listing showed (object stores).
    pub etag: Option<String>,
}

/// Whether an ingest failed because the stream ended short of (or past) the listed size.
pub(crate) fn short(e: &sealed_store::Error) -> bool {
    matches!(e, sealed_store::Error::FileChanged { .. })
}

/// Why a download that ended at another size than the listing declared failed. Only the
/// declared size, which the tenant's listing already showed: the size that came is a number
/// the tenant did not know.
pub(crate) fn size_mismatch(declared: u64) -> String {
    format!("the download's size differs from the {declared} bytes the listing declared")
}

/// The delay before retry `attempt` (1-based): exponential with jitter (the store's
/// [`RetryPolicy`](sealed_store::retry::RetryPolicy)), in [200 ms, 400 ms) for the first,
/// doubling, every delay under 10 s: sync Jobs that failed at one instant (a source's outage,
/// its 429) do not come back in lockstep.
pub(crate) fn backoff(attempt: u32) -> Duration {
    sealed_store::retry::RetryPolicy::new(Duration::from_millis(200), Duration::from_secs(10))
        .delay(attempt)
}

/// Wraps a download: hashes what passes (SHA-256, and the git blob id when asked),
/// remembers whether the source itself failed, so a broken-off download can be retried while
/// a store failure is not, and stops a download at the size the listing declared
/// ([`overflowed`](Self::overflowed)) instead of reading whatever the server sends.
pub(crate) struct Tap<R> {
    inner: R,
    sha256: Sha256,
    git: Option<Sha1>,
    /// The size the listing declared, and the bytes read so far.
    limit: u64,
    read: u64,
    pub failed: bool,
    /// The source sent more than `limit` bytes; the read failed at that point.
    pub overflowed: bool,
}

/// What a [`Tap`] saw: lowercase hex digests.
pub(crate) struct Tapped {
    pub sha256: String,
    pub git_oid: Option<String>,
}

impl<R> Tap<R> {
    /// A tap over a file the listing declared as `limit` bytes.
    pub fn new(inner: R, limit: u64) -> Self {
        Tap {
            inner,
            sha256: Sha256::new(),
            git: None,
            limit,
            read: 0,
            failed: false,
            overflowed: false,
        }
    }

    /// The message of an [`overflowed`](Self::overflowed) download.
    pub fn overflow_detail(&self) -> String {
        format!(
            "the server sent more than the {} bytes the listing declared; stopped reading there",
            self.limit
        )
    }

    /// Also computes the git blob id of content announced as `size` bytes.
    pub fn with_git_blob(mut self, size: u64) -> Self {
        let mut git = Sha1::new();
        git.update(format!("blob {size}\0").as_bytes());
        self.git = Some(git);
        self
    }

    /// Bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.read
    }

    pub fn finish(self) -> Tapped {
        Tapped {
            sha256: hex::encode(self.sha256.finalize()),
            git_oid: self.git.map(|g| hex::encode(g.finalize())),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Tap<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let fresh = &buf.filled()[before..];
                this.read = this.read.saturating_add(fresh.len() as u64);
                if this.read > this.limit {
                    this.overflowed = true;
                    return Poll::Ready(Err(io::Error::other(this.overflow_detail())));
                }
                this.sha256.update(fresh);
                if let Some(git) = &mut this.git {
                    git.update(fresh);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                this.failed = true;
                Poll::Ready(Err(e))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A request to a source that got no answer: what to retry with (the failure, redacted), or
/// the error to stop with. An address the policy refuses (a name that resolves there, a
/// redirect hop) is permanent and the tenant's to change; a refused redirect (https to http,
/// too many) cannot be helped by retrying; anything else is retried unless this was the
/// `last` attempt. `what` names the source and the object asked for.
pub(crate) fn send_failure(
    e: &reqwest::Error,
    what: &str,
    secrets: &[String],
    last: bool,
) -> Result<String, SourceError> {
    if let Some(refused) = crate::egress::refused_in(e) {
        return Err(SourceError::Refused(format!(
            "{what}: {}",
            crate::redact::redact(&refused.to_string(), secrets)
        )));
    }
    let detail = crate::redact::redact(&crate::redact::error_chain(e), secrets);
    if e.is_redirect() {
        return Err(SourceError::Protocol {
            what: what.to_owned(),
            detail,
        });
    }
    if last {
        return Err(SourceError::Unavailable {
            what: what.to_owned(),
            detail,
        });
    }
    Ok(detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Downloads that broke off at one instant retry out of step, in bounds.
    #[test]
    fn retries_are_jittered_and_bounded() {
        let firsts: std::collections::BTreeSet<_> = (0..100).map(|_| backoff(1)).collect();
        assert!(firsts.len() > 10, "first retries in lockstep: {firsts:?}");
        assert!(
            firsts
                .iter()
                .all(|d| *d >= Duration::from_millis(200) && *d < Duration::from_millis(400)),
            "{firsts:?}"
        );
        for attempt in [2, 5, 9, 40, u32::MAX] {
            let d = backoff(attempt);
            assert!(
                d >= Duration::from_millis(200) && d < Duration::from_secs(10),
                "{d:?}"
            );
        }
    }
}
