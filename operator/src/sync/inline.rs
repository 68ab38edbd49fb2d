//! The inline executor: syncs run as tasks of the operator process. For small clusters and
//! for tests against an API server without a kubelet. A sync lost to an operator restart is
//! started again (the store makes that cheap: chunks already uploaded are skipped).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sealed_store::ChunkStore;

use super::{Counters, SourceCredentials, SyncFailure, SyncOutcome, SyncRequest, SyncState};
use crate::metrics::Metrics;

struct Running {
    trigger: String,
    counters: Arc<Counters>,
    result: Arc<Mutex<Option<Result<SyncOutcome, SyncFailure>>>>,
    task: tokio::task::AbortHandle,
}

pub struct InlineExecutor {
    store: ChunkStore,
    metrics: Arc<Metrics>,
    syncs: Mutex<HashMap<(String, String), Running>>,
}

impl InlineExecutor {
    /// The volume controller polls a running sync (every 2 s) for progress and its end.
    pub fn new(store: ChunkStore, metrics: Arc<Metrics>) -> Self {
        InlineExecutor {
            store,
            metrics,
            syncs: Mutex::new(HashMap::new()),
        }
    }

    /// Starts the sync unless one with this trigger is already running or done; a sync of an
    /// older trigger for the same volume is cancelled.
    pub fn start(&self, request: SyncRequest, credentials: SourceCredentials) {
        let key = (request.namespace.clone(), request.name.clone());
        let mut syncs = self.syncs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = syncs.get(&key) {
            if old.trigger == request.trigger {
                return;
            }
            old.task.abort();
        }
        let counters = Arc::new(Counters::default());
        let result = Arc::new(Mutex::new(None));
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let (task_counters, task_result) = (counters.clone(), result.clone());
        let trigger = request.trigger.clone();
        let task = tokio::spawn(async move {
            let _running = RunningGauge::new(&metrics);
            let outcome = super::run(&store, &request, &credentials, task_counters).await;
            *task_result.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
        });
        syncs.insert(
            key,
            Running {
                trigger,
                counters,
                result,
                task: task.abort_handle(),
            },
        );
    }

    pub fn state(&self, namespace: &str, name: &str, trigger: &str) -> SyncState {
        let syncs = self.syncs.lock().unwrap_or_else(|p| p.into_inner());
        let Some(run) = syncs.get(&(namespace.to_string(), name.to_string())) else {
            return SyncState::Unknown;
        };
        if run.trigger != trigger {
            return SyncState::Unknown;
        }
        let result = run.result.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match result {
            Some(result) => SyncState::Finished { job: None, result },
            None => SyncState::Running {
                job: None,
                progress: Some(run.counters.snapshot()),
            },
        }
    }

    /// Forgets a finished sync once its outcome is recorded in the volume's status, and
    /// cancels any sync of a volume that is gone.
    pub fn forget(&self, namespace: &str, name: &str) {
        let mut syncs = self.syncs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(run) = syncs.remove(&(namespace.to_string(), name.to_string())) {
            run.task.abort();
        }
    }
}

/// Counts a sync in `syncs_running` for as long as its task lives, aborted or not.
struct RunningGauge(prometheus::IntGauge);

impl RunningGauge {
    fn new(metrics: &Metrics) -> Self {
        metrics.syncs_running.inc();
        RunningGauge(metrics.syncs_running.clone())
    }
}

impl Drop for RunningGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}
