//! Shared by the integration tests: a store with a pushed tree, the real `sealed-csi` binary on
//! a temporary socket, and a gRPC client for it.

#![allow(dead_code)]

pub mod outage;
/// moto and Azurite, shared with the store's and the operator's tests.
#[allow(unused_imports)]
pub use sealed_test_support::servers;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use sealed_csi::proto::csi::volume_capability::access_mode::Mode;
use sealed_csi::proto::csi::volume_capability::{AccessMode, AccessType, MountVolume};
use sealed_csi::proto::csi::{NodePublishVolumeRequest, VolumeCapability};
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress, StoreOptions};
use tempfile::TempDir;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// A file:// store holding one small version.
pub struct TestStore {
    pub dir: TempDir,
    pub url: String,
    pub digest: Digest,
    /// The version's file bytes.
    pub bytes: u64,
    /// The pushed tree, to compare mounted bytes against.
    pub source: PathBuf,
}

/// `name` goes into the tree, so each test mounts its own digest and tests running at the
/// same time never see each other's mounts.
pub async fn store_with_version(name: &str) -> TestStore {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("tree");
    std::fs::create_dir_all(source.join("sub")).unwrap();
    std::fs::write(
        source.join("config.json"),
        format!(r#"{{"model": "{name}"}}"#),
    )
    .unwrap();
    let weights: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(source.join("sub/weights.bin"), &weights).unwrap();
    store_of(dir, source).await
}

/// A file:// store in `dir` with the tree at `source` pushed into it.
pub async fn store_of(dir: TempDir, source: PathBuf) -> TestStore {
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let url = format!("file://{}", store_dir.display());
    let store = ChunkStore::open(&url, &StoreOptions::default())
        .await
        .unwrap();
    let report = push(
        &store,
        &source,
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    TestStore {
        dir,
        url,
        digest: report.digest,
        bytes: report.bytes,
        source,
    }
}

/// The real plugin binary, serving on a socket in its own temporary directory.
pub struct Plugin {
    child: Child,
    pub dir: TempDir,
    pub socket: PathBuf,
}

impl Plugin {
    pub fn start(store_url: &str, extra: &[&str]) -> Plugin {
        Plugin::start_in(tempfile::tempdir().unwrap(), store_url, extra)
    }

    /// Starts the plugin with `dir` as its home (socket, state, cache): a restart reuses it.
    ///
    /// Unless `extra` names `--kubelet-dir` or `--kubelet-root`, the plugin gets
    /// `--kubelet-root=<dir>`: targets must then be under `<dir>/pods` (see [`Plugin::pods`]).
    pub fn start_in(dir: TempDir, store_url: &str, extra: &[&str]) -> Plugin {
        let mut args = vec!["--standalone", "--node-id=test-node"];
        args.extend_from_slice(extra);
        Plugin::launch(dir, store_url, &args, &[])
    }

    /// API-server mode: `node_id` names a Node of the cluster `kubeconfig` points at.
    pub fn start_api(store_url: &str, node_id: &str, kubeconfig: &Path, extra: &[&str]) -> Plugin {
        Plugin::start_api_in(
            tempfile::tempdir().unwrap(),
            store_url,
            node_id,
            kubeconfig,
            extra,
        )
    }

    /// [`Plugin::start_api`] with `dir` as its home: a restart after [`Plugin::crash`].
    pub fn start_api_in(
        dir: TempDir,
        store_url: &str,
        node_id: &str,
        kubeconfig: &Path,
        extra: &[&str],
    ) -> Plugin {
        let node = format!("--node-id={node_id}");
        let mut args = vec![node.as_str()];
        args.extend_from_slice(extra);
        let kubeconfig = kubeconfig.display().to_string();
        Plugin::launch(
            dir,
            store_url,
            &args,
            &[("KUBECONFIG", kubeconfig.as_str())],
        )
    }

    fn launch(dir: TempDir, store_url: &str, extra: &[&str], envs: &[(&str, &str)]) -> Plugin {
        let socket = dir.path().join("csi.sock");
        // The test's own kubelet root: targets go to <dir>/pods (the rule is never relaxed).
        let kubelet_root = format!("--kubelet-root={}", dir.path().display());
        let mut extra = extra.to_vec();
        if !extra
            .iter()
            .any(|a| a.starts_with("--kubelet-dir") || a.starts_with("--kubelet-root"))
        {
            extra.push(&kubelet_root);
        }
        // A crashed run leaves its socket behind; wait for the new one.
        let _ = std::fs::remove_file(&socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("plugin.log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sealed-csi"))
            .arg(format!("--endpoint=unix://{}", socket.display()))
            .arg(format!("--store={store_url}"))
            .arg(format!(
                "--state-dir={}",
                dir.path().join("state").display()
            ))
            .arg(format!(
                "--cache-dir={}",
                dir.path().join("cache").display()
            ))
            .arg("--cache-size=64Mi")
            .args(extra)
            // Static credentials, so an s3:// store never asks an instance-metadata service.
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("SEALED_LOG", "debug")
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start sealed-csi");
        let mut plugin = Plugin { child, dir, socket };
        let started = Instant::now();
        while !plugin.socket.exists() {
            if let Ok(Some(status)) = plugin.child.try_wait() {
                panic!(
                    "sealed-csi exited ({status}) before serving; log:\n{}",
                    plugin.log()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "sealed-csi did not create its socket; log:\n{}",
                plugin.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        plugin
    }

    /// Waits until something answers on `addr` (the plugin's `--metrics-addr`); panics with
    /// the plugin's log if it exits first.
    pub fn wait_listening(&mut self, addr: std::net::SocketAddr) {
        let log = self.dir.path().join("plugin.log");
        sealed_test_support::servers::wait_for_port_or_log(
            addr.port(),
            &mut self.child,
            "sealed-csi",
            || std::fs::read_to_string(&log).unwrap_or_default(),
        );
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// `<dir>/pods`: where targets may be (the plugin runs with `--kubelet-root=<dir>`).
    pub fn pods(&self) -> PathBuf {
        self.dir.path().join("pods")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("plugin.log")).unwrap_or_default()
    }

    pub async fn channel(&self) -> Channel {
        connect(&self.socket).await
    }
}

impl Plugin {
    /// Kills the plugin with SIGKILL (no cleanup at all) and hands back its home directory.
    pub fn crash(mut self) -> TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let dir = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self.dir, dir)
    }
}

impl Plugin {
    /// Stops the plugin with SIGTERM, as kubelet stops a container, waits for it to exit and
    /// hands back its home directory.
    pub fn terminate(mut self) -> TempDir {
        // SAFETY: kill with the pid of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.crash()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // SIGTERM first so the plugin shuts down cleanly; then make sure it is gone.
        // SAFETY: kill with a pid of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                self.detach_leftovers();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.detach_leftovers();
    }
}

impl Plugin {
    /// A failed test may leave mounts in its directory; detach them so they do not outlive it.
    fn detach_leftovers(&self) {
        let Ok(dir) = self.dir.path().canonicalize() else {
            return;
        };
        for mp in sealed_csi::mounts::mount_points() {
            if mp.starts_with(&dir) {
                let _ = sealed_mount::unmount(&mp, true);
            }
        }
    }
}

/// `sealed-fd-holder`, beside `sealed-csi` in the build output. It is another package's
/// binary (the `sealed-fd-holder` crate), so cargo builds it only for a build of that
/// package: each test process asks cargo for it once (nothing to do when it is current).
fn holder_binary() -> &'static Path {
    static BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BINARY.get_or_init(|| {
        let plugin = Path::new(env!("CARGO_BIN_EXE_sealed-csi"));
        let out = plugin.parent().expect("the build output directory");
        let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        build.args([
            "build",
            "--quiet",
            "-p",
            "sealed-fd-holder",
            "--bin",
            "sealed-fd-holder",
        ]);
        // target/debug is the dev profile; any other directory is named by its profile.
        match out.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some(profile) => {
                build.args(["--profile", profile]);
            }
        }
        let status = build.status().expect("run cargo to build sealed-fd-holder");
        assert!(
            status.success(),
            "cargo build -p sealed-fd-holder failed: {status}"
        );
        out.join("sealed-fd-holder")
    })
}

/// The holder binary on its own socket.
pub struct FdHolder {
    child: Child,
    pub socket: PathBuf,
}

impl FdHolder {
    pub fn start(socket: &Path) -> FdHolder {
        let _ = std::fs::remove_file(socket);
        let child = Command::new(holder_binary())
            .arg(format!("--socket={}", socket.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start sealed-fd-holder");
        let started = Instant::now();
        while !socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "no holder socket"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        FdHolder {
            child,
            socket: socket.to_path_buf(),
        }
    }

    pub fn client(&self) -> sealed_csi::holder::HolderClient {
        sealed_csi::holder::HolderClient::new(&self.socket)
    }
}

impl Drop for FdHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A read-only publish of a mount volume, as kubelet sends it for an inline volume
/// (`SINGLE_NODE_WRITER` + `readonly`), with `context` as its volume attributes.
pub fn publish_request(
    volume_id: &str,
    target: &Path,
    context: std::collections::HashMap<String, String>,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }),
        readonly: true,
        volume_context: context,
        ..Default::default()
    }
}

/// [`publish_request`] of `digest`.
pub fn publish_digest(volume_id: &str, target: &Path, digest: &str) -> NodePublishVolumeRequest {
    let context = std::collections::HashMap::from([("digest".to_string(), digest.to_string())]);
    publish_request(volume_id, target, context)
}

/// A plain HTTP/1.1 GET: status and body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let started = Instant::now();
    let mut stream = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if started.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("cannot connect to {addr}: {e}"),
        }
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    std::io::Write::write_all(&mut stream, request.as_bytes()).unwrap();
    let mut response = String::new();
    std::io::Read::read_to_string(&mut stream, &mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The value of the sample `key` (`name` or `name{labels}`) in a Prometheus text page.
pub fn sample(page: &str, key: &str) -> Option<f64> {
    page.lines().find_map(|line| {
        line.strip_prefix(key)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

pub async fn connect(socket: &Path) -> Channel {
    let socket = socket.to_path_buf();
    Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .expect("connect to sealed-csi")
}

/// Root and /dev/fuse, which mounting needs.
pub fn can_mount() -> bool {
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    root && Path::new("/dev/fuse").exists()
}

/// A Secret like the operator's attestation Secret, and its key.
pub struct Attestation {
    /// `NAMESPACE/NAME`, for `--attestation-secret`.
    pub secret: String,
    pub namespace: String,
    pub name: String,
    pub key: sealed_crds::attestation::AttestationKey,
}

impl Attestation {
    /// `--attestation-secret=...`.
    pub fn flag(&self) -> String {
        format!("--attestation-secret={}", self.secret)
    }
}

/// 32 bytes nobody can guess in advance (a test's key; tests must not share one).
pub fn key_material() -> Vec<u8> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ u64::from(std::process::id());
    sealed_e2e::pseudo_random(32, seed)
}

/// Creates (or replaces the key of) Secret `namespace/name` with `material` as its
/// `key`, as the operator does.
pub async fn attestation_secret(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    material: &[u8],
) -> anyhow::Result<Attestation> {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{Patch, PatchParams};
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": namespace },
        "data": {
            (sealed_crds::attestation::SECRET_KEY): k8s_openapi::ByteString(material.to_vec()),
        },
    }))?;
    kube::Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(
            name,
            &PatchParams::apply("sealed-csi-test").force(),
            &Patch::Apply(&secret),
        )
        .await?;
    Ok(Attestation {
        secret: format!("{namespace}/{name}"),
        namespace: namespace.into(),
        name: name.into(),
        key: sealed_crds::attestation::AttestationKey::from_secret_bytes(material)?,
    })
}

/// Creates SealedVolume `namespace/name` (an upload volume) with `tags`.
pub async fn sealed_volume(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    tags: &[(&str, &str)],
    shared: bool,
) -> anyhow::Result<sealed_crds::SealedVolume> {
    let volume = sealed_crds::SealedVolume::new(
        name,
        sealed_crds::SealedVolumeSpec {
            source: sealed_crds::Source::upload(),
            tags: tags
                .iter()
                .map(|(t, d)| (t.to_string(), d.to_string()))
                .collect(),
            retention: sealed_crds::Retention::default(),
            shared,
            warm: None,
            verify: None,
        },
    );
    Ok(
        kube::Api::<sealed_crds::SealedVolume>::namespaced(client.clone(), namespace)
            .create(&kube::api::PostParams::default(), &volume)
            .await?,
    )
}

/// How a test's SealedVolumeVersion claims to have been made.
pub enum Made<'a> {
    /// As the operator makes it: controller-owned by its volume, `status.attestation`
    /// written with this key (through the status subresource).
    ByOperator(&'a sealed_crds::attestation::AttestationKey),
    /// Owned by its volume, with this `status.attestation` (forged, copied, none).
    WithAttestation(Option<String>),
    /// No owner reference at all, no attestation.
    Unowned,
}

/// Creates a SealedVolumeVersion of `digest` for `volume` (which must exist), named
/// `name` (default: the operator's name for it).
pub async fn sealed_version(
    client: &kube::Client,
    volume: &sealed_crds::SealedVolume,
    digest: &str,
    name: Option<&str>,
    made: Made<'_>,
) -> anyhow::Result<sealed_crds::SealedVolumeVersion> {
    use kube::Resource as _;
    use kube::ResourceExt as _;
    use kube::api::{Patch, PatchParams, PostParams};
    let namespace = volume.namespace().unwrap_or_default();
    let volume_name = volume.name_any();
    let object_name = name
        .map(String::from)
        .unwrap_or_else(|| sealed_crds::SealedVolumeVersionSpec::object_name(&volume_name, digest));
    let mut version = sealed_crds::SealedVolumeVersion::new(
        &object_name,
        sealed_crds::SealedVolumeVersionSpec {
            volume: volume_name.clone(),
            digest: digest.into(),
        },
    );
    version.metadata.labels = Some(
        [("sealedvolumes.io/volume".to_string(), volume_name.clone())]
            .into_iter()
            .collect(),
    );
    let attestation = match &made {
        Made::ByOperator(key) => Some(key.attest(&namespace, &volume_name, digest)),
        Made::WithAttestation(a) => a.clone(),
        Made::Unowned => None,
    };
    if !matches!(made, Made::Unowned) {
        version.metadata.owner_references = volume.controller_owner_ref(&()).map(|o| vec![o]);
    }
    let api = kube::Api::<sealed_crds::SealedVolumeVersion>::namespaced(client.clone(), &namespace);
    let created = api.create(&PostParams::default(), &version).await?;
    let Some(attestation) = attestation else {
        return Ok(created);
    };
    Ok(api
        .patch_status(
            &object_name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": { "attestation": attestation } })),
        )
        .await?)
}

/// Writes `status.attestation` of version `namespace/name`.
pub async fn set_attestation(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    attestation: &str,
) -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};
    kube::Api::<sealed_crds::SealedVolumeVersion>::namespaced(client.clone(), namespace)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": { "attestation": attestation } })),
        )
        .await?;
    Ok(())
}

/// The node publications Lease of `node` in `namespace`, parsed (`None` when absent).
pub async fn node_publications(
    client: &kube::Client,
    namespace: &str,
    node: &str,
) -> anyhow::Result<
    Option<(
        k8s_openapi::api::coordination::v1::Lease,
        sealed_crds::publications::NodePublications,
    )>,
> {
    use sealed_crds::publications::{ANNOTATION, NodePublications};
    let name = NodePublications::lease_name(node);
    let Some(lease) = kube::Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        client.clone(),
        namespace,
    )
    .get_opt(&name)
    .await?
    else {
        return Ok(None);
    };
    let json = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
        .cloned()
        .unwrap_or_default();
    let doc: NodePublications = serde_json::from_str(&json)?;
    Ok(Some((lease, doc)))
}
