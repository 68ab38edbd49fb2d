//! The plain read API, driven without a kernel: every byte, listings, attributes, single
//! flight, corruption, an unreachable store, and the disk cache's bound and reuse.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rand::{Rng, SeedableRng};
use sealed_mount::tree::ROOT_INO;
use sealed_mount::{
    FetchPolicy, FsError, NodeCache, NodeCacheOptions, NodeType, ReadaheadPolicy, SealedFs,
};
use sealed_store::{ChunkStore, Digest, EntryKind};

async fn open_fs(store: &ChunkStore, digest: Digest, cache: &NodeCache) -> Arc<SealedFs> {
    Arc::new(open_version(store, digest, cache, ReadaheadPolicy::default()).await)
}

fn resolve(fs: &SealedFs, path: &str) -> u64 {
    let mut ino = ROOT_INO;
    for part in path.split('/') {
        ino = fs.lookup(ino, part.as_bytes()).unwrap().ino;
    }
    ino
}

async fn read_all(fs: &SealedFs, ino: u64, piece: u32) -> Vec<u8> {
    let fh = fs.open(ino, false).unwrap();
    let mut out = Vec::new();
    loop {
        let data = fs
            .read(ino, Some(fh), out.len() as u64, piece)
            .await
            .unwrap();
        if data.is_empty() {
            break;
        }
        out.extend_from_slice(&data);
    }
    fs.release(fh);
    out
}

fn source_files(src: &Path) -> Vec<String> {
    walk(src)
        .into_iter()
        .filter(|p| std::fs::symlink_metadata(src.join(p)).unwrap().is_file())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_file_reads_back_identical_sequentially_and_at_random_offsets() {
    let fx = fixture().await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let fs = open_fs(&fx.store, fx.digest, &cache).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for rel in source_files(&fx.src) {
        let want = std::fs::read(fx.src.join(&rel)).unwrap();
        let ino = resolve(&fs, &rel);
        let attr = fs.getattr(ino).unwrap();
        assert_eq!(attr.size, want.len() as u64, "{rel}");
        for piece in [4096, 131_072, 1 << 20] {
            assert!(
                read_all(&fs, ino, piece).await == want,
                "{rel} in {piece}-byte reads"
            );
        }
        for _ in 0..50 {
            let offset = rng.random_range(0..=want.len() + 10) as u64;
            let size = rng.random_range(0..(3 << 20)) as u32;
            let got = fs.read(ino, None, offset, size).await.unwrap();
            let start = (offset as usize).min(want.len());
            let end = (start + size as usize).min(want.len());
            assert!(got[..] == want[start..end], "{rel} at {offset}+{size}");
        }
    }
    assert_eq!(fs.metrics().snapshot().read_errors, 0);
}

#[tokio::test]
async fn listings_modes_and_symlinks_match_the_source() {
    let fx = fixture().await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let fs = open_fs(&fx.store, fx.digest, &cache).await;
    let root = fs.readdir(ROOT_INO, 0).unwrap();
    let names: Vec<&str> = root.iter().map(|e| e.name.as_str()).collect();
    let mut want: Vec<String> = std::fs::read_dir(&fx.src)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    want.sort();
    let mut got: Vec<String> = names[2..].iter().map(|s| s.to_string()).collect();
    got.sort();
    assert_eq!(&names[..2], &[".", ".."]);
    assert_eq!(got, want);
    // Offsets continue where the kernel left off.
    assert_eq!(fs.readdir(ROOT_INO, 3).unwrap()[..], root[3..]);

    let run = fs.getattr(resolve(&fs, "bin/run.sh")).unwrap();
    assert_eq!(run.perm, 0o555);
    let tiny = fs.getattr(resolve(&fs, "tiny.txt")).unwrap();
    assert_eq!(tiny.perm, 0o444);
    let link = resolve(&fs, "link-to-model");
    assert_eq!(fs.getattr(link).unwrap().kind, NodeType::Symlink);
    assert_eq!(fs.readlink(link).unwrap(), "weights/model-00001.bin");
    assert_eq!(
        fs.readlink(resolve(&fs, "a/up-link")).unwrap(),
        "../tiny.txt"
    );
    assert_eq!(
        fs.getattr(resolve(&fs, "empty-dir")).unwrap().kind,
        NodeType::Dir
    );
    assert!(matches!(
        fs.lookup(ROOT_INO, b"nope"),
        Err(FsError::NotFound)
    ));
    assert!(matches!(fs.lookup(tiny.ino, b"x"), Err(FsError::NotDir)));
    assert!(matches!(fs.open(tiny.ino, true), Err(FsError::ReadOnly)));
    assert!(matches!(
        fs.read(ROOT_INO, None, 0, 10).await,
        Err(FsError::IsDir)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_readers_fetch_each_chunk_once() {
    let fx = fixture().await;
    let (faulty, store) = faulty(&fx.store);
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let fs = open_fs(&store, fx.digest, &cache).await;
    let ino = resolve(&fs, "weights/model-00001.bin");
    let want = std::fs::read(fx.src.join("weights/model-00001.bin")).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let fs = fs.clone();
        tasks.push(tokio::spawn(
            async move { read_all(&fs, ino, 1 << 20).await },
        ));
    }
    for t in tasks {
        assert!(t.await.unwrap() == want);
    }
    let manifest = store.get_manifest(&fx.digest).await.unwrap();
    let unique: HashSet<Digest> = manifest
        .entries
        .iter()
        .filter(|e| e.path == "weights/model-00001.bin")
        .flat_map(|e| match &e.kind {
            EntryKind::File(f) => f.chunks.iter().map(|c| c.digest).collect(),
            _ => vec![],
        })
        .collect();
    assert_eq!(faulty.gets(), unique.len() as u64, "one GET per chunk");
    let m = fs.metrics().snapshot();
    assert_eq!(m.store_fetches, unique.len() as u64);
    assert!(m.memory_hits > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_chunk_is_an_error_never_wrong_bytes() {
    let fx = fixture().await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let fs = open_fs(&fx.store, fx.digest, &cache).await;
    let manifest = fx.store.get_manifest(&fx.digest).await.unwrap();
    let small = manifest
        .entries
        .iter()
        .find_map(|e| match &e.kind {
            EntryKind::File(f) if e.path == "weights/small.bin" => Some(f.chunks[0].digest),
            _ => None,
        })
        .unwrap();
    corrupt_chunk(&fx.store_dir, &small);
    let ino = resolve(&fs, "weights/small.bin");
    let err = fs.read(ino, None, 0, 4096).await.unwrap_err();
    assert!(
        matches!(
            err,
            FsError::Fetch(sealed_mount::FetchError::Corrupt { .. })
        ),
        "{err}"
    );
    assert_eq!(err.errno(), libc::EIO);
    let m = fs.metrics().snapshot();
    assert_eq!(m.verification_failures, 1);
    assert_eq!(m.read_errors, 1);
    // Other files still read.
    let tiny = resolve(&fs, "tiny.txt");
    assert_eq!(&fs.read(tiny, None, 0, 100).await.unwrap()[..], b"hello\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_store_fails_within_the_bound_and_cached_data_is_still_served() {
    let fx = fixture().await;
    let (faulty, store) = faulty(&fx.store);
    let policy = FetchPolicy {
        attempt_timeout: Duration::from_millis(300),
        retries: 2,
        backoff: Duration::from_millis(50),
        // Off: this test counts each read's own attempts (the breaker's tests are in
        // store_faults.rs).
        breaker_open: Duration::ZERO,
    };
    let cache = cache_with(policy);
    let fs = open_fs(&store, fx.digest, &cache).await;
    let tiny = resolve(&fs, "tiny.txt");
    assert_eq!(&fs.read(tiny, None, 0, 100).await.unwrap()[..], b"hello\n");

    for (mode, name) in [(HANG, "hang"), (FAIL, "fail")] {
        faulty.set(mode);
        let before = faulty.gets();
        let ino = resolve(&fs, "weights/small.bin");
        let started = Instant::now();
        let err = fs.read(ino, None, 0, 4096).await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.errno(), libc::EIO, "{name}: {err}");
        assert!(
            took <= policy.worst_case() + Duration::from_millis(500),
            "{name}: {took:?}"
        );
        assert_eq!(faulty.gets() - before, 3, "{name}: one try and two retries");
        // Cached data keeps being served.
        assert_eq!(&fs.read(tiny, None, 0, 100).await.unwrap()[..], b"hello\n");
    }
    assert!(fs.metrics().snapshot().store_timeouts >= 3);
    // And the store coming back heals reads.
    faulty.set(OK);
    let ino = resolve(&fs, "weights/small.bin");
    let want = std::fs::read(fx.src.join("weights/small.bin")).unwrap();
    assert!(read_all(&fs, ino, 1 << 20).await == want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disk_cache_is_bounded_survives_restart_and_is_shared_between_versions() {
    let fx = fixture().await;
    let (faulty, store) = faulty(&fx.store);
    let cache_dir = tempfile::tempdir().unwrap();
    let options = |bytes: u64| NodeCacheOptions {
        disk_dir: Some(cache_dir.path().to_path_buf()),
        disk_bytes: bytes,
        memory_bytes: 8 << 20,
        ..Default::default()
    };
    // A bound smaller than the data (the version holds ~17 MiB of unique chunks).
    let bound = 8 << 20;
    {
        let cache = NodeCache::new(&options(bound)).unwrap();
        let fs = open_fs(&store, fx.digest, &cache).await;
        for rel in source_files(&fx.src) {
            let ino = resolve(&fs, &rel);
            let want = std::fs::read(fx.src.join(&rel)).unwrap();
            assert!(read_all(&fs, ino, 1 << 20).await == want, "{rel}");
            assert!(
                disk_usage(cache_dir.path()) <= bound,
                "cache over its bound after {rel}"
            );
        }
        assert!(fs.metrics().snapshot().disk_evictions > 0);
        cache.flush().await;
        assert!(disk_usage(cache_dir.path()) <= bound);
    }

    // Restart with a roomy bound: read one file, drop the process state, read it again.
    let before = faulty.gets();
    {
        let cache = NodeCache::new(&options(1 << 30)).unwrap();
        let fs = open_fs(&store, fx.digest, &cache).await;
        let ino = resolve(&fs, "weights/model-00001.bin");
        read_all(&fs, ino, 1 << 20).await;
        cache.flush().await;
    }
    let fetched_first = faulty.gets() - before;
    let before = faulty.gets();
    {
        let cache = NodeCache::new(&options(1 << 30)).unwrap();
        let fs = open_fs(&store, fx.digest, &cache).await;
        let ino = resolve(&fs, "weights/model-00001.bin");
        let want = std::fs::read(fx.src.join("weights/model-00001.bin")).unwrap();
        assert!(read_all(&fs, ino, 1 << 20).await == want);
        assert_eq!(faulty.gets(), before, "restart refetched cached chunks");
        assert!(fs.metrics().snapshot().disk_hits > 0);
        cache.flush().await;
    }
    assert!(fetched_first > 0);

    // A second version sharing most chunks only fetches what is new.
    let src2 = fx.src.parent().unwrap().join("src2");
    std::fs::create_dir_all(src2.join("weights")).unwrap();
    let mut v2 = std::fs::read(fx.src.join("weights/model-00001.bin")).unwrap();
    v2.extend_from_slice(&random_bytes(99, 2 << 20));
    std::fs::write(src2.join("weights/model-00001.bin"), &v2).unwrap();
    let digest2 = push_dir(&fx.store, &src2).await;
    let cache = NodeCache::new(&options(1 << 30)).unwrap();
    let fs2 = open_fs(&store, digest2, &cache).await;
    let before = faulty.gets();
    let ino = resolve(&fs2, "weights/model-00001.bin");
    assert!(read_all(&fs2, ino, 1 << 20).await == v2);
    let new_fetches = faulty.gets() - before;
    let chunks_of = |m: &sealed_store::Manifest| -> HashSet<Digest> {
        m.entries
            .iter()
            .filter(|e| e.path == "weights/model-00001.bin")
            .flat_map(|e| match &e.kind {
                EntryKind::File(f) => f.chunks.iter().map(|c| c.digest).collect(),
                _ => vec![],
            })
            .collect()
    };
    let v1 = chunks_of(&fx.store.get_manifest(&fx.digest).await.unwrap());
    let v2_chunks = chunks_of(&fx.store.get_manifest(&digest2).await.unwrap());
    let only_v2 = v2_chunks.difference(&v1).count() as u64;
    assert!(
        only_v2 < v2_chunks.len() as u64,
        "the versions share chunks"
    );
    assert_eq!(new_fetches, only_v2, "only chunks v1 lacks are fetched");
    assert!(fs2.metrics().snapshot().disk_hits > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_prefetch_warms_the_disk_cache() {
    let fx = fixture().await;
    let (faulty, store) = faulty(&fx.store);
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(cache_dir.path().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    let fs = open_fs(&store, fx.digest, &cache).await;

    let json = sealed_mount::PrefetchSelection::parse("*.json").unwrap();
    let report = sealed_mount::prefetch::prefetch(fs.clone(), &json, 4)
        .await
        .unwrap();
    assert_eq!(report.files, 1);
    assert!(sealed_mount::PrefetchSelection::parse("[").is_err());

    let report =
        sealed_mount::prefetch::prefetch(fs.clone(), &sealed_mount::PrefetchSelection::All, 4)
            .await
            .unwrap();
    assert_eq!(report.failed_chunks, 0);
    assert!(report.chunks > 5);
    // Everything is local now: the store can go away.
    faulty.set(FAIL);
    for rel in source_files(&fx.src) {
        let want = std::fs::read(fx.src.join(&rel)).unwrap();
        assert!(
            read_all(&fs, resolve(&fs, &rel), 1 << 20).await == want,
            "{rel}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_reads_prefetch_within_the_global_budget() {
    let fx = fixture().await;
    let budget = 3 << 20;
    let cache = NodeCache::new(&NodeCacheOptions {
        readahead_bytes: budget,
        ..Default::default()
    })
    .unwrap();
    let fs = open_fs(&fx.store, fx.digest, &cache).await;
    let ino = resolve(&fs, "weights/model-00001.bin");
    let fh = fs.open(ino, false).unwrap();
    let want = std::fs::read(fx.src.join("weights/model-00001.bin")).unwrap();
    let mut got = Vec::new();
    loop {
        let data = fs
            .read(ino, Some(fh), got.len() as u64, 128 << 10)
            .await
            .unwrap();
        assert!(fs.metrics().snapshot().prefetch_bytes_in_flight <= budget);
        if data.is_empty() {
            break;
        }
        got.extend_from_slice(&data);
        // Give readahead a moment to land, as a reader doing work would.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(got == want);
    let m = fs.metrics().snapshot();
    assert!(m.prefetch_issued > 0, "{m:?}");
    assert!(m.memory_hits > m.memory_misses, "{m:?}");
}
