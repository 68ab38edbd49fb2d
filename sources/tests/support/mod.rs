//! What the source tests share: the servers, trees and hand-made HTTP servers of
//! sealed-test-support (moto, Azurite, the Hub stand-in hack/hub-server.py; a missing tool
//! skips the test, or fails it under SEALED_REQUIRE_SERVERS=1), and the digest `sealed push`
//! gives a tree.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

#[allow(unused_imports)]
pub use sealed_test_support::*;

use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress};

/// The digest `sealed push` gives `dir` (into a memory store).
pub async fn push_digest(dir: &Path) -> Digest {
    push(
        &ChunkStore::memory(),
        dir,
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap()
    .digest
}
