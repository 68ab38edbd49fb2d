//! Pull keeps its bound on chunks in flight across files, and completes when the bound is
//! smaller than the number of files (no file starves the one being written).

mod support;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use sealed_store::pull::{PullOptions, pull};
use sealed_store::{ChunkStore, NoProgress};
use support::*;

/// Counts chunk GETs in flight (the request until its body is read) and the most at once.
#[derive(Debug)]
struct Gauge {
    inner: Arc<dyn ObjectStore>,
    now: AtomicUsize,
    most: AtomicUsize,
}

impl fmt::Display for Gauge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gauge({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Gauge {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if !location.as_ref().starts_with("chunks/") {
            return self.inner.get_opts(location, options).await;
        }
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        // A store with a round trip: fetches overlap, so the bound is what limits them.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let result = self.inner.get_opts(location, options).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        result
    }
    async fn get_ranges(
        &self,
        location: &ObjectPath,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }
    async fn delete(&self, location: &ObjectPath) -> object_store::Result<()> {
        self.inner.delete(location).await
    }
    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy(&self, from: &ObjectPath, to: &ObjectPath) -> object_store::Result<()> {
        self.inner.copy(from, to).await
    }
    async fn copy_if_not_exists(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
    ) -> object_store::Result<()> {
        self.inner.copy_if_not_exists(from, to).await
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
    let gauge = Arc::new(Gauge {
        inner: plain.object_store().clone(),
        now: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
    });
    let store = ChunkStore::from_object_store(gauge.clone(), "gauge");
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
