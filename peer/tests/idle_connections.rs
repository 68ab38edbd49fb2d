//! Idle connections do not starve a node (design invariant 8; issue 34): a real `sealed
//! mount` node, started under a 1024 open-files limit as a container runtime may start it,
//! takes 1,100 connections to its peer port from a dozen loopback addresses (hostile pods)
//! that send only the HTTP/2 preface, or nothing. Its caps close most at accept, it keeps
//! descriptors in reserve, so meanwhile a peer request is answered at once and a reader gets
//! uncached data through the FUSE mount (cache files, store connections); and the header
//! deadline closes every idle connection it did take.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use common::{Fleet, Gate, ports, read_all};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const LIMIT: u64 = 1024;
const IDLE: usize = 1_100;
/// Source addresses of the idle connections (127.0.1.1 ..).
const SOURCES: usize = 12;
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

async fn idle_connections(peer: SocketAddr) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for i in 0..IDLE {
        let src = IpAddr::V4(Ipv4Addr::new(127, 0, 1, (i % SOURCES + 1) as u8));
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::new(src, 0)).unwrap();
        let Ok(Ok(mut conn)) =
            tokio::time::timeout(Duration::from_secs(1), socket.connect(peer)).await
        else {
            continue;
        };
        // Every tenth sends nothing at all.
        if i % 10 != 0 {
            let _ = conn.write_all(PREFACE).await;
        }
        held.push(conn);
    }
    held
}

/// A peer request without the token, from an address no idle connection uses: the status
/// line, within `within`.
async fn peer_request(peer: SocketAddr, within: Duration) -> Result<String, String> {
    let asked = async {
        let mut conn = TcpStream::connect(peer).await.map_err(|e| e.to_string())?;
        let head = format!(
            "GET /v1/chunks/{}?len=1 HTTP/1.1\r\nHost: peer\r\nConnection: close\r\n\r\n",
            "0".repeat(64)
        );
        conn.write_all(head.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut reply = Vec::new();
        let _ = conn.read_to_end(&mut reply).await;
        let text = String::from_utf8_lossy(&reply).into_owned();
        Ok::<_, String>(text.lines().next().unwrap_or("").to_owned())
    };
    tokio::time::timeout(within, asked)
        .await
        .map_err(|_| format!("no answer in {within:?}"))?
}

/// How many of `conns` the server has closed (EOF or reset) within `within`.
async fn closed_within(conns: &mut [TcpStream], within: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + within;
    let mut closed = 0;
    for conn in conns.iter_mut() {
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
                // The server's HTTP/2 SETTINGS or GOAWAY: read on to the end.
                Ok(Ok(n)) if n > 0 => continue,
                Ok(_) => {
                    closed += 1;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    closed
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn idle_connections_do_not_starve_a_node() {
    let Some(fleet) = Fleet::start(3, 2) else {
        return;
    };
    // This process holds the idle connections' client ends: more than 1024.
    let _ = sealed_service::listen::raise_nofile_limit();
    let (port, addr) = {
        let (ports, addrs) = ports(1);
        (ports[0], addrs[0].clone())
    };
    let node = fleet.node_limited(0, port, &[format!("--peers={addr}")], &[], Some(LIMIT));
    let peer: SocketAddr = addr.parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();

    let started = Instant::now();
    let mut held = rt.block_on(idle_connections(peer));
    eprintln!(
        "{} of {IDLE} idle connections opened in {:?}; the node holds {} descriptors",
        held.len(),
        started.elapsed(),
        open_fds(node.child.id())
    );

    // A peer request is answered at once.
    let status = rt.block_on(peer_request(peer, Duration::from_secs(5)));
    assert_eq!(
        status.as_deref(),
        Ok("HTTP/1.1 401 Unauthorized"),
        "a peer request under idle connections: {}",
        node.log()
    );
    // A reader gets uncached data through the mount (bounded: a starved node may hang).
    let (done, reading) = std::sync::mpsc::channel();
    {
        let (mnt, files) = (node.mnt.clone(), fleet.files.clone());
        std::thread::spawn(move || {
            let wrong = read_all(
                &mnt,
                &files,
                &AtomicU64::new(0),
                Duration::ZERO,
                &Gate::none(),
            );
            let _ = done.send(wrong);
        });
    }
    let wrong = reading
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the read did not end in 60 s: {}", node.log()));
    assert!(wrong.is_empty(), "read wrong: {wrong:?}");
    let fds = open_fds(node.child.id());
    assert!(
        fds < (LIMIT as usize) - 256,
        "the node holds {fds} descriptors: the reserve is touched"
    );

    // The header deadline (10 s by default) closes every idle connection the node took.
    let closed = rt.block_on(closed_within(&mut held, Duration::from_secs(20)));
    assert_eq!(closed, held.len(), "idle connections left open after 20 s");
    assert_eq!(
        rt.block_on(peer_request(peer, Duration::from_secs(5)))
            .as_deref(),
        Ok("HTTP/1.1 401 Unauthorized")
    );
    node.stop();
}
