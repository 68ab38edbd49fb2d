//! Shared test support: deterministic trees and the real servers tests run against
//! (moto's S3 server from PyPI, Azurite from npm), started on loopback ports.
#![allow(dead_code)]

// The servers and trees every crate's tests share.
pub use sealed_test_support::*;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sealed_store::push::{PushOptions, PushReport, push};
use sealed_store::{ChunkStore, NoProgress, StoreOptions};

pub async fn push_dir(store: &ChunkStore, dir: &Path) -> PushReport {
    push(store, dir, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap()
}

pub async fn file_store(dir: &Path) -> ChunkStore {
    fs::create_dir_all(dir).unwrap();
    ChunkStore::open(
        &format!("file://{}", dir.display()),
        &StoreOptions::default(),
    )
    .await
    .unwrap()
}

pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Opens an S3 store on a moto server (credentials are any non-empty values for moto).
pub async fn moto_store(server: &Server, bucket: &str, prefix: &str) -> ChunkStore {
    set_test_credentials();
    let opts = StoreOptions {
        endpoint: Some(format!("http://127.0.0.1:{}", server.port)),
        region: Some("us-east-1".into()),
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    ChunkStore::open(&format!("s3://{bucket}/{prefix}"), &opts)
        .await
        .unwrap()
}

pub fn azurite_options(server: &Server) -> StoreOptions {
    set_test_credentials();
    StoreOptions {
        endpoint: Some(azurite_endpoint(server.port)),
        timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

fn set_test_credentials() {
    // SAFETY: set before any store reads the environment; every test sets the same values.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
        std::env::set_var("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT);
        std::env::set_var("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY);
    }
}
