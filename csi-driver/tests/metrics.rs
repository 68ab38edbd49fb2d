//! `--metrics-addr` against the real binary: `/healthz` is healthy while the CSI gRPC server
//! answers Probe on its socket and unhealthy once it cannot; `/metrics` counts publish errors
//! by gRPC code, publish latency, mounts, cache hits and misses per tier, bytes fetched from the
//! store and bytes read, after a real publish and read (root and /dev/fuse).

mod common;

use std::path::Path;

use common::{Plugin, can_mount, store_with_version};
use sealed_csi::proto::csi::NodeUnpublishVolumeRequest;
use sealed_csi::proto::csi::node_client::NodeClient;

fn read_tree(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            total += read_tree(&path);
        } else {
            total += std::fs::read(&path).unwrap().len() as u64;
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_metrics_follow_publishes() {
    let store = store_with_version("healthz_and_metrics_follow_publishes").await;
    let addr = sealed_test_support::servers::free_addr();
    let mut plugin = Plugin::start(&store.url, &[&format!("--metrics-addr={addr}")]);
    plugin.wait_listening(addr);
    let (status, body) = common::http_get(addr, "/healthz");
    assert_eq!(status, 200, "{body}\nlog:\n{}", plugin.log());
    assert!(body.starts_with("ok"), "{body}");
    let (status, page) = common::http_get(addr, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(
        common::sample(&page, "sealed_csi_fuse_mounts"),
        Some(0.0),
        "{page}"
    );
    assert_eq!(
        common::sample(&page, "sealed_store_fetched_bytes_total"),
        Some(0.0)
    );
    assert_eq!(
        common::sample(&page, "sealed_verification_failures_total"),
        Some(0.0)
    );
    assert_eq!(common::http_get(addr, "/nope").0, 404);

    let mut client = NodeClient::new(plugin.channel().await);
    let target = plugin.pods().join("uid/target");
    // Two refused publishes, counted by code.
    let bad = common::publish_digest("v", &target, "blake3:1234");
    assert!(client.node_publish_volume(bad).await.is_err());
    let unknown = common::publish_digest("v", &target, &format!("blake3:{}", "0".repeat(64)));
    assert!(client.node_publish_volume(unknown).await.is_err());
    let (_, page) = common::http_get(addr, "/metrics");
    assert_eq!(
        common::sample(
            &page,
            r#"sealed_csi_publish_errors_total{code="InvalidArgument"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        common::sample(&page, r#"sealed_csi_publish_errors_total{code="NotFound"}"#),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        common::sample(
            &page,
            r#"sealed_csi_publish_duration_seconds_count{code="InvalidArgument"}"#
        ),
        Some(1.0)
    );

    if can_mount() {
        let req = common::publish_digest("v", &target, &store.digest.to_string());
        client.node_publish_volume(req).await.unwrap();
        let read = read_tree(&target);
        let (_, page) = common::http_get(addr, "/metrics");
        let get =
            |key: &str| common::sample(&page, key).unwrap_or_else(|| panic!("no {key} in\n{page}"));
        assert_eq!(get("sealed_csi_fuse_mounts"), 1.0);
        assert_eq!(get("sealed_csi_published_volumes"), 1.0);
        assert_eq!(
            get(r#"sealed_csi_publish_duration_seconds_count{code="Ok"}"#),
            1.0
        );
        assert!(get(r#"sealed_csi_publish_duration_seconds_sum{code="Ok"}"#) > 0.0);
        assert!(get("sealed_store_fetches_total") >= 1.0);
        assert!(get("sealed_store_fetched_bytes_total") >= 3_000_000.0);
        assert!(get(r#"sealed_cache_misses_total{tier="disk"}"#) >= 1.0);
        assert!(get(r#"sealed_cache_misses_total{tier="memory"}"#) >= 1.0);
        assert!(get("sealed_read_bytes_total") >= read as f64);
        assert!(get("sealed_disk_cache_bytes") > 0.0);
        assert_eq!(get("sealed_verification_failures_total"), 0.0);
        // The per-tier chunk latency histogram: every origin fetch observed once.
        assert_eq!(
            get(r#"sealed_chunk_fetch_seconds_count{tier="origin"}"#),
            get("sealed_store_fetches_total")
        );
        assert!(get(r#"sealed_chunk_fetch_seconds_bucket{tier="origin",le="+Inf"}"#) >= 1.0);
        let origin_before = get("sealed_store_fetched_bytes_total");
        println!(
            "after one read of {read} bytes: fetched {} bytes in {} chunks; publish took {:.3} s",
            get("sealed_store_fetched_bytes_total"),
            get("sealed_store_fetches_total"),
            get(r#"sealed_csi_publish_duration_seconds_sum{code="Ok"}"#)
        );
        // A second publish of the same digest (the same FUSE mount) reads from the caches;
        // drop the kernel page cache first so the reads reach the plugin.
        let second = plugin.pods().join("uid/second");
        let req = common::publish_digest("w", &second, &store.digest.to_string());
        client.node_publish_volume(req).await.unwrap();
        let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
        read_tree(&second);
        let (_, page) = common::http_get(addr, "/metrics");
        let get =
            |key: &str| common::sample(&page, key).unwrap_or_else(|| panic!("no {key} in\n{page}"));
        assert_eq!(get("sealed_csi_fuse_mounts"), 1.0);
        assert_eq!(get("sealed_csi_published_volumes"), 2.0);
        // The second read is served by the node (the daemon's caches, or a hydrated file
        // through FUSE passthrough, which the daemon never sees): nothing more from the origin.
        let origin_after = get("sealed_store_fetched_bytes_total");
        assert_eq!(
            origin_after, origin_before,
            "the second read fetched from the origin"
        );
        // The mount's cold-start record, once its readers are quiet (5 s): one FUSE mount
        // made (the second publish shared it), and every origin byte was its own.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let page = loop {
            let (_, page) = common::http_get(addr, "/metrics");
            let done = common::sample(
                &page,
                r#"sealed_cold_start_seconds_count{phase="first_byte"}"#,
            );
            if done == Some(1.0) || std::time::Instant::now() > deadline {
                break page;
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        };
        let get =
            |key: &str| common::sample(&page, key).unwrap_or_else(|| panic!("no {key} in\n{page}"));
        assert_eq!(
            get(r#"sealed_cold_start_seconds_count{phase="first_byte"}"#),
            1.0,
            "no cold-start record within 20 s:\n{page}\nlog:\n{}",
            plugin.log()
        );
        assert_eq!(
            get(r#"sealed_cold_start_seconds_count{phase="mount"}"#),
            1.0
        );
        assert_eq!(get("sealed_cold_start_read_bytes_per_second_count"), 1.0);
        assert_eq!(
            get(r#"sealed_cold_start_bytes_total{tier="origin"}"#),
            origin_before,
            "the cold start's origin bytes are the store's fetched bytes"
        );
        assert_eq!(get(r#"sealed_cold_start_bytes_total{tier="peer"}"#), 0.0);
        assert!(
            plugin.log().contains("cold start of blake3:"),
            "no cold-start log line:\n{}",
            plugin.log()
        );
        for (id, t) in [("v", &target), ("w", &second)] {
            client
                .node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: id.into(),
                    target_path: t.display().to_string(),
                })
                .await
                .unwrap();
        }
        let (_, page) = common::http_get(addr, "/metrics");
        assert_eq!(common::sample(&page, "sealed_csi_fuse_mounts"), Some(0.0));
        assert_eq!(
            common::sample(&page, "sealed_csi_published_volumes"),
            Some(0.0)
        );
    } else {
        println!("skipped the mounting half: needs root and /dev/fuse");
    }

    // The gRPC server can no longer be reached on its socket: unhealthy.
    std::fs::remove_file(&plugin.socket).unwrap();
    let (status, body) = common::http_get(addr, "/healthz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("does not answer Probe"), "{body}");
}
