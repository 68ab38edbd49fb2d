//! Helpers that start or reuse the local cluster from `hack/cluster.sh`.
//!
//! Tests call [`cluster`] first. Unless `SEALED_E2E_CLUSTER=1` is set it prints why the
//! test is skipped and returns `None`; with it set, it starts the cluster (or reuses a
//! running one through its admin kubeconfig) and panics with the script's output if that
//! fails, so CI fails loudly instead of passing without testing anything.

pub mod fleet;
pub mod upgrade;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{DeleteParams, LogParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::await_condition;
use kube::{Api, Client, Config};

/// The environment variable that turns the cluster tests on.
pub const ENABLE_ENV: &str = "SEALED_E2E_CLUSTER";

/// The busybox image `hack/images.sh base` imports (has `/bin/sh` and the usual applets).
pub const BUSYBOX_IMAGE: &str = "sealed.local/busybox:v1";

/// A running cluster and a client for it.
#[derive(Clone)]
pub struct Cluster {
    /// A client with cluster-admin rights.
    pub client: Client,
    /// The admin kubeconfig, for `kubectl`/`helm` calls made by tests.
    pub kubeconfig: PathBuf,
}

/// The repository root (the e2e crate's parent directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// Where `hack/cluster.sh` keeps its state (same default and override as the script).
pub fn cluster_dir() -> PathBuf {
    std::env::var_os("SEALED_CLUSTER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/sealed-cluster"))
}

/// The admin kubeconfig written by `hack/cluster.sh up`.
pub fn kubeconfig_path() -> PathBuf {
    cluster_dir().join("admin.kubeconfig")
}

/// True when `SEALED_E2E_CLUSTER=1`.
pub fn enabled() -> bool {
    std::env::var(ENABLE_ENV).is_ok_and(|v| v == "1")
}

/// Returns the cluster, starting it if needed, or `None` (after printing a skip notice)
/// when the cluster tests are not enabled.
///
/// # Panics
/// When enabled but the cluster cannot be started or reached: that is a test failure.
pub async fn cluster(test: &str) -> Option<Cluster> {
    if !enabled() {
        // Straight to the stderr handle: the test harness captures `println!`/`eprintln!`
        // of passing tests, and a skip should be visible without --nocapture.
        let _ = writeln!(
            std::io::stderr(),
            "{test}: skipped: set {ENABLE_ENV}=1 (hack/cluster.sh builds the cluster; needs root)"
        );
        return None;
    }
    match connect_or_start().await {
        Ok(c) => Some(c),
        Err(e) => panic!("{test}: the test cluster is not usable: {e:#}"),
    }
}

/// Runs `hack/cluster.sh up` once per test process (it returns at once when every
/// component is already healthy, and repairs a partial cluster), then connects.
pub async fn connect_or_start() -> Result<Cluster> {
    start_once()?;
    connect(&kubeconfig_path()).await
}

/// Tests in one binary run on parallel threads; only the first one runs the script.
fn start_once() -> Result<()> {
    static STARTED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| run_cluster_up().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn run_cluster_up() -> Result<()> {
    let script = repo_root().join("hack/cluster.sh");
    eprintln!("starting the test cluster: {} up", script.display());
    // stderr is inherited so a cold build's progress and any failure show in the test log.
    let out = Command::new(&script)
        .arg("up")
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} up failed ({}); see the log above and {}/logs",
            script.display(),
            out.status,
            cluster_dir().display()
        );
    }
    Ok(())
}

/// Builds a client from the kubeconfig and checks that the API server answers.
pub async fn connect(kubeconfig: &Path) -> Result<Cluster> {
    let kc = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("cannot read kubeconfig {}", kubeconfig.display()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .context("invalid kubeconfig")?;
    let client = Client::try_from(config).context("cannot build a Kubernetes client")?;
    client
        .apiserver_version()
        .await
        .context("the API server does not answer")?;
    Ok(Cluster {
        client,
        kubeconfig: kubeconfig.to_path_buf(),
    })
}

impl Cluster {
    /// Creates a namespace with a unique name starting with `prefix`.
    pub async fn temp_namespace(&self, prefix: &str) -> Result<String> {
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "generateName": format!("{prefix}-") }
        }))?;
        let created = Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("cannot create a namespace for {prefix}"))?;
        let name = created
            .metadata
            .name
            .context("the API server returned a namespace without a name")?;
        wait_for_default_service_account(&self.client, &name).await?;
        Ok(name)
    }

    /// Deletes a namespace and does not wait for it to go.
    pub async fn delete_namespace(&self, name: &str) -> Result<()> {
        Api::<Namespace>::all(self.client.clone())
            .delete(name, &DeleteParams::background())
            .await
            .with_context(|| format!("cannot delete namespace {name}"))?;
        Ok(())
    }

    /// Creates `pod`, waits until it has succeeded or failed, and returns its phase and log.
    pub async fn run_pod_to_completion(
        &self,
        namespace: &str,
        pod: &Pod,
        timeout: Duration,
    ) -> Result<(String, String)> {
        let pods = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let created = pods
            .create(&PostParams::default(), pod)
            .await
            .context("cannot create the pod")?;
        let name = created.metadata.name.context("created pod has no name")?;
        let done = await_condition(pods.clone(), &name, |p: Option<&Pod>| {
            matches!(pod_phase(p), Some("Succeeded" | "Failed"))
        });
        let finished = match tokio::time::timeout(timeout, done).await {
            Ok(r) => r.context("watching the pod failed")?,
            Err(_) => {
                let state = pods.get(&name).await.ok().and_then(|p| p.status);
                bail!("pod {namespace}/{name} did not finish within {timeout:?}; status: {state:?}")
            }
        };
        let phase = pod_phase(finished.as_ref())
            .unwrap_or("Unknown")
            .to_string();
        let log = pods
            .logs(&name, &LogParams::default())
            .await
            .with_context(|| format!("cannot read the log of pod {namespace}/{name}"))?;
        Ok((phase, log))
    }
}

fn pod_phase(p: Option<&Pod>) -> Option<&str> {
    p?.status.as_ref()?.phase.as_deref()
}

/// A pod that runs `script` with `/bin/sh -c` in the busybox image, never restarted.
pub fn busybox_pod(name: &str, script: &str) -> Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
            }],
        }
    }))?)
}

/// Polls `check` every 500 ms until it says true; an error from it, or `timeout`, ends the
/// wait with an error naming `what`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Test data: xorshift64, the same bytes on every run and machine (one definition, in
/// sealed-test-support).
pub use sealed_test_support::pseudo_random;

/// Waits until namespace `ns` has its `default` ServiceAccount: pods are refused until the
/// controller-manager has made it, which lags by seconds on a freshly started cluster.
pub async fn wait_for_default_service_account(client: &Client, ns: &str) -> Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while accounts.get_opt("default").await?.is_none() {
        if std::time::Instant::now() > deadline {
            bail!(
                "namespace {ns} has no default ServiceAccount after 60 s: is \
                 kube-controller-manager running?"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Wraps a static binary into an image `reference` (`NAME:TAG`) with
/// `hack/images.sh binary` and imports it into the running cluster; `extra` entries are
/// `SRC[:DEST]` files to add. Returns the image archive's path.
pub fn image_from_binary(reference: &str, binary: &Path, extra: &[&str]) -> Result<PathBuf> {
    let script = repo_root().join("hack/images.sh");
    let out = Command::new(&script)
        .arg("binary")
        .arg(reference)
        .arg(binary)
        .args(extra)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} binary {reference} failed ({})",
            script.display(),
            out.status
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let archive = stdout
        .lines()
        .last()
        .context("hack/images.sh printed no archive path")?;
    Ok(PathBuf::from(archive))
}

/// Server-side applies both sealed CRDs as field manager `manager`, waits until each is
/// Established, then until both resources are served (discovery lags the condition).
pub async fn install_crds(client: &Client, manager: &str) -> Result<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{ListParams, Patch, PatchParams};
    use kube::runtime::wait::conditions;
    use sealed_crds::{SealedVolume, SealedVolumeVersion};

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in sealed_crds::crds() {
        let name = crd.metadata.name.clone().context("CRD without a name")?;
        crds.patch(
            &name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&crd),
        )
        .await
        .with_context(|| format!("the API server refused CRD {name}"))?;
        let established = await_condition(crds.clone(), &name, conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established)
            .await
            .with_context(|| format!("CRD {name} not established within 30 s"))??;
    }
    for _ in 0..50 {
        let volumes = Api::<SealedVolume>::all(client.clone())
            .list(&ListParams::default())
            .await;
        let versions = Api::<SealedVolumeVersion>::all(client.clone())
            .list(&ListParams::default())
            .await;
        if volumes.is_ok() && versions.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the sealed CRDs are not served 10 s after they were established")
}
