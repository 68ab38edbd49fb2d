//! Test fixtures of the source tests that the operator's sync Job test (operator/tests/
//! sync_job.rs) uses too, shared as a source file: a model-shaped tree and its `sealed push`
//! digest, and loopback HTTP servers that record what reaches them.
#![allow(dead_code)]

use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};

use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress};
use tokio::io::AsyncWriteExt;

use crate::support::pseudo_random;

/// A model-shaped tree: nested directories, an empty file, a file over 8 MiB, one shorter than
/// the minimum chunk, JSON. (Sources carry no empty directories, symlinks or modes.)
pub fn model_tree(root: &Path) {
    fs::create_dir_all(root.join("weights")).unwrap();
    fs::create_dir_all(root.join("sub/dir")).unwrap();
    fs::write(root.join("config.json"), b"{\"hidden\": 4096}\n").unwrap();
    fs::write(root.join("tokenizer.json"), pseudo_random(300 << 10, 3)).unwrap();
    fs::write(root.join("empty.txt"), b"").unwrap();
    fs::write(root.join("tiny.bin"), pseudo_random(1000, 4)).unwrap();
    fs::write(
        root.join("weights/model-00001.safetensors"),
        pseudo_random(9 << 20, 1),
    )
    .unwrap();
    fs::write(
        root.join("weights/model-00002.safetensors"),
        pseudo_random(2 << 20, 2),
    )
    .unwrap();
    fs::write(root.join("sub/dir/deep.txt"), b"deep\n").unwrap();
}

pub async fn push_digest(dir: &Path) -> Digest {
    push(
        &ChunkStore::memory(),
        dir,
        &PushOptions::default(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap()
    .digest
}

/// A whole HTTP/1.1 response with a Content-Length, for the hand-made servers of the tests.
pub fn http_response(status: &str, headers: &[(&str, String)], body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

/// Reads an HTTP/1.1 request up to the end of its head; `None` if the client hung up first.
pub async fn read_request_head(conn: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt as _;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// A loopback HTTP server that records the head (request line and headers) of every request
/// and answers with `respond(head)`: an attacker's endpoint, or a Hub stand-in.
pub struct Recorder {
    pub url: String,
    requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    pub async fn start(respond: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let respond = Arc::new(respond);
        let seen = requests.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (seen, respond) = (seen.clone(), respond.clone());
                tokio::spawn(async move {
                    let Some(head) = read_request_head(&mut conn).await else {
                        return;
                    };
                    seen.lock().unwrap().push(head.clone());
                    let _ = conn.write_all(&respond(&head)).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        Recorder {
            url,
            requests,
            task,
        }
    }

    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    /// Requests that carried any credential: an Authorization header, an AWS or Azure
    /// signature or token header, or a signed query.
    pub fn with_credentials(&self) -> Vec<String> {
        self.requests()
            .into_iter()
            .filter(|h| {
                let h = h.to_ascii_lowercase();
                [
                    "authorization:",
                    "x-amz-security-token:",
                    "x-ms-",
                    "x-amz-signature",
                    "sig=",
                ]
                .iter()
                .any(|w| h.contains(w))
            })
            .collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An attacker's endpoint: answers everything with 200 "hello" (a 5-byte file, an S3 error).
pub async fn attacker() -> Recorder {
    Recorder::start(|_| http_response("200 OK", &[], b"hello")).await
}
