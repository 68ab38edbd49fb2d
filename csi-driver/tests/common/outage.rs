//! A store that can go down: moto's S3 server (PyPI) behind a TCP proxy the test switches
//! off. Switched off, the proxy keeps accepting connections and keeps the open ones, but
//! never answers again: a store that hangs, the worst kind of down.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// moto's S3 server on a loopback port, with one bucket. Killed when dropped.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn have(binary: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {binary}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `None` (the test skips) when moto is not installed, unless SEALED_REQUIRE_SERVERS=1.
pub fn start_moto(bucket: &str) -> Option<Moto> {
    if !have("moto_server") {
        assert!(
            std::env::var("SEALED_REQUIRE_SERVERS").map_or(true, |v| v != "1"),
            "moto_server not installed (pip install 'moto[server]')"
        );
        eprintln!("SKIPPED: moto_server not installed (pip install 'moto[server]')");
        return None;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start moto_server");
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("moto_server exited early: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "moto_server did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let moto = Moto { child, port };
    // moto does not check signatures, so plain PUTs create the bucket and its objects.
    moto.curl_put(&format!("/{bucket}"), None);
    Some(moto)
}

impl Moto {
    fn curl_put(&self, path: &str, file: Option<&Path>) {
        let mut cmd = Command::new("curl");
        cmd.args(["-sf", "--max-time", "30", "-X", "PUT"]);
        if let Some(file) = file {
            // Not curl's default form type, which moto would try to parse.
            cmd.args(["-H", "Content-Type: application/octet-stream"]);
            cmd.arg("--data-binary").arg(format!("@{}", file.display()));
        }
        let status = cmd
            .arg(format!("http://127.0.0.1:{}{path}", self.port))
            .status()
            .expect("curl");
        assert!(status.success(), "PUT {path} failed");
    }

    /// Copies every object of the file:// store at `dir` into `bucket`, under the same keys.
    pub fn upload_file_store(&self, dir: &Path, bucket: &str) {
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let key = path.strip_prefix(dir).unwrap().display().to_string();
                self.curl_put(&format!("/{bucket}/{key}"), Some(&path));
            }
        }
    }
}

/// A TCP proxy in front of a server, switched on and off by the test.
pub struct StoreProxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    /// Every client connection, so that switching off can keep them open, unanswered.
    clients: Arc<Mutex<Vec<TcpStream>>>,
    /// The proxy's connections to the server, cut when it is switched off.
    upstreams: Arc<Mutex<Vec<TcpStream>>>,
}

impl StoreProxy {
    pub fn start(upstream_port: u16) -> StoreProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let proxy = StoreProxy {
            port,
            up: Arc::new(AtomicBool::new(true)),
            clients: Arc::default(),
            upstreams: Arc::default(),
        };
        let (up, clients, upstreams) = (
            proxy.up.clone(),
            proxy.clients.clone(),
            proxy.upstreams.clone(),
        );
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if let Ok(kept) = client.try_clone() {
                    clients.lock().unwrap().push(kept);
                }
                if !up.load(Ordering::SeqCst) {
                    continue; // kept open above, never answered
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)) else {
                    continue;
                };
                if let Ok(kept) = server.try_clone() {
                    upstreams.lock().unwrap().push(kept);
                }
                pipe(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    None,
                );
                pipe(server, client, Some(up.clone()));
            }
        });
        proxy
    }

    /// `http://127.0.0.1:PORT`, for `--store-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// From now on nothing is answered, on new connections or on open ones.
    pub fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        for server in self.upstreams.lock().unwrap().drain(..) {
            let _ = server.shutdown(Shutdown::Both);
        }
    }

    /// New connections reach the server again (open ones stay unanswered).
    pub fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either side ends, then passes the end on; towards the client
/// (`up` given) only while the proxy is on: switched off, the client sees neither bytes nor
/// an end (the proxy keeps a copy of every client socket open).
fn pipe(mut from: TcpStream, mut to: TcpStream, up: Option<Arc<AtomicBool>>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if up.as_ref().is_some_and(|u| !u.load(Ordering::SeqCst))
                        || to.write_all(&buf[..n]).is_err()
                    {
                        break;
                    }
                }
            }
        }
        if up.is_none_or(|u| u.load(Ordering::SeqCst)) {
            let _ = to.shutdown(Shutdown::Write);
        }
    });
}
