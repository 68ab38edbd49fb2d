//! Hydrated files and FUSE passthrough on real mounts: files whose chunks are all on the node
//! are assembled (verified against their BLAKE3) and later opens are served by the kernel
//! from that copy. Passthrough needs Linux >= 6.9 and root; where the kernel refuses it the
//! tests check the fallback and say so.

mod common;

use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use sealed_mount::{MountHandle, MountOptions, NodeCache, NodeCacheOptions};
use sealed_store::EntryKind;

fn disk_cache(dir: &Path, bytes: u64) -> NodeCache {
    NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(dir.to_path_buf()),
        disk_bytes: bytes,
        memory_bytes: 4 << 20,
        ..Default::default()
    })
    .unwrap()
}

fn mount(
    rt: &tokio::runtime::Runtime,
    fx: &Fixture,
    dir: &Path,
    cache: NodeCache,
    passthrough: bool,
) -> MountHandle {
    rt.block_on(MountHandle::spawn(
        fx.store.clone(),
        fx.digest,
        dir,
        cache,
        MountOptions {
            passthrough,
            // No readahead, so that a partial read leaves the file partial.
            readahead: sealed_mount::ReadaheadPolicy { initial: 0, max: 0 },
            kernel_readahead_kb: None,
            ..MountOptions::default()
        },
    ))
    .unwrap()
}

/// Files (relative paths) of the fixture with more than one chunk: the ones assembled.
fn multi_chunk_files(rt: &tokio::runtime::Runtime, fx: &Fixture) -> Vec<String> {
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    manifest
        .entries
        .iter()
        .filter_map(|e| match &e.kind {
            EntryKind::File(f) if f.chunks.len() > 1 => Some(e.path.clone()),
            _ => None,
        })
        .collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Reads with O_DIRECT (aligned buffer, aligned offsets) until the end, 8 MiB at a time: the
/// kernel splits each into 1 MiB FUSE requests sent at once (`FUSE_ASYNC_DIO`) when the file
/// is daemon-served, and the last read of a 9 MiB file is short.
fn read_direct(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    const ALIGN: usize = 4096;
    const STEP: usize = 8 << 20;
    let mut raw = vec![0u8; STEP + ALIGN];
    let skew = raw.as_ptr().align_offset(ALIGN);
    let buf = &mut raw[skew..skew + STEP];
    let mut out = Vec::new();
    loop {
        let n = f.read_at(buf, out.len() as u64)?;
        out.extend_from_slice(&buf[..n]);
        if n < STEP {
            return Ok(out);
        }
    }
}

fn check_identical(m: &Path, src: &Path, rel: &str) {
    let want = fs::read(src.join(rel)).unwrap();
    let f = File::open(m.join(rel)).unwrap_or_else(|e| panic!("{rel}: open: {e}"));
    let mut got = Vec::new();
    (&f).read_to_end(&mut got)
        .unwrap_or_else(|e| panic!("{rel}: read: {e}"));
    assert!(got == want, "{rel}: read");
    for offset in [0, 1, 4095, 1 << 20, want.len().saturating_sub(10)] {
        let mut buf = vec![0u8; 300_000];
        let n = f.read_at(&mut buf, offset as u64).unwrap();
        let end = (offset + 300_000).min(want.len());
        assert!(buf[..n] == want[offset..end], "{rel}: pread at {offset}");
    }
    // SAFETY: the mapped file is immutable (a read-only sealed version).
    let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
    assert!(map[..] == want[..], "{rel}: mmap");
    assert!(
        read_direct(&m.join(rel)).unwrap() == want,
        "{rel}: O_DIRECT"
    );
}

#[test]
fn complete_files_are_hydrated_and_served_by_passthrough() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let cache_dir = tempfile::tempdir().unwrap();
    let bound = 64 << 20;
    let cache = disk_cache(cache_dir.path(), bound);
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache.clone(), true);
    let m = mnt.path();
    let multi = multi_chunk_files(&rt, &fx);
    assert!(multi.len() >= 2, "the fixture has multi-chunk files");
    let big = "weights/model-00001.bin";

    // A partial file is served chunk by chunk, correctly, and is not assembled.
    let want = fs::read(fx.src.join(big)).unwrap();
    let mut head = vec![0u8; 1 << 20];
    File::open(m.join(big))
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    assert!(head[..] == want[..1 << 20]);
    std::thread::sleep(Duration::from_millis(300));
    let ino = |rel: &str| {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(m.join(rel)).unwrap().ino()
    };
    assert!(
        !handle.fs().is_hydrated(ino(big)),
        "a partial file is not hydrated"
    );

    // Read every file once (daemon-served), then they are assembled on release.
    for rel in walk(&fx.src) {
        if fs::symlink_metadata(fx.src.join(&rel)).unwrap().is_file() {
            assert!(fs::read(m.join(&rel)).unwrap() == fs::read(fx.src.join(&rel)).unwrap());
        }
    }
    let expected = multi.len() as u64;
    wait_for("the multi-chunk files to be hydrated", || {
        handle.metrics().snapshot().files_hydrated >= expected
    });
    for rel in &multi {
        assert!(handle.fs().is_hydrated(ino(rel)), "{rel} hydrated");
    }
    // No byte held twice: the chunks of assembled files have no files of their own, and
    // the cache stays within its bound.
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let chunk_files: Vec<String> = files_under(&cache_dir.path().join("chunks"))
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for (path, file) in manifest.files() {
        if multi.iter().any(|r| r == path) {
            for c in &file.chunks {
                assert!(
                    !chunk_files.contains(&c.digest.hex()),
                    "chunk of hydrated {path} is held twice"
                );
            }
            let assembled = cache_dir
                .path()
                .join("files")
                .join(&file.blake3.hex()[..2])
                .join(file.blake3.hex());
            assert_eq!(
                fs::read(assembled).unwrap(),
                fs::read(fx.src.join(path)).unwrap()
            );
        }
    }
    assert!(disk_usage(cache_dir.path()) <= bound);

    // New opens: byte-identical through read, pread, mmap and O_DIRECT.
    let before = handle.metrics().snapshot();
    for rel in &multi {
        check_identical(m, &fx.src, rel);
    }
    let after = handle.metrics().snapshot();
    if after.passthrough_opens == before.passthrough_opens {
        eprintln!(
            "SKIPPED (passthrough part): the kernel or privileges refused FUSE passthrough \
             ({} fallbacks); hydrated files were served by the daemon",
            after.passthrough_fallbacks
        );
        assert!(after.passthrough_fallbacks > before.passthrough_fallbacks);
    } else {
        // Reads of passthrough files never enter the daemon.
        assert_eq!(
            after.bytes_read, before.bytes_read,
            "passthrough reads went through the daemon"
        );
    }
    rt.block_on(handle.unmount()).unwrap();

    // A second mount on the node finds the hydrated files at once.
    let mnt2 = tempfile::tempdir().unwrap();
    let cache2 = disk_cache(cache_dir.path(), bound);
    let handle2 = mount(&rt, &fx, mnt2.path(), cache2, true);
    check_identical(mnt2.path(), &fx.src, big);
    let s = handle2.metrics().snapshot();
    assert_eq!(
        s.store_fetches, 0,
        "the second mount fetched from the store"
    );
    rt.block_on(handle2.unmount()).unwrap();
}

#[test]
fn eviction_never_takes_an_open_passthrough_file() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let cache_dir = tempfile::tempdir().unwrap();
    // Room for the 9 MiB file and little else.
    let bound = 12 << 20;
    let cache = disk_cache(cache_dir.path(), bound);
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache, true);
    let m = mnt.path();
    let big = "weights/model-00001.bin";
    let want = fs::read(fx.src.join(big)).unwrap();
    assert!(fs::read(m.join(big)).unwrap() == want);
    wait_for("the big file to be hydrated", || {
        handle.metrics().snapshot().files_hydrated >= 1
    });
    let open = File::open(m.join(big)).unwrap();
    let passthrough = handle.metrics().snapshot().passthrough_opens > 0;
    // Pressure: other files need the space the open file holds.
    for rel in ["weights/model-copy.bin", "weights/small.bin"] {
        for _ in 0..2 {
            assert!(fs::read(m.join(rel)).unwrap() == fs::read(fx.src.join(rel)).unwrap());
        }
        let used = disk_usage(cache_dir.path());
        assert!(
            used <= bound,
            "over the bound: {used} (files {}, chunks {}, tmp {}), {:?}",
            disk_usage(&cache_dir.path().join("files")),
            disk_usage(&cache_dir.path().join("chunks")),
            disk_usage(&cache_dir.path().join("tmp")),
            handle.metrics().snapshot()
        );
    }
    let assembled = files_under(&cache_dir.path().join("files"));
    if passthrough {
        assert_eq!(assembled.len(), 1, "the open passthrough file was evicted");
    } else {
        eprintln!("SKIPPED (pin part): passthrough unavailable here, nothing is pinned");
    }
    let mut got = Vec::new();
    (&open).read_to_end(&mut got).unwrap();
    assert!(
        got == want,
        "the open file reads back identical under pressure"
    );
    // SAFETY: immutable file.
    let map = unsafe { memmap2::Mmap::map(&open) }.unwrap();
    assert!(map[..] == want[..]);
    drop(map);
    drop(open);
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn without_passthrough_hydrated_files_are_served_by_the_daemon() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = disk_cache(cache_dir.path(), 64 << 20);
    let mnt = tempfile::tempdir().unwrap();
    // The path taken when passthrough is unavailable (no kernel support, not root).
    let handle = mount(&rt, &fx, mnt.path(), cache, false);
    let m = mnt.path();
    let big = "weights/model-00001.bin";
    assert!(fs::read(m.join(big)).unwrap() == fs::read(fx.src.join(big)).unwrap());
    wait_for("the big file to be hydrated", || {
        handle.metrics().snapshot().files_hydrated >= 1
    });
    let before = handle.metrics().snapshot();
    check_identical(m, &fx.src, big);
    let after = handle.metrics().snapshot();
    assert_eq!(after.passthrough_opens, 0);
    assert!(after.passthrough_fallbacks > before.passthrough_fallbacks);
    assert!(after.bytes_read > before.bytes_read, "served by the daemon");
    // From the assembled file (disk tier), not the store.
    assert_eq!(after.store_fetches, before.store_fetches);
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn a_corrupt_chunk_is_never_assembled() {
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let (_, file) = manifest
        .files()
        .find(|(p, _)| *p == "weights/model-00001.bin")
        .unwrap();
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = disk_cache(cache_dir.path(), 64 << 20);
    corrupt_chunk(&fx.store_dir, &file.chunks[1].digest);
    let result = rt.block_on(sealed_mount::hydrate::assemble(&cache, &fx.store, file));
    assert!(
        result.is_err(),
        "assembled from a corrupt chunk: {result:?}"
    );
    assert!(files_under(&cache_dir.path().join("files")).is_empty());
    // No partial assembly left (chunk writes of the fetches alongside may still be there).
    let left = files_under(&cache_dir.path().join("tmp"));
    let blake3 = file.blake3.hex();
    assert!(
        !left.iter().any(|p| p
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&blake3)),
        "{left:?}"
    );
    assert_eq!(cache.metrics().snapshot().hydration_failures, 1);

    // A manifest whose whole-file BLAKE3 lies: the assembly is refused, nothing kept.
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let (_, file) = manifest
        .files()
        .find(|(p, _)| *p == "weights/model-00001.bin")
        .unwrap();
    let mut lying = file.clone();
    lying.blake3 = sealed_store::Digest::of(b"something else");
    let cache = disk_cache(cache_dir.path(), 64 << 20);
    let result = rt.block_on(sealed_mount::hydrate::assemble(&cache, &fx.store, &lying));
    assert!(
        matches!(
            result,
            Err(sealed_mount::hydrate::HydrateError::WrongContent { .. })
        ),
        "{result:?}"
    );
    assert!(files_under(&cache_dir.path().join("files")).is_empty());
    // The honest entry assembles.
    let ok = rt.block_on(sealed_mount::hydrate::assemble(&cache, &fx.store, file));
    assert!(matches!(ok, Ok(true)), "{ok:?}");
    let assembled = files_under(&cache_dir.path().join("files"));
    assert_eq!(assembled.len(), 1);
    assert_eq!(
        fs::read(&assembled[0]).unwrap(),
        fs::read(fx.src.join("weights/model-00001.bin")).unwrap()
    );
}

/// Issue 33: a first open of a hydrated file whose copy this process has not checked yet is
/// not held up by the check. It is daemon-served at once, every chunk read from the copy and
/// verified against the manifest (a flipped byte there is caught and the chunk fetched again,
/// never served), while the copy's check runs beside it; once the check matched and the
/// handle closed, the next open is passthrough. A large file first in the manifest keeps the
/// mount's walker busy, so the opens below find their copies unchecked. Before, an open
/// waited for the check (up to 5 s) and went passthrough.
#[test]
fn a_first_open_of_an_unchecked_copy_is_served_at_once_chunk_by_chunk_verified() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(&src).unwrap();
    let (first, good, flipped) = ("a-first.bin", "z-good.bin", "z-flipped.bin");
    fs::write(src.join(first), random_bytes(31, 64 << 20)).unwrap();
    fs::write(src.join(good), random_bytes(32, 6 << 20)).unwrap();
    fs::write(src.join(flipped), random_bytes(33, 6 << 20)).unwrap();
    let store_dir = tmp.path().join("store");
    let store = rt.block_on(file_store(&store_dir));
    let digest = rt.block_on(push_dir(&store, &src));
    let fx = Fixture {
        _tmp: tmp,
        src,
        store_dir,
        store,
        digest,
    };
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let blake3 = |rel: &str| {
        manifest
            .files()
            .find(|(p, _)| *p == rel)
            .map(|(_, f)| f.blake3)
            .unwrap()
    };
    let want = |rel: &str| fs::read(fx.src.join(rel)).unwrap();
    let cache_dir = tempfile::tempdir().unwrap();
    let bound = 512 << 20;

    // The first mount reads every file: all three are assembled on the node.
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(
        &rt,
        &fx,
        mnt.path(),
        disk_cache(cache_dir.path(), bound),
        true,
    );
    for rel in [first, good, flipped] {
        assert!(fs::read(mnt.path().join(rel)).unwrap() == want(rel));
    }
    wait_for("the three files to be hydrated", || {
        handle.metrics().snapshot().files_hydrated >= 3
    });
    rt.block_on(handle.unmount()).unwrap();
    let copy = |rel: &str| {
        let hex = blake3(rel).hex();
        cache_dir.path().join("files").join(&hex[..2]).join(hex)
    };
    // A failing disk between the two mounts.
    {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(copy(flipped))
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 3 << 20).unwrap();
        b[0] ^= 0x5a;
        f.write_all_at(&b, 3 << 20).unwrap();
        f.sync_all().unwrap();
    }
    let _ = std::process::Command::new("sync").status();
    if let Err(e) = fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("cannot drop the page cache ({e}): the walker may check faster");
    }

    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(
        &rt,
        &fx,
        mnt.path(),
        disk_cache(cache_dir.path(), bound),
        true,
    );
    let m = mnt.path();
    // Opened at once, while the walker hashes the 64 MiB file.
    let good_file = File::open(m.join(good)).unwrap();
    let flipped_file = File::open(m.join(flipped)).unwrap();
    let s = handle.metrics().snapshot();
    assert_eq!(
        (s.unverified_opens, s.passthrough_opens),
        (2, 0),
        "first opens of unchecked copies are daemon-served at once, not passthrough after the check"
    );
    let mut got = Vec::new();
    (&good_file).read_to_end(&mut got).unwrap();
    assert!(got == want(good), "{good}: wrong bytes");
    let mut got = Vec::new();
    match (&flipped_file).read_to_end(&mut got) {
        Ok(_) => assert!(
            got == want(flipped),
            "{flipped}: the flipped byte was served"
        ),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{flipped}: {e}"),
    }
    let s = handle.metrics().snapshot();
    assert!(s.disk_hits > 0, "the daemon read chunks from the copies");
    assert!(
        s.bytes_read >= (12 << 20),
        "both files were read through the daemon"
    );
    assert!(s.verification_failures >= 1, "the flipped byte is counted");
    drop((good_file, flipped_file));

    // The checks ran beside the reads: the good copies match (the flipped one is dropped,
    // its damage counted above); new opens are passthrough, and every path reads right.
    wait_for("the good copies to be checked", || {
        handle.metrics().snapshot().files_verified >= 2
    });
    if let Ok(now) = fs::read(copy(flipped)) {
        assert!(
            now == want(flipped),
            "the flipped copy is still in the cache"
        );
    }
    let before = handle.metrics().snapshot();
    for rel in [first, good, flipped] {
        check_identical(m, &fx.src, rel);
    }
    let after = handle.metrics().snapshot();
    if after.passthrough_fallbacks > before.passthrough_fallbacks {
        eprintln!(
            "SKIPPED (passthrough part): the kernel or privileges refused FUSE passthrough; \
             hydrated files were served by the daemon"
        );
    } else {
        assert!(
            after.passthrough_opens >= before.passthrough_opens + 2,
            "opens after the checks are passthrough"
        );
    }
    rt.block_on(handle.unmount()).unwrap();
}
