//! Where the plugin may mount and unmount: only kubelet's pod volume directories.
//!
//! A CSI `target_path` comes from whoever can reach the plugin's socket. The plugin runs as
//! root with the host's mount namespace, so a path it takes on trust is a way to mount over,
//! or unmount and delete, anything on the node (an unpublish once unmounted and removed an
//! unrelated tmpfs). kubelet only ever sends `<kubelet-root>/pods/<uid>/volumes/…`, so that is
//! all the plugin accepts: an absolute path without `.` or `..`, whose existing part resolves
//! (symlinks followed, [`std::fs::canonicalize`] of the parent) to a place strictly under
//! `<kubelet-root>/pods`, that is not itself a symlink and is neither inside nor above the
//! plugin's state directory. Anything else is `InvalidArgument`, and nothing is mounted,
//! unmounted or removed.

use std::io;
use std::path::{Component, Path, PathBuf};

use crate::error::CsiError;

/// kubelet's default root directory.
pub const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";

/// The directories a target must be under (kubelet's pods) and must stay out of (the
/// plugin's state).
#[derive(Clone, Debug)]
pub struct TargetRules {
    /// `<kubelet-root>/pods`, as configured (resolved on every check: it may appear later).
    pub pods_dir: PathBuf,
    /// The plugin's state directory (its FUSE mounts and publication records).
    pub state_dir: PathBuf,
}

impl TargetRules {
    pub fn new(kubelet_root: &Path, state_dir: &Path) -> Self {
        TargetRules {
            pods_dir: kubelet_root.join("pods"),
            state_dir: state_dir.to_path_buf(),
        }
    }

    /// `Ok` when `target` may be published to or unpublished from.
    pub fn check(&self, target: &Path) -> Result<(), CsiError> {
        let refuse = |why: String| {
            CsiError::InvalidArgument(format!(
                "target_path {}: {why}; sealed volumes are published only into kubelet's pod \
                 directories under {} (--kubelet-root, or --kubelet-dir), so nothing was \
                 mounted, unmounted or removed",
                target.display(),
                self.pods_dir.display()
            ))
        };
        if !target.is_absolute() {
            return Err(refuse("not an absolute path".into()));
        }
        // `Path::components` drops inner `.` silently; look at the raw segments.
        let raw = target.as_os_str().as_encoded_bytes();
        if raw.split(|b| *b == b'/').any(|s| s == b"." || s == b"..") {
            return Err(refuse("has a '.' or '..' component".into()));
        }
        if std::fs::symlink_metadata(target).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(refuse("is a symbolic link".into()));
        }
        let resolved = resolve(target).map_err(|e| refuse(format!("cannot be resolved: {e}")))?;
        let pods = resolve_dir(&self.pods_dir).map_err(|e| {
            refuse(format!(
                "{} cannot be resolved: {e}",
                self.pods_dir.display()
            ))
        })?;
        if !resolved.starts_with(&pods) || resolved == pods {
            return Err(refuse(if resolved == lexical(target) {
                "outside kubelet's pod directories".into()
            } else {
                format!(
                    "resolves to {}, outside kubelet's pod directories",
                    resolved.display()
                )
            }));
        }
        if let Ok(state) = resolve_dir(&self.state_dir)
            && (resolved.starts_with(&state) || state.starts_with(&resolved))
        {
            return Err(refuse(format!(
                "overlaps the plugin's state directory {}",
                self.state_dir.display()
            )));
        }
        Ok(())
    }
}

/// `path` with its nearest existing ancestor canonicalised (the target itself is not: it
/// may be a FUSE mount whose server is gone, which `stat` cannot reach).
fn resolve(path: &Path) -> io::Result<PathBuf> {
    let Some(parent) = path.parent() else {
        return Ok(path.to_path_buf());
    };
    let name = path.file_name().map(PathBuf::from).unwrap_or_default();
    Ok(resolve_dir(parent)?.join(name))
}

/// A directory path, canonicalised as far as it exists; the missing rest appended as is.
fn resolve_dir(dir: &Path) -> io::Result<PathBuf> {
    let mut missing: Vec<&std::ffi::OsStr> = Vec::new();
    let mut cur = dir;
    loop {
        match cur.canonicalize() {
            Ok(mut base) => {
                for part in missing.iter().rev() {
                    base.push(part);
                }
                return Ok(base);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let (Some(parent), Some(name)) = (cur.parent(), cur.file_name()) else {
                    return Err(e);
                };
                missing.push(name);
                cur = parent;
            }
            Err(e) => return Err(e),
        }
    }
}

/// `path` without `.` components and repeated slashes.
fn lexical(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(root: &Path) -> TargetRules {
        TargetRules::new(&root.join("kubelet"), &root.join("state"))
    }

    fn refused(rules: &TargetRules, target: &Path, needle: &str) {
        let e = rules.check(target).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        let text = e.to_string();
        assert!(text.contains(needle), "{text} should say {needle:?}");
        assert!(
            text.contains("nothing was mounted, unmounted or removed"),
            "{text}"
        );
    }

    #[test]
    fn kubelet_pod_volume_dirs_are_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let rules = rules(dir.path());
        // Neither the pods dir nor the target exist yet: resolved lexically below the root.
        let target = dir
            .path()
            .join("kubelet/pods/0d6f/volumes/kubernetes.io~csi/model/mount");
        rules.check(&target).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        rules.check(&target).unwrap();
        std::fs::create_dir_all(&target).unwrap();
        rules.check(&target).unwrap();
    }

    #[test]
    fn paths_outside_the_pods_dir_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let rules = rules(dir.path());
        std::fs::create_dir_all(dir.path().join("kubelet/pods")).unwrap();
        refused(&rules, Path::new("relative/mount"), "not an absolute path");
        refused(
            &rules,
            Path::new("/tmp/unrelated"),
            "outside kubelet's pod directories",
        );
        refused(&rules, &dir.path().join("kubelet/plugins/x"), "outside");
        // The pods dir itself, and kubelet's root.
        refused(&rules, &dir.path().join("kubelet/pods"), "outside");
        refused(&rules, &dir.path().join("kubelet"), "outside");
        refused(
            &rules,
            &dir.path().join("kubelet/pods/../../etc"),
            "'.' or '..'",
        );
        refused(&rules, &dir.path().join("kubelet/pods/./a"), "'.' or '..'");
    }

    #[test]
    fn symlinks_out_of_the_pods_dir_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let rules = rules(dir.path());
        let pods = dir.path().join("kubelet/pods");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&pods).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        // A parent that is a symlink out of the pods dir.
        std::os::unix::fs::symlink(&outside, pods.join("escape")).unwrap();
        refused(&rules, &pods.join("escape/mount"), "resolves to");
        refused(&rules, &pods.join("escape/deeper/mount"), "resolves to");
        // The target itself a symlink (mount(2) and umount(2) would follow it).
        std::fs::create_dir_all(pods.join("uid")).unwrap();
        std::os::unix::fs::symlink(&outside, pods.join("uid/mount")).unwrap();
        refused(&rules, &pods.join("uid/mount"), "symbolic link");
        // A symlink that stays inside is fine.
        std::fs::create_dir_all(pods.join("real")).unwrap();
        std::os::unix::fs::symlink(pods.join("real"), pods.join("alias")).unwrap();
        rules.check(&pods.join("alias/mount")).unwrap();
    }

    #[test]
    fn a_kubelet_root_behind_a_symlink_works() {
        // /var/lib/kubelet -> /data/kubelet: kubelet sends the /var/lib path.
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("data/kubelet");
        std::fs::create_dir_all(real.join("pods/uid")).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("kubelet")).unwrap();
        let rules = rules(dir.path());
        rules
            .check(&dir.path().join("kubelet/pods/uid/mount"))
            .unwrap();
        rules.check(&real.join("pods/uid/mount")).unwrap();
    }

    #[test]
    fn the_state_dir_is_off_limits() {
        let dir = tempfile::tempdir().unwrap();
        // A state dir (wrongly) inside kubelet's pods dir.
        let rules = TargetRules::new(
            &dir.path().join("kubelet"),
            &dir.path().join("kubelet/pods/sealed-state"),
        );
        std::fs::create_dir_all(dir.path().join("kubelet/pods/sealed-state/mounts")).unwrap();
        refused(
            &rules,
            &dir.path().join("kubelet/pods/sealed-state/mounts/abc"),
            "state directory",
        );
        refused(
            &rules,
            &dir.path().join("kubelet/pods/sealed-state"),
            "state directory",
        );
        rules
            .check(&dir.path().join("kubelet/pods/uid/mount"))
            .unwrap();
    }
}
