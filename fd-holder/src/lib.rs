//! The FUSE fd holder: a tiny process that keeps a duplicate of every mount's /dev/fuse fd so
//! that the kernel keeps the mounts alive while the node plugin restarts or is upgraded.
//!
//! The plugin puts each mount's fd here as it mounts, takes a duplicate back when it starts
//! again (and resumes serving the mount, `sealed_mount::MountHandle::resume`), and drops it
//! when it unmounts. The holder runs as its own DaemonSet that upgrades only when deleted by
//! hand, so a plugin upgrade never takes it down; it holds fds and nothing else (no store
//! access, no API access, no privileges).
//!
//! Protocol: a unix SOCK_SEQPACKET socket (one message per request, no framing), one JSON
//! request per connection and one JSON answer, a descriptor riding along as SCM_RIGHTS with
//! `put` requests and `get` answers. Only root can connect (socket mode 0600).

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, accept, bind, connect, listen, recvmsg, sendmsg, setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;
use serde::{Deserialize, Serialize};

/// Largest request or answer: a `list` of about a thousand mounts.
const MAX_MESSAGE: usize = 256 * 1024;
/// A client that says nothing for this long is dropped, so it cannot stall the holder.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum HolderError {
    #[error("fd holder {socket}: {what}: {source}")]
    Io {
        socket: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("fd holder {socket}: {message}")]
    Refused { socket: PathBuf, message: String },
}

/// One mount whose fd the holder keeps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldMount {
    /// The FUSE mount point (the plugin's `<state-dir>/mounts/<hex>`).
    pub key: String,
    /// The version mounted there (`blake3:<hex>`).
    pub digest: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Request {
    Put { key: String, digest: String },
    Get { key: String },
    Drop { key: String },
    List,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Answer {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    digest: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    entries: Vec<HeldMount>,
}

fn seqpacket() -> nix::Result<OwnedFd> {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
}

fn send(fd: BorrowedFd<'_>, body: &[u8], attach: Option<BorrowedFd<'_>>) -> nix::Result<()> {
    let iov = [IoSlice::new(body)];
    let fds: Vec<RawFd> = attach.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsgs };
    sendmsg::<UnixAddr>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// One message and the descriptor that came with it, if any. An empty message is EOF.
fn receive(fd: BorrowedFd<'_>) -> nix::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let (len, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<UnixAddr>(
            fd.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                fds.extend(received);
            }
        }
        (msg.bytes, fds)
    };
    // SAFETY: SCM_RIGHTS installed these descriptors in this process for us alone.
    let mut owned: Vec<OwnedFd> = fds
        .into_iter()
        .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) })
        .collect();
    buf.truncate(len);
    // More than one descriptor is a confused client: keep the first, close the rest.
    let first = if owned.is_empty() {
        None
    } else {
        Some(owned.swap_remove(0))
    };
    Ok((buf, first))
}

/// Talks to the holder at `socket`; every call is one short connection.
#[derive(Clone, Debug)]
pub struct HolderClient {
    socket: PathBuf,
}

impl HolderClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        HolderClient {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Hands the holder a duplicate of `fuse`, the FUSE fd of the mount at `key`.
    pub fn put(&self, key: &str, digest: &str, fuse: BorrowedFd<'_>) -> Result<(), HolderError> {
        let request = Request::Put {
            key: key.into(),
            digest: digest.into(),
        };
        self.call(&request, Some(fuse)).map(|_| ())
    }

    /// A duplicate of the fd held for `key` (the holder keeps its own), or None.
    pub fn get(&self, key: &str) -> Result<Option<(String, OwnedFd)>, HolderError> {
        let (answer, fd) = match self.call(&Request::Get { key: key.into() }, None) {
            Ok(r) => r,
            Err(HolderError::Refused { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        match (answer.digest, fd) {
            (Some(digest), Some(fd)) => Ok(Some((digest, fd))),
            _ => Err(self.refused("a `get` answer without its digest or descriptor")),
        }
    }

    /// Closes the holder's fd for `key` (the mount is gone). Unknown keys are fine.
    pub fn drop_fd(&self, key: &str) -> Result<(), HolderError> {
        self.call(&Request::Drop { key: key.into() }, None)
            .map(|_| ())
    }

    pub fn list(&self) -> Result<Vec<HeldMount>, HolderError> {
        self.call(&Request::List, None).map(|(a, _)| a.entries)
    }

    fn refused(&self, message: impl Into<String>) -> HolderError {
        HolderError::Refused {
            socket: self.socket.clone(),
            message: message.into(),
        }
    }

    fn call(
        &self,
        request: &Request,
        attach: Option<BorrowedFd<'_>>,
    ) -> Result<(Answer, Option<OwnedFd>), HolderError> {
        let io = |what: &'static str| {
            let socket = self.socket.clone();
            move |e: nix::Error| HolderError::Io {
                socket,
                what,
                source: std::io::Error::from(e),
            }
        };
        let fd = seqpacket().map_err(io("creating a socket"))?;
        let timeout = TimeVal::new(IO_TIMEOUT.as_secs() as i64, 0);
        setsockopt(&fd, sockopt::ReceiveTimeout, &timeout).map_err(io("setting a timeout"))?;
        setsockopt(&fd, sockopt::SendTimeout, &timeout).map_err(io("setting a timeout"))?;
        let addr = UnixAddr::new(&self.socket).map_err(io("socket path"))?;
        connect(fd.as_raw_fd(), &addr).map_err(io("connecting"))?;
        let body = serde_json::to_vec(request).map_err(|e| self.refused(e.to_string()))?;
        send(fd.as_fd(), &body, attach).map_err(io("sending"))?;
        let (bytes, received) = receive(fd.as_fd()).map_err(io("receiving"))?;
        let answer: Answer = serde_json::from_slice(&bytes)
            .map_err(|e| self.refused(format!("unreadable answer: {e}")))?;
        if !answer.ok {
            return Err(self.refused(answer.error.unwrap_or_else(|| "refused".into())));
        }
        Ok((answer, received))
    }
}

/// The holder's side: the fds it keeps, by mount point.
#[derive(Default)]
pub struct Holder {
    held: BTreeMap<String, (String, OwnedFd)>,
}

impl Holder {
    fn answer(&mut self, body: &[u8], fd: Option<OwnedFd>) -> (Answer, Option<OwnedFd>) {
        let fail = |error: String| Answer {
            error: Some(error),
            ..Answer::default()
        };
        let request: Request = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return (fail(format!("bad request: {e}")), None),
        };
        let ok = Answer {
            ok: true,
            ..Answer::default()
        };
        match request {
            Request::Put { key, digest } => {
                let Some(fd) = fd else {
                    return (fail("`put` needs a descriptor".into()), None);
                };
                tracing::info!(%key, %digest, "holding a FUSE fd");
                self.held.insert(key, (digest, fd));
                (ok, None)
            }
            Request::Get { key } => match self.held.get(&key) {
                Some((digest, fd)) => match fd.try_clone() {
                    Ok(dup) => {
                        tracing::info!(%key, %digest, "handing a FUSE fd back");
                        let answer = Answer {
                            digest: Some(digest.clone()),
                            ..ok
                        };
                        (answer, Some(dup))
                    }
                    Err(e) => (fail(format!("duplicating the fd of {key}: {e}")), None),
                },
                None => (fail(format!("no fd held for {key}")), None),
            },
            Request::Drop { key } => {
                if self.held.remove(&key).is_some() {
                    tracing::info!(%key, "released a FUSE fd");
                }
                (ok, None)
            }
            Request::List => {
                let entries = self
                    .held
                    .iter()
                    .map(|(key, (digest, _))| HeldMount {
                        key: key.clone(),
                        digest: digest.clone(),
                    })
                    .collect();
                (Answer { entries, ..ok }, None)
            }
        }
    }

    /// Serves one connection: one request, one answer.
    fn serve_connection(&mut self, conn: OwnedFd) -> nix::Result<()> {
        let timeout = TimeVal::new(IO_TIMEOUT.as_secs() as i64, 0);
        setsockopt(&conn, sockopt::ReceiveTimeout, &timeout)?;
        setsockopt(&conn, sockopt::SendTimeout, &timeout)?;
        let (body, fd) = receive(conn.as_fd())?;
        if body.is_empty() {
            return Ok(());
        }
        let (answer, dup) = self.answer(&body, fd);
        let bytes = serde_json::to_vec(&answer).unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
        send(conn.as_fd(), &bytes, dup.as_ref().map(|d| d.as_fd()))
    }

    /// Accepts connections on `listener` for ever, one at a time (each is one short request).
    pub fn serve(&mut self, listener: OwnedFd) -> nix::Result<()> {
        loop {
            let raw = match accept(listener.as_raw_fd()) {
                Ok(raw) => raw,
                Err(nix::Error::EINTR | nix::Error::ECONNABORTED) => continue,
                Err(e) => return Err(e),
            };
            // SAFETY: accept returned a fresh descriptor nothing else owns.
            let conn = unsafe { OwnedFd::from_raw_fd(raw) };
            if let Err(e) = self.serve_connection(conn) {
                tracing::warn!(error = %e, "fd holder connection failed");
            }
        }
    }
}

/// Binds the holder's socket at `path` (replacing a stale one), readable by root only.
pub fn listen_at(path: &Path) -> Result<OwnedFd, HolderError> {
    let io = |what: &'static str| {
        move |source: std::io::Error| HolderError::Io {
            socket: path.to_path_buf(),
            what,
            source,
        }
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io("creating the socket directory"))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing a stale socket")(e)),
    }
    let nix_io = |what: &'static str| move |e: nix::Error| io(what)(std::io::Error::from(e));
    let fd = seqpacket().map_err(nix_io("creating a socket"))?;
    let addr = UnixAddr::new(path).map_err(nix_io("socket path"))?;
    bind(fd.as_raw_fd(), &addr).map_err(nix_io("binding"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io("restricting the socket to root"))?;
    let backlog = Backlog::new(64).map_err(nix_io("backlog"))?;
    listen(&fd, backlog).map_err(nix_io("listening"))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_keeps_gives_back_and_drops_fds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("holder.sock");
        let listener = listen_at(&socket).expect("listen");
        std::thread::spawn(move || Holder::default().serve(listener));
        let client = HolderClient::new(&socket);

        // A pipe stands in for /dev/fuse: what matters is that the holder keeps the same
        // open file, so bytes written into the original come out of the returned duplicate.
        let (read_end, write_end) = nix::unistd::pipe().expect("pipe");
        client
            .put("/state/mounts/aa", "blake3:aa", read_end.as_fd())
            .expect("put");
        drop(read_end);
        assert_eq!(
            client.list().expect("list"),
            vec![HeldMount {
                key: "/state/mounts/aa".into(),
                digest: "blake3:aa".into()
            }]
        );
        let (digest, back) = client.get("/state/mounts/aa").expect("get").expect("held");
        assert_eq!(digest, "blake3:aa");
        nix::unistd::write(&write_end, b"same file").expect("write");
        let mut buf = [0u8; 16];
        let n = nix::unistd::read(&back, &mut buf).expect("read");
        assert_eq!(&buf[..n], b"same file");

        assert!(client.get("/state/mounts/bb").expect("get").is_none());
        client.drop_fd("/state/mounts/aa").expect("drop");
        assert!(client.list().expect("list").is_empty());
        let mode = std::fs::metadata(&socket)
            .expect("socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "only root may talk to the holder");
    }

    #[test]
    fn put_without_a_descriptor_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("holder.sock");
        let listener = listen_at(&socket).expect("listen");
        std::thread::spawn(move || Holder::default().serve(listener));
        let client = HolderClient::new(&socket);
        let request = Request::Put {
            key: "k".into(),
            digest: "d".into(),
        };
        let err = client.call(&request, None).expect_err("refused");
        assert!(err.to_string().contains("needs a descriptor"), "{err}");
    }

    #[test]
    fn a_missing_holder_is_a_connect_error_naming_the_socket() {
        let client = HolderClient::new("/nonexistent/holder.sock");
        let err = client.list().expect_err("no holder");
        assert!(
            err.to_string().contains("/nonexistent/holder.sock"),
            "{err}"
        );
    }
}
