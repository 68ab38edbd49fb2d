//! Who serves a mount point. The serving process of `sealed mount` holds an exclusive lock on
//! a small file keyed by the mount point for as long as it lives; `sealed umount` opens that
//! file before unmounting and waits for the lock to be released, so it returns only once the
//! serving process has settled (chunk writes, background assemblies, the learned profile) and
//! exited. The kernel drops the lock when the process dies, so a crash leaves nothing held.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Held by the serving process; released (and its file removed) on drop.
#[derive(Debug)]
pub struct ServingLock {
    file: File,
    path: PathBuf,
}

impl ServingLock {
    /// Takes the lock for `mount_point`. `None` when another live process already holds it
    /// (a mount stacked on another) or the runtime directory is unusable: the mount still
    /// works, only `sealed umount` cannot wait for this process.
    pub fn acquire(mount_point: &Path) -> Option<Self> {
        match runtime_dir(true) {
            Ok(runtime) => Self::acquire_in(&runtime, mount_point),
            Err(e) => {
                tracing::warn!(error = %e, "no serving lock: `sealed umount` will not wait for this process");
                None
            }
        }
    }

    fn acquire_in(runtime: &Path, mount_point: &Path) -> Option<Self> {
        let path = match lock_path(runtime, mount_point, true) {
            Ok(path) => path,
            Err(e) => {
                tracing::warn!(error = %e, "no serving lock: `sealed umount` will not wait for this process");
                return None;
            }
        };
        let mut file = match OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot open the serving lock");
                return None;
            }
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                tracing::warn!(path = %path.display(), "another process serves this mount point");
                return None;
            }
            Err(TryLockError::Error(e)) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot lock the serving lock");
                return None;
            }
        }
        // The pid is for people reading the file; the lock is what counts.
        let _ = file.set_len(0);
        let _ = writeln!(file, "{}", std::process::id());
        Some(Self { file, path })
    }
}

impl Drop for ServingLock {
    fn drop(&mut self) {
        // Removed while still locked: a waiter holds its own descriptor to this inode, and a
        // later mount of the same point creates a fresh file.
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

/// The serving lock of `mount_point`, opened by `sealed umount` before it unmounts; `None`
/// when no `sealed mount` process has served it (mounted by another tool, or long gone).
pub fn open_for_wait(mount_point: &Path) -> Option<File> {
    open_in(&runtime_dir(false).ok()?, mount_point)
}

fn open_in(runtime: &Path, mount_point: &Path) -> Option<File> {
    let path = lock_path(runtime, mount_point, false).ok()?;
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .ok()
}

/// Waits until the serving process has released its lock (it has exited), up to `bound`.
/// Returns how long that took, or `None` if it was still holding it at the bound.
pub fn wait_released(file: &File, bound: Duration) -> Option<Duration> {
    let start = Instant::now();
    loop {
        match file.try_lock_shared() {
            Ok(()) => {
                let _ = file.unlock();
                return Some(start.elapsed());
            }
            // Anything but "held" means nobody can be holding it for us to wait on.
            Err(TryLockError::Error(_)) => return Some(start.elapsed()),
            Err(TryLockError::WouldBlock) => {}
        }
        if start.elapsed() >= bound {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `<runtime>/mounts/<blake3 of the absolute mount point>.lock`. The parent is
/// canonicalized, never the mount point itself: resolving it would ask the FUSE server.
fn lock_path(runtime: &Path, mount_point: &Path, create: bool) -> io::Result<PathBuf> {
    let name = mount_point.file_name().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "mount point has no file name")
    })?;
    let parent = match mount_point.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let absolute = parent.canonicalize()?.join(name);
    let key = blake3::hash(absolute.as_os_str().as_encoded_bytes()).to_hex();
    let dir = runtime.join("mounts");
    if create {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
    }
    Ok(dir.join(format!("{}.lock", &key[..32])))
}

/// `$XDG_RUNTIME_DIR/sealed-volumes`, `/run/sealed-volumes` as root, else a per-user
/// directory under the temp dir that must be ours (not a symlink another user planted).
fn runtime_dir(create: bool) -> io::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("sealed-volumes"));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return Ok(PathBuf::from("/run/sealed-volumes"));
    }
    let dir = std::env::temp_dir().join(format!("sealed-volumes-{uid}"));
    if create {
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} is not a private directory of this user", dir.display()),
        ));
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_returns_only_once_the_holder_lets_go() {
        let runtime = tempfile::tempdir().unwrap();
        let mounts = tempfile::tempdir().unwrap();
        let point = mounts.path().join("mnt");
        let runtime = runtime.path();
        let held = ServingLock::acquire_in(runtime, &point).expect("lock taken");
        assert!(
            ServingLock::acquire_in(runtime, &point).is_none(),
            "a second holder of the same mount point"
        );
        let waiter = open_in(runtime, &point).expect("lock file found");
        assert_eq!(wait_released(&waiter, Duration::from_millis(100)), None);
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        let waited = wait_released(&waiter, Duration::from_secs(10)).expect("released");
        assert!(
            waited >= Duration::from_millis(150),
            "returned early: {waited:?}"
        );
        release.join().unwrap();
        assert!(open_in(runtime, &point).is_none(), "lock file left behind");
        // The same directory by another spelling is the same mount point.
        let again = ServingLock::acquire_in(runtime, &mounts.path().join(".").join("mnt"))
            .expect("retaken");
        assert!(open_in(runtime, &point).is_some());
        drop(again);
    }
}
