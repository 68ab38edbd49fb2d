//! Four real `sealed mount` processes, each its own cache dir and peer port, cold-read the
//! same version from one S3 server (moto) at the same moment: every byte is right and the
//! fleet reads the version from the store about once (≤ 1.3×), not four times.

mod common;

use common::{Fleet, counter, peer_counter, ports, read_everywhere};

#[test]
fn four_nodes_read_a_version_from_the_store_about_once() {
    let Some(fleet) = Fleet::start(2, 24) else {
        return;
    };
    let (ports, addrs) = ports(4);
    let peers = [format!("--peers={}", addrs.join(","))];
    let nodes: Vec<_> = (0..4)
        .map(|i| fleet.node(i, ports[i], &peers, &[]))
        .collect();
    for wrong in read_everywhere(&fleet, &nodes) {
        assert_eq!(wrong, Vec::<String>::new(), "wrong bytes read");
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    let origin: u64 = stats
        .iter()
        .map(|s| counter(s, "store_bytes_fetched"))
        .sum();
    let from_peers: u64 = stats.iter().map(|s| counter(s, "peer_bytes_fetched")).sum();
    let served: u64 = stats.iter().map(|s| peer_counter(s, "served_bytes")).sum();
    let size = fleet.version_bytes();
    eprintln!("version {size} B: origin {origin} B, from peers {from_peers} B, served {served} B");
    assert!(
        origin * 10 <= size * 13,
        "the fleet read {origin} B from the store for a {size} B version (> 1.3×)"
    );
    assert!(from_peers >= size * 2, "peers served only {from_peers} B");
    for s in &stats {
        assert_eq!(counter(s, "read_errors"), 0);
        assert_eq!(counter(s, "peer_corrupt"), 0);
        // Every node owns a share and served it: no owner sat idle.
        assert!(
            peer_counter(s, "served_requests") > 0,
            "an owner served nothing: {s}"
        );
    }
}

/// With a fanout of 2, four nodes give each chunk two owners: the secondary asks the
/// primary (one hop), so the store still sees each chunk about once, and both serve.
#[test]
fn hot_chunks_have_several_owners_and_still_one_origin_fetch() {
    let Some(fleet) = Fleet::start(1, 24) else {
        return;
    };
    let (ports, addrs) = ports(4);
    let peers = [
        format!("--peers={}", addrs.join(",")),
        "--peer-fanout=2".to_owned(),
    ];
    let nodes: Vec<_> = (0..4)
        .map(|i| fleet.node(i, ports[i], &peers, &[]))
        .collect();
    for wrong in read_everywhere(&fleet, &nodes) {
        assert_eq!(wrong, Vec::<String>::new(), "wrong bytes read");
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    let origin: u64 = stats
        .iter()
        .map(|s| counter(s, "store_bytes_fetched"))
        .sum();
    let forwarded: u64 = stats.iter().map(|s| peer_counter(s, "forwarded")).sum();
    let size = fleet.version_bytes();
    assert!(
        origin * 10 <= size * 13,
        "{origin} B from the store for a {size} B version"
    );
    assert!(forwarded > 0, "no secondary owner passed a request on");
}

/// With `--peer-upload-rate`, what a node serves its peers waits for the cap: two nodes
/// reading a 16 MiB version at once each serve the other its share (about 8 MiB) through a
/// 2 MiB/s cap, so their answers wait seconds in all, and every byte is still right.
#[test]
fn served_bytes_wait_for_the_upload_cap_and_arrive_whole() {
    let Some(fleet) = Fleet::start(2, 8) else {
        return;
    };
    let (ports, addrs) = ports(2);
    let peers = [
        format!("--peers={}", addrs.join(",")),
        "--peer-upload-rate=2Mi".to_owned(),
    ];
    let nodes: Vec<_> = (0..2)
        .map(|i| fleet.node(i, ports[i], &peers, &[]))
        .collect();
    for wrong in read_everywhere(&fleet, &nodes) {
        assert_eq!(wrong, Vec::<String>::new(), "wrong bytes read");
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    for s in &stats {
        assert_eq!(counter(s, "read_errors"), 0);
        let served = peer_counter(s, "served_bytes");
        let waited_us = peer_counter(s, "upload_wait_us");
        eprintln!("served {served} B, waited {waited_us} us for the cap");
        // Past the bucket's first slice, 2 MiB/s is 0.5 s a MiB; the waits of answers sent
        // side by side add up, so their sum is at least that (half of it, for slack).
        let paced_us = served.saturating_sub(64 << 10) * 1_000_000 / (2 << 20);
        assert!(served > 0, "a node served nothing: {s}");
        assert!(
            waited_us >= paced_us / 2,
            "{served} B served at 2 MiB/s but answers waited only {waited_us} us: {s}"
        );
    }
}
