//! Source readers against real servers: a sync seals exactly the digest `sealed push` gives
//! for the same files, honours include/exclude, reuses unchanged chunks, and fails with the
//! right reason (and no secret in the message) when it cannot. The servers here are plain
//! http on loopback and some sources are `file://`, so these syncs run with the policy's
//! `allow_http` and `allow_file`; the attacker-endpoint tests at the end check that credentials
//! never reach an endpoint they do not belong to.

mod support;

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutPayload};
use sealed_sources::{
    BucketPrefix, Egress, HubRepo, HubRepoType, NoReporter, SourceCredentials, SourceError,
    SourcePolicy, SourceSpec, SyncOptions, SyncOutcome, SyncReporter, resolve_revision,
    sync_source,
};
use sealed_store::ChunkStore;
use support::{
    AZURITE_ACCOUNT, AZURITE_KEY, Recorder, attacker, model_tree, pseudo_random, push_digest,
};

/// Rewrites the tail of the big shard: most of its chunks stay the same.
fn change_one_file(root: &Path) {
    let path = root.join("weights/model-00001.safetensors");
    let mut data = fs::read(&path).unwrap();
    let n = data.len();
    data[n - 1000..].copy_from_slice(&pseudo_random(1000, 99));
    fs::write(path, data).unwrap();
}

fn copy_tree(from: &Path, to: &Path, keep: &dyn Fn(&str) -> bool) {
    fn walk(root: &Path, dir: &Path, to: &Path, keep: &dyn Fn(&str) -> bool) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, to, keep);
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_owned();
            if rel.starts_with('.') || !keep(&rel) {
                continue;
            }
            let dest = to.join(&rel);
            fs::create_dir_all(dest.parent().unwrap()).unwrap();
            fs::copy(&p, dest).unwrap();
        }
    }
    fs::create_dir_all(to).unwrap();
    walk(from, from, to, keep);
}

#[derive(Default)]
struct Counting {
    listed_files: AtomicU64,
    listed_bytes: AtomicU64,
    advanced: AtomicU64,
    files_done: AtomicU64,
    retries: AtomicU64,
}

impl SyncReporter for Counting {
    fn listed(&self, files: u64, bytes: u64) {
        self.listed_files.store(files, Ordering::SeqCst);
        self.listed_bytes.store(bytes, Ordering::SeqCst);
    }
    fn advance(&self, bytes: u64) {
        self.advanced.fetch_add(bytes, Ordering::SeqCst);
    }
    fn file_done(&self, _path: &str, _bytes: u64) {
        self.files_done.fetch_add(1, Ordering::SeqCst);
    }
    fn retry(&self, _path: &str) {
        self.retries.fetch_add(1, Ordering::SeqCst);
    }
}

fn hf(endpoint: &str, repo: &str, revision: &str) -> HubRepo {
    HubRepo {
        repo: repo.into(),
        revision: revision.into(),
        repo_type: HubRepoType::Model,
        include: vec![],
        exclude: vec![],
        endpoint: Some(endpoint.into()),
    }
}

/// The loopback test servers speak plain http, and some sources are directories; an admin
/// allows loopback.
fn test_policy() -> SourcePolicy {
    SourcePolicy {
        allow_file: true,
        allow_http: true,
        egress: Egress::allowing(&["127.0.0.0/8", "::1/128"]).unwrap(),
        ..Default::default()
    }
}

fn opts() -> SyncOptions {
    SyncOptions {
        retries: 3,
        timeout: std::time::Duration::from_secs(20),
        policy: test_policy(),
        ..Default::default()
    }
}

async fn sync(
    store: &ChunkStore,
    source: &SourceSpec,
    creds: &SourceCredentials,
) -> Result<SyncOutcome, SourceError> {
    sync_source(store, source, creds, &opts(), Arc::new(NoReporter)).await
}

#[tokio::test]
async fn hugging_face_sync_matches_push() {
    let hub_root = tempfile::tempdir().unwrap();
    let repo = hub_root.path().join("acme/llm");
    model_tree(&repo);
    // Three entries a page: the listing takes several pages.
    let Some(hub) = support::start_hub(hub_root.path(), 3) else {
        return;
    };
    let store = ChunkStore::memory();
    let source = SourceSpec::HuggingFace(hf(&hub.url, "acme/llm", "main"));
    let progress = Arc::new(Counting::default());
    let first = sync_source(
        &store,
        &source,
        &SourceCredentials::default(),
        &opts(),
        progress.clone(),
    )
    .await
    .unwrap();
    assert_eq!(first.digest, push_digest(&repo).await);
    assert_eq!(first.files, 7);
    assert_eq!(first.source_revision.len(), 40);
    assert_eq!(progress.listed_files.load(Ordering::SeqCst), 7);
    assert_eq!(progress.files_done.load(Ordering::SeqCst), 7);
    assert_eq!(
        progress.advanced.load(Ordering::SeqCst),
        progress.listed_bytes.load(Ordering::SeqCst)
    );
    let manifest = store.get_manifest(&first.digest).await.unwrap();
    assert!(manifest.entries.iter().any(|e| e.path == "sub/dir"));
    assert_eq!(
        resolve_revision(&source, &SourceCredentials::default(), &opts())
            .await
            .unwrap(),
        first.source_revision
    );

    // A new commit with one changed file uploads only the changed chunks.
    change_one_file(&repo);
    let second = sync(&store, &source, &SourceCredentials::default())
        .await
        .unwrap();
    assert_ne!(second.source_revision, first.source_revision);
    assert_ne!(second.digest, first.digest);
    assert_eq!(second.digest, push_digest(&repo).await);
    assert!(
        second.bytes_reused >= 8 << 20,
        "reused only {} bytes",
        second.bytes_reused
    );
    assert!(second.bytes_new <= 5 << 20);

    // The same sync, pinned to the commit instead of the branch.
    let pinned = SourceSpec::HuggingFace(hf(&hub.url, "acme/llm", &second.source_revision));
    let again = sync(&store, &pinned, &SourceCredentials::default())
        .await
        .unwrap();
    assert_eq!(again.digest, second.digest);
    assert_eq!(again.bytes_new, 0);
}

#[tokio::test]
async fn hugging_face_include_exclude() {
    let hub_root = tempfile::tempdir().unwrap();
    let repo = hub_root.path().join("acme/llm");
    model_tree(&repo);
    let Some(hub) = support::start_hub(hub_root.path(), 50) else {
        return;
    };
    let mut spec = hf(&hub.url, "acme/llm", "main");
    spec.include = vec!["*.json".into(), "*.safetensors".into()];
    spec.exclude = vec!["*-00002.*".into()];
    let outcome = sync(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(spec),
        &SourceCredentials::default(),
    )
    .await
    .unwrap();
    let expected = tempfile::tempdir().unwrap();
    copy_tree(&repo, expected.path(), &|p| {
        (p.ends_with(".json") || p.ends_with(".safetensors")) && !p.contains("-00002.")
    });
    assert_eq!(outcome.files, 3);
    assert_eq!(outcome.digest, push_digest(expected.path()).await);

    // Patterns that match nothing are an error, not an empty version.
    let mut spec = hf(&hub.url, "acme/llm", "main");
    spec.include = vec!["*.gguf".into()];
    let err = sync(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(spec),
        &SourceCredentials::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "NothingToSync", "{err}");

    // A dataset repository lives under /datasets/ on the Hub.
    let data = hub_root.path().join("datasets/acme/corpus");
    fs::create_dir_all(data.join("train")).unwrap();
    fs::write(data.join("train/part-0.jsonl"), pseudo_random(2 << 20, 11)).unwrap();
    fs::write(data.join("README.md"), b"# corpus\n").unwrap();
    let mut spec = hf(&hub.url, "acme/corpus", "main");
    spec.repo_type = HubRepoType::Dataset;
    let outcome = sync(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(spec),
        &SourceCredentials::default(),
    )
    .await
    .unwrap();
    assert_eq!(outcome.digest, push_digest(&data).await);
}

#[tokio::test]
async fn hugging_face_errors() {
    let hub_root = tempfile::tempdir().unwrap();
    let token = "hf_secret_token_0123456789";
    let private = hub_root.path().join("acme/private");
    fs::create_dir_all(&private).unwrap();
    fs::write(private.join("config.json"), b"{}").unwrap();
    fs::write(private.join(".private"), token).unwrap();
    let corrupt = hub_root.path().join("acme/corrupt");
    fs::create_dir_all(&corrupt).unwrap();
    fs::write(corrupt.join("model.bin"), pseudo_random(3 << 20, 7)).unwrap();
    fs::write(corrupt.join(".corrupt"), b"").unwrap();
    let flaky = hub_root.path().join("acme/flaky");
    fs::create_dir_all(&flaky).unwrap();
    fs::write(flaky.join("config.json"), b"{\"a\": 1}").unwrap();
    fs::write(flaky.join(".flaky"), b"2").unwrap();
    let Some(hub) = support::start_hub(hub_root.path(), 50) else {
        return;
    };
    let store = ChunkStore::memory();
    let none = SourceCredentials::default();
    let with = |t: &str| SourceCredentials {
        hf_token: Some(t.into()),
        ..Default::default()
    };

    // Private without a token, or with a wrong one: AccessDenied, never echoing the token.
    let private_src = SourceSpec::HuggingFace(hf(&hub.url, "acme/private", "main"));
    let err = sync(&store, &private_src, &none).await.unwrap_err();
    assert_eq!(err.reason(), "AccessDenied", "{err}");
    assert!(err.to_string().contains("tokenSecretRef"), "{err}");
    let wrong = "hf_wrong_token_abcdefghij";
    let err = sync(&store, &private_src, &with(wrong)).await.unwrap_err();
    assert_eq!(err.reason(), "AccessDenied", "{err}");
    assert!(!format!("{err} {err:?}").contains(wrong), "{err:?}");
    // With the token it syncs.
    let ok = sync(&store, &private_src, &with(token)).await.unwrap();
    assert_eq!(ok.files, 1);

    let err = sync(
        &store,
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/missing", "main")),
        &none,
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "RepoNotFound", "{err}");
    assert!(err.to_string().contains("acme/missing"), "{err}");

    let err = sync(
        &store,
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/private", "v9")),
        &with(token),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "RevisionNotFound", "{err}");

    // A corrupted LFS payload fails the sync and seals nothing.
    let before = store.list_versions().await.unwrap().len();
    let err = sync(
        &store,
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/corrupt", "main")),
        &none,
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "IntegrityMismatch", "{err}");
    assert!(err.to_string().contains("model.bin"), "{err}");
    assert_eq!(store.list_versions().await.unwrap().len(), before);
    // A small (non-LFS) file is checked against its git blob id.
    let small = hub_root.path().join("acme/corrupt-small");
    fs::create_dir_all(&small).unwrap();
    fs::write(small.join("config.json"), b"{\"layers\": 32}").unwrap();
    fs::write(small.join(".corrupt"), b"").unwrap();
    let err = sync(
        &store,
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/corrupt-small", "main")),
        &none,
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "IntegrityMismatch", "{err}");
    assert!(err.to_string().contains("git blob"), "{err}");

    // Two 503s on the download are retried.
    let ok = sync(
        &store,
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/flaky", "main")),
        &none,
    )
    .await
    .unwrap();
    assert_eq!(ok.files, 1);

    // A payload that breaks off halfway, twice, is downloaded again from the start.
    let broken = hub_root.path().join("acme/broken");
    fs::create_dir_all(&broken).unwrap();
    fs::write(broken.join("model.bin"), pseudo_random(5 << 20, 12)).unwrap();
    fs::write(broken.join(".truncate"), b"2").unwrap();
    let progress = Arc::new(Counting::default());
    let ok = sync_source(
        &store,
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/broken", "main")),
        &none,
        &opts(),
        progress.clone(),
    )
    .await
    .unwrap();
    assert_eq!(progress.retries.load(Ordering::SeqCst), 2);
    let expected = tempfile::tempdir().unwrap();
    copy_tree(&broken, expected.path(), &|_| true);
    assert_eq!(ok.digest, push_digest(expected.path()).await);

    // Nothing listens here: SourceUnavailable after the retries.
    let mut dead = hf("http://127.0.0.1:9", "acme/llm", "main");
    dead.endpoint = Some("http://127.0.0.1:9".into());
    let err = sync_source(
        &store,
        &SourceSpec::HuggingFace(dead),
        &none,
        &SyncOptions {
            retries: 1,
            ..opts()
        },
        Arc::new(NoReporter),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "SourceUnavailable", "{err}");
    assert!(!err.is_permanent());
}

async fn upload_dir(store: &dyn ObjectStore, prefix: &str, dir: &Path) {
    fn files(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_owned();
                out.push((rel, fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    files(dir, dir, &mut out);
    for (rel, data) in out {
        store
            .put(
                &ObjectPath::from(format!("{prefix}/{rel}")),
                PutPayload::from(data),
            )
            .await
            .unwrap();
    }
}

fn bucket_source(url: &str, endpoint: Option<&str>) -> SourceSpec {
    SourceSpec::ObjectStore(BucketPrefix {
        url: url.into(),
        endpoint: endpoint.map(Into::into),
        region: Some("us-east-1".into()),
    })
}

fn aws(key: &str, secret: &str) -> SourceCredentials {
    SourceCredentials {
        hf_token: None,
        object_store: BTreeMap::from([
            ("AWS_ACCESS_KEY_ID".to_owned(), key.to_owned()),
            ("AWS_SECRET_ACCESS_KEY".to_owned(), secret.to_owned()),
        ]),
        docker_config: None,
    }
}

#[tokio::test]
async fn file_prefix_sync_matches_push() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("models/llm");
    model_tree(&data);
    let store = ChunkStore::memory();
    let source = bucket_source(&format!("file://{}", data.display()), None);
    let first = sync(&store, &source, &SourceCredentials::default())
        .await
        .unwrap();
    assert_eq!(first.digest, push_digest(&data).await);
    assert!(first.source_revision.starts_with("etags:"));
    // Unchanged: the same revision.
    let creds = SourceCredentials::default();
    assert_eq!(
        resolve_revision(&source, &creds, &opts()).await.unwrap(),
        first.source_revision
    );
    change_one_file(&data);
    let second = sync(&store, &source, &creds).await.unwrap();
    assert_ne!(second.source_revision, first.source_revision);
    assert_eq!(second.digest, push_digest(&data).await);
    assert!(second.bytes_reused >= 8 << 20);
}

#[tokio::test]
async fn s3_sync_matches_push() {
    let Some(moto) = support::start_moto("models", false) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    model_tree(dir.path());
    let bucket = object_store::aws::AmazonS3Builder::new()
        .with_bucket_name("models")
        .with_endpoint(&moto.url)
        .with_region("us-east-1")
        .with_access_key_id("testing")
        .with_secret_access_key("testing")
        .with_allow_http(true)
        .build()
        .unwrap();
    upload_dir(&bucket, "llm/v1", dir.path()).await;
    // A neighbour prefix sharing the name's start must not leak in.
    bucket
        .put(
            &ObjectPath::from("llm/v10/other.txt"),
            PutPayload::from("x"),
        )
        .await
        .unwrap();

    let store = ChunkStore::memory();
    let creds = aws("testing", "testing");
    let source = bucket_source("s3://models/llm/v1", Some(&moto.url));
    let first = sync(&store, &source, &creds).await.unwrap();
    assert_eq!(first.digest, push_digest(dir.path()).await);
    assert_eq!(first.files, 7);

    change_one_file(dir.path());
    upload_dir(&bucket, "llm/v1", dir.path()).await;
    let second = sync(&store, &source, &creds).await.unwrap();
    assert_eq!(second.digest, push_digest(dir.path()).await);
    assert_ne!(second.source_revision, first.source_revision);
    assert!(second.bytes_reused >= 8 << 20);

    // The same prefix as a path-style https(http)://host/bucket/prefix URL.
    let path_style = sync(
        &store,
        &bucket_source(&format!("{}/models/llm/v1", moto.url), None),
        &creds,
    )
    .await
    .unwrap();
    assert_eq!(path_style.digest, second.digest);
    assert_eq!(path_style.source_revision, second.source_revision);

    let err = sync(
        &store,
        &bucket_source("s3://no-such-bucket/x", Some(&moto.url)),
        &creds,
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "BucketNotFound", "{err}");

    let err = sync(
        &store,
        &bucket_source("s3://models/llm/v1", Some(&moto.url)),
        &SourceCredentials {
            hf_token: None,
            object_store: BTreeMap::from([("AWS_ACCESS_KEY_ID".to_owned(), "testing".to_owned())]),
            docker_config: None,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "InvalidCredentials", "{err}");
}

#[tokio::test]
async fn s3_bad_credentials() {
    let Some(moto) = support::start_moto("locked", true) else {
        return;
    };
    let secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    let err = sync(
        &ChunkStore::memory(),
        &bucket_source("s3://locked/llm", Some(&moto.url)),
        &aws("AKIAIOSFODNN7EXAMPLE", secret),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "CredentialsRejected", "{err}");
    assert!(!format!("{err} {err:?}").contains(secret));
}

#[tokio::test]
async fn azure_sync_matches_push() {
    let Some(azurite) = support::start_azurite("models") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    model_tree(dir.path());
    let container = object_store::azure::MicrosoftAzureBuilder::new()
        .with_account(AZURITE_ACCOUNT)
        .with_access_key(AZURITE_KEY)
        .with_container_name("models")
        .with_endpoint(azurite.url.clone())
        .with_allow_http(true)
        .build()
        .unwrap();
    upload_dir(&container, "llm", dir.path()).await;
    let creds = |key: &str| SourceCredentials {
        hf_token: None,
        object_store: BTreeMap::from([
            (
                "AZURE_STORAGE_ACCOUNT_NAME".to_owned(),
                AZURITE_ACCOUNT.to_owned(),
            ),
            ("AZURE_STORAGE_ACCOUNT_KEY".to_owned(), key.to_owned()),
        ]),
        docker_config: None,
    };
    let source = SourceSpec::ObjectStore(BucketPrefix {
        url: "az://models/llm".into(),
        endpoint: Some(azurite.url.clone()),
        region: None,
    });
    let store = ChunkStore::memory();
    let outcome = sync(&store, &source, &creds(AZURITE_KEY)).await.unwrap();
    assert_eq!(outcome.digest, push_digest(dir.path()).await);

    // A wrong key (valid base64) is rejected by the signature check.
    let wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ==";
    let err = sync(&store, &source, &creds(wrong)).await.unwrap_err();
    assert_eq!(err.reason(), "CredentialsRejected", "{err}");
    assert!(!format!("{err} {err:?}").contains(wrong));
}

/// A service-account key with a freshly made RSA key (object_store signs a JWT with it for
/// every request; fake-gcs-server does not check it), or None when openssl is missing.
fn gcs_key() -> Option<String> {
    if support::missing("openssl", "apt-get install openssl") {
        return None;
    }
    let out = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "openssl genpkey failed");
    let pem = String::from_utf8(out.stdout).unwrap();
    Some(
        serde_json::json!({
            "type": "service_account",
            "client_email": "sync@tenant.iam.gserviceaccount.com",
            "private_key_id": "1",
            "private_key": pem,
        })
        .to_string(),
    )
}

fn gcs_creds(key: &str) -> SourceCredentials {
    SourceCredentials {
        hf_token: None,
        object_store: BTreeMap::from([("GOOGLE_SERVICE_ACCOUNT_KEY".to_owned(), key.to_owned())]),
        docker_config: None,
    }
}

#[tokio::test]
async fn gcs_sync_matches_push() {
    let Some(gcs) = support::start_fake_gcs("models") else {
        return;
    };
    let Some(key) = gcs_key() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    model_tree(dir.path());
    support::gcs_put_dir(&gcs, "models", "llm/v1", dir.path());
    // A neighbour prefix sharing the name's start must not leak in.
    support::gcs_put_object(&gcs, "models", "llm/v10/other.txt", b"x");

    let store = ChunkStore::memory();
    let creds = gcs_creds(&key);
    let source = bucket_source("gs://models/llm/v1", Some(&gcs.url));
    let first = sync(&store, &source, &creds).await.unwrap();
    assert_eq!(first.digest, push_digest(dir.path()).await);
    assert_eq!(first.files, 7);
    assert_eq!(
        resolve_revision(&source, &creds, &opts()).await.unwrap(),
        first.source_revision,
        "an unchanged prefix, the same revision"
    );

    change_one_file(dir.path());
    support::gcs_put_dir(&gcs, "models", "llm/v1", dir.path());
    let second = sync(&store, &source, &creds).await.unwrap();
    assert_eq!(second.digest, push_digest(dir.path()).await);
    assert_ne!(second.source_revision, first.source_revision);
    assert!(second.bytes_reused >= 8 << 20);

    // fake-gcs-server answers a missing bucket's listing with 500, not GCS's 404: retried,
    // then an error (not an empty version).
    let err = sync(
        &store,
        &bucket_source("gs://no-such-bucket/x", Some(&gcs.url)),
        &creds,
    )
    .await
    .unwrap_err();
    assert_ne!(err.reason(), "InvalidCredentials", "{err}");
}

#[tokio::test]
async fn gcs_key_cannot_move_the_endpoint() {
    let evil = attacker().await;
    // A usable key that names its own host (the client would send its signed JWT there):
    // refused before any request, endpoint or not.
    let Some(key) = gcs_key() else {
        return;
    };
    let mut key: serde_json::Value = serde_json::from_str(&key).unwrap();
    key["gcs_base_url"] = evil.url.clone().into();
    let private_key = key["private_key"].as_str().unwrap().to_owned();
    let key = key.to_string();
    for endpoint in [None, Some("https://storage.googleapis.com")] {
        let err = sync(
            &ChunkStore::memory(),
            &bucket_source("gs://models/llm", endpoint),
            &gcs_creds(&key),
        )
        .await
        .unwrap_err();
        assert_eq!(err.reason(), "InvalidCredentials", "{err}");
        assert!(err.to_string().contains("gcs_base_url"), "{err}");
        assert!(!format!("{err} {err:?}").contains(&private_key), "{err:?}");
    }
    assert!(evil.requests().is_empty(), "{:?}", evil.requests());
}

/// The request line's path.
fn request_path(head: &str) -> &str {
    head.split_whitespace().nth(1).unwrap_or("")
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A Hub stand-in: `acme/paged`'s listing points its next page at `next`; `acme/redirect`'s
/// one file redirects to `next`.
async fn hostile_hub(next: String) -> Recorder {
    Recorder::start(move |head| {
        let path = request_path(head);
        let json = |body: &str| {
            support::http_response(
                "200 OK",
                &[("Content-Type", "application/json".into())],
                body.as_bytes(),
            )
        };
        let tree = r#"[{"type": "file", "path": "a.txt", "size": 5}]"#;
        if path.contains("/revision/") {
            json(&format!(r#"{{"sha": "{COMMIT}"}}"#))
        } else if path.starts_with("/api/models/acme/paged/tree/") {
            support::http_response(
                "200 OK",
                &[
                    ("Content-Type", "application/json".into()),
                    (
                        "Link",
                        format!(
                            "<{next}/api/models/acme/paged/tree/{COMMIT}?cursor=2>; rel=\"next\""
                        ),
                    ),
                ],
                tree.as_bytes(),
            )
        } else if path.starts_with("/api/models/acme/redirect/tree/") {
            json(tree)
        } else if path.starts_with("/acme/redirect/resolve/") {
            support::http_response(
                "302 Found",
                &[("Location", format!("{next}/cdn/a.txt"))],
                b"",
            )
        } else {
            support::http_response(
                "404 Not Found",
                &[("X-Error-Code", "RepoNotFound".into())],
                b"",
            )
        }
    })
    .await
}

#[tokio::test]
async fn hub_token_stays_at_its_origin() {
    let evil = attacker().await;
    let hub = hostile_hub(evil.url.clone()).await;
    let token = "hf_attack_test_token_0123456789";
    let creds = SourceCredentials {
        hf_token: Some(token.into()),
        ..Default::default()
    };

    // A next page at another origin (another port): never followed, with or without a token.
    let err = sync(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/paged", "main")),
        &creds,
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "SourceError", "{err}");
    assert!(err.to_string().contains("another origin"), "{err}");
    assert!(evil.requests().is_empty(), "{:?}", evil.requests());
    // The Hub itself did get the token: the test would see a leak.
    assert!(
        hub.requests()
            .iter()
            .any(|h| h.contains(&format!("Bearer {token}"))),
        "{:?}",
        hub.requests()
    );

    // A redirect to another origin is followed (the Hub's CDN), without the token.
    let ok = sync(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/redirect", "main")),
        &creds,
    )
    .await
    .unwrap();
    assert_eq!(ok.files, 1);
    assert_eq!(evil.requests().len(), 1, "{:?}", evil.requests());
    assert!(evil.with_credentials().is_empty(), "{:?}", evil.requests());

    // A password in the endpoint: refused before any request, never echoed.
    let before = hub.requests().len();
    let with_password = hub.url.replace("http://", "http://user:hunter2pass@");
    let err = sync(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(hf(&with_password, "acme/redirect", "main")),
        &SourceCredentials::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "InvalidSource", "{err}");
    assert!(!format!("{err} {err:?}").contains("hunter2pass"), "{err:?}");
    assert_eq!(hub.requests().len(), before);

    // Plain http without the operator's flag: refused before any request.
    let err = sync_source(
        &ChunkStore::memory(),
        &SourceSpec::HuggingFace(hf(&hub.url, "acme/redirect", "main")),
        &creds,
        &SyncOptions {
            policy: SourcePolicy::default(),
            ..opts()
        },
        Arc::new(NoReporter),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "SourceRefused", "{err}");
    assert_eq!(hub.requests().len(), before);
}

#[tokio::test]
async fn object_store_endpoint_gets_no_ambient_credentials() {
    let evil = attacker().await;
    let source = bucket_source("s3://models/llm", Some(&evil.url));
    // No Secret: refused, whatever credentials the process has.
    let err = sync(
        &ChunkStore::memory(),
        &source,
        &SourceCredentials::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "CredentialsRequired", "{err}");
    let err = resolve_revision(&source, &SourceCredentials::default(), &opts())
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "CredentialsRequired", "{err}");
    // Allow-listing the bucket does not allow it at another endpoint.
    let allow_listed = SyncOptions {
        policy: SourcePolicy {
            ambient_allowed: vec!["s3://models/".into()],
            ..test_policy()
        },
        ..opts()
    };
    let err = sync_source(
        &ChunkStore::memory(),
        &source,
        &SourceCredentials::default(),
        &allow_listed,
        Arc::new(NoReporter),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "CredentialsRequired", "{err}");
    // A path-style URL at the attacker, the same.
    let err = sync(
        &ChunkStore::memory(),
        &bucket_source(&format!("{}/models/llm", evil.url), None),
        &SourceCredentials::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "CredentialsRequired", "{err}");
    // A Secret that tries to move the endpoint: refused.
    let mut creds = aws("AKIAEXAMPLE", "tenant-secret");
    creds
        .object_store
        .insert("AWS_ENDPOINT".into(), evil.url.clone());
    let err = sync(
        &ChunkStore::memory(),
        &bucket_source("s3://models/llm", None),
        &creds,
    )
    .await
    .unwrap_err();
    assert_eq!(err.reason(), "InvalidCredentials", "{err}");
    assert!(
        !format!("{err} {err:?}").contains("tenant-secret"),
        "{err:?}"
    );
    assert!(evil.requests().is_empty(), "{:?}", evil.requests());
}
