//! What a user of the aws, kubectl and huggingface CLIs expects of `sealed`: a plain path is
//! a store, a malformed digest is a usage error (exit 2), `pull` resumes into a directory it
//! already wrote (keeping files whose content hashes right) and takes `--include`, and `ls`
//! does not pay one store round trip per version in a row.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

mod common;
use common::Env;

fn sample(env: &Env) -> std::path::PathBuf {
    let d = env.path("model");
    std::fs::create_dir_all(d.join("tokenizer")).unwrap();
    std::fs::create_dir_all(d.join("empty")).unwrap();
    let weights: Vec<u8> = (0..(3u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(d.join("model.safetensors"), &weights).unwrap();
    std::fs::write(d.join("config.json"), b"{\"layers\": 2}").unwrap();
    std::fs::write(d.join("tokenizer/tokenizer.json"), b"{\"vocab\": []}").unwrap();
    std::fs::write(d.join("README.md"), b"a model").unwrap();
    std::os::unix::fs::symlink("config.json", d.join("latest.json")).unwrap();
    d
}

fn code(env: &Env, args: &[&str]) -> (i32, String, String) {
    let out = env.sealed().args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_plain_path_is_a_file_store() {
    let env = Env::new();
    let src = sample(&env);
    let plain = env.path("plain store");
    let plain_arg = plain.to_str().unwrap();
    let (c, digest, err) = code(&env, &["--store", plain_arg, "push", src.to_str().unwrap()]);
    assert_eq!(c, 0, "{err}");
    let digest = digest.trim();
    assert!(
        plain.join("manifests").is_dir(),
        "push did not create the store at the path"
    );
    // The same store by its URL, and by a relative path from its parent.
    let url = url::Url::from_directory_path(&plain).unwrap().to_string();
    let (c, ls, err) = code(&env, &["--store", &url, "ls"]);
    assert!(c == 0 && ls.contains(digest), "{err}{ls}");
    let out = env
        .sealed()
        .current_dir(env.path(""))
        .args(["--store", "./plain store", "verify", digest])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SEALED_STORE takes a path too.
    let out = env
        .sealed()
        .env("SEALED_STORE", plain_arg)
        .args(["inspect", digest])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A mistyped scheme is not taken for a directory: the store says what is wrong with it,
    // and an unknown one is a usage error with a hint on how to write a store.
    let work = env.path("");
    let out = env
        .sealed()
        .current_dir(&work)
        .args(["--store", "s3:/bucket/models", "ls"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("s3:/bucket/models"),
        "{err}"
    );
    assert!(!work.join("s3:").exists(), "a directory was made of a URL");
    let (c, _, err) = code(&env, &["--store", "s4://bucket/models", "ls"]);
    assert_eq!(c, 2, "{err}");
    assert!(
        err.contains("file:///dir, or a plain directory path"),
        "{err}"
    );
}

#[test]
fn a_malformed_digest_is_a_usage_error() {
    let env = Env::new();
    let out = env.path("out");
    for args in [
        vec!["inspect", "blake3:1234"],
        vec!["pull", "blake3:not-hex", out.to_str().unwrap()],
        vec!["verify", "sha256:abcd"],
        vec!["diff", "blake3:zz", "blake3:yy"],
    ] {
        let (c, _, err) = code(&env, &args);
        assert_eq!(c, 2, "sealed {args:?}: {err}");
        assert!(err.contains("digest"), "{err}");
    }
    // A well-formed digest the store lacks stays "not found" (4).
    let unknown = format!("blake3:{}", "ab".repeat(32));
    let (c, _, err) = code(&env, &["inspect", &unknown]);
    assert_eq!(c, 4, "{err}");
}

fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = vec![];
    for e in walk(dir) {
        let rel = e.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
        let m = std::fs::symlink_metadata(&e).unwrap();
        let content = if m.is_symlink() {
            std::fs::read_link(&e)
                .unwrap()
                .to_string_lossy()
                .into_owned()
                .into_bytes()
        } else if m.is_dir() {
            b"<dir>".to_vec()
        } else {
            std::fs::read(&e).unwrap()
        };
        out.push((rel, content));
    }
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        out.push(p.clone());
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            out.extend(walk(&p));
        }
    }
    out
}

#[test]
fn pull_resumes_into_a_directory_it_wrote() {
    let env = Env::new();
    let src = sample(&env);
    let (c, digest, err) = code(&env, &["push", src.to_str().unwrap()]);
    assert_eq!(c, 0, "{err}");
    let digest = digest.trim();
    let out = env.path("out");
    let out_arg = out.to_str().unwrap();
    let (c, _, err) = code(&env, &["pull", digest, out_arg]);
    assert_eq!(c, 0, "{err}");

    // An interrupted or edited pull: one file gone, one cut short, one with other bytes of
    // the same size (only its hash tells), the link pointing elsewhere, a file of the user's.
    std::fs::remove_file(out.join("config.json")).unwrap();
    let weights = out.join("model.safetensors");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    std::fs::write(out.join("tokenizer/tokenizer.json"), b"{\"vocab\":[1]}").unwrap();
    std::fs::remove_file(out.join("latest.json")).unwrap();
    std::os::unix::fs::symlink("README.md", out.join("latest.json")).unwrap();
    std::fs::write(out.join("notes.txt"), b"mine").unwrap();
    let kept_inode = std::fs::metadata(out.join("README.md")).unwrap().ino();

    let (c, json, err) = code(&env, &["pull", digest, out_arg, "-o", "json"]);
    assert_eq!(c, 0, "a non-empty directory is resumed, not refused: {err}");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["files"], 4, "{json}");
    assert_eq!(
        report["files_kept"], 1,
        "only README.md hashed right: {json}"
    );
    assert_eq!(
        std::fs::metadata(out.join("README.md")).unwrap().ino(),
        kept_inode,
        "a file with the right content is kept, not written again"
    );
    let mut want = tree(&src);
    want.push(("notes.txt".into(), b"mine".to_vec()));
    want.sort();
    assert_eq!(
        tree(&out),
        want,
        "the version's files are back; the user's file is left"
    );
    assert!(
        walk(&out)
            .iter()
            .all(|p| !p.to_string_lossy().contains("sealed-partial")),
        "no partial file left"
    );

    // Run again: everything is kept, nothing fetched.
    let (c, _, err) = code(&env, &["pull", digest, out_arg]);
    assert_eq!(c, 0, "{err}");
    assert!(
        err.contains("4 files, ") && err.contains("already there and verified"),
        "{err}"
    );
}

#[test]
fn pull_include_takes_only_matching_files() {
    let env = Env::new();
    let src = sample(&env);
    let (c, digest, err) = code(&env, &["push", src.to_str().unwrap()]);
    assert_eq!(c, 0, "{err}");
    let out = env.path("json-only");
    let (c, _, err) = code(
        &env,
        &[
            "pull",
            digest.trim(),
            out.to_str().unwrap(),
            "--include",
            "*.json",
        ],
    );
    assert_eq!(c, 0, "{err}");
    let got: Vec<String> = tree(&out).into_iter().map(|(p, _)| p).collect();
    assert_eq!(
        got,
        [
            "config.json",
            "latest.json",
            "tokenizer",
            "tokenizer/tokenizer.json"
        ],
        "json files and the link, with the directory holding one; no empty directory"
    );
    assert_eq!(
        std::fs::read(out.join("tokenizer/tokenizer.json")).unwrap(),
        std::fs::read(src.join("tokenizer/tokenizer.json")).unwrap()
    );
    // Then the rest into the same directory: a resume that keeps the JSON files.
    let (c, _, err) = code(&env, &["pull", digest.trim(), out.to_str().unwrap()]);
    assert_eq!(c, 0, "{err}");
    assert_eq!(tree(&out), tree(&src));
}

/// A TCP proxy that holds every chunk a client sends for `delay` before passing it on: each
/// request to the store costs at least `delay`, as a far region's round trip does.
fn delaying_proxy(upstream: u16, delay: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            let (mut c_read, mut s_write) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (mut s_read, mut c_write) = (server, client);
            std::thread::spawn(move || {
                let mut buf = [0u8; 64 << 10];
                while let Ok(n @ 1..) = c_read.read(&mut buf) {
                    std::thread::sleep(delay);
                    if s_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_write.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s_read, &mut c_write);
                let _ = c_write.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    port
}

#[test]
fn ls_fetches_manifests_several_at_once() {
    let Some(moto) = sealed_test_support::servers::start_moto("listing", false) else {
        return;
    };
    const VERSIONS: usize = 12;
    const DELAY: Duration = Duration::from_millis(250);
    let env = Env::new();
    let s3 = |endpoint: &str| {
        let mut c = env.sealed();
        c.env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1")
            .env_remove("AWS_PROFILE")
            .args(["--store", "s3://listing/p", "--endpoint", endpoint]);
        c
    };
    let src = env.path("v");
    std::fs::create_dir(&src).unwrap();
    let mut digests = vec![];
    for i in 0..VERSIONS {
        std::fs::write(src.join("n.txt"), format!("version {i}")).unwrap();
        let out = s3(&moto.url)
            .args(["push", src.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        digests.push(String::from_utf8_lossy(&out.stdout).trim().to_owned());
    }
    let proxy = delaying_proxy(moto.port, DELAY);
    let t0 = Instant::now();
    let out = s3(&format!("http://127.0.0.1:{proxy}"))
        .arg("ls")
        .output()
        .unwrap();
    let took = t0.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for d in &digests {
        assert!(stdout.contains(d.as_str()), "{d} not listed: {stdout}");
    }
    // One manifest GET after another costs VERSIONS x DELAY (3 s) before anything else; the
    // listing and the store's probe take a few more round trips either way.
    let serial = DELAY * VERSIONS as u32;
    eprintln!("sealed ls of {VERSIONS} versions, {DELAY:?} per request: {took:?}");
    assert!(
        took < serial,
        "ls took {took:?}: the manifests were fetched one at a time ({serial:?} for them alone)"
    );
}
