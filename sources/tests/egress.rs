//! Sources never reach loopback, link-local or private addresses unless an admin allowed them
//! (design invariant 6), checked on the resolved address of every connection and redirect
//! hop: a redirect or an endpoint to 127.0.0.0/8 (by address, or by a name that resolves
//! there, as DNS rebinding would), 169.254.0.0/16 or a private range is refused before any
//! byte reaches it. The Hub stand-in listens on 127.0.0.3, the one address the admin allows
//! here; the victims listen on 127.0.0.1. Refused private and link-local targets are never
//! connected to (the policy and the resolver refuse them first), so no traffic leaves loopback.
//! Also: a download of the wrong size names only the size the listing declared.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sealed_sources::{
    BucketPrefix, Egress, HubRepo, HubRepoType, NoReporter, SourceCredentials, SourceError,
    SourcePolicy, SourceSpec, SyncOptions, SyncOutcome, sync_source,
};
use sealed_store::ChunkStore;
use support::{attacker, http_response, read_request_head};
use tokio::io::AsyncWriteExt;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
/// The only address the admin allows in these tests.
const ALLOWED: &str = "127.0.0.3";

/// A server on `ALLOWED` that answers with `respond(path)` and records each path.
struct Server {
    url: String,
    paths: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(respond: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> Server {
    let listener = tokio::net::TcpListener::bind((ALLOWED, 0)).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let paths = Arc::new(Mutex::new(Vec::new()));
    let (seen, respond) = (paths.clone(), Arc::new(respond));
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let (seen, respond) = (seen.clone(), respond.clone());
            tokio::spawn(async move {
                let Some(head) = read_request_head(&mut conn).await else {
                    return;
                };
                let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                seen.lock().unwrap().push(path.clone());
                let _ = conn.write_all(&respond(&path)).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Server { url, paths, task }
}

/// A Hub whose one file `a.txt` (declared `size` bytes) is served by `file(path)`.
async fn hub(size: u64, file: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> Server {
    serve(move |path| {
        let json = |body: String| {
            http_response(
                "200 OK",
                &[("Content-Type", "application/json".into())],
                body.as_bytes(),
            )
        };
        if path.contains("/revision/") {
            json(format!(r#"{{"sha": "{COMMIT}"}}"#))
        } else if path.contains("/tree/") {
            json(format!(
                r#"[{{"type": "file", "path": "a.txt", "size": {size}}}]"#
            ))
        } else {
            file(path)
        }
    })
    .await
}

/// A Hub whose file redirects to `location`.
async fn redirecting_hub(location: String) -> Server {
    hub(5, move |_| {
        http_response("302 Found", &[("Location", location.clone())], b"")
    })
    .await
}

fn policy() -> SourcePolicy {
    SourcePolicy {
        allow_http: true,
        egress: Egress::allowing(&[ALLOWED]).unwrap(),
        ..Default::default()
    }
}

fn hf(endpoint: &str) -> SourceSpec {
    SourceSpec::HuggingFace(HubRepo {
        repo: "acme/model".into(),
        revision: "main".into(),
        repo_type: HubRepoType::Model,
        include: vec![],
        exclude: vec![],
        endpoint: Some(endpoint.into()),
    })
}

fn bucket(url: &str, endpoint: Option<&str>) -> SourceSpec {
    SourceSpec::ObjectStore(BucketPrefix {
        url: url.into(),
        endpoint: endpoint.map(Into::into),
        region: Some("us-east-1".into()),
    })
}

fn aws() -> SourceCredentials {
    let mut creds = SourceCredentials::default();
    creds
        .object_store
        .insert("AWS_ACCESS_KEY_ID".into(), "AKIAEGRESSTEST".into());
    creds
        .object_store
        .insert("AWS_SECRET_ACCESS_KEY".into(), "egress-secret".into());
    creds
}

async fn sync(source: &SourceSpec, creds: &SourceCredentials) -> Result<SyncOutcome, SourceError> {
    let opts = SyncOptions {
        retries: 1,
        timeout: Duration::from_secs(5),
        policy: policy(),
        ..Default::default()
    };
    // Bounded: a refusal must come at once, not after a connect timeout.
    tokio::time::timeout(
        Duration::from_secs(20),
        sync_source(
            &ChunkStore::memory(),
            source,
            creds,
            &opts,
            Arc::new(NoReporter),
        ),
    )
    .await
    .expect("the sync ends")
}

fn assert_refused(r: Result<SyncOutcome, SourceError>, what: &str) {
    match r {
        Ok(o) => panic!("{what}: synced {o:?}, expected SourceRefused"),
        Err(e) => {
            assert_eq!(e.reason(), "SourceRefused", "{what}: {e}");
            assert!(
                e.to_string().contains("--allow-source-network"),
                "{what}: {e}"
            );
        }
    }
}

#[tokio::test]
async fn hub_redirects_to_internal_addresses_are_refused() {
    let victim = attacker().await; // on 127.0.0.1, not allowed
    let port = victim.url.rsplit(':').next().unwrap().to_owned();

    // The allowed Hub works, including a redirect within what is allowed.
    let cdn = hub(5, |_| http_response("200 OK", &[], b"hello")).await;
    let ok = redirecting_hub(format!("{}/cdn/a.txt", cdn.url)).await;
    assert_eq!(
        sync(&hf(&ok.url), &SourceCredentials::default())
            .await
            .unwrap()
            .files,
        1
    );

    for location in [
        // Loopback by address and by a name that resolves there (DNS rebinding).
        format!("http://127.0.0.1:{port}/cdn/a.txt"),
        format!("http://localhost:{port}/cdn/a.txt"),
        // Instance metadata and a private range: refused before any connection.
        "http://169.254.169.254/latest/meta-data/iam".to_owned(),
        "http://10.0.0.1:9/x".to_owned(),
        "http://[fd00::1]:9/x".to_owned(),
    ] {
        let hub = redirecting_hub(location.clone()).await;
        assert_refused(
            sync(&hf(&hub.url), &SourceCredentials::default()).await,
            &location,
        );
        assert!(
            victim.requests().is_empty(),
            "{location}: {:?}",
            victim.requests()
        );
    }
}

#[tokio::test]
async fn endpoints_at_internal_addresses_are_refused() {
    let victim = attacker().await;
    let port = victim.url.rsplit(':').next().unwrap().to_owned();
    for endpoint in [
        format!("http://localhost:{port}"),
        format!("http://127.0.0.1:{port}"),
        "http://169.254.169.254".to_owned(),
        "http://192.168.0.1:9000".to_owned(),
    ] {
        assert_refused(
            sync(&hf(&endpoint), &SourceCredentials::default()).await,
            &format!("hub {endpoint}"),
        );
        assert_refused(
            sync(&bucket("s3://models/x", Some(&endpoint)), &aws()).await,
            &format!("bucket endpoint {endpoint}"),
        );
        assert_refused(
            sync(&bucket(&format!("{endpoint}/models/x"), None), &aws()).await,
            &format!("bucket url {endpoint}"),
        );
        assert!(
            victim.requests().is_empty(),
            "{endpoint}: {:?}",
            victim.requests()
        );
    }

    // An allowed endpoint that redirects to loopback: the hop is refused at connect time.
    let redirecting = serve(move |_| {
        http_response(
            "307 Temporary Redirect",
            &[(
                "Location",
                format!("http://localhost:{port}/models?list-type=2"),
            )],
            b"",
        )
    })
    .await;
    assert_refused(
        sync(&bucket("s3://models/x", Some(&redirecting.url)), &aws()).await,
        "bucket redirect",
    );
    assert!(!redirecting.paths.lock().unwrap().is_empty());
    assert!(victim.requests().is_empty(), "{:?}", victim.requests());
}

#[tokio::test]
async fn a_wrong_size_names_only_the_declared_one() {
    // The tree declares 1000 bytes; the file has 777.
    let hub = hub(1000, |_| http_response("200 OK", &[], &[7u8; 777])).await;
    let err = sync(&hf(&hub.url), &SourceCredentials::default())
        .await
        .unwrap_err();
    let text = format!("{err}");
    assert!(text.contains("1000"), "{text}");
    assert!(
        !text.contains("777"),
        "the size that came is echoed: {text}"
    );
}
