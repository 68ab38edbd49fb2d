//! Re-reading the token and TLS files of a running node (a mounted Secret the operator or an
//! admin rotated): the kubelet swaps a Secret volume's files in place, and a poll of their
//! contents sees it (inotify on the kubelet's symlink swap is fragile). A file that does not
//! parse leaves the node on what it had, with a warning, until a good one comes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::tls::PeerTls;
use crate::token::{self, PeerToken};

/// How often the files are read when no period is given.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(10);

/// The files a node's token and TLS came from.
#[derive(Clone, Debug)]
pub struct PeerFiles {
    pub token: PathBuf,
    /// Certificate, key and CA (PEM), when the node speaks TLS.
    pub tls: Option<(PathBuf, PathBuf, PathBuf)>,
}

impl PeerFiles {
    /// The token file and, when all three are given, the TLS files (`--peer-tls-*`).
    pub fn new(
        token: &Path,
        cert: Option<&Path>,
        key: Option<&Path>,
        ca: Option<&Path>,
    ) -> PeerFiles {
        PeerFiles {
            token: token.to_owned(),
            tls: match (cert, key, ca) {
                (Some(c), Some(k), Some(a)) => Some((c.to_owned(), k.to_owned(), a.to_owned())),
                _ => None,
            },
        }
    }
}

/// Reads `files` every `period` and, when their contents changed, replaces `token` and `tls`
/// (shared with the node's server and client) for new requests and connections.
pub fn spawn(
    files: PeerFiles,
    token: PeerToken,
    tls: Option<PeerTls>,
    period: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut seen = fingerprint(&files);
        let mut tick = tokio::time::interval(period);
        tick.tick().await;
        loop {
            tick.tick().await;
            let now = fingerprint(&files);
            if now == seen {
                continue;
            }
            // Once per new content, whatever the outcome: a bad file is reported once, and
            // read again when it changes.
            seen = now;
            match apply(&files, &token, tls.as_ref()) {
                Ok(()) => tracing::info!(token = %files.token.display(),
                    "peer token and TLS files changed: using them for new connections"),
                Err(e) => tracing::warn!(error = %e,
                    "peer token or TLS files changed but are unusable: keeping the previous ones"),
            }
        }
    })
}

fn apply(files: &PeerFiles, token: &PeerToken, tls: Option<&PeerTls>) -> Result<(), String> {
    let text = token::read_file(&files.token).map_err(|e| e.to_string())?;
    if let (Some((cert, key, ca)), Some(tls)) = (&files.tls, tls) {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        tls.replace_pem(&read(cert)?, &read(key)?, &read(ca)?)
            .map_err(|e| e.to_string())?;
    }
    token.replace(&text).map_err(|e| e.to_string())?;
    Ok(())
}

/// A hash of every file's content (a missing file counts as empty: the kubelet's swap).
fn fingerprint(files: &PeerFiles) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    let mut add = |p: &PathBuf| {
        let bytes = std::fs::read(p).unwrap_or_default();
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    };
    add(&files.token);
    if let Some((cert, key, ca)) = &files.tls {
        add(cert);
        add(key);
        add(ca);
    }
    h.finalize()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::pki_types::ServerName;

    use super::*;
    use crate::tls::DEFAULT_NAME;
    use crate::tls::tests::{ca, leaf};

    /// Whether `server` accepts a handshake from `client` (both ways: TLS 1.3 reports a
    /// refused client certificate on the server's side).
    async fn handshake(client: &PeerTls, server: &PeerTls) -> bool {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = server.acceptor();
        let accepted = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            acceptor.accept(tcp).await.is_ok()
        });
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client.client_config()));
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from(DEFAULT_NAME).unwrap();
        let connected = connector.connect(name, tcp).await.is_ok();
        connected && accepted.await.unwrap()
    }

    #[tokio::test]
    async fn a_rotated_token_and_certificate_are_used_without_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (old_ca, new_ca) = (ca(), ca());
        let files = PeerFiles::new(
            &dir.path().join("token"),
            Some(&dir.path().join("tls.crt")),
            Some(&dir.path().join("tls.key")),
            Some(&dir.path().join("ca.crt")),
        );
        let (token_path, (cert_path, key_path, ca_path)) =
            (files.token.clone(), files.tls.clone().unwrap());
        let write = |ca: &crate::tls::tests::Ca, token: &str| {
            let (cert, key) = leaf(ca, DEFAULT_NAME);
            std::fs::write(&cert_path, cert).unwrap();
            std::fs::write(&key_path, key).unwrap();
            std::fs::write(&ca_path, &ca.pem).unwrap();
            std::fs::write(&token_path, token).unwrap();
        };
        write(&old_ca, "the-old-fleet-token-0123456789");
        let token = PeerToken::from_file(&files.token).unwrap();
        let (c, k, a) = files.tls.clone().unwrap();
        let node = PeerTls::from_files(&c, &k, &a, DEFAULT_NAME).unwrap();
        // A node already on the new CA: refused, both ways.
        let (cert, key) = leaf(&new_ca, DEFAULT_NAME);
        let renewed = PeerTls::from_pem(
            cert.as_bytes(),
            key.as_bytes(),
            new_ca.pem.as_bytes(),
            DEFAULT_NAME,
        )
        .unwrap();
        assert!(!handshake(&renewed, &node).await);
        assert!(!handshake(&node, &renewed).await);

        let task = spawn(
            files.clone(),
            token.clone(),
            Some(node.clone()),
            Duration::from_millis(50),
        );
        // A file that does not parse is not taken: the node keeps talking to its old fleet.
        std::fs::write(&ca_path, "not a certificate").unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (cert, key) = leaf(&old_ca, DEFAULT_NAME);
        let old_peer = PeerTls::from_pem(
            cert.as_bytes(),
            key.as_bytes(),
            old_ca.pem.as_bytes(),
            DEFAULT_NAME,
        )
        .unwrap();
        assert!(handshake(&old_peer, &node).await);

        write(&new_ca, "the-new-fleet-token-0123456789");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !handshake(&renewed, &node).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the rotated certificate was not used within 5 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(handshake(&node, &renewed).await, "as a client too");
        assert!(
            !handshake(&old_peer, &node).await,
            "the old CA is no longer trusted"
        );
        assert!(token.admits(Some("Bearer the-new-fleet-token-0123456789")));
        assert!(!token.admits(Some("Bearer the-old-fleet-token-0123456789")));
        task.abort();
    }
}
