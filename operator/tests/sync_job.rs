//! `sealed-operator sync`, the process a sync Job runs: the store's credentials go to the
//! store and nowhere else, the policy is checked again in the Job, and a store that cannot be
//! opened is not named in the (tenant-visible) termination message.

mod support;

use std::fs;
use std::sync::Arc;

use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, NoProgress};

use support::{attacker, model_tree};

/// `sealed-operator sync` as a sync Job runs it, with a clean environment.
async fn sync_process(args: Vec<String>, env: Vec<(String, String)>) -> (i32, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("termination-log");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sealed-operator"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", dir.path())
        .arg("sync")
        .args(&args)
        .arg("--termination-log")
        .arg(&log)
        .envs(env);
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    let text = fs::read_to_string(&log).unwrap_or_else(|_| {
        panic!(
            "no termination log (exit {code}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (code, serde_json::from_str(&text).unwrap())
}

#[tokio::test]
async fn sync_job_keeps_the_store_credentials_to_the_store() {
    let Some(moto) = support::start_moto("sealed-store", false) else {
        return;
    };
    let evil = attacker().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("llm");
    model_tree(&data);
    let store_key = "STOREKEYID0123456789";
    let store_env = vec![
        (
            "SEALED_STORE_CRED_AWS_ACCESS_KEY_ID".to_string(),
            store_key.to_string(),
        ),
        (
            "SEALED_STORE_CRED_AWS_SECRET_ACCESS_KEY".to_string(),
            "store-secret".to_string(),
        ),
    ];
    let store_args = |source: serde_json::Value, extra: &[&str]| {
        let mut a: Vec<String> = [
            "--store",
            "s3://sealed-store/sv",
            "--store-endpoint",
            &moto.url,
            "--store-region",
            "us-east-1",
            "--volume",
            "ml/llm",
            "--source",
            &source.to_string(),
            // The test's servers listen on loopback: the admin allows it.
            "--allow-source-network=127.0.0.0/8",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let file_source =
        serde_json::json!({"objectStore": {"url": format!("file://{}", data.display())}});

    // The store opens with its credentials under SEALED_STORE_CRED_ (ChunkStore::connect),
    // and the allowed file source seals the digest `sealed push` gives.
    let (code, t) = sync_process(
        store_args(file_source.clone(), &["--allow-file-sources"]),
        store_env.clone(),
    )
    .await;
    assert_eq!(code, 0, "{t}");
    let pushed = push(
        &ChunkStore::memory(),
        &data,
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .expect("push the same tree");
    assert_eq!(
        t["succeeded"]["digest"].as_str(),
        Some(pushed.digest.to_string().as_str()),
        "{t}"
    );

    // The Job checks the policy again: without the flag, a file source is refused.
    let (code, t) = sync_process(store_args(file_source, &[]), store_env.clone()).await;
    assert_eq!(code, 3, "{t}");
    assert_eq!(t["failed"]["reason"], "SourceRefused", "{t}");

    // The store itself as a source: refused.
    let store_source =
        serde_json::json!({"objectStore": {"url": "s3://sealed-store/", "endpoint": moto.url}});
    let (code, t) = sync_process(
        store_args(store_source, &["--allow-http-sources"]),
        store_env.clone(),
    )
    .await;
    assert_eq!(code, 3, "{t}");
    assert_eq!(t["failed"]["reason"], "SourceRefused", "{t}");

    // The attacker's endpoint, no Secret: refused; the store's credentials go nowhere.
    let hostile =
        serde_json::json!({"objectStore": {"url": "s3://models/x", "endpoint": evil.url}});
    let (code, t) = sync_process(
        store_args(hostile, &["--allow-http-sources"]),
        store_env.clone(),
    )
    .await;
    assert_eq!(code, 3, "{t}");
    assert_eq!(t["failed"]["reason"], "CredentialsRequired", "{t}");
    assert!(evil.requests().is_empty(), "{:?}", evil.requests());

    // Even a prefix allow-listed for ambient credentials is read with the process's own
    // (AWS_*), never with the store's.
    let allowed = format!("{}/models/", evil.url);
    let listed = serde_json::json!({"objectStore": {"url": format!("{}/models/x", evil.url)}});
    let mut env = store_env.clone();
    env.push(("AWS_ACCESS_KEY_ID".into(), "AMBIENTKEYID".into()));
    env.push(("AWS_SECRET_ACCESS_KEY".into(), "ambient-secret".into()));
    let (code, t) = sync_process(
        store_args(
            listed,
            &[
                "--allow-http-sources",
                "--ambient-credentials-source",
                &allowed,
            ],
        ),
        env,
    )
    .await;
    assert_ne!(code, 0, "{t}");
    let seen = evil.requests();
    assert!(!seen.is_empty(), "the allow-listed source was not read");
    assert!(seen.iter().all(|h| !h.contains(store_key)), "{seen:?}");
    assert!(seen.iter().any(|h| h.contains("AMBIENTKEYID")), "{seen:?}");

    // A store that cannot be opened: the termination message (tenant-visible) does not name it.
    let dead = "http://127.0.0.1:9";
    let mut args = store_args(
        serde_json::json!({"objectStore": {"url": "s3://models/x"}}),
        &[],
    );
    for (i, a) in args.clone().iter().enumerate() {
        if a == &moto.url {
            args[i] = dead.into();
        }
    }
    let (code, t) = sync_process(args, store_env).await;
    assert_eq!(code, 1, "{t}");
    assert_eq!(t["failed"]["reason"], "StoreUnavailable", "{t}");
    let message = t["failed"]["message"].as_str().unwrap_or_default();
    assert!(
        !message.contains("sealed-store") && !message.contains("127.0.0.1"),
        "{message}"
    );
}
