//! A source that sends more than it may: an endless tree listing (one endless page, or
//! endless pages), an endless error page, a file longer than its listing said, a prefix with
//! more objects than a sync lists. Each sync fails quickly with an error that names the
//! bound, and the server (which counts what it wrote) wrote at most the bound plus what the
//! sockets' buffers hold.

use std::fs;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sealed_sources::limits::{MAX_LISTING_ENTRIES, MAX_PAGE_BYTES};
use sealed_sources::{
    BucketPrefix, Egress, HubRepo, HubRepoType, NoReporter, SourceCredentials, SourceError,
    SourceLimits, SourcePolicy, SourceSpec, SyncOptions, sync_source,
};
use sealed_store::ChunkStore;
use tokio::io::AsyncWriteExt;

mod support;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
/// What loopback sockets may hold between the server's writes and the client's reads
/// (send and receive buffers, autotuned to a few MiB each).
const SOCKET_SLACK: u64 = 16 << 20;
/// Where the hostile server gives up on its own, far past every bound: without the bounds
/// the client reads all of it.
const SERVER_STOP: u64 = 256 << 20;

/// What the hostile Hub answers to one request.
enum Reply {
    Whole(Vec<u8>),
    /// `head`, `first`, then `unit` over and over until [`SERVER_STOP`] or a hang-up.
    Endless {
        head: String,
        first: Vec<u8>,
        unit: Vec<u8>,
    },
}

/// A loopback server that records each request line and counts every byte of body it
/// managed to write.
struct HostileHub {
    url: String,
    requests: Arc<Mutex<Vec<String>>>,
    written: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl HostileHub {
    async fn start(respond: impl Fn(&str) -> Reply + Send + Sync + 'static) -> HostileHub {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let written = Arc::new(AtomicU64::new(0));
        let respond = Arc::new(respond);
        let (seen, count) = (requests.clone(), written.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (seen, count, respond) = (seen.clone(), count.clone(), respond.clone());
                tokio::spawn(async move {
                    let Some(head) = support::read_request_head(&mut conn).await else {
                        return;
                    };
                    let line = head.lines().next().unwrap_or("").to_owned();
                    seen.lock().unwrap().push(line.clone());
                    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                    match respond(&path) {
                        Reply::Whole(bytes) => {
                            let _ = conn.write_all(&bytes).await;
                        }
                        Reply::Endless { head, first, unit } => {
                            if conn.write_all(head.as_bytes()).await.is_err()
                                || conn.write_all(&first).await.is_err()
                            {
                                return;
                            }
                            let mut sent = first.len() as u64;
                            while sent < SERVER_STOP {
                                if conn.write_all(&unit).await.is_err() {
                                    break;
                                }
                                sent += unit.len() as u64;
                                count.fetch_add(unit.len() as u64, Ordering::SeqCst);
                            }
                        }
                    }
                    let _ = conn.shutdown().await;
                });
            }
        });
        HostileHub {
            url,
            requests,
            written,
            task,
        }
    }

    fn written(&self) -> u64 {
        self.written.load(Ordering::SeqCst)
    }

    fn requests_to(&self, part: &str) -> usize {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(part))
            .count()
    }
}

impl Drop for HostileHub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A body without a length: it ends when the server closes the connection.
fn endless(status: &str, first: &[u8], unit: &[u8]) -> Reply {
    Reply::Endless {
        head: format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
        ),
        first: first.to_vec(),
        unit: unit.to_vec(),
    }
}

/// The Hub's answers for the repositories below; `acme/<case>` picks the misbehaviour.
fn hostile(path: &str) -> Reply {
    let json = |body: String| {
        Reply::Whole(support::http_response(
            "200 OK",
            &[("Content-Type", "application/json".into())],
            body.as_bytes(),
        ))
    };
    let revision = format!(r#"{{"sha": "{COMMIT}"}}"#);
    let small_tree = r#"[{"type": "file", "path": "a.txt", "size": 5}]"#;
    if path.starts_with("/api/models/acme/endless-revision/revision/") {
        return endless("200 OK", br#"{"sha": ""#, b"0123456789abcdef");
    }
    if path.contains("/revision/") {
        return json(revision);
    }
    if path.starts_with("/api/models/acme/endless-page/tree/") {
        return endless(
            "200 OK",
            b"[",
            br#"{"type": "file", "path": "weights/shard.bin", "size": 1},"#,
        );
    }
    if path.starts_with("/api/models/acme/endless-pages/tree/") {
        // 1000 directory entries a page, each page pointing at the next; the server gives
        // up after 1000 pages (a million entries) with a 404.
        let page: u64 = path
            .split("cursor=")
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        if page >= 1000 {
            return Reply::Whole(support::http_response("404 Not Found", &[], b""));
        }
        let entries: Vec<String> = (0..1000)
            .map(|i| format!(r#"{{"type": "directory", "path": "d/{page}/{i}"}}"#))
            .collect();
        return Reply::Whole(support::http_response(
            "200 OK",
            &[
                ("Content-Type", "application/json".into()),
                (
                    "Link",
                    format!(
                        "</api/models/acme/endless-pages/tree/{COMMIT}?recursive=true&cursor={}>; rel=\"next\"",
                        page + 1
                    ),
                ),
            ],
            format!("[{}]", entries.join(",")).as_bytes(),
        ));
    }
    if path.starts_with("/api/models/acme/endless-error/tree/") {
        return endless("403 Forbidden", b"", b"denied, and on and on ");
    }
    if path.starts_with("/api/models/") && path.contains("/tree/") {
        return json(small_tree.into());
    }
    if path.starts_with("/acme/long-file/resolve/") {
        return endless("200 OK", b"", &[0u8; 64 << 10]);
    }
    Reply::Whole(support::http_response(
        "404 Not Found",
        &[("X-Error-Code", "RepoNotFound".into())],
        b"",
    ))
}

fn opts() -> SyncOptions {
    SyncOptions {
        retries: 3,
        timeout: Duration::from_secs(20),
        policy: SourcePolicy {
            allow_http: true,
            allow_file: true,
            egress: Egress::allowing(&["127.0.0.0/8"]).unwrap(),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn hub_source(endpoint: &str, repo: &str) -> SourceSpec {
    SourceSpec::HuggingFace(HubRepo {
        repo: repo.into(),
        revision: "main".into(),
        repo_type: HubRepoType::Model,
        include: vec![],
        exclude: vec![],
        endpoint: Some(endpoint.into()),
    })
}

/// Syncs `repo` from `hub`, which must fail within 30 s.
async fn failed_sync(hub: &HostileHub, repo: &str) -> (SourceError, Duration) {
    let started = Instant::now();
    let synced = tokio::time::timeout(
        Duration::from_secs(120),
        sync_source(
            &ChunkStore::memory(),
            &hub_source(&hub.url, repo),
            &SourceCredentials::default(),
            &opts(),
            Arc::new(NoReporter),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("{repo}: the sync still runs after 120 s"));
    let err = synced.expect_err(&format!("{repo}: the sync succeeded"));
    (err, started.elapsed())
}

#[tokio::test]
async fn an_endless_listing_page_stops_at_the_page_bound() {
    let hub = HostileHub::start(hostile).await;
    let (err, took) = failed_sync(&hub, "acme/endless-page").await;
    eprintln!(
        "{err} (after {took:?}, server wrote {} bytes)",
        hub.written()
    );
    assert_eq!(err.reason(), "SourceTooLarge", "{err}");
    assert!(
        err.to_string().contains(&MAX_PAGE_BYTES.to_string()),
        "{err}"
    );
    assert!(
        hub.written() <= MAX_PAGE_BYTES + SOCKET_SLACK,
        "the server wrote {} bytes of one listing page",
        hub.written()
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[tokio::test]
async fn endless_listing_pages_stop_at_the_entry_bound() {
    let hub = HostileHub::start(hostile).await;
    let (err, took) = failed_sync(&hub, "acme/endless-pages").await;
    eprintln!("{err} (after {took:?})");
    assert_eq!(err.reason(), "SourceTooLarge", "{err}");
    assert!(
        err.to_string()
            .contains(&format!("more than {MAX_LISTING_ENTRIES} entries")),
        "{err}"
    );
    // 1000 entries a page: the page that passes the bound is the last one requested.
    let pages = hub.requests_to("/tree/");
    let expected = (MAX_LISTING_ENTRIES / 1000 + 1) as usize;
    assert_eq!(pages, expected, "pages requested");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[tokio::test]
async fn an_endless_error_page_is_read_only_for_its_message() {
    let hub = HostileHub::start(hostile).await;
    let (err, took) = failed_sync(&hub, "acme/endless-error").await;
    assert_eq!(err.reason(), "AccessDenied", "{err}");
    assert!(err.to_string().contains("denied, and on and on"), "{err}");
    assert!(
        hub.written() <= SOCKET_SLACK,
        "the server wrote {} bytes of an error page",
        hub.written()
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[tokio::test]
async fn an_endless_revision_answer_is_refused() {
    let hub = HostileHub::start(hostile).await;
    let (err, _) = failed_sync(&hub, "acme/endless-revision").await;
    assert_eq!(err.reason(), "SourceError", "{err}");
    assert!(err.to_string().contains("larger than"), "{err}");
    assert!(hub.written() <= SOCKET_SLACK, "wrote {}", hub.written());
}

#[tokio::test]
async fn a_file_longer_than_its_listing_stops_at_its_size() {
    let hub = HostileHub::start(hostile).await;
    let (err, took) = failed_sync(&hub, "acme/long-file").await;
    eprintln!(
        "{err} (after {took:?}, server wrote {} bytes)",
        hub.written()
    );
    assert_eq!(err.reason(), "SourceError", "{err}");
    assert!(
        err.to_string()
            .contains("sent more than the 5 bytes the listing declared"),
        "{err}"
    );
    assert!(err.to_string().contains("a.txt"), "{err}");
    // Not retried: a server that sends too much is broken, not flaky.
    assert_eq!(hub.requests_to("/resolve/"), 1);
    assert!(
        hub.written() <= SOCKET_SLACK,
        "the server wrote {} bytes of a 5-byte file",
        hub.written()
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[tokio::test]
async fn a_prefix_with_too_many_objects_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..30 {
        fs::write(dir.path().join(format!("f{i:02}")), [i as u8]).unwrap();
    }
    let source = SourceSpec::ObjectStore(BucketPrefix {
        url: format!("file://{}", dir.path().display()),
        endpoint: None,
        region: None,
    });
    let with_limit = |max_entries| SyncOptions {
        limits: SourceLimits {
            max_entries,
            ..Default::default()
        },
        ..opts()
    };
    let sync = |options: SyncOptions| {
        let source = source.clone();
        async move {
            sync_source(
                &ChunkStore::memory(),
                &source,
                &SourceCredentials::default(),
                &options,
                Arc::new(NoReporter),
            )
            .await
        }
    };
    let err = sync(with_limit(20)).await.unwrap_err();
    assert_eq!(err.reason(), "SourceTooLarge", "{err}");
    assert!(err.to_string().contains("more than 20 entries"), "{err}");
    assert!(err.is_permanent());
    // At the bound it syncs.
    let ok = sync(with_limit(30)).await.unwrap();
    assert_eq!(ok.files, 30);
    assert_eq!(SourceLimits::default().max_entries, MAX_LISTING_ENTRIES);
}

/// An S3 source whose endpoint answers the listing with an endless XML page: the client cuts
/// the page off at the store's listing-page cap ([`sealed_store::CappedConnector`]) instead of
/// reading it into memory without end (before, object_store read the whole body itself).
#[tokio::test]
async fn an_endless_bucket_listing_page_is_cut_off() {
    let hub = HostileHub::start(|_path| Reply::Endless {
        head: "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\n\r\n"
            .into(),
        first: br#"<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><IsTruncated>false</IsTruncated>"#.to_vec(),
        unit: b"<Contents><Key>m/x</Key><Size>1</Size><ETag>\"e\"</ETag></Contents>".repeat(1024),
    })
    .await;
    let source = SourceSpec::ObjectStore(BucketPrefix {
        url: "s3://b/m".into(),
        endpoint: Some(hub.url.clone()),
        region: Some("us-east-1".into()),
    });
    let creds = SourceCredentials {
        hf_token: None,
        object_store: [
            ("AWS_ACCESS_KEY_ID".to_owned(), "k".to_owned()),
            ("AWS_SECRET_ACCESS_KEY".to_owned(), "s".to_owned()),
        ]
        .into(),
        docker_config: None,
    };
    // No entry bound gets in first: the page itself must be cut.
    let options = SyncOptions {
        limits: SourceLimits {
            max_entries: u64::MAX,
            max_listing_bytes: u64::MAX,
            ..Default::default()
        },
        ..opts()
    };
    let started = Instant::now();
    let synced = tokio::time::timeout(
        Duration::from_secs(120),
        sync_source(
            &ChunkStore::memory(),
            &source,
            &creds,
            &options,
            Arc::new(NoReporter),
        ),
    )
    .await
    .expect("the sync still runs after 120 s");
    let err = synced.expect_err("the sync succeeded");
    eprintln!("server wrote {} bytes; {err}", hub.written());
    let cap = sealed_store::MAX_LISTING_PAGE_BYTES;
    assert!(
        hub.written() <= cap + SOCKET_SLACK,
        "the server wrote {} bytes ({err})",
        hub.written()
    );
    assert!(
        err.to_string().contains("listing page of /b is over"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
}
