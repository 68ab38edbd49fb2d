//! `sealed mount --background` / `sealed umount` as a user runs them: a real FUSE mount served by
//! a separate process, read back byte-identical, then unmounted.

use std::path::Path;
use std::process::Command;

use assert_cmd::cargo::CommandCargoExt;

fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: FUSE mounts need root and /dev/fuse");
        return false;
    }
    true
}

fn is_mounted(dir: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(dir.to_str().unwrap_or("")))
}

#[test]
fn background_mount_reads_back_and_unmounts() {
    if !can_mount() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    std::fs::create_dir(&store).unwrap();
    let src = work.path().join("model");
    std::fs::create_dir_all(src.join("tokenizer")).unwrap();
    let weights: Vec<u8> = (0..(9u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(src.join("model.safetensors"), &weights).unwrap();
    std::fs::write(src.join("tokenizer/tokenizer.json"), b"{\"model\":{}}").unwrap();
    std::os::unix::fs::symlink("model.safetensors", src.join("current")).unwrap();

    let sealed = || {
        let mut c = Command::cargo_bin("sealed").unwrap();
        c.env("SEALED_STORE", format!("file://{}", store.display()));
        c
    };
    let out = sealed().arg("push").arg(&src).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let digest = String::from_utf8(out.stdout).unwrap().trim().to_string();

    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let out = sealed()
        .args(["mount", &digest])
        .arg(&mnt)
        .arg("--background")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        is_mounted(&mnt),
        "not in /proc/self/mounts after --background returned"
    );

    let read_back = std::fs::read(mnt.join("model.safetensors"));
    let tokenizer = std::fs::read(mnt.join("tokenizer/tokenizer.json"));
    let link = std::fs::read_link(mnt.join("current"));
    let write = std::fs::write(mnt.join("new.txt"), b"x");

    let out = sealed().arg("umount").arg(&mnt).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!is_mounted(&mnt), "still mounted after sealed umount");

    assert!(
        read_back.unwrap() == weights,
        "bytes differ through the mount"
    );
    assert_eq!(tokenizer.unwrap(), b"{\"model\":{}}");
    assert_eq!(link.unwrap(), Path::new("model.safetensors"));
    let err = write.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
}

#[test]
fn mounting_an_unknown_digest_fails_clearly() {
    if !can_mount() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    std::fs::create_dir(work.path().join("store")).unwrap();
    std::fs::create_dir(work.path().join("mnt")).unwrap();
    let unknown = format!("blake3:{}", "cd".repeat(32));
    let out = Command::cargo_bin("sealed")
        .unwrap()
        .env(
            "SEALED_STORE",
            format!("file://{}", work.path().join("store").display()),
        )
        .args(["mount", &unknown])
        .arg(work.path().join("mnt"))
        .arg("--background")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&unknown) && err.contains("not found"), "{err}");
    assert!(!is_mounted(&work.path().join("mnt")));
}

/// The serving process's pid, from `sealed mount --background`'s "serving process N".
fn serving_pid(stderr: &[u8]) -> u32 {
    let text = String::from_utf8_lossy(stderr);
    text.split("serving process ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no serving process in: {text}"))
}

/// True once `pid` has exited (gone, or a zombie waiting for its reaper).
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}

/// `sealed umount` (someone else than the serving process) right after a read: the serving
/// process still stores what the next mount needs before it exits: the learned prefetch
/// profile of what was read, and the file read to its end, assembled (hydrated). Before
/// this, it only flushed chunk writes, so the first mount of a version unmounted this way
/// never recorded a profile, and a shard read just before the unmount was served chunk by
/// chunk by the next mount.
#[test]
fn an_unmount_by_someone_else_keeps_the_profile_and_the_hydrated_file() {
    if !can_mount() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    std::fs::create_dir(&store).unwrap();
    let src = work.path().join("model");
    std::fs::create_dir(&src).unwrap();
    let weights: Vec<u8> = (0..(24u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
        .collect();
    std::fs::write(src.join("model.safetensors"), &weights).unwrap();
    let sealed = || {
        let mut c = Command::cargo_bin("sealed").unwrap();
        c.env("SEALED_STORE", format!("file://{}", store.display()));
        c
    };
    let out = sealed().arg("push").arg(&src).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let digest = String::from_utf8(out.stdout).unwrap().trim().to_string();

    let mnt = work.path().join("mnt");
    let cache = work.path().join("cache");
    std::fs::create_dir(&mnt).unwrap();
    let out = sealed()
        .args(["mount", &digest])
        .arg(&mnt)
        .arg("--background")
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid = serving_pid(&out.stderr);
    let read_back = std::fs::read(mnt.join("model.safetensors"));
    let out = sealed().arg("umount").arg(&mnt).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        read_back.unwrap() == weights,
        "bytes differ through the mount"
    );

    // `sealed umount` returned only once the serving process had settled: what it learned
    // and assembled is on disk now, with no waiting here.
    // Profiles are scoped (`profiles/<manifest hex>.<scope id>`, docs/mount.md): this mount's
    // is the one object named for its manifest.
    let hex = digest.trim_start_matches("blake3:");
    let profile_of_manifest = || {
        std::fs::read_dir(store.join("profiles"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .find(|path| {
                path.is_file()
                    && path
                        .file_name()
                        .and_then(|name| name.to_str())
                        .is_some_and(|name| name.starts_with(&format!("{hex}.")))
            })
    };
    let settled_before_return = profile_of_manifest().is_some();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !exited(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "serving process {pid} still running 30 s after the unmount"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        profile_of_manifest().is_some(),
        "no learned profile stored for {digest}"
    );
    assert!(
        settled_before_return,
        "`sealed umount` returned before the serving process stored its profile"
    );
    let file_hex = blake3::hash(&weights).to_hex().to_string();
    let hydrated = cache.join("files").join(&file_hex[..2]).join(&file_hex);
    let len = std::fs::metadata(&hydrated).map(|m| m.len()).ok();
    assert_eq!(
        len,
        Some(weights.len() as u64),
        "{} is not the assembled file",
        hydrated.display()
    );
}

/// Every path under `dir` (not `dir` itself) with its mode bits.
fn modes_under(dir: &Path) -> Vec<(std::path::PathBuf, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let Ok(meta) = e.metadata() else { continue };
            out.push((e.path(), meta.permissions().mode() & 0o7777));
            if meta.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

#[test]
fn the_disk_cache_is_private_and_an_existing_one_is_tightened() {
    if !can_mount() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    std::fs::create_dir(&store).unwrap();
    let src = work.path().join("model");
    std::fs::create_dir(&src).unwrap();
    let weights: Vec<u8> = (0..(3u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 9) as u8)
        .collect();
    std::fs::write(src.join("model.safetensors"), &weights).unwrap();
    std::fs::write(src.join("config.json"), b"{}").unwrap();
    let sealed = || {
        let mut c = Command::cargo_bin("sealed").unwrap();
        c.env("SEALED_STORE", format!("file://{}", store.display()));
        c
    };
    let out = sealed().arg("push").arg(&src).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let digest = String::from_utf8(out.stdout).unwrap().trim().to_string();

    // A cache directory an earlier version made world-readable.
    let cache = work.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let out = sealed()
        .args(["mount", &digest])
        .arg(&mnt)
        .args(["--background", "--cache-dir"])
        .arg(&cache)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read_back = std::fs::read(mnt.join("model.safetensors"));
    let config = std::fs::read(mnt.join("config.json"));
    let out = sealed().arg("umount").arg(&mnt).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(read_back.unwrap() == weights);
    assert_eq!(config.unwrap(), b"{}");

    let mode = std::fs::metadata(&cache).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o700, "the cache directory is {mode:o}");
    let entries = modes_under(&cache);
    assert!(
        entries.iter().any(|(p, _)| p.is_file()),
        "nothing was cached: {entries:?}"
    );
    for (path, mode) in entries {
        let want = if path.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode, want, "{} is {mode:o}", path.display());
    }
}
