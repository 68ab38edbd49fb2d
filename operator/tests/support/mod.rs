//! Servers the source tests run against, on loopback ports: the Hub stand-in
//! (hack/hub-server.py) here; moto's S3 server and Azurite from the store's tests
//! (store/tests/support/servers.rs, shared as a source file). A missing tool skips the test,
//! or fails it under SEALED_REQUIRE_SERVERS=1.
#![allow(dead_code)]

#[path = "../../../store/tests/support/servers.rs"]
mod servers;
#[allow(unused_imports)]
pub use servers::*;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

// Not every test that includes this module uses every re-export.
#[allow(unused_imports)]
pub use sealed_e2e::pseudo_random;

/// hack/hub-server.py serving the repositories under `root` (ROOT/<org>/<name>/), with
/// `page_size` tree entries per page.
pub fn start_hub(root: &Path, page_size: usize) -> Option<Server> {
    if missing("python3", "install Python 3") {
        return None;
    }
    let mut child = Command::new("python3")
        .arg(repo_root().join("hack/hub-server.py"))
        .arg("--root")
        .arg(root)
        .args(["--port", "0", "--page-size", &page_size.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().to_owned();
    assert!(url.starts_with("http://"), "hub-server printed {url:?}");
    let port = url.rsplit(':').next().unwrap().parse().unwrap();
    Some(Server {
        child,
        port,
        url,
        _dir: None,
    })
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
