//! The store configured the way the cloud CLIs are: `AWS_PROFILE` and `~/.aws/*` in a
//! temporary HOME, `AWS_ENDPOINT_URL`, Azure's connection string, against real servers
//! (moto, Azurite).

use std::path::Path;
use std::process::Command;

use sealed_test_support::servers::{AZURITE_ACCOUNT, AZURITE_KEY, start_azurite, start_moto};

mod common;
use common::Env;

/// `sealed` with a HOME of its own and no cloud variables from the test's environment.
fn clean(env: &Env, home: &Path) -> Command {
    let mut c = env.sealed();
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || k.starts_with("AZURE_") || k.starts_with("GOOGLE_") {
            c.env_remove(k);
        }
    }
    c.env_remove("SEALED_STORE_ENDPOINT").env("HOME", home);
    c
}

fn run(mut c: Command) -> (i32, String, String) {
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn sample(env: &Env) -> String {
    let d = env.path("model");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("w.bin"), vec![5u8; 300 << 10]).unwrap();
    d.to_str().unwrap().to_owned()
}

#[test]
fn aws_profile_from_the_shared_files_gives_keys_region_and_endpoint() {
    let Some(moto) = start_moto("profiled", false) else {
        return;
    };
    let env = Env::new();
    let home = env.path("home");
    std::fs::create_dir_all(home.join(".aws")).unwrap();
    std::fs::write(
        home.join(".aws/credentials"),
        "[default]\naws_access_key_id = nope\n\n[ml]\naws_access_key_id = AKID\naws_secret_access_key = SECRET\n",
    )
    .unwrap();
    std::fs::write(
        home.join(".aws/config"),
        format!(
            "[profile ml]\nregion = eu-west-1\nendpoint_url = {}\n",
            moto.url
        ),
    )
    .unwrap();
    let src = sample(&env);
    let mut c = clean(&env, &home);
    c.env("AWS_PROFILE", "ml")
        .args(["--store", "s3://profiled/m", "push", &src]);
    let (code, digest, err) = run(c);
    assert_eq!(code, 0, "{err}");
    let mut c = clean(&env, &home);
    c.env("AWS_PROFILE", "ml")
        .args(["--store", "s3://profiled/m", "ls"]);
    let (code, ls, err) = run(c);
    assert_eq!(code, 0, "{err}");
    assert!(ls.contains(digest.trim()), "{ls}");

    // A profile that is in neither file is named, with the files looked in.
    let mut c = clean(&env, &home);
    c.env("AWS_PROFILE", "typo")
        .args(["--store", "s3://profiled/m", "ls"]);
    let (code, _, err) = run(c);
    assert_ne!(code, 0);
    assert!(
        err.contains("AWS_PROFILE=typo") && err.contains(".aws/credentials"),
        "{err}"
    );
}

#[test]
fn aws_endpoint_url_is_used_and_a_schemeless_one_refused_by_name() {
    let Some(moto) = start_moto("by-env", false) else {
        return;
    };
    let env = Env::new();
    let home = env.path("home");
    std::fs::create_dir_all(&home).unwrap();
    let src = sample(&env);
    let mut c = clean(&env, &home);
    c.env("AWS_ENDPOINT_URL", &moto.url)
        .env("AWS_ACCESS_KEY_ID", "k")
        .env("AWS_SECRET_ACCESS_KEY", "s")
        .args(["--store", "s3://by-env/x", "push", &src]);
    let (code, digest, err) = run(c);
    assert_eq!(code, 0, "{err}");
    assert!(digest.starts_with("blake3:"), "{digest}");

    let mut c = clean(&env, &home);
    c.env("AWS_ENDPOINT_URL", format!("127.0.0.1:{}", moto.port))
        .env("AWS_ACCESS_KEY_ID", "k")
        .env("AWS_SECRET_ACCESS_KEY", "s")
        .args(["--store", "s3://by-env/x", "ls"]);
    let (code, _, err) = run(c);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("(from AWS_ENDPOINT_URL) has no scheme: write http://127.0.0.1"),
        "{err}"
    );
}

#[test]
fn azure_connection_string_names_account_key_and_endpoint() {
    let Some(azurite) = start_azurite("models") else {
        return;
    };
    let env = Env::new();
    let home = env.path("home");
    std::fs::create_dir_all(&home).unwrap();
    let src = sample(&env);
    let cs = format!(
        "DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={};",
        azurite.url
    );
    let mut c = clean(&env, &home);
    c.env("AZURE_STORAGE_CONNECTION_STRING", &cs)
        .args(["--store", "az://models/cs", "push", &src]);
    let (code, digest, err) = run(c);
    assert_eq!(code, 0, "{err}");
    let mut c = clean(&env, &home);
    c.env("AZURE_STORAGE_CONNECTION_STRING", &cs).args([
        "--store",
        "az://models/cs",
        "verify",
        digest.trim(),
    ]);
    let (code, out, err) = run(c);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("OK"), "{out}");
}
