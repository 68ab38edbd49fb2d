//! Real FUSE mounts (CI runs these as root; they skip, saying why, only without /dev/fuse).

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rand::{Rng, SeedableRng};
use sealed_mount::{FetchPolicy, MountHandle, MountOptions, NodeCache, NodeCacheOptions};
use sealed_store::{
    ChunkParams, ChunkRef, ChunkStore, Digest, Entry, EntryKind, FileEntry, Manifest,
};

fn is_mounted(dir: &Path) -> bool {
    let dir = fs::canonicalize(dir).unwrap();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(dir.to_str().unwrap()))
}

fn errno_of(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

#[test]
fn mounted_version_reads_back_identical_and_refuses_writes() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let mnt = tempfile::tempdir().unwrap();
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            fx.store.clone(),
            fx.digest,
            mnt.path(),
            cache,
            MountOptions::default(),
        ))
        .unwrap();
    let m = mnt.path();
    assert!(is_mounted(m));

    // Listings, sizes, modes, symlinks.
    assert_eq!(walk(m), walk(&fx.src));
    for rel in walk(&fx.src) {
        let want = fs::symlink_metadata(fx.src.join(&rel)).unwrap();
        let got = fs::symlink_metadata(m.join(&rel)).unwrap();
        assert_eq!(got.file_type(), want.file_type(), "{rel:?}");
        if want.is_file() {
            assert_eq!(got.len(), want.len(), "{rel:?}");
            let exec = want.permissions().mode() & 0o111 != 0;
            assert_eq!(
                got.permissions().mode() & 0o777,
                if exec { 0o555 } else { 0o444 }
            );
        }
        if want.file_type().is_symlink() {
            assert_eq!(
                fs::read_link(m.join(&rel)).unwrap(),
                fs::read_link(fx.src.join(&rel)).unwrap()
            );
        }
    }

    let files: Vec<_> = walk(&fx.src)
        .into_iter()
        .filter(|p| fs::symlink_metadata(fx.src.join(p)).unwrap().is_file())
        .collect();
    // Sequential, through symlinks too.
    for rel in &files {
        assert!(
            fs::read(m.join(rel)).unwrap() == fs::read(fx.src.join(rel)).unwrap(),
            "{rel:?}"
        );
    }
    assert!(
        fs::read(m.join("link-to-model")).unwrap()
            == fs::read(fx.src.join("weights/model-00001.bin")).unwrap()
    );
    // Random offsets with pread.
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for rel in &files {
        let want = fs::read(fx.src.join(rel)).unwrap();
        let f = File::open(m.join(rel)).unwrap();
        for _ in 0..40 {
            let offset = rng.random_range(0..=want.len());
            let len = rng.random_range(0..(2 << 20));
            let mut buf = vec![0u8; len];
            let mut got = 0;
            while got < len {
                let n = f.read_at(&mut buf[got..], (offset + got) as u64).unwrap();
                if n == 0 {
                    break;
                }
                got += n;
            }
            let end = (offset + len).min(want.len());
            assert!(buf[..got] == want[offset..end], "{rel:?} at {offset}+{len}");
        }
    }
    // mmap.
    for rel in &files {
        let want = fs::read(fx.src.join(rel)).unwrap();
        if want.is_empty() {
            continue;
        }
        let f = File::open(m.join(rel)).unwrap();
        // SAFETY: the mapped file is immutable (a read-only sealed version).
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        assert!(map[..] == want[..], "{rel:?} via mmap");
    }
    // Many concurrent readers.
    let want = Arc::new(fs::read(fx.src.join("weights/model-00001.bin")).unwrap());
    let readers: Vec<_> = (0..12)
        .map(|i| {
            let path = m.join(if i % 2 == 0 {
                "weights/model-00001.bin"
            } else {
                "link-to-model"
            });
            let want = want.clone();
            std::thread::spawn(move || {
                let mut f = File::open(path).unwrap();
                let mut got = Vec::new();
                f.read_to_end(&mut got).unwrap();
                assert!(got == *want);
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }

    // Writes, creates, renames, chmod, mkdir, unlink: EROFS.
    let erofs = libc::EROFS;
    assert_eq!(errno_of(File::create(m.join("new")).unwrap_err()), erofs);
    assert_eq!(
        errno_of(
            OpenOptions::new()
                .write(true)
                .open(m.join("tiny.txt"))
                .unwrap_err()
        ),
        erofs
    );
    assert_eq!(
        errno_of(fs::rename(m.join("tiny.txt"), m.join("moved")).unwrap_err()),
        erofs
    );
    assert_eq!(
        errno_of(
            fs::set_permissions(m.join("tiny.txt"), fs::Permissions::from_mode(0o777)).unwrap_err()
        ),
        erofs
    );
    assert_eq!(errno_of(fs::create_dir(m.join("d")).unwrap_err()), erofs);
    assert_eq!(
        errno_of(fs::remove_file(m.join("tiny.txt")).unwrap_err()),
        erofs
    );
    assert_eq!(
        fs::read(m.join("missing")).unwrap_err().kind(),
        ErrorKind::NotFound
    );

    let st = nix_statfs(m);
    assert!(st > 0);

    rt.block_on(handle.unmount()).unwrap();
    assert!(!is_mounted(m));
}

/// Blocks reported by statfs(2) on the mount.
fn nix_statfs(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated and st is a valid out-pointer.
    assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
    st.f_blocks as u64
}

#[test]
fn corrupt_chunk_is_eio_through_the_mount_and_counted() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let chunk = manifest
        .entries
        .iter()
        .find_map(|e| match &e.kind {
            EntryKind::File(f) if e.path == "weights/small.bin" => Some(f.chunks[0].digest),
            _ => None,
        })
        .unwrap();
    corrupt_chunk(&fx.store_dir, &chunk);
    let mnt = tempfile::tempdir().unwrap();
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            fx.store.clone(),
            fx.digest,
            mnt.path(),
            cache,
            MountOptions::default(),
        ))
        .unwrap();
    let m = mnt.path();
    let err = fs::read(m.join("weights/small.bin")).unwrap_err();
    assert_eq!(errno_of(err), libc::EIO);
    assert!(handle.metrics().snapshot().verification_failures >= 1);
    assert_eq!(fs::read(m.join("tiny.txt")).unwrap(), b"hello\n");
    assert!(
        fs::read(m.join("weights/model-00001.bin")).unwrap()
            == fs::read(fx.src.join("weights/model-00001.bin")).unwrap()
    );
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn unreachable_store_is_eio_after_the_timeout_and_unmount_still_works() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let (faulty, store) = faulty(&fx.store);
    let policy = FetchPolicy {
        attempt_timeout: Duration::from_millis(500),
        retries: 1,
        backoff: Duration::from_millis(50),
        // Off: this test wants a reader stuck on the hanging store during the unmount (the
        // breaker's tests are in store_faults.rs).
        breaker_open: Duration::ZERO,
    };
    let cache = cache_with(policy);
    let mnt = tempfile::tempdir().unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            store,
            fx.digest,
            mnt.path(),
            cache,
            MountOptions::default(),
        ))
        .unwrap();
    let m = mnt.path().to_path_buf();
    assert_eq!(fs::read(m.join("tiny.txt")).unwrap(), b"hello\n");

    faulty.set(HANG);
    let started = Instant::now();
    let err = fs::read(m.join("weights/small.bin")).unwrap_err();
    assert_eq!(errno_of(err), libc::EIO);
    assert!(
        started.elapsed() < policy.worst_case() + Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // Cached data is still served.
    assert_eq!(fs::read(m.join("tiny.txt")).unwrap(), b"hello\n");

    // A reader stuck on the hanging store does not stop the unmount.
    let slow = m.join("weights/model-copy.bin");
    let reader = std::thread::spawn(move || fs::read(slow).map(|d| d.len()));
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    rt.block_on(handle.unmount()).unwrap();
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(!is_mounted(&m));
    assert!(reader.join().unwrap().is_err());
}

#[test]
fn mount_time_does_not_grow_with_data_size() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = ChunkStore::memory();
    // A 10 GiB version: only its manifest exists, so mounting it can only be fast if
    // mounting fetches nothing but the manifest.
    let chunk = ChunkRef {
        digest: Digest::of(b"never fetched"),
        len: 4 << 20,
    };
    let huge = Manifest {
        chunking: ChunkParams::default(),
        entries: vec![Entry {
            path: "huge.bin".into(),
            kind: EntryKind::File(FileEntry {
                executable: false,
                size: 2560 * (4 << 20),
                blake3: Digest::of(b"x"),
                chunks: vec![chunk; 2560],
            }),
        }],
    };
    let (bytes, huge_digest) = huge.seal().unwrap();
    rt.block_on(store.put_manifest(bytes)).unwrap();
    // 1,000 small files in 10 directories, built directly (pushing them is the store's test).
    let mut entries = Vec::new();
    for d in 0..10 {
        entries.push(Entry {
            path: format!("d{d}"),
            kind: EntryKind::Dir,
        });
    }
    for i in 0..1000 {
        let data = format!("file {i}\n").into_bytes();
        let digest = Digest::of(&data);
        rt.block_on(store.put_chunk(&digest, data.clone().into()))
            .unwrap();
        entries.push(Entry {
            path: format!("d{}/f{i}.txt", i % 10),
            kind: EntryKind::File(FileEntry {
                executable: false,
                size: data.len() as u64,
                blake3: digest,
                chunks: vec![ChunkRef {
                    digest,
                    len: data.len() as u32,
                }],
            }),
        });
    }
    entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let many = Manifest {
        chunking: ChunkParams::default(),
        entries,
    };
    let (bytes, many_digest) = many.seal().unwrap();
    rt.block_on(store.put_manifest(bytes)).unwrap();

    for (name, digest) in [("10 GiB", huge_digest), ("1000 files", many_digest)] {
        let mnt = tempfile::tempdir().unwrap();
        let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
        let started = Instant::now();
        let handle = rt
            .block_on(MountHandle::spawn(
                store.clone(),
                digest,
                mnt.path(),
                cache,
                MountOptions::default(),
            ))
            .unwrap();
        let elapsed = started.elapsed();
        eprintln!(
            "mount-ready for {name}: {:.1} ms",
            elapsed.as_secs_f64() * 1e3
        );
        assert!(elapsed < Duration::from_secs(2), "{name}: {elapsed:?}");
        if name == "10 GiB" {
            assert_eq!(
                fs::metadata(mnt.path().join("huge.bin")).unwrap().len(),
                10 << 30
            );
            assert_eq!(handle.metrics().snapshot().store_fetches, 0);
        } else {
            assert_eq!(
                fs::read_to_string(mnt.path().join("d7/f997.txt")).unwrap(),
                "file 997\n"
            );
        }
        let started = Instant::now();
        rt.block_on(handle.unmount()).unwrap();
        eprintln!(
            "unmount of {name}: {:.1} ms",
            started.elapsed().as_secs_f64() * 1e3
        );
    }
}

#[test]
fn spawn_with_manifest_needs_no_manifest_in_the_store_and_still_verifies_chunks() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    // The caller's verified copy; then the store loses the manifest object.
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    fs::remove_file(
        fx.store_dir
            .join(ChunkStore::manifest_key(&fx.digest).as_ref()),
    )
    .unwrap();
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let fetching = tempfile::tempdir().unwrap();
    let err = rt
        .block_on(MountHandle::spawn(
            fx.store.clone(),
            fx.digest,
            fetching.path(),
            cache.clone(),
            MountOptions::default(),
        ))
        .err()
        .expect("spawn needs the manifest from the store");
    assert!(err.to_string().contains(&fx.digest.to_string()), "{err}");

    let small = manifest
        .entries
        .iter()
        .find_map(|e| match &e.kind {
            EntryKind::File(f) if e.path == "weights/small.bin" => Some(f.chunks[0].digest),
            _ => None,
        })
        .unwrap();
    corrupt_chunk(&fx.store_dir, &small);
    let mnt = tempfile::tempdir().unwrap();
    let handle = rt
        .block_on(MountHandle::spawn_with_manifest(
            fx.store.clone(),
            fx.digest,
            manifest,
            mnt.path(),
            cache,
            MountOptions::default(),
        ))
        .unwrap();
    let m = mnt.path();
    assert!(is_mounted(m));
    assert_eq!(walk(m), walk(&fx.src));
    for rel in [
        "tiny.txt",
        "weights/model-00001.bin",
        "weights/model-copy.bin",
    ] {
        assert!(
            fs::read(m.join(rel)).unwrap() == fs::read(fx.src.join(rel)).unwrap(),
            "{rel}"
        );
    }
    // Chunks are still verified: the corrupt one is EIO, never wrong bytes.
    let err = fs::read(m.join("weights/small.bin")).unwrap_err();
    assert_eq!(errno_of(err), libc::EIO);
    assert!(handle.metrics().snapshot().verification_failures >= 1);
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn spawn_retries_a_failing_manifest_fetch_by_the_fetch_policy() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let (faulty, store) = faulty(&fx.store);
    let policy = FetchPolicy {
        attempt_timeout: Duration::from_secs(5),
        retries: 2,
        backoff: Duration::from_millis(10),
        breaker_open: Duration::ZERO,
    };
    let cache = cache_with(policy);

    // Two failures: the third and last attempt mounts.
    faulty.fail_manifest_gets(2);
    let mnt = tempfile::tempdir().unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            store.clone(),
            fx.digest,
            mnt.path(),
            cache.clone(),
            MountOptions::default(),
        ))
        .unwrap();
    assert_eq!(faulty.manifest_gets(), 3, "one try and two retries");
    assert_eq!(fs::read(mnt.path().join("tiny.txt")).unwrap(), b"hello\n");
    rt.block_on(handle.unmount()).unwrap();

    // A store that keeps failing: its error, after exactly the policy's attempts.
    faulty.fail_manifest_gets(10);
    let before = faulty.manifest_gets();
    let err = rt
        .block_on(MountHandle::spawn(
            store,
            fx.digest,
            mnt.path(),
            cache,
            MountOptions::default(),
        ))
        .err()
        .expect("the manifest never comes");
    assert!(
        matches!(
            err,
            sealed_mount::MountError::Store(sealed_store::Error::Backend { .. })
        ),
        "{err}"
    );
    assert_eq!(faulty.manifest_gets() - before, 3);
}

#[test]
fn a_mount_store_is_opened_without_client_retries() {
    let user = sealed_store::StoreOptions {
        timeout: Duration::from_secs(7),
        retries: 4,
        ..Default::default()
    };
    let policy = FetchPolicy::for_store(&user);
    assert_eq!(policy.attempt_timeout, Duration::from_secs(7));
    assert_eq!(policy.retries, 4);
    let client = FetchPolicy::store_options(&user);
    assert_eq!(client.retries, 0, "the fetch policy owns the retries");
    assert_eq!(client.timeout, user.timeout);
}
