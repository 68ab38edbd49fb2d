//! Servers the source tests run against, on loopback ports: the Hub stand-in
//! (hack/hub-server.py) here; moto's S3 server and Azurite from the store's tests
//! (the sealed-test-support crate). A missing tool skips the test,
//! or fails it under SEALED_REQUIRE_SERVERS=1.
#![allow(dead_code)]

#[allow(unused_imports)]
pub use sealed_test_support::servers::*;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

// Not every test that includes this module uses every re-export.
#[allow(unused_imports)]
pub use sealed_e2e::pseudo_random;

/// hack/hub-server.py serving the repositories under `root` (ROOT/<org>/<name>/), with
/// `page_size` tree entries per page.
pub fn start_hub(root: &Path, page_size: usize) -> Option<Hub> {
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
    Some(Hub { child, port, url })
}

/// A running hack/hub-server.py, killed when dropped.
pub struct Hub {
    child: Child,
    pub port: u16,
    pub url: String,
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
