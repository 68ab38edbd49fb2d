//! The README's first command, `hack/demo.sh`, run as a newcomer runs it (with this build's
//! `sealed` and a fresh home): it uses a store of its own, neither the default store nor the
//! one `SEALED_STORE` names; the second push uploads
//! only the changed chunks, the pull round-trips, and where FUSE is available the version is
//! mounted by digest, read through the mount and unmounted.

use std::path::Path;
use std::process::Command;

/// `(bytes, chunks)` from a push's summary line: "… uploaded 1.0 MiB (2 chunks), …".
fn uploaded(summary: &str) -> Option<(String, u64)> {
    let rest = summary.split("uploaded ").nth(1)?;
    let (size, rest) = rest.split_once(" (")?;
    let chunks = rest.split_once(' ')?.0.parse().ok()?;
    Some((size.to_owned(), chunks))
}

#[test]
fn the_demo_pushes_pulls_and_mounts_by_digest() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let home = tempfile::tempdir().unwrap();
    // The user's own store, which the demo must leave alone.
    let users_store = home.path().join("users-store");
    std::fs::create_dir(&users_store).unwrap();
    let out = Command::new("bash")
        .arg(repo.join("hack/demo.sh"))
        .env("SEALED_BIN", env!("CARGO_BIN_EXE_sealed"))
        .env("HOME", home.path())
        .env("XDG_DATA_HOME", home.path().join("data"))
        .env("XDG_CACHE_HOME", home.path().join("cache"))
        .env("SEALED_STORE", format!("file://{}", users_store.display()))
        .env_remove("SEALED_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // Neither the embedded default store nor the user's SEALED_STORE got anything.
    assert!(
        !home.path().join("data/sealed-volumes/store").exists(),
        "the demo wrote into the default store: {stderr}"
    );
    assert_eq!(
        std::fs::read_dir(&users_store).unwrap().count(),
        0,
        "the demo wrote into SEALED_STORE: {stderr}"
    );
    assert!(stderr.contains("the demo's own"), "{stderr}");

    let pushes: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("sealed ") && l.contains(" uploaded "))
        .collect();
    assert_eq!(pushes.len(), 2, "two push summaries expected: {stderr}");
    let (_, first_chunks) = uploaded(pushes[0]).unwrap();
    let (second_bytes, second_chunks) = uploaded(pushes[1]).unwrap();
    // 48 MiB of weights is about 48 chunks; a 4 KiB edit and a new config upload a few.
    assert!(first_chunks >= 40, "first push: {}", pushes[0]);
    assert!(
        (1..=4).contains(&second_chunks),
        "the second push uploaded {second_chunks} chunks ({second_bytes}): {}",
        pushes[1]
    );
    assert!(
        stdout.contains("pulled tree is byte-identical"),
        "no pull round-trip: {stdout}"
    );

    // SAFETY: geteuid has no preconditions.
    let can_mount = Path::new("/dev/fuse").exists() && unsafe { libc::geteuid() } == 0;
    if can_mount {
        assert!(
            stdout.contains("unmounted ") || stderr.contains("unmounted "),
            "no unmount: {stdout}\n{stderr}"
        );
        for want in ["mounted in ", "through the mount in "] {
            assert!(
                stdout.contains(want),
                "no {want:?} line: {stdout}\n{stderr}"
            );
        }
        assert!(
            stdout.contains("read 50331952 bytes of model.safetensors"),
            "the model was not read through the mount: {stdout}"
        );
        assert!(!stderr.contains("skipped the mount"), "{stderr}");
    } else {
        // Without root the demo may still mount through fusermount3; it is not checked here.
        eprintln!("the mount part is not checked here: it needs root and /dev/fuse");
    }
}
