//! The node plugin's peer tier with three real `sealed-csi` processes on this machine (each
//! its own cache, CSI socket, peer port and `/metrics`), over one store: a version published
//! and read on one node is fetched from the origin about once for the fleet, the others
//! asking each chunk's owner; with one plugin killed, another node still reads every byte
//! right, from the live owner and the origin. Needs root and /dev/fuse.

mod common;

use common::{Plugin, can_mount};
use sealed_csi::proto::csi::node_client::NodeClient;
use std::net::SocketAddr;
use std::path::Path;

const TOKEN: &str = "csi-peer-test-token-0123456789abcdef";

/// Every file under `dir`, compared with the same path under `want`; returns bytes read.
fn read_and_compare(dir: &Path, want: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(want).unwrap() {
        let entry = entry.unwrap();
        let rel = entry.file_name();
        if entry.path().is_dir() {
            total += read_and_compare(&dir.join(&rel), &entry.path());
        } else {
            let got = std::fs::read(dir.join(&rel)).unwrap();
            assert!(
                got == std::fs::read(entry.path()).unwrap(),
                "{} read wrong through the mount",
                entry.path().display()
            );
            total += got.len() as u64;
        }
    }
    total
}

struct Node {
    plugin: Plugin,
    metrics: SocketAddr,
}

impl Node {
    /// Publishes `digest` into a pod target on this node and reads it all, compared with
    /// `source`; returns the bytes read.
    async fn publish_and_read(&self, digest: &str, source: &Path) -> u64 {
        let mut client = NodeClient::new(self.plugin.channel().await);
        let target = self.plugin.pods().join("uid/target");
        client
            .node_publish_volume(common::publish_digest("v", &target, digest))
            .await
            .unwrap();
        read_and_compare(&target, source)
    }

    fn get(&self, key: &str) -> f64 {
        let (_, page) = common::http_get(self.metrics, "/metrics");
        common::sample(&page, key).unwrap_or_else(|| panic!("no {key} in\n{page}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_read_a_version_once_from_the_origin_and_survive_a_dead_peer() {
    if !can_mount() {
        return;
    }
    // 24 MiB of pseudo-random weights (about 24 chunks) and a config, in a file:// store.
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("tree");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("config.json"), br#"{"model": "peers"}"#).unwrap();
    let weights = sealed_test_support::trees::pseudo_random(24 << 20, 41);
    std::fs::write(source.join("model.safetensors"), &weights).unwrap();
    let store = common::store_of(work, source.clone()).await;
    let (url, version_bytes) = (store.url.clone(), store.bytes as f64);
    let digest = store.digest.to_string();

    let token = store.dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let peers: Vec<SocketAddr> = (0..3)
        .map(|_| sealed_test_support::servers::free_addr())
        .collect();
    let list = peers
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let nodes: Vec<Node> = peers
        .iter()
        .map(|peer| {
            let metrics = sealed_test_support::servers::free_addr();
            let mut plugin = Plugin::start(
                &url,
                &[
                    &format!("--metrics-addr={metrics}"),
                    &format!("--peer-listen={peer}"),
                    &format!("--peers={list}"),
                    &format!("--peer-token-file={}", token.display()),
                ],
            );
            plugin.wait_listening(metrics);
            Node { plugin, metrics }
        })
        .collect();
    for node in &nodes {
        assert_eq!(
            node.get("sealed_peer_members"),
            3.0,
            "{}",
            node.plugin.log()
        );
    }

    // Node 0 reads the whole version: it fetches the chunks it owns from the origin and asks
    // the others for theirs, which fetch them from the origin once and keep them.
    let read = nodes[0].publish_and_read(&digest, &source).await;
    assert!(read as f64 >= version_bytes);
    let origin: f64 = nodes
        .iter()
        .map(|n| n.get("sealed_store_fetched_bytes_total"))
        .sum();
    let from_peers = nodes[0].get("sealed_peer_fetched_bytes_total");
    let served: f64 = nodes[1..]
        .iter()
        .map(|n| n.get("sealed_peer_served_bytes_total"))
        .sum();
    println!(
        "node 0 read {read} bytes: the fleet fetched {origin} bytes from the origin \
         ({:.2}x the version), node 0 got {from_peers} from its peers",
        origin / version_bytes
    );
    assert!(
        origin <= 1.3 * version_bytes,
        "the fleet fetched {origin} bytes from the origin for a {version_bytes}-byte version:\n{}",
        nodes[0].plugin.log()
    );
    // About two thirds of the chunks belong to the other two nodes.
    assert!(
        from_peers >= 0.25 * version_bytes && from_peers == served,
        "node 0 got {from_peers} bytes from peers, which served {served}"
    );
    assert_eq!(nodes[0].get("sealed_verification_failures_total"), 0.0);
    assert_eq!(nodes[0].get("sealed_read_errors_total"), 0.0);

    // Node 2 dies. Node 1 then reads the version: node 0's chunks come from node 0, its own
    // from its cache, node 2's from the origin after one failed request; every byte right.
    let mut nodes = nodes;
    let dead = nodes.pop().unwrap();
    let _ = dead.plugin.crash();
    let hits_before = nodes[1].get("sealed_peer_hits_total");
    nodes[1].publish_and_read(&digest, &source).await;
    let node = &nodes[1];
    assert_eq!(
        node.get("sealed_read_errors_total"),
        0.0,
        "{}",
        node.plugin.log()
    );
    assert!(
        node.get("sealed_peer_hits_total") > hits_before,
        "nothing came from node 0"
    );
    assert!(
        node.get("sealed_peer_request_failures_total") >= 1.0,
        "node 1 never tried the dead node:\n{}",
        node.plugin.log()
    );
    assert!(
        node.get("sealed_peer_skipped_down_total") >= 1.0
            || node.get("sealed_peer_request_failures_total") >= 2.0,
        "the dead node was not marked down"
    );
}
