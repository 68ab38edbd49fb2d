//! A tiny S3-compatible HTTP server on loopback, for the store faults that need a real TCP
//! peer: it serves objects from memory (path-style `GET /<bucket>/<key>`, an empty listing
//! for the store's probe), and chunk GETs can be held forever (a blackhole: the request is
//! read, never answered) or answered after a delay while the requests in flight are counted.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use sealed_store::{ChunkStore, Digest, StoreOptions};

pub const BUCKET: &str = "models";

#[derive(Default)]
struct State {
    objects: Mutex<HashMap<String, Bytes>>,
    blackhole_chunks: AtomicBool,
    chunk_delay_ms: AtomicU64,
    chunk_requests: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    stop: AtomicBool,
}

pub struct MiniS3 {
    pub port: u16,
    state: Arc<State>,
}

impl MiniS3 {
    pub fn start() -> MiniS3 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State::default());
        let s = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        MiniS3 { port, state }
    }

    pub fn put(&self, key: &str, data: impl Into<Bytes>) {
        self.state
            .objects
            .lock()
            .insert(key.to_owned(), data.into());
    }

    pub fn put_chunk(&self, data: &[u8]) -> Digest {
        let digest = Digest::of(data);
        self.put(
            ChunkStore::chunk_key(&digest).as_ref(),
            Bytes::copy_from_slice(data),
        );
        digest
    }

    /// Stores an encoded manifest; returns its digest.
    pub fn put_manifest(&self, encoded: Vec<u8>) -> Digest {
        let digest = Digest::of(&encoded);
        self.put(ChunkStore::manifest_key(&digest).as_ref(), encoded);
        digest
    }

    /// Chunk GETs are read and never answered (the connection stays open).
    pub fn blackhole_chunks(&self, on: bool) {
        self.state.blackhole_chunks.store(on, Ordering::SeqCst);
    }

    pub fn delay_chunks(&self, delay: Duration) {
        self.state
            .chunk_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn chunk_requests(&self) -> u64 {
        self.state.chunk_requests.load(Ordering::SeqCst)
    }

    /// The most chunk GETs this server had under way at once.
    pub fn max_in_flight(&self) -> u64 {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// A store client of the kind the node plugin builds (`s3://` with a custom endpoint),
    /// whose own per-request timeout and retries are `timeout` and `retries`.
    pub async fn store(&self, timeout: Duration, retries: usize) -> ChunkStore {
        set_test_credentials();
        let opts = StoreOptions {
            endpoint: Some(format!("http://127.0.0.1:{}", self.port)),
            region: Some("us-east-1".into()),
            timeout,
            retries,
            ..Default::default()
        };
        ChunkStore::open(&format!("s3://{BUCKET}"), &opts)
            .await
            .unwrap()
    }
}

impl Drop for MiniS3 {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn set_test_credentials() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: set once, before the first store of this test binary reads the environment;
    // every test sets the same values.
    ONCE.call_once(|| unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
    });
}

/// One connection: HTTP/1.1 requests one after another (the client keeps connections).
fn serve(conn: TcpStream, state: &State) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        // Headers until the blank line (GETs and HEADs carry no body).
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" || line == "\n" {
                break;
            }
        }
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or("").to_owned();
        let target = parts.next().unwrap_or("").to_owned();
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let key = path
            .trim_start_matches('/')
            .strip_prefix(BUCKET)
            .unwrap_or("")
            .trim_start_matches('/')
            .to_owned();
        let is_chunk = key.starts_with("chunks/");
        if is_chunk {
            state.chunk_requests.fetch_add(1, Ordering::SeqCst);
            if state.blackhole_chunks.load(Ordering::SeqCst) {
                // Never answer; hold the connection until the client gives up on it.
                let mut sink = Vec::new();
                let _ = std::io::Read::read_to_end(&mut reader, &mut sink);
                return;
            }
            let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            state.max_in_flight.fetch_max(now, Ordering::SeqCst);
            let delay = state.chunk_delay_ms.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(delay));
        }
        let response = if key.is_empty() || query.contains("list-type") {
            let body = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>{BUCKET}\
                 </Name><Prefix></Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>\
                 <IsTruncated>false</IsTruncated></ListBucketResult>"
            );
            reply(200, "application/xml", body.as_bytes(), method == "HEAD")
        } else {
            let object = state.objects.lock().get(&key).cloned();
            match object {
                Some(data) => reply(200, "application/octet-stream", &data, method == "HEAD"),
                None => reply(
                    404,
                    "application/xml",
                    b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>NoSuchKey</Code>\
                      <Message>not found</Message></Error>",
                    method == "HEAD",
                ),
            }
        };
        let sent = conn.write_all(&response);
        if is_chunk {
            state.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        if sent.is_err() {
            return;
        }
    }
}

fn reply(status: u16, content_type: &str, body: &[u8], head: bool) -> Vec<u8> {
    let reason = if status == 200 { "OK" } else { "Not Found" };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         ETag: \"0123456789abcdef\"\r\nLast-Modified: Tue, 01 Dec 2026 00:00:00 GMT\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head {
        out.extend_from_slice(body);
    }
    out
}
