//! GCS (`gs://`, object_store's GCS client through `cloud::gcs_builder`) against a real
//! fake-gcs-server on loopback, as backends.rs runs S3 on moto and Azure on Azurite.
//!
//! fake-gcs-server v1.56.1 serves the XML API's reads, which is what pull, verify, listing
//! and the first probe use, but none of its writes: object_store's `PUT /{bucket}/{object}`
//! (and `x-goog-if-generation-match: 0`, the conditional create of manifests) reaches its JSON
//! `insertObject`, which answers `400 invalid uploadType` (see
//! `sealed_test_support::servers::start_fake_gcs`). So the store here is filled through the
//! JSON API with the bytes a push wrote to a local store, and read back through `gs://`; the
//! write path waits, `#[ignore]`d below, for an emulator that takes XML-API PUTs.

mod support;

use std::sync::Arc;
use std::time::Duration;

use sealed_store::pull::{PullOptions, pull};
use sealed_store::verify::{ProblemKind, verify};
use sealed_store::{ChunkStore, Digest, EntryKind, Error, NoProgress, StoreOptions};
use support::*;

const BUCKET: &str = "models";
const PREFIX: &str = "team/prefix";

fn gcs_options(server: &Server) -> StoreOptions {
    StoreOptions {
        endpoint: Some(server.url.clone()),
        timeout: Duration::from_secs(10),
        retries: 1,
        ..Default::default()
    }
}

#[tokio::test]
async fn gcs_store_pull_verify_and_list_on_fake_gcs_server() {
    let Some(server) = start_fake_gcs(BUCKET) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    rich_tree(&src);
    // A push into a local store; its objects, as they are, into the bucket under the prefix.
    let local = work.path().join("local");
    let pushed = push_dir(&file_store(&local).await, &src).await;
    gcs_put_dir(&server, BUCKET, PREFIX, &local);

    let store = ChunkStore::open(&format!("gs://{BUCKET}/{PREFIX}"), &gcs_options(&server))
        .await
        .unwrap();
    let versions = store.list_versions().await.unwrap();
    assert_eq!(
        versions.iter().map(|v| v.digest).collect::<Vec<_>>(),
        vec![pushed.digest],
        "the listing under the prefix"
    );
    assert!(store.has_manifest(&pushed.digest).await.unwrap());

    let out = work.path().join("out");
    pull(
        &store,
        &pushed.digest,
        &out,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_same_tree(&src, &out);
    let report = verify(&store, &pushed.digest, 8, Arc::new(NoProgress))
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");

    // Flip a byte of one chunk of a known file in the bucket: verify and pull name the file.
    let manifest = store.get_manifest(&pushed.digest).await.unwrap();
    let (victim_path, victim) = manifest
        .entries
        .iter()
        .find_map(|e| match &e.kind {
            EntryKind::File(f) if e.path.ends_with("model-00002.safetensors") => {
                Some((e.path.clone(), f.chunks[0]))
            }
            _ => None,
        })
        .unwrap();
    let key = ChunkStore::chunk_key(&victim.digest).to_string();
    let mut data = std::fs::read(local.join(&key)).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x01;
    gcs_put_object(&server, BUCKET, &format!("{PREFIX}/{key}"), &data);

    let report = verify(&store, &pushed.digest, 8, Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(report.problems.len(), 1, "{report:?}");
    assert_eq!(report.problems[0].problem, ProblemKind::Corrupt);
    assert_eq!(report.problems[0].files, vec![victim_path.clone()]);
    let bad_out = work.path().join("bad-out");
    let msg = pull(
        &store,
        &pushed.digest,
        &bad_out,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains(&victim_path) && msg.contains("corrupt"),
        "{msg}"
    );

    let unknown = Digest::of(b"no such version");
    match store.get_manifest(&unknown).await {
        Err(Error::UnknownVersion { .. }) => {}
        other => panic!("expected UnknownVersion, got {other:?}"),
    }
}

#[tokio::test]
async fn gcs_missing_bucket_is_a_clear_error() {
    let Some(server) = start_fake_gcs(BUCKET) else {
        return;
    };
    let mut opts = gcs_options(&server);
    opts.retries = 0;
    let err = ChunkStore::open("gs://no-such-bucket/x", &opts)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("gs://no-such-bucket/x"), "{err}");
    // GCS answers 404 NoSuchBucket, fake-gcs-server 500 (body "no bucket named ..."): the
    // first listing fails, naming the store and the answer, instead of opening an empty store.
    assert!(err.contains("404") || err.contains("500"), "{err}");
}

/// Push, re-push, conditional create of a manifest, pull: the write path. fake-gcs-server
/// v1.56.1 answers object_store's XML-API `PUT /models/team/prefix/chunks/..` with `400
/// invalid uploadType`; run with `--ignored` to see it, and un-ignore for an emulator that
/// takes those PUTs.
#[tokio::test]
#[ignore = "fake-gcs-server v1.56.1 has no XML-API object PUT (400 invalid uploadType)"]
async fn gcs_store_push_round_trip_on_fake_gcs_server() {
    let Some(server) = start_fake_gcs(BUCKET) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    rich_tree(&src);
    let store = ChunkStore::open(&format!("gs://{BUCKET}/{PREFIX}"), &gcs_options(&server))
        .await
        .unwrap();
    let first = push_dir(&store, &src).await;
    assert!(first.chunks_uploaded > 0);
    let second = push_dir(&store, &src).await;
    assert_eq!(second.digest, first.digest);
    assert_eq!(second.chunks_uploaded, 0, "re-push uploaded chunks");
    // The manifest exists: writing it again is a conditional create that finds it.
    let bytes = store.get_manifest_bytes(&first.digest).await.unwrap();
    assert_eq!(
        store.put_manifest(bytes.to_vec()).await.unwrap(),
        first.digest
    );
    let out = work.path().join("out");
    pull(
        &store,
        &first.digest,
        &out,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_same_tree(&src, &out);
}
