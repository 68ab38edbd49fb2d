//! The stat cache: a re-push of an unchanged tree reads no file bytes and seals the same
//! digest; a changed file is read however its mtime was put back; a damaged cache is ignored;
//! a file the cache vouches for whose chunks the store lacks is still uploaded.

mod support;

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sealed_store::push::{PushOptions, PushReport, StatCachePolicy, push};
use sealed_store::stat_cache::StatCacheConfig;
use sealed_store::verify::verify;
use sealed_store::{ChunkStore, NoProgress};
use sealed_test_support::trees::pseudo_random;
use support::file_store;

const WINDOW: Duration = Duration::from_millis(50);

struct Fixture {
    _tmp: tempfile::TempDir,
    tree: std::path::PathBuf,
    store: ChunkStore,
    cfg: StatCacheConfig,
}

/// A tree of three files (one spanning several chunks), old enough to be outside `WINDOW`.
async fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let tree = tmp.path().join("tree");
    fs::create_dir_all(tree.join("sub")).unwrap();
    fs::write(tree.join("big.bin"), pseudo_random(9 << 20, 1)).unwrap();
    fs::write(tree.join("sub/small.txt"), b"hello").unwrap();
    fs::write(tree.join("empty"), b"").unwrap();
    let store = file_store(&tmp.path().join("store")).await;
    let cfg = StatCacheConfig {
        dir: tmp.path().join("cache"),
        racy_window: WINDOW,
    };
    std::thread::sleep(WINDOW * 2);
    Fixture {
        _tmp: tmp,
        tree,
        store,
        cfg,
    }
}

async fn push_with(f: &Fixture, policy: StatCachePolicy) -> PushReport {
    let opts = PushOptions {
        stat_cache: policy,
        ..Default::default()
    };
    push(&f.store, &f.tree, &opts, Arc::new(NoProgress))
        .await
        .unwrap()
}

fn using(f: &Fixture) -> StatCachePolicy {
    StatCachePolicy::Use(f.cfg.clone())
}

const TOTAL: u64 = (9 << 20) + 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_tree_re_pushes_without_reading_a_byte() {
    let f = fixture().await;
    let first = push_with(&f, using(&f)).await;
    assert_eq!(first.bytes_read, TOTAL);
    assert_eq!(first.files_cached, 0);

    let again = push_with(&f, using(&f)).await;
    assert_eq!(again.digest, first.digest);
    assert_eq!(again.bytes_read, 0, "an unchanged tree is not read");
    assert_eq!(again.files_cached, 3);
    assert_eq!(again.bytes_uploaded, 0);
    assert_eq!(again.bytes_reused, first.bytes_uploaded);

    // --rehash reads everything and finds the same digest; so does a push without a cache.
    let rehashed = push_with(&f, StatCachePolicy::Rehash(f.cfg.clone())).await;
    assert_eq!(rehashed.digest, first.digest);
    assert_eq!(rehashed.bytes_read, TOTAL);
    assert_eq!(rehashed.files_cached, 0);
    let plain = push_with(&f, StatCachePolicy::Off).await;
    assert_eq!(plain.digest, first.digest);
    assert_eq!(plain.bytes_read, TOTAL);
}

/// Rewrites `path` in place with `data` (same size) and puts its mtime back as it was:
/// only ctime still says it changed.
fn rewrite_keeping_mtime(path: &Path, data: &[u8]) {
    let before = fs::metadata(path).unwrap();
    fs::write(path, data).unwrap();
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    use std::os::unix::fs::MetadataExt;
    let times = [
        libc::timespec {
            tv_sec: before.atime(),
            tv_nsec: before.atime_nsec(),
        },
        libc::timespec {
            tv_sec: before.mtime(),
            tv_nsec: before.mtime_nsec(),
        },
    ];
    // SAFETY: a valid NUL-terminated path and two timespecs, as utimensat(2) wants.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) };
    assert_eq!(rc, 0, "utimensat: {}", std::io::Error::last_os_error());
    let after = fs::metadata(path).unwrap();
    assert_eq!(
        (after.len(), after.mtime(), after.mtime_nsec(), after.ino()),
        (
            before.len(),
            before.mtime(),
            before.mtime_nsec(),
            before.ino()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_changed_with_its_mtime_put_back_is_read_again() {
    let f = fixture().await;
    let first = push_with(&f, using(&f)).await;
    // Within the racy window of the real default, same size, mtime forged back.
    rewrite_keeping_mtime(&f.tree.join("sub/small.txt"), b"HELLO");
    let again = push_with(&f, using(&f)).await;
    assert_ne!(again.digest, first.digest);
    assert_eq!(again.bytes_read, 5, "only the changed file is read");
    assert_eq!(again.files_cached, 2);
    let plain = push_with(&f, StatCachePolicy::Off).await;
    assert_eq!(
        again.digest, plain.digest,
        "the same digest as without a cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_written_within_the_racy_window_are_not_trusted() {
    let f = fixture().await;
    let strict = StatCacheConfig {
        racy_window: Duration::from_secs(3600),
        ..f.cfg.clone()
    };
    push_with(&f, StatCachePolicy::Use(strict.clone())).await;
    let again = push_with(&f, StatCachePolicy::Use(strict)).await;
    assert_eq!(again.bytes_read, TOTAL);
    assert_eq!(again.files_cached, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_cache_is_ignored() {
    let f = fixture().await;
    let first = push_with(&f, using(&f)).await;
    let file = f.cfg.file_for(&f.tree, f.store.name());
    let good = fs::read(&file).unwrap();
    let mut bad = good.clone();
    let at = bad.len() - 40;
    bad[at] ^= 0x55;
    for damaged in [
        bad,
        good[..good.len() / 2].to_vec(),
        b"not a cache".to_vec(),
    ] {
        fs::write(&file, &damaged).unwrap();
        let again = push_with(&f, using(&f)).await;
        assert_eq!(again.digest, first.digest);
        assert_eq!(again.bytes_read, TOTAL, "a damaged cache is not trusted");
    }
    // And it was rewritten whole.
    let healed = push_with(&f, using(&f)).await;
    assert_eq!(healed.bytes_read, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_files_whose_chunks_the_store_lacks_are_uploaded() {
    let f = fixture().await;
    let first = push_with(&f, using(&f)).await;
    // The version gone and one chunk of big.bin with it (as a collection of a trashed
    // version would leave it).
    let manifest = f.store.get_manifest(&first.digest).await.unwrap();
    let big = manifest
        .files()
        .find(|(p, _)| *p == "big.bin")
        .unwrap()
        .1
        .clone();
    assert!(big.chunks.len() > 2);
    let raw = f.store.object_store();
    raw.delete(&ChunkStore::manifest_key(&first.digest))
        .await
        .unwrap();
    raw.delete(&ChunkStore::chunk_key(&big.chunks[1].digest))
        .await
        .unwrap();

    let again = push_with(&f, using(&f)).await;
    assert_eq!(again.digest, first.digest);
    assert_eq!(
        again.bytes_read,
        9 << 20,
        "only the file with a missing chunk"
    );
    assert_eq!(again.files_cached, 2);
    assert_eq!(again.chunks_uploaded, 1);
    assert_eq!(again.bytes_uploaded, u64::from(big.chunks[1].len));
    let report = verify(&f.store, &again.digest, 4, Arc::new(NoProgress))
        .await
        .unwrap();
    assert!(report.ok(), "{:?}", report.problems);
}
