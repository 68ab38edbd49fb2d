//! Ingest (sealing from streams) gives exactly the digest a push of the same files gives.

mod support;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::StreamExt;
use sealed_store::ingest::{Ingest, IngestOptions, IngestReport};
use sealed_store::{ChunkStore, NoProgress};
use support::{file_store, pseudo_random, push_dir, rich_tree};
use tokio::io::{AsyncRead, ReadBuf};

/// What a walk of the tree finds, in the order the walk finds it.
enum Item {
    Dir(String),
    File {
        rel: String,
        path: std::path::PathBuf,
        executable: bool,
        size: u64,
    },
    Link(String, String),
}

fn walk(root: &Path, rel: &str, out: &mut Vec<Item>) {
    let dir = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let child = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        let meta = fs::symlink_metadata(e.path()).unwrap();
        if meta.file_type().is_symlink() {
            let target = fs::read_link(e.path()).unwrap();
            out.push(Item::Link(child, target.to_str().unwrap().to_owned()));
        } else if meta.is_dir() {
            out.push(Item::Dir(child.clone()));
            walk(root, &child, out);
        } else {
            out.push(Item::File {
                rel: child,
                path: e.path(),
                executable: meta.permissions().mode() & 0o111 != 0,
                size: meta.len(),
            });
        }
    }
}

/// Streams every file of `root` into an ingest, `parallel` files at once, directories only
/// when they are empty (parents of files are implied).
async fn ingest_dir(store: &ChunkStore, root: &Path, parallel: usize) -> IngestReport {
    let mut items = Vec::new();
    walk(root, "", &mut items);
    let ingest = Ingest::new(store, &IngestOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    let mut files = Vec::new();
    for item in items {
        match item {
            Item::Dir(rel) => {
                if fs::read_dir(root.join(&rel)).unwrap().next().is_none() {
                    ingest.add_dir(&rel).unwrap();
                }
            }
            Item::Link(rel, target) => ingest.add_symlink(&rel, &target).unwrap(),
            Item::File {
                rel,
                path,
                executable,
                size,
            } => files.push((rel, path, executable, size)),
        }
    }
    let ingest_ref = &ingest;
    futures::stream::iter(files)
        .map(|(rel, path, executable, size)| async move {
            let file = tokio::fs::File::open(&path).await.unwrap();
            ingest_ref
                .add_file(&rel, executable, Some(size), file)
                .await
                .unwrap();
        })
        .buffer_unordered(parallel)
        .collect::<Vec<()>>()
        .await;
    ingest.seal().await.unwrap()
}

/// A tree with nested directories, an empty file, an executable, a file over 8 MiB, a file
/// shorter than the minimum chunk, symlinks and empty directories.
fn tree(root: &Path) {
    rich_tree(root);
    fs::write(root.join("weights/tiny.bin"), pseudo_random(1000, 9)).unwrap();
    fs::write(
        root.join("weights/shards/big.bin"),
        pseudo_random(17 << 20, 10),
    )
    .unwrap();
}

#[tokio::test]
async fn ingest_matches_push_on_memory_store() {
    let dir = tempfile::tempdir().unwrap();
    tree(dir.path());
    let pushed = push_dir(&ChunkStore::memory(), dir.path()).await;
    let store = ChunkStore::memory();
    let ingested = ingest_dir(&store, dir.path(), 1).await;
    assert_eq!(ingested.digest, pushed.digest);
    assert_eq!(ingested.files, pushed.files);
    assert_eq!(ingested.directories, pushed.directories);
    assert_eq!(ingested.symlinks, pushed.symlinks);
    assert_eq!(ingested.bytes_uploaded, pushed.bytes_uploaded);
    // The sealed manifest is readable and every chunk it names is in the store.
    let manifest = store.get_manifest(&ingested.digest).await.unwrap();
    for chunk in manifest.unique_chunks() {
        store.get_chunk(&chunk.digest).await.unwrap();
    }
    // Several files at once seal the same version, reusing every chunk.
    let again = ingest_dir(&store, dir.path(), 4).await;
    assert_eq!(again.digest, pushed.digest);
    assert_eq!(again.bytes_uploaded, 0);
    assert_eq!(again.bytes_reused, pushed.bytes_uploaded);
}

#[tokio::test]
async fn ingest_matches_push_on_local_file_store() {
    let dir = tempfile::tempdir().unwrap();
    tree(dir.path());
    let stores = tempfile::tempdir().unwrap();
    let pushed = push_dir(&file_store(&stores.path().join("a")).await, dir.path()).await;
    let store = file_store(&stores.path().join("b")).await;
    let ingested = ingest_dir(&store, dir.path(), 3).await;
    assert_eq!(ingested.digest, pushed.digest);
    assert!(store.has_manifest(&ingested.digest).await.unwrap());
    // The lease is gone once sealed.
    assert!(
        sealed_store::writer_lease::list_leases(&store)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn volume_record_is_written() {
    let store = ChunkStore::memory();
    let opts = IngestOptions {
        volume: Some("ml/demo".into()),
        ..Default::default()
    };
    let ingest = Ingest::new(&store, &opts, Arc::new(NoProgress))
        .await
        .unwrap();
    ingest
        .add_file("a/b.txt", false, None, &b"hello"[..])
        .await
        .unwrap();
    let report = ingest.seal().await.unwrap();
    let records = store.list_volume_records().await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].volume, "ml/demo");
    assert_eq!(records[0].digest, report.digest);
}

/// Yields `data`, then fails.
struct Failing {
    data: Vec<u8>,
}

impl AsyncRead for Failing {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.data.is_empty() {
            return Poll::Ready(Err(std::io::Error::other("connection reset by source")));
        }
        let n = buf.remaining().min(self.data.len());
        let rest = self.data.split_off(n);
        buf.put_slice(&self.data);
        self.data = rest;
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn bad_streams_seal_nothing() {
    let store = ChunkStore::memory();
    let ingest = Ingest::new(&store, &IngestOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    // A truncated stream (fewer bytes than announced) fails the file.
    let short = pseudo_random(3 << 20, 4);
    let err = ingest
        .add_file("short.bin", false, Some(4 << 20), &short[..])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("announced"), "{err}");
    // A source error fails the file with the source's message.
    let err = ingest
        .add_file(
            "broken.bin",
            false,
            None,
            Failing {
                data: pseudo_random(5 << 20, 5),
            },
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("connection reset"), "{err}");
    // A retry of the same path after a failure is fine; a second copy is not.
    ingest
        .add_file("short.bin", false, Some(short.len() as u64), &short[..])
        .await
        .unwrap();
    assert!(
        ingest
            .add_file("short.bin", false, None, &b""[..])
            .await
            .is_err()
    );
    // Bad paths and links are refused.
    assert!(
        ingest
            .add_file("../x", false, None, &b""[..])
            .await
            .is_err()
    );
    assert!(ingest.add_symlink("up", "../../etc/passwd").is_err());
    ingest.abort().await;
    assert!(store.list_versions().await.unwrap().is_empty());
    assert!(
        sealed_store::writer_lease::list_leases(&store)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_file_cannot_be_a_directory_too() {
    let store = ChunkStore::memory();
    let ingest = Ingest::new(&store, &IngestOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    ingest.add_file("a", false, None, &b"x"[..]).await.unwrap();
    ingest
        .add_file("a/b", false, None, &b"y"[..])
        .await
        .unwrap();
    let err = ingest.seal().await.unwrap_err();
    assert!(err.to_string().contains("both a file"), "{err}");
    assert!(store.list_versions().await.unwrap().is_empty());
}
