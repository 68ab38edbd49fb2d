//! Syncs: turning a volume's source into a sealed version, inline or as a Kubernetes Job.
//!
//! Both executors run the same [`run`]; they differ in where it runs and how the operator
//! learns the outcome (shared memory, or the Job pod's termination message).

pub mod credentials;
pub mod executor;
pub mod failure;
pub mod inline;
pub mod job;
pub mod runner;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sealed_crds::Source;
use sealed_sources::{SyncOptions, SyncReporter, sync_source};
use serde::{Deserialize, Serialize};

pub use credentials::SourceCredentials;
pub use executor::Executor;
pub use sealed_sources::{SourcePolicy, SyncOutcome};

/// One sync to run: which volume, from what, why (the trigger), and under which policy.
#[derive(Clone, Debug)]
pub struct SyncRequest {
    pub namespace: String,
    pub name: String,
    pub source: Source,
    /// What started it (`generation=N,resync=...`): a sync is identified by volume + trigger.
    pub trigger: String,
    /// What the source may be and how it is read: the operator's, given to a sync Job as
    /// arguments, and checked again wherever the sync runs.
    pub policy: SourcePolicy,
}

impl SyncRequest {
    /// `namespace/name`, the volume name recorded in the store.
    pub fn volume(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Why a sync failed: `reason` is a CamelCase condition reason (`RepoNotFound`,
/// `AccessDenied`, `SecretNotFound`, ...), `message` says what to do. Never holds a secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncFailure {
    pub reason: String,
    pub message: String,
    /// A retry cannot fix it (missing repo, bad credentials): a Job fails at once.
    #[serde(default)]
    pub permanent: bool,
}

impl SyncFailure {
    /// A failure a retry cannot fix.
    pub fn new(reason: &str, message: impl Into<String>) -> Self {
        SyncFailure {
            reason: reason.into(),
            message: message.into(),
            permanent: true,
        }
    }

    /// A failure that may go away (network, store unavailable): worth a retry.
    pub fn transient(reason: &str, message: impl Into<String>) -> Self {
        SyncFailure {
            permanent: false,
            ..SyncFailure::new(reason, message)
        }
    }
}

/// The last line a sync Job writes to its termination log, read back by the operator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Termination {
    Succeeded(SyncOutcome),
    Failed(SyncFailure),
}

/// Live counters of a running sync.
#[derive(Debug, Default)]
pub struct Counters {
    pub bytes_done: AtomicU64,
    pub bytes_total: AtomicU64,
    pub files_done: AtomicU64,
    pub files_total: AtomicU64,
}

/// A copy of [`Counters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CountersSnapshot {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub files_done: u64,
    pub files_total: u64,
}

/// The source readers count into the counters directly.
impl SyncReporter for Counters {
    fn listed(&self, files: u64, bytes: u64) {
        self.files_total.store(files, Ordering::Relaxed);
        self.bytes_total.store(bytes, Ordering::Relaxed);
    }
    fn advance(&self, bytes: u64) {
        self.bytes_done.fetch_add(bytes, Ordering::Relaxed);
    }
    fn file_done(&self, _path: &str, _bytes: u64) {
        self.files_done.fetch_add(1, Ordering::Relaxed);
    }
}

impl Counters {
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            bytes_total: self.bytes_total.load(Ordering::Relaxed),
            files_done: self.files_done.load(Ordering::Relaxed),
            files_total: self.files_total.load(Ordering::Relaxed),
        }
    }
}

impl CountersSnapshot {
    /// "41% (3.1 GiB of 7.5 GiB, 4/9 files)", for `kubectl get -o wide`.
    pub fn describe(&self) -> String {
        if self.bytes_total == 0 {
            return format!("listing ({} files so far)", self.files_total);
        }
        // In u128: sizes come from the source's listing, whatever it claims.
        let pct =
            u128::from(self.bytes_done.min(self.bytes_total)) * 100 / u128::from(self.bytes_total);
        format!(
            "{pct}% ({} of {}, {}/{} files)",
            human_bytes(self.bytes_done),
            human_bytes(self.bytes_total),
            self.files_done,
            self.files_total
        )
    }
}

/// One home for the size strings of status fields and Events (`sealed_crds`).
pub use sealed_crds::human_bytes;

/// Where a sync stands, as an executor sees it.
#[derive(Clone, Debug, PartialEq)]
pub enum SyncState {
    /// No sync with this trigger is known (never started, or lost with a restart).
    Unknown,
    Running {
        job: Option<String>,
        progress: Option<CountersSnapshot>,
    },
    Finished {
        job: Option<String>,
        result: Result<SyncOutcome, SyncFailure>,
    },
}

/// Runs one sync to the end: stream the source into the store and seal it.
pub async fn run(
    store: &sealed_store::ChunkStore,
    request: &SyncRequest,
    credentials: &SourceCredentials,
    counters: Arc<Counters>,
) -> Result<SyncOutcome, SyncFailure> {
    let options = SyncOptions {
        volume: Some(request.volume()),
        policy: request.policy.clone(),
        ..Default::default()
    };
    let synced = match crate::source_spec::source_spec(&request.source) {
        Ok(spec) => sync_source(store, &spec, credentials, &options, counters).await,
        Err(e) => Err(e),
    };
    synced.map_err(|e| SyncFailure::from_source(&e, store.name(), &request.volume()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line() {
        let s = CountersSnapshot {
            bytes_done: 3 << 30,
            bytes_total: 6 << 30,
            files_done: 4,
            files_total: 9,
        };
        assert_eq!(s.describe(), "50% (3.0 GiB of 6.0 GiB, 4/9 files)");
        assert_eq!(human_bytes(512), "512 B");
        // Sizes a hostile listing claims: no overflow (this panicked in debug builds).
        let huge = CountersSnapshot {
            bytes_done: u64::MAX / 2,
            bytes_total: u64::MAX,
            files_done: 1,
            files_total: 2,
        };
        assert!(huge.describe().starts_with("49% "), "{}", huge.describe());
    }

    #[test]
    fn termination_round_trips() {
        let t = Termination::Failed(SyncFailure::new("RepoNotFound", "no such repo"));
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Termination>(&json).unwrap(), t);
    }
}
