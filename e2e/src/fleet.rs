//! The test cluster with more nodes (`hack/cluster.sh up --nodes N`), and what a fleet test
//! needs around it: images in every node's containerd, an origin that counts the bytes it
//! serves, helm, and the metrics of pods the host reaches by their IP.
//!
//! Extra nodes are `sealed-node-2..N`, tainted and labelled `sealedvolumes.io/fleet=true` so
//! other tests' pods stay off them; [`ExtraNodes`] removes them (`hack/cluster.sh down
//! --extra-nodes`) when dropped, so the shared cluster is left as it was.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail, ensure};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::{cluster_dir, repo_root};

/// The taint (`=true:NoSchedule`) and label (`=true`) of every extra node.
pub const FLEET_KEY: &str = "sealedvolumes.io/fleet";

/// The first node's name and address (`hack/cluster.sh`'s defaults).
pub const FIRST_NODE: &str = "sealed-node";
pub const FIRST_NODE_IP: &str = "10.244.0.1";

/// Extra node `i` (2..N).
pub fn extra_node(i: usize) -> String {
    format!("{FIRST_NODE}-{i}")
}

/// The nodes `sealed-node-2..N` of the test cluster, removed when dropped.
pub struct ExtraNodes {
    names: Vec<String>,
}

impl ExtraNodes {
    /// `hack/cluster.sh up --nodes total`, each `labels` entry `NODE:KEY=VALUE` (the kubelet
    /// registers the node with it). Waits until every node is Ready.
    pub fn up(total: usize, labels: &[&str]) -> Result<ExtraNodes> {
        ensure!(
            total >= 2,
            "ExtraNodes::up({total}): a fleet has at least 2 nodes"
        );
        let script = repo_root().join("hack/cluster.sh");
        let mut cmd = Command::new(&script);
        cmd.args(["up", "--nodes", &total.to_string()]);
        for l in labels {
            cmd.args(["--label", l]);
        }
        let names: Vec<String> = (2..=total).map(extra_node).collect();
        // From here on, whatever happens, drop removes what the script started.
        let nodes = ExtraNodes { names };
        let status = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .with_context(|| format!("cannot run {}", script.display()))?;
        ensure!(
            status.success(),
            "{} up --nodes {total} failed ({status}); see {}/logs",
            script.display(),
            cluster_dir().display()
        );
        Ok(nodes)
    }

    /// `sealed-node-2..N`.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Removes the extra nodes now (drop does the same, ignoring failures).
    pub fn down(mut self) -> Result<()> {
        let r = remove_extra_nodes();
        self.names.clear();
        r
    }
}

impl Drop for ExtraNodes {
    fn drop(&mut self) {
        if !self.names.is_empty()
            && let Err(e) = remove_extra_nodes()
        {
            eprintln!("removing the extra nodes failed: {e:#}");
        }
    }
}

/// `hack/cluster.sh down --extra-nodes`: the extra nodes' pods, Node objects, processes,
/// bridges, rules and state go; node 1 and the control plane stay.
pub fn remove_extra_nodes() -> Result<()> {
    let script = repo_root().join("hack/cluster.sh");
    let status = Command::new(&script)
        .args(["down", "--extra-nodes"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .with_context(|| format!("cannot run {}", script.display()))?;
    ensure!(
        status.success(),
        "{} down --extra-nodes failed ({status})",
        script.display()
    );
    Ok(())
}

/// The state directory of `node`: the cluster's for the first node, `nodes/<name>` in it for
/// an extra node (its containerd socket is `run/containerd.sock` in it).
pub fn node_dir(node: &str) -> PathBuf {
    if node == FIRST_NODE {
        cluster_dir()
    } else {
        cluster_dir().join("nodes").join(node)
    }
}

/// Imports a docker-archive image into `node`'s containerd (`hack/images.sh import`, pointed
/// at that node's state directory).
pub fn import_image(node: &str, archive: &Path) -> Result<()> {
    let dir = node_dir(node);
    let script = repo_root().join("hack/images.sh");
    let status = Command::new(&script)
        .arg("import")
        .arg(archive)
        .env("SEALED_CLUSTER_DIR", &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .with_context(|| format!("cannot run {}", script.display()))?;
    ensure!(
        status.success(),
        "importing {} into {node} failed ({status})",
        archive.display()
    );
    Ok(())
}

/// `ctr -n k8s.io ARGS` against `node`'s containerd.
fn ctr_on(node: &str, args: &[&str]) -> Result<()> {
    let sock = node_dir(node).join("run/containerd.sock");
    let out = Command::new("ctr")
        .arg("--address")
        .arg(&sock)
        .args(["-n", "k8s.io"])
        .args(args)
        .output()
        .context("cannot run ctr")?;
    ensure!(
        out.status.success(),
        "ctr {} on {node} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Gives image `from` in `node`'s containerd the second reference `to` (the same bytes under
/// a new name: what an upgrade to a new image reference changes, without a build).
pub fn tag_image_on(node: &str, from: &str, to: &str) -> Result<()> {
    ctr_on(node, &["images", "tag", "--force", from, to])
}

/// Removes image references from `node`'s containerd (errors ignored: cleanup).
pub fn remove_images_on(node: &str, refs: &[String]) {
    let mut args = vec!["images", "rm"];
    args.extend(refs.iter().map(String::as_str));
    let _ = ctr_on(node, &args);
}

/// A binary cargo built for another package of the workspace: next to the running test's
/// directory (`$CARGO_TARGET_DIR/debug/deps/<test>` → `$CARGO_TARGET_DIR/debug/NAME`).
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the test binary's path")?;
    let debug = exe
        .parent()
        .and_then(Path::parent)
        .context("the test binary has no grandparent directory")?;
    let path = debug.join(name);
    ensure!(
        path.is_file(),
        "{} does not exist: build it with `cargo build -p {name}` (cargo test --workspace builds \
         it too)",
        path.display()
    );
    Ok(path)
}

/// `helm` (and `kubectl`) of the pinned builds (`hack/build-k8s.sh`), on the test cluster.
pub struct Helm {
    helm: PathBuf,
    kubeconfig: PathBuf,
}

impl Helm {
    pub fn new(kubeconfig: &Path) -> Result<Helm> {
        let helm = match std::env::var_os("SEALED_HELM") {
            Some(h) => PathBuf::from(h),
            None => {
                let out = Command::new(repo_root().join("hack/build-k8s.sh"))
                    .arg("--print-bin-dir")
                    .output()
                    .context("cannot run hack/build-k8s.sh --print-bin-dir")?;
                ensure!(
                    out.status.success(),
                    "hack/build-k8s.sh --print-bin-dir failed"
                );
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("helm")
            }
        };
        ensure!(
            helm.is_file(),
            "no helm at {} (hack/build-k8s.sh builds it; or set SEALED_HELM)",
            helm.display()
        );
        Ok(Helm {
            helm,
            kubeconfig: kubeconfig.to_path_buf(),
        })
    }

    /// Runs helm in the repository root; its stdout, or an error with both outputs.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(&self.helm)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .current_dir(repo_root())
            .output()
            .context("cannot run helm")?;
        if !out.status.success() {
            bail!(
                "helm {} failed ({}):\n{}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// A TCP proxy in front of an origin that counts the bytes the origin sent back through it:
/// what the origin served, counted at the origin's side, not by its clients. Pods reach it on
/// the address it listens on; the origin itself may listen on loopback only, so nothing in the
/// cluster bypasses the count.
pub struct CountingProxy {
    addr: SocketAddr,
    served: Arc<AtomicU64>,
    pace: Arc<Pace>,
    task: tokio::task::JoinHandle<()>,
}

/// A cap on the bytes per second the origin sends through the proxy, all connections together
/// (0: none): each read of the origin's answer takes its turn on one timeline.
#[derive(Default)]
struct Pace {
    rate: AtomicU64,
    next: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Pace {
    /// Waits for `n` bytes' turn under the cap.
    async fn take(&self, n: usize) {
        let rate = self.rate.load(Ordering::Relaxed);
        if rate == 0 {
            return;
        }
        let cost = std::time::Duration::from_secs_f64(n as f64 / rate as f64);
        let at = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let now = tokio::time::Instant::now();
            let start = next.filter(|t| *t > now).unwrap_or(now);
            let done = start + cost;
            *next = Some(done);
            done
        };
        tokio::time::sleep_until(at).await;
    }
}

impl CountingProxy {
    /// Listens on `listen` (port 0: any) and forwards every connection to `upstream`.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> Result<CountingProxy> {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        let addr = listener.local_addr()?;
        let served = Arc::new(AtomicU64::new(0));
        let pace = Arc::new(Pace::default());
        let (count, paced) = (served.clone(), pace.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (count, paced) = (count.clone(), paced.clone());
                tokio::spawn(async move {
                    if let Ok(origin) = TcpStream::connect(upstream).await {
                        let _ = relay(client, origin, count, paced).await;
                    }
                });
            }
        });
        Ok(CountingProxy {
            addr,
            served,
            pace,
            task,
        })
    }

    /// Caps what the origin sends through the proxy at `bytes_per_sec` in all (`None`: no
    /// cap): a cold read then lasts long enough for something to happen in its middle.
    pub fn limit_rate(&self, bytes_per_sec: Option<u64>) {
        self.pace
            .rate
            .store(bytes_per_sec.unwrap_or(0), Ordering::Relaxed);
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Bytes the origin sent through the proxy since it started.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    client: TcpStream,
    origin: TcpStream,
    served: Arc<AtomicU64>,
    pace: Arc<Pace>,
) -> Result<()> {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut origin_rx, mut origin_tx) = origin.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut client_rx, &mut origin_tx).await;
        let _ = origin_tx.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = match origin_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            served.fetch_add(n as u64, Ordering::Relaxed);
            pace.take(n).await;
            if client_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_tx.shutdown().await;
    };
    tokio::join!(up, down);
    Ok(())
}

/// One counter of a Prometheus text exposition (the sum of its series), 0 when absent.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name)
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// `GET http://addr/metrics` from this host (pod IPs are reachable from it on every node's
/// bridge).
pub async fn scrape(addr: SocketAddr) -> Result<String> {
    let mut conn =
        tokio::time::timeout(std::time::Duration::from_secs(5), TcpStream::connect(addr))
            .await
            .with_context(|| format!("connecting to {addr} timed out"))?
            .with_context(|| format!("cannot connect to {addr}"))?;
    conn.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut body = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_to_end(&mut body),
    )
    .await
    .with_context(|| format!("reading {addr}/metrics timed out"))??;
    let text = String::from_utf8_lossy(&body).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{addr}/metrics: no HTTP head"))?;
    ensure!(
        head.starts_with("HTTP/1.") && head.split(' ').nth(1) == Some("200"),
        "{addr}/metrics answered {}",
        head.lines().next().unwrap_or_default()
    );
    Ok(rest.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sum_adds_every_series_of_one_name_only() {
        let text = "# HELP a x\na_total 2\na_total{k=\"v\"} 3.5\na_total_more 100\nb 1\n";
        assert_eq!(metric_sum(text, "a_total"), 5.5);
        assert_eq!(metric_sum(text, "missing"), 0.0);
    }

    #[tokio::test]
    async fn the_proxy_counts_what_the_origin_sends() {
        let origin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let origin_addr = origin.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut c, _) = origin.accept().await.unwrap();
            let mut req = [0u8; 5];
            c.read_exact(&mut req).await.unwrap();
            c.write_all(&[7u8; 1000]).await.unwrap();
        });
        let proxy = CountingProxy::start("127.0.0.1:0".parse().unwrap(), origin_addr)
            .await
            .unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), 1000);
        assert_eq!(proxy.served(), 1000);
    }

    #[tokio::test]
    async fn the_proxy_caps_what_the_origin_sends() {
        let origin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let origin_addr = origin.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut c, _) = origin.accept().await.unwrap();
            c.write_all(&vec![7u8; 1 << 20]).await.unwrap();
        });
        let proxy = CountingProxy::start("127.0.0.1:0".parse().unwrap(), origin_addr)
            .await
            .unwrap();
        proxy.limit_rate(Some(4 << 20));
        let started = std::time::Instant::now();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.unwrap();
        let took = started.elapsed();
        assert_eq!(got.len(), 1 << 20);
        // 1 MiB at 4 MiB/s: about 250 ms (the last read's turn ends it).
        assert!(
            took >= std::time::Duration::from_millis(180),
            "1 MiB under a 4 MiB/s cap took {took:?}"
        );
    }
}
