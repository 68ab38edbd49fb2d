//! The end-to-end journey (issue 7) on the real local cluster (`hack/cluster.sh`), with the
//! Helm chart installed as a user would, images built without Docker and a real S3 server
//! (moto) the pods reach on the node's IP. One test, in order; every step says on stderr
//! what it did and what it checked:
//!
//! 1. images built (`hack/images.sh sealed`, plus the `tree-b3` reader) and pushed with crane
//!    to a private registry on loopback (`crane registry serve` behind the Basic-auth proxy
//!    `hack/registry-auth.py` on 127.0.0.1:15000, which `hack/cluster.sh` gives containerd a
//!    plain-http hosts.toml for), the current CRDs applied server-side (other tests apply
//!    them too; the install takes them over), the chart installed into a fresh namespace
//!    with `helm install` and documented values only (each component's `image.repository` +
//!    `image.digest`, `imagePullSecrets`
//!    with the registry's credentials, the sync Jobs' service account; store: a moto
//!    bucket), operator Deployment and node DaemonSet ready, the driver registered with
//!    kubelet; every container's `imageID` is `127.0.0.1:15000/<image>@<pushed digest>` and
//!    the proxy logged authenticated manifest pulls of both images; a pod of the same image
//!    without the secret gets ErrImagePull/ImagePullBackOff and the proxy's 401;
//! 2. a small model tree in a second bucket, a SealedVolume with an `objectStore` source: the
//!    operator runs a sync Job and a Ready SealedVolumeVersion appears whose digest equals
//!    `sealed_store::push` of the same local tree into a scratch memory store, and the Job's
//!    pod Succeeded under the chart's sync ServiceAccount with its pull secret (its image
//!    pulled from the registry with it) and no API token;
//! 3. a pod mounting the version inline by digest: the BLAKE3 of every file it reads equals
//!    that file's whole-content BLAKE3 in the manifest (read from the store);
//! 4. tags: `prod` → v1, a pod by `volume` + `tag` and one pinned to v1; the source changes
//!    and a resync (annotation) seals v2; `prod` → v2: a new pod by tag reads v2, the pinned
//!    pod (and the tag pod started earlier) still read v1; the webhook admitted the new tag
//!    pod with v2's digest (and `fromTag`);
//!    after the tag moves of steps 4 and 5 there were exactly 2 sync Jobs (tags start none);
//! 5. rollback: `prod` back to v1 and a pod by tag reads v1; a pod by v1's digest reads v1;
//! 6. deleting v1's SealedVolumeVersion moves its manifest to the store's trash and a pod
//!    by v1's digest is refused; restoring it (`sealed_store::trash::restore_version`, what
//!    `sealed restore` does) makes the operator re-import the version, and a pod reads v1;
//! 7. labelling the node `nvidia.com/gpu.product=NVIDIA-L4` takes the node plugin away
//!    (desiredNumberScheduled 0); removing the label brings it back;
//! 8. `helm upgrade` rolls the node plugin while a pod reads: the new plugin gets ready, the
//!    running pod's reads all return correct bytes (none fails) because the fd holder kept
//!    the FUSE fd and the new plugin resumed the mount, and a new pod reads correct bytes.
//!    The chart's defaults put the peer tier and mutual TLS on (step 1 checks the plugin
//!    serves peers over TLS with the fleet token and certificate the operator made); the
//!    upgrade, and a `helm template` render of the release's values, leave the token, the CA
//!    and the certificate as they were (the render holds none of them).
//!
//! Cleanup runs whatever happens (the steps run in a spawned task, so a panic is caught):
//! pods and versions go while the plugin and operator still run, then `helm uninstall`,
//! the node's GPU label, the CSIDriver, the namespaces, moto and the registry.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`; needs root, moto_server, helm
//! (`hack/build-k8s.sh`), crane on PATH (`hack/build-test-tools.sh`), python3 and the
//! workspace's binaries (`cargo build` / `cargo test` builds them).

use std::collections::BTreeMap;
use std::fmt::Display;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Namespace, Node, Pod, Secret, ServiceAccount};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use object_store::aws::AmazonS3Builder;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, PutPayload};
use sealed_crds::{SealedVolume, SealedVolumeVersion, SealedVolumeVersionSpec};
use sealed_e2e::wait_for;

#[path = "journey/hostile.rs"]
mod hostile;
#[path = "journey/registry.rs"]
mod registry;
use sealed_e2e::{Cluster, pseudo_random};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, EntryKind, NoProgress};

/// The sync Jobs' own ServiceAccount and pull Secret in the release namespace (step 1).
const SYNC_SERVICE_ACCOUNT: &str = "journey-sync";
const PULL_SECRET: &str = "journey-registry";
const RELEASE: &str = "journey";
const DRIVER: &str = "csi.sealedvolumes.io";
const GPU_LABEL: &str = "nvidia.com/gpu.product";
const READER_IMAGE: &str = "sealed.local/tree-b3:journey";
/// Namespaces this suite creates carry this label (`journey` for pods and volumes,
/// `journey-release` for the chart), so a later run can clean up after a run that was killed.
const NS_LABEL: &str = "sealedvolumes.io/e2e";
const STORE_BUCKET: &str = "journey-store";
const STORE_PREFIX: &str = "sealed";
const SOURCE_BUCKET: &str = "journey-source";
const SOURCE_PREFIX: &str = "models/tiny";
const VOLUME: &str = "tiny";
/// The node's address as pods see it (hack/cluster.sh's bridge).
const HOST_IP: &str = "10.244.0.1";
const REGION: &str = "us-east-1";

// ---------------------------------------------------------------------------------------
// Logging

fn started() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// One line on stderr (the handle, so it shows without --nocapture), with the time.
fn say(msg: impl Display) {
    let _ = writeln!(
        std::io::stderr(),
        "[journey {:>6.1}s] {msg}",
        started().elapsed().as_secs_f64()
    );
}

fn step(n: u32, title: &str) {
    say(format!("===== step {n}: {title}"));
}

// ---------------------------------------------------------------------------------------
// Tools and servers

/// A binary cargo built for another crate of the workspace: next to this test's own
/// directory (`$CARGO_TARGET_DIR/debug/deps/journey-…` → `$CARGO_TARGET_DIR/debug/NAME`).
fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the test binary's path")?;
    let debug = exe
        .parent()
        .and_then(Path::parent)
        .context("the test binary has no grandparent directory")?;
    let path = debug.join(name);
    ensure!(
        path.is_file(),
        "{} does not exist: build it with `cargo build -p {name}` (cargo test --workspace builds \
         it too)",
        path.display()
    );
    Ok(path)
}

/// helm and kubectl: the pinned builds of `hack/build-k8s.sh` (or `SEALED_HELM`).
struct Tools {
    helm: PathBuf,
    kubeconfig: PathBuf,
}

impl Tools {
    fn find(kubeconfig: &Path) -> Result<Tools> {
        let helm = match std::env::var_os("SEALED_HELM") {
            Some(p) => PathBuf::from(p),
            None => {
                let script = sealed_e2e::repo_root().join("hack/build-k8s.sh");
                let out = Command::new(&script)
                    .arg("--print-bin-dir")
                    .stderr(Stdio::inherit())
                    .output()
                    .with_context(|| format!("cannot run {}", script.display()))?;
                ensure!(
                    out.status.success(),
                    "{} --print-bin-dir failed",
                    script.display()
                );
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("helm")
            }
        };
        ensure!(
            helm.is_file(),
            "no helm at {} (hack/build-k8s.sh builds it; or set SEALED_HELM)",
            helm.display()
        );
        Ok(Tools {
            helm,
            kubeconfig: kubeconfig.to_path_buf(),
        })
    }

    fn helm(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(&self.helm)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .current_dir(sealed_e2e::repo_root())
            .output()
            .context("cannot run helm")?;
        if !out.status.success() {
            bail!(
                "helm {} failed ({}):\n{}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// moto's S3 server on every address (pods reach it on the node's IP), with the store and
/// source buckets; killed when dropped.
struct Moto {
    child: Child,
    port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Moto {
    fn start() -> Result<Moto> {
        let port = sealed_test_support::servers::free_port();
        let child = Command::new("moto_server")
            .args(["-H", "0.0.0.0", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context(
                "cannot start moto_server (hack/install-test-deps.sh installs it; or pip install \
                 'moto[server]')",
            )?;
        let mut moto = Moto { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = moto.child.try_wait() {
                bail!("moto_server exited early: {status}");
            }
            ensure!(
                Instant::now() < deadline,
                "moto_server did not listen on {port} within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        for bucket in [STORE_BUCKET, SOURCE_BUCKET] {
            let status = Command::new("curl")
                .args(["-sf", "-X", "PUT"])
                .arg(format!("http://127.0.0.1:{port}/{bucket}"))
                .stdout(Stdio::null())
                .status()
                .context("cannot run curl")?;
            ensure!(status.success(), "creating bucket {bucket} on moto failed");
        }
        // The same server must answer on the node's IP, where pods send their requests.
        ensure!(
            std::net::TcpStream::connect((HOST_IP, port)).is_ok(),
            "moto listens on 0.0.0.0:{port} but {HOST_IP}:{port} does not answer"
        );
        Ok(moto)
    }

    /// The endpoint as pods see it.
    fn pod_endpoint(&self) -> String {
        format!("http://{HOST_IP}:{}", self.port)
    }

    /// A bucket (under `prefix`) as this process sees it.
    fn bucket(&self, bucket: &str, prefix: &str) -> Result<Arc<dyn ObjectStore>> {
        let s3 = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_endpoint(format!("http://127.0.0.1:{}", self.port))
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region(REGION)
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .build()?;
        Ok(Arc::new(PrefixStore::new(s3, prefix)))
    }

    /// The sealed store the chart's operator and plugin use, opened from this process.
    fn store(&self) -> Result<ChunkStore> {
        Ok(ChunkStore::from_object_store(
            self.bucket(STORE_BUCKET, STORE_PREFIX)?,
            format!("s3://{STORE_BUCKET}/{STORE_PREFIX}"),
        ))
    }
}

// ---------------------------------------------------------------------------------------
// The model tree

/// v1 of the model: a few files, one of 6 MiB (several chunks), nested directories.
fn model_v1() -> BTreeMap<&'static str, Vec<u8>> {
    BTreeMap::from([
        (
            "config.json",
            br#"{"architectures": ["TinyForCausalLM"], "hidden_size": 64, "step": 1000}"#.to_vec(),
        ),
        (
            "README.md",
            b"# tiny\nA model small enough for a test.\n".to_vec(),
        ),
        ("tokenizer/tokenizer.json", pseudo_random(150 * 1024, 2)),
        (
            "weights/model-00001-of-00001.bin",
            pseudo_random(6 << 20, 3),
        ),
        (
            "weights/adapters/lora/adapter.bin",
            pseudo_random(300 * 1024, 4),
        ),
    ])
}

/// v2: one file changed.
fn model_v2() -> BTreeMap<&'static str, Vec<u8>> {
    let mut files = model_v1();
    files.insert(
        "config.json",
        br#"{"architectures": ["TinyForCausalLM"], "hidden_size": 64, "step": 2000}"#.to_vec(),
    );
    files
}

fn write_tree(dir: &Path, files: &BTreeMap<&str, Vec<u8>>) -> Result<()> {
    for (path, bytes) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().context("no parent")?)?;
        std::fs::write(&path, bytes)?;
    }
    Ok(())
}

/// The digest `sealed push` gives the tree: pushed into a scratch memory store.
async fn push_digest(files: &BTreeMap<&str, Vec<u8>>) -> Result<Digest> {
    let dir = tempfile::tempdir()?;
    write_tree(dir.path(), files)?;
    let report = push(
        &ChunkStore::memory(),
        dir.path(),
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await?;
    Ok(report.digest)
}

async fn upload_tree(bucket: &dyn ObjectStore, files: &BTreeMap<&str, Vec<u8>>) -> Result<()> {
    for (path, bytes) in files {
        bucket
            .put(
                &object_store::path::Path::from(*path),
                PutPayload::from(bytes.clone()),
            )
            .await
            .with_context(|| format!("uploading {path} to the source bucket"))?;
    }
    Ok(())
}

/// What `tree-b3 /model` prints for a version: `<blake3>  <path>` per file, from the
/// manifest in the store (each file's whole-content BLAKE3), sorted by path.
async fn expected_sums(store: &ChunkStore, digest: &Digest) -> Result<Vec<String>> {
    let manifest = store
        .get_manifest(digest)
        .await
        .with_context(|| format!("reading the manifest of {digest} from the store"))?;
    let mut lines: Vec<(String, String)> = manifest
        .entries
        .iter()
        .filter_map(|e| match &e.kind {
            EntryKind::File(f) => Some((e.path.clone(), format!("{}  {}", f.blake3.hex(), e.path))),
            _ => None,
        })
        .collect();
    lines.sort();
    Ok(lines.into_iter().map(|(_, l)| l).collect())
}

/// What `tree-b3 --sleep` prints after `read N ok`: the BLAKE3 of its sums text.
fn sums_total(lines: &[String]) -> String {
    let mut text = String::new();
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

// ---------------------------------------------------------------------------------------
// Kubernetes helpers

async fn labelled_namespace(client: &Client, prefix: &str, role: &str) -> Result<String> {
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": { "generateName": format!("{prefix}-"), "labels": { NS_LABEL: role } }
    }))?;
    let name = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?
        .metadata
        .name
        .context("a namespace without a name")?;
    sealed_e2e::wait_for_default_service_account(client, &name).await?;
    Ok(name)
}

async fn csinode_has_driver(client: &Client, node: &str) -> Result<bool> {
    Ok(Api::<CSINode>::all(client.clone())
        .get_opt(node)
        .await?
        .is_some_and(|c| c.spec.drivers.iter().any(|d| d.name == DRIVER)))
}

async fn set_gpu_label(client: &Client, node: &str, value: Option<&str>) -> Result<()> {
    let patch = serde_json::json!({ "metadata": { "labels": { GPU_LABEL: value } } });
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("cannot change label {GPU_LABEL} of node {node}"))?;
    Ok(())
}

async fn gpu_label(client: &Client, node: &str) -> Result<Option<String>> {
    Ok(Api::<Node>::all(client.clone())
        .get(node)
        .await?
        .labels()
        .get(GPU_LABEL)
        .cloned())
}

/// A pod running the reader image on the volume `attributes` (digest, or volume + tag).
/// With `sleep` it keeps reading once a second after printing the sums.
fn reader_pod(name: &str, node: &str, attributes: serde_json::Value, sleep: bool) -> Result<Pod> {
    let mut args = vec!["/model"];
    if sleep {
        args.push("--sleep");
    }
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": READER_IMAGE,
                "imagePullPolicy": "Never",
                "args": args,
                "volumeMounts": [{ "name": "model", "mountPath": "/model", "readOnly": true }],
            }],
            "volumes": [{
                "name": "model",
                "csi": { "driver": DRIVER, "readOnly": true, "volumeAttributes": attributes },
            }],
        }
    }))?)
}

fn by_digest(digest: &Digest) -> serde_json::Value {
    serde_json::json!({ "digest": digest.to_string() })
}

fn by_tag(tag: &str) -> serde_json::Value {
    serde_json::json!({ "volume": VOLUME, "tag": tag })
}

/// The sums a reader pod printed (the lines before `TREE-B3-DONE`).
fn sums_in(log: &str) -> Option<Vec<String>> {
    let (sums, _) = log.split_once("TREE-B3-DONE")?;
    Some(sums.lines().map(str::to_string).collect())
}

/// Everything one run of the journey needs.
struct Journey {
    cluster: Cluster,
    tools: Tools,
    moto: Moto,
    /// The private registry the chart's images are pulled from (step 1).
    registry: registry::Registry,
    store: ChunkStore,
    node: String,
    /// The chart's release namespace.
    release_ns: String,
    /// The namespace of the SealedVolume and the pods.
    ns: String,
    /// A hostile tenant's namespace (step 9).
    attacker_ns: String,
}

impl Journey {
    fn client(&self) -> Client {
        self.cluster.client.clone()
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client(), &self.ns)
    }

    fn volumes(&self) -> Api<SealedVolume> {
        Api::namespaced(self.client(), &self.ns)
    }

    fn versions(&self) -> Api<SealedVolumeVersion> {
        Api::namespaced(self.client(), &self.ns)
    }

    fn daemonsets(&self) -> Api<DaemonSet> {
        Api::namespaced(self.client(), &self.release_ns)
    }

    async fn log_of(&self, pod: &str) -> String {
        self.pods()
            .logs(pod, &LogParams::default())
            .await
            .unwrap_or_default()
    }

    /// Why a pod is not running yet: its events.
    async fn events_of(&self, pod: &str) -> Vec<String> {
        Api::<Event>::namespaced(self.client(), &self.ns)
            .list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
            .await
            .map(|l| {
                l.items
                    .iter()
                    .map(|e| {
                        format!(
                            "{} {}: {}",
                            e.type_.as_deref().unwrap_or(""),
                            e.reason.as_deref().unwrap_or(""),
                            e.message.as_deref().unwrap_or("")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Starts a reader pod and waits until it printed its sums; returns them.
    async fn start_reader(
        &self,
        name: &str,
        attributes: serde_json::Value,
        sleep: bool,
    ) -> Result<Vec<String>> {
        let pods = self.pods();
        let t = Instant::now();
        pods.create(
            &PostParams::default(),
            &reader_pod(name, &self.node, attributes, sleep)?,
        )
        .await
        .with_context(|| format!("creating pod {name}"))?;
        let waited = wait_for(
            &format!("pod {name} to print its sums"),
            Duration::from_secs(90),
            || async {
                let pod = pods.get(name).await?;
                let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
                let log = self.log_of(name).await;
                if log.contains("TREE-B3-DONE") {
                    return Ok(true);
                }
                if matches!(phase.as_deref(), Some("Failed" | "Succeeded")) {
                    bail!("pod {name} ended ({phase:?}) without its sums; log:\n{log}");
                }
                Ok(false)
            },
        )
        .await;
        if let Err(e) = waited {
            bail!("{e:#}; events: {:#?}", self.events_of(name).await);
        }
        let log = self.log_of(name).await;
        say(format!(
            "pod {name} read every file {:.1} s after it was created",
            t.elapsed().as_secs_f64()
        ));
        sums_in(&log).context("no sums in the log")
    }

    /// A one-shot reader pod: its sums, then the pod is deleted.
    async fn read_once(&self, name: &str, attributes: serde_json::Value) -> Result<Vec<String>> {
        let sums = self.start_reader(name, attributes, false).await;
        self.delete_pod(name).await?;
        sums
    }

    async fn delete_pod(&self, name: &str) -> Result<()> {
        let pods = self.pods();
        let _ = pods.delete(name, &DeleteParams::default()).await;
        wait_for(
            &format!("pod {name} to go"),
            Duration::from_secs(90),
            || async { Ok(pods.get_opt(name).await?.is_none()) },
        )
        .await
    }

    /// The `read N ok TOTAL` / `read N failed: …` lines of a sleeping reader.
    async fn reads_of(&self, pod: &str) -> Vec<String> {
        self.log_of(pod)
            .await
            .lines()
            .filter(|l| l.starts_with("read "))
            .map(str::to_string)
            .collect()
    }

    /// Waits for the reader's next read after now and returns it.
    async fn next_read(&self, pod: &str) -> Result<String> {
        let before = self.reads_of(pod).await.len();
        let line = std::sync::Mutex::new(String::new());
        wait_for(
            &format!("pod {pod} to read again"),
            Duration::from_secs(30),
            || async {
                let reads = self.reads_of(pod).await;
                if reads.len() > before {
                    *line.lock().unwrap() = reads.last().cloned().unwrap_or_default();
                    return Ok(true);
                }
                Ok(false)
            },
        )
        .await?;
        Ok(line.into_inner().unwrap())
    }

    async fn set_tag(&self, tag: &str, digest: &Digest) -> Result<()> {
        let patch = serde_json::json!({ "spec": { "tags": { tag: digest.to_string() } } });
        self.volumes()
            .patch(VOLUME, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("cannot set tag {tag}"))?;
        say(format!("tag {tag} -> {digest}"));
        Ok(())
    }

    /// Waits until a Ready SealedVolumeVersion with `digest` exists.
    async fn wait_for_version(
        &self,
        digest: &Digest,
        timeout: Duration,
    ) -> Result<SealedVolumeVersion> {
        let want = digest.to_string();
        let deadline = Instant::now() + timeout;
        loop {
            let versions = self.versions().list(&ListParams::default()).await?.items;
            if let Some(v) = versions.iter().find(|v| v.spec.digest == want) {
                let ready = v
                    .status
                    .as_ref()
                    .and_then(|s| s.condition(sealed_crds::CONDITION_READY))
                    .is_some_and(|c| c.status == "True");
                if ready {
                    return Ok(v.clone());
                }
            }
            if Instant::now() > deadline {
                let volume = self.volumes().get_opt(VOLUME).await?;
                bail!(
                    "no Ready SealedVolumeVersion with {want} in {} within {timeout:?}; versions: \
                     {:?}; volume status: {:#?}",
                    self.ns,
                    versions
                        .iter()
                        .map(|v| (v.name_any(), v.spec.digest.clone(), v.status.clone()))
                        .collect::<Vec<_>>(),
                    volume.and_then(|v| v.status)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The sync Jobs of the operator in the release namespace.
    async fn sync_jobs(&self) -> Result<Vec<Job>> {
        Ok(Api::<Job>::namespaced(self.client(), &self.release_ns)
            .list(&ListParams::default().labels("app.kubernetes.io/managed-by=sealed-operator"))
            .await?
            .items)
    }

    /// Waits until the volume's sync asked for by the resync annotation value `resync`
    /// finished with `digest`, and checks it ran as a Job that succeeded. Returns the Job's
    /// name. The sync's trigger (`status.sync.trigger`) ends in `,resync=VALUE`; what comes
    /// before (`generation=N` or a hash of the source) is the operator's business.
    async fn wait_for_sync(&self, resync: &str, digest: &Digest) -> Result<String> {
        let suffix = format!(",resync={resync}");
        let want = digest.to_string();
        let last = std::sync::Mutex::new(None);
        let waited = wait_for(
            &format!("the sync for resync={resync:?} to finish"),
            Duration::from_secs(180),
            || async {
                let sync = self
                    .volumes()
                    .get(VOLUME)
                    .await?
                    .status
                    .and_then(|s| s.sync);
                let done = sync.as_ref().is_some_and(|s| {
                    s.trigger.as_deref().is_some_and(|t| t.ends_with(&suffix))
                        && s.finished_at.is_some()
                });
                *last.lock().unwrap() = sync;
                Ok(done)
            },
        )
        .await;
        if let Err(e) = waited {
            bail!("{e:#}; last sync status: {:#?}", last.lock().unwrap());
        }
        let sync = last.into_inner().unwrap().context("no sync status")?;
        ensure!(
            sync.digest.as_deref() == Some(want.as_str()),
            "the sync for resync={resync:?} sealed {:?}, want {want} (progress: {:?})",
            sync.digest,
            sync.progress
        );
        let job = sync
            .job
            .context("the sync status names no Job (operator.syncExecutor=job)")?;
        let status = Api::<Job>::namespaced(self.client(), &self.release_ns)
            .get(&job)
            .await
            .with_context(|| format!("the sync's Job {job}"))?
            .status;
        ensure!(
            status.as_ref().and_then(|s| s.succeeded).unwrap_or(0) >= 1,
            "Job {job} did not succeed: {status:?}"
        );
        Ok(job)
    }

    /// The node plugin's pods (by the DaemonSet's selector labels).
    async fn plugin_pods(&self) -> Result<Vec<Pod>> {
        Ok(Api::<Pod>::namespaced(self.client(), &self.release_ns)
            .list(&ListParams::default().labels(&format!(
                "app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=node"
            )))
            .await?
            .items)
    }

    /// Whether the log of a current node plugin pod contains `needle`.
    async fn plugin_log_contains(&self, needle: &str) -> Result<bool> {
        let pods = Api::<Pod>::namespaced(self.client(), &self.release_ns);
        for pod in self.plugin_pods().await? {
            let params = LogParams {
                container: Some("plugin".into()),
                ..LogParams::default()
            };
            let log = pods.logs(&pod.name_any(), &params).await?;
            if log.contains(needle) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn daemonset_ready(&self) -> Result<bool> {
        self.named_daemonset_ready(&format!("{RELEASE}-node")).await
    }

    async fn named_daemonset_ready(&self, name: &str) -> Result<bool> {
        let ds = self.daemonsets().get(name).await?;
        let generation = ds.metadata.generation;
        let Some(s) = ds.status else {
            return Ok(false);
        };
        Ok(s.observed_generation == generation
            && s.desired_number_scheduled >= 1
            && s.number_ready == s.desired_number_scheduled
            && s.updated_number_scheduled == Some(s.desired_number_scheduled))
    }

    /// The DaemonSet's pod is ready and the driver is registered with kubelet.
    async fn wait_plugin_ready(&self, what: &str) -> Result<()> {
        wait_for(
            &format!("{what}: DaemonSet {RELEASE}-node ready"),
            Duration::from_secs(120),
            || self.daemonset_ready(),
        )
        .await?;
        let client = self.client();
        wait_for(
            &format!("{what}: {DRIVER} registered in CSINode {}", self.node),
            Duration::from_secs(60),
            || csinode_has_driver(&client, &self.node),
        )
        .await
    }
}

// ---------------------------------------------------------------------------------------
// The test

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn journey() -> Result<()> {
    let Some(cluster) = sealed_e2e::cluster("journey").await else {
        return Ok(());
    };
    started();
    let client = cluster.client.clone();
    let tools = Tools::find(&cluster.kubeconfig)?;
    let operator_bin = workspace_binary("sealed-operator")?;
    let csi_bin = workspace_binary("sealed-csi")?;
    let node = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .find(|n| !n.starts_with("sealed-csi-test-"))
        .context("the cluster has no node")?;
    clean_stale_runs(&client, &tools, &node).await?;

    let moto = Moto::start()?;
    say(format!(
        "moto_server on 0.0.0.0:{} (pods: {}), buckets {STORE_BUCKET} and {SOURCE_BUCKET}",
        moto.port,
        moto.pod_endpoint()
    ));
    let store = moto.store()?;
    let registry = registry::Registry::start()?;
    say(format!(
        "crane registry serve behind hack/registry-auth.py (Basic auth) on {}",
        registry::HOST
    ));
    let release_ns =
        labelled_namespace(&client, "sealed-journey-system", "journey-release").await?;
    let ns = labelled_namespace(&client, "sealed-journey", "journey").await?;
    let attacker_ns = labelled_namespace(&client, "sealed-journey-attacker", "journey").await?;
    say(format!(
        "release namespace {release_ns}, volume namespace {ns}, attacker namespace \
         {attacker_ns}, node {node}"
    ));
    let journey = Arc::new(Journey {
        cluster,
        tools,
        moto,
        registry,
        store,
        node,
        release_ns,
        ns,
        attacker_ns,
    });

    // The steps run in their own task: a panic there still reaches the cleanup below.
    let run = tokio::spawn({
        let j = journey.clone();
        async move { steps(&j, &operator_bin, &csi_bin).await }
    });
    let result = match run.await {
        Ok(r) => r,
        Err(e) => Err(anyhow::anyhow!("the journey panicked: {e}")),
    };
    if let Err(e) = &result {
        say(format!("FAILED: {e:#}"));
        dump_state(&journey).await;
    }
    cleanup(&journey).await;
    say(format!(
        "done in {:.0} s: {}",
        started().elapsed().as_secs_f64(),
        if result.is_ok() { "ok" } else { "failed" }
    ));
    result
}

/// A run that was killed leaves its release and namespaces: remove them, and the node's
/// GPU label, before starting.
async fn clean_stale_runs(client: &Client, tools: &Tools, node: &str) -> Result<()> {
    if let Some(value) = gpu_label(client, node).await? {
        say(format!(
            "node {node} has a leftover {GPU_LABEL}={value}: removing it"
        ));
        set_gpu_label(client, node, None).await?;
    }
    let stale = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{NS_LABEL} in (journey, journey-release)")))
        .await?
        .items;
    // Pods first, while that run's plugin can still unpublish their volumes.
    for ns in stale
        .iter()
        .filter(|n| n.labels().get(NS_LABEL).map(String::as_str) == Some("journey"))
    {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name_any());
        let _ = pods
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        let _ = wait_for(
            "pods of an earlier run to go",
            Duration::from_secs(60),
            || async { Ok(pods.list(&ListParams::default()).await?.items.is_empty()) },
        )
        .await;
    }
    // Then the releases (their operators would put the versions' finalizers back), then the
    // finalizers no operator is left to remove, then the namespaces.
    for ns in &stale {
        let name = ns.name_any();
        if tools.helm(&["status", RELEASE, "-n", &name]).is_ok() {
            say(format!(
                "uninstalling release {RELEASE} of an earlier run from {name}"
            ));
            let _ = tools.helm(&["uninstall", RELEASE, "-n", &name, "--wait"]);
        }
    }
    for ns in &stale {
        let name = ns.name_any();
        say(format!("removing namespace {name} of an earlier run"));
        strip_version_finalizers(client, &name).await;
        let _ = Api::<Namespace>::all(client.clone())
            .delete(&name, &DeleteParams::default())
            .await;
    }
    let registered = wait_for(
        "no plugin of another run or test registered on the node",
        Duration::from_secs(60),
        || async { Ok(!csinode_has_driver(client, node).await?) },
    )
    .await;
    if registered.is_err() {
        bail!(
            "{DRIVER} is registered on node {node} by something else (csi-driver/tests/pods.rs \
             running now, or another DaemonSet); not touching it"
        );
    }
    // Nothing serves the driver now: a CSIDriver left behind (by a killed run of this suite or
    // of csi-driver/tests/pods.rs) would stop `helm install` ("cannot be imported").
    let drivers = Api::<CSIDriver>::all(client.clone());
    if let Some(d) = drivers.get_opt(DRIVER).await? {
        let managed = d.labels().get("app.kubernetes.io/managed-by").cloned();
        say(format!(
            "deleting a stale CSIDriver {DRIVER} (managed by {managed:?})"
        ));
        drivers.delete(DRIVER, &DeleteParams::default()).await?;
    }
    Ok(())
}

/// SealedVolumeVersions hold a finalizer only the operator removes: without an operator
/// they would keep their namespace Terminating.
async fn strip_version_finalizers(client: &Client, ns: &str) {
    let api: Api<SealedVolumeVersion> = Api::namespaced(client.clone(), ns);
    let Ok(list) = api.list(&ListParams::default()).await else {
        return;
    };
    for v in list.items {
        let patch = serde_json::json!({ "metadata": { "finalizers": null } });
        let _ = api
            .patch(
                &v.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await;
    }
}

async fn steps(j: &Journey, operator_bin: &Path, csi_bin: &Path) -> Result<()> {
    let images = install(j, operator_bin, csi_bin).await?;
    let (v1, v2) = sync_and_tags(j, &images).await?;
    delete_and_restore(j, &v1).await?;
    gpu_exclusion(j).await?;
    upgrade(j, &v1, &v2).await?;
    hostile::tenant(j, &v1).await?;
    Ok(())
}

/// The chart's images as pushed to the journey's registry (step 1).
struct Images {
    /// Manifest digests (sha256:...) of HOST/sealed-operator and HOST/sealed-csi.
    operator: String,
    csi: String,
}

impl Images {
    fn operator_ref(&self) -> String {
        format!("{}/sealed-operator@{}", registry::HOST, self.operator)
    }

    fn csi_ref(&self) -> String {
        format!("{}/sealed-csi@{}", registry::HOST, self.csi)
    }
}

/// What the runtime says a running container's image is: `HOST/REPO@sha256:...` when it
/// was pulled from the registry (an imported image has no repo digest of that host).
fn image_ids(pod: &Pod) -> Vec<(String, String)> {
    let status = pod.status.as_ref();
    status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .chain(status.and_then(|s| s.init_container_statuses.as_ref()))
        .flatten()
        .map(|c| (c.name.clone(), c.image_id.clone()))
        .collect()
}

/// Fails unless every container of `pod` runs `want` (HOST/REPO@sha256:...) as pulled.
fn ensure_pulled(pod: &Pod, want: &[String]) -> Result<()> {
    let ids = image_ids(pod);
    ensure!(
        !ids.is_empty(),
        "pod {} has no container statuses",
        pod.name_any()
    );
    for (container, id) in &ids {
        let id = id.strip_prefix("docker-pullable://").unwrap_or(id);
        ensure!(
            want.iter().any(|w| w == id),
            "container {container} of pod {} runs image {id:?}, not one pulled from the \
             registry ({want:?})",
            pod.name_any()
        );
    }
    Ok(())
}

/// Step 1.
async fn install(j: &Journey, operator_bin: &Path, csi_bin: &Path) -> Result<Images> {
    step(1, "images from a private registry and the Helm chart");
    let t = Instant::now();
    let script = sealed_e2e::repo_root().join("hack/images.sh");
    // The images a release builds (the release workflow runs the same script with
    // SEALED_PROFILE=release; here the test's own debug binaries), as docker archives.
    let out = Command::new(&script)
        .arg("sealed")
        .env("SEALED_OPERATOR_BIN", operator_bin)
        .env("SEALED_CSI_BIN", csi_bin)
        .env("SEALED_IMAGE_TAG", "dev")
        // Not into containerd: the kubelet pulls them from the registry.
        .env("SEALED_IMAGES_IMPORT", "0")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    ensure!(
        out.status.success(),
        "hack/images.sh sealed failed ({})",
        out.status
    );
    let archives: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect();
    let archive = |name: &str| {
        archives
            .iter()
            .find(|a| a.to_string_lossy().contains(name))
            .cloned()
            .with_context(|| format!("hack/images.sh printed no {name} archive: {archives:?}"))
    };
    let reader = PathBuf::from(env!("CARGO_BIN_EXE_tree-b3"));
    sealed_e2e::image_from_binary(READER_IMAGE, &reader, &[])?;
    say(format!(
        "images sealed-operator, sealed-csi and {READER_IMAGE} built in {:.0} s",
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let images = Images {
        operator: j
            .registry
            .push(&archive("sealed-operator")?, "sealed-operator", "journey")?,
        csi: j
            .registry
            .push(&archive("sealed-csi")?, "sealed-csi", "journey")?,
    };
    say(format!(
        "pushed with crane through the auth proxy in {:.0} s: {} and {}",
        t.elapsed().as_secs_f64(),
        images.operator_ref(),
        images.csi_ref()
    ));
    // Each image carries the SBOM of every binary in it (hack/images.sh, hack/sbom.sh), and
    // its config's label io.sealedvolumes.sbom names where.
    for (image, package) in [
        (images.operator_ref(), "sealed-operator"),
        (images.csi_ref(), "sealed-csi"),
        (images.csi_ref(), "sealed-fd-holder"),
    ] {
        let path = format!("usr/share/sbom/{package}.cdx.json");
        let config = j.registry.config(&image)?;
        let label = config["config"]["Labels"]["io.sealedvolumes.sbom"]
            .as_str()
            .unwrap_or_default();
        ensure!(
            label.split(',').any(|p| p == format!("/{path}")),
            "the label io.sealedvolumes.sbom of {image} ({label:?}) does not name /{path}"
        );
        let bytes = j.registry.file_in_image(&image, &path)?;
        let sbom: serde_json::Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("/{path} in {image} is not JSON"))?;
        let components = sbom["components"].as_array().map_or(0, Vec::len);
        ensure!(
            sbom["bomFormat"] == "CycloneDX"
                && sbom["metadata"]["component"]["name"] == package
                && components > 10,
            "/{path} in {image} is not {package}'s CycloneDX SBOM: {:.300}",
            String::from_utf8_lossy(&bytes)
        );
        say(format!(
            "{image} holds /{path} (its label io.sealedvolumes.sbom={label}): CycloneDX, \
             {package}, {components} components"
        ));
    }

    // Other tests on this cluster apply the CRDs without helm: apply the current ones first
    // (so a CRD left by an older build cannot prune fields the operator writes), then the
    // install takes them over (--take-ownership, as docs/helm.md's upgrade from a chart that
    // kept them in crds/ does); the chart's keep policy leaves them when the release goes.
    sealed_e2e::install_crds(&j.client(), "sealed-e2e-journey").await?;
    say("CRDs applied (server-side) and served");
    // What a private registry and workload identity need: a pull secret with the registry's
    // credentials (every image of the chart is pulled with it) and a service account of the
    // sync Jobs' own in the release namespace (step 2 checks that the Job's pod has both).
    let sync_sa: ServiceAccount = serde_json::from_value(
        serde_json::json!({ "metadata": { "name": SYNC_SERVICE_ACCOUNT } }),
    )?;
    Api::<ServiceAccount>::namespaced(j.client(), &j.release_ns)
        .create(&PostParams::default(), &sync_sa)
        .await
        .context("creating the sync Jobs' ServiceAccount")?;
    let pull: Secret = serde_json::from_value(serde_json::json!({
        "metadata": { "name": PULL_SECRET },
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": { ".dockerconfigjson": j.registry.dockerconfigjson() },
    }))?;
    Api::<Secret>::namespaced(j.client(), &j.release_ns)
        .create(&PostParams::default(), &pull)
        .await
        .context("creating the pull Secret")?;
    let endpoint = j.moto.pod_endpoint();
    let installed_after = j.registry.requests()?.len();
    let sets = [
        format!("fullnameOverride={RELEASE}"),
        // Documented values only (docs/helm.md): each component's repository and digest, and
        // Always, so that a cluster which pulled these digests before pulls them again.
        format!(
            "operator.image.repository={}/sealed-operator",
            registry::HOST
        ),
        format!("operator.image.digest={}", images.operator),
        format!("node.image.repository={}/sealed-csi", registry::HOST),
        format!("node.image.digest={}", images.csi),
        "image.pullPolicy=Always".into(),
        format!("store.url=s3://{STORE_BUCKET}/{STORE_PREFIX}"),
        format!("store.endpoint={endpoint}"),
        format!("store.region={REGION}"),
        "store.credentials.AWS_ACCESS_KEY_ID=test".into(),
        "store.credentials.AWS_SECRET_ACCESS_KEY=test".into(),
        "operator.syncExecutor=job".into(),
        // Restored versions are looked for this often (default 30s).
        "operator.uploadPoll=5s".into(),
        "operator.gcInterval=0".into(),
        // moto speaks plain http on the node's IP.
        "operator.sources.allowHttp=true".into(),
        // ... at an address the source policy refuses unless the admin allows it.
        format!("operator.sources.allowNetworks={{{HOST_IP}/32}}"),
        "cache.size=1Gi".into(),
        format!("operator.syncJobPod.serviceAccountName={SYNC_SERVICE_ACCOUNT}"),
    ];
    let mut args = vec![
        "install",
        RELEASE,
        "charts/sealed-volumes",
        "-n",
        &j.release_ns,
        "--take-ownership",
    ];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    // Only this run's namespaces: operator tests on the same cluster have their own volumes.
    let watch = format!(
        r#"operator.extraArgs=["--watch-namespace={},{}"]"#,
        j.ns, j.attacker_ns
    );
    args.extend(["--set-json", &watch]);
    let pull_secrets = format!(r#"imagePullSecrets=[{{"name":"{PULL_SECRET}"}}]"#);
    args.extend(["--set-json", &pull_secrets]);
    j.tools.helm(&args)?;
    say(format!(
        "helm install {RELEASE} -n {}: {}",
        j.release_ns,
        sets.join(" ")
    ));
    let deployments: Api<Deployment> = Api::namespaced(j.client(), &j.release_ns);
    wait_for(
        &format!("Deployment {RELEASE}-operator ready"),
        Duration::from_secs(120),
        || async {
            let d = deployments.get(&format!("{RELEASE}-operator")).await?;
            Ok(d.status.and_then(|s| s.ready_replicas).unwrap_or(0) >= 1)
        },
    )
    .await?;
    say("operator Deployment ready");
    j.wait_plugin_ready("install").await?;
    let holder = format!("{RELEASE}-fd-holder");
    wait_for(
        &format!("DaemonSet {holder} ready"),
        Duration::from_secs(120),
        || j.named_daemonset_ready(&holder),
    )
    .await?;
    say(format!(
        "fd holder DaemonSet {holder} ready (restart safety, updateStrategy OnDelete)"
    ));
    let driver = Api::<CSIDriver>::all(j.client()).get(DRIVER).await?;
    ensure!(
        driver.spec.pod_info_on_mount == Some(true),
        "the chart's CSIDriver has no podInfoOnMount"
    );
    say(format!(
        "node DaemonSet ready, {DRIVER} registered on {} (CSINode), CSIDriver installed by the \
         chart",
        j.node
    ));
    let fleet = fleet_secrets(j).await?;
    let plugin_args = j
        .daemonsets()
        .get(&format!("{RELEASE}-node"))
        .await?
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| {
            s.containers
                .iter()
                .flat_map(|c| c.args.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    ensure!(
        plugin_args.iter().any(|a| a.starts_with("--peer-listen="))
            && plugin_args
                .iter()
                .any(|a| a.starts_with("--peer-tls-cert=")),
        "the chart's defaults do not turn the peer tier with mTLS on: {plugin_args:?}"
    );
    ensure!(
        j.plugin_log_contains("peer tier on").await?,
        "the plugin did not start the peer tier"
    );
    say(format!(
        "peer tier on with mutual TLS: the operator made the fleet token ({} bytes), CA and \
         certificate; the plugin loaded them",
        fleet.token.len()
    ));
    check_pulls(j, &images, installed_after).await?;
    Ok(images)
}

/// The fleet token, CA and certificate the operator keeps for the plugins.
#[derive(Debug, PartialEq, Eq)]
struct Fleet {
    token: Vec<u8>,
    ca: Vec<u8>,
    cert: Vec<u8>,
}

/// Step 1 and 8: the operator's peer Secrets (waited for: made at its start).
async fn fleet_secrets(j: &Journey) -> Result<Fleet> {
    let secrets = Api::<Secret>::namespaced(j.client(), &j.release_ns);
    let key =
        |s: &Secret, k: &str| -> Option<Vec<u8>> { s.data.as_ref()?.get(k).map(|b| b.0.clone()) };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let token = secrets.get_opt(&format!("{RELEASE}-peer-token")).await?;
        let tls = secrets.get_opt(&format!("{RELEASE}-peer-tls")).await?;
        if let (Some(token), Some(tls)) = (token, tls) {
            return Ok(Fleet {
                token: key(&token, "token").context("no token key")?,
                ca: key(&tls, "ca.crt").context("no ca.crt key")?,
                cert: key(&tls, "tls.crt").context("no tls.crt key")?,
            });
        }
        ensure!(
            Instant::now() < deadline,
            "the operator made no peer token and TLS Secrets within 60 s"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Step 1, continued: every pod of the release runs images pulled from the registry with
/// the secret, and a pod without the secret cannot pull.
async fn check_pulls(j: &Journey, images: &Images, installed_after: usize) -> Result<()> {
    let pods = Api::<Pod>::namespaced(j.client(), &j.release_ns)
        .list(&ListParams::default())
        .await?
        .items;
    let running: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .collect();
    ensure!(
        running.len() >= 3,
        "want the operator, node plugin and fd holder pods running, got {:?}",
        running.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    let want = [images.operator_ref(), images.csi_ref()];
    for pod in &running {
        ensure_pulled(pod, &want)?;
    }
    say(format!(
        "imageIDs of {} pods ({}) name the registry: {}",
        running.len(),
        running
            .iter()
            .map(|p| p.name_any())
            .collect::<Vec<_>>()
            .join(", "),
        want.join(", ")
    ));
    let requests = j.registry.requests()?;
    let since = &requests[installed_after.min(requests.len())..];
    for repo in ["sealed-operator", "sealed-csi"] {
        let pulls = since
            .iter()
            .filter(|r| r.is_manifest_of(repo) && r.ok())
            .collect::<Vec<_>>();
        ensure!(
            !pulls.is_empty()
                && pulls
                    .iter()
                    .all(|r| r.user.as_deref() == Some(registry::USER)),
            "the auth proxy saw no authenticated pull of {repo} since helm install: {since:?}"
        );
    }
    let blobs = since
        .iter()
        .filter(|r| r.method == "GET" && r.path.contains("/blobs/") && r.ok())
        .count();
    say(format!(
        "the auth proxy saw {} requests since helm install: manifests of sealed-operator and \
         sealed-csi and {blobs} blob GETs (none for layers containerd holds from an earlier \
         run), each as user {} (and the 401 challenges before them)",
        since.len(),
        registry::USER
    ));

    // Without the secret: the pod's default ServiceAccount in the volume namespace has none.
    let name = "no-pull-secret";
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": j.node,
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "operator",
                "image": images.operator_ref(),
                "imagePullPolicy": "Always",
                "args": ["--help"],
            }],
        },
    }))?;
    let before = j.registry.requests()?.len();
    j.pods().create(&PostParams::default(), &pod).await?;
    let reason = std::sync::Mutex::new(String::new());
    let failed = wait_for(
        &format!("pod {name} to fail pulling"),
        Duration::from_secs(90),
        || async {
            let p = j.pods().get(name).await?;
            let waiting = p
                .status
                .and_then(|s| s.container_statuses)
                .into_iter()
                .flatten()
                .find_map(|c| c.state?.waiting?.reason)
                .unwrap_or_default();
            let failed = matches!(waiting.as_str(), "ErrImagePull" | "ImagePullBackOff");
            *reason.lock().expect("reason") = waiting;
            Ok(failed)
        },
    )
    .await;
    let events = j.events_of(name).await;
    j.delete_pod(name).await?;
    failed.with_context(|| format!("pod {name}: events {events:?}"))?;
    let reason = reason.into_inner().expect("reason");
    let refused = j.registry.requests()?[before..]
        .iter()
        .filter(|r| r.is_manifest_of("sealed-operator"))
        .map(|r| (r.user.clone(), r.status.clone()))
        .collect::<Vec<_>>();
    ensure!(
        !refused.is_empty() && refused.iter().all(|(user, _)| user.is_none()),
        "the pull without a secret should reach the proxy unauthenticated only: {refused:?}"
    );
    let event = events
        .iter()
        .find(|e| e.contains("401") || e.to_lowercase().contains("unauthorized"))
        .cloned()
        .unwrap_or_else(|| events.join(" | "));
    say(format!(
        "a pod of {} without a pull secret: {reason}, the proxy answered its {} manifest \
         request(s) with 401 ({event})",
        images.operator_ref(),
        refused.len()
    ));
    Ok(())
}

/// Steps 2 to 5. Returns v1 and v2.
async fn sync_and_tags(j: &Journey, images: &Images) -> Result<(Digest, Digest)> {
    step(2, "a SealedVolume synced from a bucket by a Job");
    let source = j.moto.bucket(SOURCE_BUCKET, SOURCE_PREFIX)?;
    let v1_files = model_v1();
    upload_tree(source.as_ref(), &v1_files).await?;
    let v1 = push_digest(&v1_files).await?;
    say(format!(
        "{} files ({} bytes) in s3://{SOURCE_BUCKET}/{SOURCE_PREFIX}; `sealed push` of the same \
         tree into a memory store gives {v1}",
        v1_files.len(),
        v1_files.values().map(Vec::len).sum::<usize>()
    ));
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": "source-keys",
            // Opted in as source credentials (docs/security.md).
            "labels": { sealed_crds::SOURCE_CREDENTIALS_LABEL: "true" },
        },
        "stringData": { "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test" },
    }))?;
    Api::<Secret>::namespaced(j.client(), &j.ns)
        .create(&PostParams::default(), &secret)
        .await?;
    let volume: SealedVolume = serde_json::from_value(serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolume",
        "metadata": { "name": VOLUME },
        "spec": {
            "source": { "objectStore": {
                "url": format!("s3://{SOURCE_BUCKET}/{SOURCE_PREFIX}"),
                "endpoint": j.moto.pod_endpoint(),
                "region": REGION,
                "credentialsSecretRef": { "name": "source-keys" },
            } },
        },
    }))?;
    j.volumes()
        .create(&PostParams::default(), &volume)
        .await
        .context("creating the SealedVolume")?;
    let t = Instant::now();
    let job = j.wait_for_sync("", &v1).await?;
    let version = j.wait_for_version(&v1, Duration::from_secs(60)).await?;
    let files = version.status.as_ref().map(|s| s.files);
    ensure!(
        files == Some(Some(v1_files.len() as i64)),
        "version {} says {files:?} files, want {}",
        version.name_any(),
        v1_files.len()
    );
    say(format!(
        "SealedVolumeVersion {} Ready after {:.0} s, digest {v1} = the independent push's; \
         synced by Job {}/{job} (succeeded)",
        version.name_any(),
        t.elapsed().as_secs_f64(),
        j.release_ns
    ));
    // The Job's pod ran under the chart's sync service account, with the pull secret and no
    // API token.
    let pods = Api::<Pod>::namespaced(j.client(), &j.release_ns)
        .list(&ListParams::default().labels(&format!("job-name={job}")))
        .await?
        .items;
    let job_pod = pods
        .iter()
        .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"))
        .with_context(|| format!("no Succeeded pod of Job {job}"))?;
    let pod_spec = job_pod
        .spec
        .clone()
        .with_context(|| format!("pod {} has no spec", job_pod.name_any()))?;
    // The sync image defaults to the operator's: pulled from the registry with the secret.
    ensure_pulled(job_pod, &[images.operator_ref()])?;
    ensure!(
        pod_spec.service_account_name.as_deref() == Some(SYNC_SERVICE_ACCOUNT),
        "the sync pod ran as {:?}, not {SYNC_SERVICE_ACCOUNT}",
        pod_spec.service_account_name
    );
    let secrets: Vec<String> = pod_spec
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.clone())
        .collect();
    ensure!(
        secrets == [PULL_SECRET],
        "the sync pod's pull secrets are {secrets:?}"
    );
    ensure!(
        pod_spec.automount_service_account_token == Some(false),
        "the sync pod mounts an API token"
    );
    say(format!(
        "its pod {} (Succeeded) ran as ServiceAccount {SYNC_SERVICE_ACCOUNT} with pull secret \
         {PULL_SECRET}, no API token mounted, image {} pulled from the registry",
        job_pod.name_any(),
        images.operator_ref()
    ));

    step(
        3,
        "a pod reads every file by digest, BLAKE3 = the manifest's",
    );
    let want_v1 = expected_sums(&j.store, &v1).await?;
    ensure!(
        want_v1.len() == v1_files.len(),
        "manifest lists {} files",
        want_v1.len()
    );
    for (line, (path, bytes)) in want_v1.iter().zip(&v1_files) {
        let local = format!("{}  {path}", blake3::hash(bytes).to_hex());
        ensure!(
            *line == local,
            "manifest entry {line} differs from the local file's {local}"
        );
    }
    let sums = j.read_once("read-v1", by_digest(&v1)).await?;
    ensure!(
        sums == want_v1,
        "pod read-v1 sums:\n{}\nmanifest:\n{}",
        sums.join("\n"),
        want_v1.join("\n")
    );
    say(format!(
        "pod read-v1: {} files, every BLAKE3 equals the manifest's (and the local files')",
        sums.len()
    ));

    step(4, "tags move; pinned pods keep their bytes");
    j.set_tag("prod", &v1).await?;
    let sums = j.start_reader("by-tag-a", by_tag("prod"), true).await?;
    ensure!(sums == want_v1, "by-tag-a (prod = v1) read other bytes");
    let sums = j.start_reader("pinned-b", by_digest(&v1), true).await?;
    ensure!(sums == want_v1, "pinned-b (v1) read other bytes");
    say("by-tag-a (volume tiny, tag prod) and pinned-b (digest v1) read v1");
    let v2_files = model_v2();
    upload_tree(source.as_ref(), &v2_files).await?;
    let v2 = push_digest(&v2_files).await?;
    ensure!(v2 != v1, "v2 has v1's digest");
    let patch = serde_json::json!({
        "metadata": { "annotations": { sealed_crds::RESYNC_ANNOTATION: "v2" } }
    });
    j.volumes()
        .patch(VOLUME, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    say(format!(
        "config.json changed in the source bucket, annotation {}=v2 set; push says v2 = {v2}",
        sealed_crds::RESYNC_ANNOTATION
    ));
    let t = Instant::now();
    let job = j.wait_for_sync("v2", &v2).await?;
    let version = j.wait_for_version(&v2, Duration::from_secs(60)).await?;
    say(format!(
        "the resync ran as Job {job} and sealed v2: SealedVolumeVersion {} Ready after {:.0} s",
        version.name_any(),
        t.elapsed().as_secs_f64()
    ));
    let want_v2 = expected_sums(&j.store, &v2).await?;
    j.set_tag("prod", &v2).await?;
    let sums = j.start_reader("by-tag-c", by_tag("prod"), false).await;
    // The chart's admission webhook resolved the tag when the pod was created (once per
    // workload revision; a bare pod is its own): the pod names v2's digest, and the tag it came
    // from is kept as information (docs/csi.md, "Tags and rollouts").
    let admitted = j.pods().get("by-tag-c").await?;
    j.delete_pod("by-tag-c").await?;
    let sums = sums?;
    ensure!(
        sums == want_v2,
        "by-tag-c (prod = v2) read:\n{}\nwant v2:\n{}",
        sums.join("\n"),
        want_v2.join("\n")
    );
    let attributes = admitted
        .spec
        .as_ref()
        .and_then(|spec| spec.volumes.as_ref())
        .into_iter()
        .flatten()
        .find_map(|volume| volume.csi.as_ref())
        .and_then(|csi| csi.volume_attributes.clone())
        .unwrap_or_default();
    let from_tag = format!("{VOLUME}:prod");
    ensure!(
        attributes.get("digest") == Some(&v2.to_string())
            && attributes.get("fromTag") == Some(&from_tag)
            && !attributes.contains_key("tag"),
        "by-tag-c was not resolved to v2 at admission (digest {v2}, fromTag {from_tag}): {attributes:?}"
    );
    say(format!(
        "new pod by-tag-c (tag prod) reads v2's bytes; admitted as {attributes:?}"
    ));
    for pod in ["pinned-b", "by-tag-a"] {
        let read = j.next_read(pod).await?;
        ensure!(
            read.ends_with(&format!(" ok {}", sums_total(&want_v1))),
            "{pod} should still read v1 after prod moved to v2, but read: {read}"
        );
    }
    say("pinned-b still reads v1; by-tag-a (its tag was resolved when it started) still reads v1");

    step(5, "roll back");
    j.set_tag("prod", &v1).await?;
    let sums = j.read_once("rollback-tag", by_tag("prod")).await?;
    ensure!(
        sums == want_v1,
        "rollback-tag (prod = v1 again) read other bytes"
    );
    let sums = j.read_once("rollback-digest", by_digest(&v1)).await?;
    ensure!(sums == want_v1, "rollback-digest (v1) read other bytes");
    say("prod back to v1: a new pod by tag reads v1; a pod by v1's digest reads v1");
    j.set_tag("prod", &v2).await?;
    // Two syncs were asked for (the first, and the resync); tag moves start none (the sync
    // trigger is the source's hash and the resync annotation, not metadata.generation).
    let jobs: Vec<String> = j.sync_jobs().await?.iter().map(|j| j.name_any()).collect();
    ensure!(
        jobs.len() == 2,
        "{} sync Jobs for 2 source changes ({jobs:?}): moving a tag started a sync",
        jobs.len()
    );
    say("2 sync Jobs for 2 source changes: the 4 tag moves started none");
    for pod in ["pinned-b", "by-tag-a"] {
        j.delete_pod(pod).await?;
    }
    Ok((v1, v2))
}

/// Step 6.
async fn delete_and_restore(j: &Journey, v1: &Digest) -> Result<()> {
    step(
        6,
        "delete v1 (to the trash), refused, restore, mounted again",
    );
    let name = SealedVolumeVersionSpec::object_name(VOLUME, &v1.to_string());
    // A pod still reads v1 while its version is deleted: the version waits for it.
    j.start_reader("holding-v1", by_digest(v1), true).await?;
    j.versions()
        .delete(&name, &DeleteParams::default())
        .await
        .with_context(|| format!("deleting SealedVolumeVersion {name}"))?;
    let waiting = std::sync::Mutex::new(String::new());
    wait_for(
        "a WaitingForUnpublish event on the deleted version",
        Duration::from_secs(60),
        || async {
            let events = Api::<Event>::namespaced(j.client(), &j.ns)
                .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
                .await?;
            for e in events.items {
                if e.reason.as_deref() == Some("WaitingForUnpublish") {
                    *waiting.lock().unwrap() = e.message.unwrap_or_default();
                    return Ok(true);
                }
            }
            Ok(false)
        },
    )
    .await?;
    let versions = j.versions();
    ensure!(
        versions
            .get_opt(&name)
            .await?
            .is_some_and(|v| v.metadata.deletion_timestamp.is_some()),
        "{name} went while pod holding-v1 still mounted it"
    );
    ensure!(
        j.store.has_manifest(v1).await?,
        "{v1} went to the trash while pod holding-v1 still mounted it"
    );
    let read = j.next_read("holding-v1").await?;
    ensure!(
        read.contains(" ok "),
        "holding-v1 failed to read while its version was being deleted: {read}"
    );
    say(format!(
        "while pod holding-v1 still reads v1 the deletion waits: {}",
        waiting.into_inner().unwrap()
    ));
    j.delete_pod("holding-v1").await?;
    wait_for(
        &format!("SealedVolumeVersion {name} to go (the operator's finalizer)"),
        Duration::from_secs(120),
        || async { Ok(versions.get_opt(&name).await?.is_none()) },
    )
    .await?;
    let record = sealed_store::trash::read_record(&j.store, v1)
        .await?
        .with_context(|| format!("no trash record of {v1} in the store"))?;
    ensure!(
        !j.store.has_manifest(v1).await?,
        "{v1} is still a live manifest after its version was deleted"
    );
    say(format!(
        "{name} deleted: its manifest is in the store's trash (deleted at {}, restorable until {})",
        record.deleted_at, record.restorable_until
    ));

    j.pods()
        .create(
            &PostParams::default(),
            &reader_pod("refused", &j.node, by_digest(v1), false)?,
        )
        .await?;
    let refusal = std::sync::Mutex::new(String::new());
    wait_for(
        "a FailedMount event on pod refused",
        Duration::from_secs(90),
        || async {
            for e in j.events_of("refused").await {
                if e.contains("FailedMount")
                    && (e.contains("PermissionDenied") || e.contains("NotFound"))
                {
                    *refusal.lock().unwrap() = e;
                    return Ok(true);
                }
            }
            Ok(false)
        },
    )
    .await?;
    let phase = j.pods().get("refused").await?.status.and_then(|s| s.phase);
    ensure!(
        phase.as_deref() == Some("Pending"),
        "pod refused is {phase:?}"
    );
    let refusal = refusal.into_inner().unwrap();
    say(format!("a new pod by v1's digest is refused: {refusal}"));
    j.delete_pod("refused").await?;

    let report = sealed_store::trash::restore_version(&j.store, v1).await?;
    ensure!(report.restored, "restore_version did not restore {v1}");
    say(format!(
        "{v1} restored from the trash (what `sealed restore` does)"
    ));
    let t = Instant::now();
    let version = j.wait_for_version(v1, Duration::from_secs(90)).await?;
    say(format!(
        "the operator re-imported it as SealedVolumeVersion {} ({:.0} s)",
        version.name_any(),
        t.elapsed().as_secs_f64()
    ));
    let want = expected_sums(&j.store, v1).await?;
    let sums = j.read_once("restored", by_digest(v1)).await?;
    ensure!(sums == want, "pod restored read other bytes than v1's");
    say("a new pod by v1's digest starts and reads v1's bytes");
    Ok(())
}

/// Step 7.
async fn gpu_exclusion(j: &Journey) -> Result<()> {
    step(7, "GPU exclusion: an L4 node gets no node plugin");
    let client = j.client();
    set_gpu_label(&client, &j.node, Some("NVIDIA-L4")).await?;
    say(format!("node {} labelled {GPU_LABEL}=NVIDIA-L4", j.node));
    let ds_name = format!("{RELEASE}-node");
    wait_for(
        "the DaemonSet to schedule nothing",
        Duration::from_secs(60),
        || async {
            let ds = j.daemonsets().get(&ds_name).await?;
            Ok(ds.status.is_some_and(|s| s.desired_number_scheduled == 0))
        },
    )
    .await?;
    wait_for(
        "the node plugin pod to go",
        Duration::from_secs(90),
        || async { Ok(j.plugin_pods().await?.is_empty()) },
    )
    .await?;
    say("desiredNumberScheduled 0, the plugin pod is gone");
    set_gpu_label(&client, &j.node, None).await?;
    j.wait_plugin_ready("label removed").await?;
    say("label removed: the plugin pod is back, ready and registered");
    Ok(())
}

/// Step 8.
async fn upgrade(j: &Journey, v1: &Digest, v2: &Digest) -> Result<()> {
    step(8, "upgrade the node plugin while a pod reads");
    let want = expected_sums(&j.store, v2).await?;
    let total = sums_total(&want);
    let sums = j.start_reader("reading", by_digest(v2), true).await?;
    ensure!(sums == want, "pod reading read other bytes than v2's");
    let mounted = mounts_of(&[v2]);
    ensure!(
        mounted.len() >= 2,
        "pod reading runs, but /proc/self/mountinfo shows {mounted:?} for v2 (want its FUSE \
         mount and the pod's bind)"
    );
    say(format!(
        "v2 is mounted on the node: {} (FUSE mount + bind)",
        mounted.join(", ")
    ));
    let first = j.next_read("reading").await?;
    say(format!("pod reading reads v2 once a second: {first}"));
    let old: Vec<String> = j
        .plugin_pods()
        .await?
        .iter()
        .map(|p| p.name_any())
        .collect();
    let reads_before = j.reads_of("reading").await.len();
    let fleet_before = fleet_secrets(j).await?;
    j.tools.helm(&[
        "upgrade",
        RELEASE,
        "charts/sealed-volumes",
        "-n",
        &j.release_ns,
        "--reuse-values",
        "--set-string",
        "node.podAnnotations.journey-rollout=2",
    ])?;
    say(format!(
        "helm upgrade (a new node pod annotation) rolls plugin pod(s) {old:?}"
    ));
    let t = Instant::now();
    wait_for("a new plugin pod", Duration::from_secs(120), || async {
        let pods = j.plugin_pods().await?;
        Ok(!pods.is_empty() && pods.iter().all(|p| !old.contains(&p.name_any())))
    })
    .await?;
    j.wait_plugin_ready("upgrade").await?;
    say(format!(
        "the new plugin pod is ready and registered {:.0} s after the upgrade",
        t.elapsed().as_secs_f64()
    ));
    tokio::time::sleep(Duration::from_secs(4)).await;
    let reads = j.reads_of("reading").await;
    let after = &reads[reads_before.min(reads.len())..];
    let ok = after
        .iter()
        .filter(|l| l.ends_with(&format!(" ok {total}")))
        .count();
    let failed: Vec<&String> = after.iter().filter(|l| l.contains(" failed")).collect();
    say(format!(
        "pod reading during and after the upgrade: {ok} reads ok, {} failed, {} other; last: {:?}",
        failed.len(),
        after.len() - ok - failed.len(),
        after.last()
    ));
    let last_ok = after
        .last()
        .is_some_and(|l| l.ends_with(&format!(" ok {total}")));
    ensure!(
        failed.is_empty() && ok >= 1 && last_ok,
        "the running pod's reads broke when the node plugin was upgraded (restart safety: the \
         fd holder keeps the FUSE fd, the new plugin resumes the mount); first failure: {:?}, \
         last read: {:?}",
        failed.first(),
        after.last()
    );
    let resumed = j.plugin_log_contains("resumed=true").await?;
    ensure!(
        resumed,
        "the new plugin did not log resuming the mount (\"mounted ... resumed=true\")"
    );
    say(format!(
        "the running pod kept reading correct bytes through the plugin upgrade ({ok} reads \
         after it, none failed); the new plugin resumed the FUSE mount from the fd holder"
    ));
    let sums = j.read_once("after-upgrade", by_digest(v2)).await?;
    ensure!(sums == want, "pod after-upgrade read other bytes than v2's");
    say("a new pod after the upgrade reads v2's bytes");
    ensure!(
        fleet_secrets(j).await? == fleet_before,
        "helm upgrade changed the fleet token, CA or certificate"
    );
    // A GitOps render of the same values: it holds none of the three Secrets, so applying it
    // cannot rotate them.
    let values = j
        .tools
        .helm(&["get", "values", RELEASE, "-n", &j.release_ns, "-o", "yaml"])?;
    let values_file = std::env::temp_dir().join(format!("journey-values-{}.yaml", j.release_ns));
    std::fs::write(&values_file, values)?;
    let values_path = values_file.display().to_string();
    let rendered = j.tools.helm(&[
        "template",
        RELEASE,
        "charts/sealed-volumes",
        "-n",
        &j.release_ns,
        "-f",
        &values_path,
        // Offline, as a GitOps tool renders: the cluster's version given, nothing looked up.
        "--kube-version",
        "1.34.0",
    ])?;
    let _ = std::fs::remove_file(&values_file);
    for name in ["peer-token", "peer-tls", "peer-tls-ca"] {
        let object = format!("name: {RELEASE}-{name}\n");
        ensure!(
            !rendered
                .split("\n---")
                .any(|doc| doc.contains("\nkind: Secret") && doc.contains(&object)),
            "helm template renders Secret {RELEASE}-{name}: a GitOps apply would rotate it"
        );
    }
    ensure!(
        fleet_secrets(j).await? == fleet_before,
        "the fleet token, CA or certificate changed"
    );
    say(
        "helm upgrade and a helm template render left the fleet token, CA and certificate as they were",
    );
    j.delete_pod("reading").await?;
    let mut left = Vec::new();
    let gone = wait_for(
        "no mount of v1 or v2 left on the node",
        Duration::from_secs(30),
        || {
            left = mounts_of(&[v1, v2]);
            std::future::ready(Ok(left.is_empty()))
        },
    )
    .await;
    if gone.is_err() {
        bail!(
            "after every pod went, these mounts are left:\n{}",
            left.join("\n")
        );
    }
    say(
        "pod reading deleted (unpublished by the new plugin); no FUSE mount or bind of v1 or v2 \
         is left on the node (the old plugin's dead FUSE mount was cleaned up)",
    );
    Ok(())
}

/// Mount points (FUSE mounts in the plugin's state dir, binds in kubelet's pod dirs) of
/// these versions, per /proc/self/mountinfo (the FUSE filesystem is named `sealed-<hex>`).
fn mounts_of(digests: &[&Digest]) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let names: Vec<String> = digests
        .iter()
        .map(|d| format!("sealed-{}", d.hex()))
        .collect();
    info.lines()
        .filter(|l| names.iter().any(|n| l.contains(n.as_str())))
        .map(|l| l.split(' ').nth(4).unwrap_or_default().to_string())
        .collect()
}

/// What a failure needs for diagnosis: the operator's and plugin's logs, the volume.
async fn dump_state(j: &Journey) {
    let pods = Api::<Pod>::namespaced(j.client(), &j.release_ns);
    if let Ok(list) = pods.list(&ListParams::default()).await {
        for p in list.items {
            let name = p.name_any();
            let container = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .map(|c| c.name.clone());
            let log = pods
                .logs(
                    &name,
                    &LogParams {
                        container,
                        tail_lines: Some(40),
                        ..Default::default()
                    },
                )
                .await
                .unwrap_or_default();
            say(format!(
                "--- {}/{name} ({:?}), last lines:\n{log}",
                j.release_ns,
                p.status.and_then(|s| s.phase)
            ));
        }
    }
    if let Ok(Some(v)) = j.volumes().get_opt(VOLUME).await {
        say(format!("--- SealedVolume {VOLUME} status: {:#?}", v.status));
    }
}

/// Everything the journey made goes, in the order that lets each part clean up after
/// itself: pods (unpublished by the plugin), versions (trashed by the operator), then the
/// release, the node label, the CSIDriver and the namespaces.
async fn cleanup(j: &Journey) {
    say("===== cleanup");
    let client = j.client();
    let pods = j.pods();
    if let Ok(list) = pods.list(&ListParams::default()).await {
        for p in list.items {
            let _ = pods.delete(&p.name_any(), &DeleteParams::default()).await;
        }
    }
    if wait_for("the pods to go", Duration::from_secs(90), || async {
        Ok(pods.list(&ListParams::default()).await?.items.is_empty())
    })
    .await
    .is_err()
    {
        say("cleanup: pods still there after 90 s");
    }
    // The attacker's namespace (step 9): pods, volumes, and hand-made versions.
    let attacker_pods: Api<Pod> = Api::namespaced(client.clone(), &j.attacker_ns);
    let _ = attacker_pods
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<SealedVolume>::namespaced(client.clone(), &j.attacker_ns)
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<SealedVolumeVersion>::namespaced(client.clone(), &j.attacker_ns)
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = j.volumes().delete(VOLUME, &DeleteParams::default()).await;
    let versions = j.versions();
    if wait_for("the versions to go", Duration::from_secs(60), || async {
        Ok(versions
            .list(&ListParams::default())
            .await?
            .items
            .is_empty())
    })
    .await
    .is_err()
    {
        say("cleanup: versions still there after 60 s; removing their finalizers");
        strip_version_finalizers(&client, &j.ns).await;
    }
    strip_version_finalizers(&client, &j.attacker_ns).await;
    if let Err(e) = set_gpu_label(&client, &j.node, None).await {
        say(format!("cleanup: {e:#}"));
    }
    if let Err(e) = j
        .tools
        .helm(&["uninstall", RELEASE, "-n", &j.release_ns, "--wait"])
    {
        say(format!("cleanup: {e:#}"));
    }
    if wait_for(
        "the driver to be deregistered",
        Duration::from_secs(60),
        || async { Ok(!csinode_has_driver(&client, &j.node).await?) },
    )
    .await
    .is_err()
    {
        say(format!(
            "cleanup: {DRIVER} is still registered on {}",
            j.node
        ));
    }
    // helm uninstall removes the chart's CSIDriver; if it failed, remove it here (only ours).
    let drivers = Api::<CSIDriver>::all(client.clone());
    if let Ok(Some(d)) = drivers.get_opt(DRIVER).await
        && d.labels()
            .get("app.kubernetes.io/instance")
            .map(String::as_str)
            == Some(RELEASE)
    {
        let _ = drivers.delete(DRIVER, &DeleteParams::default()).await;
    }
    for ns in [&j.ns, &j.attacker_ns, &j.release_ns] {
        if let Err(e) = j.cluster.delete_namespace(ns).await {
            say(format!("cleanup: {e:#}"));
        }
    }
    say("cleanup done (moto stops when the test ends)");
}
