//! Hand-made HTTP/1.1 servers for tests: whole responses, request heads, and a loopback
//! [`Recorder`] that keeps what it was sent (an attacker's endpoint, a hostile stand-in).

use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;

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
