//! Tags through rollouts (issue 36) and the chart's upgrade (issue 39), with bytes read in pods,
//! on the real cluster of `hack/cluster.sh`, with ONE release of the chart:
//!
//! 1. The previous chart version (from git history, `sealed_e2e::upgrade::previous_chart`) is
//!    installed with this build's images (tag `rollout-1`); a store on moto (reached by the
//!    pods through a proxy on the node's address); an upload volume with two versions v1 and v2
//!    (`version.txt` naming the version, `data.bin` 256 KiB of different bytes), tag `prod` ->
//!    v1.
//! 2. Two Deployments on `{volume: model, tag: prod}` whose pods read both files once a second
//!    and log what they read: `web` (4 replicas) and `follow` (3 replicas, annotated
//!    `sealedvolumes.io/follow-tags`). Every pod of both reads v1. The tag moves to v2 while
//!    `web` scales to 6 and one of its pods is deleted: `web` keeps its one ReplicaSet and every
//!    one of its 6 pods reads v1 bytes (old and new pods alike); `follow` rolls out (a
//!    `TagFollowed` Event names v1 -> v2) and at the end every pod of it reads v2 bytes. The tag
//!    moves back: `follow` rolls back, every pod reads v1; `web` is untouched.
//!    Beside them, on the same tag and the same moves: a StatefulSet `db` (2 replicas) and a Job
//!    `train` (parallelism 2, completions 4) whose pods read until the test opens a gate (a
//!    file in a host directory they mount), then exit. When the tag moves to v2, `db-0`
//!    is deleted and `db` scales to 3, and the gate opens, so `train`'s last 2 pods are created
//!    after the move: the StatefulSet's 3 pods (its one ControllerRevision) and the Job's 4
//!    pods each read v1 bytes, the version their revision was admitted with.
//! 3. While all those pods keep reading, `helm upgrade` to this chart with the next image tag
//!    (`rollout-2`, the same bytes: what a release upgrade changes). Just before it the live
//!    `sealedvolumes` CRD is made older than the chart (its `spec.warm`, the last field the
//!    chart's CRDs gained, removed: the API server then refuses a SealedVolume that sets it):
//!    the upgrade puts the field back (a strict dry-run apply that sets it is accepted) and the
//!    CRDs become the release's (Helm's ownership and the keep policy; their schema is this
//!    chart's), the node
//!    DaemonSet rolls its pod with `maxUnavailable` a percentage, the fd holder (OnDelete) keeps
//!    its old pod until it is replaced as docs/helm.md "Upgrading the fd holder" says (plugin
//!    ready, delete the holder pod, new holder ready, the plugin's
//!    `sealed_csi_mounts_unprotected` back at 0); no read of any pod failed, every pod kept
//!    reading its version after the upgrade.
//!
//! Cleanup whatever happens: the Deployments, the volume and versions, `helm uninstall`, the
//! namespace, the image tags.
//!
//! Why the CRD is made older by the test rather than by the previous chart: that chart keeps
//! its CRDs in `crds/` (installed only where absent, and present on a shared cluster), with
//! the same schema as this one. The field is missing for the few seconds before `helm
//! upgrade` only (a SealedVolume of another test read meanwhile would lack `spec.warm`);
//! `cleanup` puts it back if the upgrade did not. `e2e/tests/crd_upgrade.rs` shows a real
//! historical schema change, from the chart before the last CRD change, on a renamed group.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`, or outside a git checkout; needs root,
//! moto_server, helm (`hack/build-k8s.sh`), ctr and the workspace's binaries (`cargo test
//! --workspace` builds them).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::{
    ControllerRevision, DaemonSet, Deployment, ReplicaSet, StatefulSet,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use object_store::aws::AmazonS3Builder;
use object_store::prefix::PrefixStore;
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_e2e::fleet::{
    CountingProxy, FIRST_NODE, FIRST_NODE_IP, Helm, metric_sum, scrape, workspace_binary,
};
use sealed_e2e::upgrade::{
    CHART, GATE_MOUNT, Gate, MOUNT, READER_SCRIPT, Read, epoch_now, export_chart,
    gated_reader_script, previous_chart, reads, remove_images, tag_image,
};
use sealed_e2e::{BUSYBOX_IMAGE, Cluster, wait_for};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress};
use sha2::Digest as _;

const RELEASE: &str = "rollout";
const DRIVER: &str = "csi.sealedvolumes.io";
const VOLUME: &str = "model";
const TAG: &str = "prod";
/// The StatefulSet and the Job on the tag (beside the Deployments `web` and `follow`).
const STATEFULSET: &str = "db";
const JOB: &str = "train";
const JOB_PARALLELISM: i32 = 2;
const JOB_COMPLETIONS: i32 = 4;
/// Every workload of the test, by its pods' `app` label.
const APPS: [&str; 4] = ["web", "follow", STATEFULSET, JOB];
const STORE_BUCKET: &str = "rollout-store";
const STORE_PREFIX: &str = "sealed";
const REGION: &str = "us-east-1";
/// The image tag of the install, and of the upgrade (the same images under a second name).
const TAG_BEFORE: &str = "rollout-1";
const TAG_AFTER: &str = "rollout-2";
const FOLLOW_ANNOTATION: &str = "sealedvolumes.io/follow-tags";
const RESOLVED_ANNOTATION: &str = "sealedvolumes.io/resolved-tags";
/// The plugin's metrics port (chart `metrics.nodePort`).
const METRICS_PORT: u16 = 9809;
const TIMEOUT: Duration = Duration::from_secs(120);

fn started() -> Instant {
    static T: OnceLock<Instant> = OnceLock::new();
    *T.get_or_init(Instant::now)
}

/// Progress on stderr straight away (the harness captures println of passing tests).
fn say(msg: impl Display) {
    let _ = writeln!(
        std::io::stderr(),
        "[rollout {:>5.1}s] {msg}",
        started().elapsed().as_secs_f64()
    );
}

/// Different bytes on every run: the node's disk cache outlives a run.
fn run_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        nanos ^ u64::from(std::process::id()).rotate_left(32)
    })
}

/// A version as the test made it: its digest and what a reader prints for it.
#[derive(Clone, Debug)]
struct Version {
    name: &'static str,
    digest: Digest,
    /// `CONTENT SHA256` (a reader's `ok` text).
    reads_as: String,
}

struct Bed {
    cluster: Cluster,
    helm: Helm,
    ns: String,
    store: ChunkStore,
    proxy: CountingProxy,
    /// What the Job's first pods wait for before they finish.
    gate: Gate,
    previous: PathBuf,
    previous_why: String,
}

impl Bed {
    fn client(&self) -> Client {
        self.cluster.client.clone()
    }
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn daemonsets(&self) -> Api<DaemonSet> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn statefulsets(&self) -> Api<StatefulSet> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn volumes(&self) -> Api<SealedVolume> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn versions(&self) -> Api<SealedVolumeVersion> {
        Api::namespaced(self.client(), &self.ns)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tags_roll_with_their_workloads_and_the_chart_upgrades_under_readers() {
    started();
    let Some(cluster) = sealed_e2e::cluster("rollout").await else {
        return;
    };
    let Some(previous) = previous_chart().expect("finding the previous chart") else {
        eprintln!(
            "rollout: skipped: no git history here (not a git checkout, or a shallow clone \
             that cannot be deepened); the previous chart comes from it"
        );
        return;
    };
    let Some(moto) = sealed_test_support::start_moto(STORE_BUCKET, false) else {
        return;
    };
    let result = async {
        let registered = Api::<CSINode>::all(cluster.client.clone())
            .get_opt(FIRST_NODE)
            .await?
            .map(|n| n.spec.drivers)
            .unwrap_or_default()
            .iter()
            .any(|d| d.name == DRIVER);
        ensure!(
            !registered,
            "{DRIVER} is already registered on {FIRST_NODE}: another install of the chart runs \
             (the journey or the fleet test?); one node plugin per node"
        );
        let tmp = tempfile::tempdir()?;
        let previous_dir = tmp.path().join("previous");
        export_chart(&previous.commit, &previous_dir)?;
        let moto_addr: SocketAddr = format!("127.0.0.1:{}", moto.port).parse()?;
        let proxy = CountingProxy::start(format!("{FIRST_NODE_IP}:0").parse()?, moto_addr).await?;
        let s3 = AmazonS3Builder::new()
            .with_bucket_name(STORE_BUCKET)
            .with_endpoint(&moto.url)
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region(REGION)
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .build()?;
        let store = ChunkStore::from_object_store(
            Arc::new(PrefixStore::new(s3, STORE_PREFIX)),
            format!("s3://{STORE_BUCKET}/{STORE_PREFIX}"),
        );
        let ns = cluster.temp_namespace("rollout").await?;
        let bed = Bed {
            helm: Helm::new(&cluster.kubeconfig)?,
            cluster: cluster.clone(),
            ns,
            store,
            proxy,
            gate: Gate::new()?,
            previous: previous_dir,
            previous_why: format!("{:.10}: {}", previous.commit, previous.why),
        };
        let r = steps(&bed).await;
        if r.is_err() {
            dump_state(&bed).await;
        }
        cleanup(&bed).await;
        r
    }
    .await;
    say(format!(
        "done in {:.0} s",
        started().elapsed().as_secs_f64()
    ));
    result.expect("the rollout test failed");
}

async fn steps(bed: &Bed) -> Result<()> {
    let (v1, v2) = install_previous(bed).await?;
    tags_and_rollouts(bed, &v1, &v2).await?;
    upgrade(bed, &v1).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 1. the previous chart, two versions, the tag

fn build_images() -> Result<()> {
    let script = sealed_e2e::repo_root().join("hack/images.sh");
    let out = Command::new(&script)
        .arg("sealed")
        .env("SEALED_OPERATOR_BIN", workspace_binary("sealed-operator")?)
        .env("SEALED_CSI_BIN", workspace_binary("sealed-csi")?)
        .env("SEALED_IMAGE_TAG", TAG_BEFORE)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    ensure!(
        out.status.success(),
        "hack/images.sh sealed failed ({})",
        out.status
    );
    for image in ["sealed-operator", "sealed-csi"] {
        tag_image(
            &format!("sealed.local/{image}:{TAG_BEFORE}"),
            &format!("sealed.local/{image}:{TAG_AFTER}"),
        )?;
    }
    Ok(())
}

/// The values of both the install and the upgrade (a user's values file), with `image_tag`.
fn helm_args<'a>(
    bed: &'a Bed,
    verb: &'a str,
    chart: &'a str,
    sets: &'a [String],
    watch: &'a str,
) -> Vec<&'a str> {
    let mut args = vec![verb, RELEASE, chart, "-n", &bed.ns, "--take-ownership"];
    for s in sets {
        args.extend(["--set", s.as_str()]);
    }
    args.extend(["--set-json", watch]);
    args
}

fn values(bed: &Bed, image_tag: &str) -> Vec<String> {
    vec![
        format!("fullnameOverride={RELEASE}"),
        "image.repository=sealed.local".into(),
        format!("image.tag={image_tag}"),
        "image.pullPolicy=IfNotPresent".into(),
        format!("store.url=s3://{STORE_BUCKET}/{STORE_PREFIX}"),
        format!("store.endpoint=http://{}", bed.proxy.addr()),
        format!("store.region={REGION}"),
        "store.credentials.AWS_ACCESS_KEY_ID=test".into(),
        "store.credentials.AWS_SECRET_ACCESS_KEY=test".into(),
        "operator.uploadPoll=2s".into(),
        "operator.gcInterval=0".into(),
        "cache.size=1Gi".into(),
    ]
}

async fn install_previous(bed: &Bed) -> Result<(Version, Version)> {
    let t = Instant::now();
    build_images()?;
    say(format!(
        "images sealed-operator and sealed-csi built as :{TAG_BEFORE} and tagged :{TAG_AFTER} too \
         ({:.0} s)",
        t.elapsed().as_secs_f64()
    ));
    // Other tests apply the CRDs without helm: the current ones are there (the previous
    // chart's crds/ are installed only where absent).
    sealed_e2e::install_crds(&bed.client(), "sealed-e2e-rollout").await?;
    let sets = values(bed, TAG_BEFORE);
    let watch = format!(r#"operator.extraArgs=["--watch-namespace={}"]"#, bed.ns);
    let chart = bed.previous.to_string_lossy().into_owned();
    bed.helm
        .run(&helm_args(bed, "install", &chart, &sets, &watch))?;
    say(format!(
        "helm install {RELEASE} -n {}: the previous chart ({})",
        bed.ns, bed.previous_why
    ));
    wait_release_ready(bed).await?;
    let owned = crds_owned(bed).await?;
    for crd in &owned {
        say(format!("before the upgrade: {crd}"));
    }
    // A chart with its CRDs in crds/ installs them only where absent and never owns them.
    if bed.previous.join("crds").is_dir() {
        let ours = format!("release {:?} in {:?}", Some(RELEASE), Some(&bed.ns));
        ensure!(
            owned.iter().all(|c| !c.contains(&ours)),
            "the previous chart's install owns the CRDs: {owned:?}"
        );
    }

    bed.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "sealedvolumes.io/v1alpha1",
                "kind": "SealedVolume",
                "metadata": { "name": VOLUME },
                "spec": { "source": { "upload": {} } },
            }))?,
        )
        .await
        .context("creating SealedVolume model")?;
    let v1 = push_version(bed, "v1", run_seed()).await?;
    let v2 = push_version(bed, "v2", run_seed().wrapping_add(1)).await?;
    say(format!(
        "versions Ready: v1 {} reads as {:?}, v2 {} as {:?}",
        v1.digest, v1.reads_as, v2.digest, v2.reads_as
    ));
    set_tag(bed, &v1).await?;
    Ok((v1, v2))
}

async fn wait_release_ready(bed: &Bed) -> Result<()> {
    let deployments = bed.deployments();
    wait_for("the operator ready", TIMEOUT, || async {
        let d = deployments.get(&format!("{RELEASE}-operator")).await?;
        let generation = d.metadata.generation;
        Ok(d.status.is_some_and(|s| {
            s.observed_generation == generation
                && s.ready_replicas.unwrap_or(0) >= 1
                && s.updated_replicas == s.replicas
                && s.replicas == s.ready_replicas
        }))
    })
    .await?;
    wait_for("the node plugin ready", TIMEOUT, || {
        daemonset_ready(bed, "node")
    })
    .await?;
    wait_for("the fd holder ready", TIMEOUT, || {
        daemonset_ready(bed, "fd-holder")
    })
    .await?;
    let nodes = Api::<CSINode>::all(bed.client());
    wait_for(
        &format!("{DRIVER} registered on {FIRST_NODE}"),
        Duration::from_secs(60),
        || async {
            Ok(nodes
                .get_opt(FIRST_NODE)
                .await?
                .map(|n| n.spec.drivers)
                .unwrap_or_default()
                .iter()
                .any(|d| d.name == DRIVER))
        },
    )
    .await
}

async fn daemonset_ready(bed: &Bed, component: &str) -> Result<bool> {
    let ds = bed
        .daemonsets()
        .get(&format!("{RELEASE}-{component}"))
        .await?;
    let generation = ds.metadata.generation;
    Ok(ds.status.is_some_and(|s| {
        s.observed_generation == generation
            && s.desired_number_scheduled >= 1
            && s.number_ready == s.desired_number_scheduled
    }))
}

/// Each sealed CRD's owner as Helm sees it: `NAME: release R/NS (managed-by, policy)`.
async fn crds_owned(bed: &Bed) -> Result<Vec<String>> {
    let crds = Api::<CustomResourceDefinition>::all(bed.client());
    let mut out = Vec::new();
    for plural in ["sealedvolumes", "sealedvolumeversions"] {
        let name = format!("{plural}.sealedvolumes.io");
        let crd = crds.get(&name).await?;
        let a = crd.annotations();
        out.push(format!(
            "CRD {name}: release {:?} in {:?}, managed-by {:?}, resource-policy {:?}",
            a.get("meta.helm.sh/release-name"),
            a.get("meta.helm.sh/release-namespace"),
            crd.labels().get("app.kubernetes.io/managed-by"),
            a.get("helm.sh/resource-policy"),
        ));
    }
    Ok(out)
}

async fn push_version(bed: &Bed, name: &'static str, seed: u64) -> Result<Version> {
    let dir = tempfile::tempdir()?;
    let content = format!("{name}-{seed:016x}");
    let data = sealed_e2e::pseudo_random(256 << 10, seed);
    std::fs::write(dir.path().join("version.txt"), format!("{content}\n"))?;
    std::fs::write(dir.path().join("data.bin"), &data)?;
    let hex = format!("{:x}", sha2::Sha256::digest(&data));
    let opts = PushOptions {
        volume: Some(format!("{}/{VOLUME}", bed.ns)),
        ..Default::default()
    };
    let report = push(&bed.store, dir.path(), &opts, Arc::new(NoProgress)).await?;
    let digest = report.digest;
    let want = digest.to_string();
    let versions = bed.versions();
    wait_for(
        &format!("a Ready SealedVolumeVersion with {want}"),
        TIMEOUT,
        || async {
            Ok(versions
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .any(|v| {
                    v.spec.digest == want
                        && v.status
                            .as_ref()
                            .and_then(|s| s.condition(sealed_crds::CONDITION_READY))
                            .is_some_and(|c| c.status == "True")
                }))
        },
    )
    .await?;
    Ok(Version {
        name,
        digest,
        reads_as: format!("{content} {hex}"),
    })
}

async fn set_tag(bed: &Bed, to: &Version) -> Result<()> {
    let patch = serde_json::json!({ "spec": { "tags": { TAG: to.digest.to_string() } } });
    bed.volumes()
        .patch(VOLUME, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("cannot move tag {TAG}"))?;
    say(format!("tag {TAG} -> {} ({})", to.name, to.digest));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 2. one version per revision, read through every pod

/// The pod template of the readers of workload `app`: `script` reads the volume mounted by
/// `{volume: model, tag: prod}`.
fn reader_template(app: &str, script: &str, restart_never: bool) -> serde_json::Value {
    let mut spec = serde_json::json!({
        "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "reader",
            "image": BUSYBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", script],
            "readinessProbe": {
                "exec": { "command": ["cat", format!("{MOUNT}/version.txt")] },
                "periodSeconds": 1,
            },
            "volumeMounts": [{ "name": "model", "mountPath": MOUNT, "readOnly": true }],
        }],
        "volumes": [{
            "name": "model",
            "csi": { "driver": DRIVER, "readOnly": true,
                     "volumeAttributes": { "volume": VOLUME, "tag": TAG } },
        }],
    });
    if restart_never {
        spec["restartPolicy"] = "Never".into();
    }
    serde_json::json!({ "metadata": { "labels": { "app": app } }, "spec": spec })
}

fn deployment(name: &str, replicas: i32, follow: bool) -> Result<Deployment> {
    let mut annotations = serde_json::Map::new();
    if follow {
        annotations.insert(FOLLOW_ANNOTATION.into(), "true".into());
    }
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "annotations": annotations },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "strategy": { "type": "RollingUpdate",
                          "rollingUpdate": { "maxSurge": 1, "maxUnavailable": 0 } },
            "template": reader_template(name, READER_SCRIPT, false),
        },
    }))?)
}

/// StatefulSet `db` with `replicas` readers, started all at once (`Parallel`).
fn statefulset(replicas: i32) -> Result<StatefulSet> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": STATEFULSET },
        "spec": {
            "replicas": replicas,
            "serviceName": STATEFULSET,
            "podManagementPolicy": "Parallel",
            "selector": { "matchLabels": { "app": STATEFULSET } },
            "template": reader_template(STATEFULSET, READER_SCRIPT, false),
        },
    }))?)
}

/// Job `train`: its pods read until the gate opens, then succeed.
fn job(gate: &Gate) -> Result<Job> {
    let mut template = reader_template(JOB, &gated_reader_script(), true);
    template["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .context("the reader template mounts volumes")?
        .push(serde_json::json!({ "name": "gate", "mountPath": GATE_MOUNT, "readOnly": true }));
    template["spec"]["volumes"]
        .as_array_mut()
        .context("the reader template has volumes")?
        .push(serde_json::json!({
            "name": "gate",
            "hostPath": { "path": gate.dir(), "type": "Directory" },
        }));
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": JOB },
        "spec": {
            "parallelism": JOB_PARALLELISM,
            "completions": JOB_COMPLETIONS,
            "backoffLimit": 0,
            "template": template,
        },
    }))?)
}

/// The revision a pod of the test belongs to: its ReplicaSet, its StatefulSet's
/// ControllerRevision (`controller-revision-hash`), or its Job.
fn revision_of(p: &Pod) -> String {
    let owner = p
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true));
    match owner.map(|o| o.kind.as_str()) {
        Some("StatefulSet") => p
            .labels()
            .get("controller-revision-hash")
            .cloned()
            .unwrap_or_default(),
        Some(_) => owner.map(|o| o.name.clone()).unwrap_or_default(),
        None => String::new(),
    }
}

/// The pods of workload `app` (by label), not terminating, with the revision each belongs to
/// ([`revision_of`]).
async fn pods_of(bed: &Bed, app: &str) -> Result<Vec<(String, String)>> {
    let list = bed
        .pods()
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| (p.name_any(), revision_of(&p)))
        .collect())
}

async fn replica_sets_of(bed: &Bed, app: &str) -> Result<Vec<ReplicaSet>> {
    Ok(Api::<ReplicaSet>::namespaced(bed.client(), &bed.ns)
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?
        .items)
}

/// Waits until Deployment `name` has rolled out completely: `replicas` pods, all updated,
/// ready and available, no pod of an older ReplicaSet left.
async fn wait_rolled_out(bed: &Bed, name: &str, replicas: i32) -> Result<()> {
    let deployments = bed.deployments();
    wait_for(
        &format!("Deployment {name} rolled out with {replicas} ready pods"),
        TIMEOUT,
        || async {
            let d = deployments.get(name).await?;
            let generation = d.metadata.generation;
            let done = d.status.is_some_and(|s| {
                s.observed_generation == generation
                    && s.replicas == Some(replicas)
                    && s.updated_replicas == Some(replicas)
                    && s.ready_replicas == Some(replicas)
                    && s.available_replicas == Some(replicas)
            });
            Ok(done && pods_of(bed, name).await?.len() == replicas as usize)
        },
    )
    .await
}

async fn log_of(bed: &Bed, pod: &str) -> Result<String> {
    Ok(bed.pods().logs(pod, &LogParams::default()).await?)
}

/// What each pod of `app` reads at or after `since` (epoch seconds): waits for one read of
/// each after it and returns the last, by pod (with its revision).
async fn read_each(bed: &Bed, app: &str, since: u64) -> Result<BTreeMap<String, (String, Read)>> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let mut out = BTreeMap::new();
        let mut waiting = Vec::new();
        for (pod, rs) in pods_of(bed, app).await? {
            let log = log_of(bed, &pod).await.unwrap_or_default();
            match reads(&log).into_iter().rev().find(|r| r.at >= since) {
                Some(r) => {
                    out.insert(pod, (rs, r));
                }
                None => waiting.push(pod),
            }
        }
        if waiting.is_empty() {
            return Ok(out);
        }
        if Instant::now() > deadline {
            bail!("pods {waiting:?} of {app} printed no read since {since}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Reads one file through every pod of `app` and fails unless each read `want`.
async fn every_pod_reads(
    bed: &Bed,
    app: &str,
    want: &Version,
) -> Result<BTreeMap<String, (String, Read)>> {
    let got = read_each(bed, app, epoch_now()).await?;
    let wrong: Vec<_> = got
        .iter()
        .filter(|(_, (_, r))| r.result.as_ref() != Ok(&want.reads_as))
        .collect();
    ensure!(
        wrong.is_empty(),
        "pods of {app} that do not read {} ({:?}): {wrong:?}",
        want.name,
        want.reads_as
    );
    let by_rs: BTreeSet<&String> = got.values().map(|(rs, _)| rs).collect();
    say(format!(
        "{app}: each of its {} pods read {} bytes (version.txt + sha256 of data.bin: {:?}); \
         revisions {by_rs:?}",
        got.len(),
        want.name,
        want.reads_as
    ));
    Ok(got)
}

/// The `sealedvolumes.io/resolved-tags` record of ReplicaSet `rs`.
async fn resolved_of(bed: &Bed, rs: &str) -> Result<String> {
    Ok(Api::<ReplicaSet>::namespaced(bed.client(), &bed.ns)
        .get(rs)
        .await?
        .annotations()
        .get(RESOLVED_ANNOTATION)
        .cloned()
        .unwrap_or_default())
}

/// Fails unless `record` (a revision's `sealedvolumes.io/resolved-tags`) names `want`.
fn ensure_records(what: &str, record: &str, want: &Version) -> Result<()> {
    ensure!(
        record.contains(&want.digest.to_string()),
        "{what} records {record:?}, not {}",
        want.name
    );
    Ok(())
}

/// Waits until StatefulSet `db` has `replicas` ready pods, all of its current revision.
async fn wait_statefulset(bed: &Bed, replicas: i32) -> Result<()> {
    let sets = bed.statefulsets();
    wait_for(
        &format!("StatefulSet {STATEFULSET} with {replicas} ready pods"),
        TIMEOUT,
        || async {
            let s = sets.get(STATEFULSET).await?;
            let generation = s.metadata.generation;
            let done = s.status.is_some_and(|s| {
                s.observed_generation == generation
                    && s.replicas == replicas
                    && s.ready_replicas == Some(replicas)
                    && s.current_revision.is_some()
                    && s.current_revision == s.update_revision
            });
            Ok(done && pods_of(bed, STATEFULSET).await?.len() == replicas as usize)
        },
    )
    .await
}

/// The uid of every pod of `app` that is not terminating, by name.
async fn uids_of(bed: &Bed, app: &str) -> Result<BTreeMap<String, String>> {
    Ok(bed
        .pods()
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| (p.name_any(), p.uid().unwrap_or_default()))
        .collect())
}

async fn scale_statefulset(bed: &Bed, replicas: i32) -> Result<()> {
    let patch = serde_json::json!({ "spec": { "replicas": replicas } });
    bed.statefulsets()
        .patch(STATEFULSET, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("scaling {STATEFULSET} to {replicas}"))?;
    Ok(())
}

async fn scale(bed: &Bed, name: &str, replicas: i32) -> Result<()> {
    let patch = serde_json::json!({ "spec": { "replicas": replicas } });
    bed.deployments()
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("scaling {name} to {replicas}"))?;
    Ok(())
}

/// The template's digest annotation the operator writes on a following workload.
async fn follow_template(bed: &Bed) -> Result<String> {
    Ok(bed
        .deployments()
        .get("follow")
        .await?
        .spec
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.annotations)
        .and_then(|a| a.get("sealedvolumes.io/tag-digests").cloned())
        .unwrap_or_default())
}

/// Waits until the following Deployment's template pins `to` and it has rolled out.
async fn wait_followed(bed: &Bed, to: &Version, replicas: i32) -> Result<()> {
    let want = to.digest.to_string();
    wait_for(
        &format!("the operator to write {} into follow's template", to.name),
        TIMEOUT,
        || async { Ok(follow_template(bed).await?.contains(&want)) },
    )
    .await?;
    wait_rolled_out(bed, "follow", replicas).await
}

async fn followed_events(bed: &Bed) -> Result<Vec<String>> {
    Ok(Api::<Event>::namespaced(bed.client(), &bed.ns)
        .list(&ListParams::default().fields("involvedObject.name=follow"))
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("TagFollowed"))
        .filter_map(|e| e.message)
        .collect())
}

async fn tags_and_rollouts(bed: &Bed, v1: &Version, v2: &Version) -> Result<()> {
    let t = Instant::now();
    bed.deployments()
        .create(&PostParams::default(), &deployment("web", 4, false)?)
        .await
        .context("creating Deployment web")?;
    bed.deployments()
        .create(&PostParams::default(), &deployment("follow", 3, true)?)
        .await
        .context("creating Deployment follow")?;
    bed.statefulsets()
        .create(&PostParams::default(), &statefulset(2)?)
        .await
        .context("creating StatefulSet db")?;
    bed.jobs()
        .create(&PostParams::default(), &job(&bed.gate)?)
        .await
        .context("creating Job train")?;
    wait_rolled_out(bed, "web", 4).await?;
    // The follower may pin the digest the tag names into a new follower's template at the
    // first SealedVolume event (one rollout to the same digest): wait for it to settle.
    wait_rolled_out(bed, "follow", 3).await?;
    wait_statefulset(bed, 2).await?;
    say(format!(
        "Deployments web (4 replicas) and follow (3, {FOLLOW_ANNOTATION}), StatefulSet \
         {STATEFULSET} (2) and Job {JOB} (parallelism {JOB_PARALLELISM}, completions \
         {JOB_COMPLETIONS}) on {{volume: {VOLUME}, tag: {TAG}}} ready in {:.0} s",
        t.elapsed().as_secs_f64()
    ));
    every_pod_reads(bed, "web", v1).await?;
    every_pod_reads(bed, "follow", v1).await?;
    let db = every_pod_reads(bed, STATEFULSET, v1).await?;
    let db_revisions: BTreeSet<String> = db.values().map(|(r, _)| r.clone()).collect();
    ensure!(
        db_revisions.len() == 1,
        "{STATEFULSET}'s pods are not of one revision: {db:?}"
    );
    let db_rev = db_revisions
        .into_iter()
        .next()
        .context("StatefulSet without pods")?;
    let db_before = uids_of(bed, STATEFULSET).await?;
    // The Job's first pods read v1 and keep reading: the gate is closed.
    every_pod_reads(bed, JOB, v1).await?;
    let job_before = uids_of(bed, JOB).await?;
    ensure!(
        job_before.len() == JOB_PARALLELISM as usize,
        "Job {JOB} has pods {job_before:?} before the tag moves, not {JOB_PARALLELISM}"
    );
    let web_sets = replica_sets_of(bed, "web").await?;
    ensure!(
        web_sets.len() == 1,
        "web has {} ReplicaSets before anything moved",
        web_sets.len()
    );
    let old_rs = web_sets[0].name_any();
    let record = resolved_of(bed, &old_rs).await?;
    ensure!(
        record.contains(&v1.digest.to_string()),
        "ReplicaSet {old_rs} records {record:?}, not v1"
    );
    say(format!(
        "ReplicaSet {old_rs} records {RESOLVED_ANNOTATION}={record}"
    ));
    let db_record = Api::<ControllerRevision>::namespaced(bed.client(), &bed.ns)
        .get(&db_rev)
        .await?
        .annotations()
        .get(RESOLVED_ANNOTATION)
        .cloned()
        .unwrap_or_default();
    ensure_records(&format!("ControllerRevision {db_rev}"), &db_record, v1)?;
    let job_record = bed
        .jobs()
        .get(JOB)
        .await?
        .annotations()
        .get(RESOLVED_ANNOTATION)
        .cloned()
        .unwrap_or_default();
    ensure_records(&format!("Job {JOB}"), &job_record, v1)?;
    say(format!(
        "{STATEFULSET}'s ControllerRevision {db_rev} and Job {JOB} record v1 too; {JOB}'s first \
         pods {:?} read v1 and wait for the gate",
        job_before.keys().collect::<Vec<_>>()
    ));

    // The tag moves while web scales to 6 and one of its pods is deleted.
    set_tag(bed, v2).await?;
    scale(bed, "web", 6).await?;
    let victim = pods_of(bed, "web")
        .await?
        .first()
        .map(|(p, _)| p.clone())
        .context("web has no pod")?;
    bed.pods()
        .delete(&victim, &DeleteParams::default())
        .await
        .with_context(|| format!("deleting pod {victim}"))?;
    let db_victim = format!("{STATEFULSET}-0");
    bed.pods()
        .delete(&db_victim, &DeleteParams::default())
        .await
        .with_context(|| format!("deleting pod {db_victim}"))?;
    scale_statefulset(bed, 3).await?;
    bed.gate.open()?;
    say(format!(
        "after the tag moved: web scaled to 6 and its pod {victim} deleted; {db_victim} deleted \
         and {STATEFULSET} scaled to 3; the gate open, {JOB}'s first pods finish"
    ));
    wait_rolled_out(bed, "web", 6).await?;
    let web = every_pod_reads(bed, "web", v1).await?;
    ensure!(
        web.values().all(|(rs, _)| *rs == old_rs) && !web.contains_key(&victim),
        "web's pods are not all of ReplicaSet {old_rs} (or {victim} is back): {web:?}"
    );
    let web_sets = replica_sets_of(bed, "web").await?;
    ensure!(
        web_sets.len() == 1,
        "the tag move started a rollout of web, which does not follow its tags: {:?}",
        web_sets.iter().map(|r| r.name_any()).collect::<Vec<_>>()
    );
    say(format!(
        "web: the tag names v2, yet all 6 pods of its one ReplicaSet {old_rs} (3 made after the \
         move) read v1 bytes; no rollout"
    ));
    statefulset_after_move(bed, v1, &db_rev, &db_before).await?;
    job_after_move(bed, v1, &job_before).await?;

    wait_followed(bed, v2, 3).await?;
    every_pod_reads(bed, "follow", v2).await?;
    let events = followed_events(bed).await?;
    let moved = events
        .iter()
        .find(|m| m.contains(&format!("{} -> {}", v1.digest, v2.digest)))
        .cloned();
    ensure!(
        moved.is_some(),
        "no TagFollowed Event on follow naming v1 -> v2: {events:?}"
    );
    say(format!(
        "follow rolled out to v2 ({} ReplicaSets now); every pod reads v2 bytes; Event \
         TagFollowed: {}",
        replica_sets_of(bed, "follow").await?.len(),
        moved.unwrap_or_default()
    ));

    // The tag moves back: follow rolls back, web stays as it is.
    set_tag(bed, v1).await?;
    wait_followed(bed, v1, 3).await?;
    every_pod_reads(bed, "follow", v1).await?;
    let web = every_pod_reads(bed, "web", v1).await?;
    ensure!(
        web.values().all(|(rs, _)| *rs == old_rs) && replica_sets_of(bed, "web").await?.len() == 1,
        "web changed when the tag moved back: {web:?}"
    );
    let db = every_pod_reads(bed, STATEFULSET, v1).await?;
    ensure!(
        db.values().all(|(r, _)| *r == db_rev),
        "{STATEFULSET} changed when the tag moved back: {db:?}"
    );
    say(format!(
        "tag back to v1: follow rolled back, every pod reads v1 bytes; web still its one \
         ReplicaSet, {STATEFULSET} its one revision, v1 ({:.0} s for this step)",
        t.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// After the tag moved to v2, `db-0` was deleted and `db` scaled to 3: every pod of it (the
/// new `db-0` and `db-2` among them) is of the one revision and reads `v1`.
async fn statefulset_after_move(
    bed: &Bed,
    v1: &Version,
    db_rev: &str,
    before: &BTreeMap<String, String>,
) -> Result<()> {
    wait_statefulset(bed, 3).await?;
    let db = every_pod_reads(bed, STATEFULSET, v1).await?;
    let now = uids_of(bed, STATEFULSET).await?;
    let made_after: Vec<&String> = now
        .iter()
        .filter(|(name, uid)| before.get(*name) != Some(*uid))
        .map(|(name, _)| name)
        .collect();
    ensure!(
        db.values().all(|(r, _)| r == db_rev) && made_after.len() == 2,
        "{STATEFULSET}: pods of another revision than {db_rev}, or not 2 made after the move \
         ({made_after:?}): {db:?}"
    );
    say(format!(
        "{STATEFULSET}: the tag names v2, yet its 3 pods of its one revision {db_rev} ({} made \
         after the move: {made_after:?}) read v1 bytes",
        made_after.len()
    ));
    Ok(())
}

/// After the tag moved to v2 and the gate opened: Job `train` completes, and every read of
/// each of its pods, the ones created after the move among them, is of `v1`.
async fn job_after_move(bed: &Bed, v1: &Version, before: &BTreeMap<String, String>) -> Result<()> {
    let jobs = bed.jobs();
    wait_for(
        &format!(
            "Job {JOB} to complete (its pods finish once they see the gate {} open)",
            bed.gate.dir().display()
        ),
        TIMEOUT,
        || async {
            let status = jobs.get(JOB).await?.status.unwrap_or_default();
            let failed = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Failed" && c.status == "True");
            ensure!(!failed, "Job {JOB} failed: {status:?}");
            Ok(status.succeeded == Some(JOB_COMPLETIONS))
        },
    )
    .await?;
    let pods = uids_of(bed, JOB).await?;
    let made_after: Vec<&String> = pods
        .iter()
        .filter(|(name, uid)| before.get(*name) != Some(*uid))
        .map(|(name, _)| name)
        .collect();
    ensure!(
        pods.len() == JOB_COMPLETIONS as usize
            && made_after.len() == (JOB_COMPLETIONS - JOB_PARALLELISM) as usize,
        "Job {JOB}: pods {pods:?}, made after the move {made_after:?}"
    );
    let mut total = 0usize;
    for pod in pods.keys() {
        let all = reads(&log_of(bed, pod).await?);
        let bad: Vec<&Read> = all
            .iter()
            .filter(|r| r.result.as_ref() != Ok(&v1.reads_as))
            .collect();
        ensure!(
            !all.is_empty() && bad.is_empty(),
            "Job {JOB}'s pod {pod} read {} times, not v1 {} of them; first: {:?}",
            all.len(),
            bad.len(),
            bad.first()
        );
        total += all.len();
    }
    say(format!(
        "{JOB}: completed; its {} pods ({} created after the move: {made_after:?}) read v1 bytes \
         {total} times, never anything else",
        pods.len(),
        made_after.len()
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 3. the upgrade under readers

/// The pods of a DaemonSet component: (name, node, image of its first container, IP).
async fn component_pods(
    bed: &Bed,
    component: &str,
) -> Result<Vec<(String, String, String, String)>> {
    let lp = ListParams::default().labels(&format!(
        "app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
    ));
    Ok(bed
        .pods()
        .list(&lp)
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let spec = p.spec.clone().unwrap_or_default();
            (
                p.name_any(),
                spec.node_name.unwrap_or_default(),
                spec.containers
                    .first()
                    .and_then(|c| c.image.clone())
                    .unwrap_or_default(),
                p.status.and_then(|s| s.pod_ip).unwrap_or_default(),
            )
        })
        .collect())
}

/// `sealed_csi_mounts_unprotected` of every plugin pod, by pod.
async fn unprotected(bed: &Bed) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for (name, _, _, ip) in component_pods(bed, "node").await? {
        if ip.is_empty() {
            continue;
        }
        let text = scrape(format!("{ip}:{METRICS_PORT}").parse()?).await?;
        out.insert(name, metric_sum(&text, "sealed_csi_mounts_unprotected"));
    }
    Ok(out)
}

async fn upgrade(bed: &Bed, v1: &Version) -> Result<()> {
    let t = Instant::now();
    let since = epoch_now();
    let readers: Vec<String> = [
        pods_of(bed, "web").await?,
        pods_of(bed, "follow").await?,
        pods_of(bed, STATEFULSET).await?,
    ]
    .concat()
    .into_iter()
    .map(|(p, _)| p)
    .collect();
    let plugins_before = component_pods(bed, "node").await?;
    let holders_before = component_pods(bed, "fd-holder").await?;
    say(format!(
        "{} pods reading v1 once a second; plugin pods {:?}, fd holder pods {:?}",
        readers.len(),
        plugins_before.iter().map(|p| &p.0).collect::<Vec<_>>(),
        holders_before.iter().map(|p| &p.0).collect::<Vec<_>>()
    ));

    // The CRDs as an install older than the chart left them: without spec.warm (the last
    // field the chart's CRDs gained), so that the upgrade has a schema to change.
    downgrade_crd(bed).await?;
    say(format!(
        "CRD {PLURAL_CHANGED}.sealedvolumes.io made older than the chart: its schema lacks \
         {FIELD_CHANGED}; the API server refuses a SealedVolume that sets it (strict field \
         validation)"
    ));

    let sets = values(bed, TAG_AFTER);
    let watch = format!(r#"operator.extraArgs=["--watch-namespace={}"]"#, bed.ns);
    let chart = sealed_e2e::repo_root().join(CHART);
    let chart = chart.to_string_lossy().into_owned();
    bed.helm
        .run(&helm_args(bed, "upgrade", &chart, &sets, &watch))?;
    say(format!(
        "helm upgrade {RELEASE} to this chart, image tag {TAG_AFTER} (the same values otherwise)"
    ));
    // The CRD change applied: the API server accepts an object that uses the field.
    wait_for(
        &format!("a SealedVolume with {FIELD_CHANGED} accepted after helm upgrade"),
        Duration::from_secs(30),
        || async { Ok(try_warm_volume(bed).await?.is_ok()) },
    )
    .await?;
    say(format!(
        "after helm upgrade the API server accepts a SealedVolume with {FIELD_CHANGED} \
         (strict field validation, dry run) and returns it with the field"
    ));

    // CRDs: the release's now, with the keep policy, and the chart's schema.
    let crds = Api::<CustomResourceDefinition>::all(bed.client());
    for plural in ["sealedvolumes", "sealedvolumeversions"] {
        let name = format!("{plural}.sealedvolumes.io");
        let crd = crds.get(&name).await?;
        let a = crd.annotations();
        ensure!(
            a.get("meta.helm.sh/release-name").map(String::as_str) == Some(RELEASE)
                && a.get("meta.helm.sh/release-namespace") == Some(&bed.ns)
                && a.get("helm.sh/resource-policy").map(String::as_str) == Some("keep")
                && crd
                    .labels()
                    .get("app.kubernetes.io/managed-by")
                    .map(String::as_str)
                    == Some("Helm"),
            "after helm upgrade CRD {name} is not the release's with the keep policy: {a:?}"
        );
        let file = sealed_e2e::repo_root()
            .join(CHART)
            .join("files/crds")
            .join(format!("sealedvolumes.io_{plural}.yaml"));
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("{} does not parse", file.display()))?;
        let want = docs
            .iter()
            .find(|d| d["kind"] == "CustomResourceDefinition")
            .with_context(|| format!("{} holds no CRD", file.display()))?;
        let live = serde_json::to_value(&crd)?;
        let live_paths = schema_paths(&live)?;
        ensure!(
            plural != PLURAL_CHANGED || live_paths.contains(&format!("v1alpha1.{FIELD_CHANGED}")),
            "helm upgrade left CRD {name} without {FIELD_CHANGED}"
        );
        ensure!(
            live_paths == schema_paths(want)?,
            "the live schema of {name} is not the chart's"
        );
    }
    for crd in crds_owned(bed).await? {
        say(format!("after the upgrade: {crd}; schema = files/crds"));
    }

    // The node plugin: rolled by the DaemonSet controller, by percentage.
    let ds = bed.daemonsets().get(&format!("{RELEASE}-node")).await?;
    let strategy = ds
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.clone())
        .unwrap_or_default();
    let max_unavailable = strategy
        .rolling_update
        .as_ref()
        .and_then(|r| r.max_unavailable.clone());
    ensure!(
        strategy.type_.as_deref() == Some("RollingUpdate")
            && matches!(&max_unavailable,
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(p)) if p.ends_with('%')),
        "the node DaemonSet does not roll by a percentage: {strategy:?}"
    );
    let want_image = format!(":{TAG_AFTER}");
    wait_for(
        "the node plugin rolled to the new image",
        TIMEOUT,
        || async {
            let pods = component_pods(bed, "node").await?;
            Ok(!pods.is_empty()
                && pods.iter().all(|p| p.2.ends_with(&want_image))
                && daemonset_ready(bed, "node").await?)
        },
    )
    .await?;
    let plugins_after = component_pods(bed, "node").await?;
    ensure!(
        plugins_after
            .iter()
            .all(|p| !plugins_before.iter().any(|b| b.0 == p.0)),
        "the plugin pods were not replaced: {plugins_after:?}"
    );
    say(format!(
        "node DaemonSet rolled (RollingUpdate, maxUnavailable {max_unavailable:?}): {:?} -> {:?}, \
         {:.0} s after the upgrade",
        plugins_before.iter().map(|p| &p.0).collect::<Vec<_>>(),
        plugins_after.iter().map(|p| &p.0).collect::<Vec<_>>(),
        t.elapsed().as_secs_f64()
    ));
    wait_release_ready(bed).await?;

    // The fd holder: OnDelete, so still the old pods; then docs/helm.md's procedure.
    let holders = component_pods(bed, "fd-holder").await?;
    ensure!(
        holders.iter().map(|h| &h.0).collect::<Vec<_>>()
            == holders_before.iter().map(|h| &h.0).collect::<Vec<_>>()
            && holders
                .iter()
                .all(|h| h.2.ends_with(&format!(":{TAG_BEFORE}"))),
        "helm upgrade replaced the fd holder (updateStrategy OnDelete): {holders_before:?} -> \
         {holders:?}"
    );
    say(format!(
        "fd holder after helm upgrade: still {:?} (OnDelete); now docs/helm.md's procedure",
        holders.iter().map(|h| (&h.0, &h.2)).collect::<Vec<_>>()
    ));
    for (holder, node, _, _) in &holders {
        // 1-2: the plugin on that node ready first, never both down.
        wait_for("the plugin ready before the holder goes", TIMEOUT, || {
            daemonset_ready(bed, "node")
        })
        .await?;
        bed.pods()
            .delete(holder, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting fd holder pod {holder}"))?;
        wait_for(&format!("a new fd holder on {node}"), TIMEOUT, || async {
            let pods = component_pods(bed, "fd-holder").await?;
            Ok(pods.iter().any(|p| p.1 == *node && p.0 != *holder)
                && daemonset_ready(bed, "fd-holder").await?)
        })
        .await?;
        // The plugin puts its fds back within 10 s: sealed_csi_mounts_unprotected at 0.
        let last = std::sync::Mutex::new(BTreeMap::new());
        let t_holder = Instant::now();
        let back = wait_for(
            "the plugin's mounts held again (sealed_csi_mounts_unprotected 0)",
            Duration::from_secs(40),
            || async {
                // The gauge is computed every 10 s: wait one period before trusting a 0.
                let now = unprotected(bed).await?;
                let held = t_holder.elapsed() > Duration::from_secs(11)
                    && !now.is_empty()
                    && now.values().all(|v| *v == 0.0);
                *last.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = now;
                Ok(held)
            },
        )
        .await;
        let last = last.into_inner().unwrap_or_default();
        if let Err(e) = back {
            bail!("{e:#}: {last:?}");
        }
        say(format!(
            "fd holder {holder} on {node} replaced; the plugin's mounts are held again ({last:?})"
        ));
    }
    let holders = component_pods(bed, "fd-holder").await?;
    let ds = bed
        .daemonsets()
        .get(&format!("{RELEASE}-fd-holder"))
        .await?;
    let status = ds.status.unwrap_or_default();
    ensure!(
        holders.iter().all(|h| h.2.ends_with(&want_image))
            && status.updated_number_scheduled == Some(status.desired_number_scheduled),
        "the fd holder is not upgraded: {holders:?}, UP-TO-DATE {:?} of {}",
        status.updated_number_scheduled,
        status.desired_number_scheduled
    );
    say(format!(
        "fd holder upgraded: {:?}, UP-TO-DATE {} of {}",
        holders.iter().map(|h| (&h.0, &h.2)).collect::<Vec<_>>(),
        status.updated_number_scheduled.unwrap_or(0),
        status.desired_number_scheduled
    ));

    // No failed read, and every reader reads on after it all.
    let done = epoch_now();
    let mut total = 0usize;
    let mut longest_gap = 0u64;
    for pod in &readers {
        let deadline = Instant::now() + Duration::from_secs(30);
        let all = loop {
            let all: Vec<Read> = reads(&log_of(bed, pod).await?)
                .into_iter()
                .filter(|r| r.at >= since)
                .collect();
            if all.iter().any(|r| r.at > done) {
                break all;
            }
            ensure!(
                Instant::now() < deadline,
                "pod {pod} has not read since the upgrade ended (last: {:?})",
                all.last()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let bad: Vec<&Read> = all
            .iter()
            .filter(|r| r.result.as_ref() != Ok(&v1.reads_as))
            .collect();
        ensure!(
            bad.is_empty(),
            "pod {pod}: {} of {} reads during the upgrade failed or read other bytes than v1; \
             first: {:?}",
            bad.len(),
            all.len(),
            bad.first()
        );
        for w in all.windows(2) {
            longest_gap = longest_gap.max(w[1].at.saturating_sub(w[0].at));
        }
        total += all.len();
    }
    let resumed = plugin_log_contains(bed, "resumed=true").await?;
    ensure!(
        resumed,
        "the new plugin did not log resuming the mounts (\"resumed=true\")"
    );
    say(format!(
        "no failed read: {} pods read v1 {total} times from the upgrade to {}s after it, none \
         failed, longest pause between two reads of a pod {longest_gap} s; the new plugin \
         resumed the mounts from the fd holder; upgrade step {:.0} s",
        readers.len(),
        epoch_now().saturating_sub(done),
        t.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// The CRD whose live schema the test makes older before `helm upgrade`, and the field it
/// removes (the last one the chart's CRDs gained, `spec.warm`, issue 15).
const PLURAL_CHANGED: &str = "sealedvolumes";
const FIELD_CHANGED: &str = "spec.warm";

/// A server-side dry-run apply, with strict field validation, of a SealedVolume that sets
/// `spec.warm`: `Ok(())` when the API server accepts it and returns the field, `Err(refusal)`
/// when it refuses it as unknown.
async fn try_warm_volume(bed: &Bed) -> Result<Result<(), String>> {
    let obj = serde_json::json!({
        "apiVersion": "sealedvolumes.io/v1alpha1",
        "kind": "SealedVolume",
        "metadata": { "name": "crd-upgrade-check" },
        "spec": { "source": { "upload": {} }, "warm": { "nodes": 1 } },
    });
    let params = PatchParams::apply("sealed-e2e-rollout")
        .dry_run()
        .validation_strict();
    match bed
        .volumes()
        .patch("crd-upgrade-check", &params, &Patch::Apply(&obj))
        .await
    {
        Ok(v) => {
            ensure!(
                v.spec.warm.as_ref().map(|w| w.nodes) == Some(1),
                "the API server accepted the SealedVolume but dropped {FIELD_CHANGED}: {:?}",
                v.spec
            );
            Ok(Ok(()))
        }
        Err(kube::Error::Api(e)) if e.message.contains("warm") => Ok(Err(e.message)),
        Err(e) => Err(e.into()),
    }
}

/// Removes `spec.warm` from every version's schema of the live `sealedvolumes` CRD (owned by
/// no release, as the previous chart's `crds/` leaves it) and waits until the API server
/// refuses an object that sets it. `cleanup` puts the field back if `helm upgrade` did not.
async fn downgrade_crd(bed: &Bed) -> Result<()> {
    let crds = Api::<CustomResourceDefinition>::all(bed.client());
    let name = format!("{PLURAL_CHANGED}.sealedvolumes.io");
    let mut crd = serde_json::to_value(crds.get(&name).await?)?;
    let versions = crd["spec"]["versions"]
        .as_array_mut()
        .context("a CRD without spec.versions")?;
    for v in versions {
        let removed = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            .as_object_mut()
            .and_then(|p| p.remove("warm"));
        ensure!(
            removed.is_some(),
            "the live CRD {name} has no {FIELD_CHANGED} to remove"
        );
    }
    let crd: CustomResourceDefinition = serde_json::from_value(crd)?;
    crds.replace(&name, &PostParams::default(), &crd)
        .await
        .with_context(|| format!("replacing CRD {name} with an older schema"))?;
    let refusal = std::sync::Mutex::new(String::new());
    wait_for(
        &format!("the API server to refuse {FIELD_CHANGED}"),
        Duration::from_secs(30),
        || async {
            let r = try_warm_volume(bed).await?;
            if let Err(msg) = &r {
                *refusal.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = msg.clone();
            }
            Ok(r.is_err())
        },
    )
    .await?;
    say(format!(
        "before helm upgrade: {}",
        refusal.into_inner().unwrap_or_default()
    ));
    let live = serde_json::to_value(crds.get(&name).await?)?;
    ensure!(
        !schema_paths(&live)?.contains(&format!("v1alpha1.{FIELD_CHANGED}")),
        "CRD {name} still has {FIELD_CHANGED}"
    );
    Ok(())
}

/// Every property path of each version's schema of a CRD (`v1alpha1.spec.warm.nodes`, ...).
fn schema_paths(crd: &serde_json::Value) -> Result<BTreeSet<String>> {
    fn walk(schema: &serde_json::Value, prefix: &str, out: &mut BTreeSet<String>) {
        if let Some(props) = schema.get("properties").and_then(|p| p.as_object()) {
            for (name, sub) in props {
                let path = format!("{prefix}.{name}");
                out.insert(path.clone());
                walk(sub, &path, out);
            }
        }
        if let Some(items) = schema.get("items") {
            walk(items, &format!("{prefix}[]"), out);
        }
    }
    let mut out = BTreeSet::new();
    for v in crd["spec"]["versions"]
        .as_array()
        .context("a CRD without spec.versions")?
    {
        let name = v["name"].as_str().unwrap_or("?");
        walk(&v["schema"]["openAPIV3Schema"], name, &mut out);
    }
    Ok(out)
}

async fn plugin_log_contains(bed: &Bed, needle: &str) -> Result<bool> {
    for (pod, _, _, _) in component_pods(bed, "node").await? {
        let lp = LogParams {
            container: Some("plugin".into()),
            ..Default::default()
        };
        if bed.pods().logs(&pod, &lp).await?.contains(needle) {
            return Ok(true);
        }
    }
    Ok(false)
}

// ---------------------------------------------------------------------------------------
// Diagnostics and cleanup

async fn dump_state(bed: &Bed) {
    say("===== state at failure");
    if let Ok(list) = bed.pods().list(&ListParams::default()).await {
        for p in list.items {
            let phase = p.status.as_ref().and_then(|s| s.phase.clone());
            say(format!("pod {}: {phase:?}", p.name_any()));
            let lp = LogParams {
                tail_lines: Some(15),
                container: p
                    .spec
                    .as_ref()
                    .and_then(|s| s.containers.first())
                    .map(|c| c.name.clone()),
                ..Default::default()
            };
            if let Ok(log) = bed.pods().logs(&p.name_any(), &lp).await {
                say(format!("log of {}:\n{log}", p.name_any()));
            }
        }
    }
}

async fn cleanup(bed: &Bed) {
    say("cleanup");
    // A failure between downgrade_crd and helm upgrade leaves the CRD without spec.warm:
    // give the shared cluster its CRDs back.
    let crds = Api::<CustomResourceDefinition>::all(bed.client());
    let name = format!("{PLURAL_CHANGED}.sealedvolumes.io");
    let current = match crds.get(&name).await.map(serde_json::to_value) {
        Ok(Ok(v)) => schema_paths(&v)
            .map(|p| p.contains(&format!("v1alpha1.{FIELD_CHANGED}")))
            .unwrap_or(false),
        _ => false,
    };
    if !current && let Err(e) = sealed_e2e::install_crds(&bed.client(), "sealed-e2e-rollout").await
    {
        say(format!("cleanup: putting the CRDs back: {e:#}"));
    }
    for name in ["web", "follow"] {
        let _ = bed
            .deployments()
            .delete(name, &DeleteParams::background())
            .await;
    }
    let _ = bed
        .statefulsets()
        .delete(STATEFULSET, &DeleteParams::background())
        .await;
    let _ = bed.jobs().delete(JOB, &DeleteParams::background()).await;
    let pods = bed.pods();
    let readers = ListParams::default().labels(&format!("app in ({})", APPS.join(", ")));
    if wait_for("the readers to go", Duration::from_secs(60), || async {
        Ok(pods.list(&readers).await?.items.is_empty())
    })
    .await
    .is_err()
    {
        say("cleanup: reader pods still there after 60 s");
    }
    let _ = bed.volumes().delete(VOLUME, &DeleteParams::default()).await;
    let versions = bed.versions();
    if wait_for("the versions to go", Duration::from_secs(30), || async {
        Ok(versions
            .list(&ListParams::default())
            .await?
            .items
            .is_empty())
    })
    .await
    .is_err()
        && let Ok(list) = versions.list(&ListParams::default()).await
    {
        for v in list.items {
            let patch = serde_json::json!({ "metadata": { "finalizers": null } });
            let _ = versions
                .patch(
                    &v.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await;
        }
    }
    if let Err(e) = bed
        .helm
        .run(&["uninstall", RELEASE, "-n", &bed.ns, "--wait"])
    {
        say(format!("cleanup: {e:#}"));
    }
    if let Err(e) = bed.cluster.delete_namespace(&bed.ns).await {
        say(format!("cleanup: {e:#}"));
    }
    remove_images(
        &[TAG_BEFORE, TAG_AFTER]
            .iter()
            .flat_map(|t| {
                [
                    format!("sealed.local/sealed-operator:{t}"),
                    format!("sealed.local/sealed-csi:{t}"),
                ]
            })
            .collect::<Vec<_>>(),
    );
}
