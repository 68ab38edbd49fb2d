//! The `sealed` binary as users meet it: stdout carries the digest alone, JSON output parses,
//! and bad input gets a clear message, a non-zero exit and nothing sealed.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::Env;

impl Env {
    fn sample(&self) -> PathBuf {
        let d = self.path("model");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("weights.bin"), vec![7u8; 3 << 20]).unwrap();
        std::fs::write(d.join("sub/config.json"), b"{}").unwrap();
        d
    }
    fn manifests(&self) -> usize {
        std::fs::read_dir(self.path("store/manifests"))
            .map(|d| d.count())
            .unwrap_or(0)
    }
    /// Push that must fail; returns stderr. Checks nothing was sealed.
    fn push_fails(&self, dir: &Path) -> String {
        let (ok, stdout, stderr) = self.run(&["push", dir.to_str().unwrap()]);
        assert!(!ok, "push succeeded: {stdout}");
        assert!(stdout.is_empty(), "stdout on failure: {stdout}");
        assert_eq!(self.manifests(), 0, "a failed push sealed a manifest");
        stderr
    }
}

#[test]
fn push_prints_the_digest_alone_and_round_trips() {
    let env = Env::new();
    let src = env.sample();
    let (ok, stdout, _) = env.run(&["push", src.to_str().unwrap()]);
    assert!(ok);
    let digest = stdout.trim();
    assert!(
        digest.starts_with("blake3:") && digest.len() == 71,
        "{stdout:?}"
    );

    let (ok, json, _) = env.run(&["push", src.to_str().unwrap(), "-o", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["digest"], digest);
    assert_eq!(v["bytes_uploaded"], 0);

    let out = env.path("out");
    let (ok, _, stderr) = env.run(&["pull", digest, out.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert_eq!(
        std::fs::read(out.join("weights.bin")).unwrap(),
        vec![7u8; 3 << 20]
    );

    let (ok, inspect, _) = env.run(&["inspect", digest, "-o", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(v["files"], 2);
    assert_eq!(v["directories"], 1);

    let (ok, text, _) = env.run(&["verify", digest]);
    assert!(ok && text.starts_with("OK"), "{text}");
    let (ok, ls, _) = env.run(&["ls"]);
    assert!(ok && ls.contains(digest), "{ls}");
}

#[test]
fn diff_reports_changes_and_upload_size() {
    let env = Env::new();
    let src = env.sample();
    let (_, a, _) = env.run(&["push", src.to_str().unwrap()]);
    std::fs::write(src.join("sub/config.json"), b"{\"v\":2}").unwrap();
    std::fs::write(src.join("new.txt"), b"new").unwrap();
    let (_, b, _) = env.run(&["push", src.to_str().unwrap()]);
    let (ok, out, _) = env.run(&["diff", a.trim(), b.trim(), "-o", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["added"], serde_json::json!(["new.txt"]));
    assert_eq!(v["changed"][0]["path"], "sub/config.json");
    assert_eq!(v["new_bytes"], 7 + 3);
}

/// Every file under `dir` with its bytes: what a command that must write nothing leaves.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p.clone());
            }
            let bytes = if p.is_file() {
                std::fs::read(&p).unwrap()
            } else {
                vec![]
            };
            out.push((p, bytes));
        }
    }
    out.sort();
    out
}

#[test]
fn push_dry_run_and_diff_of_a_directory_write_nothing() {
    let env = Env::new();
    let src = env.sample();
    let (ok, a, _) = env.run(&["push", src.to_str().unwrap()]);
    assert!(ok);
    let a = a.trim().to_owned();
    std::fs::write(src.join("sub/config.json"), b"{\"v\":2}").unwrap();
    // Bytes that do not repeat, so none of its chunks dedupe.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..2 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(src.join("new.bin"), noise).unwrap();
    std::fs::remove_dir_all(src.join("sub")).unwrap();
    std::fs::create_dir(src.join("sub")).unwrap();
    std::fs::write(src.join("sub/other.json"), b"[]").unwrap();
    let store = snapshot(&env.path("store"));
    let cache = snapshot(&env.path("cache"));

    // The dry run prints the digest the push will print, and what it would upload.
    let (ok, out, err) = env.run(&["push", "--dry-run", src.to_str().unwrap(), "-o", "json"]);
    assert!(ok, "{err}");
    let dry: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["already_in_store"], false);
    assert!(dry["chunks_to_upload"].as_u64().unwrap() >= 2, "{dry}");
    assert_eq!(dry["bytes_to_upload"], (2 << 20) + 2, "{dry}");
    let (ok, text, _) = env.run(&["push", "--dry-run", src.to_str().unwrap()]);
    assert!(ok);
    assert_eq!(text.trim(), dry["digest"], "the digest alone on stdout");

    // diff DIGEST DIR: what pushing the directory would change; --exit-code says they differ.
    let (ok, out, err) = env.run(&["diff", &a, src.to_str().unwrap(), "-o", "json"]);
    assert!(ok, "{err}");
    let d: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(d["to"], dry["digest"]);
    assert_eq!(d["same"], false);
    assert_eq!(d["added"], serde_json::json!(["new.bin", "sub/other.json"]));
    assert_eq!(d["removed"], serde_json::json!(["sub/config.json"]));
    assert_eq!(d["new_bytes"], (2 << 20) + 2);
    let out = env
        .sealed()
        .args(["diff", "--exit-code", src.to_str().unwrap(), &a])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "differ: exit 1");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("- new.bin") && text.contains("+ sub/config.json"),
        "{text}"
    );
    assert_eq!(
        snapshot(&env.path("store")),
        store,
        "a dry run or a diff wrote to the store"
    );
    assert_eq!(
        snapshot(&env.path("cache")),
        cache,
        "a dry run or a diff wrote the stat cache"
    );

    // Pushed, the same directory is the same version: exit 0, nothing more to upload.
    let (ok, b, _) = env.run(&["push", src.to_str().unwrap()]);
    assert!(ok);
    assert_eq!(b.trim(), dry["digest"]);
    let out = env
        .sealed()
        .args(["diff", "--exit-code", b.trim(), src.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, out, _) = env.run(&["push", "--dry-run", src.to_str().unwrap(), "-o", "json"]);
    assert!(ok);
    let dry: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(dry["already_in_store"], true);
    assert_eq!(dry["bytes_to_upload"], 0);
    // Two versions: --exit-code 1 when they differ, 0 against itself.
    let code = |x: &str, y: &str| {
        env.sealed()
            .args(["diff", "--exit-code", x, y])
            .output()
            .unwrap()
            .status
            .code()
    };
    assert_eq!(code(&a, b.trim()), Some(1));
    assert_eq!(code(&a, &a), Some(0));
    assert!(env.run(&["diff", &a, b.trim()]).0, "without --exit-code: 0");
}

#[test]
fn works_as_a_kubectl_plugin() {
    let env = Env::new();
    let bin = assert_cmd::cargo::cargo_bin("sealed");
    let plugin = env.path("kubectl-sealed");
    std::fs::copy(&bin, &plugin).unwrap();
    let out = Command::new(&plugin).arg("--help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("push"));
}

#[test]
fn bad_digests_are_named() {
    let env = Env::new();
    let (ok, _, err) = env.run(&["inspect", "blake3:1234"]);
    assert!(
        !ok && err.contains("malformed digest 'blake3:1234'"),
        "{err}"
    );
    let unknown = format!("blake3:{}", "ab".repeat(32));
    let (ok, _, err) = env.run(&["pull", &unknown, env.path("x").to_str().unwrap()]);
    assert!(
        !ok && err.contains("not found") && err.contains(&unknown),
        "{err}"
    );
    assert!(!env.path("x").exists());
}

#[test]
fn missing_store_is_named() {
    let env = Env::new();
    let src = env.sample();
    // Every command but push (which creates a file:// store) needs the store to exist.
    let out = env
        .sealed()
        .args(["--store", "file:///definitely/not/here", "inspect"])
        .arg(format!("blake3:{}", "ab".repeat(32)))
        .output()
        .unwrap();
    assert!(src.is_dir());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("/definitely/not/here") && err.contains("does not exist"),
        "{err}"
    );
    let (ok, _, err) = env.run(&["--store", "ftp://x/y", "ls"]);
    assert!(!ok && err.contains("unsupported scheme"), "{err}");
}

#[test]
fn special_files_are_refused() {
    let env = Env::new();
    let src = env.sample();
    let sock = src.join("control.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    assert!(env.push_fails(&src).contains("is a socket"));
    std::fs::remove_file(&sock).unwrap();

    let fifo = src.join("pipe");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let err = env.push_fails(&src);
    assert!(err.contains("pipe") && err.contains("FIFO"), "{err}");
    std::fs::remove_file(&fifo).unwrap();

    let dev = src.join("null");
    let path = std::ffi::CString::new(dev.as_os_str().as_bytes()).unwrap();
    // SAFETY: mknod with a valid C path; fails without privilege, which we then skip.
    let rc = unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    if rc == 0 {
        assert!(env.push_fails(&src).contains("is a device"));
        std::fs::remove_file(&dev).unwrap();
    } else {
        eprintln!("skipped the device case: mknod needs root");
    }
}

#[test]
fn non_utf8_names_are_refused() {
    let env = Env::new();
    let src = env.sample();
    std::fs::write(src.join(OsStr::from_bytes(b"bad-\xff-name")), b"x").unwrap();
    let err = env.push_fails(&src);
    assert!(err.contains("not valid UTF-8"), "{err}");
}

#[test]
fn symlink_loops_and_escapes_are_refused() {
    let env = Env::new();
    let src = env.sample();
    std::os::unix::fs::symlink("b", src.join("a")).unwrap();
    std::os::unix::fs::symlink("a", src.join("b")).unwrap();
    let err = env.push_fails(&src);
    assert!(err.contains("symlink loop"), "{err}");
    std::fs::remove_file(src.join("a")).unwrap();
    std::fs::remove_file(src.join("b")).unwrap();

    std::os::unix::fs::symlink("/etc/passwd", src.join("passwd")).unwrap();
    let err = env.push_fails(&src);
    assert!(
        err.contains("passwd") && err.contains("outside the volume"),
        "{err}"
    );
}

#[test]
fn unreadable_files_are_named() {
    let env = Env::new();
    let src = env.sample();
    let secret = src.join("secret.bin");
    std::fs::write(&secret, b"secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o000)).unwrap();
    // Root reads anything, so run the push as nobody (the store and tree are open to it).
    for p in [env.dir.path(), &src, &src.join("sub")] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(env.path("store"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let bin = assert_cmd::cargo::cargo_bin("sealed");
    let is_root = unsafe { libc::geteuid() } == 0;
    let out = if is_root {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(&bin)
            .args(["--store", &env.store_url(), "push"])
            .arg(&src)
            .output()
            .unwrap()
    } else {
        env.sealed().arg("push").arg(&src).output().unwrap()
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("secret.bin") && err.contains("Permission denied"),
        "{err}"
    );
    assert_eq!(env.manifests(), 0);
}

#[test]
fn corrupt_and_garbage_manifests_are_reported() {
    let env = Env::new();
    let src = env.sample();
    let (_, digest, _) = env.run(&["push", src.to_str().unwrap()]);
    let digest = digest.trim();
    let file = env.path("store/manifests").join(&digest["blake3:".len()..]);

    // Truncated in place: its bytes no longer hash to its name.
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, _, err) = env.run(&["inspect", digest]);
    assert!(!ok && err.contains("corrupt"), "{err}");

    // Garbage stored under its own hash: the hash matches, the parse refuses it.
    let garbage = b"SEALEDVM\x01\x00garbage";
    let name = blake3::hash(garbage).to_hex().to_string();
    std::fs::write(env.path("store/manifests").join(&name), garbage).unwrap();
    let (ok, _, err) = env.run(&[
        "pull",
        &format!("blake3:{name}"),
        env.path("o").to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("invalid manifest"), "{err}");
    assert!(!env.path("o").exists());
}

/// A non-empty destination is resumed into (cli/tests/papercuts.rs); only an entry the
/// version cannot take the place of is refused, by name, and nothing is written.
#[test]
fn pull_into_a_non_empty_destination_keeps_what_matches() {
    let env = Env::new();
    let src = env.sample();
    let (_, digest, _) = env.run(&["push", src.to_str().unwrap()]);
    // Into the tree it was pushed from: every file already matches.
    let (ok, _, err) = env.run(&["pull", digest.trim(), src.to_str().unwrap()]);
    assert!(
        ok && err.contains("(2 files, ") && err.contains("already there and verified"),
        "{err}"
    );
    // A directory where the version has a file is not removed.
    std::fs::remove_file(src.join("weights.bin")).unwrap();
    std::fs::create_dir(src.join("weights.bin")).unwrap();
    let (ok, _, err) = env.run(&["pull", digest.trim(), src.to_str().unwrap()]);
    assert!(!ok && err.contains("weights.bin"), "{err}");
    assert!(src.join("weights.bin").is_dir());
    assert!(!std::fs::read_dir(&src).unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .contains("sealed-partial")
    }));
}

/// A reader that stops early (`sealed ... | head`) ends the command quietly, without a panic.
#[test]
fn closed_stdout_is_not_a_panic() {
    let store = tempfile::tempdir().unwrap();
    let url = format!("file://{}", store.path().display());
    let src = tempfile::tempdir().unwrap();
    for i in 0..50 {
        std::fs::write(src.path().join(format!("f{i}")), format!("{i}")).unwrap();
    }
    let bin = assert_cmd::cargo::cargo_bin("sealed");
    let digest = std::process::Command::new(&bin)
        .args(["--store", &url, "--no-progress", "push"])
        .arg(src.path())
        .output()
        .unwrap();
    assert!(digest.status.success());
    let digest = String::from_utf8(digest.stdout).unwrap();
    let mut child = std::process::Command::new(&bin)
        .args(["--store", &url, "-o", "json", "inspect", digest.trim()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before the output is written
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn version_and_completions() {
    let env = Env::new();
    let (ok, out, _) = env.run(&["version"]);
    assert!(ok);
    assert_eq!(out.trim(), format!("sealed {}", env!("CARGO_PKG_VERSION")));
    let (ok, json, _) = env.run(&["version", "-o", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    let (ok, script, err) = env.run(&["completions", "bash"]);
    assert!(ok, "{err}");
    assert!(
        script.contains("_sealed") && script.contains("--follow-symlinks"),
        "not a bash completion of sealed"
    );
}
