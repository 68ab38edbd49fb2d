//! The real servers tests run against, on loopback ports: moto's S3 server (PyPI), Azurite
//! (npm) and fake-gcs-server (Go module, hack/build-test-tools.sh). A missing tool skips the
//! test, or fails it under SEALED_REQUIRE_SERVERS=1 (as .ci/run sets).

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

/// Where [`free_port`] looks: below the kernel's ephemeral range (32768 and up), so no
/// outgoing connection on this machine can take a port between our check and the server's
/// own bind (CI lost a plugin's `--metrics-addr` that way), and below Kubernetes' NodePorts
/// (30000 and up) and the ports `hack/` uses.
const TEST_PORTS: std::ops::Range<u16> = 20_000..30_000;

/// A TCP port on 127.0.0.1 that is free now and that no earlier call in this process returned,
/// so the addresses of one test (peers, metrics) never collide with each other.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    let span = u32::from(TEST_PORTS.end - TEST_PORTS.start);
    // Processes start at different places in the range, calls of one process never repeat.
    static NEXT: std::sync::OnceLock<AtomicU32> = std::sync::OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU32::new(std::process::id().wrapping_mul(7_919) % span));
    for _ in 0..span {
        let offset = next.fetch_add(1, Ordering::Relaxed) % span;
        let port = TEST_PORTS.start + u16::try_from(offset).expect("offset below the span");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {TEST_PORTS:?}");
}

/// `127.0.0.1:`[`free_port`].
pub fn free_addr() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], free_port()))
}

pub fn wait_for_port(port: u16, child: &mut Child, what: &str) {
    wait_for_port_or_log(port, child, what, String::new);
}

/// [`wait_for_port`] that adds `log()` (the child's log) to its panic.
pub fn wait_for_port_or_log(port: u16, child: &mut Child, what: &str, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited early: {status}\n{}", log());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} did not listen on port {port} within 60s\n{}", log());
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
    // Its port opens before it answers every route: on a loaded machine the first PUT can
    // fail (seen in CI), so it is retried for a few seconds.
    let mut created = false;
    for _ in 0..40 {
        let status = Command::new("curl")
            .args([
                "-sf",
                "-X",
                "PUT",
                &format!("http://127.0.0.1:{port}/{bucket}"),
            ])
            .status()
            .unwrap();
        if status.success() {
            created = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    assert!(created, "creating bucket {bucket} failed");
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
    // Its port can accept before the blob service answers (a loaded CI run once saw the
    // first request refused): try for a few seconds while the server lives.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let status = Command::new("python3")
            .arg(repo_root().join("hack/azurite-container.py"))
            .arg(&url)
            .arg(container)
            .status()
            .unwrap();
        if status.success() {
            break;
        }
        if let Ok(Some(exit)) = child.try_wait() {
            panic!("azurite-blob exited while creating container {container}: {exit}");
        }
        assert!(
            Instant::now() < deadline,
            "creating container {container} failed for 15 s"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
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

/// fake-gcs-server (hack/build-test-tools.sh builds it) with a fresh bucket; `url` is the
/// base URL a GCS client takes (`gcs_base_url`). Its public host is set to the address
/// clients use, or it routes no XML-API request (it matches the Host header against
/// `-public-host`, default storage.googleapis.com).
///
/// It serves object_store's XML-API reads (GET/HEAD with ranges, `list-type=2` listings) but,
/// at v1.56.1, no XML-API write: `PUT /{bucket}/{object}` reaches its JSON `insertObject`,
/// which answers 400 "invalid uploadType" without `?uploadType=` (fakestorage/upload.go), and
/// `x-goog-if-generation-match` is read nowhere. Tests write through [`gcs_put_object`]
/// (the JSON API's media upload) instead.
pub fn start_fake_gcs(bucket: &str) -> Option<Server> {
    if missing(
        "fake-gcs-server",
        "hack/build-test-tools.sh, then its --path on PATH",
    ) {
        return None;
    }
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut child = Command::new("fake-gcs-server")
        .args([
            "-backend",
            "memory",
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
        ])
        .args(["-port", &port.to_string()])
        .args(["-public-host", &format!("127.0.0.1:{port}")])
        .args(["-external-url", &url, "-log-level", "error"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_port(port, &mut child, "fake-gcs-server");
    let status = Command::new("curl")
        .args(["-sf", "-o", "/dev/null", "-X", "POST"])
        .arg(format!("{url}/storage/v1/b"))
        .args(["-H", "Content-Type: application/json"])
        .args(["-d", &format!("{{\"name\":\"{bucket}\"}}")])
        .status()
        .unwrap();
    assert!(status.success(), "creating bucket {bucket} failed");
    Some(Server {
        child,
        port,
        url,
        _dir: None,
    })
}

/// Writes `data` as object `name` of `bucket` through the JSON API's media upload (the write
/// fake-gcs-server has; see [`start_fake_gcs`]). Overwrites.
pub fn gcs_put_object(server: &Server, bucket: &str, name: &str, data: &[u8]) {
    use std::io::Write;
    let mut body = tempfile::NamedTempFile::new().unwrap();
    body.write_all(data).unwrap();
    let name: String = name
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let status = Command::new("curl")
        .args(["-sf", "-o", "/dev/null", "-X", "POST"])
        .args(["-H", "Content-Type: application/octet-stream"])
        .arg("--data-binary")
        .arg(format!("@{}", body.path().display()))
        .arg(format!(
            "{}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
            server.url
        ))
        .status()
        .unwrap();
    assert!(status.success(), "uploading gs://{bucket}/{name} failed");
}

/// Every file under `dir` as an object under `prefix` (`prefix/relative/path`) of `bucket`.
pub fn gcs_put_dir(server: &Server, bucket: &str, prefix: &str, dir: &Path) {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(dir, &mut files);
    for f in files {
        let rel = f.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
        let name = if prefix.is_empty() {
            rel
        } else {
            format!("{}/{rel}", prefix.trim_end_matches('/'))
        };
        gcs_put_object(server, bucket, &name, &std::fs::read(&f).unwrap());
    }
}
