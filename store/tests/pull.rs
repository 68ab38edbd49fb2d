//! Pull keeps its bound on chunks in flight across files, and completes when the bound is
//! smaller than the number of files (no file starves the one being written).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use object_store::GetResult;
use object_store::path::Path as ObjectPath;
use sealed_store::pull::{PullOptions, pull};
use sealed_store::{ChunkStore, NoProgress};
use support::*;

/// Counts chunk GETs in flight (the request until its body is read) and the most at once.
#[derive(Debug, Default)]
struct Gauge {
    now: AtomicUsize,
    most: AtomicUsize,
}

impl GetHook for Gauge {
    fn around_get<'a>(
        &'a self,
        location: &'a ObjectPath,
        get: BoxFuture<'a, object_store::Result<GetResult>>,
    ) -> BoxFuture<'a, object_store::Result<GetResult>> {
        if !is_chunk(location) {
            return get;
        }
        Box::pin(async move {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            // A store with a round trip: fetches overlap, so the bound is what limits them.
            tokio::time::sleep(Duration::from_millis(5)).await;
            let result = get.await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            result
        })
    }
}

/// A version of one file of many chunks and 24 small files, behind a [`Gauge`].
async fn fixture(work: &std::path::Path) -> (Arc<Gauge>, ChunkStore, sealed_store::Digest) {
    let src = work.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("big.bin"), pseudo_random(24 << 20, 1)).unwrap();
    for i in 0..24u64 {
        std::fs::write(
            src.join(format!("small-{i:02}.bin")),
            pseudo_random(4096, 100 + i),
        )
        .unwrap();
    }
    let plain = file_store(&work.join("store")).await;
    let digest = push_dir(&plain, &src).await.digest;
    let gauge = Arc::new(Gauge::default());
    let hooked = HookedStore::new(plain.object_store().clone(), gauge.clone());
    let store = ChunkStore::from_object_store(hooked, "gauge");
    (gauge, store, digest)
}

fn assert_same_tree(src: &std::path::Path, out: &std::path::Path) {
    let mut names: Vec<_> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), 25);
    for name in names {
        assert_eq!(
            std::fs::read(src.join(&name)).unwrap(),
            std::fs::read(out.join(&name)).unwrap(),
            "{name:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_in_flight_never_exceed_the_bound_across_files() {
    let work = tempfile::tempdir().unwrap();
    let (gauge, store, digest) = fixture(work.path()).await;
    let out = work.path().join("out");
    let opts = PullOptions {
        concurrency: 3,
        ..Default::default()
    };
    tokio::time::timeout(
        Duration::from_secs(60),
        pull(&store, &digest, &out, &opts, Arc::new(NoProgress)),
    )
    .await
    .expect("the pull finishes: a bound smaller than the files at once does not deadlock")
    .unwrap();
    assert_same_tree(&work.path().join("src"), &out);
    let most = gauge.most.load(Ordering::SeqCst);
    assert!(most <= 3, "{most} chunk GETs at once, bound 3");
    assert!(most >= 2, "the bound is used, not serialised: {most}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_file_gets_the_whole_bound() {
    let work = tempfile::tempdir().unwrap();
    let (gauge, store, digest) = fixture(work.path()).await;
    let out = work.path().join("out");
    pull(
        &store,
        &digest,
        &out,
        &PullOptions {
            concurrency: 20,
            ..Default::default()
        },
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_same_tree(&work.path().join("src"), &out);
    let most = gauge.most.load(Ordering::SeqCst);
    assert!(
        (9..=20).contains(&most),
        "{most} chunk GETs at once, bound 20"
    );
}
