//! The fetch core against real tiers: an in-memory object store (`object_store`'s), a
//! disk tier in a temporary directory, and a peer tier that lies.

use std::sync::atomic::AtomicU32;

use std::sync::atomic::Ordering;

use futures::FutureExt;
use futures::future::BoxFuture;

use super::origin::MAX_PAUSE;
use super::*;
use crate::peer::PeerAnswer;

fn chunk_of(data: &[u8]) -> ChunkRef {
    ChunkRef {
        digest: Digest::of(data),
        len: u32::try_from(data.len()).unwrap(),
    }
}

async fn store_with(data: &[u8]) -> (ChunkStore, ChunkRef) {
    let store = ChunkStore::memory();
    let chunk = chunk_of(data);
    store
        .put_chunk(&chunk.digest, Bytes::copy_from_slice(data))
        .await
        .unwrap();
    (store, chunk)
}

fn cache_on(dir: Option<&std::path::Path>) -> NodeCache {
    NodeCache::new(&NodeCacheOptions {
        disk_dir: dir.map(|d| d.to_path_buf()),
        disk_bytes: 64 << 20,
        memory_bytes: 16 << 20,
        ..NodeCacheOptions::default()
    })
    .unwrap()
}

/// A peer tier that answers every ask with the same wrong bytes, and counts the asks.
#[derive(Default)]
struct LyingPeers {
    asks: AtomicU32,
}

impl PeerTier for LyingPeers {
    fn fetch(&self, chunk: ChunkRef) -> BoxFuture<'static, PeerAnswer> {
        self.asks.fetch_add(1, Ordering::Relaxed);
        let wrong = vec![0x5a; chunk.len as usize];
        async move { PeerAnswer::Chunk(Bytes::from(wrong)) }.boxed()
    }
}

#[tokio::test]
async fn a_reader_gets_the_chunk_from_memory_disk_or_origin_in_that_order() {
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (store, chunk) = store_with(&data).await;
    let dir = tempfile::tempdir().unwrap();

    let cache = cache_on(Some(dir.path()));
    let got = cache.get(&store, &chunk).await.unwrap();
    assert_eq!(got, data);
    let s = cache.metrics().snapshot();
    assert_eq!((s.store_fetches, s.memory_misses, s.disk_misses), (1, 1, 1));
    // Again: memory.
    assert_eq!(cache.get(&store, &chunk).await.unwrap(), data);
    let s = cache.metrics().snapshot();
    assert_eq!((s.store_fetches, s.memory_hits), (1, 1));
    cache.flush().await;

    // A new process on the same disk: the disk tier, verified, no store fetch.
    let cache = cache_on(Some(dir.path()));
    assert_eq!(cache.get(&store, &chunk).await.unwrap(), data);
    let s = cache.metrics().snapshot();
    assert_eq!((s.store_fetches, s.disk_hits), (0, 1));
}

#[tokio::test]
async fn a_peers_wrong_bytes_are_never_served_and_a_peer_is_never_asked_for_a_peer() {
    let data = vec![7u8; 100_000];
    let (store, chunk) = store_with(&data).await;

    // A reader: the lying peer is asked, caught, and the origin serves.
    let cache = cache_on(None);
    let peers = Arc::new(LyingPeers::default());
    assert!(cache.set_peers(peers.clone()));
    assert_eq!(cache.get(&store, &chunk).await.unwrap(), data);
    assert_eq!(peers.asks.load(Ordering::Relaxed), 1);
    let s = cache.metrics().snapshot();
    assert_eq!(
        (s.peer_corrupt, s.verification_failures, s.store_fetches),
        (1, 1, 1)
    );

    // Another node's request: origin only, and memory is left to this node's readers.
    let cache = cache_on(None);
    let peers = Arc::new(LyingPeers::default());
    assert!(cache.set_peers(peers.clone()));
    assert_eq!(cache.serve_peer(&store, &chunk).await.unwrap(), data);
    assert_eq!(peers.asks.load(Ordering::Relaxed), 0);
    assert!(!cache.inner.memory.contains(&chunk.digest));
    assert_eq!(cache.metrics().snapshot().store_fetches, 1);
}

#[tokio::test]
async fn prefetch_and_assembly_fill_the_disk_not_memory() {
    let data = vec![3u8; 200_000];
    let (store, chunk) = store_with(&data).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_on(Some(dir.path()));
    cache.prefetch(&store, &chunk).await.unwrap();
    cache.flush().await;
    assert!(cache.on_disk(&chunk.digest));
    assert!(
        !cache.inner.memory.contains(&chunk.digest),
        "a prefetch filled memory"
    );
    // The flight leaves the table just after its disk write.
    let started = Instant::now();
    while cache.is_hot(&chunk.digest) {
        assert!(started.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let got = cache
        .fetch(&store, &chunk, Request::new(Want::Assembly))
        .await
        .unwrap();
    assert_eq!(got, data);
    assert!(
        !cache.inner.memory.contains(&chunk.digest),
        "an assembly filled memory"
    );
    let s = cache.metrics().snapshot();
    assert_eq!((s.store_fetches, s.disk_hits), (1, 1));
    // Neither counts as a reader's memory miss.
    assert_eq!(s.memory_misses, 0);
}

#[tokio::test]
async fn a_lying_length_and_a_missing_chunk_are_answers_at_once() {
    let data = vec![1u8; 50_000];
    let (store, chunk) = store_with(&data).await;
    let cache = NodeCache::new(&NodeCacheOptions {
        fetch: FetchPolicy {
            retries: 3,
            backoff: Duration::from_secs(1),
            ..FetchPolicy::default()
        },
        ..NodeCacheOptions::default()
    })
    .unwrap();
    let longer = ChunkRef {
        len: chunk.len + 1,
        ..chunk
    };
    assert!(matches!(
        cache.get(&store, &longer).await,
        Err(FetchError::WrongLength { .. })
    ));
    // Not retried: a missing chunk is the store's answer, not its failure.
    let started = Instant::now();
    let absent = chunk_of(b"not in the store");
    assert!(matches!(
        cache.get(&store, &absent).await,
        Err(FetchError::Missing { .. })
    ));
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(cache.metrics().snapshot().store_errors, 1);
}

/// The pauses between attempts are jittered (two schedules differ) and stay within the
/// unjittered schedule they replaced: pause n in [b/2, b), b = min(200 ms * 2^n, 2 s),
/// so `worst_case` and the documented read bound hold.
#[test]
fn retry_pauses_are_jittered_within_the_documented_bound() {
    let policy = FetchPolicy::default();
    let a: Vec<Duration> = policy.pauses().schedule_seeded(1).take(8).collect();
    let b: Vec<Duration> = policy.pauses().schedule_seeded(2).take(8).collect();
    assert_ne!(a, b, "two nodes' retries in lockstep");
    for pauses in [&a, &b] {
        let mut bound = policy.backoff;
        for (n, pause) in pauses.iter().enumerate() {
            let cap = bound.min(MAX_PAUSE);
            assert!(
                *pause >= cap / 2 && *pause < cap,
                "pause {n} = {pause:?} outside [{:?}, {cap:?})",
                cap / 2
            );
            bound = bound.saturating_mul(2);
        }
    }
    // docs/mount.md: `--timeout 3 --retries 1` gives 6.2 s.
    let documented = FetchPolicy {
        attempt_timeout: Duration::from_secs(3),
        retries: 1,
        ..FetchPolicy::default()
    };
    assert_eq!(documented.worst_case(), Duration::from_millis(6200));
    let many = FetchPolicy {
        attempt_timeout: Duration::from_secs(1),
        retries: 5,
        ..FetchPolicy::default()
    };
    // 6 s of attempts + 0.2 + 0.4 + 0.8 + 1.6 + 2 s of pauses.
    assert_eq!(many.worst_case(), Duration::from_millis(11_000));
}
