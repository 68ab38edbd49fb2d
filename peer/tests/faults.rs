//! Faults in the fleet, with real `sealed mount` processes over moto: a peer killed in the
//! middle of a read, a peer that serves wrong bytes, and the membership changing while the
//! nodes read. Readers see every byte right and no error in each.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Query};
use common::{
    Fleet, Gate, TOKEN, counter, peer_counter, ports, read_at_once_gated, read_everywhere,
};

#[test]
fn a_peer_killed_mid_read_leaves_the_others_reading_from_the_store() {
    // Six files of 8 MiB (about 48 chunks, a quarter of them the victim's): the readers stop
    // before the third file, the victim is killed, and the last four files (about 8 chunks
    // of the victim's) are read with it dead, however fast this machine is.
    let Some(fleet) = Fleet::start(6, 8) else {
        return;
    };
    let (ports, addrs) = ports(4);
    // A short peer bound so that requests in flight to the dead node end quickly.
    let peers = [
        format!("--peers={}", addrs.join(",")),
        "--peer-timeout-ms=1000".to_owned(),
    ];
    let extra = ["--readahead=4Mi"];
    let mut nodes: Vec<_> = (0..4)
        .map(|i| fleet.node(i, ports[i], &peers, &extra))
        .collect();
    let victim = nodes.pop().unwrap();
    let files = Arc::new(fleet.files.clone());
    let gate = Gate::before_file(2);
    let (_, readers) = read_at_once_gated(
        nodes.iter().map(|n| n.mnt.clone()).collect(),
        &files,
        Duration::ZERO,
        gate.clone(),
    );
    let started = Instant::now();
    while gate.waiting() < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the readers did not reach the gate"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    victim.kill();
    gate.open();
    for r in readers {
        assert_eq!(r.join().unwrap(), Vec::<String>::new(), "wrong bytes read");
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    // Any sign of the dead owner: a failed or timed-out request, or a skip while it was
    // marked down.
    let noticed: u64 = stats
        .iter()
        .map(|s| {
            [
                "request_failures",
                "request_timeouts",
                "body_timeouts",
                "skipped_down",
            ]
            .iter()
            .map(|k| peer_counter(s, k))
            .sum::<u64>()
        })
        .sum();
    for s in &stats {
        assert_eq!(counter(s, "read_errors"), 0, "a reader saw an error: {s}");
    }
    assert!(
        noticed > 0,
        "no node noticed the dead peer (it owned a quarter of the chunks): {stats:?}"
    );
    // Its chunks went to the next-best member, not every survivor to the origin.
    let rerouted: u64 = stats.iter().map(|s| peer_counter(s, "rerouted")).sum();
    assert!(
        rerouted > 0,
        "no survivor asked the dead peer's chunks of the next-best member: {stats:?}"
    );
}

/// A test peer that lies (a stand-in for a compromised or broken node): it has the fleet's
/// token and answers every chunk with the right number of wrong bytes.
async fn lying_peer(listener: tokio::net::TcpListener) {
    #[derive(serde::Deserialize)]
    struct Len {
        len: usize,
    }
    let app = axum::Router::new().route(
        "/v1/chunks/{digest}",
        axum::routing::get(|Path(_): Path<String>, Query(q): Query<Len>| async move {
            vec![0xA5u8; q.len.min(4 << 20)]
        }),
    );
    axum::serve(listener, app).await.unwrap();
}

#[test]
fn a_peer_serving_wrong_bytes_is_caught_and_the_chunk_refetched() {
    let Some(fleet) = Fleet::start(1, 32) else {
        return;
    };
    let _ = TOKEN;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let liar = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let liar_addr = liar.local_addr().unwrap().to_string();
    runtime.spawn(lying_peer(liar));
    let (ports, mut addrs) = ports(2);
    addrs.push(liar_addr);
    let peers = [format!("--peers={}", addrs.join(","))];
    let nodes: Vec<_> = (0..2)
        .map(|i| fleet.node(i, ports[i], &peers, &[]))
        .collect();
    for wrong in read_everywhere(&fleet, &nodes) {
        assert_eq!(
            wrong,
            Vec::<String>::new(),
            "a peer's wrong bytes reached a reader"
        );
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    for s in &stats {
        assert_eq!(counter(s, "read_errors"), 0);
        // The liar owns about a third of the chunks; each was caught and refetched.
        assert!(
            counter(s, "peer_corrupt") > 0,
            "no wrong answer was caught: {s}"
        );
    }
}

#[test]
fn the_membership_changes_while_the_nodes_read() {
    // Six files of 8 MiB (about 8 chunks each): the first three are read with the first
    // membership, the last three with the second.
    let Some(fleet) = Fleet::start(6, 8) else {
        return;
    };
    let (ports, addrs) = ports(4);
    let list = fleet.work.path().join("peers");
    let write_list = |members: &[String]| {
        // Renamed into place, so a node never reads a half-written list.
        let tmp = list.with_extension("new");
        std::fs::write(&tmp, members.join("\n")).unwrap();
        std::fs::rename(&tmp, &list).unwrap();
    };
    write_list(&addrs[..3]);
    let peers = [format!("--peers-file={}", list.display())];
    let extra = ["--readahead=4Mi"];
    let nodes: Vec<_> = (0..4)
        .map(|i| fleet.node(i, ports[i], &peers, &extra))
        .collect();
    let files = Arc::new(fleet.files.clone());
    // Nodes 0 and 1 read; node 2 leaves the list and node 3 joins it midway. The readers stop
    // before opening the fourth file until both readers' nodes have taken the new list, so
    // the files after it are fetched with the new membership only.
    let gate = Gate::before_file(3);
    let (_, readers) = read_at_once_gated(
        nodes[..2].iter().map(|n| n.mnt.clone()).collect(),
        &files,
        Duration::ZERO,
        gate.clone(),
    );
    let started = Instant::now();
    while gate.waiting() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the readers did not reach the gate"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    write_list(&[&addrs[..2], &addrs[3..]].concat());
    for node in &nodes[..2] {
        node.wait_members(3, Duration::from_secs(30));
    }
    gate.open();
    for r in readers {
        assert_eq!(r.join().unwrap(), Vec::<String>::new(), "wrong bytes read");
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    for s in &stats[..2] {
        assert_eq!(counter(s, "read_errors"), 0);
    }
    assert!(
        peer_counter(&stats[2], "served_requests") > 0,
        "node 2 served nothing before it left: {}",
        stats[2]
    );
    assert!(
        peer_counter(&stats[3], "served_requests") > 0,
        "node 3 served nothing after it joined: {}",
        stats[3]
    );
}
