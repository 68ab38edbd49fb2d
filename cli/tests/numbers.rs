//! Numbers and addresses users type (issue 12, item 7): absurd values are refused at parse
//! time with a message that names the flag, the value and the bound, never a panic (exit
//! code 101) in the middle of an operation. And a tree whose symlinks leave it through each
//! other is refused by `push` (item 5).

mod common;
use common::Env;

/// Runs `sealed ARGS` expecting a clear refusal: not a panic, a non-zero exit, every needle
/// in stderr. Returns stderr.
fn refused(env: &Env, args: &[&str], needles: &[&str]) -> String {
    let out = env.sealed().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = out.status.code();
    assert_ne!(code, Some(101), "sealed {args:?} panicked: {stderr}");
    assert!(!out.status.success(), "sealed {args:?} succeeded");
    assert!(!stderr.contains("panicked"), "sealed {args:?}: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "sealed {args:?}: no {n:?} in: {stderr}");
    }
    stderr
}

fn pushed(env: &Env) -> String {
    let d = env.path("model");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("w.bin"), b"weights").unwrap();
    let (ok, stdout, stderr) = env.run(&["push", d.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    stdout.trim().to_owned()
}

#[test]
fn a_retention_past_a_hundred_years_is_refused_not_a_panic() {
    let env = Env::new();
    let digest = pushed(&env);
    refused(
        &env,
        &["rm", &digest, "--retention", "3000000000h"],
        &["--retention", "3000000000h", "876000h"],
    );
    refused(
        &env,
        &["rm", &digest, "--retention", "876001h"],
        &["876000h"],
    );
    // Still live.
    let (ok, _, stderr) = env.run(&["verify", &digest]);
    assert!(ok, "{stderr}");
    // The bound itself is accepted.
    let (ok, _, stderr) = env.run(&["rm", &digest, "--retention", "876000h"]);
    assert!(ok, "{stderr}");
}

#[test]
fn a_grace_past_a_hundred_years_is_refused_not_a_panic() {
    let env = Env::new();
    refused(
        &env,
        &["gc", "--grace", "3000000000h"],
        &["--grace", "3000000000h", "876000h"],
    );
    refused(
        &env,
        &["gc", "--writer-wait", "3000000000h"],
        &["--writer-wait", "876000h"],
    );
    let (ok, _, stderr) = env.run(&["gc", "--grace", "1h"]);
    assert!(ok, "{stderr}");
}

#[test]
fn timeouts_and_retries_are_bounded() {
    let env = Env::new();
    refused(
        &env,
        &["--timeout", "18446744073709551615", "ls"],
        &["--timeout", "18446744073709551615"],
    );
    refused(&env, &["--timeout", "86401", "ls"], &["--timeout", "86400"]);
    refused(&env, &["--timeout", "0", "ls"], &["--timeout"]);
    refused(
        &env,
        &["--retries", "4294967295", "ls"],
        &["--retries", "4294967295", "100"],
    );
    refused(
        &env,
        &["--retries", "18446744073709551616", "ls"],
        &["--retries"],
    );
    // SEALED_STORE_TIMEOUT goes through the same parser.
    let out = env
        .sealed()
        .env("SEALED_STORE_TIMEOUT", "18446744073709551615")
        .arg("ls")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // The bounds themselves work.
    let (ok, _, stderr) = env.run(&["--timeout", "86400", "--retries", "100", "ls"]);
    assert!(ok, "{stderr}");
    refused(
        &env,
        &[
            "sync",
            "hf://org/repo",
            "--volume",
            "ns/name",
            "--wait-timeout",
            "18446744073709551615",
        ],
        &["--wait-timeout"],
    );
}

#[test]
fn an_endpoint_without_a_scheme_is_refused_at_parse_time() {
    let env = Env::new();
    let msg =
        "--endpoint 127.0.0.1:9 has no scheme: write http://127.0.0.1:9 or https://127.0.0.1:9";
    refused(
        &env,
        &["--store", "s3://bucket", "--endpoint", "127.0.0.1:9", "ls"],
        &[msg],
    );
    let out = env
        .sealed()
        .env("SEALED_STORE_ENDPOINT", "127.0.0.1:9")
        .args(["--store", "s3://bucket", "ls"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(msg), "{stderr}");
    refused(
        &env,
        &[
            "--store",
            "s3://bucket",
            "--endpoint",
            "ftp://127.0.0.1:9",
            "ls",
        ],
        &["--endpoint ftp://127.0.0.1:9", "http://"],
    );
}

#[test]
fn push_refuses_links_that_leave_the_tree_through_each_other() {
    let env = Env::new();
    let src = env.path("model");
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("w.bin"), b"weights").unwrap();
    std::os::unix::fs::symlink("..", src.join("a/up")).unwrap();
    std::os::unix::fs::symlink("a/up/../..", src.join("esc")).unwrap();
    let stderr = refused(
        &env,
        &["push", src.to_str().unwrap()],
        &["esc", "'a/up'", "outside the volume"],
    );
    assert!(!stderr.contains("w.bin"), "{stderr}");
    assert!(
        std::fs::read_dir(env.path("store/manifests"))
            .map(|d| d.count())
            .unwrap_or(0)
            == 0,
        "sealed a manifest"
    );
}
