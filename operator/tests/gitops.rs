//! The GitOps rules against the real API server of the local cluster (`hack/cluster.sh`):
//!
//! - a version someone applied (as Argo CD does, server-side apply as `argocd-controller`)
//!   gets no ownerReference, so Argo CD can prune it; the versions the operator makes keep a
//!   controller reference; deleting the volume still deletes and trashes both, for the
//!   volume's own `spec.retention` (not the 168h default);
//! - `sealed sync` does not overwrite a source another field manager owns without `--force`;
//! - `sealed pin` rewrites volume + tag references in manifests (and Helm values) to digests,
//!   `--check` fails while one floats, and a tag that does not resolve changes no file; after
//!   `sealed tag` moved the tag (refused on a tag Git owns without `--force`), `sealed pin`
//!   re-pins from the markers it left, and `--check` passes until a floating reference comes.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`. The CLI tests need the `sealed`
//! binary built (`cargo build -p sealed-cli`).

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use sealed_crds::{
    CONDITION_READY, SealedVolume, SealedVolumeVersion, SealedVolumeVersionSpec, VOLUME_LABEL,
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
    operator: Option<tokio::task::JoinHandle<()>>,
    cluster: sealed_e2e::Cluster,
}

impl Fixture {
    /// The cluster, the CRDs, a namespace and a store; with `operator`, an operator scoped to
    /// the namespace.
    async fn start(test: &str, operator: bool) -> Option<Fixture> {
        let cluster = sealed_e2e::cluster(test).await?;
        let client = cluster.client.clone();
        sealed_e2e::install_crds(&client, "sealed-operator-test")
            .await
            .expect("install CRDs");
        let ns = cluster
            .temp_namespace("svol-gitops")
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
        let operator = operator.then(|| {
            let mut config = OperatorConfig::inline(&url, &ns);
            config.upload_poll = Duration::from_secs(1);
            let (client, store) = (client.clone(), store.clone());
            tokio::spawn(async move {
                let metrics = Arc::new(Metrics::new());
                if let Err(e) =
                    sealed_operator::controller::run(client, config, store, metrics).await
                {
                    panic!("operator stopped: {e:#}");
                }
            })
        });
        Some(Fixture {
            client,
            ns,
            store,
            _store_dir: store_dir,
            operator,
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

    /// Server-side applies `object` (a SealedVolume or SealedVolumeVersion of this
    /// namespace) as field manager `manager`, as Argo CD or `kubectl apply --server-side` do.
    async fn apply_as<K>(&self, manager: &str, name: &str, object: serde_json::Value)
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), &self.ns);
        api.patch(name, &PatchParams::apply(manager), &Patch::Apply(&object))
            .await
            .unwrap_or_else(|e| panic!("apply {name} as {manager}: {e}"));
    }

    /// Runs the `sealed` CLI with the cluster's kubeconfig.
    async fn sealed(&self, args: &[&str]) -> Output {
        let sealed = env!("CARGO_BIN_EXE_sealed-operator").replace("sealed-operator", "sealed");
        assert!(
            Path::new(&sealed).exists(),
            "build the CLI first (cargo build -p sealed-cli): {sealed}"
        );
        let kubeconfig = self.cluster.kubeconfig.clone();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            Command::new(&sealed)
                .args(&args)
                .arg("--no-progress")
                .env("KUBECONFIG", &kubeconfig)
                .output()
                .expect("run sealed")
        })
        .await
        .expect("join")
    }

    async fn stop(self) {
        if let Some(operator) = self.operator {
            operator.abort();
        }
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

fn write_tree(dir: &Path, seed: u8) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join("config.json"), format!("{{\"seed\": {seed}}}")).expect("write");
    let data: Vec<u8> = (0..(1 << 20))
        .map(|i: usize| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    std::fs::write(dir.join("model.bin"), data).expect("write");
}

fn upload_volume(name: &str, retention: &str, tags: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolume",
        "metadata": { "name": name },
        "spec": { "source": { "upload": {} }, "tags": tags,
                  "retention": { "deletedVersions": retention } },
    })
}

fn ready(v: &SealedVolumeVersion) -> bool {
    v.status
        .as_ref()
        .and_then(|s| s.condition(CONDITION_READY))
        .is_some_and(|c| c.status == "True")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_versions_have_no_owner_and_go_with_their_volume_for_its_retention() {
    let Some(fx) = Fixture::start(
        "applied_versions_have_no_owner_and_go_with_their_volume_for_its_retention",
        true,
    )
    .await
    else {
        return;
    };
    let work = tempfile::tempdir().expect("tempdir");
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    write_tree(&a_dir, 1);
    write_tree(&b_dir, 2);

    // Git holds the volume (30 days of retention) and a version of it, as Argo CD applies them.
    fx.apply_as::<SealedVolume>(
        "argocd-controller",
        "llama",
        upload_volume("llama", "720h", serde_json::json!({})),
    )
    .await;
    let b_digest = {
        // The digest b will have, for the version Git declares before the push.
        let scratch = tempfile::tempdir().expect("tempdir");
        let url = format!("file://{}", scratch.path().display());
        let store = ChunkStore::open(
            &url,
            &StoreOptions {
                create: true,
                ..Default::default()
            },
        )
        .await
        .expect("scratch store");
        push(
            &store,
            &b_dir,
            &PushOptions::default(),
            Arc::new(NoProgress),
        )
        .await
        .expect("push")
        .digest
    };
    let from_git = SealedVolumeVersionSpec::object_name("llama", &b_digest.to_string());
    fx.apply_as::<SealedVolumeVersion>(
        "argocd-controller",
        &from_git,
        serde_json::json!({
            "apiVersion": sealed_crds::API_VERSION,
            "kind": "SealedVolumeVersion",
            "metadata": { "name": from_git },
            "spec": { "volume": "llama", "digest": b_digest.to_string() },
        }),
    )
    .await;
    // a is pushed and imported by the operator; b's push gives Git's version its record.
    let a = fx.push(&a_dir, "llama").await;
    let b = fx.push(&b_dir, "llama").await;
    assert_eq!(b, b_digest);

    let versions = fx.versions();
    let find = |d: Digest| {
        let versions = versions.clone();
        async move {
            versions
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|v| v.spec.digest == d.to_string() && ready(v))
        }
    };
    let made = wait_for("the operator's version of a, Ready", || find(a)).await;
    let applied = wait_for("Git's version of b, Ready", || async {
        find(b).await.filter(|v| {
            v.labels().get(VOLUME_LABEL).map(String::as_str) == Some("llama")
                && v.status.as_ref().is_some_and(|s| s.attestation.is_some())
        })
    })
    .await;
    assert_eq!(applied.name_any(), from_git);

    // The operator's version is controlled by its volume; Git's has no owner at all (Argo CD
    // prunes only what has none), and both carry the volume's retention.
    let owners = made.owner_references();
    assert!(
        owners
            .iter()
            .any(|o| o.kind == "SealedVolume" && o.name == "llama" && o.controller == Some(true)),
        "{owners:?}"
    );
    assert!(
        applied.owner_references().is_empty(),
        "a version applied from Git got owners: {:?}",
        applied.owner_references()
    );
    for v in [&made, &applied] {
        assert_eq!(
            v.annotations()
                .get(sealed_operator::version::RETENTION_ANNOTATION)
                .map(String::as_str),
            Some("720h"),
            "{}",
            v.name_any()
        );
    }
    // The volume holds the finalizer that deletes Git's versions with it.
    wait_for("the volume's finalizer", || async {
        let v = fx.volumes().get("llama").await.ok()?;
        v.finalizers()
            .iter()
            .any(|f| f == sealed_operator::volume::FINALIZER)
            .then_some(())
    })
    .await;

    // Deleting the volume (kubectl's default: background) deletes both versions, and each is
    // restorable for the volume's 720h, not the 168h default.
    fx.volumes()
        .delete("llama", &DeleteParams::background())
        .await
        .expect("delete volume");
    wait_for("every version and the volume gone", || async {
        let left = fx.versions().list(&ListParams::default()).await.ok()?.items;
        let volume = fx.volumes().get_opt("llama").await.ok()?;
        (left.is_empty() && volume.is_none()).then_some(())
    })
    .await;
    for d in [&a, &b] {
        assert!(!fx.store.has_manifest(d).await.expect("head"), "{d} live");
        let record = sealed_store::trash::read_record(&fx.store, d)
            .await
            .expect("read trash")
            .unwrap_or_else(|| panic!("{d} not in the trash"));
        let kept = record.restorable_until - record.deleted_at;
        assert_eq!(kept.num_hours(), 720, "{d} kept for the volume's retention");
    }
    fx.stop().await;
}

/// A volume Git owns: server-side applied as `manager`, or written by `kubectl apply`
/// (client-side: an update whose manager is `kubectl-client-side-apply`).
async fn volume_owned_by(fx: &Fixture, manager: &str, name: &str) {
    let volume = serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolume",
        "metadata": { "name": name },
        "spec": { "source": { "huggingFace": { "repo": "acme/llm", "revision": "main" } } },
    });
    if manager == "kubectl-client-side-apply" {
        let object: SealedVolume = serde_json::from_value(volume).expect("volume");
        let params = kube::api::PostParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        fx.volumes()
            .create(&params, &object)
            .await
            .expect("create volume");
    } else {
        fx.apply_as::<SealedVolume>(manager, name, volume).await;
    }
}

async fn repo_of(fx: &Fixture, name: &str) -> serde_json::Value {
    let v = fx.volumes().get(name).await.expect("get volume");
    serde_json::to_value(&v.spec.source).expect("source")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_sync_does_not_overwrite_a_source_git_owns_without_force() {
    let Some(fx) = Fixture::start(
        "sealed_sync_does_not_overwrite_a_source_git_owns_without_force",
        false,
    )
    .await
    else {
        return;
    };
    for (manager, name) in [
        ("argocd-controller", "argo"),
        ("kubectl-client-side-apply", "kubectl"),
    ] {
        volume_owned_by(&fx, manager, name).await;
        let volume = format!("{}/{name}", fx.ns);
        let before = repo_of(&fx, name).await;
        // Another repo, and another kind of source: both refused, naming the owner.
        for source in ["hf://acme/other", "s3://bucket/prefix"] {
            let out = fx
                .sealed(&["sync", source, "--volume", &volume, "--no-wait"])
                .await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{manager} {source}: {stderr}");
            assert!(
                stderr.contains(manager) && stderr.contains("--force"),
                "{manager} {source}: {stderr}"
            );
            assert_eq!(
                repo_of(&fx, name).await,
                before,
                "{manager} {source}: changed"
            );
        }
        // The same source only asks for a resync: no conflict.
        let out = fx
            .sealed(&["sync", "hf://acme/llm", "--volume", &volume, "--no-wait"])
            .await;
        assert!(
            out.status.success(),
            "{manager}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // --force takes it over.
        let out = fx
            .sealed(&[
                "sync",
                "hf://acme/other",
                "--volume",
                &volume,
                "--no-wait",
                "--force",
            ])
            .await;
        assert!(
            out.status.success(),
            "{manager} --force: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            repo_of(&fx, name).await["huggingFace"]["repo"],
            "acme/other"
        );
        let out = fx
            .sealed(&[
                "sync",
                "s3://bucket/prefix",
                "--volume",
                &volume,
                "--no-wait",
                "--force",
            ])
            .await;
        assert!(
            out.status.success(),
            "{manager} --force s3: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let source = repo_of(&fx, name).await;
        assert!(source.get("huggingFace").is_none(), "{source}");
        assert_eq!(
            source["objectStore"]["url"], "s3://bucket/prefix",
            "{source}"
        );
    }

    // A volume `sealed sync` made is its own to change.
    let volume = format!("{}/mine", fx.ns);
    for source in ["hf://acme/llm", "hf://acme/other"] {
        let out = fx
            .sealed(&["sync", source, "--volume", &volume, "--no-wait"])
            .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(
        repo_of(&fx, "mine").await["huggingFace"]["repo"],
        "acme/other"
    );
    fx.stop().await;
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

fn deployment(ns: &str, tag: &str) -> String {
    format!(
        "# the model server: Argo CD applies this\n\
         apiVersion: apps/v1\n\
         kind: Deployment\n\
         metadata:\n  name: server\n  namespace: {ns}\n\
         spec:\n  template:\n    spec:\n      containers:\n      - name: s\n        image: x  # kept\n\
         \x20     volumes:\n      - name: weights\n        csi:\n          driver: csi.sealedvolumes.io\n\
         \x20         readOnly: true\n          volumeAttributes:\n            volume: llama  # the model\n\
         \x20           tag: {tag}\n"
    )
}

const POD: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n---\n\
    apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  volumes:\n  - name: w\n    csi: \
    {driver: csi.sealedvolumes.io, volumeAttributes: {volume: llama, tag: prod}}\n";

/// Helm values: a digest beside the volume and tag keys, at any depth.
const VALUES: &str = "# the chart's values\nserver:\n  model:\n    volume: llama\n    tag: prod\n    digest: \"\"  # sealed pin writes it\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_pin_rewrites_tags_to_digests_and_check_fails_while_one_floats() {
    let Some(fx) = Fixture::start(
        "sealed_pin_rewrites_tags_to_digests_and_check_fails_while_one_floats",
        true,
    )
    .await
    else {
        return;
    };
    let work = tempfile::tempdir().expect("tempdir");
    write_tree(&work.path().join("a"), 3);
    let a = fx.push(&work.path().join("a"), "llama").await;
    fx.apply_as::<SealedVolume>(
        "argocd-controller",
        "llama",
        upload_volume(
            "llama",
            "168h",
            serde_json::json!({ "prod": a.to_string() }),
        ),
    )
    .await;
    wait_for("tag prod resolved", || async {
        let v = fx.volumes().get("llama").await.ok()?;
        let status = v.status?;
        (status.observed_generation == v.metadata.generation
            && status.tags.get("prod")?.version.is_some())
        .then_some(())
    })
    .await;

    let repo = work.path().join("repo");
    let deploy = repo.join("apps/server.yaml");
    let pod = repo.join("pod.yml");
    let values = repo.join("chart/values.yaml");
    write(&deploy, &deployment(&fx.ns, "prod"));
    write(&pod, POD);
    write(&values, VALUES);
    // A Helm template is not YAML: skipped with a warning, never rewritten.
    let template = repo.join("chart/templates/x.yaml");
    write(&template, "a: {{ .Values.x }\n");
    let ns = fx.ns.clone();

    // --check (no cluster needed) lists both references and fails.
    let out = fx
        .sealed(&["pin", "--check", repo.to_str().expect("utf-8")])
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("apps/server.yaml:19:") && stdout.contains("pod.yml:"),
        "{stdout}"
    );

    // A tag that does not resolve: a clear error (not found), and no file changes.
    let bad = work.path().join("bad");
    write(&bad.join("server.yaml"), &deployment(&fx.ns, "prod"));
    write(&bad.join("typo.yaml"), &deployment(&fx.ns, "prdo"));
    let out = fx
        .sealed(&["pin", bad.to_str().expect("utf-8"), "-n", &ns])
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(
        stderr.contains("typo.yaml:19")
            && stderr.contains("prdo")
            && stderr.contains("no such tag"),
        "{stderr}"
    );
    assert_eq!(read(&bad.join("server.yaml")), deployment(&fx.ns, "prod"));

    // pin rewrites both to a's digest and keeps everything else.
    let out = fx
        .sealed(&["pin", repo.to_str().expect("utf-8"), "-n", &ns])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pinned = read(&deploy);
    let pinned_to = |d: &Digest| {
        deployment(&fx.ns, "prod").replace(
            "            volume: llama  # the model\n            tag: prod\n",
            &format!("            digest: \"{d}\"  # the model  # sealed: volume=llama tag=prod\n"),
        )
    };
    assert_eq!(pinned, pinned_to(&a));
    let pod_pinned_to = |d: &Digest| {
        POD.replace(
            "volumeAttributes: {volume: llama, tag: prod}}",
            &format!("volumeAttributes: {{digest: \"{d}\"}}}}  # sealed: volume=llama tag=prod"),
        )
    };
    assert_eq!(read(&pod), pod_pinned_to(&a));
    assert_eq!(
        read(&values),
        VALUES.replace("digest: \"\"", &format!("digest: \"{a}\""))
    );
    assert_eq!(read(&template), "a: {{ .Values.x }\n");

    // Now nothing floats.
    let check = |path: std::path::PathBuf| {
        let fx = &fx;
        async move {
            fx.sealed(&["pin", "--check", path.to_str().expect("utf-8")])
                .await
        }
    };
    let out = check(repo.clone()).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The tag moves with `sealed tag`: Git (argocd-controller) owns it, so not without --force.
    write_tree(&work.path().join("b"), 4);
    let b = fx.push(&work.path().join("b"), "llama").await;
    let b_short = &b.to_string()[..15];
    let out = wait_for("version b imported (sealed tag accepts it)", || async {
        let out = fx
            .sealed(&["tag", "llama", "prod", b_short, "-n", &ns])
            .await;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (!stderr.contains("no version")).then_some(out)
    })
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("argocd-controller") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(
        fx.volumes().get("llama").await.expect("volume").spec.tags["prod"],
        a.to_string()
    );
    let out = fx
        .sealed(&[
            "tag", "llama", "prod", b_short, "-n", &ns, "--force", "-o", "json",
        ])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let moved: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(moved["digest"], b.to_string());
    assert_eq!(moved["previous"], a.to_string());
    // A digest that is no version of the volume is refused (not found), the tag unchanged.
    let stranger = Digest::of(b"no such version");
    let out = fx
        .sealed(&["tag", "llama", "prod", &stranger.to_string(), "-n", &ns])
        .await;
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A new tag, then --rm; removing it again is not found.
    let out = fx
        .sealed(&["tag", &format!("{ns}/llama"), "canary", &a.to_string()])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        fx.volumes().get("llama").await.expect("volume").spec.tags["canary"],
        a.to_string()
    );
    let out = fx
        .sealed(&["tag", "--rm", "llama", "canary", "-n", &ns])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tags = fx.volumes().get("llama").await.expect("volume").spec.tags;
    assert!(
        !tags.contains_key("canary") && tags["prod"] == b.to_string(),
        "{tags:?}"
    );
    let out = fx
        .sealed(&["tag", "--rm", "llama", "canary", "-n", &ns])
        .await;
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Re-pin from the markers once the operator resolved the moved tag.
    wait_for("tag prod resolved to b", || async {
        let v = fx.volumes().get("llama").await.ok()?;
        let status = v.status?;
        (status.observed_generation == v.metadata.generation
            && status.tags.get("prod")?.digest == b.to_string()
            && status.tags.get("prod")?.version.is_some())
        .then_some(())
    })
    .await;
    let out = fx
        .sealed(&["pin", repo.to_str().expect("utf-8"), "-n", &ns])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read(&deploy), pinned_to(&b));
    assert_eq!(read(&pod), pod_pinned_to(&b));
    assert_eq!(
        read(&values),
        VALUES.replace("digest: \"\"", &format!("digest: \"{b}\""))
    );
    let out = check(repo.clone()).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // A floating reference fails --check, naming its file and line.
    write(&repo.join("apps/new.yaml"), &deployment(&fx.ns, "prod"));
    let out = check(repo.clone()).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("apps/new.yaml:19:") && !stdout.contains("server.yaml"),
        "{stdout}"
    );
    fx.stop().await;
}
