//! Trash, restore and garbage collection against real stores, and the invariant that matters:
//! no live or restorable version ever loses a chunk, however pushes, deletes and collections
//! interleave.

mod support;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chrono::Utc;
use object_store::PutPayload;
use sealed_store::gc::{GcOptions, collect};
use sealed_store::gc_marker::read_gc_marker;
use sealed_store::layout;
use sealed_store::prefetch_profile::ProfileScope;
use sealed_store::push::{PushOptions, push};
use sealed_store::trash::{list_trash, restore_version, trash_version};
use sealed_store::writer_lease::{LeaseOptions, list_leases};
use sealed_store::{ChunkStore, Digest, Error, NoProgress, Profile, WriterLease};
use support::*;

const HOUR: Duration = Duration::from_secs(3600);

fn gc_now(grace: Duration) -> GcOptions {
    GcOptions {
        grace,
        writer_wait: Duration::from_millis(200),
        ..Default::default()
    }
}

/// Writes `files` (name, seed, len) under `dir`.
fn write_tree(dir: &Path, files: &[(&str, u64, usize)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, seed, len) in files {
        std::fs::write(dir.join(name), pseudo_random(*len, *seed)).unwrap();
    }
}

async fn chunks_of(store: &ChunkStore, digest: &Digest) -> Vec<Digest> {
    store
        .get_manifest(digest)
        .await
        .unwrap()
        .unique_chunks()
        .into_iter()
        .map(|c| c.digest)
        .collect()
}

async fn present(store: &ChunkStore, chunks: &[Digest]) -> usize {
    let mut n = 0;
    for c in chunks {
        if store.has_chunk(c).await.unwrap() {
            n += 1;
        }
    }
    n
}

/// Every live manifest and every manifest in the trash has all its chunks.
async fn assert_nothing_lost(store: &ChunkStore, context: &str) -> (usize, usize) {
    let mut live = 0;
    for v in store.list_versions().await.unwrap() {
        let manifest = match store.get_manifest(&v.digest).await {
            Ok(m) => m,
            Err(Error::UnknownVersion { .. }) => continue, // trashed since the listing
            Err(e) => panic!("{context}: {e}"),
        };
        for c in manifest.unique_chunks() {
            assert!(
                store.has_chunk(&c.digest).await.unwrap(),
                "{context}: live version {} lost chunk {}",
                v.digest,
                c.digest
            );
        }
        live += 1;
    }
    let mut trashed = 0;
    for r in list_trash(store).await.unwrap() {
        let key = layout::trash_manifest_key(&r.digest);
        let bytes = match store.object_store().get(&key).await {
            Ok(g) => g.bytes().await.unwrap(),
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => panic!("{context}: {e}"),
        };
        let manifest = sealed_store::Manifest::parse(&bytes).unwrap();
        for c in manifest.unique_chunks() {
            assert!(
                store.has_chunk(&c.digest).await.unwrap(),
                "{context}: trashed version {} lost chunk {}",
                r.digest,
                c.digest
            );
        }
        trashed += 1;
    }
    (live, trashed)
}

async fn trash_restore_round_trip_on(store: &ChunkStore) {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    write_tree(&src, &[("a.bin", 1, 100_000), ("b.bin", 2, 50_000)]);
    let digest = push_dir(store, &src).await.digest;

    let record = trash_version(store, &digest, HOUR).await.unwrap();
    assert_eq!(record.digest, digest);
    assert!(record.restorable_until > Utc::now() + chrono::Duration::minutes(59));
    assert!(!store.has_manifest(&digest).await.unwrap());
    assert!(store.list_versions().await.unwrap().is_empty());
    let trash = list_trash(store).await.unwrap();
    assert_eq!(trash, vec![record.clone()]);

    // Deleting again is idempotent: the same record.
    assert_eq!(trash_version(store, &digest, HOUR).await.unwrap(), record);

    // A collection keeps a restorable version's chunks, whatever their age.
    let chunks = chunks_of_trashed(store, &digest).await;
    let report = collect(store, &gc_now(Duration::ZERO)).await.unwrap();
    assert_eq!(report.chunks_deleted, 0, "{report:?}");
    assert_eq!(present(store, &chunks).await, chunks.len());

    let restored = restore_version(store, &digest).await.unwrap();
    assert!(restored.restored);
    assert_eq!(restored.deleted_at, Some(record.deleted_at));
    assert!(store.has_manifest(&digest).await.unwrap());
    assert!(list_trash(store).await.unwrap().is_empty());
    let out = work.path().join("out");
    sealed_store::pull::pull(
        store,
        &digest,
        &out,
        &Default::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_same_tree(&src, &out);

    // Restoring a live version changes nothing.
    assert!(!restore_version(store, &digest).await.unwrap().restored);

    // Unknown digests: a clear error each way.
    let unknown = Digest::of(b"never pushed");
    match trash_version(store, &unknown, HOUR).await {
        Err(Error::UnknownVersion { .. }) => {}
        other => panic!("expected UnknownVersion, got {other:?}"),
    }
    let err = restore_version(store, &unknown).await.unwrap_err();
    assert!(matches!(err, Error::VersionReclaimed { .. }), "{err:?}");
    assert!(err.to_string().contains("reclaimed"), "{err}");
    // No lease left behind by any of this.
    assert!(list_leases(store).await.unwrap().is_empty());

    // Collections exclude each other on this backend too (conditional create), and an
    // expired marker is taken over (conditional update where the backend has one).
    put_marker(store, chrono::Duration::minutes(5)).await;
    let err = collect(store, &gc_now(HOUR)).await.unwrap_err();
    assert!(matches!(err, Error::GcBusy { .. }), "{err:?}");
    put_marker(store, chrono::Duration::minutes(-1)).await;
    let report = collect(store, &gc_now(HOUR)).await.unwrap();
    assert!(report.skipped.is_none(), "{report:?}");
    assert!(read_gc_marker(store).await.unwrap().is_none());
}

async fn chunks_of_trashed(store: &ChunkStore, digest: &Digest) -> Vec<Digest> {
    let key = layout::trash_manifest_key(digest);
    let bytes = store
        .object_store()
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    sealed_store::Manifest::parse(&bytes)
        .unwrap()
        .unique_chunks()
        .into_iter()
        .map(|c| c.digest)
        .collect()
}

#[tokio::test]
async fn trash_restore_round_trip_local() {
    let dir = tempfile::tempdir().unwrap();
    trash_restore_round_trip_on(&file_store(dir.path()).await).await;
}

#[tokio::test]
async fn trash_restore_round_trip_moto() {
    let Some(server) = start_moto("gc-round-trip", false) else {
        return;
    };
    trash_restore_round_trip_on(&moto_store(&server, "gc-round-trip", "p").await).await;
}

#[tokio::test]
async fn trash_restore_round_trip_azurite() {
    let Some(server) = start_azurite("gc-round-trip") else {
        return;
    };
    let store = ChunkStore::open("az://gc-round-trip/p", &azurite_options(&server))
        .await
        .unwrap();
    trash_restore_round_trip_on(&store).await;
}

async fn expired_trash_reclaimed_on(store: &ChunkStore) {
    let work = tempfile::tempdir().unwrap();
    let (a, b) = (work.path().join("a"), work.path().join("b"));
    write_tree(
        &a,
        &[("shared.bin", 10, 80_000), ("only-a.bin", 11, 60_000)],
    );
    write_tree(
        &b,
        &[("shared.bin", 10, 80_000), ("only-b.bin", 12, 70_000)],
    );
    let da = push_dir(store, &a).await.digest;
    let db = push_dir(store, &b).await.digest;
    let ca = chunks_of(store, &da).await;
    let cb = chunks_of(store, &db).await;
    let shared: HashSet<Digest> = ca.iter().filter(|c| cb.contains(c)).copied().collect();
    let only_a: Vec<Digest> = ca.iter().filter(|c| !shared.contains(c)).copied().collect();
    assert_eq!(shared.len(), 1);
    assert_eq!(only_a.len(), 1);
    // Both versions were mounted in two scopes: each has a learned profile per scope, and A
    // an unscoped one an earlier release wrote.
    let scopes = [
        ProfileScope::new("team-a/model").unwrap(),
        ProfileScope::new("team-b/model").unwrap(),
    ];
    for (digest, chunks) in [(da, &ca), (db, &cb)] {
        let profile = Profile {
            manifest: digest,
            chunks: chunks.clone(),
        };
        for scope in &scopes {
            assert!(store.put_profile(&profile, scope).await.unwrap());
        }
    }
    let unscoped = object_store::path::Path::from(format!("profiles/{}", da.hex()));
    store
        .object_store()
        .put(&unscoped, PutPayload::from_static(b"an old profile"))
        .await
        .unwrap();
    let has_profile = |d: Digest| {
        let scopes = scopes.clone();
        async move {
            for scope in &scopes {
                if store.get_profile_bytes(&d, scope).await.unwrap().is_some() {
                    return true;
                }
            }
            false
        }
    };

    trash_version(store, &da, HOUR).await.unwrap();

    // Before expiry nothing goes, even with no grace: the restorable version keeps its
    // profile too.
    let report = collect(store, &gc_now(Duration::ZERO)).await.unwrap();
    assert_eq!((report.trash_expired, report.chunks_deleted), (0, 0));
    assert_eq!(report.manifests_scanned, 1);
    assert_eq!(report.profiles_deleted, 0, "{report:?}");
    assert!(has_profile(da).await);

    // Two hours on: the trash entry expires and A's own chunk goes; the shared one stays.
    let later = GcOptions {
        now: Some(Utc::now() + chrono::Duration::hours(2)),
        ..gc_now(Duration::ZERO)
    };
    let report = collect(store, &later).await.unwrap();
    assert_eq!(report.trash_expired, 1, "{report:?}");
    assert_eq!(report.expired_versions, vec![da]);
    assert_eq!(report.chunks_deleted, 1, "{report:?}");
    assert_eq!(report.bytes_freed, 60_000);
    // The reclaimed version's profiles (every scope's, and the unscoped one) go with it; the
    // live one's stay.
    assert_eq!(report.profiles_deleted, 3, "{report:?}");
    assert!(!has_profile(da).await);
    let old = store.object_store().head(&unscoped).await;
    assert!(old.is_err(), "the unscoped profile is gone");
    assert!(has_profile(db).await);
    assert_eq!(present(store, &only_a).await, 0);
    assert_eq!(present(store, &cb).await, cb.len());
    assert!(list_trash(store).await.unwrap().is_empty());
    assert_nothing_lost(store, "after reclaiming").await;

    let err = restore_version(store, &da).await.unwrap_err();
    assert!(matches!(err, Error::VersionReclaimed { .. }), "{err:?}");
    assert!(read_gc_marker(store).await.unwrap().is_none());

    // A second collection finds nothing more to do.
    let report = collect(store, &later).await.unwrap();
    assert_eq!((report.trash_expired, report.chunks_deleted), (0, 0));
    assert_eq!(report.profiles_deleted, 0);
}

#[tokio::test]
async fn expired_trash_reclaimed_shared_chunks_stay_local() {
    let dir = tempfile::tempdir().unwrap();
    expired_trash_reclaimed_on(&file_store(dir.path()).await).await;
}

#[tokio::test]
async fn expired_trash_reclaimed_shared_chunks_stay_moto() {
    let Some(server) = start_moto("gc-expired", false) else {
        return;
    };
    expired_trash_reclaimed_on(&moto_store(&server, "gc-expired", "p").await).await;
}

#[tokio::test]
async fn grace_keeps_young_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    let orphan = Bytes::from_static(b"an orphan chunk");
    let od = Digest::of(&orphan);
    store.put_chunk(&od, orphan).await.unwrap();
    let report = collect(&store, &gc_now(HOUR)).await.unwrap();
    assert_eq!((report.chunks_in_grace, report.chunks_deleted), (1, 0));
    assert!(store.has_chunk(&od).await.unwrap());
    let report = collect(&store, &gc_now(Duration::ZERO)).await.unwrap();
    assert_eq!(report.chunks_deleted, 1);
    assert!(!store.has_chunk(&od).await.unwrap());
}

#[tokio::test]
async fn dry_run_deletes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    let work = tempfile::tempdir().unwrap();
    write_tree(work.path(), &[("x.bin", 20, 40_000)]);
    let d = push_dir(&store, work.path()).await.digest;
    let chunks = chunks_of(&store, &d).await;
    trash_version(&store, &d, HOUR).await.unwrap();
    let orphan = Bytes::from_static(b"orphan");
    store
        .put_chunk(&Digest::of(&orphan), orphan.clone())
        .await
        .unwrap();

    let opts = GcOptions {
        dry_run: true,
        now: Some(Utc::now() + chrono::Duration::hours(2)),
        ..gc_now(Duration::ZERO)
    };
    let report = collect(&store, &opts).await.unwrap();
    assert!(report.dry_run);
    assert_eq!(report.trash_expired, 1, "{report:?}");
    assert_eq!(report.chunks_deleted, 2, "{report:?}");
    assert_eq!(report.bytes_freed, 40_000 + orphan.len() as u64);
    // … and yet everything is still there, and no marker was left.
    assert_eq!(present(&store, &chunks).await, 1);
    assert!(store.has_chunk(&Digest::of(&orphan)).await.unwrap());
    assert_eq!(list_trash(&store).await.unwrap().len(), 1);
    assert!(read_gc_marker(&store).await.unwrap().is_none());
    assert!(restore_version(&store, &d).await.unwrap().restored);
}

#[tokio::test]
async fn gc_skips_while_a_lease_is_live() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    let orphan = Bytes::from_static(b"orphan chunk");
    let od = Digest::of(&orphan);
    store.put_chunk(&od, orphan).await.unwrap();

    let lease = WriterLease::acquire(&store, "test writer").await.unwrap();
    let report = collect(&store, &gc_now(Duration::ZERO)).await.unwrap();
    let skipped = report
        .skipped
        .clone()
        .expect("collection ran under a live lease");
    assert!(skipped.contains("1 writer active"), "{skipped}");
    assert!(skipped.contains("test writer"), "{skipped}");
    assert_eq!(report.active_writers.len(), 1);
    assert_eq!(report.chunks_deleted, 0);
    assert!(store.has_chunk(&od).await.unwrap());
    assert!(read_gc_marker(&store).await.unwrap().is_none());
    lease.ensure_live().unwrap();

    // A lease released while the collection waits lets it run.
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        lease.release().await.unwrap();
    });
    let opts = GcOptions {
        writer_wait: Duration::from_secs(10),
        ..gc_now(Duration::ZERO)
    };
    let report = collect(&store, &opts).await.unwrap();
    releaser.await.unwrap();
    assert!(report.skipped.is_none(), "{report:?}");
    assert_eq!(report.chunks_deleted, 1);
    assert!(list_leases(&store).await.unwrap().is_empty());
}

#[tokio::test]
async fn crashed_writer_lease_expires() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    // A lease object whose writer died: expired, so it neither blocks nor survives a run.
    let dead = serde_json::json!({
        "id": "00000000000000000000000000000000", "purpose": "push (crashed)",
        "host": "gone", "pid": 1,
        "acquired_at": Utc::now() - chrono::Duration::hours(1),
        "expires_at": Utc::now() - chrono::Duration::minutes(50),
    });
    store
        .object_store()
        .put(
            &layout::lease_key("00000000000000000000000000000000"),
            PutPayload::from(serde_json::to_vec(&dead).unwrap()),
        )
        .await
        .unwrap();
    let report = collect(&store, &gc_now(Duration::ZERO)).await.unwrap();
    assert!(report.skipped.is_none(), "{report:?}");
    assert_eq!(report.stale_leases_removed, 1);
    assert!(list_leases(&store).await.unwrap().is_empty());
}

async fn put_marker(store: &ChunkStore, expires_in: chrono::Duration) {
    let marker = serde_json::json!({
        "id": "ffffffffffffffffffffffffffffffff", "host": "other-host", "pid": 42,
        "started_at": Utc::now(), "expires_at": Utc::now() + expires_in,
    });
    store
        .object_store()
        .put(
            &layout::gc_marker_key(),
            PutPayload::from(serde_json::to_vec(&marker).unwrap()),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn writers_wait_for_a_running_gc_and_collections_exclude_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;

    // A live marker: a second collection is refused, a writer waits, then gives up clearly.
    put_marker(&store, chrono::Duration::minutes(5)).await;
    let err = collect(&store, &gc_now(Duration::ZERO)).await.unwrap_err();
    assert!(matches!(err, Error::GcBusy { .. }), "{err:?}");
    assert!(err.to_string().contains("other-host"), "{err}");
    let opts = LeaseOptions {
        max_wait: Duration::from_millis(400),
        ..Default::default()
    };
    let err = WriterLease::acquire_with(&store, "push", &opts)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::GcRunning { .. }), "{err:?}");
    assert!(err.to_string().contains("pid 42"), "{err}");
    // The writer withdrew its lease when it gave up.
    assert!(list_leases(&store).await.unwrap().is_empty());
    // While it waits its lease stays (marked waiting), so the next collection defers to it;
    // a wait that is abandoned (Ctrl-C) takes the lease along.
    let waiter = WriterLease::acquire(&store, "impatient push");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiter)
            .await
            .is_err()
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !list_leases(&store).await.unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "an abandoned wait left its lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A marker that ends while the writer waits: the writer proceeds.
    put_marker(&store, chrono::Duration::minutes(5)).await;
    let s2 = store.clone();
    let ender = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        s2.object_store()
            .delete(&layout::gc_marker_key())
            .await
            .unwrap();
    });
    let started = Instant::now();
    let opts = LeaseOptions {
        max_wait: Duration::from_secs(20),
        ..Default::default()
    };
    let lease = WriterLease::acquire_with(&store, "push", &opts)
        .await
        .unwrap();
    ender.await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(600));
    lease.release().await.unwrap();

    // An expired marker (a crashed collection) neither blocks writers nor the next run.
    put_marker(&store, chrono::Duration::minutes(-1)).await;
    let lease = WriterLease::acquire(&store, "push").await.unwrap();
    lease.release().await.unwrap();
    let report = collect(&store, &gc_now(Duration::ZERO)).await.unwrap();
    assert!(report.skipped.is_none());
    assert!(read_gc_marker(&store).await.unwrap().is_none());
}

#[tokio::test]
async fn lease_is_renewed_while_held() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    let opts = LeaseOptions {
        ttl: Duration::from_millis(1200),
        ..Default::default()
    };
    let lease = WriterLease::acquire_with(&store, "long push", &opts)
        .await
        .unwrap();
    let first = list_leases(&store).await.unwrap()[0].expires_at;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    lease.ensure_live().unwrap();
    let leases = list_leases(&store).await.unwrap();
    assert_eq!(leases.len(), 1);
    assert!(leases[0].expires_at > first, "the lease was not renewed");
    assert!(leases[0].expires_at > Utc::now());
    assert_eq!(leases[0].purpose, "long push");
    drop(lease);
    // Dropping deletes it in the background.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !list_leases(&store).await.unwrap().is_empty() {
        assert!(Instant::now() < deadline, "a dropped lease was not deleted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A writer paused past its lease's TTL (here: its single-threaded runtime blocked, so the
/// renewal cannot run) may have been overtaken by a collection: it must not seal anything.
#[tokio::test(flavor = "current_thread")]
async fn a_lapsed_lease_refuses_to_seal() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    let opts = LeaseOptions {
        ttl: Duration::from_millis(600),
        ..Default::default()
    };
    let lease = WriterLease::acquire_with(&store, "slow push", &opts)
        .await
        .unwrap();
    lease.ensure_live().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let err = lease.ensure_live().unwrap_err();
    assert!(matches!(err, Error::LeaseLapsed { .. }), "{err:?}");
    assert!(err.to_string().contains("slow push"), "{err}");
    // Once lapsed, always lapsed, even after the renewal task runs again.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(lease.ensure_live().is_err());
    lease.release().await.unwrap();
    assert!(list_leases(&store).await.unwrap().is_empty());
}

// ---------------------------------------------------------------------------------------
// Stress: pushes, deletes, restores and collections at once.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A small random tree drawn from a pool of 12 blobs, so trees share many chunks and chunks
/// orphaned by a reclaimed version are soon wanted again (the classic GC/push race).
fn random_tree(dir: &Path, rng: &mut Rng) {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let files = 1 + rng.below(3);
    for i in 0..files {
        let seed = 1000 + rng.below(12);
        let len = 1_000 + (seed as usize % 5) * 7_000;
        let name = if i % 2 == 0 {
            format!("f{i}.bin")
        } else {
            format!("sub/f{i}.bin")
        };
        std::fs::write(dir.join(name), pseudo_random(len, seed)).unwrap();
    }
}

/// Rounds of: `pushes` concurrent pushes, deletes of all but two live versions (most with no
/// retention, so the next collection reclaims them and orphans their chunks while new pushes
/// want them; some restorable, some restored), and collections with no grace running back
/// to back until the round's writers are done. After each round every live and trashed
/// manifest must have all its chunks.
async fn stress(store: ChunkStore, rounds: usize, pushes: usize) {
    let work = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x5EA1_ED00_u64 | 1);
    let mut live: Vec<Digest> = Vec::new();
    let (mut runs, mut swept_runs, mut chunks_deleted, mut trash_expired) = (0, 0, 0, 0);
    let started = Instant::now();
    for round in 0..rounds {
        let mut writers = tokio::task::JoinSet::new();
        for p in 0..pushes {
            let dir = work.path().join(format!("r{round}-p{p}"));
            random_tree(&dir, &mut rng);
            let store = store.clone();
            writers.spawn(async move {
                let opts = PushOptions {
                    concurrency: 4,
                    threads: Some(1),
                    ..Default::default()
                };
                let r = push(&store, &dir, &opts, Arc::new(NoProgress)).await;
                let _ = std::fs::remove_dir_all(&dir);
                r.map(|r| r.digest).unwrap();
            });
        }
        while live.len() > 2 {
            let d = live.swap_remove(rng.below(live.len() as u64) as usize);
            let keep = rng.below(4) == 0;
            let restore = keep && rng.below(2) == 0;
            let store = store.clone();
            writers.spawn(async move {
                let retention = if keep { HOUR } else { Duration::ZERO };
                // A twin push may have re-created it and another delete removed it again.
                match trash_version(&store, &d, retention).await {
                    Ok(_) | Err(Error::UnknownVersion { .. }) => {}
                    Err(e) => panic!("delete {d}: {e}"),
                }
                if restore {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    restore_version(&store, &d).await.unwrap();
                }
            });
        }
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut collectors = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let (store, done) = (store.clone(), done.clone());
            collectors.spawn(async move {
                let mut reports = Vec::new();
                loop {
                    let last = done.load(std::sync::atomic::Ordering::SeqCst);
                    let opts = GcOptions {
                        writer_wait: Duration::from_millis(20),
                        ..gc_now(Duration::ZERO)
                    };
                    match collect(&store, &opts).await {
                        Ok(r) => reports.push(r),
                        Err(Error::GcBusy { .. }) => {
                            tokio::time::sleep(Duration::from_millis(5)).await
                        }
                        Err(e) => panic!("collection failed: {e}"),
                    }
                    if last {
                        return reports;
                    }
                }
            });
        }
        while let Some(w) = writers.join_next().await {
            w.unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        while let Some(c) = collectors.join_next().await {
            for r in c.unwrap() {
                runs += 1;
                if r.skipped.is_none() {
                    swept_runs += 1;
                    chunks_deleted += r.chunks_deleted;
                    trash_expired += r.trash_expired;
                }
            }
        }
        assert_nothing_lost(&store, &format!("round {round}")).await;
        live = store
            .list_versions()
            .await
            .unwrap()
            .into_iter()
            .map(|v| v.digest)
            .collect();
    }
    assert!(list_leases(&store).await.unwrap().is_empty());
    assert!(read_gc_marker(&store).await.unwrap().is_none());
    let (n_live, n_trash) = assert_nothing_lost(&store, "the end").await;
    eprintln!(
        "stress on {}: {rounds} rounds in {:?}, {runs} collections ({swept_runs} not skipped), \
         {chunks_deleted} chunks and {trash_expired} trash entries reclaimed, {n_live} live and \
         {n_trash} trashed versions intact",
        store.name(),
        started.elapsed(),
    );
    assert!(
        chunks_deleted > 0,
        "the stress test never collected a chunk"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_concurrent_push_delete_gc_local() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    stress(store, 40, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_concurrent_push_delete_gc_moto() {
    let Some(server) = start_moto("gc-stress", false) else {
        return;
    };
    let store = moto_store(&server, "gc-stress", "p").await;
    stress(store, 10, 6).await;
}
