//! Readahead sizing through the read API: without a disk tier a window as large as the memory
//! tier is capped, so a sequential read fetches every chunk once; on a slow link the window
//! grows past the configured one with the measured bandwidth-delay product, never past the
//! readahead budget.

mod common;

use std::sync::Arc;

use common::*;
use sealed_mount::tree::ROOT_INO;
use sealed_mount::{NodeCache, NodeCacheOptions, ReadaheadPolicy, SealedFs};
use sealed_store::{ChunkStore, Digest, EntryKind};

const MIB: u64 = 1 << 20;

/// A version of one 48 MiB file of random bytes (about 48 chunks), and its bytes.
async fn big_version() -> (tempfile::TempDir, ChunkStore, Digest, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = random_bytes(11, 48 << 20);
    std::fs::write(src.join("big.bin"), &data).unwrap();
    let store = file_store(&tmp.path().join("store")).await;
    let digest = push_dir(&store, &src).await;
    (tmp, store, digest, data)
}

async fn open(
    store: &ChunkStore,
    digest: Digest,
    cache: &NodeCache,
    policy: ReadaheadPolicy,
) -> Arc<SealedFs> {
    Arc::new(open_version(store, digest, cache, policy).await)
}

async fn chunk_count(store: &ChunkStore, digest: &Digest) -> u64 {
    let manifest = store.get_manifest(digest).await.unwrap();
    manifest
        .entries
        .iter()
        .find_map(|e| match &e.kind {
            EntryKind::File(f) => Some(f.chunks.len() as u64),
            _ => None,
        })
        .unwrap()
}

/// Reads big.bin front to back in 1 MiB pieces; `each` sees the cache after every read.
async fn read_through(fs: &SealedFs, mut each: impl FnMut(&NodeCache)) -> Vec<u8> {
    let ino = fs.lookup(ROOT_INO, b"big.bin").unwrap().ino;
    let fh = fs.open(ino, false).unwrap();
    let mut got = Vec::new();
    loop {
        let data = fs
            .read(ino, Some(fh), got.len() as u64, 1 << 20)
            .await
            .unwrap();
        each(fs.cache());
        if data.is_empty() {
            break;
        }
        got.extend_from_slice(&data);
    }
    fs.release(fh);
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_disk_tier_a_window_larger_than_memory_fetches_each_chunk_once() {
    let (_tmp, store, digest, want) = big_version().await;
    let chunks = chunk_count(&store, &digest).await;
    assert!(chunks > 24, "{chunks} chunks");
    // 32 MiB of memory and a 64 MiB window asked for: uncapped, chunks fetched ahead are
    // evicted before the reader gets to them and fetched again. Capped at 8 MiB (a quarter),
    // the window ahead, the window just read and two partly covered chunks fit.
    let cache = NodeCache::new(&NodeCacheOptions {
        memory_bytes: 32 * MIB,
        readahead_bytes: 64 * MIB,
        ..Default::default()
    })
    .unwrap();
    let policy = ReadaheadPolicy {
        initial: 4 * MIB,
        max: 64 * MIB,
    };
    let fs = open(&store, digest, &cache, policy).await;
    let got = read_through(&fs, |_| {}).await;
    assert!(got == want, "the bytes read back differ");
    let m = cache.metrics().snapshot();
    assert_eq!(m.store_fetches, chunks, "every chunk fetched once: {m:?}");
    assert!(m.prefetch_issued > 0, "readahead ran: {m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_link_grows_the_window_within_the_readahead_budget() {
    let (tmp, store, digest, want) = big_version().await;
    let (faulty, slow) = faulty(&store);
    faulty.delay_chunk_gets(100);
    let budget = 16 * MIB;
    let cache = NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(tmp.path().join("cache")),
        disk_bytes: 1 << 30,
        readahead_bytes: budget,
        ..Default::default()
    })
    .unwrap();
    let configured = ReadaheadPolicy {
        initial: MIB,
        max: 2 * MIB,
    };
    let fs = open(&slow, digest, &cache, configured).await;
    let mut widest = 0;
    let got = read_through(&fs, |c| {
        let window = c.metrics().snapshot().readahead_window_bytes;
        assert!(window <= budget, "a {window}-byte window, budget {budget}");
        widest = widest.max(window);
    })
    .await;
    assert!(got == want, "the bytes read back differ");
    // 2 MiB per 100 ms trip shows the link holds more than the window: it grows.
    assert!(
        widest >= 8 * MIB,
        "the window stayed at {widest} bytes on a 100 ms link (configured 2 MiB)"
    );
}
