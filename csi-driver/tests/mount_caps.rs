//! The plugin's per-mount caps and store bounds, set by flags on the real binary: a version
//! larger than the caps is refused with `RESOURCE_EXHAUSTED` naming the cap and both numbers
//! (kubelet shows it on the pod), and absurd numbers are refused when the plugin starts.

mod common;

use std::process::Command;

use common::{Plugin, can_mount, publish_digest, store_with_version};
use sealed_csi::proto::csi::node_client::NodeClient;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_over_the_mount_caps_is_refused_with_the_cap() {
    if !can_mount() {
        println!("skipped: mounting needs root and /dev/fuse");
        return;
    }
    // The test version has three entries (config.json, sub, sub/weights.bin).
    let store = store_with_version("mount_caps").await;
    let plugin = Plugin::start(&store.url, &["--max-mount-entries=2"]);
    let mut client = NodeClient::new(plugin.channel().await);
    let target = plugin.pods().join("a/volume");
    let status = client
        .node_publish_volume(publish_digest("vol-a", &target, &store.digest.to_string()))
        .await
        .expect_err("a version over the cap was mounted");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("max_entries") && status.message().contains('2'),
        "{status:?}"
    );

    // The same version under the default caps mounts.
    let plugin = Plugin::start(&store.url, &[]);
    let mut client = NodeClient::new(plugin.channel().await);
    let target = plugin.pods().join("a/volume");
    client
        .node_publish_volume(publish_digest("vol-a", &target, &store.digest.to_string()))
        .await
        .unwrap();
    assert!(target.join("config.json").exists());
}

#[test]
fn absurd_numbers_are_refused_at_start() {
    for (flag, needle) in [
        ("--store-retries=4294967295", "--store-retries"),
        ("--store-timeout=18446744073709551615", "--store-timeout"),
        ("--store-timeout=0", "--store-timeout"),
        ("--max-fetches-per-read=0", "1 to 4096"),
        ("--max-fetches-per-mount=1000000", "1 to 4096"),
        ("--breaker-open=99999999", "--breaker-open"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sealed-csi"))
            .args(["--node-id=n", "--store=memory://", "--standalone", flag])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(needle), "{flag}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flag}: {stderr}");
    }
}
