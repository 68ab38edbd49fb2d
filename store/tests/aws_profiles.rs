//! AWS profiles without keys of their own, against moto with its IAM checks on (only keys
//! moto issued pass, and only for what their policies allow): an assume-role profile
//! (`role_arn` + `source_profile`, STS AssumeRole at moto's STS), an SSO-style profile
//! (`credential_process`, as `aws configure export-credentials` of an SSO login prints), and
//! an `sso_session` profile run through the aws CLI (a stub `aws` on PATH here, printing
//! what the real one prints). Each writes and reads a chunk through `ChunkStore::connect`
//! with `AWS_PROFILE` set. The source user may not touch S3 itself: the chunk is written
//! with the role's credentials or not at all.
//!
//! One test in this binary: it sets the process environment (AWS_*, PATH).

use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use sealed_store::{ChunkStore, StoreOptions};
use sealed_store::{Digest, Error};
use sealed_test_support::servers::missing;

const BUCKET: &str = "profiles";
/// moto's default account.
const ACCOUNT: &str = "123456789012";

/// Creates the bucket, a user that may only assume roles, the role (S3 allowed) and a user
/// allowed S3 directly (the SSO-style profile's), and prints their keys.
const SETUP: &str = r#"
import boto3, json, sys
url = sys.argv[1]
kw = dict(endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup", aws_secret_access_key="setup")
boto3.client("s3", **kw).create_bucket(Bucket="profiles")
iam = boto3.client("iam", **kw)
allow = lambda action: json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": action, "Resource": "*"}]})
iam.create_user(UserName="alice")
alice = iam.create_access_key(UserName="alice")["AccessKey"]
iam.put_user_policy(UserName="alice", PolicyName="assume", PolicyDocument=allow("sts:AssumeRole"))
trust = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::123456789012:user/alice"}, "Action": "sts:AssumeRole"}]})
iam.create_role(RoleName="reader", AssumeRolePolicyDocument=trust)
iam.put_role_policy(RoleName="reader", PolicyName="s3", PolicyDocument=allow("s3:*"))
iam.create_user(UserName="bob")
bob = iam.create_access_key(UserName="bob")["AccessKey"]
iam.put_user_policy(UserName="bob", PolicyName="s3", PolicyDocument=allow("s3:*"))
print(json.dumps({"alice": [alice["AccessKeyId"], alice["SecretAccessKey"]], "bob": [bob["AccessKeyId"], bob["SecretAccessKey"]]}))
"#;
/// The requests SETUP makes, free of IAM checks; every later one is checked.
const SETUP_REQUESTS: u32 = 9;

struct Moto(std::process::Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn write_and_read(profile: &str) -> Result<(), Error> {
    // SAFETY (edition 2024 set_var): the only test of this binary; nothing else reads the
    // environment concurrently except the store code this very task runs.
    unsafe { std::env::set_var("AWS_PROFILE", profile) };
    let opts = StoreOptions {
        retries: 0,
        timeout: Duration::from_secs(20),
        ..StoreOptions::default()
    };
    let store = ChunkStore::connect(&format!("s3://{BUCKET}/{profile}"), &opts)?;
    let data = Bytes::from(format!("written with AWS profile {profile}"));
    let digest = Digest::of(&data);
    store.put_chunk(&digest, data.clone()).await?;
    assert_eq!(store.get_chunk(&digest).await?, data);
    Ok(())
}

#[tokio::test]
async fn assume_role_and_sso_style_profiles_work_against_moto() {
    if missing("moto_server", "pip install 'moto[server]'") {
        return;
    }
    let port = free_port();
    let _moto = Moto(
        Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .env("INITIAL_NO_AUTH_ACTION_COUNT", SETUP_REQUESTS.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server"),
    );
    let url = format!("http://127.0.0.1:{port}");
    let mut keys = None;
    for _ in 0..60 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            let out = Command::new("python3")
                .args(["-c", SETUP, &url])
                .output()
                .expect("python3");
            assert!(
                out.status.success(),
                "moto setup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            keys = Some(serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("keys"));
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let keys = keys.expect("moto_server did not open its port");
    let key = |who: &str, i: usize| keys[who][i].as_str().expect("a key").to_owned();

    let dir = tempfile::tempdir().unwrap();
    let credentials = dir.path().join("credentials");
    let config = dir.path().join("config");
    std::fs::write(
        &credentials,
        format!(
            "[alice]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
            key("alice", 0),
            key("alice", 1)
        ),
    )
    .unwrap();
    let bob_json = format!(
        r#"{{"Version": 1, "AccessKeyId": "{}", "SecretAccessKey": "{}", "Expiration": "2999-01-01T00:00:00Z"}}"#,
        key("bob", 0),
        key("bob", 1)
    );
    let process = dir.path().join("export-credentials");
    std::fs::write(
        &process,
        format!("#!/bin/sh\ncat <<'EOF'\n{bob_json}\nEOF\n"),
    )
    .unwrap();
    // The aws CLI as an SSO profile runs it: `aws configure export-credentials --profile
    // corp --format process` prints the session's keys (bob's here).
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::write(
        bin.join("aws"),
        format!(
            "#!/bin/sh\n[ \"$*\" = \"configure export-credentials --profile corp --format process\" ] || \
             {{ echo \"unexpected: $*\" >&2; exit 2; }}\nexec {}\n",
            process.display()
        ),
    )
    .unwrap();
    for f in [&process, &bin.join("aws")] {
        Command::new("chmod").arg("755").arg(f).status().unwrap();
    }
    std::fs::write(
        &config,
        format!(
            "[profile alice]\nregion = us-east-1\n\
             [profile reader]\nrole_arn = arn:aws:iam::{ACCOUNT}:role/reader\n\
             source_profile = alice\nrole_session_name = sealed-test\nregion = us-east-1\n\
             [profile exported]\ncredential_process = {}\nregion = us-east-1\n\
             [profile corp]\nsso_session = corp\nsso_account_id = {ACCOUNT}\n\
             sso_role_name = reader\nregion = us-east-1\n\
             [sso-session corp]\nsso_start_url = https://corp.awsapps.com/start\nsso_region = us-east-1\n",
            process.display()
        ),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: see write_and_read.
    unsafe {
        for k in [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL_STS",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_ROLE_ARN",
        ] {
            std::env::remove_var(k);
        }
        std::env::set_var("AWS_CONFIG_FILE", &config);
        std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", &credentials);
        std::env::set_var("AWS_ENDPOINT_URL", &url);
        std::env::set_var("AWS_REGION", "us-east-1");
        std::env::set_var("PATH", path);
    }

    // The source user alone may not write: moto's IAM checks are on.
    let denied = write_and_read("alice").await;
    assert!(
        denied.is_err(),
        "alice wrote without the role: moto checks nothing"
    );
    for profile in ["reader", "exported", "corp"] {
        if let Err(e) = write_and_read(profile).await {
            panic!("AWS profile {profile}: {e}");
        }
    }
}
