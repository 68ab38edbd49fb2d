//! Manifests that lie, at the mount: a chunk reference whose declared length is not the
//! chunk's is EIO for its readers (never short bytes, never a panic in `Bytes::slice` of a
//! FUSE worker), and a manifest whose symlinks lead out of the volume through each other is
//! refused before anything is mounted.

mod common;

use std::path::Path;

use bytes::Bytes;
use common::open_version;
use sealed_mount::tree::ROOT_INO;
use sealed_mount::{
    FetchError, FsError, MountError, MountHandle, MountOptions, NodeCache, NodeCacheOptions,
    ReadaheadPolicy, SealedFs, Tree,
};
use sealed_store::{ChunkParams, ChunkRef, ChunkStore, Digest, Entry, EntryKind, Manifest};

fn chunk(data: &[u8], len: u32) -> ChunkRef {
    ChunkRef {
        digest: Digest::of(data),
        len,
    }
}

/// `short` is "hello world" but names the 5-byte chunk "hello" with the length 11 (the
/// lengths add up, so the manifest is well formed); `good` is right and shares "hello".
async fn lying_version(store: &ChunkStore) -> Digest {
    for c in [&b"hello"[..], b" world"] {
        store
            .put_chunk(&Digest::of(c), Bytes::copy_from_slice(c))
            .await
            .unwrap();
    }
    let m = Manifest {
        chunking: ChunkParams::default(),
        entries: vec![
            common::file_entry(
                "good",
                b"hello world",
                vec![chunk(b"hello", 5), chunk(b" world", 6)],
            ),
            common::file_entry("short", b"hello world", vec![chunk(b"hello", 11)]),
        ],
    };
    store.put_manifest(m.encode().unwrap()).await.unwrap()
}

async fn open_fs(store: &ChunkStore, digest: Digest, cache: &NodeCache) -> SealedFs {
    open_version(store, digest, cache, ReadaheadPolicy::default()).await
}

fn is_wrong_length(e: &FsError) -> bool {
    matches!(
        e,
        FsError::Fetch(FetchError::WrongLength {
            declared: 11,
            actual: 5,
            ..
        })
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_length_that_is_not_the_chunks_is_eio_never_a_panic() {
    let store = ChunkStore::memory();
    let digest = lying_version(&store).await;
    let disk = tempfile::tempdir().unwrap();
    for disk_dir in [None, Some(disk.path().to_path_buf())] {
        let cache = NodeCache::new(&NodeCacheOptions {
            disk_dir,
            ..Default::default()
        })
        .unwrap();
        let fs = open_fs(&store, digest, &cache).await;
        let short = fs.lookup(ROOT_INO, b"short").unwrap().ino;
        let good = fs.lookup(ROOT_INO, b"good").unwrap().ino;
        // Twice: from the store, then from the memory (and disk) tier.
        for _ in 0..2 {
            // Past the chunk's real end (the old code panicked slicing 6..5) and from the
            // start (the old code served the 5 short bytes as if they were the file).
            for (offset, size) in [(6, 5), (0, 11), (0, 4096), (10, 1)] {
                let fh = fs.open(short, false).unwrap();
                let err = fs.read(short, Some(fh), offset, size).await.unwrap_err();
                assert!(is_wrong_length(&err), "{offset}+{size}: {err:?}");
                assert_eq!(err.errno(), libc::EIO);
                assert!(err.to_string().contains("manifest declares 11"), "{err}");
                fs.release(fh);
            }
            // The chunk's bytes are right; the file that references it rightly reads fine.
            let got = fs.read(good, None, 0, 4096).await.unwrap();
            assert_eq!(&got[..], b"hello world");
        }
        assert!(fs.metrics().snapshot().verification_failures >= 1);
        // Prefetching the lying reference fails the same way when it has bytes to look at
        // (with a disk cache that holds the chunk already, `prefetch` reads nothing and serves
        // nothing: readers are checked in `get`, as above).
        let fresh = NodeCache::new(&NodeCacheOptions::default()).unwrap();
        let err = fresh
            .prefetch(&store, &chunk(b"hello", 11))
            .await
            .unwrap_err();
        assert!(matches!(err, FetchError::WrongLength { .. }), "{err:?}");
    }
}

/// The example: `a/up -> ..` and `esc -> a/up/../..`.
fn escaping_manifest() -> Manifest {
    Manifest {
        chunking: ChunkParams::default(),
        entries: vec![
            Entry {
                path: "a".into(),
                kind: EntryKind::Dir,
            },
            Entry {
                path: "a/up".into(),
                kind: EntryKind::Symlink {
                    target: "..".into(),
                },
            },
            Entry {
                path: "esc".into(),
                kind: EntryKind::Symlink {
                    target: "a/up/../..".into(),
                },
            },
        ],
    }
}

#[test]
fn the_tree_refuses_links_that_leave_the_volume_through_each_other() {
    let err = Tree::build(escaping_manifest()).unwrap_err();
    assert!(
        err.contains("symlink 'esc'") && err.contains("outside the volume"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mounting_a_manifest_whose_links_escape_fails_before_the_mount() {
    let store = ChunkStore::memory();
    // Written as a buggy or hostile writer would: bytes the format's own encoder refuses.
    let digest = store
        .put_manifest(escaping_manifest().encode_unchecked())
        .await
        .unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let err = MountHandle::spawn(
        store.clone(),
        digest,
        mnt.path(),
        cache,
        MountOptions::default(),
    )
    .await
    .err()
    .expect("mounted a manifest whose links escape");
    assert!(matches!(err, MountError::Store(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("symlink 'esc'") && msg.contains("outside the volume"),
        "{msg}"
    );
    assert!(!is_mounted(mnt.path()));
}

fn is_mounted(dir: &Path) -> bool {
    let dir = std::fs::canonicalize(dir).unwrap();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(dir.to_str().unwrap()))
}

#[test]
fn through_the_kernel_a_lying_length_is_eio_and_the_mount_keeps_serving() {
    if !Path::new("/dev/fuse").exists() {
        eprintln!("SKIPPED: /dev/fuse is absent, so no FUSE mount can be made here");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = ChunkStore::memory();
    let digest = rt.block_on(lying_version(&store));
    let mnt = tempfile::tempdir().unwrap();
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            store,
            digest,
            mnt.path(),
            cache,
            MountOptions::default(),
        ))
        .unwrap();
    let m = mnt.path();
    let err = std::fs::read(m.join("short")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    let f = std::fs::File::open(m.join("short")).unwrap();
    let mut buf = [0u8; 5];
    let err = std::os::unix::fs::FileExt::read_at(&f, &mut buf, 6).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    drop(f);
    // No worker died: the other file still reads.
    assert_eq!(std::fs::read(m.join("good")).unwrap(), b"hello world");
    rt.block_on(handle.unmount()).unwrap();
}
