//! Learned prefetch on real FUSE mounts: a first mount records the order its readers asked
//! for chunks and stores the profile at unmount; a mount on another node (another disk
//! cache) fetches exactly those chunks before anything is read; opting out records nothing;
//! foreign, stale, corrupt and oversized profiles are ignored, counted by reason, fetch
//! nothing and change no byte read.

mod common;

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use object_store::PutPayload;
use sealed_mount::metrics::PROFILE_IGNORE_REASONS;
use sealed_mount::{
    MountHandle, MountOptions, NodeCache, NodeCacheOptions, REPLAY_READ_MULTIPLE, ReadaheadPolicy,
};
use sealed_store::prefetch_profile::{MAX_PROFILE_BYTES, ProfileScope};
use sealed_store::{ChunkStore, Digest, EntryKind, Manifest, Profile, layout};

/// A node: its own disk cache.
fn node_cache(dir: &Path) -> NodeCache {
    NodeCache::new(&NodeCacheOptions {
        disk_dir: Some(dir.to_path_buf()),
        disk_bytes: 1 << 30,
        ..Default::default()
    })
    .unwrap()
}

/// Daemon readahead off, so that what arrives ahead of a reader is the learned prefetch's.
fn options(learned: bool) -> MountOptions {
    MountOptions {
        readahead: ReadaheadPolicy { initial: 0, max: 0 },
        kernel_readahead_kb: None,
        learned_prefetch: learned,
        ..MountOptions::default()
    }
}

fn mount(
    rt: &tokio::runtime::Runtime,
    store: &ChunkStore,
    digest: Digest,
    dir: &Path,
    cache: NodeCache,
    learned: bool,
) -> MountHandle {
    rt.block_on(MountHandle::spawn(
        store.clone(),
        digest,
        dir,
        cache,
        options(learned),
    ))
    .unwrap()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn file_of<'a>(manifest: &'a Manifest, rel: &str) -> &'a sealed_store::FileEntry {
    manifest
        .files()
        .find(|(p, _)| *p == rel)
        .map(|(_, f)| f)
        .unwrap_or_else(|| panic!("{rel} is in the version"))
}

/// The bytes of `rel`'s chunks (what reading it all fetches).
fn bytes_of(manifest: &Manifest, rel: &str) -> u64 {
    file_of(manifest, rel)
        .chunks
        .iter()
        .map(|c| u64::from(c.len))
        .sum()
}

fn manifest_chunk_len(manifest: &Manifest, rel: &str, index: usize) -> u64 {
    u64::from(file_of(manifest, rel).chunks[index].len)
}

fn chunks_of(manifest: &Manifest, rel: &str) -> Vec<Digest> {
    manifest
        .entries
        .iter()
        .find_map(|e| match &e.kind {
            EntryKind::File(f) if e.path == rel => {
                Some(f.chunks.iter().map(|c| c.digest).collect())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("{rel} is in the version"))
}

/// What the workload reads: all of small.bin, then the first MiB of model-00001.bin.
fn workload(dir: &Path, src: &Path) {
    let small = std::fs::read(dir.join("weights/small.bin")).unwrap();
    assert_eq!(small, std::fs::read(src.join("weights/small.bin")).unwrap());
    let mut head = vec![0u8; 1 << 20];
    std::fs::File::open(dir.join("weights/model-00001.bin"))
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    let want = std::fs::read(src.join("weights/model-00001.bin")).unwrap();
    assert_eq!(head, want[..1 << 20]);
}

/// The profile stored for `digest` in the default scope (`sealed mount`'s).
fn stored_profile(
    rt: &tokio::runtime::Runtime,
    store: &ChunkStore,
    digest: &Digest,
) -> Option<Profile> {
    stored_profile_in(rt, store, digest, &ProfileScope::default())
}

fn stored_profile_in(
    rt: &tokio::runtime::Runtime,
    store: &ChunkStore,
    digest: &Digest,
    scope: &ProfileScope,
) -> Option<Profile> {
    rt.block_on(store.get_profile_bytes(digest, scope))
        .unwrap()
        .map(|b| Profile::decode(&b, digest).expect("a well-formed profile"))
}

#[test]
fn a_first_mount_records_and_another_node_replays_ahead_of_its_reader() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let small = chunks_of(&manifest, "weights/small.bin");
    let model = chunks_of(&manifest, "weights/model-00001.bin");
    let work = tempfile::tempdir().unwrap();
    let (mnt_a, mnt_b) = (work.path().join("a"), work.path().join("b"));
    std::fs::create_dir_all(&mnt_a).unwrap();
    std::fs::create_dir_all(&mnt_b).unwrap();

    // Node A: the first mount of the version records what its reader asks for.
    let cache_a = node_cache(&work.path().join("cache-a"));
    let a = mount(&rt, &fx.store, fx.digest, &mnt_a, cache_a.clone(), true);
    workload(&mnt_a, &fx.src);
    rt.block_on(a.unmount()).unwrap();
    assert_eq!(cache_a.metrics().snapshot().learned_profiles_written, 1);
    let profile = stored_profile(&rt, &fx.store, &fx.digest).expect("stored at unmount");
    // small.bin's chunks first, in file order, then model-00001.bin's first chunk; nothing
    // of files that were never read.
    assert_eq!(profile.chunks[..small.len()], small[..], "{profile:?}");
    assert_eq!(profile.chunks.get(small.len()), model.first());
    let read: HashSet<Digest> = small.iter().chain(&model).copied().collect();
    assert!(
        profile.chunks.iter().all(|c| read.contains(c)),
        "{profile:?}"
    );
    assert!(
        profile.chunks.len() < small.len() + model.len(),
        "only the first MiB of the model was read: {} entries",
        profile.chunks.len()
    );

    // Node B: its own cache. Nothing is fetched before the first read; reading small.bin
    // lets the replay fetch the rest of the profile (the model's first chunk) ahead of the
    // reader, within REPLAY_READ_MULTIPLE times what was read. Every chunk is fetched once.
    let (faulty_b, store_b) = faulty(&fx.store);
    let cache_b = node_cache(&work.path().join("cache-b"));
    let b = mount(&rt, &store_b, fx.digest, &mnt_b, cache_b.clone(), true);
    let m = cache_b.metrics();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(faulty_b.gets(), 0, "the replay waits for a reader");
    let small_read = bytes_of(&manifest, "weights/small.bin");
    let model_first = manifest_chunk_len(&manifest, "weights/model-00001.bin", 0);
    assert!(
        model_first <= REPLAY_READ_MULTIPLE * small_read,
        "fixture: the model's first chunk fits the bound small.bin makes"
    );
    assert_eq!(
        std::fs::read(mnt_b.join("weights/small.bin")).unwrap(),
        std::fs::read(fx.src.join("weights/small.bin")).unwrap()
    );
    // The model's first chunk is fetched by the replay, before its reader asks.
    wait_for("the replay", || {
        faulty_b.gets() > small.len() as u64 && m.snapshot().learned_prefetch_chunks >= 1
    });
    assert_eq!(m.snapshot().learned_profiles_replayed, 1);
    // The same workload now reads only local chunks: not one more GET.
    workload(&mnt_b, &fx.src);
    assert_eq!(
        faulty_b.gets(),
        profile.chunks.len() as u64,
        "each profile chunk fetched once, nothing else"
    );
    rt.block_on(b.unmount()).unwrap();
    assert_eq!(
        m.snapshot().learned_profiles_written,
        0,
        "a replaying mount records nothing"
    );
    assert_eq!(
        stored_profile(&rt, &fx.store, &fx.digest),
        Some(profile),
        "first writer wins"
    );
}

/// `mount` in `scope`, learned prefetch on.
fn mount_in(
    rt: &tokio::runtime::Runtime,
    store: &ChunkStore,
    digest: Digest,
    dir: &Path,
    cache: NodeCache,
    scope: &ProfileScope,
) -> MountHandle {
    let options = MountOptions {
        profile_scope: scope.clone(),
        ..options(true)
    };
    rt.block_on(MountHandle::spawn(
        store.clone(),
        digest,
        dir,
        cache,
        options,
    ))
    .unwrap()
}

const EVERY_FILE: [&str; 5] = [
    "weights/small.bin",
    "weights/model-00001.bin",
    "weights/model-copy.bin",
    "config.json",
    "tiny.txt",
];

/// A first reader that touches everything.
fn read_all(dir: &Path, src: &Path, files: &[&str]) {
    for rel in files {
        assert!(
            std::fs::read(dir.join(rel)).unwrap() == std::fs::read(src.join(rel)).unwrap(),
            "{rel}"
        );
    }
}

/// A first mount in `scope` (its own cache) whose reader reads `files`; its profile stored.
fn learn(
    rt: &tokio::runtime::Runtime,
    fx: &Fixture,
    work: &Path,
    scope: &ProfileScope,
    files: &[&str],
) -> Profile {
    let name = scope.id().hex();
    let (mnt, cache) = (
        work.join(&name[..8]),
        work.join(format!("cache-{}", &name[..8])),
    );
    std::fs::create_dir_all(&mnt).unwrap();
    let handle = mount_in(rt, &fx.store, fx.digest, &mnt, node_cache(&cache), scope);
    read_all(&mnt, &fx.src, files);
    rt.block_on(handle.unmount()).unwrap();
    stored_profile_in(rt, &fx.store, &fx.digest, scope).expect("stored at unmount")
}

#[test]
fn a_profile_learned_in_one_namespace_steers_no_mount_in_another() {
    if !fuse_available() {
        return;
    }
    // Issue 34: a first reader in namespace A touched everything; a fresh node's mount of
    // the same digest for namespace B reads one small file. It fetches that file's chunks
    // and nothing of A's profile.
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let work = tempfile::tempdir().unwrap();
    let (a, b) = (
        ProfileScope::new("team-a/model").unwrap(),
        ProfileScope::new("team-b/model").unwrap(),
    );
    let profile = learn(&rt, &fx, work.path(), &a, &EVERY_FILE);
    let small = chunks_of(&manifest, "weights/small.bin");
    assert!(profile.chunks.len() > 3 * small.len(), "{profile:?}");
    assert_eq!(stored_profile_in(&rt, &fx.store, &fx.digest, &b), None);

    let (counted, store) = faulty(&fx.store);
    let cache = node_cache(&work.path().join("cache-b"));
    let mnt = work.path().join("b");
    std::fs::create_dir_all(&mnt).unwrap();
    let handle = mount_in(&rt, &store, fx.digest, &mnt, cache.clone(), &b);
    read_all(&mnt, &fx.src, &["weights/small.bin"]);
    // Time for a replay to show, if there were one.
    std::thread::sleep(Duration::from_millis(1500));
    let s = cache.metrics().snapshot();
    assert_eq!(
        counted.gets(),
        small.len() as u64,
        "only small.bin's chunks"
    );
    assert_eq!(
        s.store_bytes_fetched,
        bytes_of(&manifest, "weights/small.bin")
    );
    assert_eq!(s.learned_profiles_replayed, 0);
    rt.block_on(handle.unmount()).unwrap();
    // B learned its own; A's is unchanged.
    let own = stored_profile_in(&rt, &fx.store, &fx.digest, &b).expect("B's own profile");
    assert_eq!(own.chunks, small);
    assert_eq!(
        stored_profile_in(&rt, &fx.store, &fx.digest, &a),
        Some(profile)
    );
}

#[test]
fn a_replay_stays_within_a_multiple_of_what_was_read_and_stops_when_readers_diverge() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let work = tempfile::tempdir().unwrap();
    let small_bytes = bytes_of(&manifest, "weights/small.bin");

    // 1. A profile of everything; a later mount of the same scope reads one small file (all
    // of it in the profile): the replay fetches at most REPLAY_READ_MULTIPLE times that,
    // and stops when the reader goes quiet.
    let scope = ProfileScope::new("team-a/model").unwrap();
    learn(&rt, &fx, work.path(), &scope, &EVERY_FILE);
    let cache = node_cache(&work.path().join("cache-small"));
    let mnt = work.path().join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let handle = mount_in(&rt, &fx.store, fx.digest, &mnt, cache.clone(), &scope);
    read_all(&mnt, &fx.src, &["weights/small.bin"]);
    let m = cache.metrics();
    wait_for("the replay to stop", || {
        m.snapshot().learned_replays_stopped == 1
    });
    let s = m.snapshot();
    assert_eq!(s.learned_profiles_replayed, 1);
    let version: u64 = EVERY_FILE.iter().map(|f| bytes_of(&manifest, f)).sum();
    assert!(
        s.store_bytes_fetched <= (1 + REPLAY_READ_MULTIPLE) * small_bytes,
        "read {small_bytes} bytes, fetched {} of {version}",
        s.store_bytes_fetched
    );
    rt.block_on(handle.unmount()).unwrap();

    // 2. A profile of model-00001.bin; a reader of the same scope reads small.bin, which
    // the profile does not name: the replay stops at once, nothing but small.bin fetched.
    let scope = ProfileScope::new("team-a/model-only").unwrap();
    learn(&rt, &fx, work.path(), &scope, &["weights/model-00001.bin"]);
    let (counted, store) = faulty(&fx.store);
    let cache = node_cache(&work.path().join("cache-diverge"));
    let mnt = work.path().join("diverge");
    std::fs::create_dir_all(&mnt).unwrap();
    let handle = mount_in(&rt, &store, fx.digest, &mnt, cache.clone(), &scope);
    read_all(&mnt, &fx.src, &["weights/small.bin"]);
    let m = cache.metrics();
    wait_for("the replay to stop", || {
        m.snapshot().learned_replays_stopped == 1
    });
    // Before the cold start is over: the divergence stopped it, not the quiet.
    assert!(!handle.cold_start().snapshot().is_over());
    let s = m.snapshot();
    assert_eq!(s.learned_prefetch_chunks, 0);
    assert_eq!(s.store_bytes_fetched, small_bytes);
    assert_eq!(
        counted.gets(),
        chunks_of(&manifest, "weights/small.bin").len() as u64
    );
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn reads_made_while_the_profile_is_looked_up_are_recorded() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let small = chunks_of(&manifest, "weights/small.bin");
    let work = tempfile::tempdir().unwrap();
    let mnt = work.path().join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    // The lookup of a stored profile is slow: the whole workload runs before it answers.
    let (faulty, store) = faulty(&fx.store);
    faulty.hold_profile_gets(true);
    let cache = node_cache(&work.path().join("cache"));
    let handle = mount(&rt, &store, fx.digest, &mnt, cache.clone(), true);
    workload(&mnt, &fx.src);
    faulty.hold_profile_gets(false);
    rt.block_on(handle.unmount()).unwrap();
    assert_eq!(cache.metrics().snapshot().learned_profiles_written, 1);
    let profile = stored_profile(&rt, &fx.store, &fx.digest).expect("stored at unmount");
    assert_eq!(profile.chunks[..small.len()], small[..], "{profile:?}");
}

#[test]
fn a_mount_that_opts_out_records_nothing() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let work = tempfile::tempdir().unwrap();
    let mnt = work.path().join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    let cache = node_cache(&work.path().join("cache"));
    let handle = mount(&rt, &fx.store, fx.digest, &mnt, cache.clone(), false);
    workload(&mnt, &fx.src);
    rt.block_on(handle.unmount()).unwrap();
    assert_eq!(stored_profile(&rt, &fx.store, &fx.digest), None);
    assert_eq!(cache.metrics().snapshot().learned_profiles_written, 0);
}

#[test]
fn foreign_stale_corrupt_and_oversized_profiles_are_ignored() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let fx = rt.block_on(fixture());
    let manifest = rt.block_on(fx.store.get_manifest(&fx.digest)).unwrap();
    let real = chunks_of(&manifest, "weights/model-00001.bin");
    let foreign = Profile {
        manifest: Digest::of(b"another version"),
        chunks: real.clone(),
    };
    let mut stale_chunks = real.clone();
    stale_chunks.insert(1, Digest::of(b"a chunk of another version"));
    let stale = Profile {
        manifest: fx.digest,
        chunks: stale_chunks,
    };
    let mut corrupt = Profile {
        manifest: fx.digest,
        chunks: real,
    }
    .encode();
    let last = corrupt.len() - 40;
    corrupt[last] ^= 1;
    let oversized = vec![0u8; usize::try_from(MAX_PROFILE_BYTES).unwrap() + 1];
    let work = tempfile::tempdir().unwrap();
    for (reason, bytes) in [
        ("foreign", foreign.encode()),
        ("stale", stale.encode()),
        ("corrupt", corrupt),
        ("oversized", oversized),
    ] {
        let key = layout::profile_key(&fx.digest, &ProfileScope::default().id());
        rt.block_on(
            fx.store
                .object_store()
                .put(&key, PutPayload::from(bytes.clone())),
        )
        .unwrap();
        let (faulty_store, store) = faulty(&fx.store);
        let mnt = work.path().join(reason);
        std::fs::create_dir_all(&mnt).unwrap();
        let cache = node_cache(&work.path().join(format!("cache-{reason}")));
        let handle = mount(&rt, &store, fx.digest, &mnt, cache.clone(), true);
        let slot = PROFILE_IGNORE_REASONS
            .iter()
            .position(|r| *r == reason)
            .unwrap();
        wait_for(reason, || {
            cache.metrics().snapshot().learned_profiles_ignored[slot] == 1
        });
        assert_eq!(
            faulty_store.gets(),
            0,
            "{reason}: the profile fetched nothing"
        );
        let s = cache.metrics().snapshot();
        assert_eq!(
            (s.learned_profiles_replayed, s.learned_prefetch_chunks),
            (0, 0),
            "{reason}"
        );
        // Reads are the version's bytes, whatever the profile said.
        for rel in ["weights/model-00001.bin", "tiny.txt"] {
            assert_eq!(
                std::fs::read(mnt.join(rel)).unwrap(),
                std::fs::read(fx.src.join(rel)).unwrap(),
                "{reason}: {rel}"
            );
        }
        rt.block_on(handle.unmount()).unwrap();
        // Nothing recorded over it, nothing else counted.
        let stored = rt.block_on(fx.store.object_store().get(&key)).unwrap();
        assert_eq!(rt.block_on(stored.bytes()).unwrap(), bytes, "{reason}");
        let ignored: u64 = cache
            .metrics()
            .snapshot()
            .learned_profiles_ignored
            .iter()
            .sum();
        assert_eq!(ignored, 1, "{reason}");
    }
}
