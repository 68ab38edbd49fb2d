//! Against the real API server (`hack/cluster.sh`), with an inline operator and a local file
//! store: only versions the operator made carry a valid attestation; a hand-made version
//! with another volume's digest is `Ready=False/NotAttested`; a store record without the
//! proof that its writer had the manifest imports nothing (`RecordRejected`); deleting a
//! version waits while a node's publication Lease lists its digest.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use object_store::PutPayload;
use sealed_crds::attestation::{AttestationKey, SECRET_KEY};
use sealed_crds::publications::{ANNOTATION, LABEL, NodePublications, Publication};
use sealed_crds::{
    CONDITION_READY, Retention, SealedVolume, SealedVolumeSpec, SealedVolumeVersion,
    SealedVolumeVersionSpec, Source,
};
use sealed_operator::config::{DEFAULT_ATTESTATION_SECRET, OperatorConfig};
use sealed_operator::metrics::Metrics;
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, NoProgress, StoreOptions};

const TIMEOUT: Duration = Duration::from_secs(60);

async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {TIMEOUT:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn upload_volume(name: &str) -> SealedVolume {
    SealedVolume::new(
        name,
        SealedVolumeSpec {
            source: Source::upload(),
            tags: BTreeMap::new(),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: None,
        },
    )
}

fn write_tree(dir: &Path, seed: u8) {
    std::fs::create_dir_all(dir).expect("mkdir");
    let data: Vec<u8> = (0..(2 << 20)).map(|i: usize| (i as u8) ^ seed).collect();
    std::fs::write(dir.join("weights.bin"), data).expect("write");
}

async fn reasons(client: &Client, ns: &str, reason: &str) -> Vec<String> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some(reason))
                .filter_map(|e| e.message)
                .collect()
        })
        .unwrap_or_default()
}

fn ready(v: &SealedVolumeVersion) -> Option<(String, String)> {
    let c = v.status.as_ref()?.condition(CONDITION_READY)?;
    Some((c.status.clone(), c.reason.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_operator_made_versions_are_attested_and_trashing_waits_for_nodes() {
    let Some(cluster) = sealed_e2e::cluster("attestation").await else {
        return;
    };
    let client = cluster.client.clone();
    sealed_e2e::install_crds(&client, "sealed-operator-test")
        .await
        .expect("install CRDs");
    let ns = cluster.temp_namespace("svol-att").await.expect("namespace");
    let store_dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", store_dir.path().display());
    let store = ChunkStore::open(
        &url,
        &StoreOptions {
            create: true,
            ..Default::default()
        },
    )
    .await
    .expect("store");
    let mut config = OperatorConfig::inline(&url, &ns);
    config.upload_poll = Duration::from_secs(1);
    let operator = {
        let (client, store) = (client.clone(), store.clone());
        tokio::spawn(async move {
            if let Err(e) =
                sealed_operator::controller::run(client, config, store, Arc::new(Metrics::new()))
                    .await
            {
                panic!("operator stopped: {e:#}");
            }
        })
    };

    // The operator makes its key on first start.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let secret = wait_for("the attestation Secret", || async {
        secrets
            .get_opt(DEFAULT_ATTESTATION_SECRET)
            .await
            .ok()
            .flatten()
    })
    .await;
    let material = secret
        .data
        .as_ref()
        .and_then(|d| d.get(SECRET_KEY))
        .map(|b: &ByteString| b.0.clone())
        .expect("key in the Secret");
    assert!(material.len() >= 32, "{} key bytes", material.len());
    let key = AttestationKey::from_secret_bytes(&material).expect("key");

    // A pushed version of an upload volume: made by the operator, attested, Ready.
    let work = tempfile::tempdir().expect("tempdir");
    write_tree(&work.path().join("private"), 1);
    let private = push(
        &store,
        &work.path().join("private"),
        &PushOptions {
            volume: Some(format!("{ns}/private")),
            ..Default::default()
        },
        Arc::new(NoProgress),
    )
    .await
    .expect("push")
    .digest;
    let volumes: Api<SealedVolume> = Api::namespaced(client.clone(), &ns);
    let versions: Api<SealedVolumeVersion> = Api::namespaced(client.clone(), &ns);
    for name in ["private", "grab"] {
        volumes
            .create(&PostParams::default(), &upload_volume(name))
            .await
            .expect("create volume");
    }
    let real = SealedVolumeVersionSpec::object_name("private", &private.to_string());
    let made = wait_for("the pushed version Ready", || async {
        versions
            .get_opt(&real)
            .await
            .ok()
            .flatten()
            .filter(|v| ready(v).is_some_and(|(s, _)| s == "True"))
    })
    .await;
    let attestation = made
        .status
        .as_ref()
        .and_then(|s| s.attestation.clone())
        .expect("an attestation");
    assert!(key.verify(&attestation, &ns, "private", &private.to_string()));

    // A version made by hand naming the same digest for another volume, with the real
    // version's attestation copied onto it: not attested, Ready=False/NotAttested.
    let fake_name = "grab-fake";
    let mut fake = SealedVolumeVersion::new(
        fake_name,
        SealedVolumeVersionSpec {
            volume: "grab".into(),
            digest: private.to_string(),
        },
    );
    fake.metadata.namespace = Some(ns.clone());
    versions
        .create(&PostParams::default(), &fake)
        .await
        .expect("create the hand-made version");
    let patch = serde_json::json!({ "status": { "attestation": attestation } });
    versions
        .patch_status(fake_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("forge the status");
    let refused = wait_for("the hand-made version NotAttested", || async {
        versions
            .get_opt(fake_name)
            .await
            .ok()
            .flatten()
            .filter(|v| ready(v).is_some_and(|(_, r)| r == "NotAttested"))
    })
    .await;
    assert_eq!(ready(&refused).map(|r| r.0).as_deref(), Some("False"));
    let copied = refused.status.as_ref().and_then(|s| s.attestation.clone());
    assert!(
        !copied.is_some_and(|a| key.verify(&a, &ns, "grab", &private.to_string())),
        "the operator attested a hand-made version"
    );
    let told = wait_for("a NotAttested event", || async {
        let r = reasons(&client, &ns, "NotAttested").await;
        (!r.is_empty()).then_some(r)
    })
    .await;
    assert!(told[0].contains("authorizes no mount"), "{told:?}");

    // A store record naming the digest for `grab` without the proof: nothing imported.
    let record = serde_json::json!({
        "volume": format!("{ns}/grab"),
        "digest": private,
        "pushed_at": "2026-01-01T00:00:00Z",
        "proof": "00".repeat(32),
    });
    store
        .object_store()
        .put(
            &sealed_store::layout::volume_record_key(&format!("{ns}/grab"), &private),
            PutPayload::from(serde_json::to_vec(&record).expect("json")),
        )
        .await
        .expect("write the forged record");
    let rejected = wait_for("a RecordRejected event", || async {
        let r = reasons(&client, &ns, "RecordRejected").await;
        (!r.is_empty()).then_some(r)
    })
    .await;
    assert!(rejected[0].contains(&private.to_string()), "{rejected:?}");
    let imported = SealedVolumeVersionSpec::object_name("grab", &private.to_string());
    assert!(
        versions.get_opt(&imported).await.expect("get").is_none(),
        "a forged record was imported"
    );

    // Deleting the hand-made version touches nothing in the store.
    versions
        .delete(fake_name, &DeleteParams::default())
        .await
        .expect("delete the fake");
    wait_for("the hand-made version to go", || async {
        versions
            .get_opt(fake_name)
            .await
            .ok()
            .map(|v| v.is_none())
            .filter(|gone| *gone)
    })
    .await;
    assert!(
        store.has_manifest(&private).await.expect("has"),
        "trashed by a fake"
    );

    // A node still publishes the digest: deleting the real version waits for it.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let publications = NodePublications {
        node: "node-a".into(),
        published: vec![Publication {
            namespace: ns.clone(),
            digest: private.to_string(),
        }],
    };
    let lease = Lease {
        metadata: kube::api::ObjectMeta {
            name: Some(NodePublications::lease_name("node-a")),
            labels: Some(BTreeMap::from([(LABEL.to_string(), "node-a".to_string())])),
            annotations: Some(BTreeMap::from([(
                ANNOTATION.to_string(),
                serde_json::to_string(&publications).expect("json"),
            )])),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("node-a".into()),
            lease_duration_seconds: Some(60),
            renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            ..Default::default()
        }),
    };
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create the publications Lease");
    versions
        .delete(&real, &DeleteParams::default())
        .await
        .expect("delete the real version");
    let waiting = wait_for("a WaitingForUnpublish event", || async {
        let r = reasons(&client, &ns, "WaitingForUnpublish").await;
        (!r.is_empty()).then_some(r)
    })
    .await;
    assert!(waiting[0].contains("node-a"), "{waiting:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let still = versions.get_opt(&real).await.expect("get");
    assert!(
        still.is_some_and(|v| v.metadata.deletion_timestamp.is_some()),
        "the version went while a node published it"
    );
    assert!(
        store.has_manifest(&private).await.expect("has"),
        "trashed while mounted"
    );

    // The node lets go: the version goes to the trash (the operator retries every 30 s).
    leases
        .delete(
            &NodePublications::lease_name("node-a"),
            &DeleteParams::default(),
        )
        .await
        .expect("delete the Lease");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while versions.get_opt(&real).await.expect("get").is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the version stayed after the node let go"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        sealed_store::trash::read_record(&store, &private)
            .await
            .expect("trash record")
            .is_some(),
        "not in the trash"
    );
    assert!(!store.has_manifest(&private).await.expect("has"));

    operator.abort();
    let _ = cluster.delete_namespace(&ns).await;
}
