//! Where syncs run ([`crate::config::SyncExecutor`]): as tasks of the operator
//! ([`InlineExecutor`]) or as Kubernetes Jobs ([`JobExecutor`]). The volume reconciler sees
//! only this trait: start a sync, ask where it stands, forget it once recorded.

use std::time::Duration;

use futures::future::BoxFuture;

use super::inline::InlineExecutor;
use super::job::JobExecutor;
use super::{SourceCredentials, SyncRequest, SyncState};
use crate::error::Result;

pub trait Executor: Send + Sync {
    /// How soon the reconciler looks again at a running sync.
    fn poll_interval(&self) -> Duration;

    /// Starts `request` (starting the same request again is a no-op). Returns the Job's name
    /// when the sync runs in one.
    fn start<'a>(
        &'a self,
        request: &'a SyncRequest,
        credentials: SourceCredentials,
    ) -> BoxFuture<'a, Result<Option<String>>>;

    /// Where the sync of `request` (its volume and trigger) stands.
    fn state<'a>(&'a self, request: &'a SyncRequest) -> BoxFuture<'a, Result<SyncState>>;

    /// The sync of this volume is recorded in its status, or the volume is gone: let go of
    /// it (cancelling it if it still runs). Jobs clean up after themselves.
    fn forget(&self, _namespace: &str, _name: &str) {}
}

impl Executor for InlineExecutor {
    fn poll_interval(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn start<'a>(
        &'a self,
        request: &'a SyncRequest,
        credentials: SourceCredentials,
    ) -> BoxFuture<'a, Result<Option<String>>> {
        InlineExecutor::start(self, request.clone(), credentials);
        Box::pin(async { Ok(None) })
    }

    fn state<'a>(&'a self, request: &'a SyncRequest) -> BoxFuture<'a, Result<SyncState>> {
        let state =
            InlineExecutor::state(self, &request.namespace, &request.name, &request.trigger);
        Box::pin(async { Ok(state) })
    }

    fn forget(&self, namespace: &str, name: &str) {
        InlineExecutor::forget(self, namespace, name);
    }
}

impl Executor for JobExecutor {
    fn poll_interval(&self) -> Duration {
        Duration::from_secs(15)
    }

    fn start<'a>(
        &'a self,
        request: &'a SyncRequest,
        credentials: SourceCredentials,
    ) -> BoxFuture<'a, Result<Option<String>>> {
        Box::pin(async move { Ok(Some(JobExecutor::start(self, request, &credentials).await?)) })
    }

    fn state<'a>(&'a self, request: &'a SyncRequest) -> BoxFuture<'a, Result<SyncState>> {
        Box::pin(JobExecutor::state(self, request))
    }
}
