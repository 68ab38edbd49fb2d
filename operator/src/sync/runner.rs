//! The sync Job's side of the result protocol (what `sealed-operator sync` runs in a Job pod;
//! the operator's side is `job.rs`): progress as JSON lines on stdout every 5 s, the outcome
//! as JSON in the termination log, and the exit code: 0, 1 (worth a retry) or
//! [`EXIT_PERMANENT`] (a retry cannot help).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sealed_store::ChunkStore;

use super::failure::hide_store;
use super::job::EXIT_PERMANENT;
use super::{Counters, SourceCredentials, SyncFailure, SyncRequest, Termination};

/// How often a running sync prints its counters.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Runs one sync as a Job does. `store` is the result of opening the store named by
/// `store_url` (which is never written to the tenant-visible termination message).
pub async fn run_in_job(
    store: anyhow::Result<ChunkStore>,
    store_url: &str,
    request: &SyncRequest,
    credentials: &SourceCredentials,
    termination_log: &Path,
) -> anyhow::Result<u8> {
    let counters = Arc::new(Counters::default());
    let reporter = {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(PROGRESS_EVERY);
            loop {
                tick.tick().await;
                let snapshot = counters.snapshot();
                if let Ok(line) = serde_json::to_string(&serde_json::json!({"progress": snapshot}))
                {
                    println!("{line}");
                }
            }
        })
    };
    let result = match store {
        Ok(store) => super::run(&store, request, credentials, counters).await,
        Err(e) => {
            // The details name the store: this Job's log (in the operator's namespace) has
            // them; the termination message, which the tenant sees, does not.
            tracing::error!(error = %sealed_sources::redact_urls_in(&format!("{e:#}")), "cannot open the store");
            Err(SyncFailure::transient(
                "StoreUnavailable",
                format!(
                    "cannot open the store: {}; the sync Job's log in the operator's namespace has the details",
                    store_failure_kind(&e, store_url)
                ),
            ))
        }
    };
    reporter.abort();
    let (termination, code) = match result {
        Ok(outcome) => (Termination::Succeeded(outcome), 0),
        Err(failure) => {
            let code = if failure.permanent {
                EXIT_PERMANENT as u8
            } else {
                1
            };
            (Termination::Failed(failure), code)
        }
    };
    let json = serde_json::to_string(&termination)?;
    println!("{json}");
    if let Err(e) = std::fs::write(termination_log, &json) {
        tracing::warn!(path = %termination_log.display(), error = %e, "cannot write the termination log");
    }
    Ok(code)
}

/// What went wrong opening the store, in words that do not name it.
fn store_failure_kind(e: &anyhow::Error, store_url: &str) -> String {
    match e.downcast_ref::<sealed_store::Error>() {
        Some(sealed_store::Error::Timeout { .. }) => "it did not answer in time".into(),
        Some(sealed_store::Error::StoreNotFound { .. }) => "it does not exist".into(),
        Some(sealed_store::Error::InvalidStoreUrl { .. }) => "its URL is invalid".into(),
        Some(sealed_store::Error::Backend { source, .. }) => match source {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => "its credentials were refused".into(),
            object_store::Error::NotFound { .. } => "its bucket or container was not found".into(),
            _ => "a request to it failed".into(),
        },
        Some(other) => {
            let text = hide_store(&other.to_string(), store_url);
            if text.contains("://") {
                "it failed".into()
            } else {
                text
            }
        }
        None => "it failed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_failures_are_worded_without_the_store() {
        let url = "s3://secret-bucket/prefix";
        let e = anyhow::Error::new(sealed_store::Error::InvalidStoreUrl {
            url: url.into(),
            reason: "bad".into(),
        });
        let text = store_failure_kind(&e, url);
        assert_eq!(text, "its URL is invalid");
        assert!(!text.contains("secret-bucket"));
        let other = anyhow::anyhow!("connect to {url} failed");
        assert_eq!(store_failure_kind(&other, url), "it failed");
    }
}
