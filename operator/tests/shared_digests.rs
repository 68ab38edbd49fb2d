//! Issue 42 on the real API server (`hack/cluster.sh`): a digest shared by two namespaces
//! stays live while either references it; one namespace's deletion removes only its own
//! reference. Two operators (one per namespace, as the other operator tests scope theirs)
//! over one local file store, with the inline executor.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use sealed_crds::{
    CONDITION_READY, Retention, SealedVolume, SealedVolumeSpec, SealedVolumeVersion, Source,
};
use sealed_operator::config::OperatorConfig;
use sealed_operator::metrics::Metrics;
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress, StoreOptions};

const TIMEOUT: Duration = Duration::from_secs(90);

/// Starts an operator scoped to `ns` over the store at `url`.
fn start_operator(
    client: &Client,
    store: &ChunkStore,
    url: &str,
    ns: &str,
    upload_poll: Duration,
) -> tokio::task::JoinHandle<()> {
    let mut config = OperatorConfig::inline(url, ns);
    config.upload_poll = upload_poll;
    let (client, store) = (client.clone(), store.clone());
    let metrics = Arc::new(Metrics::new());
    let ns = ns.to_owned();
    tokio::spawn(async move {
        if let Err(e) = sealed_operator::controller::run(client, config, store, metrics).await {
            panic!("operator of {ns} stopped: {e:#}");
        }
    })
}

/// Polls `check` until it returns Some, or panics after [`TIMEOUT`] saying what it waited for.
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

fn write_tree(dir: &Path) {
    std::fs::create_dir_all(dir.join("weights")).expect("mkdir");
    std::fs::write(dir.join("config.json"), b"{\"layers\": 2}").expect("write");
    std::fs::write(
        dir.join("weights/model.bin"),
        support::pseudo_random(3 << 20, 42),
    )
    .expect("write");
}

fn upload_volume(retention: &str) -> SealedVolume {
    SealedVolume::new(
        "model",
        SealedVolumeSpec {
            source: Source::upload(),
            tags: Default::default(),
            retention: Retention {
                deleted_versions: retention.into(),
            },
            shared: false,
            warm: None,
            verify: None,
        },
    )
}

async fn version_of(
    versions: &Api<SealedVolumeVersion>,
    digest: &Digest,
) -> Option<SealedVolumeVersion> {
    versions
        .list(&ListParams::default())
        .await
        .ok()?
        .items
        .into_iter()
        .find(|v| v.spec.digest == digest.to_string())
}

fn ready(v: &SealedVolumeVersion) -> bool {
    v.status.as_ref().is_some_and(|s| {
        s.attestation.is_some()
            && s.condition(CONDITION_READY)
                .is_some_and(|c| c.status == "True")
    })
}

async fn events_with_reason(client: &Client, ns: &str, reason: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    events
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

/// Namespace A deletes its version of a digest while namespace B's version of the same
/// content is still on its way: B pushed, and its operator imports the record only at its
/// next poll, 15 s later, so B has no SealedVolumeVersion yet (the window a sync finishing,
/// or a version not yet attested, leaves). A's deletion removes only A's reference: B's
/// version ends Ready, attested and pullable, and a collection with no grace keeps every chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_in_one_namespace_keeps_another_namespaces_version() {
    let test = "a_deletion_in_one_namespace_keeps_another_namespaces_version";
    let Some(cluster) = sealed_e2e::cluster(test).await else {
        return;
    };
    let client = cluster.client.clone();
    sealed_e2e::install_crds(&client, "sealed-operator-test")
        .await
        .expect("install CRDs");
    let ns_a = cluster
        .temp_namespace("svol-ref-a")
        .await
        .expect("namespace");
    let ns_b = cluster
        .temp_namespace("svol-ref-b")
        .await
        .expect("namespace");
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
    let operator_a = start_operator(&client, &store, &url, &ns_a, Duration::from_secs(1));
    let operator_b = start_operator(&client, &store, &url, &ns_b, Duration::from_secs(15));
    let (volumes_a, versions_a): (Api<SealedVolume>, Api<SealedVolumeVersion>) = (
        Api::namespaced(client.clone(), &ns_a),
        Api::namespaced(client.clone(), &ns_a),
    );
    let (volumes_b, versions_b): (Api<SealedVolume>, Api<SealedVolumeVersion>) = (
        Api::namespaced(client.clone(), &ns_b),
        Api::namespaced(client.clone(), &ns_b),
    );
    // A keeps nothing once deleted (retention 0), B the default.
    volumes_a
        .create(&PostParams::default(), &upload_volume("0s"))
        .await
        .expect("volume A");
    volumes_b
        .create(&PostParams::default(), &upload_volume("168h"))
        .await
        .expect("volume B");

    let work = tempfile::tempdir().expect("tempdir");
    let dir = work.path().join("model");
    write_tree(&dir);
    let push_to = |ns: &str| PushOptions {
        volume: Some(format!("{ns}/model")),
        ..Default::default()
    };
    let digest = push(&store, &dir, &push_to(&ns_a), Arc::new(NoProgress))
        .await
        .expect("push A")
        .digest;
    let version_a = wait_for("A's version Ready", || async {
        version_of(&versions_a, &digest).await.filter(ready)
    })
    .await;
    let chunks: Vec<Digest> = store
        .get_manifest(&digest)
        .await
        .expect("manifest")
        .unique_chunks()
        .into_iter()
        .map(|c| c.digest)
        .collect();

    // B pushes the same tree: same digest, B's record in the store, no version of B's yet.
    let pushed = push(&store, &dir, &push_to(&ns_b), Arc::new(NoProgress))
        .await
        .expect("push B")
        .digest;
    assert_eq!(pushed, digest);
    assert!(
        version_of(&versions_b, &digest).await.is_none(),
        "B's version exists already: the window this test needs is closed"
    );

    // A deletes its version while B's is still on its way.
    versions_a
        .delete(&version_a.name_any(), &DeleteParams::default())
        .await
        .expect("delete A's version");
    wait_for("A's version gone", || async {
        version_of(&versions_a, &digest)
            .await
            .is_none()
            .then_some(())
    })
    .await;
    let kept = events_with_reason(&client, &ns_a, "KeptInStore").await;
    assert!(
        kept.iter().any(|e| e.contains(&digest.to_string())),
        "A's deletion did not keep the shared version: {kept:?}"
    );
    assert!(
        store.has_manifest(&digest).await.expect("head"),
        "A's deletion trashed a manifest B references"
    );
    assert!(
        version_of(&versions_b, &digest).await.is_none(),
        "B's version arrived before A's deletion finished: the race was not exercised"
    );

    // B's version arrives, Ready and attested (what the node plugin mounts by).
    let version_b = wait_for("B's version Ready", || async {
        version_of(&versions_b, &digest).await.filter(ready)
    })
    .await;
    assert_eq!(version_b.spec.volume, "model");

    // A collection with no grace keeps every chunk, and the version pulls (mountable).
    let gc = sealed_store::gc::collect(
        &store,
        &sealed_store::gc::GcOptions {
            grace: Duration::ZERO,
            writer_wait: Duration::from_secs(5),
            ..Default::default()
        },
    )
    .await
    .expect("gc");
    assert_eq!(gc.chunks_deleted, 0, "{gc:?}");
    for c in &chunks {
        assert!(store.has_chunk(c).await.expect("head"), "chunk {c} lost");
    }
    sealed_store::pull::pull(
        &store,
        &digest,
        &work.path().join("pulled"),
        &Default::default(),
        Arc::new(NoProgress),
    )
    .await
    .expect("B's version pulls");
    // Still Ready after the operator looked again.
    let again = versions_b.get(&version_b.name_any()).await.expect("get");
    assert!(ready(&again), "{:?}", again.status);

    operator_a.abort();
    operator_b.abort();
    let _ = cluster.delete_namespace(&ns_a).await;
    let _ = cluster.delete_namespace(&ns_b).await;
}
