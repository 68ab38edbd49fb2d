//! Garbage collection by a host whose clock runs 20 minutes ahead (libfaketime, Debian's
//! `faketime`) while a writer holds a lease and reuses chunks that no manifest names yet:
//! the collector must judge the lease by the store's clock, defer to it, and delete nothing
//! the writer is about to seal. Before the fix it judged the lease expired by its own clock,
//! deleted it and the reused chunks, and the writer sealed a version with chunks missing.
//!
//! Skipped (with a notice) when libfaketime is not installed, unless
//! `SEALED_REQUIRE_SERVERS=1` (CI), where that is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use sealed_store::ingest::{Ingest, IngestOptions};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, NoProgress, StoreOptions};

fn libfaketime() -> Option<PathBuf> {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
    ];
    candidates.iter().map(PathBuf::from).find(|p| p.is_file())
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    let mut x = u64::from(seed) + 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A `file://` store under `dir/store`, made on first use: its URL and the opened store.
async fn file_store(dir: &Path) -> (String, ChunkStore) {
    let url = format!("file://{}", dir.join("store").display());
    let store = ChunkStore::open(
        &url,
        &StoreOptions {
            create: true,
            ..Default::default()
        },
    )
    .await
    .expect("store");
    (url, store)
}

/// `sealed gc` in another process whose clock is `offset` ahead.
fn skewed_gc(lib: &Path, store: &str, offset: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sealed"))
        .args([
            "gc",
            "--grace",
            "0s",
            "--writer-wait",
            "0s",
            "--store",
            store,
        ])
        .env("LD_PRELOAD", lib)
        .env("FAKETIME", offset)
        // Only the wall clock moves; the monotonic clock the renewals use does not.
        .env("DONT_FAKE_MONOTONIC", "1")
        .output()
        .expect("run sealed gc")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_whose_clock_runs_ahead_defers_to_a_live_writer() {
    let Some(lib) = libfaketime() else {
        assert!(
            std::env::var("SEALED_REQUIRE_SERVERS").as_deref() != Ok("1"),
            "libfaketime is not installed (apt-get install faketime)"
        );
        eprintln!("skipped: libfaketime is not installed (apt-get install faketime)");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (url, store) = file_store(dir.path()).await;

    // The faked clock is really ahead in that process.
    let date = Command::new("date")
        .arg("+%s")
        .env("LD_PRELOAD", &lib)
        .env("FAKETIME", "+20m")
        .output()
        .expect("date");
    let faked: i64 = String::from_utf8_lossy(&date.stdout)
        .trim()
        .parse()
        .expect("date prints seconds");
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    assert!(
        (faked - real - 1200).abs() < 30,
        "libfaketime did not move the clock: {faked} vs {real}"
    );

    // Chunks in the store that no manifest names: a version whose manifest went away.
    let tree = tempfile::tempdir().expect("tempdir");
    let weights = data(12 << 20, 7);
    std::fs::write(tree.path().join("weights.bin"), &weights).expect("write");
    let old = push(
        &store,
        tree.path(),
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .expect("push")
    .digest;
    std::fs::remove_file(dir.path().join("store/manifests").join(old.hex()))
        .expect("remove the old manifest");

    // A writer takes its lease and streams the same bytes: every chunk is found present and
    // reused, none uploaded.
    let ingest = Ingest::new(&store, &IngestOptions::default(), Arc::new(NoProgress))
        .await
        .expect("ingest");
    ingest
        .add_file(
            "weights.bin",
            false,
            Some(weights.len() as u64),
            std::io::Cursor::new(weights.clone()),
        )
        .await
        .expect("add");

    // Meanwhile a collector 20 minutes ahead runs.
    let out = skewed_gc(&lib, &url, "+20m");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "sealed gc failed: {report}");

    // The writer seals; whatever the collector did, the sealed version must be whole, or
    // the seal must fail. Never a sealed version with chunks missing.
    match ingest.seal().await {
        Ok(sealed) => {
            assert_eq!(sealed.digest, old, "same bytes, same digest");
            let manifest = store.get_manifest(&sealed.digest).await.expect("manifest");
            let mut missing = 0;
            for chunk in manifest.unique_chunks() {
                if !store.has_chunk(&chunk.digest).await.expect("head") {
                    missing += 1;
                }
            }
            assert_eq!(
                missing,
                0,
                "sealed {} with {missing} of {} chunks missing; the collector said: {report}",
                sealed.digest,
                manifest.unique_chunks().len()
            );
            assert!(
                report.contains("skipped") || report.contains("writer"),
                "the collector should have deferred to the writer: {report}"
            );
        }
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("lease"),
                "the seal failed, but not for its lease: {e}"
            );
        }
    }
}

/// A writer whose lease object was deleted behind its back (by a collector that judged it
/// expired, or by hand) seals nothing: before the fix it only checked its own timers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_whose_lease_was_taken_away_seals_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_url, store) = file_store(dir.path()).await;
    let ingest = Ingest::new(&store, &IngestOptions::default(), Arc::new(NoProgress))
        .await
        .expect("ingest");
    let bytes = data(3 << 20, 9);
    ingest
        .add_file(
            "a.bin",
            false,
            Some(bytes.len() as u64),
            std::io::Cursor::new(bytes),
        )
        .await
        .expect("add");
    let leases = dir.path().join("store/leases");
    for entry in std::fs::read_dir(&leases).expect("leases dir") {
        std::fs::remove_file(entry.expect("entry").path()).expect("remove the lease");
    }
    let err = ingest.seal().await.expect_err("sealed without its lease");
    assert!(err.to_string().contains("taken away"), "{err}");
    assert!(
        std::fs::read_dir(dir.path().join("store/manifests"))
            .map(|d| d.count())
            .unwrap_or(0)
            == 0,
        "a manifest was written"
    );
}
