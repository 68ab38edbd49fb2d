//! API-server mode against the real API server of the local cluster (`hack/cluster.sh`): the
//! real `sealed-csi` binary, called over its socket as kubelet calls it, authorizes by
//! SealedVolumeVersion in the pod's namespace (or a shared volume), resolves `volume` + `tag`
//! and records an Event on the pod, and refuses to publish on a node with an excluded GPU.
//!
//! A second test registers the plugin with the cluster's real kubelet through
//! `plugins_registry` (kubelet's plugin watcher sends the socket path as `:authority`, which
//! the plugin's authority shim accepts) and waits for the driver to show up in the node's
//! CSINode (and to go again when the plugin stops).
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`. Successful publishes mount through
//! FUSE, so they need root and /dev/fuse.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use common::{Plugin, can_mount, store_with_version};
use k8s_openapi::api::core::v1::{Event, Node};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use sealed_crds::{
    Retention, SealedVolume, SealedVolumeSpec, SealedVolumeVersion, SealedVolumeVersionSpec, Source,
};
use sealed_csi::csi::node_client::NodeClient;
use sealed_csi::csi::{NodePublishVolumeRequest, NodeUnpublishVolumeRequest};
use tonic::Code;
use tonic::transport::Channel;

const MANAGER: &str = "sealed-csi-test";

/// A publish as kubelet sends it for an inline volume of `pod` in `namespace`
/// (`podInfoOnMount: true`).
fn publish_req(
    target: &Path,
    namespace: &str,
    pod: &str,
    attributes: &[(&str, &str)],
) -> NodePublishVolumeRequest {
    let mut context: HashMap<String, String> = attributes
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (k, v) in [
        ("csi.storage.k8s.io/ephemeral", "true"),
        ("csi.storage.k8s.io/pod.namespace", namespace),
        ("csi.storage.k8s.io/pod.name", pod),
        (
            "csi.storage.k8s.io/pod.uid",
            "0d6f7c52-5b0e-4d55-9a57-1c1c1c1c1c1c",
        ),
        ("csi.storage.k8s.io/serviceAccount.name", "default"),
    ] {
        context.insert(k.into(), v.into());
    }
    common::publish_request(&format!("csi-{pod}"), target, context)
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
    // A Node object without a kubelet: the plugin only reads its labels.
    let node_name = format!("sealed-csi-test-{owner}");
    let nodes = Api::<Node>::all(client.clone());
    let node: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": node_name}}))?;
    nodes.create(&PostParams::default(), &node).await?;
    let result = run(&cluster, &owner, &other, &node_name).await;
    let _ = nodes.delete(&node_name, &DeleteParams::default()).await;
    cluster.delete_namespace(&owner).await?;
    cluster.delete_namespace(&other).await?;
    result
}

async fn run(
    cluster: &sealed_e2e::Cluster,
    owner: &str,
    other: &str,
    node_name: &str,
) -> Result<()> {
    let client = cluster.client.clone();
    // The namespace name goes into the tree, so the digest is this run's own.
    let store = store_with_version(owner).await;
    let digest = store.digest.to_string();
    let volumes = Api::<SealedVolume>::namespaced(client.clone(), owner);
    let volume = SealedVolume::new(
        "llama",
        SealedVolumeSpec {
            source: Source::upload(),
            tags: BTreeMap::from([("prod".to_string(), digest.clone())]),
            retention: Retention::default(),
            shared: false,
        },
    );
    volumes.create(&PostParams::default(), &volume).await?;
    let version = SealedVolumeVersion::new(
        &SealedVolumeVersionSpec::object_name("llama", &digest),
        SealedVolumeVersionSpec {
            volume: "llama".into(),
            digest: digest.clone(),
        },
    );
    Api::<SealedVolumeVersion>::namespaced(client.clone(), owner)
        .create(&PostParams::default(), &version)
        .await?;

    let plugin = Plugin::start_api(&store.url, node_name, &cluster.kubeconfig, &[]);
    let mut csi = NodeClient::new(plugin.channel().await);
    let target = plugin.dir.path().join("target");
    let by_digest = [("digest", digest.as_str())];
    let result = checks(
        &client, &mut csi, &store, owner, other, node_name, &target, &by_digest,
    )
    .await;
    if result.is_err() {
        eprintln!("plugin log:\n{}", plugin.log());
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn checks(
    client: &Client,
    csi: &mut NodeClient<Channel>,
    store: &common::TestStore,
    owner: &str,
    other: &str,
    node_name: &str,
    target: &Path,
    by_digest: &[(&str, &str)],
) -> Result<()> {
    let digest = store.digest.to_string();
    let mount = can_mount();
    if !mount {
        eprintln!("successful publishes: skipped: needs root and /dev/fuse");
    }

    // Authorization: a version in the pod's namespace allows; another namespace is refused.
    if mount {
        let req = publish_req(target, owner, "reader", by_digest);
        publish_and_read(csi, "digest in the owner namespace", req, &store.source).await?;
    }
    let req = publish_req(target, other, "intruder", by_digest);
    expect_code(
        csi,
        "digest in another namespace",
        req,
        Code::PermissionDenied,
        &[&digest, other, "spec.shared"],
    )
    .await?;
    let mut req = publish_req(target, owner, "nopodinfo", by_digest);
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

    // Tags resolve in the pod's namespace, and the pod gets an Event that says so.
    let tag = [("volume", "llama"), ("tag", "prod")];
    if mount {
        let req = publish_req(target, owner, "tagpod", &tag);
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
    }
    let req = publish_req(
        target,
        owner,
        "badtag",
        &[("volume", "llama"), ("tag", "nope")],
    );
    expect_code(
        csi,
        "unknown tag",
        req,
        Code::NotFound,
        &["tag 'nope'", "prod"],
    )
    .await?;
    // A tag naming a version of another volume is refused, though the digest is allowed.
    let borrowed = SealedVolume::new(
        "borrower",
        SealedVolumeSpec {
            source: Source::upload(),
            tags: BTreeMap::from([("prod".to_string(), digest.clone())]),
            retention: Retention::default(),
            shared: false,
        },
    );
    Api::<SealedVolume>::namespaced(client.clone(), owner)
        .create(&PostParams::default(), &borrowed)
        .await?;
    let req = publish_req(
        target,
        owner,
        "borrowtag",
        &[("volume", "borrower"), ("tag", "prod")],
    );
    expect_code(
        csi,
        "tag naming another volume's version",
        req,
        Code::FailedPrecondition,
        &["not a version of", "borrower"],
    )
    .await?;
    let req = publish_req(
        target,
        owner,
        "badvol",
        &[("volume", "gone"), ("tag", "prod")],
    );
    expect_code(csi, "unknown volume", req, Code::NotFound, &["gone"]).await?;
    // The tag is looked up in the pod's namespace, where there is no volume llama.
    let req = publish_req(target, other, "othertag", &tag);
    expect_code(
        csi,
        "tag from another namespace",
        req,
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
        let req = publish_req(target, other, "sharedreader", by_digest);
        publish_and_read(
            csi,
            "shared volume from another namespace",
            req,
            &store.source,
        )
        .await?;
    }

    // An excluded GPU on the node refuses every publish, read from the labels at publish time.
    Api::<Node>::all(client.clone())
        .patch(
            node_name,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-L4"}}}),
            ),
        )
        .await?;
    let req = publish_req(target, owner, "onl4", by_digest);
    expect_code(
        csi,
        "node with an L4",
        req,
        Code::FailedPrecondition,
        &["NVIDIA-L4", node_name],
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
        &[&format!("--kubelet-dir={kubelet_dir}")],
    );
    let registered = wait_for_driver(&client, &node, true).await;
    let node_id = csinode_driver(&client, &node).await;
    if registered.is_err() {
        eprintln!("plugin log:\n{}", plugin.log());
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
