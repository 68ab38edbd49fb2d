//! The journey's private registry (step 1): `crane registry serve` on a loopback port behind
//! `hack/registry-auth.py` (Basic auth) on `127.0.0.1:15000`, the host `hack/cluster.sh`
//! gives containerd a plain-http `hosts.toml` for (SEALED_REGISTRY). The images are pushed
//! through the proxy with crane and the kubelet pulls them with the pods' imagePullSecret;
//! the proxy's JSON request log says which requests carried valid credentials.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

/// `hack/cluster.sh`'s default SEALED_REGISTRY: containerd pulls from it over plain http.
pub const HOST: &str = "127.0.0.1:15000";
pub const USER: &str = "journey";

/// One request the proxy saw.
#[derive(Debug, serde::Deserialize)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// The user of valid credentials; None: refused with 401.
    pub user: Option<String>,
    pub status: serde_json::Value,
}

impl Request {
    /// A manifest request (what every pull starts with) for `repo`.
    pub fn is_manifest_of(&self, repo: &str) -> bool {
        matches!(self.method.as_str(), "GET" | "HEAD")
            && self.path.starts_with(&format!("/v2/{repo}/manifests/"))
    }

    pub fn ok(&self) -> bool {
        self.status
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s))
    }
}

/// crane's registry and the auth proxy; both killed when dropped.
pub struct Registry {
    crane: Child,
    proxy: Child,
    dir: tempfile::TempDir,
    pub password: String,
}

impl Drop for Registry {
    fn drop(&mut self) {
        for child in [&mut self.proxy, &mut self.crane] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An executable on PATH (hack/build-test-tools.sh puts crane there).
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn crane() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("SEALED_CRANE") {
        return Ok(PathBuf::from(p));
    }
    on_path("crane").context(
        "no crane on PATH: run `export PATH=\"$(hack/build-test-tools.sh):$PATH\"` (or set \
         SEALED_CRANE)",
    )
}

fn wait_port(addr: &str, child: &mut Child, what: &str) -> Result<()> {
    for _ in 0..100 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited ({status}) before listening on {addr}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{what} did not listen on {addr} within 10 s")
}

impl Registry {
    pub fn start() -> Result<Registry> {
        ensure!(
            TcpListener::bind(HOST).is_ok(),
            "{HOST} (hack/cluster.sh's SEALED_REGISTRY) is in use: a registry of an earlier run? \
             (ss -ltnp 'sport = :15000')"
        );
        let dir = tempfile::tempdir()?;
        std::fs::create_dir(dir.path().join("blobs"))?;
        let backend_port = sealed_test_support::servers::free_port();
        let backend = format!("127.0.0.1:{backend_port}");
        let mut crane = Command::new(crane()?)
            .args(["registry", "serve", "--address", &backend, "--disk"])
            .arg(dir.path().join("blobs"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("crane.log"))?)
            .spawn()
            .context("cannot start crane registry serve")?;
        if let Err(e) = wait_port(&backend, &mut crane, "crane registry serve") {
            let _ = crane.kill();
            return Err(e);
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos();
        let password = format!("pw-{}-{nanos:09}", std::process::id());
        std::fs::write(
            dir.path().join("credentials"),
            format!("{USER}:{password}\n"),
        )?;
        let script = sealed_e2e::repo_root().join("hack/registry-auth.py");
        let proxy = Command::new("python3")
            .arg(&script)
            .args(["--listen", HOST, "--backend", &backend, "--credentials"])
            .arg(dir.path().join("credentials"))
            .arg("--log")
            .arg(dir.path().join("requests.jsonl"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("proxy.log"))?)
            .spawn();
        let mut proxy = match proxy {
            Ok(p) => p,
            Err(e) => {
                let _ = crane.kill();
                return Err(e).context("cannot start python3 hack/registry-auth.py");
            }
        };
        let ready = wait_port(HOST, &mut proxy, "hack/registry-auth.py");
        let registry = Registry {
            crane,
            proxy,
            dir,
            password,
        };
        ready.with_context(|| registry.logs())?;
        // A docker config for crane's pushes through the proxy.
        std::fs::create_dir(registry.dir.path().join("docker"))?;
        std::fs::write(
            registry.dir.path().join("docker/config.json"),
            registry.dockerconfigjson(),
        )?;
        Ok(registry)
    }

    fn auth(&self) -> String {
        use std::io::Write as _;
        // base64 of user:password, without a dependency for it.
        let mut child = Command::new("base64")
            .arg("-w0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("base64 (coreutils)");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(format!("{USER}:{}", self.password).as_bytes())
            .expect("write to base64");
        let out = child.wait_with_output().expect("base64");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The `.dockerconfigjson` of a pull Secret for this registry.
    pub fn dockerconfigjson(&self) -> String {
        serde_json::json!({ "auths": { HOST: {
            "username": USER, "password": self.password, "auth": self.auth(),
        } } })
        .to_string()
    }

    /// Pushes a docker-archive (hack/images.sh's output) as HOST/REPO:TAG through the proxy,
    /// with credentials; returns its manifest digest (sha256:...).
    pub fn push(&self, archive: &Path, repo: &str, tag: &str) -> Result<String> {
        let target = format!("{HOST}/{repo}:{tag}");
        let out = Command::new(crane()?)
            .arg("push")
            .arg(archive)
            .arg(&target)
            .env("DOCKER_CONFIG", self.dir.path().join("docker"))
            .stderr(Stdio::inherit())
            .output()
            .context("cannot run crane push")?;
        ensure!(
            out.status.success(),
            "crane push {} {target} failed ({})",
            archive.display(),
            out.status
        );
        // crane prints HOST/REPO@sha256:...
        let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let digest = printed
            .rsplit_once('@')
            .map(|(_, d)| d.to_string())
            .filter(|d| d.starts_with("sha256:") && d.len() == 71)
            .with_context(|| format!("crane push printed {printed:?}, no digest"))?;
        Ok(digest)
    }

    /// Every request the proxy has seen so far, oldest first.
    pub fn requests(&self) -> Result<Vec<Request>> {
        let text =
            std::fs::read_to_string(self.dir.path().join("requests.jsonl")).unwrap_or_default();
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).with_context(|| format!("request log line {l:?}")))
            .collect()
    }

    /// The proxy's and crane's own logs, for a failure report.
    pub fn logs(&self) -> String {
        let read = |f: &str| std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
        format!(
            "registry-auth.py:\n{}\ncrane registry serve:\n{}",
            read("proxy.log"),
            read("crane.log")
        )
    }
}

impl Registry {
    /// The config (JSON) of the image `reference` of this registry, read through the proxy
    /// with `crane config`.
    pub fn config(&self, reference: &str) -> Result<serde_json::Value> {
        let out = Command::new(crane()?)
            .arg("config")
            .arg(reference)
            .env("DOCKER_CONFIG", self.dir.path().join("docker"))
            .output()
            .context("cannot run crane config")?;
        ensure!(
            out.status.success(),
            "crane config {reference} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout)
            .with_context(|| format!("crane config {reference} printed no JSON"))
    }

    /// The bytes of file `path` (no leading /) in the image `reference` of this registry,
    /// read through the proxy with `crane export` (the flattened filesystem) and tar.
    pub fn file_in_image(&self, reference: &str, path: &str) -> Result<Vec<u8>> {
        let crane = crane()?;
        let out = Command::new("bash")
            .arg("-c")
            .arg(r#"set -o pipefail; "$0" export "$1" - | tar -xOf - "$2""#)
            .arg(&crane)
            .arg(reference)
            .arg(path)
            .env("DOCKER_CONFIG", self.dir.path().join("docker"))
            .output()
            .context("cannot run crane export | tar")?;
        ensure!(
            out.status.success(),
            "crane export {reference} | tar -xO {path} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(out.stdout)
    }
}
