//! A store that can go down: moto's S3 server (PyPI, started by the store's shared
//! `servers::start_moto`) behind a TCP proxy the test switches off. Switched off, the proxy keeps accepting connections and keeps the open ones, but
//! never answers again: a store that hangs, the worst kind of down.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
