//! How a failed command ends: the error chain once, cause last, a hint, and an exit code a
//! script can act on (the table in `sealed --help`), each against a real store.

use std::process::Command;

mod common;
use common::Env;

fn code(cmd: &mut Command) -> (i32, String) {
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// No level of the chain is printed twice: each "caused by" line appears once, and no line
/// contains the one after it.
fn assert_chain_once(stderr: &str) {
    let lines: Vec<&str> = stderr
        .lines()
        .filter_map(|l| {
            l.strip_prefix("error: ")
                .or_else(|| l.strip_prefix("  caused by: "))
        })
        .collect();
    assert!(!lines.is_empty(), "{stderr}");
    for pair in lines.windows(2) {
        assert!(!pair[0].contains(pair[1]), "repeated: {stderr}");
    }
}

#[test]
fn help_documents_the_exit_codes() {
    let env = Env::new();
    let (ok, out, _) = env.run(&["--help"]);
    assert!(ok);
    for line in [
        "2  usage",
        "3  the version is corrupt",
        "4  not found",
        "5  the store is unreachable",
    ] {
        assert!(out.contains(line), "{line} missing from --help:\n{out}");
    }
}

#[test]
fn usage_not_found_and_corrupt_have_their_codes() {
    let env = Env::new();
    assert_eq!(code(env.sealed().args(["push"])).0, 2, "missing argument");
    assert_eq!(code(env.sealed().args(["--store", "ftp://x/y", "ls"])).0, 2);

    let unknown = format!("blake3:{}", "ab".repeat(32));
    let (c, err) = code(env.sealed().args(["inspect", &unknown]));
    assert_eq!(c, 4, "{err}");
    assert!(err.contains("not found") && err.contains(&unknown), "{err}");
    assert_chain_once(&err);
    let (c, _) = code(
        env.sealed()
            .args(["--store", "file:///definitely/not/here", "ls"]),
    );
    assert_eq!(c, 4);

    // A chunk removed from the store: verify says which, exits 3; pull fails with 3 too.
    let src = env.path("model");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("w.bin"), vec![3u8; 1 << 20]).unwrap();
    let (ok, digest, _) = env.run(&["push", src.to_str().unwrap()]);
    assert!(ok);
    let digest = digest.trim();
    let chunks = env.path("store/chunks");
    let victim = walk(&chunks).pop().expect("a chunk file");
    std::fs::remove_file(victim).unwrap();
    let (c, _) = code(env.sealed().args(["verify", digest]));
    assert_eq!(c, 3, "verify of an incomplete version");
    let (c, err) = code(
        env.sealed()
            .args(["pull", digest, env.path("out").to_str().unwrap()]),
    );
    assert_eq!(c, 3, "{err}");
    assert!(err.contains("hint: "), "{err}");
    assert_chain_once(&err);
}

#[test]
fn an_unreachable_store_exits_5_with_its_cause_once() {
    let env = Env::new();
    let port = sealed_test_support::servers::free_port();
    let (c, err) = code(
        env.sealed()
            .env("AWS_ACCESS_KEY_ID", "k")
            .env("AWS_SECRET_ACCESS_KEY", "s")
            .args(["--store", "s3://b/p", "--timeout", "1", "--retries", "0"])
            .args(["--endpoint", &format!("http://127.0.0.1:{port}"), "ls"]),
    );
    assert_eq!(c, 5, "{err}");
    assert!(
        err.trim_end().lines().last().unwrap().starts_with("hint: "),
        "{err}"
    );
    assert!(err.contains("Connection refused"), "{err}");
    assert_chain_once(&err);
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
}

#[test]
fn a_store_refusing_the_credentials_exits_5() {
    let Some(moto) = sealed_test_support::servers::start_moto("locked", true) else {
        return;
    };
    let env = Env::new();
    let (c, err) = code(
        env.sealed()
            .env("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
            .env(
                "AWS_SECRET_ACCESS_KEY",
                "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            )
            .args(["--store", "s3://locked/p", "--retries", "0"])
            .args(["--endpoint", &moto.url, "ls"]),
    );
    assert_eq!(c, 5, "{err}");
    assert!(err.contains("credentials"), "{err}");
    assert_chain_once(&err);
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
