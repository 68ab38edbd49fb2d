//! Shared test support: deterministic trees and the real servers tests run against
//! (moto's S3 server from PyPI, Azurite from npm), started on loopback ports.
#![allow(dead_code)]

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealed_store::push::{PushOptions, PushReport, push};
use sealed_store::{ChunkStore, NoProgress, StoreOptions};

/// xorshift64: a specified generator, so trees (and test vectors) are the same everywhere.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A tree with every kind of entry the format supports.
pub fn rich_tree(root: &Path) {
    fs::create_dir_all(root.join("weights/shards")).unwrap();
    fs::create_dir_all(root.join("empty/nested-empty")).unwrap();
    fs::create_dir_all(root.join("a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p")).unwrap();
    fs::write(
        root.join("weights/shards/model-00001.safetensors"),
        pseudo_random(9 << 20, 1),
    )
    .unwrap();
    fs::write(
        root.join("weights/shards/model-00002.safetensors"),
        pseudo_random(3 << 20, 2),
    )
    .unwrap();
    fs::write(root.join("config.json"), b"{\"hidden\": 4096}\n").unwrap();
    fs::write(root.join("empty-file"), b"").unwrap();
    fs::write(
        root.join("a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/deep.txt"),
        b"deep\n",
    )
    .unwrap();
    fs::write(root.join("tokenizer-\u{00e9}\u{6f22}\u{1f600}.json"), b"{}").unwrap();
    fs::write(root.join("run.sh"), b"#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(root.join("run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink(
        "shards/model-00001.safetensors",
        root.join("weights/current"),
    )
    .unwrap();
    std::os::unix::fs::symlink("missing-target", root.join("dangling")).unwrap();
}

/// Compares two trees: same entries, bytes, executable bits and link targets.
pub fn assert_same_tree(a: &Path, b: &Path) {
    let list = |root: &Path| -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                let m = fs::symlink_metadata(&p).unwrap();
                let desc = if m.file_type().is_symlink() {
                    format!("link {}", fs::read_link(&p).unwrap().display())
                } else if m.is_dir() {
                    stack.push(p.clone());
                    "dir".into()
                } else {
                    format!(
                        "file {} exec={} {}",
                        m.len(),
                        m.permissions().mode() & 0o111 != 0,
                        blake3::hash(&fs::read(&p).unwrap()).to_hex()
                    )
                };
                out.push((rel, desc));
            }
        }
        out.sort();
        out
    };
    assert_eq!(list(a), list(b));
}

pub async fn push_dir(store: &ChunkStore, dir: &Path) -> PushReport {
    push(store, dir, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap()
}

pub async fn file_store(dir: &Path) -> ChunkStore {
    fs::create_dir_all(dir).unwrap();
    ChunkStore::open(
        &format!("file://{}", dir.display()),
        &StoreOptions::default(),
    )
    .await
    .unwrap()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for_port(port: u16, child: &mut Child, what: &str) {
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

/// A server process that is killed when dropped.
pub struct Server {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// moto's S3-compatible server with a fresh bucket; `None` (with a printed reason) when
/// `moto_server` is not installed and SEALED_REQUIRE_SERVERS is not set.
pub fn start_moto(bucket: &str) -> Option<Server> {
    if !have("moto_server") {
        assert!(
            !require_servers(),
            "moto_server not installed (pip install 'moto[server]')"
        );
        eprintln!(
            "skipped: moto_server not installed (pip install 'moto[server]'); .ci/run installs it"
        );
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_port(port, &mut child, "moto_server");
    // moto does not check signatures, so a plain PUT creates the bucket.
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
        _dir: dir,
    })
}

pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Azurite's blob service with a fresh container.
pub fn start_azurite(container: &str) -> Option<Server> {
    if !have("azurite-blob") {
        assert!(
            !require_servers(),
            "azurite-blob not installed (npm install -g azurite)"
        );
        eprintln!(
            "skipped: azurite-blob not installed (npm install -g azurite); .ci/run installs it"
        );
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
    let script = manifest_dir().join("../hack/azurite-container.py");
    let status = Command::new("python3")
        .arg(script)
        .arg(azurite_endpoint(port))
        .arg(container)
        .status()
        .unwrap();
    assert!(status.success(), "creating container {container} failed");
    Some(Server {
        child,
        port,
        _dir: dir,
    })
}

pub fn azurite_endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}/{AZURITE_ACCOUNT}")
}

pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Opens an S3 store on a moto server (credentials are any non-empty values for moto).
pub async fn moto_store(server: &Server, bucket: &str, prefix: &str) -> ChunkStore {
    set_test_credentials();
    let opts = StoreOptions {
        endpoint: Some(format!("http://127.0.0.1:{}", server.port)),
        region: Some("us-east-1".into()),
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    ChunkStore::open(&format!("s3://{bucket}/{prefix}"), &opts)
        .await
        .unwrap()
}

pub fn azurite_options(server: &Server) -> StoreOptions {
    set_test_credentials();
    StoreOptions {
        endpoint: Some(azurite_endpoint(server.port)),
        timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

fn set_test_credentials() {
    // SAFETY: set before any store reads the environment; every test sets the same values.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
        std::env::set_var("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT);
        std::env::set_var("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY);
    }
}
