//! The Node service against the real `sealed-csi` binary: bad input gets the right gRPC code
//! and a message naming the problem; a publish mounts byte-identical data read-only, shares
//! one FUSE mount per digest and unpublish takes everything down.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{Plugin, TestStore, can_mount, store_with_version};
use sealed_csi::proto::csi::node_client::NodeClient;
use sealed_csi::proto::csi::volume_capability::access_mode::Mode;
use sealed_csi::proto::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use sealed_csi::proto::csi::{
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
    let target = plugin.pods().join("uid/target");
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
    let target = plugin.pods().join("uid/target");
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

/// Runs the binary with `args` (no socket comes up) and returns its exit status and stderr.
fn run_to_exit(args: &[&str]) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sealed-csi"))
        .arg(format!(
            "--endpoint=unix://{}",
            dir.path().join("csi.sock").display()
        ))
        .arg(format!("--store=file://{}", dir.path().display()))
        .arg(format!(
            "--state-dir={}",
            dir.path().join("state").display()
        ))
        .arg(format!(
            "--cache-dir={}",
            dir.path().join("cache").display()
        ))
        .arg("--node-id=test-node")
        .args(args)
        // Never a real cluster: the refusal must come before any API call.
        .env("KUBECONFIG", dir.path().join("no-kubeconfig"))
        .env_remove("SEALED_ATTESTATION_SECRET")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn api_server_mode_needs_the_attestation_secret() {
    let (status, stderr) = run_to_exit(&[]);
    assert!(!status.success());
    assert!(
        stderr.contains("--attestation-secret NAMESPACE/NAME")
            && stderr.contains("--insecure-skip-attestation"),
        "{stderr}"
    );
    let (status, stderr) = run_to_exit(&["--attestation-secret=no-slash"]);
    assert!(!status.success());
    assert!(stderr.contains("expected NAMESPACE/NAME"), "{stderr}");
    let (status, stderr) = run_to_exit(&[
        "--attestation-secret=sealed/attestation",
        "--insecure-skip-attestation",
    ]);
    assert!(!status.success());
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_and_cache_dirs_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let store = store_with_version("state_and_cache_dirs_are_private").await;
    let home = tempfile::tempdir().unwrap();
    // Left world-readable by an earlier version of the plugin.
    for d in ["state", "cache"] {
        std::fs::create_dir(home.path().join(d)).unwrap();
        std::fs::set_permissions(home.path().join(d), std::fs::Permissions::from_mode(0o755))
            .unwrap();
    }
    let plugin = Plugin::start_in(home, &store.url, &[]);
    for d in ["state", "cache", "state/mounts", "state/publications"] {
        let mode = std::fs::metadata(plugin.dir.path().join(d))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777;
        assert_eq!(mode, 0o700, "{d}: {mode:o}; {}", plugin.log());
    }
    // New ones are made 0700.
    let fresh = Plugin::start(&store.url, &[]);
    for d in ["state", "cache"] {
        let mode = std::fs::metadata(fresh.dir.path().join(d))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777;
        assert_eq!(mode, 0o700, "{d}: {mode:o}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_outside_kubelet_pods_are_refused_and_left_alone() {
    let store = store_with_version("targets_outside_kubelet_pods_are_refused").await;
    let plugin = Plugin::start(&store.url, &[]);
    let mut client = NodeClient::new(plugin.channel().await);
    let digest = store.digest.to_string();
    // An unrelated directory, a tmpfs on it when we may mount, with a file in it.
    let unrelated_home = tempfile::tempdir().unwrap();
    let unrelated = unrelated_home.path().join("unrelated");
    std::fs::create_dir(&unrelated).unwrap();
    let tmpfs = can_mount();
    if tmpfs {
        nix::mount::mount(
            Some("tmpfs"),
            &unrelated,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
    }
    std::fs::write(unrelated.join("keep"), b"precious").unwrap();
    let pods = plugin.pods();
    std::fs::create_dir_all(pods.join("uid")).unwrap();
    // A symlink in kubelet's pods dir to the unrelated dir, and paths that climb out.
    std::os::unix::fs::symlink(&unrelated, pods.join("uid/escape")).unwrap();
    let dotdot = format!("{}/uid/../../../unrelated", pods.display());
    let targets: Vec<(std::path::PathBuf, &str)> = vec![
        (unrelated.clone(), "outside kubelet's pod directories"),
        (unrelated.join("sub"), "outside kubelet's pod directories"),
        (pods.join("uid/escape"), "symbolic link"),
        (pods.join("uid/escape/mount"), "resolves to"),
        (dotdot.into(), "'.' or '..'"),
        (plugin.dir.path().join("state/mounts"), "outside"),
        (pods.clone(), "outside"),
    ];
    for (target, needle) in &targets {
        let status = client
            .node_publish_volume(publish_req("v", target, &digest))
            .await
            .expect_err("publish outside <kubelet>/pods");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(needle) && status.message().contains("nothing was mounted"),
            "{}: {}",
            target.display(),
            status.message()
        );
        let status = client
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: "v".into(),
                target_path: target.display().to_string(),
            })
            .await
            .expect_err("unpublish outside <kubelet>/pods");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(needle), "{}", status.message());
    }
    // Nothing was unmounted or removed.
    assert_eq!(std::fs::read(unrelated.join("keep")).unwrap(), b"precious");
    assert!(pods.join("uid/escape").symlink_metadata().is_ok());
    if tmpfs {
        assert!(
            sealed_csi::mounts::is_mount_point(&unrelated),
            "the tmpfs survives"
        );
        nix::mount::umount(&unrelated).unwrap();
    } else {
        println!("tmpfs part skipped: needs root");
    }
}
