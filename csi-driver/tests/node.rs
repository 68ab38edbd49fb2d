//! The Node service against the real `sealed-csi` binary: bad input gets the right gRPC code
//! and a message naming the problem; a publish mounts byte-identical data read-only, shares
//! one FUSE mount per digest and unpublish takes everything down.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{Plugin, TestStore, can_mount, store_with_version};
use sealed_csi::csi::node_client::NodeClient;
use sealed_csi::csi::volume_capability::access_mode::Mode;
use sealed_csi::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use sealed_csi::csi::{
    NodeGetCapabilitiesRequest, NodeGetInfoRequest, NodeGetVolumeStatsRequest,
    NodePublishVolumeRequest, NodeUnpublishVolumeRequest, VolumeCapability,
};
use sealed_store::Digest;
use tonic::Code;
use tonic::transport::Channel;

fn capability(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

/// An inline ephemeral volume as kubelet sends it (SINGLE_NODE_WRITER + readonly).
fn publish_req(volume_id: &str, target: &Path, digest: &str) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(capability(Mode::SingleNodeWriter)),
        readonly: true,
        volume_context: HashMap::from([
            ("digest".to_string(), digest.to_string()),
            (
                "csi.storage.k8s.io/ephemeral".to_string(),
                "true".to_string(),
            ),
        ]),
        ..Default::default()
    }
}

async fn expect_error(
    client: &mut NodeClient<Channel>,
    req: NodePublishVolumeRequest,
    code: Code,
    needle: &str,
) {
    let status = client
        .node_publish_volume(req)
        .await
        .expect_err("publish should fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "message {:?} should contain {needle:?}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_code_and_message() {
    let store: TestStore = store_with_version("bad_input_gets_the_right_code_and_message").await;
    let plugin = Plugin::start(&store.url, &[]);
    let mut client = NodeClient::new(plugin.channel().await);
    let target = plugin.dir.path().join("target");
    let good = store.digest.to_string();

    let mut req = publish_req("v", &target, "blake3:1234");
    expect_error(
        &mut client,
        req.clone(),
        Code::InvalidArgument,
        "malformed digest 'blake3:1234'",
    )
    .await;

    req = publish_req("v", &target, &good);
    req.volume_context.remove("digest");
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "'digest' is required",
    )
    .await;

    req = publish_req("", &target, &good);
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "volume_id is required",
    )
    .await;

    req = publish_req("v", Path::new(""), &good);
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "target_path is required",
    )
    .await;

    req = publish_req("v", &target, &good);
    req.volume_capability = None;
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "volume_capability is required",
    )
    .await;

    req = publish_req("v", &target, &good);
    req.readonly = false;
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "sealed volumes are read-only",
    )
    .await;

    req = publish_req("v", &target, &good);
    req.volume_capability = Some(capability(Mode::MultiNodeMultiWriter));
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "MULTI_NODE_MULTI_WRITER",
    )
    .await;

    req = publish_req("v", &target, &good);
    req.volume_capability = Some(VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume::default())),
        ..capability(Mode::MultiNodeReaderOnly)
    });
    expect_error(
        &mut client,
        req,
        Code::InvalidArgument,
        "block access is not supported",
    )
    .await;

    let unknown = Digest::of(b"never pushed");
    req = publish_req("v", &target, &unknown.to_string());
    expect_error(
        &mut client,
        req,
        Code::NotFound,
        &format!("version {unknown} not found"),
    )
    .await;
    assert!(!target.exists(), "a failed publish leaves no target behind");

    let status = client
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: "v".into(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");

    // Unpublishing what was never published is a success.
    client
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "v".into(),
            target_path: target.display().to_string(),
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_store_is_unavailable() {
    // Nothing listens on port 1: the store cannot be reached, at start or on publish.
    let plugin = Plugin::start(
        "s3://sealed-test",
        &[
            "--store-endpoint=http://127.0.0.1:1",
            "--store-region=us-east-1",
            "--store-timeout=1",
            "--store-retries=0",
        ],
    );
    let mut client = NodeClient::new(plugin.channel().await);
    let target = plugin.dir.path().join("target");
    let digest = Digest::of(b"anything").to_string();
    expect_error(
        &mut client,
        publish_req("v", &target, &digest),
        Code::Unavailable,
        "store s3://sealed-test is not reachable",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_capabilities() {
    let store = store_with_version("info_and_capabilities").await;
    let plugin = Plugin::start(&store.url, &["--max-volumes=7"]);
    let mut client = NodeClient::new(plugin.channel().await);
    let info = client
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "test-node");
    assert_eq!(info.max_volumes_per_node, 7);
    let caps = client
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1);
}

/// Mounts of `digest` (the FUSE mount and its binds) under `dir`, per /proc/self/mountinfo.
fn fuse_mounts_of(digest: &Digest, dir: &Path) -> usize {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let name = format!("sealed-{}", digest.hex());
    let dir = dir.canonicalize().unwrap();
    info.lines()
        .filter(|l| l.contains(&name))
        .filter(|l| {
            l.split(' ')
                .nth(4)
                .is_some_and(|mp| Path::new(mp).starts_with(&dir))
        })
        .count()
}

fn assert_same_tree(mounted: &Path, source: &Path) {
    for file in ["config.json", "sub/weights.bin"] {
        let want = std::fs::read(source.join(file)).unwrap();
        let got = std::fs::read(mounted.join(file)).unwrap();
        assert!(got == want, "{file} differs under {}", mounted.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_shares_one_fuse_mount_and_unpublish_removes_it() {
    if !can_mount() {
        println!("skipped: mounting needs root and /dev/fuse");
        return;
    }
    let store = store_with_version("publish_shares_one_fuse_mount_and_unpublish_removes_it").await;
    let plugin = Plugin::start(&store.url, &[]);
    let mut client = NodeClient::new(plugin.channel().await);
    let digest = store.digest.to_string();
    let pods = plugin.dir.path().join("pods");
    let (t1, t2) = (pods.join("a/volume"), pods.join("b/volume"));

    client
        .node_publish_volume(publish_req("vol-a", &t1, &digest))
        .await
        .unwrap();
    // Idempotent: the same volume at the same target again.
    client
        .node_publish_volume(publish_req("vol-a", &t1, &digest))
        .await
        .unwrap();
    // A static persistent volume: ReadOnlyMany, no ephemeral marker.
    let mut pv = publish_req("pv-b", &t2, &digest);
    pv.volume_capability = Some(capability(Mode::MultiNodeReaderOnly));
    pv.volume_context.remove("csi.storage.k8s.io/ephemeral");
    client.node_publish_volume(pv).await.unwrap();

    assert_same_tree(&t1, &store.source);
    assert_same_tree(&t2, &store.source);
    // One FUSE mount plus one bind mount per target.
    assert_eq!(
        fuse_mounts_of(&store.digest, plugin.dir.path()),
        3,
        "{}",
        plugin.log()
    );
    let write = std::fs::write(t1.join("new"), b"x").unwrap_err();
    assert_eq!(write.raw_os_error(), Some(libc::EROFS), "{write}");

    // Another volume cannot take a target that is in use.
    let status = client
        .node_publish_volume(publish_req("vol-other", &t1, &digest))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");

    let stats = client
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: "vol-a".into(),
            volume_path: t1.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let bytes = stats.usage.iter().find(|u| u.unit == 1).unwrap();
    let want: u64 = ["config.json", "sub/weights.bin"]
        .iter()
        .map(|f| std::fs::metadata(store.source.join(f)).unwrap().len())
        .sum();
    assert_eq!(bytes.total as u64, want);

    let unpublish = |id: &str, t: &Path| NodeUnpublishVolumeRequest {
        volume_id: id.into(),
        target_path: t.display().to_string(),
    };
    client
        .node_unpublish_volume(unpublish("vol-a", &t1))
        .await
        .unwrap();
    assert!(!t1.exists(), "target removed");
    assert_same_tree(&t2, &store.source);
    assert_eq!(fuse_mounts_of(&store.digest, plugin.dir.path()), 2);
    // Idempotent: again, after it is gone.
    client
        .node_unpublish_volume(unpublish("vol-a", &t1))
        .await
        .unwrap();
    client
        .node_unpublish_volume(unpublish("pv-b", &t2))
        .await
        .unwrap();
    assert!(!t2.exists(), "target removed");
    assert_eq!(
        fuse_mounts_of(&store.digest, plugin.dir.path()),
        0,
        "{}",
        plugin.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_of_one_digest_share_one_fuse_mount() {
    if !can_mount() {
        println!("skipped: mounting needs root and /dev/fuse");
        return;
    }
    let store = store_with_version("concurrent_publishes_of_one_digest_share_one_fuse_mount").await;
    let plugin = Plugin::start(&store.url, &[]);
    let channel = plugin.channel().await;
    let digest = store.digest.to_string();
    let targets: Vec<_> = (0..6)
        .map(|i| plugin.dir.path().join(format!("pods/{i}/volume")))
        .collect();
    let publishes = targets.iter().enumerate().map(|(i, t)| {
        let mut client = NodeClient::new(channel.clone());
        let req = publish_req(&format!("vol-{i}"), t, &digest);
        async move { client.node_publish_volume(req).await }
    });
    for result in futures::future::join_all(publishes).await {
        result.unwrap();
    }
    assert_eq!(
        fuse_mounts_of(&store.digest, plugin.dir.path()),
        1 + targets.len()
    );
    let mut client = NodeClient::new(channel);
    for (i, t) in targets.iter().enumerate() {
        client
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: format!("vol-{i}"),
                target_path: t.display().to_string(),
            })
            .await
            .unwrap();
    }
    assert_eq!(
        fuse_mounts_of(&store.digest, plugin.dir.path()),
        0,
        "{}",
        plugin.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_plugin_cleans_up_what_a_crashed_one_left() {
    if !can_mount() {
        println!("skipped: mounting needs root and /dev/fuse");
        return;
    }
    let store = store_with_version("a_restarted_plugin_cleans_up_what_a_crashed_one_left").await;
    let plugin = Plugin::start(&store.url, &[]);
    let target = plugin.dir.path().join("pods/a/volume");
    let mut client = NodeClient::new(plugin.channel().await);
    client
        .node_publish_volume(publish_req("vol-a", &target, &store.digest.to_string()))
        .await
        .unwrap();
    assert_eq!(fuse_mounts_of(&store.digest, plugin.dir.path()), 2);
    drop(client);

    // SIGKILL: the FUSE mount and the bind are left behind, served by nobody.
    let home = plugin.crash();
    assert_eq!(fuse_mounts_of(&store.digest, home.path()), 2);
    let plugin = Plugin::start_in(home, &store.url, &[]);
    // The FUSE mount under the state directory is gone at start.
    assert_eq!(
        fuse_mounts_of(&store.digest, plugin.dir.path()),
        1,
        "{}",
        plugin.log()
    );
    // kubelet's unpublish of the orphaned target unmounts it and removes the directory.
    let mut client = NodeClient::new(plugin.channel().await);
    client
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "vol-a".into(),
            target_path: target.display().to_string(),
        })
        .await
        .unwrap();
    assert!(!target.exists());
    assert_eq!(
        fuse_mounts_of(&store.digest, plugin.dir.path()),
        0,
        "{}",
        plugin.log()
    );
}
