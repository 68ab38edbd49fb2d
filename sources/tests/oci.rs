//! OCI registry sources against a real registry on loopback (`crane registry serve`, from
//! go-containerregistry; `hack/build-test-tools.sh` puts it on PATH): a CNCF ModelPack
//! artifact pushed by hand from the spec (raw HTTP uploads written here, not by the code under
//! test) and a two-layer image with weights under `/models` (pushed with `crane append`, a
//! whiteout in the upper layer) are each synced into a `file://` store; the sealed files read
//! back byte-identical; a re-sync of the same manifest digest uploads nothing and seals the
//! same version; a layer whose stored bytes no longer match its digest fails the sync naming
//! the layer, and nothing is sealed.
//!
//! Without crane the test is skipped with a message, unless `SEALED_REQUIRE_SERVERS=1` (CI),
//! where that is a failure.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealed_sources::{
    Egress, NoReporter, OciArtifact, SourceCredentials, SourcePolicy, SourceSpec, SyncOptions,
    resolve_revision, sync_source,
};
use sealed_store::pull::{PullOptions, pull};
use sealed_store::{ChunkStore, NoProgress, StoreOptions};
use sealed_test_support::http::{Recorder, http_response};
use sha2::{Digest as _, Sha256};

struct Registry {
    child: Child,
    host: String,
    _disk: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn crane() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("crane"))
        .find(|p| p.is_file())
}

fn start_registry() -> Option<Registry> {
    let Some(crane) = crane() else {
        assert!(
            std::env::var("SEALED_REQUIRE_SERVERS").as_deref() != Ok("1"),
            "crane is not on PATH (hack/build-test-tools.sh builds it) and SEALED_REQUIRE_SERVERS=1"
        );
        eprintln!("SKIP: crane is not on PATH (hack/build-test-tools.sh builds it)");
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host = format!("127.0.0.1:{port}");
    let disk = tempfile::tempdir().unwrap();
    let child = Command::new(&crane)
        .args(["registry", "serve", "--address", &host, "--disk"])
        .arg(disk.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start crane registry serve");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&host).is_err() {
        assert!(
            Instant::now() < deadline,
            "crane registry serve did not listen on {host}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(Registry {
        child,
        host,
        _disk: disk,
    })
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// Pseudo-random bytes (xorshift), so chunks do not dedup by accident.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A blob upload as the distribution spec has it: POST for a session, PUT with the digest.
async fn put_blob(http: &reqwest::Client, host: &str, repo: &str, data: &[u8]) -> String {
    let digest = sha256(data);
    let resp = http
        .post(format!("http://{host}/v2/{repo}/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 202, "{resp:?}");
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    let mut url = reqwest::Url::parse(&format!("http://{host}"))
        .unwrap()
        .join(&location)
        .unwrap();
    url.query_pairs_mut().append_pair("digest", &digest);
    let resp = http.put(url).body(data.to_vec()).send().await.unwrap();
    assert!(resp.status().is_success(), "{resp:?}");
    digest
}

/// Pushes a ModelPack artifact (model-spec v1: artifactType, the model config, one raw layer
/// a file with its path in `org.cncf.model.filepath`) and returns its manifest digest.
async fn push_modelpack(host: &str, repo: &str, tag: &str, files: &[(&str, Vec<u8>)]) -> String {
    let http = reqwest::Client::new();
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    for (path, data) in files {
        let digest = put_blob(&http, host, repo, data).await;
        let media = if path.ends_with(".safetensors") {
            "application/vnd.cncf.model.weight.v1.raw"
        } else {
            "application/vnd.cncf.model.weight.config.v1.raw"
        };
        diff_ids.push(digest.clone());
        layers.push(serde_json::json!({
            "mediaType": media,
            "digest": digest,
            "size": data.len(),
            "annotations": {"org.cncf.model.filepath": path},
        }));
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "descriptor": {"name": "tiny", "version": "1"},
        "config": {"format": "safetensors"},
        "modelfs": {"type": "layers", "diffIds": diff_ids},
    }))
    .unwrap();
    let config_digest = put_blob(&http, host, repo, &config).await;
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.cncf.model.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.cncf.model.config.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": layers,
    }))
    .unwrap();
    let resp = http
        .put(format!("http://{host}/v2/{repo}/manifests/{tag}"))
        .header("content-type", "application/vnd.oci.image.manifest.v1+json")
        .body(manifest.clone())
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{resp:?}");
    sha256(&manifest)
}

fn opts() -> SyncOptions {
    SyncOptions {
        retries: 1,
        timeout: Duration::from_secs(20),
        policy: SourcePolicy {
            allow_http: true,
            egress: Egress::allowing(&["127.0.0.0/8"]).unwrap(),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn source(host: &str, reference: &str, path: Option<&str>) -> SourceSpec {
    SourceSpec::Oci(OciArtifact {
        reference: format!("oci://{host}/{reference}"),
        path: path.map(str::to_owned),
        endpoint: Some(format!("http://{host}")),
    })
}

/// Every regular file under `dir`, relative path → bytes.
fn read_tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

async fn pulled(store: &ChunkStore, digest: &sealed_store::Digest) -> BTreeMap<String, Vec<u8>> {
    let dest = tempfile::tempdir().unwrap();
    pull(
        store,
        digest,
        &dest.path().join("out"),
        &PullOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    read_tree(&dest.path().join("out"))
}

fn tar(dir: &Path, out: &Path, what: &str) {
    let ok = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg(out)
        .arg(what)
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar {}", out.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oci_sources_sync_from_a_real_registry() {
    let Some(reg) = start_registry() else {
        return;
    };
    let host = reg.host.clone();
    let store_dir = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", store_dir.path().display());
    let store = ChunkStore::open(&store_url, &StoreOptions::default())
        .await
        .unwrap();
    let creds = SourceCredentials::default();

    // (a) A ModelPack artifact, built by hand.
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("model.safetensors", bytes(3 << 20, 1)),
        ("config.json", br#"{"hidden": 8}"#.to_vec()),
        ("tokenizer/vocab.txt", b"a\nb\n".to_vec()),
    ];
    let manifest_digest = push_modelpack(&host, "models/tiny", "v1", &files).await;
    let src = source(&host, "models/tiny:v1", None);
    let first = sync_source(&store, &src, &creds, &opts(), Arc::new(NoReporter))
        .await
        .unwrap();
    assert_eq!(first.source_revision, manifest_digest);
    assert_eq!(first.files, 3);
    let want: BTreeMap<String, Vec<u8>> = files
        .iter()
        .map(|(p, d)| (p.to_string(), d.clone()))
        .collect();
    assert_eq!(pulled(&store, &first.digest).await, want, "ModelPack files");
    // Re-sync of the same digest: the same version, nothing uploaded; pinned by digest too.
    assert_eq!(
        resolve_revision(&src, &creds, &opts()).await.unwrap(),
        manifest_digest
    );
    let pinned = source(&host, &format!("models/tiny@{manifest_digest}"), None);
    let again = sync_source(&store, &pinned, &creds, &opts(), Arc::new(NoReporter))
        .await
        .unwrap();
    assert_eq!(again.digest, first.digest);
    assert_eq!(again.source_revision, manifest_digest);
    assert_eq!(again.bytes_new, 0, "{again:?}");
    // A ModelPack artifact with --oci-path is refused.
    let err = sync_source(
        &store,
        &source(&host, "models/tiny:v1", Some("/models")),
        &creds,
        &opts(),
        Arc::new(NoReporter),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "InvalidSource", "{err}");

    // (b) An image: weights under /models in two layers, the upper one replacing a file,
    // whiting out another and adding one; something outside /models that must not come.
    let Some(crane) = crane() else { unreachable!() };
    let work = tempfile::tempdir().unwrap();
    let l1 = work.path().join("l1");
    std::fs::create_dir_all(l1.join("models/sub")).unwrap();
    std::fs::create_dir_all(l1.join("etc")).unwrap();
    std::fs::write(l1.join("models/weights.bin"), bytes(2 << 20, 2)).unwrap();
    std::fs::write(l1.join("models/old.bin"), b"old").unwrap();
    std::fs::write(l1.join("models/sub/keep.txt"), b"keep").unwrap();
    std::fs::write(l1.join("etc/passwd"), b"root:x:0:0").unwrap();
    let l2 = work.path().join("l2");
    std::fs::create_dir_all(l2.join("models")).unwrap();
    std::fs::write(l2.join("models/weights.bin"), bytes(2 << 20, 3)).unwrap();
    std::fs::write(l2.join("models/.wh.old.bin"), b"").unwrap();
    std::fs::write(l2.join("models/new.json"), b"{}").unwrap();
    tar(&l1, &work.path().join("l1.tar"), ".");
    tar(&l2, &work.path().join("l2.tar"), ".");
    for (base, layer, tag) in [(None, "l1.tar", "v1"), (Some("v1"), "l2.tar", "v2")] {
        let mut cmd = Command::new(&crane);
        cmd.arg("append").arg("-f").arg(work.path().join(layer));
        cmd.args(["-t", &format!("{host}/images/llm:{tag}")]);
        if let Some(b) = base {
            cmd.args(["-b", &format!("{host}/images/llm:{b}")]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let image = source(&host, "images/llm:v2", Some("/models"));
    let synced = sync_source(&store, &image, &creds, &opts(), Arc::new(NoReporter))
        .await
        .unwrap();
    let want: BTreeMap<String, Vec<u8>> = [
        ("weights.bin".to_owned(), bytes(2 << 20, 3)),
        ("new.json".to_owned(), b"{}".to_vec()),
        ("sub/keep.txt".to_owned(), b"keep".to_vec()),
    ]
    .into();
    assert_eq!(pulled(&store, &synced.digest).await, want, "image /models");
    // An image without a path is refused with what to set.
    let err = sync_source(
        &store,
        &source(&host, "images/llm:v2", None),
        &creds,
        &opts(),
        Arc::new(NoReporter),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--oci-path"), "{err}");

    // (c) A layer whose bytes do not match its digest. crane's registry checks its own
    // storage (a blob changed on its disk is answered 404), so the bytes come from a
    // registry that lies: a loopback stand-in serving the same manifest and a layer of the
    // right size with one byte flipped.
    let weight = sha256(&files[0].1);
    let manifest = reqwest::get(format!("http://{host}/v2/models/tiny/manifests/v1"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let mut bad = files[0].1.clone();
    bad[1000] ^= 0xff;
    let small: Vec<(String, Vec<u8>)> = files[1..]
        .iter()
        .map(|(_, d)| (sha256(d), d.clone()))
        .collect();
    let (manifest_for, weight_for) = (manifest.clone(), weight.clone());
    let liar = Recorder::start(move |head| {
        let line = head.lines().next().unwrap_or_default();
        let body = if line.contains("/manifests/") {
            manifest_for.clone()
        } else if line.contains(&weight_for) {
            bad.clone()
        } else if let Some((_, d)) = small.iter().find(|(dg, _)| line.contains(dg.as_str())) {
            d.clone()
        } else {
            return http_response("404 Not Found", &[], b"");
        };
        http_response(
            "200 OK",
            &[(
                "Content-Type",
                "application/vnd.oci.image.manifest.v1+json".to_owned(),
            )],
            &body,
        )
    })
    .await;
    let liar_host = liar.url.trim_start_matches("http://").to_owned();
    let other_dir = tempfile::tempdir().unwrap();
    let other = ChunkStore::open(
        &format!("file://{}", other_dir.path().display()),
        &StoreOptions::default(),
    )
    .await
    .unwrap();
    let err = sync_source(
        &other,
        &source(&liar_host, "models/tiny:v1", None),
        &creds,
        &opts(),
        Arc::new(NoReporter),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "IntegrityMismatch", "{err}");
    assert!(err.to_string().contains(&weight), "names the layer: {err}");
    assert!(
        other.list_versions().await.unwrap().is_empty(),
        "nothing sealed after a bad layer"
    );

    // (d) A private repository: the journey's Basic-auth proxy in front of the registry. No
    // pull secret: refused; the pull secret's entry for the registry: byte-identical files.
    let auth_port = sealed_test_support::free_port();
    let auth_host = format!("127.0.0.1:{auth_port}");
    let cred_file = work.path().join("registry-credentials");
    std::fs::write(&cred_file, "puller:pa55word\n").unwrap();
    let mut proxy = Command::new("python3")
        .arg(sealed_test_support::repo_root().join("hack/registry-auth.py"))
        .args(["--listen", &auth_host, "--backend", &host, "--credentials"])
        .arg(&cred_file)
        .arg("--log")
        .arg(work.path().join("auth.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 hack/registry-auth.py");
    sealed_test_support::wait_for_port(auth_port, &mut proxy, "hack/registry-auth.py");
    let private = SourceSpec::Oci(OciArtifact {
        reference: format!("oci://{auth_host}/models/tiny:v1"),
        path: None,
        endpoint: Some(format!("http://{auth_host}")),
    });
    let err = sync_source(&store, &private, &creds, &opts(), Arc::new(NoReporter))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "AccessDenied", "{err}");
    let auth = base64_encode("puller:pa55word");
    let secret = SourceCredentials {
        docker_config: Some(format!(
            r#"{{"auths":{{"{auth_host}":{{"auth":"{auth}"}},"other.example":{{"auth":"eDp5"}}}}}}"#
        )),
        ..Default::default()
    };
    let private_sync = sync_source(&store, &private, &secret, &opts(), Arc::new(NoReporter)).await;
    let _ = proxy.kill();
    let _ = proxy.wait();
    let private_sync = private_sync.unwrap();
    assert_eq!(private_sync.digest, first.digest);
    assert_eq!(private_sync.source_revision, manifest_digest);
    let log = std::fs::read_to_string(work.path().join("auth.log")).unwrap();
    assert!(
        log.contains("\"puller\""),
        "pulls were authenticated: {log}"
    );
}

fn base64_encode(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}
