//! The plugin's state directory, and how files in it are written.
//!
//! `<state-dir>/mounts/<hex>` holds the FUSE mounts, `publications/` the publication records
//! (`records`), `manifests/` the kept manifests (`manifest_cache`). All of it says which
//! versions the node mounts: directories are 0700, files 0600, and every file is replaced
//! atomically, so a crash leaves the old content or the new one, never half of either.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

use crate::error::CsiError;

/// Creates `dir` (and its parents) with mode 0700, and sets 0700 on it if it exists with
/// another mode: the plugin's state and the node cache hold which versions the node mounts
/// and their bytes, which no other user on the node should read.
pub fn private_dir(dir: &Path) -> Result<(), CsiError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| CsiError::io("creating", dir, e))?;
    let meta = std::fs::metadata(dir).map_err(|e| CsiError::io("reading", dir, e))?;
    if meta.permissions().mode() & 0o7777 != 0o700 {
        tracing::info!(dir = %dir.display(), mode = format!("{:o}", meta.permissions().mode() & 0o7777),
            "setting mode 0700");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| CsiError::io("setting mode 0700 on", dir, e))?;
    }
    Ok(())
}

/// Replaces `path` with `bytes` (mode 0600): a temporary file beside it, fsync, rename, fsync
/// of the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn private_dirs_are_0700_new_or_old() {
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("a/b/state");
        private_dir(&new).unwrap();
        assert_eq!(mode(&new), 0o700);
        let old = dir.path().join("cache");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(mode(&old), 0o755);
        private_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o700);
        // A file where the directory should be is an error, not a panic.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(private_dir(&file).is_err());
    }

    #[test]
    fn atomic_writes_replace_the_whole_file_and_leave_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("record.json");
        write_atomically(&path, b"a long first version").unwrap();
        write_atomically(&path, b"short").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"short");
        assert_eq!(mode(&path), 0o600);
        assert!(!path.with_extension("tmp").exists());
    }
}
