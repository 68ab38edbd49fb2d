//! Reads against a real S3 endpoint on loopback (`common::s3::MiniS3`) that misbehaves:
//! one that accepts chunk requests and never answers (the read bound, with the kernel
//! retrying its readahead), and versions of a million-fetch shape (the caps and the bound on
//! fetches in flight).

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::s3::MiniS3;
use common::{open_version, runtime};
use sealed_mount::tree::ROOT_INO;
use sealed_mount::{
    FetchPolicy, MountError, MountHandle, MountLimits, MountOptions, NodeCache, NodeCacheOptions,
    ReadaheadPolicy, SealedFs,
};
use sealed_store::{ChunkParams, ChunkRef, ChunkStore, Digest, Entry, EntryKind, Manifest};

/// `content` cut into chunks of `chunk_len` bytes, each stored on the server.
fn chunked(server: &MiniS3, path: &str, content: &[u8], chunk_len: usize) -> Entry {
    let chunks = content
        .chunks(chunk_len)
        .map(|c| ChunkRef {
            digest: server.put_chunk(c),
            len: c.len() as u32,
        })
        .collect();
    common::file_entry(path, content, chunks)
}

fn seal(server: &MiniS3, mut entries: Vec<Entry>) -> Digest {
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    let m = Manifest {
        chunking: ChunkParams::default(),
        entries,
    };
    server.put_manifest(m.encode().unwrap())
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// The case, scaled down: `--timeout 1 --retries 1` against an endpoint that accepts
/// and never answers. One 1 MiB `pread` over uncached chunks must fail within the bound
/// (the old code forgot the failure, the kernel sent its readahead again synchronously, and
/// the read waited the whole bound a second time), and the read after it fails at once.
#[test]
fn a_pread_against_a_blackholed_store_fails_within_the_bound_and_the_next_fails_fast() {
    if !Path::new("/dev/fuse").exists() {
        eprintln!("SKIPPED: /dev/fuse is absent, so no FUSE mount can be made here");
        return;
    }
    let rt = runtime();
    let server = MiniS3::start();
    let content = common::random_bytes(9, 8 << 20);
    let digest = seal(
        &server,
        vec![chunked(&server, "model.bin", &content, 1 << 20)],
    );
    server.blackhole_chunks(true);
    let store = rt.block_on(server.store(Duration::from_secs(1), 1));
    let policy = FetchPolicy {
        attempt_timeout: Duration::from_secs(1),
        retries: 1,
        ..FetchPolicy::default()
    };
    let cache = NodeCache::new(&NodeCacheOptions {
        fetch: policy,
        ..Default::default()
    })
    .unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            store,
            digest,
            mnt.path(),
            cache.clone(),
            MountOptions::default(),
        ))
        .unwrap();
    let file = File::open(mnt.path().join("model.bin")).unwrap();
    let bound = policy.worst_case();

    let mut buf = vec![0u8; 1 << 20];
    let started = Instant::now();
    let err = file.read_at(&mut buf, 0).unwrap_err();
    let took = started.elapsed();
    assert_eq!(errno_of(&err), libc::EIO, "{err}");
    eprintln!("first pread failed after {took:?} (fetch bound {bound:?})");
    assert!(
        took <= bound.mul_f64(1.5) + Duration::from_millis(300),
        "one pread took {took:?}, over the bound {bound:?}"
    );

    // Right after: another uncached range fails at once, well under one attempt's timeout.
    let started = Instant::now();
    let err = file.read_at(&mut buf, 5 << 20).unwrap_err();
    let took = started.elapsed();
    assert_eq!(errno_of(&err), libc::EIO, "{err}");
    assert!(
        took < Duration::from_millis(300),
        "the second pread took {took:?}: the failure was forgotten"
    );
    let m = cache.metrics().snapshot();
    assert!(m.breaker_opens >= 1, "{m:?}");
    assert!(m.store_fast_failures >= 1, "{m:?}");
    drop(file);
    rt.block_on(handle.unmount()).unwrap();
}

/// After the open window the breaker lets one probe through, and a store that answers again
/// heals reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_breaker_probes_after_its_window_and_closes_when_the_store_answers() {
    let server = MiniS3::start();
    let content = common::random_bytes(10, 3 << 20);
    let digest = seal(&server, vec![chunked(&server, "f", &content, 1 << 20)]);
    let store = server.store(Duration::from_secs(1), 0).await;
    let policy = FetchPolicy {
        attempt_timeout: Duration::from_millis(500),
        retries: 0,
        breaker_open: Duration::from_millis(800),
        ..FetchPolicy::default()
    };
    let cache = NodeCache::new(&NodeCacheOptions {
        fetch: policy,
        ..Default::default()
    })
    .unwrap();
    let fs = open_fs(&store, digest, &cache, &MountLimits::default()).await;
    let ino = fs.lookup(ROOT_INO, b"f").unwrap().ino;

    server.blackhole_chunks(true);
    assert!(fs.read(ino, None, 0, 4096).await.is_err());
    let before = server.chunk_requests();
    let started = Instant::now();
    let err = fs.read(ino, None, 1 << 20, 4096).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(100), "fails fast");
    assert!(err.to_string().contains("circuit breaker"), "{err}");
    assert_eq!(
        server.chunk_requests(),
        before,
        "nothing asked of the store"
    );

    server.blackhole_chunks(false);
    tokio::time::sleep(policy.breaker_open).await;
    let got = fs.read(ino, None, 1 << 20, 4096).await.unwrap();
    assert_eq!(&got[..], &content[1 << 20..(1 << 20) + 4096]);
    let got = fs.read(ino, None, 2 << 20, 4096).await.unwrap();
    assert_eq!(&got[..], &content[2 << 20..(2 << 20) + 4096]);
}

async fn open_fs(
    store: &ChunkStore,
    digest: Digest,
    cache: &NodeCache,
    limits: &MountLimits,
) -> Arc<SealedFs> {
    Arc::new(
        open_version(store, digest, cache, ReadaheadPolicy::default())
            .await
            .with_limits(limits),
    )
}

/// `n` distinct 4-byte chunks (each its own index), the file they make.
fn tiny_chunk_content(seed: u32, n: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (seed.wrapping_mul(1 << 20) ^ i).to_be_bytes())
        .collect()
}

/// One read over 2048 tiny chunks (the format allows them down to one byte) starts at most
/// `max_fetches_per_read` fetches at once, as the server counts them; the old code started
/// all 2048.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_read_over_tiny_chunks_has_at_most_the_bound_in_flight() {
    let server = MiniS3::start();
    server.delay_chunks(Duration::from_millis(10));
    let content = tiny_chunk_content(1, 2048);
    let digest = seal(&server, vec![chunked(&server, "tiny", &content, 4)]);
    let store = server.store(Duration::from_secs(10), 0).await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let limits = MountLimits::default();
    let fs = open_fs(&store, digest, &cache, &limits).await;
    let ino = fs.lookup(ROOT_INO, b"tiny").unwrap().ino;

    let got = fs.read(ino, None, 0, 1 << 20).await.unwrap();
    assert!(got[..] == content[..]);
    assert_eq!(server.chunk_requests(), 2048);
    let max = server.max_in_flight();
    eprintln!("at most {max} chunk requests in flight");
    assert!(
        max <= limits.max_fetches_per_read as u64,
        "{max} fetches in flight for one read, over {}",
        limits.max_fetches_per_read
    );
}

/// Reads of two files at once, with readahead over their tiny chunks, stay within the
/// mount's bound together.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_and_readahead_of_a_mount_stay_within_its_bound() {
    let server = MiniS3::start();
    server.delay_chunks(Duration::from_millis(5));
    let a = tiny_chunk_content(2, 4096);
    let b = tiny_chunk_content(3, 4096);
    let digest = seal(
        &server,
        vec![chunked(&server, "a", &a, 4), chunked(&server, "b", &b, 4)],
    );
    let store = server.store(Duration::from_secs(10), 0).await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let limits = MountLimits {
        max_fetches_per_read: 16,
        max_fetches_per_mount: 40,
        ..MountLimits::default()
    };
    let fs = open_fs(&store, digest, &cache, &limits).await;
    let readers = [("a", a), ("b", b)].map(|(name, want)| {
        let fs = fs.clone();
        tokio::spawn(async move {
            let ino = fs.lookup(ROOT_INO, name.as_bytes()).unwrap().ino;
            let fh = fs.open(ino, false).unwrap();
            let mut got = Vec::new();
            while got.len() < want.len() {
                let piece = fs
                    .read(ino, Some(fh), got.len() as u64, 1024)
                    .await
                    .unwrap();
                assert!(!piece.is_empty());
                got.extend_from_slice(&piece);
            }
            assert!(got == want, "{name}");
        })
    });
    for r in readers {
        r.await.unwrap();
    }
    let max = server.max_in_flight();
    eprintln!("at most {max} chunk requests in flight");
    assert!(max <= 40, "{max} fetches in flight for the mount, over 40");
    assert!(fs.metrics().snapshot().prefetch_issued > 0, "readahead ran");
}

/// A legal version over a per-mount cap is refused at mount time, naming the cap and both
/// numbers; nothing is mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_over_a_cap_is_refused_with_the_cap_and_both_numbers() {
    let server = MiniS3::start();
    let content = tiny_chunk_content(4, 300);
    let mut entries = vec![chunked(&server, "tiny", &content, 1)];
    for i in 0..5 {
        entries.push(Entry {
            path: format!("d{i}"),
            kind: EntryKind::Dir,
        });
    }
    let digest = seal(&server, entries);
    let store = server.store(Duration::from_secs(10), 0).await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let cases = [
        (
            MountLimits {
                max_entries: 5,
                ..MountLimits::default()
            },
            "max_entries",
            6,
            5,
        ),
        (
            MountLimits {
                max_chunks: 1000,
                ..MountLimits::default()
            },
            "max_chunks",
            1200,
            1000,
        ),
        (
            MountLimits {
                max_manifest_bytes: 4096,
                ..MountLimits::default()
            },
            "max_manifest_bytes",
            0,
            4096,
        ),
    ];
    for (limits, field, count, limit) in cases {
        let options = MountOptions {
            limits,
            ..MountOptions::default()
        };
        let err = MountHandle::spawn(store.clone(), digest, mnt.path(), cache.clone(), options)
            .await
            .err()
            .unwrap_or_else(|| panic!("{field}: mounted"));
        let text = err.to_string();
        match err {
            MountError::OverLimit {
                field: f,
                count: c,
                limit: l,
                ..
            } => {
                assert_eq!(f, field, "{text}");
                assert_eq!(l, limit, "{text}");
                if count > 0 {
                    assert_eq!(c, count, "{text}");
                } else {
                    assert!(c > limit, "{text}");
                }
            }
            other => panic!("{field}: {other}"),
        }
        assert!(
            text.contains(field) && text.contains(&limit.to_string()),
            "{text}"
        );
    }
    // Within the caps (the defaults) it mounts.
    let handle = MountHandle::spawn(store, digest, mnt.path(), cache, MountOptions::default())
        .await
        .unwrap();
    handle.unmount().await.unwrap();
}

/// A chunk body longer than any chunk can be (the store cuts it off: `ResponseTooLarge`) is
/// an answer about that chunk, like a corrupt one: the read fails, but the breaker stays
/// closed, so reads of the other chunks from the same store go on at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_chunk_fails_its_read_without_opening_the_breaker() {
    let server = MiniS3::start();
    let content = common::random_bytes(11, 2 << 20);
    let entry = chunked(&server, "f", &content, 1 << 20);
    let EntryKind::File(file) = &entry.kind else {
        unreachable!("chunked makes files")
    };
    // The first chunk's key answers 20 MiB: over the store's 16 MiB chunk cap.
    server.put(
        ChunkStore::chunk_key(&file.chunks[0].digest).as_ref(),
        vec![0u8; 20 << 20],
    );
    let digest = seal(&server, vec![entry]);
    let store = server.store(Duration::from_secs(10), 0).await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let fs = open_fs(&store, digest, &cache, &MountLimits::default()).await;
    let ino = fs.lookup(ROOT_INO, b"f").unwrap().ino;

    let err = fs.read(ino, None, 0, 4096).await.unwrap_err();
    assert!(err.to_string().contains("hostile answer"), "{err}");
    let before = server.chunk_requests();
    let got = fs.read(ino, None, 1 << 20, 4096).await.unwrap();
    assert_eq!(&got[..], &content[1 << 20..(1 << 20) + 4096]);
    assert!(server.chunk_requests() > before, "the store was asked");
    let metrics = cache.metrics().snapshot();
    assert_eq!(metrics.breaker_opens, 0, "{metrics:?}");
}
