//! Bridges a sync request to the source readers in [`crate::source`].

use std::sync::Arc;

use sealed_store::ChunkStore;

use crate::sync::{Counters, Credentials, SyncFailure, SyncOutcome, SyncRequest};

pub async fn sync(
    _store: &ChunkStore,
    _request: &SyncRequest,
    _credentials: &Credentials,
    _counters: Arc<Counters>,
) -> Result<SyncOutcome, SyncFailure> {
    Err(SyncFailure::new(
        "NotWired",
        "WIP: source readers not wired yet",
    ))
}
