//! Volume records (`volumes/<ns>/<name>/<hex>`) carry a proof that their writer had the
//! manifest's bytes: a record naming someone else's public digest does not verify.

mod support;

use std::sync::Arc;

use object_store::PutPayload;
use sealed_store::layout;
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, NoProgress, VolumeRecord};
use support::{file_store, rich_tree};

#[tokio::test]
async fn a_pushed_record_verifies_and_a_forged_one_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path()).await;
    let tree = tempfile::tempdir().unwrap();
    rich_tree(tree.path());
    let opts = PushOptions {
        volume: Some("team-b/private".into()),
        ..Default::default()
    };
    let report = push(&store, tree.path(), &opts, Arc::new(NoProgress))
        .await
        .unwrap();
    let records = store
        .list_records_of_volume("team-b/private")
        .await
        .unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].digest, report.digest);
    assert!(store.verify_volume_record(&records[0]).await.unwrap());

    // A tenant that may write records under its own prefix, knowing only the digest.
    let forged = |proof: Option<String>| VolumeRecord {
        volume: "team-a/grab".into(),
        digest: report.digest,
        pushed_at: chrono::Utc::now(),
        proof,
        removed: None,
    };
    for record in [
        forged(None),
        forged(Some("00".repeat(32))),
        // The victim's own proof, copied: it covers the victim's volume name, not this one.
        forged(records[0].proof.clone()),
        // A proof "keyed" by the digest, the one thing the tenant has.
        forged(Some(
            blake3::keyed_hash(report.digest.as_bytes(), b"team-a/grab")
                .to_hex()
                .to_string(),
        )),
    ] {
        let key = layout::volume_record_key("team-a/grab", &report.digest);
        let body = serde_json::to_vec(&record).unwrap();
        store
            .object_store()
            .put(&key, PutPayload::from(body))
            .await
            .unwrap();
        let listed = store.list_records_of_volume("team-a/grab").await.unwrap();
        assert_eq!(listed.len(), 1, "the forged record is listed");
        assert!(
            !store.verify_volume_record(&listed[0]).await.unwrap(),
            "a forged record verified: {:?}",
            listed[0].proof
        );
    }

    // A record whose content names another volume than its key is not listed at all.
    let key = layout::volume_record_key("team-a/other", &report.digest);
    store
        .object_store()
        .put(
            &key,
            PutPayload::from(serde_json::to_vec(&records[0]).unwrap()),
        )
        .await
        .unwrap();
    assert!(
        store
            .list_records_of_volume("team-a/other")
            .await
            .unwrap()
            .is_empty()
    );

    // The real writer's proof, recomputed from the manifest: what verify checks.
    let bytes = store.get_manifest_bytes(&report.digest).await.unwrap();
    assert_eq!(
        records[0].proof.as_deref(),
        Some(ChunkStore::record_proof("team-b/private", &bytes).as_str())
    );
    store
        .delete_volume_record("team-b/private", &report.digest)
        .await
        .unwrap();
    assert!(
        store
            .list_records_of_volume("team-b/private")
            .await
            .unwrap()
            .is_empty()
    );
}
