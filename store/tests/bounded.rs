//! Remote input is bounded: a hostile S3 endpoint (a real TCP server speaking just enough
//! HTTP/1.1) answers with bodies far larger than anything it may legitimately send, and the
//! store stops reading at the cap with a clear error. Each test counts the bytes the server
//! managed to write: no more than the cap plus what the sockets' buffers hold.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sealed_store::{ChunkRef, ChunkStore, Digest, Error, StoreOptions};

const MIB: u64 = 1024 * 1024;
/// What the kernel may buffer between the server's writes and the client's reads once the
/// client stops (loopback receive buffers autotune up to 32 MiB here, sends to 4 MiB).
const SLACK: u64 = 40 * MIB;
const PIECE: usize = 64 * 1024;

/// How the hostile server answers one request.
enum Reply {
    /// 200 with this XML body.
    Xml(String),
    /// `status` with `Content-Length: declared` (or chunked when `None`), then filler
    /// (`prefix` first) until `send` bytes are written or the client goes away.
    Huge {
        status: u16,
        declared: Option<u64>,
        prefix: String,
        filler: Vec<u8>,
        send: u64,
    },
}

struct HostileS3 {
    port: u16,
    written: Arc<AtomicU64>,
}

impl HostileS3 {
    fn start(answer: impl Fn(&str, &str) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let written = Arc::new(AtomicU64::new(0));
        let answer = Arc::new(answer);
        let counter = written.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let (answer, counter) = (answer.clone(), counter.clone());
                std::thread::spawn(move || serve(conn, &*answer, &counter));
            }
        });
        HostileS3 { port, written }
    }

    fn written(&self) -> u64 {
        self.written.load(Ordering::SeqCst)
    }

    async fn store(&self) -> ChunkStore {
        // SAFETY: set before any store reads the environment; every test sets the same values
        // (the ones store/tests/support sets).
        unsafe {
            std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
            std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
        }
        let opts = StoreOptions {
            endpoint: Some(format!("http://127.0.0.1:{}", self.port)),
            region: Some("us-east-1".into()),
            timeout: Duration::from_secs(20),
            retries: 0,
            ..Default::default()
        };
        ChunkStore::open("s3://bucket", &opts).await.unwrap()
    }
}

/// One request per connection: read the head, answer, close.
fn serve(conn: TcpStream, answer: &dyn Fn(&str, &str) -> Reply, written: &AtomicU64) {
    conn.set_write_timeout(Some(Duration::from_secs(20))).ok();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut header = String::new();
        match reader.read_line(&mut header) {
            Ok(0) | Err(_) => return,
            Ok(_) if header == "\r\n" => break,
            Ok(_) => {}
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let mut conn = conn;
    let common = "Connection: close\r\nLast-Modified: Tue, 01 Dec 2026 10:00:00 GMT\r\n\
                  ETag: \"e\"\r\nContent-Type: application/xml\r\n";
    match answer(method, target) {
        Reply::Xml(body) => {
            let head = format!(
                "HTTP/1.1 200 OK\r\n{common}Content-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(body.as_bytes());
        }
        Reply::Huge {
            status,
            declared,
            prefix,
            filler,
            send,
        } => {
            let length = match declared {
                Some(n) => format!("Content-Length: {n}\r\n"),
                None => "Transfer-Encoding: chunked\r\n".into(),
            };
            let head = format!("HTTP/1.1 {status} Hostile\r\n{common}{length}\r\n");
            if conn.write_all(head.as_bytes()).is_err() {
                return;
            }
            let mut piece = prefix.into_bytes();
            while piece.len() < PIECE {
                piece.extend_from_slice(&filler);
            }
            let mut sent: u64 = 0;
            while sent < send {
                let take = piece
                    .len()
                    .min(usize::try_from(send - sent).unwrap_or(usize::MAX));
                let data = &piece[..take];
                let framed = match declared {
                    Some(_) => data.to_vec(),
                    None => {
                        let mut f = format!("{take:x}\r\n").into_bytes();
                        f.extend_from_slice(data);
                        f.extend_from_slice(b"\r\n");
                        f
                    }
                };
                if conn.write_all(&framed).is_err() {
                    return;
                }
                sent += take as u64;
                written.fetch_add(take as u64, Ordering::SeqCst);
                piece = filler.repeat(PIECE / filler.len().max(1) + 1);
            }
            if declared.is_none() {
                let _ = conn.write_all(b"0\r\n\r\n");
            }
        }
    }
}

const EMPTY_LISTING: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name><Prefix>manifests/</Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated></ListBucketResult>"#;

/// The answer to the store's first listing (`open` probes with a delimited listing).
fn probe(target: &str) -> Option<Reply> {
    target
        .contains("delimiter=")
        .then(|| Reply::Xml(EMPTY_LISTING.into()))
}

/// An object body of `declared` bytes, of which the server sends up to `send`.
fn object(declared: u64, send: u64) -> Reply {
    Reply::Huge {
        status: 200,
        declared: Some(declared),
        prefix: String::new(),
        filler: vec![b'x'; 4096],
        send,
    }
}

/// An error's message, shortened (an error body may be in it).
fn short(err: &Error) -> String {
    err.to_string().chars().take(300).collect()
}

fn some_digest() -> Digest {
    Digest::of(b"a chunk the hostile store claims to have")
}

#[tokio::test]
async fn a_chunk_far_above_the_largest_chunk_is_refused_before_it_is_read() {
    let server =
        HostileS3::start(|_, target| probe(target).unwrap_or(object(128 * MIB, 128 * MIB)));
    let store = server.store().await;
    let err = store.get_chunk(&some_digest()).await.unwrap_err();
    let written = server.written();
    assert!(
        written <= sealed_store::bounded::MAX_CHUNK_BYTES + SLACK,
        "the client read on: the server wrote {written} bytes ({})",
        short(&err)
    );
    match &err {
        Error::ResponseTooLarge { what, limit, .. } => {
            assert!(what.contains("chunk"), "{err}");
            assert_eq!(*limit, sealed_store::bounded::MAX_CHUNK_BYTES);
        }
        other => panic!("expected ResponseTooLarge, got {other:?}"),
    }
}

#[tokio::test]
async fn a_chunk_longer_than_its_manifest_declares_is_not_read_past_the_declared_length() {
    let server = HostileS3::start(|_, target| probe(target).unwrap_or(object(3 * MIB, 3 * MIB)));
    let store = server.store().await;
    let chunk = ChunkRef {
        digest: some_digest(),
        len: 1000,
    };
    let err = store.get_chunk_checked(&chunk).await.unwrap_err();
    match &err {
        Error::ChunkLengthMismatch {
            declared, actual, ..
        } => {
            assert_eq!(*declared, 1000);
            assert_eq!(*actual, 3 * MIB, "the length the store declared");
        }
        other => panic!("expected ChunkLengthMismatch, got {other:?}"),
    }
}

#[tokio::test]
async fn a_manifest_over_a_gibibyte_is_refused_before_it_is_read() {
    let server =
        HostileS3::start(|_, target| probe(target).unwrap_or(object(2048 * MIB, 128 * MIB)));
    let store = server.store().await;
    let err = store.get_manifest_bytes(&some_digest()).await.unwrap_err();
    let written = server.written();
    assert!(
        written <= SLACK,
        "the client read on: the server wrote {written} bytes ({})",
        short(&err)
    );
    assert!(
        matches!(err, Error::ResponseTooLarge { limit, .. } if limit == 1 << 30),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_gc_marker_is_read_as_the_small_record_it_is() {
    let server =
        HostileS3::start(|_, target| probe(target).unwrap_or(object(128 * MIB, 128 * MIB)));
    let store = server.store().await;
    let got = sealed_store::gc_marker::read_gc_marker(&store).await;
    let written = server.written();
    assert!(
        written <= sealed_store::bounded::MAX_RECORD_BYTES + SLACK,
        "the client read on: the server wrote {written} bytes ({:?})",
        got.as_ref().map(|m| m.as_ref().map(|m| m.host.clone()))
    );
    let err = got.unwrap_err();
    assert!(
        matches!(&err, Error::ResponseTooLarge { what, .. } if what.contains("gc/running")),
        "{err:?}"
    );
}

#[tokio::test]
async fn an_endless_error_body_is_cut_off() {
    let server = HostileS3::start(|_, target| {
        probe(target).unwrap_or(Reply::Huge {
            status: 403,
            declared: None,
            prefix: "<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code><Message>".into(),
            filler: b"no ".to_vec(),
            send: 128 * MIB,
        })
    });
    let store = server.store().await;
    let err = store.get_chunk(&some_digest()).await.unwrap_err();
    let written = server.written();
    assert!(
        written <= MIB + SLACK,
        "the client read on: the server wrote {written} bytes ({})",
        short(&err)
    );
    assert!(
        matches!(&err, Error::ResponseTooLarge { what, limit, .. }
            if what.contains("error body") && *limit == 1024 * 1024),
        "{}",
        err.to_string().chars().take(300).collect::<String>()
    );
}

#[tokio::test]
async fn an_endless_listing_page_is_cut_off() {
    let server = HostileS3::start(|_, target| {
        probe(target).unwrap_or(Reply::Huge {
            status: 200,
            declared: None,
            prefix: "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult \
                     xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>bucket</Name>\
                     <IsTruncated>false</IsTruncated>"
                .into(),
            filler: format!(
                "<Contents><Key>manifests/{}</Key><LastModified>2026-12-01T10:00:00.000Z\
                 </LastModified><Size>1</Size></Contents>",
                some_digest().hex()
            )
            .into_bytes(),
            send: 256 * MIB,
        })
    });
    let store = server.store().await;
    let err = store.list_versions().await.unwrap_err();
    let written = server.written();
    assert!(
        written <= 64 * MIB + SLACK,
        "the client read on: the server wrote {written} bytes ({})",
        short(&err)
    );
    assert!(
        matches!(&err, Error::ResponseTooLarge { what, limit, .. }
            if what.contains("listing page") && *limit == 64 * MIB),
        "{err:?}"
    );
}

#[tokio::test]
async fn bad_store_options_are_refused_when_the_store_is_opened() {
    for opts in [
        StoreOptions {
            timeout: Duration::MAX,
            ..Default::default()
        },
        StoreOptions {
            timeout: Duration::ZERO,
            ..Default::default()
        },
        StoreOptions {
            retries: usize::MAX,
            ..Default::default()
        },
    ] {
        // Before validation at connect, these overflowed the retry timeout (a panic) or made
        // a store whose every request times out.
        let opened = tokio::spawn(async move { ChunkStore::open("s3://bucket", &opts).await })
            .await
            .expect("opening must not panic");
        let err = opened.unwrap_err();
        assert!(matches!(err, Error::OutOfRange { .. }), "{err:?}");
    }
    // What the workspace's tests use is accepted: millisecond timeouts, no retries.
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        timeout: Duration::from_millis(300),
        retries: 0,
        ..Default::default()
    };
    ChunkStore::open(&format!("file://{}", dir.path().display()), &opts)
        .await
        .unwrap();
}
