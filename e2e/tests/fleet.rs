//! The fleet as pods (issue 37): the chart with the peer tier on, on three real nodes of the
//! test cluster (`hack/cluster.sh up --nodes 3`), one of them labelled an L4 instance.
//!
//! 1. The images (`hack/images.sh sealed`, tag `fleet`, and the `tree-b3` reader) go into the
//!    containerd of both eligible nodes; the chart is installed (peer tier and mutual TLS on,
//!    the chart's defaults; warming allowed) with a moto store behind a proxy that counts the
//!    bytes moto sends (moto listens on loopback: pods reach the store only through the
//!    count). The node plugin runs on `sealed-node` and `sealed-node-2` only, never on the L4
//!    node `sealed-node-3`; the peers' EndpointSlice lists exactly those two plugin pods, ready,
//!    and each plugin's own view (`sealed_peer_members` on its /metrics) has both: what an
//!    operator checks before trusting the tier (the slices do not say every plugin saw them).
//! 2. A version (`SEALED_FLEET_MIB`, default 96 MiB) pushed for an upload volume: reader pods on
//!    both nodes read it at once; every file's BLAKE3 is right, the origin served at most 1.3×
//!    the version (counted at the origin), and the plugins served each other chunks
//!    (`sealed_peer_served_bytes_total`, scraped from each plugin pod).
//! 3. A pod with the volume and no node: the scheduler places it on an eligible node, never on
//!    the L4 one (the admission webhook gives it the plugin's GPU exclusion).
//! 4. `spec.warm.nodes: 1`: exactly one plugin warms the next version (one `Warmed` Event);
//!    a reader on the other node then gets a share of the chunks from the warmed node and the
//!    origin serves less than the version for that read.
//! 5. A plugin pod deleted mid-read (the origin capped so that a cold read lasts ~10 s): the
//!    other node's reader finishes right, the new plugin rejoins (both views have both again)
//!    and the first node's reader, its mount held by the fd holder, resumes and finishes right.
//! 6. `helm upgrade` changing the plugin's image (`node.image.tag`: the same bytes re-tagged in
//!    both nodes' containerd) while a busybox pod on each eligible node reads a version in a
//!    loop (`sealed_e2e::upgrade::READER_SCRIPT`, as `tests/rollout.rs`): the node DaemonSet
//!    rolls one node, then the other; no read fails, none reads other bytes, both read on.
//!    Printed: reads and failures per pod, the longest pause between two reads, and each
//!    node's roll (old plugin pod gone -> new one Ready).
//!
//! After each read the plugins' peer series are printed (requests, failures, revived owners,
//! served bytes, ...), so a bound that fails says why.
//!
//! Cleanup whatever happens: pods, versions, `helm uninstall`, the namespace, and the extra
//! nodes (`hack/cluster.sh down --extra-nodes`), so the shared cluster is as it was.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`; needs root, moto_server, helm
//! (`hack/build-k8s.sh`) and the workspace's binaries (`cargo test --workspace` builds them).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use object_store::aws::AmazonS3Builder;
use object_store::prefix::PrefixStore;
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_e2e::fleet::{
    CountingProxy, ExtraNodes, FIRST_NODE, FIRST_NODE_IP, FLEET_KEY, Helm, import_image,
    metric_sum, remove_images_on, scrape, tag_image_on, workspace_binary,
};
use sealed_e2e::upgrade::{MOUNT, READER_SCRIPT, Read, epoch_now, reads};
use sealed_e2e::{BUSYBOX_IMAGE, Cluster, wait_for};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress};
use sha2::Digest as _;

const RELEASE: &str = "fleet";
const DRIVER: &str = "csi.sealedvolumes.io";
const IMAGE_TAG: &str = "fleet";
/// The plugin's image tag after `helm upgrade` (the same bytes, re-tagged on each node).
const IMAGE_TAG_AFTER: &str = "fleet-2";
const READER_IMAGE: &str = "sealed.local/tree-b3:fleet";
const STORE_BUCKET: &str = "fleet-store";
const STORE_PREFIX: &str = "sealed";
const REGION: &str = "us-east-1";
const GPU_LABEL: &str = "nvidia.com/gpu.product";
/// The third node, labelled as an L4 instance: the chart's default exclusion keeps the plugin off it.
const L4_NODE: &str = "sealed-node-3";
const SECOND_NODE: &str = "sealed-node-2";
/// Every metrics port of the plugin (chart `metrics.nodePort`).
const METRICS_PORT: u16 = 9809;

fn started() -> Instant {
    static T: OnceLock<Instant> = OnceLock::new();
    *T.get_or_init(Instant::now)
}

/// Progress on stderr straight away (the harness captures println of passing tests).
fn say(msg: impl Display) {
    let _ = writeln!(
        std::io::stderr(),
        "[fleet {:>5.1}s] {msg}",
        started().elapsed().as_secs_f64()
    );
}

/// The version's size in MiB (`SEALED_FLEET_MIB`, default 96; at least 8).
fn version_mib() -> usize {
    std::env::var("SEALED_FLEET_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96usize)
        .max(8)
}

/// Polls `check` every 500 ms until it gives `Some`, or fails after `timeout` naming `what`.
async fn poll_some<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A seed of this run: the first node's disk cache (a host directory) outlives a run, so a
/// version made of the same bytes again would be read from it, not from the peers or the origin.
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

struct Fleet {
    cluster: Cluster,
    helm: Helm,
    ns: String,
    store: ChunkStore,
    proxy: CountingProxy,
}

impl Fleet {
    fn client(&self) -> Client {
        self.cluster.client.clone()
    }
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn versions(&self) -> Api<SealedVolumeVersion> {
        Api::namespaced(self.client(), &self.ns)
    }
    fn volumes(&self) -> Api<SealedVolume> {
        Api::namespaced(self.client(), &self.ns)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleet_of_pods_reads_once_from_the_origin() {
    started();
    let Some(cluster) = sealed_e2e::cluster("fleet").await else {
        return;
    };
    let Some(moto) = sealed_test_support::start_moto(STORE_BUCKET, false) else {
        return;
    };
    let nodes = ExtraNodes::up(3, &[&format!("{L4_NODE}:{GPU_LABEL}=NVIDIA-L4")])
        .expect("hack/cluster.sh up --nodes 3");
    say(format!("nodes up: {FIRST_NODE} and {:?}", nodes.names()));
    let result = async {
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
        let ns = cluster.temp_namespace("fleet").await?;
        let fleet = Fleet {
            helm: Helm::new(&cluster.kubeconfig)?,
            cluster: cluster.clone(),
            ns,
            store,
            proxy,
        };
        let r = steps(&fleet).await;
        if r.is_err() {
            dump_state(&fleet).await;
        }
        cleanup(&fleet).await;
        r
    }
    .await;
    let down = nodes.down();
    say("extra nodes removed");
    result.expect("the fleet test failed");
    down.expect("hack/cluster.sh down --extra-nodes");
}

async fn steps(f: &Fleet) -> Result<()> {
    install(f).await?;
    let model = read_at_once(f).await?;
    scheduled_on_an_eligible_node(f, &model).await?;
    warm_one_node(f).await?;
    plugin_deleted_mid_read(f).await?;
    upgrade_rolls_across_nodes(f).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 1. images, chart, placement and membership

fn sealed_images() -> Result<Vec<PathBuf>> {
    let script = sealed_e2e::repo_root().join("hack/images.sh");
    let out = Command::new(&script)
        .arg("sealed")
        .env("SEALED_OPERATOR_BIN", workspace_binary("sealed-operator")?)
        .env("SEALED_CSI_BIN", workspace_binary("sealed-csi")?)
        .env("SEALED_IMAGE_TAG", IMAGE_TAG)
        .env("SEALED_IMAGES_IMPORT", "0")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    ensure!(
        out.status.success(),
        "hack/images.sh sealed failed ({})",
        out.status
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect())
}

/// `helm install|upgrade` of the release with the test's values (a user's values file, the
/// same for both), plus `extra` `--set` values.
fn release(f: &Fleet, verb: &str, extra: &[String]) -> Result<String> {
    let endpoint = format!("http://{}", f.proxy.addr());
    let sets = [
        format!("fullnameOverride={RELEASE}"),
        "image.repository=sealed.local".to_string(),
        format!("image.tag={IMAGE_TAG}"),
        "image.pullPolicy=IfNotPresent".into(),
        format!("store.url=s3://{STORE_BUCKET}/{STORE_PREFIX}"),
        format!("store.endpoint={endpoint}"),
        format!("store.region={REGION}"),
        "store.credentials.AWS_ACCESS_KEY_ID=test".into(),
        "store.credentials.AWS_SECRET_ACCESS_KEY=test".into(),
        "operator.uploadPoll=2s".into(),
        "operator.gcInterval=0".into(),
        "cache.size=2Gi".into(),
        "warming.allow=all".into(),
    ];
    let mut args: Vec<String> = [
        verb,
        RELEASE,
        "charts/sealed-volumes",
        "-n",
        f.ns.as_str(),
        "--take-ownership",
    ]
    .map(String::from)
    .into();
    for s in sets.iter().chain(extra) {
        args.extend(["--set".to_string(), s.clone()]);
    }
    let watch = format!(r#"operator.extraArgs=["--watch-namespace={}"]"#, f.ns);
    args.extend(["--set-json".to_string(), watch]);
    f.helm
        .run(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn install(f: &Fleet) -> Result<()> {
    let t = Instant::now();
    let mut archives = sealed_images()?;
    // Imported into the first node's containerd by the helper; the other node's below.
    let reader = PathBuf::from(env!("CARGO_BIN_EXE_tree-b3"));
    let reader_archive = sealed_e2e::image_from_binary(READER_IMAGE, &reader, &[])?;
    for a in &archives {
        import_image(FIRST_NODE, a)?;
    }
    archives.push(reader_archive);
    for a in &archives {
        import_image(SECOND_NODE, a)?;
    }
    say(format!(
        "images built and imported into {FIRST_NODE} and {SECOND_NODE} in {:.0} s",
        t.elapsed().as_secs_f64()
    ));

    sealed_e2e::install_crds(&f.client(), "sealed-e2e-fleet").await?;
    release(f, "install", &[])?;
    say(format!(
        "helm install {RELEASE} -n {} (peer tier and mTLS on: the chart's defaults; the \
         plugin DaemonSet tolerates every taint, the fleet's too)",
        f.ns
    ));

    let deployments: Api<Deployment> = Api::namespaced(f.client(), &f.ns);
    wait_for("the operator ready", Duration::from_secs(120), || async {
        let d = deployments.get(&format!("{RELEASE}-operator")).await?;
        Ok(d.status.and_then(|s| s.ready_replicas).unwrap_or(0) >= 1)
    })
    .await?;
    let daemonsets: Api<DaemonSet> = Api::namespaced(f.client(), &f.ns);
    let ds_name = format!("{RELEASE}-node");
    wait_for(
        "the plugin DaemonSet ready on its nodes",
        Duration::from_secs(180),
        || async {
            let s = daemonsets.get(&ds_name).await?.status.unwrap_or_default();
            Ok(s.desired_number_scheduled >= 1
                && s.number_ready == s.desired_number_scheduled
                && s.updated_number_scheduled.unwrap_or(0) == s.desired_number_scheduled)
        },
    )
    .await?;
    let status = daemonsets.get(&ds_name).await?.status.unwrap_or_default();
    let plugins = plugin_pods(f).await?;
    let on: BTreeSet<String> = plugins.keys().cloned().collect();
    let want: BTreeSet<String> = [FIRST_NODE.to_string(), SECOND_NODE.to_string()].into();
    ensure!(
        status.desired_number_scheduled == 2 && on == want,
        "the plugin should run on {want:?} only (not on the L4 node {L4_NODE}): the DaemonSet \
         wants {} pods, runs on {on:?}",
        status.desired_number_scheduled
    );
    say(format!(
        "the plugin runs on {on:?} (desiredNumberScheduled {}), not on {L4_NODE} \
         ({GPU_LABEL}=NVIDIA-L4)",
        status.desired_number_scheduled
    ));

    // Membership: the peers' EndpointSlices list exactly those pods, ready.
    let slices: Api<EndpointSlice> = Api::namespaced(f.client(), &f.ns);
    let selector = format!("kubernetes.io/service-name={RELEASE}-peers");
    let want_members: BTreeSet<(String, String)> = plugins
        .iter()
        .map(|(node, (_, ip))| (node.clone(), ip.clone()))
        .collect();
    let seen = poll_some(
        "the peers' EndpointSlices to list both plugins",
        Duration::from_secs(60),
        || {
            let (slices, selector, want) = (slices.clone(), selector.clone(), want_members.clone());
            async move {
                let members = ready_members(&slices, &selector).await?;
                Ok((members == want).then_some(members))
            }
        },
    )
    .await;
    if seen.is_err() {
        let members = ready_members(&slices, &selector).await?;
        bail!("the peers' EndpointSlices list {members:?}, the plugin pods are {want_members:?}");
    }
    say(format!(
        "membership from the EndpointSlices of {RELEASE}-peers: {want_members:?} (node, pod IP), \
         both ready"
    ));
    let views = wait_for_peer_views(f, 2, Duration::from_secs(60)).await?;
    say(format!(
        "every plugin's own view of the fleet (sealed_peer_members on its /metrics): {views:?}"
    ));
    Ok(())
}

/// Waits until every plugin pod's own view of the fleet (`sealed_peer_members`, scraped from
/// its /metrics) has `n` members and there are `n` plugin pods: what an operator checks before
/// trusting the tier. The EndpointSlices listing every plugin do not say that each plugin has
/// seen them yet. A plugin not answering yet counts as not there.
async fn wait_for_peer_views(
    f: &Fleet,
    n: usize,
    timeout: Duration,
) -> Result<BTreeMap<String, f64>> {
    let want = n as f64;
    let mut last = BTreeMap::new();
    let deadline = Instant::now() + timeout;
    loop {
        last.clear();
        for (node, (_, ip)) in plugin_pods(f).await? {
            let addr: SocketAddr = format!("{ip}:{METRICS_PORT}").parse()?;
            let members = match scrape(addr).await {
                Ok(text) => metric_sum(&text, "sealed_peer_members"),
                Err(_) => -1.0,
            };
            last.insert(node, members);
        }
        if last.len() == n && last.values().all(|m| *m == want) {
            return Ok(last);
        }
        if Instant::now() > deadline {
            bail!(
                "after {timeout:?} the plugins' views of the fleet are {last:?} \
                 (sealed_peer_members by node, -1: not scraped), not {n} plugins seeing {n}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The plugin pods by node: (pod name, pod IP).
async fn plugin_pods(f: &Fleet) -> Result<BTreeMap<String, (String, String)>> {
    let lp = ListParams::default().labels("app.kubernetes.io/component=node");
    let mut out = BTreeMap::new();
    for p in f.pods().list(&lp).await?.items {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
        if let (Some(node), Some(ip)) = (node, ip) {
            out.insert(node, (p.name_any(), ip));
        }
    }
    Ok(out)
}

async fn ready_members(
    slices: &Api<EndpointSlice>,
    selector: &str,
) -> Result<BTreeSet<(String, String)>> {
    let mut out = BTreeSet::new();
    for s in slices
        .list(&ListParams::default().labels(selector))
        .await?
        .items
    {
        for e in s.endpoints {
            let c = e.conditions.unwrap_or_default();
            if c.ready == Some(true) && c.terminating != Some(true) {
                for a in e.addresses {
                    out.insert((e.node_name.clone().unwrap_or_default(), a));
                }
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// 2. both nodes read one version at once

/// `files` files of pseudo-random bytes making `mib` MiB in all; each file's BLAKE3 line as
/// tree-b3 prints it.
fn write_version(dir: &std::path::Path, mib: usize, seed: u64) -> Result<Vec<String>> {
    let files = 4usize;
    let each = mib.checked_mul(1 << 20).context("version size overflows")? / files;
    let mut sums = Vec::new();
    for i in 0..files {
        let name = format!("shard-{i}.safetensors");
        let bytes = sealed_e2e::pseudo_random(each, seed.wrapping_add(i as u64));
        std::fs::write(dir.join(&name), &bytes)?;
        sums.push(format!("{}  {name}", blake3::hash(&bytes).to_hex()));
    }
    sums.sort();
    Ok(sums)
}

/// Pushes a version of `mib` MiB for volume `volume` (its store record makes the operator
/// import it) and waits for its Ready SealedVolumeVersion.
async fn push_version(
    f: &Fleet,
    volume: &str,
    mib: usize,
    seed: u64,
) -> Result<(Digest, Vec<String>, u64, SealedVolumeVersion)> {
    let dir = tempfile::tempdir()?;
    let sums = write_version(dir.path(), mib, seed)?;
    let opts = PushOptions {
        volume: Some(format!("{}/{volume}", f.ns)),
        ..Default::default()
    };
    let report = push(&f.store, dir.path(), &opts, Arc::new(NoProgress)).await?;
    let digest = report.digest;
    let want = digest.to_string();
    let versions = f.versions();
    let version = poll_some(
        &format!("a Ready SealedVolumeVersion of {volume} with {want}"),
        Duration::from_secs(120),
        || {
            let (versions, want) = (versions.clone(), want.clone());
            async move {
                let list = versions.list(&ListParams::default()).await?.items;
                Ok(list.into_iter().find(|v| {
                    v.spec.digest == want
                        && v.status
                            .as_ref()
                            .and_then(|s| s.condition(sealed_crds::CONDITION_READY))
                            .is_some_and(|c| c.status == "True")
                }))
            }
        },
    )
    .await?;
    let bytes = u64::try_from(mib)?
        .checked_mul(1 << 20)
        .context("version size overflows")?;
    Ok((digest, sums, bytes, version))
}

fn reader_pod(name: &str, node: Option<&str>, digest: &Digest) -> Result<Pod> {
    let mut pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{ "key": FLEET_KEY, "operator": "Exists", "effect": "NoSchedule" }],
            "containers": [{
                "name": "main",
                "image": READER_IMAGE,
                "imagePullPolicy": "Never",
                "args": ["/model"],
                "volumeMounts": [{ "name": "model", "mountPath": "/model", "readOnly": true }],
            }],
            "volumes": [{
                "name": "model",
                "csi": {
                    "driver": DRIVER,
                    "readOnly": true,
                    "volumeAttributes": { "digest": digest.to_string() },
                },
            }],
        }
    }))?;
    if let (Some(node), Some(spec)) = (node, pod.spec.as_mut()) {
        spec.node_name = Some(node.to_string());
    }
    Ok(pod)
}

/// Waits for each pod to succeed and returns the sums each printed.
async fn sums_of(f: &Fleet, names: &[String]) -> Result<BTreeMap<String, Vec<String>>> {
    let pods = f.pods();
    let mut out = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    for name in names {
        loop {
            let p = pods.get(name).await?;
            let phase = p.status.as_ref().and_then(|s| s.phase.clone());
            match phase.as_deref() {
                Some("Succeeded") => break,
                Some("Failed") => {
                    let log = pods
                        .logs(name, &LogParams::default())
                        .await
                        .unwrap_or_default();
                    bail!("reader {name} failed; log:\n{log}");
                }
                _ => {}
            }
            if Instant::now() > deadline {
                bail!(
                    "reader {name} did not finish within 300 s: {:?}",
                    p.status.map(|s| (s.phase, s.container_statuses))
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let log = pods.logs(name, &LogParams::default()).await?;
        let (sums, _) = log
            .split_once("TREE-B3-DONE")
            .with_context(|| format!("reader {name} printed no TREE-B3-DONE:\n{log}"))?;
        let mut sums: Vec<String> = sums.lines().map(str::to_string).collect();
        sums.sort();
        out.insert(name.clone(), sums);
    }
    Ok(out)
}

/// Each plugin's counter `name`, by node.
async fn plugin_metric(f: &Fleet, name: &str) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for (node, (_, ip)) in plugin_pods(f).await? {
        let text = scrape(format!("{ip}:{METRICS_PORT}").parse()?).await?;
        out.insert(node, metric_sum(&text, name));
    }
    Ok(out)
}

/// The peer tier's series that tell how a read went, by node (for the log: a failed bound
/// then says whether an owner was refused, timed out, marked down or missing from a view).
const PEER_SERIES: [&str; 15] = [
    "sealed_peer_members",
    "sealed_peer_requests_total",
    "sealed_peer_hits_total",
    "sealed_peer_request_failures_total",
    "sealed_peer_request_timeouts_total",
    "sealed_peer_skipped_down_total",
    "sealed_peer_revived_total",
    "sealed_peer_owned_here_total",
    "sealed_peer_served_bytes_total",
    "sealed_peer_served_rejected_total",
    "sealed_peer_served_busy_total",
    "sealed_peer_tls_refused_total",
    "sealed_peer_served_errors_total",
    "sealed_peer_body_timeouts_total",
    "sealed_peer_stalls_total",
];

/// [`PEER_SERIES`] of every plugin, one line per node (`-` for a plugin not scraped).
async fn peer_report(f: &Fleet) -> String {
    let mut lines = Vec::new();
    let Ok(plugins) = plugin_pods(f).await else {
        return "plugin pods not listed".into();
    };
    for (node, (pod, ip)) in plugins {
        let text = match format!("{ip}:{METRICS_PORT}").parse() {
            Ok(addr) => scrape(addr).await.ok(),
            Err(_) => None,
        };
        let values: Vec<String> = PEER_SERIES
            .iter()
            .map(|name| {
                let short = name
                    .trim_start_matches("sealed_peer_")
                    .trim_end_matches("_total");
                match &text {
                    Some(t) => format!("{short}={}", metric_sum(t, name)),
                    None => format!("{short}=-"),
                }
            })
            .collect();
        lines.push(format!("  {node} ({pod}): {}", values.join(" ")));
    }
    lines.join("\n")
}

async fn read_at_once(f: &Fleet) -> Result<Digest> {
    let mib = version_mib();
    f.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "sealedvolumes.io/v1alpha1",
                "kind": "SealedVolume",
                "metadata": { "name": "model" },
                "spec": { "source": { "upload": {} } },
            }))?,
        )
        .await
        .context("creating SealedVolume model")?;
    let (digest, sums, bytes, _) = push_version(f, "model", mib, run_seed()).await?;
    say(format!("version {digest} ({mib} MiB, 4 files) Ready"));

    let served_before = plugin_metric(f, "sealed_peer_served_bytes_total").await?;
    let origin_before = f.proxy.served();
    let t = Instant::now();
    let names: Vec<String> = [FIRST_NODE, SECOND_NODE]
        .iter()
        .map(|n| format!("read-{n}"))
        .collect();
    for (name, node) in names.iter().zip([FIRST_NODE, SECOND_NODE]) {
        f.pods()
            .create(
                &PostParams::default(),
                &reader_pod(name, Some(node), &digest)?,
            )
            .await
            .with_context(|| format!("creating reader {name}"))?;
    }
    let got = sums_of(f, &names).await?;
    let secs = t.elapsed().as_secs_f64();
    for (name, s) in &got {
        ensure!(
            *s == sums,
            "reader {name} read wrong bytes:\n got {s:?}\nwant {sums:?}"
        );
    }
    let origin = f.proxy.served().saturating_sub(origin_before);
    let served_after = plugin_metric(f, "sealed_peer_served_bytes_total").await?;
    let served: BTreeMap<&String, f64> = served_after
        .iter()
        .map(|(n, v)| (n, v - served_before.get(n).copied().unwrap_or(0.0)))
        .collect();
    let ratio = origin as f64 / bytes as f64;
    say(format!(
        "2 readers (one per node) read {mib} MiB each, every file's BLAKE3 right, in {secs:.1} s; \
         origin served {origin} bytes for a {bytes}-byte version: {ratio:.3}x (bound 1.3x); \
         peers served {served:?} bytes; the plugins' peer series:\n{}",
        peer_report(f).await
    ));
    ensure!(
        ratio <= 1.3,
        "the origin served {origin} bytes for a {bytes}-byte version read on 2 nodes: {ratio:.3}x \
         > 1.3x (peers served {served:?})"
    );
    ensure!(
        served.values().sum::<f64>() > 0.0,
        "no plugin served a peer any byte: {served:?}"
    );
    for name in &names {
        f.pods().delete(name, &DeleteParams::default()).await?;
    }
    Ok(digest)
}

// ---------------------------------------------------------------------------------------
// 3. the scheduler's choice

async fn scheduled_on_an_eligible_node(f: &Fleet, digest: &Digest) -> Result<()> {
    let name = "read-anywhere";
    f.pods()
        .create(&PostParams::default(), &reader_pod(name, None, digest)?)
        .await
        .context("creating a reader without a node")?;
    let pods = f.pods();
    let node = poll_some(
        "the scheduler to place the reader",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move { Ok(pods.get(name).await?.spec.and_then(|s| s.node_name)) }
        },
    )
    .await?;
    ensure!(
        node == FIRST_NODE || node == SECOND_NODE,
        "a pod with a sealed volume (tolerating the fleet taint) was scheduled on {node}, not on \
         a node with the plugin"
    );
    let affinity = pods
        .get(name)
        .await?
        .spec
        .and_then(|s| s.affinity)
        .map(|a| serde_json::to_string(&a))
        .transpose()?
        .unwrap_or_default();
    say(format!(
        "a reader with no node was scheduled on {node} (eligible; {} GPU exclusion in its \
         affinity: {})",
        if affinity.contains(GPU_LABEL) {
            "with the"
        } else {
            "without a"
        },
        if affinity.is_empty() {
            "none"
        } else {
            &affinity
        }
    ));
    let _ = sums_of(f, &[name.to_string()]).await?;
    f.pods().delete(name, &DeleteParams::default()).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 4. warming one node, which serves the other

async fn warm_one_node(f: &Fleet) -> Result<()> {
    let mib = (version_mib() / 2).max(8);
    f.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "sealedvolumes.io/v1alpha1",
                "kind": "SealedVolume",
                "metadata": { "name": "warm" },
                "spec": { "source": { "upload": {} }, "warm": { "nodes": 1 } },
            }))?,
        )
        .await
        .context("creating SealedVolume warm")?;
    let origin_before_push = f.proxy.served();
    let (digest, sums, bytes, version) =
        push_version(f, "warm", mib, run_seed().wrapping_add(100)).await?;
    let annotation = version
        .annotations()
        .get(sealed_crds::WARM_ANNOTATION)
        .cloned();
    ensure!(
        annotation.as_deref() == Some("1"),
        "the operator stamped {:?} on the warm volume's version, not \"1\"",
        annotation
    );
    let events: Api<Event> = Api::namespaced(f.client(), &f.ns);
    let vname = version.name_any();
    let fields = format!("involvedObject.name={vname}");
    let warmed_events = |events: Api<Event>, fields: String| async move {
        Ok::<_, anyhow::Error>(
            events
                .list(&ListParams::default().fields(&fields))
                .await?
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("Warmed"))
                .collect::<Vec<Event>>(),
        )
    };
    poll_some("a Warmed Event", Duration::from_secs(120), || {
        let w = warmed_events(events.clone(), fields.clone());
        async move { Ok(Some(w.await?).filter(|w| !w.is_empty())) }
    })
    .await?;
    // Any second node would have warmed by now too: give it a moment, then count.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let warmed = warmed_events(events.clone(), fields.clone()).await?;
    let hosts: BTreeSet<String> = warmed
        .iter()
        .filter_map(|e| e.source.as_ref().and_then(|s| s.host.clone()))
        .collect();
    ensure!(
        hosts.len() == 1,
        "spec.warm.nodes 1: Warmed Events from {hosts:?}: {:?}",
        warmed.iter().map(|e| e.message.clone()).collect::<Vec<_>>()
    );
    let warm_node = hosts.into_iter().next().context("no host")?;
    let cold_node = if warm_node == FIRST_NODE {
        SECOND_NODE
    } else {
        FIRST_NODE
    };
    let warm_origin = f.proxy.served().saturating_sub(origin_before_push);
    say(format!(
        "spec.warm.nodes 1: {warm_node} alone warmed {digest} ({mib} MiB; the origin served {} \
         bytes meanwhile, {:.3}x): {:?}",
        warm_origin,
        warm_origin as f64 / bytes as f64,
        warmed.first().and_then(|e| e.message.clone())
    ));

    let served_before = plugin_metric(f, "sealed_peer_served_bytes_total").await?;
    let origin_before = f.proxy.served();
    let name = "read-cold".to_string();
    f.pods()
        .create(
            &PostParams::default(),
            &reader_pod(&name, Some(cold_node), &digest)?,
        )
        .await?;
    let got = sums_of(f, std::slice::from_ref(&name)).await?;
    ensure!(
        got.get(&name) == Some(&sums),
        "reader on {cold_node} read wrong bytes"
    );
    let origin = f.proxy.served().saturating_sub(origin_before);
    let served_after = plugin_metric(f, "sealed_peer_served_bytes_total").await?;
    let by_warm = served_after.get(&warm_node).copied().unwrap_or(0.0)
        - served_before.get(&warm_node).copied().unwrap_or(0.0);
    say(format!(
        "a reader on {cold_node} read the warmed version right: {warm_node} served it {by_warm:.0} \
         bytes ({:.2} of the version), the origin {origin} ({:.3}x; the chunks {cold_node} owns \
         itself come from the origin, by design)",
        by_warm / bytes as f64,
        origin as f64 / bytes as f64
    ));
    ensure!(
        by_warm >= 0.25 * bytes as f64,
        "the warmed node {warm_node} served {by_warm} bytes of a {bytes}-byte version to \
         {cold_node}: less than a quarter"
    );
    ensure!(
        origin < bytes,
        "the origin served {origin} bytes for the read on {cold_node} of a warmed {bytes}-byte \
         version: the warm saved nothing"
    );
    f.pods().delete(&name, &DeleteParams::default()).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 5. a plugin pod deleted mid-read

/// Readers on both nodes read a new version cold, the origin capped so that the read lasts;
/// in its middle the first node's plugin pod is deleted. The other node's reader goes on
/// (the gone owner's chunks from the origin) and finishes with every byte right; the
/// DaemonSet's new plugin rejoins the fleet (both plugins' views have both again), and the
/// first node's reader, whose mount the fd holder kept, resumes and finishes right too
/// (docs/csi.md, "Restart safety": reads pause and go on).
async fn plugin_deleted_mid_read(f: &Fleet) -> Result<()> {
    let mib = version_mib();
    f.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "sealedvolumes.io/v1alpha1",
                "kind": "SealedVolume",
                "metadata": { "name": "restart" },
                "spec": { "source": { "upload": {} } },
            }))?,
        )
        .await
        .context("creating SealedVolume restart")?;
    let (digest, sums, bytes, _) =
        push_version(f, "restart", mib, run_seed().wrapping_add(200)).await?;
    // About 10 s of origin bytes for the fleet's one copy: the deletion lands mid-read.
    let rate = (bytes / 10).max(1 << 20);
    f.proxy.limit_rate(Some(rate));
    let result = async {
        let origin_before = f.proxy.served();
        let names: Vec<String> = [FIRST_NODE, SECOND_NODE]
            .iter()
            .map(|n| format!("restart-{n}"))
            .collect();
        for (name, node) in names.iter().zip([FIRST_NODE, SECOND_NODE]) {
            f.pods()
                .create(
                    &PostParams::default(),
                    &reader_pod(name, Some(node), &digest)?,
                )
                .await
                .with_context(|| format!("creating reader {name}"))?;
        }
        let proxy = &f.proxy;
        let at_deletion = poll_some(
            "the readers to have read an eighth of the version",
            Duration::from_secs(120),
            || async move {
                let served = proxy.served().saturating_sub(origin_before);
                Ok((served >= bytes / 8).then_some(served))
            },
        )
        .await?;
        let (victim, _) = plugin_pods(f)
            .await?
            .remove(FIRST_NODE)
            .context("no plugin pod on the first node")?;
        let deleted = Instant::now();
        f.pods().delete(&victim, &DeleteParams::default()).await?;
        say(format!(
            "deleted the plugin pod {victim} on {FIRST_NODE} mid-read (the origin had sent \
             {at_deletion} of the {bytes}-byte version, capped at {rate} B/s)"
        ));

        let survivor = sums_of(f, &names[1..]).await?;
        ensure!(
            survivor.get(&names[1]) == Some(&sums),
            "the reader on {SECOND_NODE} read wrong bytes after {FIRST_NODE}'s plugin went"
        );
        say(format!(
            "the reader on {SECOND_NODE} went on and finished, every file's BLAKE3 right, {:.1} s \
             after the deletion",
            deleted.elapsed().as_secs_f64()
        ));

        let views = wait_for_peer_views(f, 2, Duration::from_secs(180)).await?;
        let back = plugin_pods(f)
            .await?
            .remove(FIRST_NODE)
            .map(|(name, _)| name)
            .unwrap_or_default();
        ensure!(
            back != victim,
            "the plugin pod on {FIRST_NODE} is still {victim}"
        );
        say(format!(
            "the DaemonSet's new plugin {back} on {FIRST_NODE} rejoined {:.1} s after the \
             deletion: the plugins' views {views:?}",
            deleted.elapsed().as_secs_f64()
        ));

        let resumed = sums_of(f, &names[..1]).await?;
        ensure!(
            resumed.get(&names[0]) == Some(&sums),
            "the reader on {FIRST_NODE} read wrong bytes across its plugin's restart"
        );
        let origin = f.proxy.served().saturating_sub(origin_before);
        say(format!(
            "the reader on {FIRST_NODE} (its mount held by the fd holder) resumed and finished \
             right {:.1} s after the deletion; the origin served {origin} bytes for this \
             version ({:.3}x: the gone plugin's chunks came from it)",
            deleted.elapsed().as_secs_f64(),
            origin as f64 / bytes as f64
        ));
        for name in &names {
            f.pods().delete(name, &DeleteParams::default()).await?;
        }
        Ok(())
    }
    .await;
    f.proxy.limit_rate(None);
    result
}

// ---------------------------------------------------------------------------------------
// 6. helm upgrade rolls the plugin across both nodes under readers

/// The plugin pods by node: (pod name, image, ready), terminating ones left out.
async fn plugin_states(f: &Fleet) -> Result<BTreeMap<String, (String, String, bool)>> {
    let lp = ListParams::default().labels("app.kubernetes.io/component=node");
    let mut out = BTreeMap::new();
    for p in f.pods().list(&lp).await?.items {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(spec) = p.spec.as_ref() else {
            continue;
        };
        let Some(node) = spec.node_name.clone() else {
            continue;
        };
        let image = spec
            .containers
            .first()
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        let ready = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        out.insert(node, (p.name_any(), image, ready));
    }
    Ok(out)
}

/// A busybox pod on `node` reading the volume's two files once a second
/// ([`READER_SCRIPT`]: every read opens the files anew, a FUSE request to the plugin).
fn loop_reader_pod(name: &str, node: &str, digest: &Digest) -> Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{ "key": FLEET_KEY, "operator": "Exists", "effect": "NoSchedule" }],
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", READER_SCRIPT],
                "volumeMounts": [{ "name": "model", "mountPath": MOUNT, "readOnly": true }],
            }],
            "volumes": [{
                "name": "model",
                "csi": {
                    "driver": DRIVER,
                    "readOnly": true,
                    "volumeAttributes": { "digest": digest.to_string() },
                },
            }],
        }
    }))?)
}

/// The reads a loop reader logged from `since` (epoch seconds) on.
async fn reads_of(f: &Fleet, pod: &str, since: u64) -> Result<Vec<Read>> {
    let log = f.pods().logs(pod, &LogParams::default()).await?;
    Ok(reads(&log).into_iter().filter(|r| r.at >= since).collect())
}

/// While a pod on each eligible node reads a version in a loop, `helm upgrade` changes the
/// plugin's image (`node.image.tag`: the same bytes re-tagged in both nodes' containerd, what
/// a release upgrade changes); the node DaemonSet rolls its pod on one node, then on the other
/// (maxUnavailable 10% of 2 nodes: one at a time). No read of either pod fails or reads other
/// bytes, and both read on after the roll.
async fn upgrade_rolls_across_nodes(f: &Fleet) -> Result<()> {
    let t = Instant::now();
    f.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "sealedvolumes.io/v1alpha1",
                "kind": "SealedVolume",
                "metadata": { "name": "loop" },
                "spec": { "source": { "upload": {} } },
            }))?,
        )
        .await
        .context("creating SealedVolume loop")?;
    let seed = run_seed().wrapping_add(300);
    let dir = tempfile::tempdir()?;
    let content = format!("loop-{seed:016x}");
    let data = sealed_e2e::pseudo_random(4 << 20, seed);
    std::fs::write(dir.path().join("version.txt"), format!("{content}\n"))?;
    std::fs::write(dir.path().join("data.bin"), &data)?;
    let reads_as = format!("{content} {:x}", sha2::Sha256::digest(&data));
    let opts = PushOptions {
        volume: Some(format!("{}/loop", f.ns)),
        ..Default::default()
    };
    let digest = push(&f.store, dir.path(), &opts, Arc::new(NoProgress))
        .await?
        .digest;
    let want = digest.to_string();
    let versions = f.versions();
    wait_for(
        &format!("a Ready SealedVolumeVersion with {want}"),
        Duration::from_secs(120),
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

    let nodes = [FIRST_NODE, SECOND_NODE];
    let names: Vec<String> = nodes.iter().map(|n| format!("loop-{n}")).collect();
    for (name, node) in names.iter().zip(nodes) {
        f.pods()
            .create(
                &PostParams::default(),
                &loop_reader_pod(name, node, &digest)?,
            )
            .await
            .with_context(|| format!("creating loop reader {name}"))?;
    }
    let start = epoch_now();
    wait_for(
        "both loop readers reading the version",
        Duration::from_secs(120),
        || async {
            for name in &names {
                let ok = match reads_of(f, name, start.saturating_sub(60)).await {
                    Ok(r) => r.iter().filter(|r| r.result.is_ok()).count(),
                    Err(_) => 0,
                };
                if ok < 2 {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await?;

    // The new image: the plugin's bytes under a second tag, in both nodes' containerd.
    let from = format!("sealed.local/sealed-csi:{IMAGE_TAG}");
    let to = format!("sealed.local/sealed-csi:{IMAGE_TAG_AFTER}");
    for node in nodes {
        tag_image_on(node, &from, &to)?;
    }
    let before = plugin_states(f).await?;
    let since = epoch_now();
    let upgraded = Instant::now();
    release(f, "upgrade", &[format!("node.image.tag={IMAGE_TAG_AFTER}")])?;
    say(format!(
        "2 pods reading {digest} once a second (one per node); helm upgrade {RELEASE} with \
         node.image.tag={IMAGE_TAG_AFTER} (the plugin's image re-tagged; the same values \
         otherwise); plugin pods before: {:?}",
        before
            .iter()
            .map(|(n, p)| (n, &p.0))
            .collect::<BTreeMap<_, _>>()
    ));

    // Each node's roll: its old plugin pod gone (terminating or absent) -> a new one Ready.
    let mut gone: BTreeMap<&str, Duration> = BTreeMap::new();
    let mut ready: BTreeMap<&str, Duration> = BTreeMap::new();
    let daemonsets: Api<DaemonSet> = Api::namespaced(f.client(), &f.ns);
    let ds_name = format!("{RELEASE}-node");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let now = plugin_states(f).await?;
        for node in nodes {
            let old = before.get(node).map(|p| p.0.as_str());
            let current = now.get(node);
            if current.map(|p| p.0.as_str()) != old {
                gone.entry(node).or_insert_with(|| upgraded.elapsed());
            }
            if let Some((name, image, true)) = current
                && Some(name.as_str()) != old
                && image.ends_with(&format!(":{IMAGE_TAG_AFTER}"))
            {
                ready.entry(node).or_insert_with(|| upgraded.elapsed());
            }
        }
        let s = daemonsets.get(&ds_name).await?.status.unwrap_or_default();
        if ready.len() == nodes.len()
            && s.desired_number_scheduled == 2
            && s.number_ready == 2
            && s.updated_number_scheduled == Some(2)
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the plugin DaemonSet did not roll to :{IMAGE_TAG_AFTER} on both nodes within 180 s: \
             pods {now:?}, gone {gone:?}, ready {ready:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let rolled = upgraded.elapsed();
    let mut rolls = Vec::new();
    for node in nodes {
        let (g, r) = (gone.get(node).copied(), ready.get(node).copied());
        let (Some(g), Some(r)) = (g, r) else {
            bail!("no roll seen on {node}: gone {g:?}, ready {r:?}");
        };
        rolls.push(format!(
            "{node}: old pod gone at {:.1} s, new pod Ready at {:.1} s ({:.1} s without a \
             ready plugin)",
            g.as_secs_f64(),
            r.as_secs_f64(),
            r.saturating_sub(g).as_secs_f64()
        ));
    }
    say(format!(
        "the plugin DaemonSet rolled to :{IMAGE_TAG_AFTER} across both nodes in {:.1} s (from \
         helm upgrade): {}",
        rolled.as_secs_f64(),
        rolls.join("; ")
    ));

    // Every read from the upgrade to after the roll: none failed, none read other bytes.
    let done = epoch_now();
    let mut lines = Vec::new();
    for name in &names {
        let deadline = Instant::now() + Duration::from_secs(30);
        let all = loop {
            let all = reads_of(f, name, since).await?;
            if all.iter().any(|r| r.at > done) {
                break all;
            }
            ensure!(
                Instant::now() < deadline,
                "{name} has not read since the roll ended (last: {:?})",
                all.last()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let bad: Vec<&Read> = all
            .iter()
            .filter(|r| r.result.as_ref() != Ok(&reads_as))
            .collect();
        let failed = all.iter().filter(|r| r.result.is_err()).count();
        let pause = all
            .windows(2)
            .map(|w| w[1].at.saturating_sub(w[0].at))
            .max()
            .unwrap_or(0);
        lines.push(format!(
            "{name}: {} reads, {failed} failed, {} wrong bytes, longest pause {pause} s",
            all.len(),
            bad.len().saturating_sub(failed)
        ));
        ensure!(
            bad.is_empty(),
            "{name}: {} of {} reads from the upgrade on failed or read other bytes; first: {:?}",
            bad.len(),
            all.len(),
            bad.first()
        );
    }
    say(format!(
        "no read failed across the roll, every read right (version.txt and data.bin's \
         SHA-256), reads up to {}s after it: {}; step {:.0} s",
        epoch_now().saturating_sub(done),
        lines.join("; "),
        t.elapsed().as_secs_f64()
    ));
    for name in &names {
        f.pods().delete(name, &DeleteParams::default()).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Diagnostics and cleanup

async fn dump_state(f: &Fleet) {
    say("===== state at failure");
    say(format!(
        "the plugins' peer series:\n{}",
        peer_report(f).await
    ));
    if let Ok(list) = f.pods().list(&ListParams::default()).await {
        for p in list.items {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let phase = p.status.as_ref().and_then(|s| s.phase.clone());
            say(format!("pod {} on {node:?}: {phase:?}", p.name_any()));
            let lp = LogParams {
                tail_lines: Some(30),
                container: p
                    .spec
                    .as_ref()
                    .and_then(|s| s.containers.first())
                    .map(|c| c.name.clone()),
                ..Default::default()
            };
            if let Ok(log) = f.pods().logs(&p.name_any(), &lp).await {
                say(format!("log of {}:\n{log}", p.name_any()));
            }
        }
    }
}

async fn cleanup(f: &Fleet) {
    say("cleanup");
    let pods = f.pods();
    let readers = ListParams::default().labels("!app.kubernetes.io/component");
    if let Ok(list) = pods.list(&readers).await {
        for p in list.items {
            let _ = pods.delete(&p.name_any(), &DeleteParams::default()).await;
        }
    }
    if wait_for("the readers to go", Duration::from_secs(60), || async {
        Ok(pods.list(&readers).await?.items.is_empty())
    })
    .await
    .is_err()
    {
        say("cleanup: reader pods still there after 60 s");
    }
    let _ = f
        .volumes()
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let versions = f.versions();
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
    if let Err(e) = f.helm.run(&["uninstall", RELEASE, "-n", &f.ns, "--wait"]) {
        say(format!("cleanup: {e:#}"));
    }
    if let Err(e) = f.cluster.delete_namespace(&f.ns).await {
        say(format!("cleanup: {e:#}"));
    }
    // The images this test imported into the first node (the extra nodes' go with them).
    remove_images_on(
        FIRST_NODE,
        &[
            format!("sealed.local/sealed-operator:{IMAGE_TAG}"),
            format!("sealed.local/sealed-csi:{IMAGE_TAG}"),
            format!("sealed.local/sealed-csi:{IMAGE_TAG_AFTER}"),
            READER_IMAGE.to_string(),
        ],
    );
}
