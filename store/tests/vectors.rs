//! Checked-in test vectors pin the format: chunk cut points, chunk digests, manifest bytes and
//! version digests. A dependency bump that moves a single cut point fails here.
//!
//! Regenerate (only for a deliberate format change, with a new manifest version):
//! `SEALED_UPDATE_VECTORS=1 cargo test -p sealed-store --test vectors`

mod support;

use std::path::Path;
use std::sync::Arc;

use sealed_store::chunker::{ChunkParams, chunk_reader, cut_points};
use sealed_store::push::{PushOptions, push};
use sealed_store::{
    ChunkRef, ChunkStore, Digest, Entry, EntryKind, FileEntry, Manifest, NoProgress,
};
use serde_json::{Value, json};
use support::*;

const VECTORS: &str = "tests/vectors/vectors.json";

/// (name, generator, length): inputs are made by `support::pseudo_random` or as zeros.
const CHUNK_CASES: &[(&str, u64, usize)] = &[
    ("empty", 1, 0),
    ("one-byte", 2, 1),
    ("just-under-min", 3, 256 * 1024 - 1),
    ("random-5MiB", 4, 5 << 20),
    ("random-23MiB-odd", 5, (23 << 20) + 12_345),
    ("zeros-10MiB", 0, 10 << 20),
];

fn input(seed: u64, len: usize) -> Vec<u8> {
    if seed == 0 {
        vec![0; len]
    } else {
        pseudo_random(len, seed)
    }
}

fn chunk_vectors() -> Value {
    let params = ChunkParams::default();
    let cases: Vec<Value> = CHUNK_CASES
        .iter()
        .map(|&(name, seed, len)| {
            let data = input(seed, len);
            let streamed = chunk_reader(&data[..], &params, &|_| {}).unwrap();
            // The streaming chunker and the in-memory reference must agree.
            let mut end = 0;
            let ends: Vec<usize> = streamed.chunks.iter().map(|c| { end += c.len as usize; end }).collect();
            assert_eq!(ends, cut_points(&data, &params), "{name}: streaming != in-memory");
            json!({
                "name": name, "seed": seed, "length": len,
                "file_blake3": streamed.blake3.to_string(),
                "cut_points": ends,
                "chunk_blake3": streamed.chunks.iter().map(|c| c.digest.to_string()).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!(cases)
}

/// A tiny manifest built by hand: its exact bytes are pinned, so the encoding cannot drift.
fn tiny_manifest() -> Manifest {
    let data = b"hello, sealed\n";
    Manifest {
        chunking: ChunkParams::default(),
        entries: vec![
            Entry {
                path: "dir".into(),
                kind: EntryKind::Dir,
            },
            Entry {
                path: "dir/hello.txt".into(),
                kind: EntryKind::File(FileEntry {
                    executable: true,
                    size: data.len() as u64,
                    blake3: Digest::of(data),
                    chunks: vec![ChunkRef {
                        digest: Digest::of(data),
                        len: data.len() as u32,
                    }],
                }),
            },
            Entry {
                path: "link".into(),
                kind: EntryKind::Symlink {
                    target: "dir/hello.txt".into(),
                },
            },
        ],
    }
}

async fn tree_digest(root: &Path, threads: Option<usize>) -> Digest {
    let opts = PushOptions {
        threads,
        ..Default::default()
    };
    push(&ChunkStore::memory(), root, &opts, Arc::new(NoProgress))
        .await
        .unwrap()
        .digest
}

async fn all_vectors() -> Value {
    let (bytes, digest) = tiny_manifest().seal().unwrap();
    let tree = tempfile::tempdir().unwrap();
    rich_tree(tree.path());
    json!({
        "chunker": ChunkParams::default(),
        "chunks": chunk_vectors(),
        "tiny_manifest": { "hex": hex::encode(&bytes), "digest": digest.to_string() },
        "rich_tree_digest": tree_digest(tree.path(), Some(1)).await.to_string(),
    })
}

#[tokio::test]
async fn format_matches_checked_in_vectors() {
    let path = manifest_dir().join(VECTORS);
    let actual = all_vectors().await;
    if std::env::var("SEALED_UPDATE_VECTORS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, serde_json::to_string_pretty(&actual).unwrap() + "\n").unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for key in ["chunker", "tiny_manifest", "rich_tree_digest"] {
        assert_eq!(
            actual[key], expected[key],
            "vector '{key}' moved: the format changed"
        );
    }
    let (a, e) = (
        actual["chunks"].as_array().unwrap(),
        expected["chunks"].as_array().unwrap(),
    );
    assert_eq!(a.len(), e.len());
    for (a, e) in a.iter().zip(e) {
        assert_eq!(
            a, e,
            "chunk vector '{}' moved: cut points or chunk digests changed",
            e["name"]
        );
    }
}

#[tokio::test]
async fn tiny_manifest_parses_back_from_pinned_bytes() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(manifest_dir().join(VECTORS)).unwrap())
            .unwrap();
    let bytes = hex::decode(expected["tiny_manifest"]["hex"].as_str().unwrap()).unwrap();
    assert_eq!(Manifest::parse(&bytes).unwrap(), tiny_manifest());
}

#[tokio::test]
async fn same_digest_across_runs_and_thread_counts() {
    let tree = tempfile::tempdir().unwrap();
    rich_tree(tree.path());
    let one = tree_digest(tree.path(), Some(1)).await;
    let all = tree_digest(tree.path(), None).await;
    let again = tree_digest(tree.path(), Some(2)).await;
    assert_eq!(one, all);
    assert_eq!(one, again);
    // And a copy of the tree elsewhere (different inodes, mtimes, absolute paths).
    let copy = tempfile::tempdir().unwrap();
    rich_tree(copy.path());
    assert_eq!(tree_digest(copy.path(), None).await, one);
}
