//! Pushing from where model files really are: a `huggingface-cli download` snapshot is links
//! into a blob cache. With `--follow-symlinks` it seals the digest the operator's Hub sync
//! seals for the same files (include/exclude too); links that dangle, loop or leave the
//! allowed roots are refused; a `file://` store is created by the first push.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sealed_sources::{
    HubRepo, HubRepoType, NoReporter, SourceCredentials, SourcePolicy, SourceSpec, SyncOptions,
    sync_source,
};
use sealed_store::ChunkStore;
use sealed_test_support::servers::start_hub;
use sealed_test_support::trees::model_tree;

mod common;
use common::Env;

fn files(root: &Path, rel: &str, out: &mut Vec<(String, PathBuf)>) {
    let mut children: Vec<_> = std::fs::read_dir(root.join(rel))
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    children.sort_by_key(|c| c.file_name());
    for c in children {
        let name = c.file_name().into_string().unwrap();
        let r = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        if c.file_type().unwrap().is_dir() {
            files(root, &r, out);
        } else {
            out.push((r, c.path()));
        }
    }
}

/// The layout `huggingface-cli download` leaves: `REPO/blobs/<hash>` and
/// `REPO/snapshots/<rev>/<path>` as relative links to them. Returns the snapshot directory.
fn hf_cache_snapshot(repo: &Path, cache: &Path) -> PathBuf {
    let cached = cache.join("models--acme--llm");
    let snapshot = cached.join("snapshots/0123456789abcdef0123456789abcdef01234567");
    std::fs::create_dir_all(cached.join("blobs")).unwrap();
    let mut all = Vec::new();
    files(repo, "", &mut all);
    for (rel, path) in all {
        let bytes = std::fs::read(&path).unwrap();
        let hash = blake3::hash(&bytes).to_hex().to_string();
        std::fs::write(cached.join("blobs").join(&hash), &bytes).unwrap();
        let link = snapshot.join(&rel);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let up = "../".repeat(rel.matches('/').count() + 2);
        symlink(format!("{up}blobs/{hash}"), &link).unwrap();
    }
    snapshot
}

fn hub_spec(endpoint: &str, include: &[&str], exclude: &[&str]) -> SourceSpec {
    SourceSpec::HuggingFace(HubRepo {
        repo: "acme/llm".into(),
        revision: "main".into(),
        repo_type: HubRepoType::Model,
        include: include.iter().map(|s| s.to_string()).collect(),
        exclude: exclude.iter().map(|s| s.to_string()).collect(),
        endpoint: Some(endpoint.into()),
    })
}

async fn synced(spec: &SourceSpec) -> String {
    let opts = SyncOptions {
        retries: 2,
        timeout: std::time::Duration::from_secs(20),
        policy: SourcePolicy {
            allow_http: true,
            egress: sealed_sources::Egress::allowing(&["127.0.0.0/8"]).unwrap(),
            ..Default::default()
        },
        ..Default::default()
    };
    sync_source(
        &ChunkStore::memory(),
        spec,
        &SourceCredentials::default(),
        &opts,
        Arc::new(NoReporter),
    )
    .await
    .unwrap()
    .digest
    .to_string()
}

#[tokio::test]
async fn a_hugging_face_snapshot_seals_the_digest_the_hub_sync_seals() {
    let hub_root = tempfile::tempdir().unwrap();
    let repo = hub_root.path().join("acme/llm");
    model_tree(&repo);
    let Some(hub) = start_hub(hub_root.path(), 50) else {
        return;
    };
    let env = Env::new();
    let snapshot = hf_cache_snapshot(&repo, &env.path("hf-cache"));
    let snap = snapshot.to_str().unwrap();
    // A store that does not exist yet: the first push creates it.
    let store = format!("file://{}", env.path("fresh/store").display());

    // As links the snapshot leaves itself: refused, nothing sealed.
    let (ok, _, err) = env.run(&["--store", &store, "push", snap]);
    assert!(!ok);
    assert!(err.contains("push with --follow-symlinks"), "{err}");

    let (ok, pushed, err) = env.run(&["--store", &store, "push", "--follow-symlinks", snap]);
    assert!(ok, "{err}");
    assert_eq!(pushed.trim(), synced(&hub_spec(&hub.url, &[], &[])).await);
    assert!(env.path("fresh/store/manifests").is_dir(), "store created");

    let (ok, pushed, err) = env.run(&[
        "--store",
        &store,
        "push",
        "--follow-symlinks",
        "--include",
        "*.json",
        "--include",
        "*.safetensors",
        "--exclude",
        "*-00002.*",
        snap,
    ]);
    assert!(ok, "{err}");
    let expected = synced(&hub_spec(
        &hub.url,
        &["*.json", "*.safetensors"],
        &["*-00002.*"],
    ))
    .await;
    assert_eq!(pushed.trim(), expected);
    let (ok, inspect, _) = env.run(&["--store", &store, "inspect", pushed.trim(), "-o", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(v["files"], 3, "{inspect}");

    let (ok, _, err) = env.run(&[
        "--store",
        &store,
        "push",
        "--follow-symlinks",
        "--include",
        "*.gguf",
        snap,
    ]);
    assert!(!ok && err.contains("no file matches"), "{err}");
}

#[test]
fn followed_links_that_leave_loop_or_dangle_are_refused() {
    let env = Env::new();
    let dir = env.path("tree");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("a.bin"), b"a").unwrap();
    let outside = env.path("outside.txt");
    std::fs::write(&outside, b"secret").unwrap();
    let push = |d: &Path, extra: &[&str]| {
        let mut args = vec!["push", "--follow-symlinks"];
        args.extend_from_slice(extra);
        args.push(d.to_str().unwrap());
        env.run(&args)
    };

    // A link inside the tree is sealed as its target's bytes.
    symlink("../a.bin", dir.join("sub/alias")).unwrap();
    let (ok, digest, err) = push(&dir, &[]);
    assert!(ok, "{err}");
    let (_, inspect, _) = env.run(&["inspect", digest.trim(), "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(v["files"], 2, "{inspect}");
    assert_eq!(v["symlinks"], 0, "{inspect}");

    symlink(&outside, dir.join("escape")).unwrap();
    let (ok, _, err) = push(&dir, &[]);
    assert!(!ok && err.contains("outside the pushed directory"), "{err}");
    // Allowed once its root is.
    let (ok, _, err) = push(&dir, &["--allow-root", env.path("").to_str().unwrap()]);
    assert!(ok, "{err}");
    std::fs::remove_file(dir.join("escape")).unwrap();

    symlink("..", dir.join("sub/up")).unwrap();
    let (ok, _, err) = push(&dir, &[]);
    assert!(!ok && err.contains("symlink loop"), "{err}");
    std::fs::remove_file(dir.join("sub/up")).unwrap();

    symlink("self", dir.join("self")).unwrap();
    let (ok, _, err) = push(&dir, &[]);
    assert!(!ok && err.contains("symlink loop"), "{err}");
    std::fs::remove_file(dir.join("self")).unwrap();

    symlink("nowhere", dir.join("dangling")).unwrap();
    let (ok, _, err) = push(&dir, &[]);
    assert!(!ok && err.contains("dangling"), "{err}");
}
