//! Pods on the real cluster (`hack/cluster.sh`: kubelet 1.34, containerd), with the real
//! `sealed-csi` binary running on the host, registered with kubelet through its own
//! `plugins_registry` socket (no node-driver-registrar), and a CSIDriver object
//! (`attachRequired: false`, `podInfoOnMount: true`, Ephemeral + Persistent).
//!
//! One test, in order: a pod with an inline volume by digest reads byte-identical files
//! (`sha256sum` of every file in the pod vs. the host's on the pushed tree); a second pod
//! shares the one FUSE mount (one FUSE mount + two binds in /proc/self/mountinfo, and the
//! plugin's metrics say so); a pod with a static ReadOnlyMany PersistentVolume of the digest
//! (through a claim) reads the same and adds a third bind; a pod in a namespace with only a
//! tenant-made (unattested) SealedVolumeVersion of the digest is refused (a FailedMount event
//! naming PermissionDenied and the missing attestation); the node publications Lease lists
//! the digest while pods use it, and not after; deleting a pod drops its bind
//! and keeps the FUSE mount for the other; the plugin is SIGKILLed and restarted while a pod
//! reads in a loop (what the pod sees is printed, and docs/csi.md says it); deleting the last
//! pod leaves nothing mounted; a pod started after the restart reads correct data.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`; needs root and /dev/fuse.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::Made;
use common::{FdHolder, Plugin, TestStore, can_mount, store_with_version};
use k8s_openapi::api::core::v1::{Event, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::{Api, Client};
use sealed_csi::DRIVER_NAME;
use sealed_e2e::wait_for;
use sealed_e2e::{BUSYBOX_IMAGE, Cluster};

const MANAGER: &str = "sealed-csi-pods-test";

/// Prints the sha256 of every file under /model, then reads one file once a second and says
/// whether that worked, forever.
const READER: &str = r#"
cd /model && find . -type f | sort | xargs sha256sum
echo SUMS-DONE
if touch /model/written 2>/dev/null; then echo WRITABLE; else echo READ-ONLY; fi
i=0
while true; do
  i=$((i+1))
  if md5sum /model/sub/weights.bin >/tmp/out 2>/tmp/err; then
    echo "read $i ok"
  else
    echo "read $i failed: $(cat /tmp/err)"
  fi
  sleep 1
done
"#;

fn reader_pod(name: &str, node: &str, digest: &str) -> Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", READER],
                "volumeMounts": [{ "name": "model", "mountPath": "/model", "readOnly": true }],
            }],
            "volumes": [{
                "name": "model",
                "csi": {
                    "driver": DRIVER_NAME,
                    "readOnly": true,
                    "volumeAttributes": { "digest": digest },
                },
            }],
        }
    }))?)
}

/// A static PersistentVolume of the digest, pre-bound to claim `model` in `namespace`.
fn persistent_volume(name: &str, namespace: &str, digest: &str) -> Result<PersistentVolume> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "capacity": { "storage": "1Gi" },
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "claimRef": { "namespace": namespace, "name": "model" },
            "csi": {
                "driver": DRIVER_NAME,
                "volumeHandle": name,
                "readOnly": true,
                "volumeAttributes": { "digest": digest },
            },
        }
    }))?)
}

fn claim(volume: &str) -> Result<PersistentVolumeClaim> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": { "name": "model" },
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": volume,
            "resources": { "requests": { "storage": "1Gi" } },
        }
    }))?)
}

/// [`reader_pod`] with the claim `model` instead of an inline volume.
fn claim_reader_pod(name: &str, node: &str) -> Result<Pod> {
    let mut pod = reader_pod(name, node, "unused")?;
    if let Some(spec) = pod.spec.as_mut() {
        spec.volumes = Some(vec![serde_json::from_value(serde_json::json!({
            "name": "model",
            "persistentVolumeClaim": { "claimName": "model", "readOnly": true },
        }))?]);
    }
    Ok(pod)
}

/// What `find . -type f | sort | xargs sha256sum` prints in the pushed tree, on the host.
fn expected_sums(source: &Path) -> Result<String> {
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg("find . -type f | LC_ALL=C sort | xargs sha256sum")
        .current_dir(source)
        .output()
        .context("sha256sum on the host")?;
    ensure!(out.status.success(), "sha256sum on the host failed");
    Ok(String::from_utf8(out.stdout)?)
}

/// FUSE mounts of `digest` (under the plugin's state dir) and binds of it (kubelet's pod
/// volume dirs), per /proc/self/mountinfo.
fn mounts_of(store: &TestStore) -> (usize, usize) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let name = format!("sealed-{}", store.digest.hex());
    let mut fuse = 0;
    let mut binds = 0;
    for line in info.lines().filter(|l| l.contains(&name)) {
        let mount_point = line.split(' ').nth(4).unwrap_or_default();
        if mount_point.contains("/volumes/kubernetes.io~csi/") {
            binds += 1;
        } else {
            fuse += 1;
        }
    }
    (fuse, binds)
}

async fn pod_log(pods: &Api<Pod>, name: &str) -> String {
    pods.logs(name, &LogParams::default())
        .await
        .unwrap_or_default()
}

/// Creates the pod and waits until its log has the checksums; returns them.
async fn start_reader(pods: &Api<Pod>, name: &str, node: &str, digest: &str) -> Result<String> {
    start_pod(pods, name, &reader_pod(name, node, digest)?).await
}

async fn start_pod(pods: &Api<Pod>, name: &str, pod: &Pod) -> Result<String> {
    pods.create(&PostParams::default(), pod)
        .await
        .with_context(|| format!("creating pod {name}"))?;
    let started = Instant::now();
    wait_for(
        &format!("pod {name} to print its checksums"),
        Duration::from_secs(120),
        || async {
            let pod = pods.get(name).await?;
            let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
            if matches!(phase.as_deref(), Some("Failed" | "Succeeded")) {
                bail!("pod {name} ended: {:?}", pod.status);
            }
            Ok(pod_log(pods, name).await.contains("SUMS-DONE"))
        },
    )
    .await?;
    println!(
        "pod {name}: running and read every file {:.1} s after create",
        started.elapsed().as_secs_f64()
    );
    let log = pod_log(pods, name).await;
    Ok(log
        .split("SUMS-DONE")
        .next()
        .unwrap_or_default()
        .to_string())
}

async fn delete_pod_and_wait(pods: &Api<Pod>, name: &str) -> Result<()> {
    let _ = pods.delete(name, &DeleteParams::default()).await;
    wait_for(
        &format!("pod {name} to go"),
        Duration::from_secs(120),
        || async { Ok(pods.get_opt(name).await?.is_none()) },
    )
    .await
}

async fn csinode_has_driver(client: &Client, node: &str) -> Result<bool> {
    Ok(Api::<CSINode>::all(client.clone())
        .get_opt(node)
        .await?
        .is_some_and(|c| c.spec.drivers.iter().any(|d| d.name == DRIVER_NAME)))
}

fn scrape(addr: SocketAddr) -> String {
    common::http_get(addr, "/metrics").1
}

/// The CSIDriver the chart installs; created when absent (and deleted at the end).
async fn ensure_csidriver(client: &Client) -> Result<bool> {
    let api = Api::<CSIDriver>::all(client.clone());
    if let Some(existing) = api.get_opt(DRIVER_NAME).await? {
        ensure!(
            existing.spec.pod_info_on_mount == Some(true),
            "CSIDriver {DRIVER_NAME} exists without podInfoOnMount: true"
        );
        return Ok(false);
    }
    let driver: CSIDriver = serde_json::from_value(serde_json::json!({
        "metadata": { "name": DRIVER_NAME },
        "spec": {
            "attachRequired": false,
            "podInfoOnMount": true,
            "volumeLifecycleModes": ["Ephemeral", "Persistent"],
            "fsGroupPolicy": "None",
        }
    }))?;
    api.create(&PostParams::default(), &driver).await?;
    Ok(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_read_sealed_volumes_through_the_real_kubelet() -> Result<()> {
    let Some(cluster) =
        sealed_e2e::cluster("pods_read_sealed_volumes_through_the_real_kubelet").await
    else {
        return Ok(());
    };
    if !can_mount() {
        println!("skipped: needs root and /dev/fuse");
        return Ok(());
    }
    let client = cluster.client.clone();
    let node = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .find(|n| !n.starts_with("sealed-csi-test-"))
        .context("the cluster has no node")?;
    ensure!(
        !csinode_has_driver(&client, &node).await?,
        "{DRIVER_NAME} is already registered on {node} (a DaemonSet?); not touching it"
    );
    sealed_e2e::install_crds(&client, MANAGER).await?;
    let created_driver = ensure_csidriver(&client).await?;
    let owner = cluster.temp_namespace("sealed-pods").await?;
    let stranger = cluster.temp_namespace("sealed-pods-other").await?;
    // The operator's namespace: the attestation Secret and the node publications Lease.
    let system = cluster.temp_namespace("sealed-pods-system").await?;
    let store = store_with_version(&owner).await;

    // The plugin outlives `run` so that, on failure too, the pods go before it does.
    let mut plugin = None;
    let namespaces = Namespaces {
        owner: &owner,
        stranger: &stranger,
        system: &system,
    };
    let result = run(&cluster, &node, namespaces, &store, &mut plugin).await;
    if let (Err(_), Some(p)) = (&result, &plugin) {
        eprintln!("plugin log:\n{}", p.log());
    }

    // Pods go before the plugin, so kubelet can unpublish their volumes.
    for ns in [&owner, &stranger] {
        let _ = cluster.delete_namespace(ns).await;
    }
    for ns in [&owner, &stranger] {
        let pods = Api::<Pod>::namespaced(client.clone(), ns);
        let _ = wait_for("pods to go", Duration::from_secs(120), || async {
            Ok(pods.list(&ListParams::default()).await?.items.is_empty())
        })
        .await;
    }
    drop(plugin);
    let _ = cluster.delete_namespace(&system).await;
    let _ = Api::<PersistentVolume>::all(client.clone())
        .delete(&format!("{owner}-model"), &DeleteParams::default())
        .await;
    if created_driver {
        let _ = Api::<CSIDriver>::all(client.clone())
            .delete(DRIVER_NAME, &DeleteParams::default())
            .await;
    }
    result
}

#[derive(Clone, Copy)]
struct Namespaces<'a> {
    /// Has the operator-made version of the digest.
    owner: &'a str,
    /// Has a tenant-made (unattested) version of the same digest.
    stranger: &'a str,
    /// The attestation Secret and the node publications Lease.
    system: &'a str,
}

async fn run(
    cluster: &Cluster,
    node: &str,
    ns: Namespaces<'_>,
    store: &TestStore,
    slot: &mut Option<Plugin>,
) -> Result<()> {
    let client = cluster.client.clone();
    let digest = store.digest.to_string();
    let attestation = common::attestation_secret(
        &client,
        ns.system,
        "sealed-attestation",
        &common::key_material(),
    )
    .await?;
    // As the operator makes a version: owned by its volume, attested.
    let model = common::sealed_volume(&client, ns.owner, "model", &[], false).await?;
    common::sealed_version(
        &client,
        &model,
        &digest,
        None,
        Made::ByOperator(&attestation.key),
    )
    .await?;
    // A tenant's own version of the same digest (digests are not secrets): no attestation.
    let stolen = common::sealed_volume(&client, ns.stranger, "model", &[], false).await?;
    common::sealed_version(&client, &stolen, &digest, None, Made::WithAttestation(None)).await?;
    let metrics_addr = sealed_test_support::servers::free_addr();
    let kubelet_dir =
        std::env::var("SEALED_KUBELET_DIR").unwrap_or_else(|_| "/var/lib/kubelet".into());
    // Restart safety: the holder keeps the FUSE fds while the plugin is killed (step 5).
    let holder_dir = tempfile::tempdir()?;
    let holder = FdHolder::start(&holder_dir.path().join("fd-holder.sock"));
    let extra = [
        format!("--kubelet-dir={kubelet_dir}"),
        format!("--metrics-addr={metrics_addr}"),
        format!("--fd-holder={}", holder.socket.display()),
        attestation.flag(),
        format!("--publications-namespace={}", ns.system),
    ];
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    *slot = Some(Plugin::start_api(
        &store.url,
        node,
        &cluster.kubeconfig,
        &extra,
    ));
    with_plugin(cluster, node, ns, store, slot, metrics_addr, &extra).await
}

/// Whether the node publications Lease lists `digest` for `namespace`.
async fn leased(client: &Client, ns: Namespaces<'_>, node: &str, digest: &str) -> Result<bool> {
    let Some((_, doc)) = common::node_publications(client, ns.system, node).await? else {
        return Ok(false);
    };
    Ok(doc
        .published
        .iter()
        .any(|p| p.namespace == ns.owner && p.digest == digest))
}

async fn with_plugin(
    cluster: &Cluster,
    node: &str,
    ns: Namespaces<'_>,
    store: &TestStore,
    slot: &mut Option<Plugin>,
    metrics_addr: SocketAddr,
    extra: &[&str],
) -> Result<()> {
    let (owner, stranger) = (ns.owner, ns.stranger);
    let plugin = slot.as_ref().context("no plugin")?;
    let client = cluster.client.clone();
    let digest = store.digest.to_string();
    let registered = wait_for(
        "the driver in the node's CSINode",
        Duration::from_secs(30),
        || csinode_has_driver(&client, node),
    )
    .await;
    if let Err(e) = registered {
        bail!("{e}; plugin log:\n{}", plugin.log());
    }
    let want = expected_sums(&store.source)?;
    let pods = Api::<Pod>::namespaced(client.clone(), owner);

    // 1. One pod reads every file, byte-identical; the volume is read-only.
    let sums = start_reader(&pods, "reader-a", node, &digest).await;
    let sums = match sums {
        Ok(s) => s,
        Err(e) => bail!("{e:#}; plugin log:\n{}", plugin.log()),
    };
    ensure!(
        sums.trim() == want.trim(),
        "pod checksums differ:\n{sums}\nwant:\n{want}"
    );
    ensure!(
        pod_log(&pods, "reader-a").await.contains("READ-ONLY"),
        "the pod could write to its sealed volume"
    );
    // The operator can see the digest in use on this node.
    ensure!(
        leased(&client, ns, node, &digest).await?,
        "the node publications Lease does not list ({owner}, {digest}) while reader-a runs"
    );

    // 2. A second pod: the same FUSE mount, a second bind.
    let sums = start_reader(&pods, "reader-b", node, &digest).await?;
    ensure!(sums.trim() == want.trim(), "reader-b checksums differ");
    let (fuse, binds) = mounts_of(store);
    println!("two pods: {fuse} FUSE mount(s), {binds} bind(s) of {digest}");
    ensure!(
        (fuse, binds) == (1, 2),
        "want 1 FUSE mount + 2 binds, got {fuse} + {binds}"
    );
    let page = scrape(metrics_addr);
    ensure!(
        common::sample(&page, "sealed_csi_fuse_mounts") == Some(1.0)
            && common::sample(&page, "sealed_csi_published_volumes") == Some(2.0),
        "metrics disagree with the mounts:\n{page}"
    );

    // 2b. A static PersistentVolume (ReadOnlyMany) of the digest, through a claim: a third
    // bind of the same FUSE mount.
    let pv_name = format!("{owner}-model");
    Api::<PersistentVolume>::all(client.clone())
        .create(
            &PostParams::default(),
            &persistent_volume(&pv_name, owner, &digest)?,
        )
        .await?;
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), owner)
        .create(&PostParams::default(), &claim(&pv_name)?)
        .await?;
    let sums = start_pod(&pods, "reader-pv", &claim_reader_pod("reader-pv", node)?).await?;
    ensure!(sums.trim() == want.trim(), "reader-pv checksums differ");
    let (fuse, binds) = mounts_of(store);
    println!("two inline volumes and a PV: {fuse} FUSE mount(s), {binds} bind(s)");
    ensure!(
        (fuse, binds) == (1, 3),
        "want 1 FUSE mount + 3 binds, got {fuse} + {binds}"
    );
    delete_pod_and_wait(&pods, "reader-pv").await?;
    ensure!(
        mounts_of(store) == (1, 2),
        "after deleting reader-pv: {:?}",
        mounts_of(store)
    );

    // 3. A namespace without the version: refused, and the pod's events say why.
    let strangers = Api::<Pod>::namespaced(client.clone(), stranger);
    strangers
        .create(
            &PostParams::default(),
            &reader_pod("intruder", node, &digest)?,
        )
        .await?;
    let events = Api::<Event>::namespaced(client.clone(), stranger);
    let deadline = Instant::now() + Duration::from_secs(90);
    let refusal = loop {
        let list = events
            .list(&ListParams::default().fields("involvedObject.name=intruder"))
            .await?;
        let found = list.items.iter().find_map(|e| {
            let message = e.message.as_deref()?;
            (e.reason.as_deref() == Some("FailedMount") && message.contains("PermissionDenied"))
                .then(|| message.to_string())
        });
        if let Some(message) = found {
            break message;
        }
        ensure!(
            Instant::now() < deadline,
            "no FailedMount event with PermissionDenied on the intruder pod within 90 s: {:?}",
            list.items.iter().map(|e| &e.message).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!("intruder pod: {refusal}");
    ensure!(
        refusal.contains(stranger) && refusal.contains(&digest),
        "the refusal should name the namespace and digest: {refusal}"
    );
    // The stranger's own SealedVolumeVersion of the digest does not help: not operator-made.
    ensure!(
        refusal.contains("was not made by the operator (no valid attestation"),
        "the refusal should say the stranger's version is not attested: {refusal}"
    );
    let intruder = strangers.get("intruder").await?;
    let phase = intruder.status.and_then(|s| s.phase);
    ensure!(
        phase.as_deref() == Some("Pending"),
        "intruder pod is {phase:?}"
    );
    ensure!(
        common::sample(
            &scrape(metrics_addr),
            r#"sealed_csi_publish_errors_total{code="PermissionDenied"}"#
        )
        .is_some_and(|n| n >= 1.0),
        "no PermissionDenied in the metrics"
    );
    delete_pod_and_wait(&strangers, "intruder").await?;

    // 4. Deleting one pod drops its bind; the FUSE mount stays for the other.
    delete_pod_and_wait(&pods, "reader-b").await?;
    let (fuse, binds) = mounts_of(store);
    ensure!(
        (fuse, binds) == (1, 1),
        "after deleting reader-b: want 1 FUSE mount + 1 bind, got {fuse} + {binds}"
    );

    // 5. The plugin dies (SIGKILL) while reader-a reads once a second, and comes back: the
    // pod's reads pause while it is dead and go on after the restart, none failing.
    let log_before = pod_log(&pods, "reader-a").await;
    let reads_before = log_before.matches(" ok").count();
    let home = slot.take().context("no plugin")?.crash();
    println!("plugin killed (SIGKILL) while reader-a runs");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let log_killed = pod_log(&pods, "reader-a").await;
    let after_kill = &log_killed[log_before.len().min(log_killed.len())..];
    println!("reader-a, plugin dead:\n{}", after_kill.trim_end());
    *slot = Some(Plugin::start_api_in(
        home,
        &store.url,
        node,
        &cluster.kubeconfig,
        extra,
    ));
    let plugin = slot.as_ref().context("no plugin")?;
    wait_for(
        "the restarted plugin in the node's CSINode",
        Duration::from_secs(30),
        || csinode_has_driver(&client, node),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let log_restarted = pod_log(&pods, "reader-a").await;
    let after_restart = &log_restarted[log_killed.len().min(log_restarted.len())..];
    println!("reader-a, plugin restarted:\n{}", after_restart.trim_end());
    println!(
        "reads ok before the kill: {reads_before}; while dead: {} ok, {} failed; after the \
         restart: {} ok, {} failed",
        after_kill.matches(" ok").count(),
        after_kill.matches(" failed").count(),
        after_restart.matches(" ok").count(),
        after_restart.matches(" failed").count(),
    );
    let failed = after_kill.matches(" failed").count() + after_restart.matches(" failed").count();
    ensure!(
        failed == 0 && after_restart.matches(" ok").count() >= 1,
        "reader-a's reads broke across the plugin restart (the fd holder keeps the FUSE fd, \
         the restarted plugin resumes the mount):\n{after_kill}{after_restart}\nplugin log:\n{}",
        plugin.log()
    );

    // 6. Deleting the last pod (unpublished by the restarted plugin) leaves nothing mounted.
    delete_pod_and_wait(&pods, "reader-a").await?;
    let (fuse, binds) = mounts_of(store);
    ensure!(
        (fuse, binds) == (0, 0),
        "after deleting every pod: {fuse} FUSE mount(s) + {binds} bind(s) left; plugin log:\n{}",
        plugin.log()
    );
    // kubelet may report the pod gone a moment before its unpublish returns.
    wait_for(
        "the node publications Lease to drop the digest",
        Duration::from_secs(10),
        || async { Ok(!leased(&client, ns, node, &digest).await?) },
    )
    .await?;

    // 7. A pod started after the restart reads correct data; its deletion cleans up too.
    let sums = start_reader(&pods, "reader-c", node, &digest).await?;
    ensure!(sums.trim() == want.trim(), "reader-c checksums differ");
    delete_pod_and_wait(&pods, "reader-c").await?;
    let (fuse, binds) = mounts_of(store);
    ensure!(
        (fuse, binds) == (0, 0),
        "after deleting reader-c: {fuse} FUSE mount(s) + {binds} bind(s) left"
    );
    Ok(())
}
