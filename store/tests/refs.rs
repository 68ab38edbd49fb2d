//! Shared digests (issue 42): two volumes that push the same tree share one manifest, and a
//! deletion in one removes only that volume's reference. The manifest goes to the trash when
//! the last reference goes, with the longest retention any reference asked for, and a
//! deletion racing a new reference never leaves the referenced manifest in the trash.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sealed_store::gc::{GcOptions, collect};
use sealed_store::push::{PushOptions, push};
use sealed_store::refs::{RemoveReport, remove_reference};
use sealed_store::trash::{list_trash, read_record};
use sealed_store::{ChunkStore, Digest, NoProgress};
use support::*;

const HOUR: Duration = Duration::from_secs(3600);
const A: &str = "team-a/model";
const B: &str = "team-b/model";

/// What the operator does when a version of `volume` is deleted: remove its reference.
async fn remove_ref(
    store: &ChunkStore,
    volume: &str,
    digest: &Digest,
    retention: Duration,
) -> sealed_store::Result<RemoveReport> {
    remove_reference(store, volume, digest, retention).await
}

fn tree(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    // Three chunks' worth: small enough for CI, large enough to have several chunks.
    std::fs::write(dir.join("weights.bin"), pseudo_random(900_000, 42)).unwrap();
    std::fs::write(dir.join("config.json"), b"{\"layers\": 2}").unwrap();
}

async fn push_to(store: &ChunkStore, dir: &Path, volume: &str) -> Digest {
    let opts = PushOptions {
        volume: Some(volume.into()),
        ..Default::default()
    };
    push(store, dir, &opts, Arc::new(NoProgress))
        .await
        .unwrap()
        .digest
}

fn gc_now() -> GcOptions {
    GcOptions {
        grace: Duration::ZERO,
        writer_wait: Duration::from_millis(200),
        ..Default::default()
    }
}

async fn chunks(store: &ChunkStore, digest: &Digest) -> Vec<Digest> {
    store
        .get_manifest(digest)
        .await
        .unwrap()
        .unique_chunks()
        .into_iter()
        .map(|c| c.digest)
        .collect()
}

async fn missing(store: &ChunkStore, chunks: &[Digest]) -> usize {
    let mut n = 0;
    for c in chunks {
        if !store.has_chunk(c).await.unwrap() {
            n += 1;
        }
    }
    n
}

async fn pullable(store: &ChunkStore, digest: &Digest, out: &Path) -> bool {
    let _ = std::fs::remove_dir_all(out);
    sealed_store::pull::pull(
        store,
        digest,
        out,
        &Default::default(),
        Arc::new(NoProgress),
    )
    .await
    .is_ok()
}

#[tokio::test]
async fn one_volumes_deletion_keeps_the_other_volumes_version() {
    let work = tempfile::tempdir().unwrap();
    let store = file_store(&work.path().join("store")).await;
    let src = work.path().join("src");
    tree(&src);
    let digest = push_to(&store, &src, A).await;
    assert_eq!(
        push_to(&store, &src, B).await,
        digest,
        "same tree, same digest"
    );
    let all = chunks(&store, &digest).await;
    assert!(all.len() >= 2, "{} chunks", all.len());

    // A deletes with retention 0, as a namespace whose volume keeps nothing would.
    let report = remove_ref(&store, A, &digest, Duration::ZERO)
        .await
        .unwrap();
    assert!(report.trashed.is_none(), "{report:?}");
    assert_eq!(report.still_referenced_by, vec![B.to_owned()]);
    assert!(store.has_manifest(&digest).await.unwrap());
    assert!(pullable(&store, &digest, &work.path().join("out")).await);
    let gc = collect(&store, &gc_now()).await.unwrap();
    assert_eq!(gc.chunks_deleted, 0, "{gc:?}");
    assert_eq!(missing(&store, &all).await, 0);
    assert!(pullable(&store, &digest, &work.path().join("out")).await);
    // B's record still names it (what the operator imports); A's is gone.
    assert_eq!(store.list_records_of_volume(B).await.unwrap().len(), 1);
    assert!(store.list_records_of_volume(A).await.unwrap().is_empty());
}

#[tokio::test]
async fn the_last_reference_trashes_with_the_longest_retention() {
    let work = tempfile::tempdir().unwrap();
    let store = file_store(&work.path().join("store")).await;
    let src = work.path().join("src");
    tree(&src);
    let digest = push_to(&store, &src, A).await;
    push_to(&store, &src, B).await;
    let all = chunks(&store, &digest).await;

    // A asks for 48h, B (the last) for 1h: the trash keeps it 48h.
    let first = remove_ref(&store, A, &digest, 48 * HOUR).await.unwrap();
    assert!(first.trashed.is_none(), "{first:?}");
    assert!(store.has_manifest(&digest).await.unwrap());
    let last = remove_ref(&store, B, &digest, HOUR).await.unwrap();
    let record = last.trashed.expect("the last reference trashes it");
    assert!(!store.has_manifest(&digest).await.unwrap());
    let floor = Utc::now() + chrono::Duration::hours(47);
    assert!(record.restorable_until > floor, "{record:?}");
    assert_eq!(read_record(&store, &digest).await.unwrap(), Some(record));
    // A third removal (again, with 0) does not shorten it either.
    let again = remove_ref(&store, B, &digest, Duration::ZERO)
        .await
        .unwrap();
    let kept = read_record(&store, &digest).await.unwrap().unwrap();
    assert!(kept.restorable_until > floor, "{again:?} {kept:?}");
    let gc = collect(&store, &gc_now()).await.unwrap();
    assert_eq!(gc.chunks_deleted, 0, "{gc:?}");
    assert_eq!(list_trash(&store).await.unwrap().len(), 1);
    assert_eq!(missing(&store, &all).await, 0);
}

#[tokio::test]
async fn a_deleted_version_stays_deleted_when_another_volume_pushes_it_again() {
    let work = tempfile::tempdir().unwrap();
    let store = file_store(&work.path().join("store")).await;
    let src = work.path().join("src");
    tree(&src);
    let digest = push_to(&store, &src, A).await;
    push_to(&store, &src, B).await;
    remove_ref(&store, B, &digest, HOUR).await.unwrap();
    remove_ref(&store, A, &digest, HOUR).await.unwrap();
    assert!(!store.has_manifest(&digest).await.unwrap());
    // A syncs the same content again: A's version is back, B's stays deleted.
    push_to(&store, &src, A).await;
    assert!(store.has_manifest(&digest).await.unwrap());
    assert_eq!(store.list_records_of_volume(A).await.unwrap().len(), 1);
    let b: Vec<_> = store.list_records_of_volume(B).await.unwrap();
    assert!(b.is_empty(), "B's deleted version came back: {b:?}");
}

/// One round: A holds the only reference; A's deletion and B's push of the same tree race.
/// `delete_first` starts the deletion first and the push a little later, else the reverse.
async fn race_round(round: u32, delete_first: bool) {
    let work = tempfile::tempdir().unwrap();
    let store = file_store(&work.path().join("store")).await;
    let src = work.path().join("src");
    tree(&src);
    let digest = push_to(&store, &src, A).await;
    let all = chunks(&store, &digest).await;
    let delay = Duration::from_micros(u64::from(round % 8) * 700);
    let (s1, s2, dir) = (store.clone(), store.clone(), src.clone());
    let deletion = tokio::spawn(async move {
        if !delete_first {
            tokio::time::sleep(delay).await;
        }
        remove_ref(&s1, A, &digest, Duration::ZERO).await.unwrap()
    });
    let pushing = tokio::spawn(async move {
        if delete_first {
            tokio::time::sleep(delay).await;
        }
        push_to(&s2, &dir, B).await
    });
    let (deleted, pushed) = (deletion.await.unwrap(), pushing.await.unwrap());
    assert_eq!(pushed, digest);
    let context = format!("round {round} (delete first: {delete_first}; {deleted:?})");
    assert!(
        store.has_manifest(&digest).await.unwrap(),
        "{context}: B references a manifest left in the trash"
    );
    let gc = collect(&store, &gc_now()).await.unwrap();
    assert_eq!(missing(&store, &all).await, 0, "{context}: {gc:?}");
    assert!(
        pullable(&store, &digest, &work.path().join("out")).await,
        "{context}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deletion_racing_a_new_reference_never_trashes_it() {
    for round in 0..24 {
        race_round(round, round % 2 == 0).await;
    }
}

/// What a remover that crashed between its delete and its second look leaves when a push
/// raced it: a record naming a trashed manifest. The next collection puts it back.
#[tokio::test]
async fn a_collection_puts_back_a_referenced_version_left_in_the_trash() {
    let work = tempfile::tempdir().unwrap();
    let store = file_store(&work.path().join("store")).await;
    let src = work.path().join("src");
    tree(&src);
    let digest = push_to(&store, &src, A).await;
    let bytes = store.get_manifest_bytes(&digest).await.unwrap();
    let all = chunks(&store, &digest).await;
    let removed = remove_ref(&store, A, &digest, Duration::ZERO)
        .await
        .unwrap();
    assert!(removed.trashed.is_some(), "{removed:?}");
    store.put_volume_record(B, &bytes).await.unwrap();
    assert!(!store.has_manifest(&digest).await.unwrap());

    let gc = collect(&store, &gc_now()).await.unwrap();
    assert_eq!((gc.trash_healed, gc.trash_expired), (1, 0), "{gc:?}");
    assert!(store.has_manifest(&digest).await.unwrap());
    assert!(list_trash(&store).await.unwrap().is_empty());
    assert_eq!(missing(&store, &all).await, 0);
    // A's tombstone asked for no retention: the collection removed it.
    assert_eq!(gc.tombstones_expired, 1, "{gc:?}");
}

/// `sealed restore` undoes the deletions: references removed within their window come back.
#[tokio::test]
async fn a_restore_brings_back_the_removed_references() {
    let work = tempfile::tempdir().unwrap();
    let store = file_store(&work.path().join("store")).await;
    let src = work.path().join("src");
    tree(&src);
    let digest = push_to(&store, &src, A).await;
    push_to(&store, &src, B).await;
    remove_ref(&store, B, &digest, HOUR).await.unwrap();
    assert!(store.list_records_of_volume(B).await.unwrap().is_empty());
    let last = remove_ref(&store, A, &digest, HOUR).await.unwrap();
    assert!(last.trashed.is_some(), "{last:?}");
    let report = sealed_store::trash::restore_version(&store, &digest)
        .await
        .unwrap();
    assert!(report.restored);
    let mut revived = report.references_restored.clone();
    revived.sort();
    assert_eq!(revived, vec![A.to_owned(), B.to_owned()]);
    for volume in [A, B] {
        let records = store.list_records_of_volume(volume).await.unwrap();
        assert_eq!(records.len(), 1, "{volume}");
        assert!(store.verify_volume_record(&records[0]).await.unwrap());
    }
}
