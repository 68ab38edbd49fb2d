//! The real servers tests run against, on loopback ports: moto's S3 server (PyPI) and Azurite
//! (npm). A missing tool skips the test, or fails it under SEALED_REQUIRE_SERVERS=1 (as
//! .ci/run sets).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A server process that is killed when dropped.
pub struct Server {
    pub(crate) child: Child,
    pub port: u16,
    /// moto: `http://127.0.0.1:PORT`; Azurite: the account endpoint.
    pub url: String,
    pub(crate) _dir: Option<tempfile::TempDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The repository's root (this crate sits one level below it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The cargo-built binary `name`, when there is one (`$CARGO_TARGET_DIR/debug`, else
/// `target/debug`): `cargo test --workspace` builds every package's binaries first.
pub fn built_binary(name: &str) -> Option<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let path = target.join("debug").join(name);
    path.is_file().then_some(path)
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for_port(port: u16, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited early: {status}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} did not listen on port {port} within 60s");
}

/// Whether a missing server binary fails the test (CI) or skips it (a laptop without it).
fn require_servers() -> bool {
    std::env::var("SEALED_REQUIRE_SERVERS").is_ok_and(|v| v == "1")
}

fn have(binary: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {binary}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// True (with a printed reason) when `binary` is not installed and the test should skip.
pub fn missing(binary: &str, install: &str) -> bool {
    if have(binary) {
        return false;
    }
    assert!(!require_servers(), "{binary} not installed ({install})");
    eprintln!("skipped: {binary} not installed ({install}); .ci/run installs it");
    true
}

/// moto's S3 server with a fresh bucket. With `auth`, moto checks credentials after the
/// bucket is created (only keys it issued pass, so any key is rejected).
pub fn start_moto(bucket: &str, auth: bool) -> Option<Server> {
    if missing("moto_server", "pip install 'moto[server]'") {
        return None;
    }
    let port = free_port();
    let mut cmd = Command::new("moto_server");
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if auth {
        // The first request (creating the bucket) is free; every later one is checked.
        cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", "1");
    }
    let mut child = cmd.spawn().unwrap();
    wait_for_port(port, &mut child, "moto_server");
    // moto does not check signatures (without `auth`), so a plain PUT creates the bucket.
    let status = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "PUT",
            &format!("http://127.0.0.1:{port}/{bucket}"),
        ])
        .status()
        .unwrap();
    assert!(status.success(), "creating bucket {bucket} failed");
    Some(Server {
        child,
        port,
        url: format!("http://127.0.0.1:{port}"),
        _dir: None,
    })
}

pub fn azurite_endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}/{AZURITE_ACCOUNT}")
}

/// Azurite's blob service with a fresh container; `url` is the account endpoint.
pub fn start_azurite(container: &str) -> Option<Server> {
    if missing("azurite-blob", "npm install -g azurite") {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = Command::new("azurite-blob")
        .args([
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            &port.to_string(),
            "--silent",
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--location",
        ])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_port(port, &mut child, "azurite-blob");
    let url = azurite_endpoint(port);
    let status = Command::new("python3")
        .arg(repo_root().join("hack/azurite-container.py"))
        .arg(&url)
        .arg(container)
        .status()
        .unwrap();
    assert!(status.success(), "creating container {container} failed");
    Some(Server {
        child,
        port,
        url,
        _dir: Some(dir),
    })
}

/// hack/hub-server.py serving the repositories under `root` (ROOT/<org>/<name>/), with
/// `page_size` tree entries per page.
pub fn start_hub(root: &Path, page_size: usize) -> Option<Hub> {
    if missing("python3", "install Python 3") {
        return None;
    }
    let mut child = Command::new("python3")
        .arg(repo_root().join("hack/hub-server.py"))
        .arg("--root")
        .arg(root)
        .args(["--port", "0", "--page-size", &page_size.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().to_owned();
    assert!(url.starts_with("http://"), "hub-server printed {url:?}");
    let port = url.rsplit(':').next().unwrap().parse().unwrap();
    Some(Hub { child, port, url })
}

/// A running hack/hub-server.py, killed when dropped.
pub struct Hub {
    child: Child,
    pub port: u16,
    pub url: String,
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
