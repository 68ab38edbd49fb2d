//! A node disk cache damaged under the mount (a failing disk, a stray write): hydrated files,
//! single-chunk files' chunk files and chunk files with a flipped byte, between mounts and
//! while mounted. Every read must get the right bytes or EIO, never the flipped ones, and
//! the damage must be counted (`verification_failures`). Real FUSE mounts, passthrough on.

mod common;

use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use sealed_mount::{MountHandle, MountOptions, NodeCache, NodeCacheOptions};
use sealed_store::{Digest, FileEntry};

const BIG: &str = "weights/model-00001.bin";
const COPY: &str = "weights/model-copy.bin";

/// A node cache on `dir`; `scrub` turns on a fast background scrub of what it holds.
fn cache_on(dir: &Path, scrub: bool) -> NodeCache {
    NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(dir.to_path_buf()),
        disk_bytes: 64 << 20,
        memory_bytes: 4 << 20,
        scrub: if scrub {
            sealed_mount::ScrubOptions {
                bytes_per_second: 256 << 20,
                pass_interval: Duration::from_millis(100),
            }
        } else {
            sealed_mount::ScrubOptions::off()
        },
        ..Default::default()
    })
    .unwrap()
}

fn mount(rt: &tokio::runtime::Runtime, fx: &Fixture, dir: &Path, cache: NodeCache) -> MountHandle {
    rt.block_on(MountHandle::spawn(
        fx.store.clone(),
        fx.digest,
        dir,
        cache,
        MountOptions {
            passthrough: true,
            // No readahead: a partial read leaves the rest of a file off the node.
            readahead: sealed_mount::ReadaheadPolicy { initial: 0, max: 0 },
            kernel_readahead_kb: None,
            learned_prefetch: false,
            ..MountOptions::default()
        },
    ))
    .unwrap()
}

fn entry(rt: &tokio::runtime::Runtime, fx: &Fixture, rel: &str) -> FileEntry {
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    manifest
        .files()
        .find(|(p, _)| *p == rel)
        .map(|(_, f)| f.clone())
        .unwrap_or_else(|| panic!("{rel} is in the fixture"))
}

/// The largest file of the fixture that is one chunk (its chunk file is its whole copy).
fn single_chunk_file(rt: &tokio::runtime::Runtime, fx: &Fixture) -> (String, FileEntry) {
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    manifest
        .files()
        .filter(|(_, f)| f.chunks.len() == 1)
        .max_by_key(|(_, f)| f.size)
        .map(|(p, f)| (p.to_owned(), f.clone()))
        .unwrap()
}

fn cached(cache_dir: &Path, sub: &str, digest: &Digest) -> PathBuf {
    let hex = digest.hex();
    cache_dir.join(sub).join(&hex[..2]).join(hex)
}

/// Flips one byte of `path` in place (the same inode a passthrough backing file would be).
fn flip(path: &Path, at: u64) {
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x5a;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

fn drop_page_cache() {
    let _ = std::process::Command::new("sync").status();
    if let Err(e) = fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("cannot drop the page cache ({e}): reads below may come from it");
    }
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

fn is_eio(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EIO)
}

/// Reads `path` through the mount by read, O_DIRECT and mmap: each gets `want` or EIO.
fn right_or_eio(path: &Path, want: &[u8]) {
    let name = path.display();
    let mut got = Vec::new();
    match File::open(path).and_then(|mut f| f.read_to_end(&mut got)) {
        Ok(_) => assert!(got == want, "{name}: read served wrong bytes"),
        Err(e) => assert!(is_eio(&e), "{name}: read failed with {e}, not EIO"),
    }
    match read_direct(path) {
        Ok(got) => assert!(got == want, "{name}: O_DIRECT served wrong bytes"),
        Err(e) => assert!(is_eio(&e), "{name}: O_DIRECT failed with {e}, not EIO"),
    }
    // A mapping of a file whose reads fail would fault (SIGBUS): mapped only once a read
    // of it succeeded just now.
    let mut again = Vec::new();
    if let Ok(f) = File::open(path)
        && (&f).read_to_end(&mut again).is_ok()
        && !want.is_empty()
    {
        // SAFETY: the mapped file is immutable (a read-only sealed version).
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        assert!(map[..] == want[..], "{name}: mmap served wrong bytes");
    }
}

fn read_direct(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    const ALIGN: usize = 4096;
    const STEP: usize = 4 << 20;
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

#[test]
fn damaged_hydrated_and_single_chunk_files_are_not_served_by_the_next_mount() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let cache_dir = tempfile::tempdir().unwrap();
    let big = entry(&rt, &fx, BIG);
    let (single_rel, single) = single_chunk_file(&rt, &fx);
    let want_big = fs::read(fx.src.join(BIG)).unwrap();
    let want_single = fs::read(fx.src.join(&single_rel)).unwrap();

    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache_on(cache_dir.path(), false));
    assert!(fs::read(mnt.path().join(BIG)).unwrap() == want_big);
    assert!(fs::read(mnt.path().join(&single_rel)).unwrap() == want_single);
    wait_for("the big file to be hydrated", || {
        handle.metrics().snapshot().files_hydrated >= 1
    });
    rt.block_on(handle.unmount()).unwrap();

    // A failing disk between two mounts.
    flip(&cached(cache_dir.path(), "files", &big.blake3), 4 << 20);
    flip(
        &cached(cache_dir.path(), "chunks", &single.chunks[0].digest),
        0,
    );
    drop_page_cache();

    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache_on(cache_dir.path(), false));
    for _ in 0..2 {
        right_or_eio(&mnt.path().join(BIG), &want_big);
        right_or_eio(&mnt.path().join(&single_rel), &want_single);
    }
    wait_for("both damaged copies to be counted", || {
        handle.metrics().snapshot().verification_failures >= 2
    });
    // The damaged copies are gone; what replaces them is right.
    rt.block_on(handle.unmount()).unwrap();
    for (sub, digest, want) in [
        ("files", big.blake3, &want_big),
        ("chunks", single.chunks[0].digest, &want_single),
    ] {
        if let Ok(now) = fs::read(cached(cache_dir.path(), sub, &digest)) {
            assert!(now == *want, "a damaged {sub} copy is still in the cache");
        }
    }
}

#[test]
fn a_damaged_chunk_file_is_refetched_by_the_next_mount() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let cache_dir = tempfile::tempdir().unwrap();
    let big = entry(&rt, &fx, BIG);
    let want = fs::read(fx.src.join(BIG)).unwrap();
    let first = big.chunks[0];
    let len = first.len as usize;

    // Only the first chunk is read: the file stays partial, its chunk has a file of its own.
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache_on(cache_dir.path(), false));
    let mut head = vec![0u8; len];
    File::open(mnt.path().join(BIG))
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    assert!(head[..] == want[..len]);
    rt.block_on(handle.unmount()).unwrap();
    let chunk = cached(cache_dir.path(), "chunks", &first.digest);
    flip(&chunk, 10);
    drop_page_cache();

    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache_on(cache_dir.path(), false));
    let f = File::open(mnt.path().join(BIG)).unwrap();
    let mut got = vec![0u8; len];
    match f.read_exact_at(&mut got, 0) {
        Ok(()) => assert!(got[..] == want[..len], "a damaged chunk file was served"),
        Err(e) => assert!(is_eio(&e), "{e}"),
    }
    assert!(handle.metrics().snapshot().verification_failures >= 1);
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn damage_after_verification_is_found_by_the_scrub_while_mounted() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let cache_dir = tempfile::tempdir().unwrap();
    let big = entry(&rt, &fx, BIG);
    let copy = entry(&rt, &fx, COPY);
    let (single_rel, single) = single_chunk_file(&rt, &fx);
    let want_big = fs::read(fx.src.join(BIG)).unwrap();
    let want_single = fs::read(fx.src.join(&single_rel)).unwrap();
    let want_copy = fs::read(fx.src.join(COPY)).unwrap();

    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &fx, mnt.path(), cache_on(cache_dir.path(), true));
    let m = mnt.path();
    assert!(fs::read(m.join(BIG)).unwrap() == want_big);
    assert!(fs::read(m.join(&single_rel)).unwrap() == want_single);
    // The last chunk of the copy only (its own bytes, not shared with BIG): a chunk file.
    let last = *copy.chunks.last().unwrap();
    let tail_at = copy.size - u64::from(last.len);
    let mut tail = vec![0u8; last.len as usize];
    // Held open: a file whose chunks are all local is assembled when released, which would
    // drop this chunk's own file.
    let copy_open = File::open(m.join(COPY)).unwrap();
    copy_open.read_exact_at(&mut tail, tail_at).unwrap();
    assert!(tail[..] == want_copy[tail_at as usize..]);
    wait_for("the big file to be hydrated", || {
        handle.metrics().snapshot().files_hydrated >= 1
    });
    let chunk_file = cached(cache_dir.path(), "chunks", &last.digest);
    wait_for("the chunk file to be written", || chunk_file.exists());
    // Opened again now that they are whole on the node (passthrough where it works).
    right_or_eio(&m.join(BIG), &want_big);
    right_or_eio(&m.join(&single_rel), &want_single);
    let failures = handle.metrics().snapshot().verification_failures;
    // A handle open by passthrough while its copy is found damaged: the kernel keeps reading
    // that backing file for it (nothing can swap it), so new opens must not join it.
    let opens = handle.metrics().snapshot().passthrough_opens;
    let held = File::open(m.join(BIG)).unwrap();
    let held_by_passthrough = handle.metrics().snapshot().passthrough_opens > opens;

    // Damage after this process verified (and served) them.
    flip(&cached(cache_dir.path(), "files", &big.blake3), 4 << 20);
    flip(
        &cached(cache_dir.path(), "chunks", &single.chunks[0].digest),
        0,
    );
    flip(&chunk_file, 100);
    wait_for("the scrub to find the three damaged copies", || {
        let s = handle.metrics().snapshot();
        s.verification_failures >= failures + 3 && s.scrub_failures >= 3
    });
    let s = handle.metrics().snapshot();
    assert!(s.scrub_failures >= 3, "{s:?}");
    assert!(s.scrub_files >= 3 && s.scrub_bytes > 0, "{s:?}");
    if held_by_passthrough {
        let reopened = File::open(m.join(BIG));
        assert!(
            reopened.as_ref().is_err_and(is_eio),
            "an open joined a passthrough inode whose copy was dropped: {reopened:?}"
        );
    } else {
        eprintln!("SKIPPED (held handle part): passthrough unavailable here");
    }
    drop(held);
    right_or_eio(&m.join(BIG), &want_big);
    right_or_eio(&m.join(&single_rel), &want_single);
    let f = File::open(m.join(COPY)).unwrap();
    match f.read_exact_at(&mut tail, tail_at) {
        Ok(()) => assert!(tail[..] == want_copy[tail_at as usize..]),
        Err(e) => assert!(is_eio(&e), "{e}"),
    }
    drop(f);
    drop(copy_open);
    // The bad file is refetched through the tiers and assembled again.
    wait_for("the big file to be hydrated again", || {
        handle.metrics().snapshot().files_hydrated >= 2
    });
    right_or_eio(&m.join(BIG), &want_big);
    rt.block_on(handle.unmount()).unwrap();
}
