//! `sealed push` re-pushes an unchanged tree at metadata speed (the stat cache under
//! `$XDG_CACHE_HOME/sealed/stat`), reads every file again with `--rehash`, and never trusts a
//! changed file or a damaged cache.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;
use common::Env;

/// Longer than the stat cache's racy window (2 s): files this old are trusted.
const SETTLE: Duration = Duration::from_millis(2300);

impl Env {
    fn tree(&self) -> PathBuf {
        let d = self.path("model");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let data: Vec<u8> = (0..5u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        std::fs::write(d.join("weights.bin"), data).unwrap();
        std::fs::write(d.join("sub/config.json"), b"{\"a\":1}").unwrap();
        d
    }
    fn push_json(&self, dir: &Path, extra: &[&str]) -> (serde_json::Value, String) {
        let mut args = vec!["push", dir.to_str().unwrap(), "-o", "json"];
        args.extend(extra);
        let (ok, out, err) = self.run(&args);
        assert!(ok, "push failed: {err}");
        (serde_json::from_str(&out).unwrap(), err)
    }
    fn cache_files(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.path("cache/sealed/stat"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    }
}

const TOTAL: u64 = (5 << 20) + 7;

#[test]
fn a_re_push_reads_nothing_and_rehash_reads_everything() {
    let env = Env::new();
    let src = env.tree();
    std::thread::sleep(SETTLE);
    let (first, _) = env.push_json(&src, &[]);
    assert_eq!(first["bytes_read"], TOTAL);
    assert_eq!(
        env.cache_files().len(),
        1,
        "one cache file for the tree and store"
    );

    let (again, _) = env.push_json(&src, &[]);
    assert_eq!(again["digest"], first["digest"]);
    assert_eq!(again["bytes_read"], 0, "an unchanged tree is not read");
    assert_eq!(again["files_cached"], 2);

    let (rehashed, _) = env.push_json(&src, &["--rehash"]);
    assert_eq!(rehashed["digest"], first["digest"]);
    assert_eq!(rehashed["bytes_read"], TOTAL);
    assert_eq!(rehashed["files_cached"], 0);

    // A damaged cache is ignored, said so, and rewritten.
    let cache = &env.cache_files()[0];
    let mut bytes = std::fs::read(cache).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(cache, &bytes).unwrap();
    let (damaged, err) = env.push_json(&src, &[]);
    assert_eq!(damaged["digest"], first["digest"]);
    assert_eq!(damaged["bytes_read"], TOTAL);
    assert!(err.contains("ignoring the stat cache"), "{err}");
    let (healed, _) = env.push_json(&src, &[]);
    assert_eq!(healed["bytes_read"], 0);
}

#[test]
fn a_same_size_change_with_the_mtime_put_back_is_read() {
    let env = Env::new();
    let src = env.tree();
    std::thread::sleep(SETTLE);
    let (first, _) = env.push_json(&src, &[]);

    // Within the racy window, same size, mtime forged back with utimensat(2).
    let file = src.join("sub/config.json");
    let before = std::fs::metadata(&file).unwrap();
    std::fs::write(&file, b"{\"a\":2}").unwrap();
    let c = CString::new(file.as_os_str().as_bytes()).unwrap();
    let times = [
        libc::timespec {
            tv_sec: before.atime(),
            tv_nsec: before.atime_nsec(),
        },
        libc::timespec {
            tv_sec: before.mtime(),
            tv_nsec: before.mtime_nsec(),
        },
    ];
    // SAFETY: a NUL-terminated path and two timespecs, as utimensat(2) wants.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) },
        0
    );
    let after = std::fs::metadata(&file).unwrap();
    assert_eq!(
        (after.len(), after.mtime_nsec()),
        (before.len(), before.mtime_nsec())
    );

    let (again, _) = env.push_json(&src, &[]);
    assert_ne!(again["digest"], first["digest"], "the change was sealed");
    assert_eq!(again["bytes_read"], 7, "only the changed file was read");
    let (rehashed, _) = env.push_json(&src, &["--rehash"]);
    assert_eq!(rehashed["digest"], again["digest"]);
}
