//! `sealed sync oci://…` end to end with the real binary: an image with weights under
//! `/models`, pushed to a real registry on loopback with `crane append` (`crane registry
//! serve`, on PATH from `hack/build-test-tools.sh`), is synced into a `file://` store and
//! `sealed pull` gives back the same bytes; a second sync of the same digest prints the same
//! version; without the loopback and plain-http flags the registry is refused.
//!
//! Without crane the test is skipped with a message, unless `SEALED_REQUIRE_SERVERS=1` (CI).

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Env;

fn crane() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("crane"))
        .find(|p| p.is_file())
}

#[test]
fn sync_oci_image_then_pull() {
    let Some(crane) = crane() else {
        assert!(
            std::env::var("SEALED_REQUIRE_SERVERS").as_deref() != Ok("1"),
            "crane is not on PATH (hack/build-test-tools.sh builds it) and SEALED_REQUIRE_SERVERS=1"
        );
        eprintln!("SKIP: crane is not on PATH (hack/build-test-tools.sh builds it)");
        return;
    };
    let env = Env::new();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host = format!("127.0.0.1:{port}");
    let mut registry = Command::new(&crane)
        .args(["registry", "serve", "--address", &host])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&host).is_err() {
        assert!(
            Instant::now() < deadline,
            "crane registry serve did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let layer = env.path("layer");
    std::fs::create_dir_all(layer.join("models/tokenizer")).unwrap();
    let weights: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(layer.join("models/model.safetensors"), &weights).unwrap();
    std::fs::write(layer.join("models/tokenizer/vocab.json"), b"{\"a\": 1}").unwrap();
    std::fs::write(layer.join("README"), b"outside /models").unwrap();
    let tar = env.path("layer.tar");
    assert!(
        Command::new("tar")
            .arg("-C")
            .arg(&layer)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .status()
            .unwrap()
            .success()
    );
    let image = format!("{host}/serving/llm:v1");
    let out = Command::new(&crane)
        .arg("append")
        .arg("-f")
        .arg(&tar)
        .args(["-t", &image])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let source = format!("oci://{image}");
    let endpoint = format!("http://{host}");
    let sync = |extra: &[&str]| {
        let mut args = vec![
            "sync",
            source.as_str(),
            "--oci-path",
            "/models",
            "--volume",
            "ml/llm",
            "--source-endpoint",
            endpoint.as_str(),
        ];
        args.extend_from_slice(extra);
        env.run(&args)
    };
    // The policy is the operator's: loopback and plain http only when allowed.
    let (ok, _, err) = sync(&[]);
    assert!(!ok && err.contains("--allow-http-sources"), "{err}");
    let (ok, _, err) = sync(&["--allow-http-sources"]);
    assert!(!ok && err.contains("--allow-source-network"), "{err}");

    let allow = [
        "--allow-http-sources",
        "--allow-source-network",
        "127.0.0.0/8",
    ];
    let first = sync(&allow);
    let again = sync(&allow);
    let _ = registry.kill();
    let _ = registry.wait();
    let (ok, out, err) = first;
    assert!(ok, "{err}");
    let digest = out.trim().to_owned();
    assert!(digest.starts_with("blake3:"), "{out}");
    assert!(again.0, "{}", again.2);
    assert_eq!(
        again.1.trim(),
        digest,
        "the same digest syncs to the same version"
    );

    let dest = env.path("pulled");
    let (ok, _, err) = env.run(&["pull", &digest, dest.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(dest.join("model.safetensors")).unwrap(),
        weights
    );
    assert_eq!(
        std::fs::read(dest.join("tokenizer/vocab.json")).unwrap(),
        b"{\"a\": 1}"
    );
    assert!(!dest.join("README").exists() && !dest.join("models").exists());
}
