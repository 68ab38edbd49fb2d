//! A hostile warm (issue 34): a tenant's volume asks for a version bigger than the node's
//! disk cache to be warmed on a node where another tenant's version was just read. With the
//! admin's bounds (`WarmSettings`: a 50% share of the cache, entries used within the hour
//! spared) the warm evicts none of the other version's chunks and takes at most its share; a
//! cache with no room but recently used data ends it early, said in what it returns. Real
//! parts: a file store with both versions pushed, the node cache on a real disk directory,
//! the plugin's own warm function. No cluster needed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sealed_crds::warming::WarmingPolicy;
use sealed_csi::warm::{Pace, WarmConfig, WarmMetrics, WarmSettings, warm_version};
use sealed_mount::{MountLimits, NodeCache, NodeCacheOptions};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress, StoreOptions};

const MIB: u64 = 1 << 20;

async fn pushed(store: &ChunkStore, dir: &Path, name: &str, len: usize, seed: u64) -> Digest {
    let tree = dir.join(name);
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(
        tree.join("model.safetensors"),
        sealed_test_support::trees::pseudo_random(len, seed),
    )
    .unwrap();
    push(store, &tree, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap()
        .digest
}

/// Bytes of chunk and file entries under the cache directory.
fn disk_usage(dir: &Path) -> u64 {
    let mut total = 0;
    for sub in ["chunks", "files"] {
        for shard in std::fs::read_dir(dir.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            for f in std::fs::read_dir(shard.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                total += f.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_warm_evicts_nothing_recently_used_and_stays_within_its_share() {
    let work = tempfile::tempdir().unwrap();
    let url = format!("file://{}", work.path().join("store").display());
    std::fs::create_dir_all(work.path().join("store")).unwrap();
    let store = ChunkStore::open(&url, &StoreOptions::default())
        .await
        .unwrap();
    // Tenant A's version (6 MiB), read on this node just now; tenant B's (40 MiB) asks for
    // warming. The disk cache holds 16 MiB.
    let victim = pushed(&store, work.path(), "a", 6 << 20, 1).await;
    let hostile = pushed(&store, work.path(), "b", 40 << 20, 2).await;
    let disk_bytes = 16 * MIB;
    let cache_dir = work.path().join("cache");
    let cache = NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(cache_dir.clone()),
        disk_bytes,
        memory_bytes: 4 * MIB,
        ..NodeCacheOptions::default()
    })
    .unwrap();

    let a_chunks = store.get_manifest(&victim).await.unwrap().unique_chunks();
    for c in &a_chunks {
        cache.serve_peer(&store, c).await.unwrap();
    }
    cache.flush().await;
    assert!(a_chunks.iter().all(|c| cache.on_disk(&c.digest)));

    let settings = WarmSettings {
        policy: WarmingPolicy::All,
        cache_share: 50,
        spare_recent: Duration::from_secs(3600),
        rate: 0,
    };
    let config = WarmConfig {
        cache: cache.clone(),
        disk_bytes,
        settings: settings.clone(),
        record_dir: None,
        limits: MountLimits::default(),
        me: "node-a".into(),
        ring: None,
    };
    let metrics = WarmMetrics::new().unwrap();
    let warmed = warm_version(&config, &store, &hostile, &Pace::new(0), &metrics)
        .await
        .unwrap()
        .expect("something was fetched");
    eprintln!("warmed: {warmed:?}; disk {} bytes", disk_usage(&cache_dir));

    let kept = a_chunks.iter().filter(|c| cache.on_disk(&c.digest)).count();
    assert_eq!(
        kept,
        a_chunks.len(),
        "the warm evicted {} of tenant A's {} recently read chunks",
        a_chunks.len() - kept,
        a_chunks.len()
    );
    let share = settings.budget(disk_bytes);
    assert!(warmed.cut, "a 40 MiB version is cut to its share");
    assert!(
        warmed.bytes <= share && warmed.bytes > 0,
        "the warm fetched {} bytes; its share is {share}",
        warmed.bytes
    );
    let b_chunks = store.get_manifest(&hostile).await.unwrap().unique_chunks();
    let b_on_disk: u64 = b_chunks
        .iter()
        .filter(|c| cache.on_disk(&c.digest))
        .map(|c| u64::from(c.len))
        .sum();
    assert!(
        b_on_disk <= share,
        "{b_on_disk} bytes of B on disk, share {share}"
    );
    assert!(disk_usage(&cache_dir) <= disk_bytes);

    // A second hostile version, with the cache full of recently used data (A's and the
    // first warm's): it evicts nothing and says it stopped.
    let other = pushed(&store, work.path(), "c", 8 << 20, 3).await;
    let before: Vec<bool> = a_chunks.iter().map(|c| cache.on_disk(&c.digest)).collect();
    let second = warm_version(&config, &store, &other, &Pace::new(0), &metrics)
        .await
        .unwrap()
        .expect("a warm was tried");
    eprintln!("second warm: {second:?}");
    assert!(
        second.stopped,
        "the warm stops where the cache has no stale room"
    );
    let after: Vec<bool> = a_chunks.iter().map(|c| cache.on_disk(&c.digest)).collect();
    assert_eq!(before, after);
    assert!(
        b_chunks
            .iter()
            .filter(|c| cache.on_disk(&c.digest))
            .map(|c| u64::from(c.len))
            .sum::<u64>()
            == b_on_disk,
        "the second warm evicted the first one's chunks"
    );
}

#[tokio::test]
async fn warm_egress_is_paced() {
    // 4 MiB at 8 MiB/s: the fifth MiB waits about half a second.
    let pace = Pace::new(8 * MIB);
    let started = tokio::time::Instant::now();
    for _ in 0..5 {
        pace.wait(MIB).await;
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(450),
        "5 MiB paced at 8 MiB/s took {took:?}"
    );
}
