//! `--metrics-addr` against the real binary: `/healthz` is healthy while the CSI gRPC server
//! answers Probe on its socket and unhealthy once it cannot; `/metrics` counts publish errors
//! by gRPC code, publish latency, mounts, cache hits and misses per tier, bytes fetched from the
//! store and bytes read, after a real publish and read (root and /dev/fuse).

mod common;

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Plugin, can_mount, store_with_version};
use sealed_csi::csi::node_client::NodeClient;
use sealed_csi::csi::volume_capability::access_mode::Mode;
use sealed_csi::csi::volume_capability::{AccessMode, AccessType, MountVolume};
use sealed_csi::csi::{NodePublishVolumeRequest, NodeUnpublishVolumeRequest, VolumeCapability};

fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// A plain HTTP/1.1 GET: status and body.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let started = Instant::now();
    let mut stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if started.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("cannot connect to {addr}: {e}"),
        }
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The value of the sample `key` (`name` or `name{labels}`) in a Prometheus text page.
fn sample(page: &str, key: &str) -> Option<f64> {
    page.lines().find_map(|line| {
        line.strip_prefix(key)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

fn publish_req(volume_id: &str, target: &Path, digest: &str) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }),
        readonly: true,
        volume_context: HashMap::from([("digest".to_string(), digest.to_string())]),
        ..Default::default()
    }
}

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
    let addr = free_addr();
    let plugin = Plugin::start(&store.url, &[&format!("--metrics-addr={addr}")]);
    let (status, body) = http_get(addr, "/healthz");
    assert_eq!(status, 200, "{body}\nlog:\n{}", plugin.log());
    assert!(body.starts_with("ok"), "{body}");
    let (status, page) = http_get(addr, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(sample(&page, "sealed_csi_fuse_mounts"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "sealed_store_fetched_bytes_total"), Some(0.0));
    assert_eq!(
        sample(&page, "sealed_verification_failures_total"),
        Some(0.0)
    );
    assert_eq!(http_get(addr, "/nope").0, 404);

    let mut client = NodeClient::new(plugin.channel().await);
    let target = plugin.dir.path().join("target");
    // Two refused publishes, counted by code.
    let bad = publish_req("v", &target, "blake3:1234");
    assert!(client.node_publish_volume(bad).await.is_err());
    let unknown = publish_req("v", &target, &format!("blake3:{}", "0".repeat(64)));
    assert!(client.node_publish_volume(unknown).await.is_err());
    let (_, page) = http_get(addr, "/metrics");
    assert_eq!(
        sample(
            &page,
            r#"sealed_csi_publish_errors_total{code="InvalidArgument"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(&page, r#"sealed_csi_publish_errors_total{code="NotFound"}"#),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            r#"sealed_csi_publish_duration_seconds_count{code="InvalidArgument"}"#
        ),
        Some(1.0)
    );

    if can_mount() {
        let req = publish_req("v", &target, &store.digest.to_string());
        client.node_publish_volume(req).await.unwrap();
        let read = read_tree(&target);
        let (_, page) = http_get(addr, "/metrics");
        let get = |key: &str| sample(&page, key).unwrap_or_else(|| panic!("no {key} in\n{page}"));
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
        let hits_before = get(r#"sealed_cache_hits_total{tier="memory"}"#)
            + get(r#"sealed_cache_hits_total{tier="disk"}"#);
        println!(
            "after one read of {read} bytes: fetched {} bytes in {} chunks; publish took {:.3} s",
            get("sealed_store_fetched_bytes_total"),
            get("sealed_store_fetches_total"),
            get(r#"sealed_csi_publish_duration_seconds_sum{code="Ok"}"#)
        );
        // A second publish of the same digest (the same FUSE mount) reads from the caches;
        // drop the kernel page cache first so the reads reach the plugin.
        let second = plugin.dir.path().join("second");
        let req = publish_req("w", &second, &store.digest.to_string());
        client.node_publish_volume(req).await.unwrap();
        let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
        read_tree(&second);
        let (_, page) = http_get(addr, "/metrics");
        let get = |key: &str| sample(&page, key).unwrap_or_else(|| panic!("no {key} in\n{page}"));
        assert_eq!(get("sealed_csi_fuse_mounts"), 1.0);
        assert_eq!(get("sealed_csi_published_volumes"), 2.0);
        let hits_after = get(r#"sealed_cache_hits_total{tier="memory"}"#)
            + get(r#"sealed_cache_hits_total{tier="disk"}"#);
        assert!(
            hits_after > hits_before,
            "cache hits {hits_before} -> {hits_after}"
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
        let (_, page) = http_get(addr, "/metrics");
        assert_eq!(sample(&page, "sealed_csi_fuse_mounts"), Some(0.0));
        assert_eq!(sample(&page, "sealed_csi_published_volumes"), Some(0.0));
    } else {
        println!("skipped the mounting half: needs root and /dev/fuse");
    }

    // The gRPC server can no longer be reached on its socket: unhealthy.
    std::fs::remove_file(&plugin.socket).unwrap();
    let (status, body) = http_get(addr, "/healthz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("does not answer Probe"), "{body}");
}
