//! Serving a FUSE connection that another process set up: what lets the CSI node plugin
//! restart without breaking the pods that read its mounts.
//!
//! The kernel keeps a FUSE connection alive as long as any process holds its /dev/fuse file
//! open. When the plugin hands a duplicate of that fd to a holder process and then dies, the
//! mount stays, reads simply wait, and a new plugin can take the fd back and answer them. Two
//! kernel facts make this work:
//!
//! - the connection was initialised once (FUSE_INIT) and never is again, but `fuser` only
//!   builds a session after answering an INIT. [`session_for_live_fd`] gives it a synthetic
//!   INIT over a socket pair and then swaps the real /dev/fuse file in under the same fd
//!   number (`dup2`), before the session reads anything else;
//! - requests the dead process had read but not answered sit in the connection's processing
//!   queue. Since Linux 6.9, `FUSE_NOTIFY_RESEND` ([`notify_resend`]) puts them back in the
//!   pending queue, so the new process answers them too. Older kernels ignore the notification
//!   (EINVAL) and those few requests stay unanswered.
//!
//! Re-attaching is safe because a sealed version never changes: the new process builds the
//! same tree from the same manifest, so every inode number the kernel remembers still names
//! the same file, and file handles carry no state the reads depend on.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use fuser::{Config, Filesystem, Session};

/// FUSE_INIT's opcode.
const FUSE_INIT: u32 = 26;
/// `fuse_notify_code::FUSE_NOTIFY_RESEND` (Linux 6.9).
const FUSE_NOTIFY_RESEND: i32 = 7;
/// The protocol version the synthetic INIT announces: 7.40, the newest `fuser` 0.18 speaks.
/// What the session negotiates from it is discarded; the kernel keeps what it agreed to with
/// the process that mounted.
const SYNTHETIC_MINOR: u32 = 40;

/// A FUSE_INIT request as the kernel sends it: `fuse_in_header` then `fuse_init_in`, with
/// every capability offered so the filesystem's `init` never fails on a missing one.
fn synthetic_init() -> Vec<u8> {
    let mut msg = Vec::with_capacity(104);
    let u32s = |values: &[u32], msg: &mut Vec<u8>| {
        for v in values {
            msg.extend_from_slice(&v.to_ne_bytes());
        }
    };
    // fuse_in_header: len, opcode, unique (u64), nodeid (u64), uid, gid, pid, padding.
    u32s(&[104, FUSE_INIT], &mut msg);
    msg.extend_from_slice(&1u64.to_ne_bytes());
    msg.extend_from_slice(&0u64.to_ne_bytes());
    u32s(&[0, 0, 0, 0], &mut msg);
    // fuse_init_in: major, minor, max_readahead, flags, flags2, unused[11].
    u32s(&[7, SYNTHETIC_MINOR, 1 << 20, u32::MAX, u32::MAX], &mut msg);
    u32s(&[0; 11], &mut msg);
    msg
}

/// A SOCK_SEQPACKET pair: like /dev/fuse, every read returns one whole message.
fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded, so both are fresh descriptors nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A `fuser` session serving the already-initialised FUSE connection `fuse`. Nothing is read
/// from `fuse` until the session runs.
pub fn session_for_live_fd<FS: Filesystem>(
    filesystem: FS,
    fuse: OwnedFd,
    config: Config,
) -> io::Result<Session<FS>> {
    let (ours, peer) = seqpacket_pair()?;
    write_all_once(peer.as_fd(), &synthetic_init())?;
    let acl = config.acl;
    // The handshake reads the synthetic INIT from `ours` and answers it into the pair.
    let session = Session::from_fd(filesystem, ours, acl, config)?;
    let slot = session.as_fd().as_raw_fd();
    // Put the real connection under the session's fd number. dup2 swaps the file atomically
    // and the session reads nothing until it runs, so it never sees the socket again.
    // SAFETY: both descriptors are open and owned (by `fuse` and by the session).
    let rc = unsafe { libc::dup2(fuse.as_raw_fd(), slot) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // `fuse` and `peer` close here; the session's descriptor keeps the connection.
    Ok(session)
}

fn write_all_once(fd: BorrowedFd<'_>, msg: &[u8]) -> io::Result<()> {
    // SAFETY: `msg` is valid for `msg.len()` bytes for the duration of the call.
    let n = unsafe { libc::write(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != msg.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("short write: {n} of {} bytes", msg.len()),
        ));
    }
    Ok(())
}

/// Asks the kernel to send again every request a previous server read but never answered.
/// `Ok(false)`: the kernel is older than 6.9 and cannot.
pub fn notify_resend(fuse: BorrowedFd<'_>) -> io::Result<bool> {
    // fuse_out_header: len, error (the notification code), unique 0 (a notification).
    let mut msg = Vec::with_capacity(16);
    msg.extend_from_slice(&16u32.to_ne_bytes());
    msg.extend_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    msg.extend_from_slice(&0u64.to_ne_bytes());
    match write_all_once(fuse, &msg) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_init_has_the_kernel_layout() {
        let msg = synthetic_init();
        assert_eq!(msg.len(), 104, "fuse_in_header (40) + fuse_init_in (64)");
        let word = |i: usize| u32::from_ne_bytes([msg[i], msg[i + 1], msg[i + 2], msg[i + 3]]);
        assert_eq!(word(0) as usize, msg.len(), "header length");
        assert_eq!(word(4), FUSE_INIT);
        assert_eq!(word(40), 7, "major");
        assert_eq!(word(44), SYNTHETIC_MINOR);
    }

    #[test]
    fn seqpacket_keeps_message_boundaries() {
        let (a, b) = seqpacket_pair().expect("socketpair");
        write_all_once(a.as_fd(), b"first").expect("write");
        write_all_once(a.as_fd(), b"second").expect("write");
        let mut buf = [0u8; 64];
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::read(b.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        assert_eq!(&buf[..n as usize], b"first");
    }
}
