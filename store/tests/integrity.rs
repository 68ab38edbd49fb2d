//! Manifests that lie, and numbers that overflow: every consumer refuses them with an error
//! that names the thing, never wrong bytes, a file outside the destination or a panic.
//!
//! - chunk references whose declared length is not the chunk's (issue 12, item 6): `verify`
//!   reports them corrupt, `pull` fails naming the file and leaves nothing;
//! - a file whose whole-content BLAKE3 is not its content's: `pull` fails naming the file;
//! - symlinks that leave the volume through each other (item 5): the store refuses the
//!   manifest, so `pull`, `verify` and the mount never see it; `push` refuses the tree;
//! - retention and grace periods that overflow the clock (item 7).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sealed_store::gc::{GcOptions, collect};
use sealed_store::pull::{PullOptions, pull};
use sealed_store::push::{PushOptions, push};
use sealed_store::trash::trash_version;
use sealed_store::verify::{ProblemKind, verify};
use sealed_store::{
    ChunkParams, ChunkRef, ChunkStore, Digest, Entry, EntryKind, Error, FileEntry, Manifest,
    NoProgress,
};

fn dir(path: &str) -> Entry {
    Entry {
        path: path.into(),
        kind: EntryKind::Dir,
    }
}

fn link(path: &str, target: &str) -> Entry {
    Entry {
        path: path.into(),
        kind: EntryKind::Symlink {
            target: target.into(),
        },
    }
}

fn file(path: &str, size: u64, blake3: Digest, chunks: Vec<ChunkRef>) -> Entry {
    Entry {
        path: path.into(),
        kind: EntryKind::File(FileEntry {
            executable: false,
            size,
            blake3,
            chunks,
        }),
    }
}

fn chunk(data: &[u8], len: u32) -> ChunkRef {
    ChunkRef {
        digest: Digest::of(data),
        len,
    }
}

/// Stores the chunks and the manifest's bytes as they are (no validation: what a buggy or
/// hostile writer could leave in a store), and returns the version's digest.
async fn store_raw(store: &ChunkStore, chunks: &[&[u8]], manifest: &Manifest) -> Digest {
    for c in chunks {
        store
            .put_chunk(&Digest::of(c), Bytes::copy_from_slice(c))
            .await
            .unwrap();
    }
    store
        .put_manifest(manifest.encode_unchecked())
        .await
        .unwrap()
}

fn manifest(entries: Vec<Entry>) -> Manifest {
    Manifest {
        chunking: ChunkParams::default(),
        entries,
    }
}

/// Nothing at `dest`, and no staging directory beside it.
fn nothing_left(dest: &Path) {
    assert!(!dest.exists(), "{} was created", dest.display());
    let parent = dest.parent().unwrap();
    let left: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `f` is "hello world" (11 bytes) but its one reference names the chunk "hello" (5 bytes)
/// with the length 11: the lengths add up to the size, so the manifest is well formed.
fn short_chunk_manifest() -> Manifest {
    manifest(vec![file(
        "f",
        11,
        Digest::of(b"hello world"),
        vec![chunk(b"hello", 11)],
    )])
}

#[tokio::test]
async fn a_declared_length_that_is_not_the_chunks_is_corruption_in_verify() {
    let store = ChunkStore::memory();
    let m = short_chunk_manifest();
    m.validate().expect("well formed: the lengths add up");
    let digest = store_raw(&store, &[b"hello"], &m).await;
    let report = verify(&store, &digest, 4, Arc::new(NoProgress))
        .await
        .unwrap();
    assert!(!report.ok(), "verify said OK: {report:?}");
    assert_eq!(report.problems.len(), 1);
    let p = &report.problems[0];
    assert_eq!(p.problem, ProblemKind::Corrupt);
    assert_eq!(p.files, vec!["f".to_string()]);
    let detail = p.detail.as_deref().unwrap();
    assert!(
        detail.contains("is 5 bytes but the manifest declares 11"),
        "{detail}"
    );
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["problems"][0]["problem"], "corrupt");
}

#[tokio::test]
async fn verify_checks_every_length_a_digest_is_declared_with() {
    // "hello" is referenced twice: rightly by `a` (5 bytes), wrongly by `b` (6 bytes, with a
    // second chunk one byte short so that b's lengths still add up to its size).
    let store = ChunkStore::memory();
    let m = manifest(vec![
        file("a", 5, Digest::of(b"hello"), vec![chunk(b"hello", 5)]),
        file(
            "b",
            8,
            Digest::of(b"hellowor"),
            vec![chunk(b"hello", 6), chunk(b"wor", 2)],
        ),
    ]);
    let digest = store_raw(&store, &[b"hello", b"wor"], &m).await;
    let report = verify(&store, &digest, 4, Arc::new(NoProgress))
        .await
        .unwrap();
    let mut bad: Vec<(Digest, Vec<String>)> = report
        .problems
        .iter()
        .map(|p| {
            assert_eq!(p.problem, ProblemKind::Corrupt);
            (p.chunk, p.files.clone())
        })
        .collect();
    bad.sort();
    let mut want = vec![
        (Digest::of(b"hello"), vec!["b".to_string()]),
        (Digest::of(b"wor"), vec!["b".to_string()]),
    ];
    want.sort();
    assert_eq!(bad, want, "{report:?}");
}

#[tokio::test]
async fn pull_refuses_a_short_chunk_and_leaves_nothing() {
    let store = ChunkStore::memory();
    let digest = store_raw(&store, &[b"hello"], &short_chunk_manifest()).await;
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    let err = pull(
        &store,
        &digest,
        &dest,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("file 'f'"), "{msg}");
    assert!(
        msg.contains("is 5 bytes but the manifest declares 11"),
        "{msg}"
    );
    nothing_left(&dest);
}

#[tokio::test]
async fn pull_checks_each_files_whole_content_digest() {
    // Every chunk is right; the file's recorded BLAKE3 is not its content's.
    let store = ChunkStore::memory();
    let m = manifest(vec![
        dir("d"),
        file(
            "d/w.bin",
            5,
            Digest::of(b"not hello"),
            vec![chunk(b"hello", 5)],
        ),
    ]);
    let digest = store_raw(&store, &[b"hello"], &m).await;
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    let err = pull(
        &store,
        &digest,
        &dest,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::FileDigestMismatch { path, .. } if path == "d/w.bin"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("file 'd/w.bin'") && msg.contains(&Digest::of(b"hello").to_string()),
        "{msg}"
    );
    nothing_left(&dest);
}

#[tokio::test]
async fn pull_of_a_good_version_still_writes_every_byte() {
    let store = ChunkStore::memory();
    let m = manifest(vec![
        file(
            "f",
            11,
            Digest::of(b"hello world"),
            vec![chunk(b"hello", 5), chunk(b" world", 6)],
        ),
        file("zeros", 8, Digest::of(&[0u8; 8]), vec![chunk(&[0u8; 8], 8)]),
    ]);
    let digest = store_raw(&store, &[b"hello", b" world", &[0u8; 8]], &m).await;
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    pull(
        &store,
        &digest,
        &dest,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(dest.join("f")).unwrap(), b"hello world");
    assert_eq!(std::fs::read(dest.join("zeros")).unwrap(), [0u8; 8]);
}

/// The example: each link is lexically fine, together they leave the volume.
fn chained_escape() -> Manifest {
    manifest(vec![
        dir("a"),
        link("a/up", ".."),
        link("esc", "a/up/../.."),
    ])
}

#[tokio::test]
async fn the_store_refuses_links_that_leave_the_volume_through_each_other() {
    let store = ChunkStore::memory();
    let digest = store_raw(&store, &[], &chained_escape()).await;
    let err = store.get_manifest(&digest).await.unwrap_err().to_string();
    assert!(
        err.contains("symlink 'esc'") && err.contains("'a/up'") && err.contains("outside"),
        "{err}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    let err = pull(
        &store,
        &digest,
        &dest,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("symlink 'esc'"), "{err}");
    nothing_left(&dest);

    let err = verify(&store, &digest, 4, Arc::new(NoProgress))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("symlink 'esc'"), "{err}");
}

#[tokio::test]
async fn push_refuses_a_tree_whose_links_leave_it_through_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("w.bin"), b"weights").unwrap();
    std::os::unix::fs::symlink("..", src.join("a/up")).unwrap();
    std::os::unix::fs::symlink("a/up/../..", src.join("esc")).unwrap();
    let store = ChunkStore::memory();
    let err = push(&store, &src, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&src.join("esc").display().to_string()) && err.contains("outside"),
        "{err}"
    );
    assert!(store.list_versions().await.unwrap().is_empty());

    // Without the second link the tree is fine: `a/up -> ..` stays inside.
    std::fs::remove_file(src.join("esc")).unwrap();
    push(&store, &src, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
}

#[tokio::test]
async fn pull_writes_links_only_inside_the_destination() {
    // Links that stay inside (through each other) and a dangling one are pulled as links.
    let store = ChunkStore::memory();
    let m = manifest(vec![
        dir("a"),
        dir("a/b"),
        link("a/b/top", "../.."),
        link("a/dangling", "missing/x"),
        file("f", 5, Digest::of(b"hello"), vec![chunk(b"hello", 5)]),
        link("via", "a/b/top/f"),
    ]);
    let digest = store_raw(&store, &[b"hello"], &m).await;
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    pull(
        &store,
        &digest,
        &dest,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(dest.join("via")).unwrap(), b"hello");
    let root = dest.canonicalize().unwrap();
    assert_eq!(dest.join("a/b/top").canonicalize().unwrap(), root);
    assert_eq!(
        std::fs::read_link(dest.join("a/dangling")).unwrap(),
        Path::new("missing/x")
    );
}

/// A version of one small file, pushed to `store`.
async fn push_one_file(store: &ChunkStore) -> sealed_store::push::PushReport {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("w.bin"), b"weights").unwrap();
    push(
        store,
        tmp.path(),
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_retention_that_overflows_the_clock_is_an_error_not_a_panic() {
    let store = ChunkStore::memory();
    let report = push_one_file(&store).await;
    for retention in [
        Duration::from_secs(3_000_000_000 * 3600),
        Duration::MAX,
        Duration::from_secs(101 * 365 * 24 * 3600),
    ] {
        let err = trash_version(&store, &report.digest, retention)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("retention") && err.contains("876000h"),
            "{err}"
        );
    }
    // Nothing moved: the version is still live.
    assert!(store.has_manifest(&report.digest).await.unwrap());
    // And the bound itself is fine.
    trash_version(&store, &report.digest, Duration::from_secs(876_000 * 3600))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_grace_period_that_overflows_the_clock_is_an_error_not_a_panic() {
    let store = ChunkStore::memory();
    for grace in [Duration::from_secs(3_000_000_000 * 3600), Duration::MAX] {
        for dry_run in [false, true] {
            let opts = GcOptions {
                grace,
                dry_run,
                writer_wait: Duration::from_millis(100),
                ..Default::default()
            };
            let err = collect(&store, &opts).await.unwrap_err().to_string();
            assert!(
                err.contains("grace period") && err.contains("876000h"),
                "{err}"
            );
        }
    }
    // No marker left behind by the refused runs.
    collect(
        &store,
        &GcOptions {
            grace: Duration::from_secs(3600),
            writer_wait: Duration::from_millis(100),
            ..Default::default()
        },
    )
    .await
    .unwrap();
}

/// A trashed version's manifest stays readable for the readers that hold it (the node plugin
/// resuming a mount), verified: bytes under its trash key that are not that manifest are
/// refused, and a version that was never trashed is `None`.
#[tokio::test]
async fn a_trashed_manifest_is_read_back_verified() {
    use sealed_store::trash::read_trashed_manifest;
    let store = ChunkStore::memory();
    let report = push_one_file(&store).await;
    let live = store.get_manifest_bytes(&report.digest).await.unwrap();
    assert_eq!(
        read_trashed_manifest(&store, &report.digest).await.unwrap(),
        None
    );
    trash_version(&store, &report.digest, Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(store.get_manifest_bytes(&report.digest).await.is_err());
    let trashed = read_trashed_manifest(&store, &report.digest)
        .await
        .unwrap()
        .expect("the trash keeps the manifest");
    assert_eq!(trashed, live);

    // Other bytes under the trash key: refused, never served as the version.
    let key = sealed_store::layout::trash_manifest_key(&report.digest);
    store
        .object_store()
        .put(&key, Bytes::from_static(b"not the manifest").into())
        .await
        .unwrap();
    let err = read_trashed_manifest(&store, &report.digest)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ManifestDigestMismatch { .. }), "{err}");
}
