//! The operator against the real API server of the local cluster (`hack/cluster.sh`), with
//! the inline executor and a local file store: versions pushed with `sealed push --volume`
//! become SealedVolumeVersions, tags resolve (and a tag naming no version turns Ready
//! False), a deleted version goes to the store's trash and comes back after a restore, and
//! deleting a volume trashes its versions. Each test runs its own operator scoped to its
//! own namespace.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Event;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use sealed_crds::{
    CONDITION_READY, CONDITION_SYNCED, HuggingFaceSource, Retention, SealedVolume,
    SealedVolumeSpec, SealedVolumeVersion, SecretKeyRef, Source,
};
use sealed_operator::config::OperatorConfig;
use sealed_operator::metrics::Metrics;
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress, StoreOptions};

const TIMEOUT: Duration = Duration::from_secs(60);

struct Fixture {
    client: Client,
    ns: String,
    store: ChunkStore,
    _store_dir: tempfile::TempDir,
    operator: tokio::task::JoinHandle<()>,
    metrics: Arc<Metrics>,
    cluster: sealed_e2e::Cluster,
}

impl Fixture {
    async fn start(test: &str) -> Option<Fixture> {
        let cluster = sealed_e2e::cluster(test).await?;
        let client = cluster.client.clone();
        sealed_e2e::install_crds(&client, "sealed-operator-test")
            .await
            .expect("install CRDs");
        let ns = cluster.temp_namespace("svol-op").await.expect("namespace");
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
        // The Hub stand-in speaks plain http on loopback.
        config.source_policy.allow_http = true;
        config.source_policy.egress = sealed_sources::Egress::allowing(&["127.0.0.0/8"]).unwrap();
        let metrics = Arc::new(Metrics::new());
        let operator = {
            let (client, store, metrics) = (client.clone(), store.clone(), metrics.clone());
            tokio::spawn(async move {
                if let Err(e) =
                    sealed_operator::controller::run(client, config, store, metrics).await
                {
                    panic!("operator stopped: {e:#}");
                }
            })
        };
        Some(Fixture {
            client,
            ns,
            store,
            _store_dir: store_dir,
            operator,
            metrics,
            cluster,
        })
    }

    fn volumes(&self) -> Api<SealedVolume> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn versions(&self) -> Api<SealedVolumeVersion> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn push(&self, dir: &Path, volume: &str) -> Digest {
        let opts = PushOptions {
            volume: Some(format!("{}/{volume}", self.ns)),
            ..Default::default()
        };
        push(&self.store, dir, &opts, Arc::new(NoProgress))
            .await
            .expect("push")
            .digest
    }

    async fn stop(self) {
        self.operator.abort();
        let _ = self.cluster.delete_namespace(&self.ns).await;
    }
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

fn write_tree(dir: &Path, seed: u8, weights: usize) {
    std::fs::create_dir_all(dir.join("weights")).expect("mkdir");
    std::fs::write(dir.join("config.json"), format!("{{\"seed\": {seed}}}")).expect("write");
    let data: Vec<u8> = (0..weights)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    std::fs::write(dir.join("weights/model.bin"), data).expect("write");
}

fn upload_volume(name: &str, tags: &[(&str, &str)]) -> SealedVolume {
    SealedVolume::new(
        name,
        SealedVolumeSpec {
            source: Source::upload(),
            tags: tags
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: None,
        },
    )
}

fn condition(volume: &SealedVolume, type_: &str) -> Option<(String, String, String)> {
    let c = volume.status.as_ref()?.condition(type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_tags_trash_restore_and_volume_deletion() {
    let Some(fx) = Fixture::start("uploads_tags_trash_restore_and_volume_deletion").await else {
        return;
    };
    let work = tempfile::tempdir().expect("tempdir");
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    write_tree(&a_dir, 1, 3 << 20);
    write_tree(&b_dir, 2, 3 << 20);
    let a = fx.push(&a_dir, "llama").await;
    let b = fx.push(&b_dir, "llama").await;

    fx.volumes()
        .create(
            &PostParams::default(),
            &upload_volume("llama", &[("prod", &a.to_string())]),
        )
        .await
        .expect("create volume");

    // Both pushed versions appear, described from their manifests, and the tag resolves.
    let versions = fx.versions();
    for d in [&a, &b] {
        let v = wait_for(&format!("a Ready version for {d}"), || async {
            version_of(&versions, d).await.filter(|v| {
                v.status
                    .as_ref()
                    .and_then(|s| s.condition(CONDITION_READY))
                    .is_some_and(|c| c.status == "True")
            })
        })
        .await;
        let status = v.status.clone().expect("status");
        assert_eq!(status.files, Some(2), "{d}");
        assert_eq!(status.size_bytes, Some((3 << 20) + 11), "{d}");
        assert!(status.chunks.unwrap_or(0) >= 1);
        assert_eq!(
            v.labels()
                .get(sealed_crds::VOLUME_LABEL)
                .map(String::as_str),
            Some("llama")
        );
        assert!(
            v.owner_references().iter().any(|o| o.name == "llama"),
            "owned by its volume"
        );
    }
    let volume = wait_for("the volume Ready with prod resolved", || async {
        let v = fx.volumes().get("llama").await.ok()?;
        let ready = condition(&v, CONDITION_READY)?;
        let tag = v.status.as_ref()?.tags.get("prod")?.version.clone()?;
        (ready.0 == "True").then_some((v, tag))
    })
    .await;
    let a_version = version_of(&versions, &a)
        .await
        .expect("version a")
        .name_any();
    assert_eq!(volume.1, a_version);
    assert_eq!(
        condition(&volume.0, CONDITION_SYNCED).map(|c| c.1),
        Some("Upload".to_string())
    );
    assert!(
        volume
            .0
            .status
            .as_ref()
            .and_then(|s| s.latest_digest.clone())
            .is_some()
    );

    // Moving the tag changes what it resolves to; a tag naming no version of this volume
    // turns Ready False with a reason that names it.
    let unknown = Digest::of(b"never pushed").to_string();
    let patch = serde_json::json!({"spec": {"tags": {"prod": b.to_string(), "canary": unknown}}});
    fx.volumes()
        .patch("llama", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch tags");
    let b_version = version_of(&versions, &b)
        .await
        .expect("version b")
        .name_any();
    let (reason, message) = wait_for("Ready False for the unresolved tag", || async {
        let v = fx.volumes().get("llama").await.ok()?;
        let (status, reason, message) = condition(&v, CONDITION_READY)?;
        let prod = v.status.as_ref()?.tags.get("prod")?.version.clone();
        (status == "False" && prod.as_deref() == Some(b_version.as_str()))
            .then_some((reason, message))
    })
    .await;
    assert_eq!(reason, "TagUnresolved");
    assert!(
        message.contains("canary") && message.contains(&unknown),
        "{message}"
    );

    // Deleting version a moves its manifest to the trash, and it is not imported again.
    versions
        .delete(&a_version, &DeleteParams::default())
        .await
        .expect("delete version a");
    wait_for("version a gone", || async {
        versions
            .get_opt(&a_version)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    assert!(
        !fx.store.has_manifest(&a).await.expect("head"),
        "manifest a still live"
    );
    let trashed = sealed_store::trash::read_record(&fx.store, &a)
        .await
        .expect("trash record")
        .expect("a is in the trash");
    let left = trashed.restorable_until - trashed.deleted_at;
    assert_eq!(left.num_hours(), 168, "the default retention is 7 days");
    let notes = wait_for("a Trashed event", || async {
        let e = events_with_reason(&fx.client, &fx.ns, "Trashed").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    assert!(notes[0].contains("sealed restore"), "{notes:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        version_of(&versions, &a).await.is_none(),
        "a deleted version came back by itself"
    );

    // Restoring it in the store brings the version back.
    sealed_store::trash::restore_version(&fx.store, &a)
        .await
        .expect("restore");
    wait_for("version a imported again after the restore", || async {
        version_of(&versions, &a).await
    })
    .await;

    // Deleting the volume deletes its versions (owner references) and trashes both.
    fx.volumes()
        .delete("llama", &DeleteParams::background())
        .await
        .expect("delete volume");
    wait_for("every version gone with its volume", || async {
        let left = versions.list(&ListParams::default()).await.ok()?.items;
        left.is_empty().then_some(())
    })
    .await;
    for d in [&a, &b] {
        assert!(
            !fx.store.has_manifest(d).await.expect("head"),
            "{d} still live"
        );
        assert!(
            sealed_store::trash::read_record(&fx.store, d)
                .await
                .expect("read")
                .is_some(),
            "{d} not in the trash"
        );
    }
    assert!(fx.metrics.versions_trashed.get() >= 3);
    fx.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_secret_is_a_condition_without_a_hot_loop() {
    let Some(fx) = Fixture::start("missing_secret_is_a_condition_without_a_hot_loop").await else {
        return;
    };
    let volume = SealedVolume::new(
        "gated",
        SealedVolumeSpec {
            source: Source::hugging_face(HuggingFaceSource {
                repo: "org/gated-model".into(),
                revision: "main".into(),
                repo_type: Default::default(),
                include: vec![],
                exclude: vec![],
                token_secret_ref: Some(SecretKeyRef {
                    name: "hf-token".into(),
                    key: "token".into(),
                }),
                endpoint: None,
            }),
            tags: BTreeMap::new(),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: None,
        },
    );
    fx.volumes()
        .create(&PostParams::default(), &volume)
        .await
        .expect("create");
    let (reason, message) = wait_for("Synced False naming the Secret", || async {
        let v = fx.volumes().get("gated").await.ok()?;
        let (status, reason, message) = condition(&v, CONDITION_SYNCED)?;
        (status == "False").then_some((reason, message))
    })
    .await;
    assert_eq!(reason, "SecretNotFound");
    assert!(
        message.contains(&format!("{}/hf-token", fx.ns)),
        "{message}"
    );
    // Retried on a slow clock, not in a hot loop.
    let reconciles = || {
        fx.metrics
            .reconciles
            .with_label_values(&["SealedVolume", "ok"])
            .get()
    };
    let before = reconciles();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = reconciles() - before;
    assert!(during <= 6, "{during} reconciles in 5 s: a hot loop");
    fx.stop().await;
}

/// Sources the policy refuses (a local path, the store itself, no credentials) and Secrets
/// that did not opt in are Synced=False conditions with their reason at once; no sync starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_sources_are_conditions_and_start_no_sync() {
    let Some(fx) = Fixture::start("refused_sources_are_conditions_and_start_no_sync").await else {
        return;
    };
    let object_store = |url: &str, secret: Option<&str>| {
        Source::object_store(sealed_crds::ObjectStoreSource {
            url: url.into(),
            endpoint: None,
            region: None,
            credentials_secret_ref: secret.map(|name| sealed_crds::SecretRef { name: name.into() }),
        })
    };
    // A Secret with credentials, but without the opt-in label.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(fx.client.clone(), &fx.ns);
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "registry-password"},
        "stringData": {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "not-for-sources"},
    }))
    .expect("secret");
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret");
    let store_url = format!("file://{}", fx._store_dir.path().display());
    let cases = [
        (
            "local-path",
            object_store("file:///etc", None),
            "SourceRefused",
            "--allow-file-sources",
        ),
        (
            "the-store",
            object_store(&store_url, None),
            "SourceRefused",
            "--allow-file-sources",
        ),
        (
            "no-secret",
            object_store("s3://models/llm", None),
            "CredentialsRequired",
            "credentialsSecretRef",
        ),
        (
            "not-opted-in",
            object_store("s3://models/llm", Some("registry-password")),
            "SecretNotOptedIn",
            "kubectl label secret",
        ),
    ];
    for (name, source, _, _) in &cases {
        let volume = SealedVolume::new(
            name,
            SealedVolumeSpec {
                source: source.clone(),
                tags: BTreeMap::new(),
                retention: Retention::default(),
                shared: false,
                warm: None,
                verify: None,
            },
        );
        fx.volumes()
            .create(&PostParams::default(), &volume)
            .await
            .expect("create");
    }
    for (name, _, reason, hint) in &cases {
        let (got, message) = wait_for(&format!("{name}: Synced False"), || async {
            let v = fx.volumes().get(name).await.ok()?;
            let (status, reason, message) = condition(&v, CONDITION_SYNCED)?;
            (status == "False").then_some((reason, message))
        })
        .await;
        assert_eq!(&got, reason, "{name}: {message}");
        assert!(message.contains(hint), "{name}: {message}");
        assert!(!message.contains("not-for-sources"), "{name}: {message}");
        let v = fx.volumes().get(name).await.expect("volume");
        let sync = v.status.and_then(|s| s.sync).expect("sync status");
        assert!(sync.started_at.is_none(), "{name}: a sync started");
    }
    assert_eq!(
        fx.metrics.syncs_started.get(),
        0,
        "a refused source started a sync"
    );
    // The tenant hears of it as an Event too.
    let events = events_with_reason(&fx.client, &fx.ns, "SecretNotOptedIn").await;
    assert!(
        events.iter().any(|e| e.contains("registry-password")),
        "{events:?}"
    );
    fx.stop().await;
}

/// A Hugging Face repo on the local Hub stand-in, synced by the operator and by `sealed
/// sync`: the version's digest is what `sealed push` of the same files gives, a new
/// revision reuses the unchanged chunks, and a missing repo is a False condition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hugging_face_sync_seals_what_push_seals() {
    let Some(fx) = Fixture::start("hugging_face_sync_seals_what_push_seals").await else {
        return;
    };
    let hub_root = tempfile::tempdir().expect("tempdir");
    let repo = hub_root.path().join("acme/tiny-llm");
    std::fs::create_dir_all(repo.join("weights")).expect("mkdir");
    std::fs::write(repo.join("config.json"), b"{\"layers\": 2}").expect("write");
    std::fs::write(
        repo.join("weights/model.safetensors"),
        support::pseudo_random(6 << 20, 7),
    )
    .expect("write");
    let Some(hub) = support::start_hub(hub_root.path(), 50) else {
        fx.stop().await;
        return;
    };

    // The same files pushed from disk give the digest the sync must reproduce.
    let expected = push(
        &fx.store,
        &repo,
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .expect("push")
    .digest;

    // `sealed sync` creates the volume and prints the digest once the operator sealed it.
    let cli = sealed_sync(&fx, &hub.url, "hf://acme/tiny-llm", "llm").await;
    let stdout = String::from_utf8_lossy(&cli.stdout);
    assert!(
        cli.status.success(),
        "sealed sync failed: {}",
        String::from_utf8_lossy(&cli.stderr)
    );
    assert_eq!(
        stdout.trim(),
        expected.to_string(),
        "sealed sync printed another digest"
    );
    let v1 = wait_for("version 1 Ready", || async {
        version_of(&fx.versions(), &expected).await.filter(|v| {
            v.status
                .as_ref()
                .and_then(|s| s.condition(CONDITION_READY))
                .is_some_and(|c| c.status == "True")
        })
    })
    .await;
    let status = v1.status.expect("status");
    assert_eq!(
        status.source_revision.as_deref().map(str::len),
        Some(40),
        "a Hub commit"
    );
    assert!(
        status.bytes_new.unwrap_or(0) == 0,
        "every chunk was pushed before the sync"
    );

    // A new revision (one file changed): a second version; the big file's chunks are reused.
    std::fs::write(repo.join("config.json"), b"{\"layers\": 3}").expect("write");
    let patch =
        serde_json::json!({"metadata": {"annotations": {sealed_crds::RESYNC_ANNOTATION: "2"}}});
    fx.volumes()
        .patch("llm", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("annotate");
    let (digest2, reused) = wait_for("the second sync", || async {
        let v = fx.volumes().get("llm").await.ok()?;
        let sync = v.status.as_ref()?.sync.clone()?;
        let digest = sync.digest.clone().filter(|d| *d != expected.to_string())?;
        let version = fx
            .versions()
            .get(&sealed_crds::SealedVolumeVersionSpec::object_name(
                "llm", &digest,
            ))
            .await
            .ok()?;
        Some((digest, version.status?.bytes_reused?))
    })
    .await;
    assert!(
        reused >= 6 << 20,
        "only {reused} bytes reused for {digest2}"
    );
    let events = events_with_reason(&fx.client, &fx.ns, "SyncSucceeded").await;
    // The recorder folds repeats of one reason into a series; the first sync's note is there.
    assert!(
        events.iter().any(|e| e.contains(&expected.to_string())),
        "{events:?}"
    );

    // Moving a tag is not a source change: it resolves, and no sync starts.
    let started = fx.metrics.syncs_started.get();
    let trigger_before = fx
        .volumes()
        .get("llm")
        .await
        .expect("volume")
        .status
        .and_then(|s| s.sync)
        .and_then(|s| s.trigger);
    let patch = serde_json::json!({"spec": {"tags": {"prod": digest2.clone()}}});
    fx.volumes()
        .patch("llm", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("tag");
    wait_for("prod resolved", || async {
        let v = fx.volumes().get("llm").await.ok()?;
        v.status.as_ref()?.tags.get("prod")?.version.clone()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let v = fx.volumes().get("llm").await.expect("volume");
    assert_eq!(
        v.status.and_then(|s| s.sync).and_then(|s| s.trigger),
        trigger_before,
        "a tag move started a sync"
    );
    assert_eq!(
        fx.metrics.syncs_started.get(),
        started,
        "a tag move started a sync"
    );

    // A repo that does not exist: Synced False with the reason, and `sealed sync` says so.
    let missing = sealed_sync(&fx, &hub.url, "hf://acme/nope", "nope").await;
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert!(stderr.contains("RepoNotFound"), "{stderr}");
    fx.stop().await;
}

/// Runs the `sealed` CLI's `sync SOURCE --volume NS/VOLUME` against the test cluster.
async fn sealed_sync(fx: &Fixture, hub: &str, source: &str, volume: &str) -> std::process::Output {
    let sealed = env!("CARGO_BIN_EXE_sealed-operator").replace("sealed-operator", "sealed");
    assert!(Path::new(&sealed).exists(), "build the CLI first: {sealed}");
    let kubeconfig = fx.cluster.kubeconfig.clone();
    let args: Vec<String> = [
        "sync",
        source,
        "--volume",
        &format!("{}/{volume}", fx.ns),
        "--source-endpoint",
        hub,
        "--no-progress",
        "--wait-timeout",
        "120",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    tokio::task::spawn_blocking(move || {
        Command::new(&sealed)
            .args(&args)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .expect("run sealed sync")
    })
    .await
    .expect("join")
}
