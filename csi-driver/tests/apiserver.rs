//! API-server mode against the real API server of the local cluster (`hack/cluster.sh`): the
//! real `sealed-csi` binary, called over its socket as kubelet calls it, authorizes by an
//! operator-attested SealedVolumeVersion in the pod's namespace (or a shared volume) and
//! refuses tenant-made ones, resolves `volume` + `tag` and records an Event on the pod,
//! checks the CSIDriver's podInfoOnMount and the pod, keeps the node publications Lease, and
//! refuses to publish on a node with an excluded GPU.
//!
//! A second test registers the plugin with the cluster's real kubelet through
//! `plugins_registry` (kubelet's plugin watcher sends the socket path as `:authority`, which
//! the plugin's authority shim accepts) and waits for the driver to show up in the node's
//! CSINode (and to go again when the plugin stops).
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`. Successful publishes mount through
//! FUSE, so they need root and /dev/fuse.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use common::{Made, Plugin, can_mount, store_with_version};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use sealed_crds::publications;
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_csi::DRIVER_NAME;
use sealed_csi::proto::csi::node_client::NodeClient;
use sealed_csi::proto::csi::{NodePublishVolumeRequest, NodeUnpublishVolumeRequest};
use tonic::Code;
use tonic::transport::Channel;

const MANAGER: &str = "sealed-csi-test";

/// A pod object the plugin can find (bound to the test's kubelet-less Node; it never runs).
#[derive(Clone, Debug)]
struct TestPod {
    namespace: String,
    name: String,
    uid: String,
}

/// Creates pod `namespace/name` bound to `node`.
async fn test_pod(client: &Client, namespace: &str, name: &str, node: &str) -> Result<TestPod> {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{ "name": "main", "image": sealed_e2e::BUSYBOX_IMAGE,
                             "imagePullPolicy": "Never" }],
        },
    }))?;
    let created = Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("creating pod {namespace}/{name}"))?;
    Ok(TestPod {
        namespace: namespace.into(),
        name: name.into(),
        uid: created.metadata.uid.context("pod without uid")?,
    })
}

/// A publish as kubelet sends it for an inline volume of `pod` (`podInfoOnMount: true`).
fn publish_req(
    target: &Path,
    pod: &TestPod,
    attributes: &[(&str, &str)],
) -> NodePublishVolumeRequest {
    let mut context: HashMap<String, String> = attributes
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (k, v) in [
        ("csi.storage.k8s.io/ephemeral", "true"),
        ("csi.storage.k8s.io/pod.namespace", pod.namespace.as_str()),
        ("csi.storage.k8s.io/pod.name", pod.name.as_str()),
        ("csi.storage.k8s.io/pod.uid", pod.uid.as_str()),
        ("csi.storage.k8s.io/serviceAccount.name", "default"),
    ] {
        context.insert(k.into(), v.into());
    }
    common::publish_request(&format!("csi-{}", pod.name), target, context)
}

async fn expect_code(
    client: &mut NodeClient<Channel>,
    what: &str,
    req: NodePublishVolumeRequest,
    code: Code,
    needles: &[&str],
) -> Result<()> {
    let status = match client.node_publish_volume(req).await {
        Ok(_) => bail!("{what}: publish succeeded, expected {code:?}"),
        Err(s) => s,
    };
    ensure!(
        status.code() == code,
        "{what}: expected {code:?}, got {status:?}"
    );
    for n in needles {
        ensure!(
            status.message().contains(n),
            "{what}: message {:?} does not name {n:?}",
            status.message()
        );
    }
    eprintln!("{what}: {:?}: {}", status.code(), status.message());
    Ok(())
}

/// Publishes, checks the mounted tree is the pushed one, and unpublishes.
async fn publish_and_read(
    client: &mut NodeClient<Channel>,
    what: &str,
    req: NodePublishVolumeRequest,
    source: &Path,
) -> Result<()> {
    let target = req.target_path.clone();
    let volume_id = req.volume_id.clone();
    client
        .node_publish_volume(req)
        .await
        .with_context(|| format!("{what}: publish failed"))?;
    let mounted = std::fs::read(Path::new(&target).join("config.json"))
        .with_context(|| format!("{what}: reading the mounted config.json"))?;
    let pushed = std::fs::read(source.join("config.json"))?;
    ensure!(mounted == pushed, "{what}: mounted bytes differ");
    client
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id,
            target_path: target,
        })
        .await
        .with_context(|| format!("{what}: unpublish failed"))?;
    Ok(())
}

/// The CSIDriver as the chart installs it; `Some(pod_info_on_mount)` it was created with when
/// the test created it (and must delete it), `None` when it existed already.
async fn ensure_csidriver(client: &Client, pod_info_on_mount: bool) -> Result<Option<bool>> {
    let api = Api::<CSIDriver>::all(client.clone());
    if let Some(existing) = api.get_opt(DRIVER_NAME).await? {
        ensure!(
            existing.spec.pod_info_on_mount == Some(true),
            "CSIDriver {DRIVER_NAME} exists without podInfoOnMount: true"
        );
        return Ok(None);
    }
    let driver: CSIDriver = serde_json::from_value(serde_json::json!({
        "metadata": { "name": DRIVER_NAME },
        "spec": {
            "attachRequired": false,
            "podInfoOnMount": pod_info_on_mount,
            "volumeLifecycleModes": ["Ephemeral", "Persistent"],
            "fsGroupPolicy": "None",
        }
    }))?;
    api.create(&PostParams::default(), &driver).await?;
    Ok(Some(pod_info_on_mount))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_mode_authorizes_resolves_tags_and_excludes_gpus() -> Result<()> {
    let Some(cluster) =
        sealed_e2e::cluster("api_server_mode_authorizes_resolves_tags_and_excludes_gpus").await
    else {
        return Ok(());
    };
    let client = cluster.client.clone();
    sealed_e2e::install_crds(&client, MANAGER).await?;
    let owner = cluster.temp_namespace("csi-owner").await?;
    let other = cluster.temp_namespace("csi-other").await?;
    // The operator's namespace: the attestation Secret and the node publications Lease.
    let system = cluster.temp_namespace("csi-system").await?;
    // A Node object without a kubelet: the plugin only reads its labels.
    let node_name = format!("sealed-csi-test-{owner}");
    let nodes = Api::<Node>::all(client.clone());
    let node: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": node_name}}))?;
    nodes.create(&PostParams::default(), &node).await?;
    // Created without podInfoOnMount first when absent, to see the refusal (set right in `run`).
    let created_driver = ensure_csidriver(&client, false).await?;
    let result = run(
        &cluster,
        &owner,
        &other,
        &system,
        &node_name,
        created_driver,
    )
    .await;
    // The test's pods are bound to a Node without kubelet: nobody would confirm their end.
    for ns in [&owner, &other] {
        let _ = Api::<Pod>::namespaced(client.clone(), ns)
            .delete_collection(
                &DeleteParams::default().grace_period(0),
                &ListParams::default(),
            )
            .await;
    }
    let _ = nodes.delete(&node_name, &DeleteParams::default()).await;
    if created_driver.is_some() {
        let _ = Api::<CSIDriver>::all(client.clone())
            .delete(DRIVER_NAME, &DeleteParams::default())
            .await;
    }
    cluster.delete_namespace(&owner).await?;
    cluster.delete_namespace(&other).await?;
    cluster.delete_namespace(&system).await?;
    result
}

async fn run(
    cluster: &sealed_e2e::Cluster,
    owner: &str,
    other: &str,
    system: &str,
    node_name: &str,
    created_driver: Option<bool>,
) -> Result<()> {
    let client = cluster.client.clone();
    // The namespace name goes into the tree, so the digest is this run's own.
    let store = store_with_version(owner).await;
    let digest = store.digest.to_string();
    let attestation = common::attestation_secret(
        &client,
        system,
        "sealed-attestation",
        &common::key_material(),
    )
    .await?;
    let volume =
        common::sealed_volume(&client, owner, "llama", &[("prod", digest.as_str())], false).await?;
    let version = common::sealed_version(
        &client,
        &volume,
        &digest,
        None,
        Made::ByOperator(&attestation.key),
    )
    .await?;

    let plugin = Plugin::start_api(
        &store.url,
        node_name,
        &cluster.kubeconfig,
        &[
            &attestation.flag(),
            &format!("--publications-namespace={system}"),
        ],
    );
    let mut csi = NodeClient::new(plugin.channel().await);
    let target = plugin
        .pods()
        .join("0d6f7c52/volumes/kubernetes.io~csi/model/mount");
    let ctx = Ctx {
        client: client.clone(),
        store: &store,
        owner,
        other,
        system,
        node_name,
        target: &target,
        attestation: &attestation,
        version: version.metadata.name.clone().unwrap_or_default(),
        created_driver,
    };
    let result = checks(&ctx, &mut csi).await;
    if result.is_err() {
        eprintln!("plugin log:\n{}", plugin.log());
    }
    result
}

struct Ctx<'a> {
    client: Client,
    store: &'a common::TestStore,
    owner: &'a str,
    other: &'a str,
    system: &'a str,
    node_name: &'a str,
    target: &'a Path,
    attestation: &'a common::Attestation,
    /// The name of the operator-made version of `llama` in `owner`.
    version: String,
    created_driver: Option<bool>,
}

impl Ctx<'_> {
    async fn pod(&self, namespace: &str, name: &str) -> Result<TestPod> {
        test_pod(&self.client, namespace, name, self.node_name).await
    }

    /// The (namespace, digest) pairs the node publications Lease lists now.
    async fn leased(&self) -> Result<Vec<(String, String)>> {
        let (lease, doc) = common::node_publications(&self.client, self.system, self.node_name)
            .await?
            .context("no node publications Lease")?;
        let spec = lease.spec.context("Lease without spec")?;
        ensure!(
            spec.holder_identity.as_deref() == Some(self.node_name)
                && spec.lease_duration_seconds == Some(2 * publications::RENEW_SECONDS)
                && spec.renew_time.is_some(),
            "Lease spec: {spec:?}"
        );
        let labels = lease.metadata.labels.unwrap_or_default();
        ensure!(
            labels.get(publications::LABEL).map(String::as_str) == Some(self.node_name),
            "Lease labels: {labels:?}"
        );
        ensure!(
            doc.node == self.node_name,
            "annotation names node {}",
            doc.node
        );
        Ok(doc
            .published
            .into_iter()
            .map(|p| (p.namespace, p.digest))
            .collect())
    }
}

async fn checks(ctx: &Ctx<'_>, csi: &mut NodeClient<Channel>) -> Result<()> {
    let client = &ctx.client;
    let (owner, other, target) = (ctx.owner, ctx.other, ctx.target);
    let store = ctx.store;
    let digest = store.digest.to_string();
    let by_digest = [("digest", digest.as_str())];
    let mount = can_mount();
    if !mount {
        eprintln!("successful publishes: skipped: needs root and /dev/fuse");
    }

    // podInfoOnMount: a CSIDriver without it refuses every publish (only when this test made
    // the CSIDriver: one installed by someone else is left alone).
    let reader = ctx.pod(owner, "reader").await?;
    if ctx.created_driver == Some(false) {
        expect_code(
            csi,
            "CSIDriver without podInfoOnMount",
            publish_req(target, &reader, &by_digest),
            Code::FailedPrecondition,
            &["CSIDriver csi.sealedvolumes.io", "podInfoOnMount: true"],
        )
        .await?;
        Api::<CSIDriver>::all(client.clone())
            .patch(
                DRIVER_NAME,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"podInfoOnMount": true}})),
            )
            .await?;
    } else {
        eprintln!("CSIDriver without podInfoOnMount: skipped: CSIDriver {DRIVER_NAME} existed");
    }

    // Authorization: an operator-made version in the pod's namespace allows, and the node
    // publications Lease lists the digest before NodePublishVolume returns.
    if mount {
        let req = publish_req(target, &reader, &by_digest);
        csi.node_publish_volume(req.clone())
            .await
            .context("digest in the owner namespace: publish failed")?;
        let leased = ctx.leased().await?;
        ensure!(
            leased.contains(&(owner.to_string(), digest.clone())),
            "the Lease does not list ({owner}, {digest}) after the publish returned: {leased:?}"
        );
        eprintln!("Lease after the publish: {leased:?}");
        csi.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
        })
        .await?;
        let leased = ctx.leased().await?;
        ensure!(
            !leased.iter().any(|(_, d)| d == &digest),
            "the Lease still lists {digest} after the unpublish returned: {leased:?}"
        );
        publish_and_read(csi, "digest in the owner namespace", req, &store.source).await?;
    }
    let intruder = ctx.pod(other, "intruder").await?;
    expect_code(
        csi,
        "digest in another namespace",
        publish_req(target, &intruder, &by_digest),
        Code::PermissionDenied,
        &[&digest, other, "spec.shared"],
    )
    .await?;
    let mut req = publish_req(target, &reader, &by_digest);
    req.volume_context
        .remove("csi.storage.k8s.io/pod.namespace");
    expect_code(
        csi,
        "no pod info",
        req,
        Code::InvalidArgument,
        &["podInfoOnMount"],
    )
    .await?;

    // The pod named in the volume context must be real: that namespace, that UID, this node.
    let mut ghost = reader.clone();
    ghost.uid = "00000000-0000-0000-0000-000000000000".into();
    expect_code(
        csi,
        "a pod uid that is not the pod's",
        publish_req(target, &ghost, &by_digest),
        Code::PermissionDenied,
        &["does not exist", &reader.uid],
    )
    .await?;
    let mut ghost = reader.clone();
    ghost.name = "no-such-pod".into();
    expect_code(
        csi,
        "a pod that does not exist",
        publish_req(target, &ghost, &by_digest),
        Code::PermissionDenied,
        &["no-such-pod", "does not exist"],
    )
    .await?;

    // A tenant's own SealedVolumeVersions with the victim's digest (digests are not secrets):
    // owned by a volume of the tenant's, with no, a forged, or the victim's (copied)
    // attestation, or not owned at all. None authorizes.
    let stolen = common::sealed_volume(client, other, "stolen", &[], false).await?;
    let forged_key =
        sealed_crds::attestation::AttestationKey::from_secret_bytes(&common::key_material())?;
    let victims = ctx.attestation.key.attest(owner, "llama", &digest);
    let tenant_versions = [
        (
            "stolen-none",
            Made::WithAttestation(None),
            "status.attestation is missing",
        ),
        (
            "stolen-forged",
            Made::WithAttestation(Some(forged_key.attest(other, "stolen", &digest))),
            "does not verify",
        ),
        (
            "stolen-copied",
            Made::WithAttestation(Some(victims)),
            "does not verify",
        ),
        (
            "stolen-unowned",
            // Owned by nothing, as a version applied from Git is: only an attestation by
            // the operator would let it authorize a mount.
            Made::Unowned,
            "status.attestation is missing",
        ),
    ];
    for (name, made, needle) in tenant_versions {
        let v = common::sealed_version(client, &stolen, &digest, Some(name), made).await?;
        expect_code(
            csi,
            &format!("tenant-made version {name}"),
            publish_req(target, &intruder, &by_digest),
            Code::PermissionDenied,
            &[
                &format!("{other}/{name}"),
                "was not made by the operator",
                needle,
            ],
        )
        .await?;
        // One at a time, so each message is about that one.
        Api::<SealedVolumeVersion>::namespaced(client.clone(), other)
            .delete(
                &v.metadata.name.unwrap_or_default(),
                &DeleteParams::default(),
            )
            .await?;
    }

    // Bad volume/tag attributes are refused before any API call; so is a target outside
    // kubelet's pod directories.
    for (attrs, needle) in [
        (
            [("volume", "../../secrets"), ("tag", "prod")],
            "volume attribute 'volume'",
        ),
        (
            [("volume", "llama"), ("tag", "prod/../x")],
            "volume attribute 'tag'",
        ),
    ] {
        expect_code(
            csi,
            "a bad attribute",
            publish_req(target, &reader, &attrs),
            Code::InvalidArgument,
            &[needle],
        )
        .await?;
    }
    let outside = tempfile::tempdir()?;
    expect_code(
        csi,
        "a target outside <kubelet>/pods",
        publish_req(&outside.path().join("mount"), &reader, &by_digest),
        Code::InvalidArgument,
        &["outside kubelet's pod directories"],
    )
    .await?;

    // Tags resolve in the pod's namespace, and the pod gets an Event that says so.
    let tag = [("volume", "llama"), ("tag", "prod")];
    if mount {
        let tagpod = ctx.pod(owner, "tagpod").await?;
        let req = publish_req(target, &tagpod, &tag);
        publish_and_read(csi, "volume + tag", req, &store.source).await?;
        let events = Api::<Event>::namespaced(client.clone(), owner)
            .list(&ListParams::default().fields("involvedObject.name=tagpod"))
            .await?;
        let event = events
            .items
            .iter()
            .find(|e| e.reason.as_deref() == Some("TagResolved"))
            .context("no TagResolved event on pod tagpod")?;
        let message = event.message.clone().unwrap_or_default();
        ensure!(
            message.contains(&digest) && message.contains("pin the digest"),
            "event message: {message}"
        );
        eprintln!("event: {message}");
        // The publish made the FUSE mount (the earlier ones were unpublished): once it went,
        // its cold start is recorded on the pod it was made for.
        let mut cold = None;
        for _ in 0..40 {
            let events = Api::<Event>::namespaced(client.clone(), owner)
                .list(&ListParams::default().fields("involvedObject.name=tagpod"))
                .await?;
            cold = events
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("ColdStart"));
            if cold.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let message = cold
            .context("no ColdStart event on pod tagpod within 10 s")?
            .message
            .unwrap_or_default();
        // (config.json may be a hydrated file by now, read through FUSE passthrough, which
        // the daemon never sees: the message then says nothing was read.)
        ensure!(
            message.starts_with(&format!("cold start of {}: mounted in", &digest[..15]))
                && message.contains("chunks from memory"),
            "cold-start event message: {message}"
        );
        eprintln!("event: {message}");
    }
    expect_code(
        csi,
        "unknown tag",
        publish_req(target, &reader, &[("volume", "llama"), ("tag", "nope")]),
        Code::NotFound,
        &["tag 'nope'", "prod"],
    )
    .await?;
    // A tag naming a version of another volume is refused, though the digest is allowed.
    common::sealed_volume(
        client,
        owner,
        "borrower",
        &[("prod", digest.as_str())],
        false,
    )
    .await?;
    expect_code(
        csi,
        "tag naming another volume's version",
        publish_req(target, &reader, &[("volume", "borrower"), ("tag", "prod")]),
        Code::FailedPrecondition,
        &["not a version of", "borrower"],
    )
    .await?;
    // A tag naming a version of its own volume that the operator did not make.
    let unsigned = common::sealed_volume(
        client,
        owner,
        "unsigned",
        &[("prod", digest.as_str())],
        false,
    )
    .await?;
    common::sealed_version(
        client,
        &unsigned,
        &digest,
        None,
        Made::WithAttestation(None),
    )
    .await?;
    expect_code(
        csi,
        "tag naming an unattested version",
        publish_req(target, &reader, &[("volume", "unsigned"), ("tag", "prod")]),
        Code::PermissionDenied,
        &["tag 'prod'", "unsigned", "was not made by the operator"],
    )
    .await?;
    expect_code(
        csi,
        "unknown volume",
        publish_req(target, &reader, &[("volume", "gone"), ("tag", "prod")]),
        Code::NotFound,
        &["gone"],
    )
    .await?;
    // The tag is looked up in the pod's namespace, where there is no volume llama.
    expect_code(
        csi,
        "tag from another namespace",
        publish_req(target, &intruder, &tag),
        Code::NotFound,
        &["llama"],
    )
    .await?;

    // A shared volume's versions may be mounted from any namespace.
    let volumes = Api::<SealedVolume>::namespaced(client.clone(), owner);
    volumes
        .patch(
            "llama",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"shared": true}})),
        )
        .await?;
    if mount {
        let sharedreader = ctx.pod(other, "sharedreader").await?;
        let req = publish_req(target, &sharedreader, &by_digest);
        publish_and_read(
            csi,
            "shared volume from another namespace",
            req,
            &store.source,
        )
        .await?;
    }
    // Shared does not help a version the operator did not make: `unsigned` is shared now,
    // but its version is not attested (and llama's is, so unshare llama first).
    volumes
        .patch(
            "llama",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"shared": false}})),
        )
        .await?;
    volumes
        .patch(
            "unsigned",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"shared": true}})),
        )
        .await?;
    expect_code(
        csi,
        "shared volume with an unattested version",
        publish_req(target, &intruder, &by_digest),
        Code::PermissionDenied,
        &[other, &digest],
    )
    .await?;

    // A rotated key: the operator attests again with the new key; the plugin reads the
    // Secret again (at most every 30 s) when an attestation does not verify.
    if mount {
        let rotated = common::attestation_secret(
            client,
            &ctx.attestation.namespace,
            &ctx.attestation.name,
            &common::key_material(),
        )
        .await?;
        common::set_attestation(
            client,
            owner,
            &ctx.version,
            &rotated.key.attest(owner, "llama", &digest),
        )
        .await?;
        let started = std::time::Instant::now();
        let req = publish_req(target, &reader, &by_digest);
        loop {
            match csi.node_publish_volume(req.clone()).await {
                Ok(_) => break,
                Err(s) if s.code() == Code::PermissionDenied => {
                    ensure!(
                        started.elapsed() < Duration::from_secs(45),
                        "the rotated key was not picked up within 45 s: {s:?}"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(s) => bail!("publish after the key rotation: {s:?}"),
            }
        }
        eprintln!(
            "rotated key picked up after {:.1} s",
            started.elapsed().as_secs_f64()
        );
        csi.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
        })
        .await?;
    }

    // A version being deleted (held by a finalizer here) authorizes nothing.
    let versions = Api::<SealedVolumeVersion>::namespaced(client.clone(), owner);
    versions
        .patch(
            &ctx.version,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"finalizers": ["sealedvolumes.io/test-hold"]}}),
            ),
        )
        .await?;
    versions
        .delete(&ctx.version, &DeleteParams::default())
        .await?;
    let deleting = expect_code(
        csi,
        "a version being deleted",
        publish_req(target, &reader, &by_digest),
        Code::PermissionDenied,
        &["is being deleted", &ctx.version],
    )
    .await;
    versions
        .patch(
            &ctx.version,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    deleting?;

    // An excluded GPU on the node refuses every publish, read from the labels at publish time.
    Api::<Node>::all(client.clone())
        .patch(
            ctx.node_name,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-L4"}}}),
            ),
        )
        .await?;
    let onl4 = ctx.pod(owner, "onl4").await?;
    expect_code(
        csi,
        "node with an L4",
        publish_req(target, &onl4, &by_digest),
        Code::FailedPrecondition,
        &["NVIDIA-L4", ctx.node_name],
    )
    .await?;
    Ok(())
}

/// The driver's entry in the CSINode of `node`: its nodeID, if registered.
async fn csinode_driver(client: &Client, node: &str) -> Result<Option<String>> {
    let Some(csinode) = Api::<CSINode>::all(client.clone()).get_opt(node).await? else {
        return Ok(None);
    };
    Ok(csinode
        .spec
        .drivers
        .iter()
        .find(|d| d.name == sealed_csi::DRIVER_NAME)
        .map(|d| d.node_id.clone()))
}

async fn wait_for_driver(client: &Client, node: &str, registered: bool) -> Result<()> {
    for _ in 0..150 {
        if csinode_driver(client, node).await?.is_some() == registered {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("CSINode {node}: driver registered should be {registered} within 30 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_the_real_kubelet() -> Result<()> {
    let Some(cluster) = sealed_e2e::cluster("registers_with_the_real_kubelet").await else {
        return Ok(());
    };
    let client = cluster.client.clone();
    // The cluster's one real node (other tests create kubelet-less Nodes named sealed-csi-test-*).
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let node = nodes
        .items
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .find(|n| !n.starts_with("sealed-csi-test-"))
        .context("the cluster has no node")?;
    if csinode_driver(&client, &node).await?.is_some() {
        bail!(
            "{} is already registered on {node}; not touching it",
            sealed_csi::DRIVER_NAME
        );
    }
    let kubelet_dir =
        std::env::var("SEALED_KUBELET_DIR").unwrap_or_else(|_| "/var/lib/kubelet".into());
    let store = store_with_version("registers_with_the_real_kubelet").await;
    let plugin = Plugin::start_api(
        &store.url,
        &node,
        &cluster.kubeconfig,
        // Registration needs no authorization: the insecure flag only lets it start.
        &[
            &format!("--kubelet-dir={kubelet_dir}"),
            "--insecure-skip-attestation",
        ],
    );
    let registered = wait_for_driver(&client, &node, true).await;
    let node_id = csinode_driver(&client, &node).await;
    if registered.is_err() {
        eprintln!("plugin log:\n{}", plugin.log());
    }
    // kubelet updates the CSINode before it tells the plugin the registration went through
    // (NotifyRegistrationStatus), so the plugin's line may come a moment after the CSINode.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !plugin.log().contains("registered with kubelet") && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = plugin.log();
    drop(plugin);
    let deregistered = wait_for_driver(&client, &node, false).await;
    registered?;
    ensure!(
        node_id?.as_deref() == Some(node.as_str()),
        "CSINode {node} lists another nodeID for the driver"
    );
    ensure!(
        log.contains("registered with kubelet"),
        "plugin log:\n{log}"
    );
    deregistered
}
