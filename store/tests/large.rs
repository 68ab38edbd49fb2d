//! Files over 4 GiB round-trip (sparse on both sides), so no 32-bit size sneaks in.

mod support;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::Arc;

use sealed_store::pull::{PullOptions, pull};
use sealed_store::{EntryKind, NoProgress};
use support::*;

#[tokio::test]
async fn file_over_4_gib_round_trips() {
    let size: u64 = (4 << 30) + (3 << 20) + 7;
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let path = src.join("big.bin");
    let f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len(size).unwrap();
    // Data at the start, across the 4 GiB boundary and at the very end.
    for (offset, seed) in [(0u64, 1u64), ((4 << 30) - 1000, 2), (size - 5000, 3)] {
        f.write_all_at(&pseudo_random(3000, seed), offset).unwrap();
    }
    drop(f);

    let store = file_store(&work.path().join("store")).await;
    let report = push_dir(&store, &src).await;
    assert_eq!(report.bytes, size);
    // Zero runs dedup to one max-size chunk: far less than 4 GiB is stored.
    assert!(
        report.bytes_uploaded < 64 << 20,
        "uploaded {}",
        report.bytes_uploaded
    );
    let manifest = store.get_manifest(&report.digest).await.unwrap();
    let EntryKind::File(entry) = &manifest.entries[0].kind else {
        panic!("not a file")
    };
    assert_eq!(entry.size, size);

    let out = work.path().join("out");
    pull(
        &store,
        &report.digest,
        &out,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    let pulled = out.join("big.bin");
    let meta = std::fs::metadata(&pulled).unwrap();
    assert_eq!(meta.len(), size);
    assert!(meta.blocks() * 512 < 256 << 20, "pulled file is not sparse");
    let mut hasher = blake3::Hasher::new();
    hasher.update_mmap_rayon(&pulled).unwrap();
    assert_eq!(
        hasher.finalize().as_bytes(),
        entry.blake3.as_bytes(),
        "b3sum of the pulled file"
    );
}
