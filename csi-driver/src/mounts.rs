//! The kernel side of publishing: read-only bind mounts of a version's FUSE mount onto
//! target paths, and finding what is mounted where.

use std::io;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};

use crate::error::CsiError;

/// Bind-mounts `source` onto `target` (created if missing) and makes the bind read-only:
/// a bind mount ignores MS_RDONLY, so it takes a second, remounting call.
pub fn bind_read_only(source: &Path, target: &Path) -> Result<(), CsiError> {
    std::fs::create_dir_all(target).map_err(|e| CsiError::io("creating target", target, e))?;
    if is_mount_point(target) {
        // Left by an earlier run of the plugin: this request replaces it.
        tracing::warn!(target = %target.display(), "target already mounted; replacing");
        unmount_all(target)?;
    }
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| CsiError::io("bind-mounting onto", target, io::Error::from(e)))?;
    let flags = MsFlags::MS_BIND
        | MsFlags::MS_REMOUNT
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV;
    if let Err(e) = mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
        let _ = umount2(target, MntFlags::MNT_DETACH);
        return Err(CsiError::io(
            "remounting read-only",
            target,
            io::Error::from(e),
        ));
    }
    Ok(())
}

/// Unmounts whatever is mounted at `target` and removes the directory. Nothing mounted, or
/// no directory at all, is a success. A target this plugin did not publish (`ours` false) that
/// is a plain directory with files in it is left alone, with a warning, rather than failing
/// kubelet's unpublish forever.
pub fn unmount_target(target: &Path, ours: bool) -> Result<(), CsiError> {
    unmount_all(target)?;
    match std::fs::remove_dir(target) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if !ours => {
            tracing::warn!(target = %target.display(), error = %e, "left an unknown target in place");
            Ok(())
        }
        Err(e) => Err(CsiError::io("removing target", target, e)),
    }
}

fn unmount_all(target: &Path) -> Result<(), CsiError> {
    // Mounts can be stacked; take them off one by one.
    for _ in 0..8 {
        if !is_mount_point(target) {
            return Ok(());
        }
        match umount2(target, MntFlags::empty()) {
            Ok(()) => {}
            Err(Errno::EBUSY) => {
                tracing::warn!(target = %target.display(), "target busy; detaching");
                umount2(target, MntFlags::MNT_DETACH)
                    .map_err(|e| CsiError::io("unmounting", target, io::Error::from(e)))?;
            }
            Err(Errno::EINVAL | Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(CsiError::io("unmounting", target, io::Error::from(e))),
        }
    }
    Ok(())
}

/// True when `path` is a mount point in this mount namespace (per /proc/self/mountinfo, which
/// also sees FUSE mounts whose server is gone and that `stat` cannot reach).
pub fn is_mount_point(path: &Path) -> bool {
    let path = absolute(path);
    mount_points().contains(&path)
}

/// The mount points listed in /proc/self/mountinfo.
pub fn mount_points() -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape(field)))
        .collect()
}

/// `path` as mountinfo lists it (to compare with [`mount_points`]).
pub fn absolute(path: &Path) -> PathBuf {
    // Canonicalize the parent only: the target itself may be a dead FUSE mount.
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => parent
            .canonicalize()
            .map(|p| p.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_mountinfo_fields() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/end\"), "/end\\");
    }

    #[test]
    fn root_is_a_mount_point() {
        assert!(is_mount_point(Path::new("/")));
        assert!(!is_mount_point(Path::new("/definitely/not/mounted/here")));
    }
}
