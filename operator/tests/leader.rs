//! The `sealed-operator run` binary against the real API server: two replicas with
//! `--leader-elect` elect exactly one leader (the Lease names it, `/metrics` says so), both
//! answer `/healthz`, and killing the leader hands the lease to the other.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

use sealed_test_support::servers::free_port;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

struct Replica {
    child: Child,
    port: u16,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.0 GET: (status code, body), or None while nothing listens.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}

fn is_leader(port: u16) -> Option<bool> {
    let (_, body) = get(port, "/metrics")?;
    let line = body
        .lines()
        .find(|l| l.starts_with("sealed_operator_leader "))?;
    Some(line.trim_end().ends_with(" 1"))
}

fn start(kubeconfig: &std::path::Path, ns: &str, store: &str, identity: &str) -> Replica {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_sealed-operator"))
        .args(["run", "--leader-elect", "--sync-executor", "inline"])
        .args(["--store", store, "--namespace", ns, "--watch-namespace", ns])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(["--gc-interval", "0"])
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAME", identity)
        .env("SEALED_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start sealed-operator");
    Replica { child, port }
}

fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_and_failover() {
    let Some(cluster) = sealed_e2e::cluster("one_leader_and_failover").await else {
        return;
    };
    sealed_e2e::install_crds(&cluster.client, "sealed-operator-test")
        .await
        .expect("CRDs");
    let ns = cluster
        .temp_namespace("svol-leader")
        .await
        .expect("namespace");
    let store_dir = tempfile::tempdir().expect("tempdir");
    let store = format!("file://{}", store_dir.path().display());
    let kubeconfig = cluster.kubeconfig.clone();

    let mut a = Some(start(&kubeconfig, &ns, &store, "replica-a"));
    let b = start(&kubeconfig, &ns, &store, "replica-b");
    let ports = [a.as_ref().map(|r| r.port).unwrap_or(0), b.port];
    // Healthy within the bound: /healthz says 503 ("controllers not running") until a
    // replica's controllers have started, which on a loaded machine can take a moment.
    for port in ports {
        wait_until("/healthz says 200", Duration::from_secs(30), || {
            get(port, "/healthz").filter(|(code, _)| *code == 200)
        });
    }
    let leaders = wait_until("exactly one leader", Duration::from_secs(40), || {
        let states: Vec<bool> = ports.iter().filter_map(|p| is_leader(*p)).collect();
        (states.len() == 2 && states.iter().filter(|l| **l).count() == 1).then_some(states)
    });
    // It stays that way: the follower does not take over while the leader renews.
    std::thread::sleep(Duration::from_secs(3));
    let again: Vec<bool> = ports.iter().filter_map(|p| is_leader(*p)).collect();
    assert_eq!(again, leaders, "leadership flapped");

    let leases: Api<Lease> = Api::namespaced(cluster.client.clone(), &ns);
    let lease = leases.get("sealed-operator").await.expect("the Lease");
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .expect("a holder");
    let leader_is_a = leaders[0];
    assert_eq!(
        holder,
        if leader_is_a {
            "replica-a"
        } else {
            "replica-b"
        }
    );

    // Kill the leader: the other replica takes the lease within its duration (15 s) + grace.
    let survivor = if leader_is_a {
        drop(a.take());
        b.port
    } else {
        // Killing b: keep a.
        let mut b = b;
        let _ = b.child.kill();
        let _ = b.child.wait();
        ports[0]
    };
    let took = Instant::now();
    wait_until("the follower takes over", Duration::from_secs(45), || {
        is_leader(survivor).filter(|l| *l)
    });
    eprintln!("failover took {:?}", took.elapsed());
    drop(a);
    let _ = cluster.delete_namespace(&ns).await;
}
