//! The same behaviour on every backend: memory, a local directory, a real S3-compatible
//! server (moto) and Azure Blob (Azurite). Digests must not depend on the backend.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use object_store::PutPayload;
use sealed_store::pull::{PullOptions, pull};
use sealed_store::verify::{ProblemKind, verify};
use sealed_store::{ChunkStore, Digest, EntryKind, Error, NoProgress};
use support::*;

/// Push, re-push, pull, corrupt, verify: the whole contract against one store.
async fn exercise(store: &ChunkStore) -> Digest {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    rich_tree(&src);

    let first = push_dir(store, &src).await;
    assert!(first.chunks_uploaded > 0);
    assert_eq!(first.bytes_uploaded + first.bytes_reused, first.bytes);

    // Same tree again: nothing to upload, same digest.
    let second = push_dir(store, &src).await;
    assert_eq!(second.digest, first.digest);
    assert_eq!(second.chunks_uploaded, 0, "re-push uploaded chunks");
    assert_eq!(second.bytes_uploaded, 0);

    let out = work.path().join("out");
    pull(
        store,
        &first.digest,
        &out,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert_same_tree(&src, &out);

    // Flip a byte of one chunk of a known file: verify and pull name that file.
    let manifest = store.get_manifest(&first.digest).await.unwrap();
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
    let key = ChunkStore::chunk_key(&victim.digest);
    let mut data = store
        .object_store()
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let mid = data.len() / 2;
    data[mid] ^= 0x01;
    store
        .object_store()
        .put(&key, PutPayload::from(Bytes::from(data)))
        .await
        .unwrap();

    let report = verify(store, &first.digest, 8, Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(report.problems.len(), 1, "{report:?}");
    assert_eq!(report.problems[0].problem, ProblemKind::Corrupt);
    assert_eq!(report.problems[0].files, vec![victim_path.clone()]);

    let bad_out = work.path().join("bad-out");
    let err = pull(
        store,
        &first.digest,
        &bad_out,
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&victim_path) && msg.contains("corrupt"),
        "{msg}"
    );
    assert!(
        !bad_out.exists(),
        "a failed pull left its destination behind"
    );

    // The next push repairs nothing silently: the chunk exists (corrupt), so it is reused,
    // and verify keeps reporting it. Delete it and push again: the push restores it.
    store.object_store().delete(&key).await.unwrap();
    let report = verify(store, &first.digest, 8, Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(report.problems[0].problem, ProblemKind::Missing);
    let repaired = push_dir(store, &src).await;
    assert_eq!(repaired.chunks_uploaded, 1);
    assert!(
        verify(store, &first.digest, 8, Arc::new(NoProgress))
            .await
            .unwrap()
            .ok()
    );

    // Unknown digests are a clear error.
    let unknown = Digest::of(b"no such version");
    match store.get_manifest(&unknown).await {
        Err(Error::UnknownVersion { .. }) => {}
        other => panic!("expected UnknownVersion, got {other:?}"),
    }
    first.digest
}

async fn reference_digest() -> Digest {
    let work = tempfile::tempdir().unwrap();
    rich_tree(work.path());
    push_dir(&ChunkStore::memory(), work.path()).await.digest
}

#[tokio::test]
async fn memory_store() {
    assert_eq!(
        exercise(&ChunkStore::memory()).await,
        reference_digest().await
    );
}

#[tokio::test]
async fn local_directory_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    assert_eq!(exercise(&store).await, reference_digest().await);
    // The layout is as documented.
    assert!(dir.path().join("manifests").is_dir());
    assert!(dir.path().join("chunks").is_dir());
}

#[tokio::test]
async fn s3_compatible_server() {
    let Some(server) = start_moto("models", false) else {
        return;
    };
    let store = moto_store(&server, "models", "team/prefix").await;
    assert_eq!(exercise(&store).await, reference_digest().await);
}

#[tokio::test]
async fn azure_blob_on_azurite() {
    let Some(server) = start_azurite("models") else {
        return;
    };
    let store = ChunkStore::open("az://models/some/prefix", &azurite_options(&server))
        .await
        .unwrap();
    assert_eq!(exercise(&store).await, reference_digest().await);
}

#[tokio::test]
async fn azure_wrong_credentials_are_a_clear_error() {
    let Some(server) = start_azurite("models") else {
        return;
    };
    let mut opts = azurite_options(&server);
    opts.retries = 0;
    // A valid base64 key that is not Azurite's.
    let wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ==";
    let store = object_store::azure::MicrosoftAzureBuilder::new()
        .with_account(AZURITE_ACCOUNT)
        .with_access_key(wrong)
        .with_container_name("models")
        .with_endpoint(opts.endpoint.clone().unwrap())
        .with_allow_http(true)
        .build()
        .unwrap();
    let store = ChunkStore::from_object_store(Arc::new(store), "az://models");
    let err = store.list_versions().await.unwrap_err().to_string();
    assert!(err.contains("az://models"), "{err}");
    assert!(
        err.contains("403") || err.to_lowercase().contains("auth"),
        "{err}"
    );
}

#[tokio::test]
async fn s3_missing_bucket_is_a_clear_error() {
    let Some(server) = start_moto("models", false) else {
        return;
    };
    let opts = sealed_store::StoreOptions {
        endpoint: Some(format!("http://127.0.0.1:{}", server.port)),
        region: Some("us-east-1".into()),
        retries: 0,
        ..Default::default()
    };
    let _ = moto_store(&server, "models", "").await; // sets credentials
    let err = ChunkStore::open("s3://no-such-bucket/x", &opts)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("s3://no-such-bucket/x"), "{err}");
    assert!(
        err.contains("NoSuchBucket") || err.contains("404") || err.contains("not found"),
        "{err}"
    );
}

#[tokio::test]
async fn unreachable_store_fails_fast_with_a_message() {
    let opts = sealed_store::StoreOptions {
        endpoint: Some("http://127.0.0.1:1".into()),
        region: Some("us-east-1".into()),
        timeout: std::time::Duration::from_secs(2),
        retries: 1,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let err = ChunkStore::open("s3://bucket/x", &opts)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("s3://bucket/x"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}
