//! The node disk cache damaged while the plugin is down (issue 33): the plugin is killed, a
//! byte is flipped in a hydrated file and in a single-chunk file's chunk file, and the next
//! plugin resumes the live FUSE mount through the fd holder. The copies it finds on disk are
//! not trusted until it has checked them: readers get the right bytes (or EIO), never the
//! flipped ones, and the damage is counted. Real binaries, real FUSE, passthrough on.

mod common;

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{FdHolder, Plugin, can_mount, store_of};
use sealed_csi::proto::csi::node_client::NodeClient;
use sealed_store::{ChunkStore, Digest, StoreOptions};

const BIG: &str = "sub/weights.bin";
const SMALL: &str = "small.bin";

/// Bytes without repeats (xorshift), so that content-defined chunking cuts them.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn cached(cache: &Path, sub: &str, digest: &Digest) -> PathBuf {
    let hex = digest.hex();
    cache.join(sub).join(&hex[..2]).join(hex)
}

/// Flips one byte of `path` in place (the inode a passthrough backing file would be).
fn flip(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
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

/// The mount's own pages would hide what a new open is served from. No `sync`: with the
/// plugin down it could wait on the FUSE mount (the flipped files were synced already).
fn drop_page_cache() {
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("cannot drop the page cache ({e}): reads below may come from it");
    }
}

fn read_direct(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    const ALIGN: usize = 4096;
    const STEP: usize = 1 << 20;
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

/// Reads `path` (plain and O_DIRECT): the right bytes or EIO, never others. True if both
/// reads got the bytes. ENOTCONN (the new plugin not serving yet) is waited out.
fn right_or_eio(path: &Path, want: &[u8]) -> bool {
    let started = Instant::now();
    let mut good = true;
    fn plain(path: &Path) -> std::io::Result<Vec<u8>> {
        std::fs::read(path)
    }
    type Read = fn(&Path) -> std::io::Result<Vec<u8>>;
    let ways: [(&str, Read); 2] = [("read", plain), ("O_DIRECT", read_direct)];
    for (how, read) in ways {
        let got = loop {
            match read(path) {
                Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                    assert!(started.elapsed() < Duration::from_secs(30), "{e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => break other,
            }
        };
        match got {
            Ok(bytes) => assert!(
                bytes == want,
                "{} ({how}): wrong bytes served after the resume",
                path.display()
            ),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{how}: {e}, not EIO");
                good = false;
            }
        }
    }
    good
}

fn wait_for(what: &str, log: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}; log:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_damaged_while_the_plugin_is_down_is_not_served_after_resume() {
    if !can_mount() {
        eprintln!("SKIPPED: needs root and /dev/fuse to mount FUSE");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("tree");
    std::fs::create_dir_all(source.join("sub")).unwrap();
    // About three chunks, and one chunk (below the 256 KiB minimum cut).
    let want_big = pattern(3_000_000, 7);
    let want_small = pattern(150_000, 11);
    std::fs::write(source.join(BIG), &want_big).unwrap();
    std::fs::write(source.join(SMALL), &want_small).unwrap();
    let store = store_of(dir, source).await;
    let manifest = ChunkStore::open(&store.url, &StoreOptions::default())
        .await
        .unwrap()
        .get_manifest(&store.digest)
        .await
        .unwrap();
    let entry = |rel: &str| {
        manifest
            .files()
            .find(|(p, _)| *p == rel)
            .map(|(_, f)| f.clone())
            .unwrap()
    };
    let (big, small) = (entry(BIG), entry(SMALL));
    assert!(big.chunks.len() > 1 && small.chunks.len() == 1, "fixture");

    let holder_dir = tempfile::tempdir().unwrap();
    let holder_socket = holder_dir.path().join("fd-holder.sock");
    let _holder = FdHolder::start(&holder_socket);
    let holder_arg = format!("--fd-holder={}", holder_socket.display());
    let metrics_addr = sealed_test_support::servers::free_addr();
    let metrics_arg = format!("--metrics-addr={metrics_addr}");
    let metric = |name: &str| {
        common::sample(&common::http_get(metrics_addr, "/metrics").1, name).unwrap_or(0.0)
    };
    let args = [
        holder_arg.as_str(),
        metrics_arg.as_str(),
        "--learned-prefetch=false",
    ];
    let plugin = Plugin::start(&store.url, &args);
    let target = plugin.pods().join("a/volume");
    let mut client = NodeClient::new(plugin.channel().await);
    client
        .node_publish_volume(common::publish_digest(
            "vol",
            &target,
            &store.digest.to_string(),
        ))
        .await
        .expect("publish");
    let cache = plugin.dir.path().join("cache");
    let big_copy = cached(&cache, "files", &big.blake3);
    let small_copy = cached(&cache, "chunks", &small.chunks[0].digest);

    // Read to the end until both have whole copies on disk and are served by passthrough
    // (what the next plugin would hand the kernel without looking).
    let log = || std::fs::read_to_string(plugin.dir.path().join("plugin.log")).unwrap_or_default();
    wait_for("both files served by passthrough", log, || {
        assert!(std::fs::read(target.join(BIG)).unwrap() == want_big);
        assert!(std::fs::read(target.join(SMALL)).unwrap() == want_small);
        big_copy.exists() && small_copy.exists() && metric("sealed_passthrough_opens_total") >= 2.0
    });

    let home = plugin.crash();
    flip(&big_copy, 1 << 20);
    flip(&small_copy, 100);
    drop_page_cache();
    let plugin = Plugin::start_in(home, &store.url, &args);
    let log = || plugin.log();

    // Every read from now on: the right bytes or EIO. The damaged copies are caught (by the
    // walker of the resumed mount, an open's check, or the scrub), dropped and fetched again.
    for _ in 0..2 {
        right_or_eio(&target.join(BIG), &want_big);
        right_or_eio(&target.join(SMALL), &want_small);
    }
    wait_for("both damaged copies counted", log, || {
        metric("sealed_verification_failures_total") >= 2.0
    });
    assert_eq!(metric("sealed_csi_mounts_resumed_total"), 1.0);
    wait_for("the right bytes again", log, || {
        right_or_eio(&target.join(BIG), &want_big) & right_or_eio(&target.join(SMALL), &want_small)
    });
    let big_now = std::fs::read(&big_copy).unwrap_or_default();
    assert!(
        big_now.is_empty() || big_now == want_big,
        "the damaged copy was dropped or replaced by a good one"
    );
}
