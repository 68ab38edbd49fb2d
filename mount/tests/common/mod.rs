//! Shared test fixtures: a generated source tree, a pushed version, and a store that can be
//! made to hang or fail on demand.
#![allow(dead_code)]

pub mod s3;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use futures::future::BoxFuture;
use object_store::GetResult;
use object_store::path::Path as ObjectPath;
use rand::{Rng, SeedableRng};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress};
pub use sealed_test_support::{GetHook, HookedStore};

/// True where FUSE mounts can be made; otherwise says why the test is skipped.
pub fn fuse_available() -> bool {
    if !Path::new("/dev/fuse").exists() {
        eprintln!("SKIPPED: /dev/fuse is absent, so no FUSE mount can be made here");
        return false;
    }
    true
}

/// The multi-threaded runtime the FUSE tests serve their mounts on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Deterministic pseudo-random bytes (incompressible, so chunking cuts real chunks).
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// A tree with the shapes that matter: empty and tiny files, multi-chunk files, an
/// executable, nested directories, names that sort differently as paths and as names,
/// relative symlinks, a file that shares most of its chunks with another.
pub fn make_tree(root: &Path) {
    let w = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    };
    w("empty", b"");
    w("tiny.txt", b"hello\n");
    w("config.json", br#"{"a": 1}"#);
    let big = random_bytes(1, 9 << 20);
    w("weights/model-00001.bin", &big);
    let mut shared = big[..6 << 20].to_vec();
    shared.extend_from_slice(&random_bytes(2, 1 << 20));
    w("weights/model-copy.bin", &shared);
    w("weights/small.bin", &random_bytes(3, 300_000));
    w("a/b/c/deep.txt", b"deep\n");
    w("a-b", b"sorts before a/ as a path\n");
    w("bin/run.sh", b"#!/bin/sh\necho hi\n");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        root.join("bin/run.sh"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::os::unix::fs::symlink("weights/model-00001.bin", root.join("link-to-model")).unwrap();
    std::os::unix::fs::symlink("../tiny.txt", root.join("a/up-link")).unwrap();
    std::fs::create_dir_all(root.join("empty-dir")).unwrap();
}

pub async fn push_dir(store: &ChunkStore, dir: &Path) -> Digest {
    push(store, dir, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .expect("push")
        .digest
}

/// A `file://` store in `dir` (made if missing).
pub async fn file_store(dir: &Path) -> ChunkStore {
    std::fs::create_dir_all(dir).unwrap();
    ChunkStore::open(
        &format!("file://{}", dir.display()),
        &sealed_store::StoreOptions::default(),
    )
    .await
    .unwrap()
}

/// The filesystem of a stored version, read through `cache` with `policy`.
pub async fn open_version(
    store: &ChunkStore,
    digest: Digest,
    cache: &sealed_mount::NodeCache,
    policy: sealed_mount::ReadaheadPolicy,
) -> sealed_mount::SealedFs {
    let manifest = store.get_manifest(&digest).await.unwrap();
    sealed_mount::SealedFs::new(
        digest,
        sealed_mount::Tree::build(manifest).unwrap(),
        store.clone(),
        cache.clone(),
        policy,
    )
}

/// A node cache with a disk tier of `disk_bytes` in `dir` (memory tier at its default).
pub fn disk_cache(dir: &Path, disk_bytes: u64) -> sealed_mount::NodeCache {
    sealed_mount::NodeCache::new(&sealed_mount::NodeCacheOptions {
        disk_dir: Some(dir.to_path_buf()),
        disk_bytes,
        ..Default::default()
    })
    .unwrap()
}

/// A file:// store in a temp dir, plus a source tree pushed into it.
pub struct Fixture {
    pub _tmp: tempfile::TempDir,
    pub src: PathBuf,
    pub store_dir: PathBuf,
    pub store: ChunkStore,
    pub digest: Digest,
}

pub async fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    make_tree(&src);
    let store_dir = tmp.path().join("store");
    let store = file_store(&store_dir).await;
    let digest = push_dir(&store, &src).await;
    Fixture {
        _tmp: tmp,
        src,
        store_dir,
        store,
        digest,
    }
}

/// Overwrites the stored bytes of a chunk in a file:// store.
pub fn corrupt_chunk(store_dir: &Path, digest: &Digest) {
    let path = store_dir.join(ChunkStore::chunk_key(digest).as_ref());
    let mut data = std::fs::read(&path).unwrap();
    data[0] ^= 0xff;
    std::fs::write(&path, data).unwrap();
}

pub const OK: u8 = 0;
pub const HANG: u8 = 1;
pub const FAIL: u8 = 2;

/// The faults of a store behind it (a [`GetHook`] of a [`HookedStore`]): chunk GETs can be
/// made to hang or fail, and are counted; the next few manifest GETs can be made to fail.
#[derive(Debug)]
pub struct FaultyStore {
    pub mode: AtomicU8,
    pub chunk_gets: AtomicU64,
    pub manifest_gets: AtomicU64,
    pub manifest_failures: AtomicU64,
    /// While set, GETs of learned prefetch profiles wait.
    pub hold_profile_gets: AtomicBool,
    /// Every chunk GET takes this much longer (a store far away).
    pub chunk_delay_ms: AtomicU64,
}

impl FaultyStore {
    pub fn new() -> Arc<FaultyStore> {
        Arc::new(FaultyStore {
            mode: AtomicU8::new(OK),
            chunk_gets: AtomicU64::new(0),
            manifest_gets: AtomicU64::new(0),
            manifest_failures: AtomicU64::new(0),
            hold_profile_gets: AtomicBool::new(false),
            chunk_delay_ms: AtomicU64::new(0),
        })
    }

    pub fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }

    pub fn gets(&self) -> u64 {
        self.chunk_gets.load(Ordering::SeqCst)
    }

    /// The next `n` manifest GETs fail with a backend error.
    pub fn fail_manifest_gets(&self, n: u64) {
        self.manifest_failures.store(n, Ordering::SeqCst);
    }

    pub fn manifest_gets(&self) -> u64 {
        self.manifest_gets.load(Ordering::SeqCst)
    }

    /// Every chunk GET takes `ms` longer from now on.
    pub fn delay_chunk_gets(&self, ms: u64) {
        self.chunk_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Profile GETs wait while `held` (a slow lookup of the learned prefetch profile).
    pub fn hold_profile_gets(&self, held: bool) {
        self.hold_profile_gets.store(held, Ordering::SeqCst);
    }
}

/// `store`'s objects behind a [`FaultyStore`]: the switch, and the store to mount from.
pub fn faulty(store: &ChunkStore) -> (Arc<FaultyStore>, ChunkStore) {
    let faulty = FaultyStore::new();
    let hooked = HookedStore::new(store.object_store().clone(), faulty.clone());
    let store = ChunkStore::from_object_store(hooked, "faulty");
    (faulty, store)
}

/// A node cache whose fetches follow `policy` (no disk tier).
pub fn cache_with(policy: sealed_mount::FetchPolicy) -> sealed_mount::NodeCache {
    sealed_mount::NodeCache::new(&sealed_mount::NodeCacheOptions {
        fetch: policy,
        ..Default::default()
    })
    .expect("a node cache")
}

impl GetHook for FaultyStore {
    fn around_get<'a>(
        &'a self,
        location: &'a ObjectPath,
        get: BoxFuture<'a, object_store::Result<GetResult>>,
    ) -> BoxFuture<'a, object_store::Result<GetResult>> {
        Box::pin(async move {
            if location.as_ref().starts_with("chunks/") {
                self.chunk_gets.fetch_add(1, Ordering::SeqCst);
                let delay = self.chunk_delay_ms.load(Ordering::SeqCst);
                if delay > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
                }
                match self.mode.load(Ordering::SeqCst) {
                    HANG => futures::future::pending::<()>().await,
                    FAIL => {
                        return Err(object_store::Error::Generic {
                            store: "faulty",
                            source: "injected failure".into(),
                        });
                    }
                    _ => {}
                }
            }
            while location.as_ref().starts_with("profiles/")
                && self.hold_profile_gets.load(Ordering::SeqCst)
            {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            if location.as_ref().starts_with("manifests/") {
                self.manifest_gets.fetch_add(1, Ordering::SeqCst);
                let fail = self
                    .manifest_failures
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if fail {
                    return Err(object_store::Error::Generic {
                        store: "faulty",
                        source: "injected manifest failure".into(),
                    });
                }
            }
            get.await
        })
    }
}

/// Every path under `root` (relative, sorted), for comparing trees.
pub fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().to_path_buf();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
            out.push(rel);
        }
    }
    out.sort();
    out
}

/// Bytes in the files under `dir`. The cache renames temporary files into place and evicts
/// while a test measures it, so an entry that vanishes between the listing and its `stat`
/// counts as gone, not as an error.
pub fn disk_usage(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && d != dir => continue,
            Err(err) => panic!("list {}: {err}", d.display()),
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => panic!("stat {}: {err}", e.path().display()),
            }
        }
    }
    total
}

/// A file entry of `content` made of `chunks`, with its size and BLAKE3 (for hand-made
/// manifests).
pub fn file_entry(
    path: &str,
    content: &[u8],
    chunks: Vec<sealed_store::ChunkRef>,
) -> sealed_store::Entry {
    sealed_store::Entry {
        path: path.into(),
        kind: sealed_store::EntryKind::File(sealed_store::FileEntry {
            executable: false,
            size: content.len() as u64,
            blake3: sealed_store::Digest::of(content),
            chunks,
        }),
    }
}
