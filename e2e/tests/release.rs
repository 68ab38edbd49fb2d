//! The release workflow (`.github/workflows/release.yml`) cannot run here; actionlint checks
//! it (syntax, expressions, the shell of every `run:` step through shellcheck when present),
//! and the chart no longer names a script that does not exist.

use std::process::Command;

use sealed_test_support::servers::{missing, repo_root};

#[test]
fn the_release_workflow_passes_actionlint() {
    if missing("actionlint", "hack/build-test-tools.sh") {
        return;
    }
    let root = repo_root();
    let out = Command::new("actionlint")
        .arg(".github/workflows/release.yml")
        .current_dir(&root)
        .output()
        .expect("run actionlint");
    assert!(
        out.status.success(),
        "actionlint:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // It would fail on a broken workflow.
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.yml");
    std::fs::write(
        &bad,
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    steps:\n      - run: echo ${{ github.nope }}\n",
    )
    .expect("write");
    let out = Command::new("actionlint").arg(&bad).output().expect("run");
    assert!(!out.status.success(), "actionlint passed a broken workflow");
}

#[test]
fn the_workflow_calls_scripts_that_exist() {
    let root = repo_root();
    let workflow =
        std::fs::read_to_string(root.join(".github/workflows/release.yml")).expect("release.yml");
    for script in workflow
        .split_whitespace()
        .filter(|w| w.starts_with("hack/"))
    {
        assert!(
            root.join(script).is_file(),
            "release.yml calls {script}, which does not exist"
        );
    }
    let values = std::fs::read_to_string(root.join("charts/sealed-volumes/values.yaml"))
        .expect("values.yaml");
    assert!(
        !values.contains("build-images.sh"),
        "values.yaml names hack/build-images.sh"
    );
}

/// The CLI that `hack/release.sh` builds is static and runs on a machine without Rust or a C
/// library: `sealed --version` in a chroot that holds only the binary and a static busybox
/// (`hack/ci-cluster.sh` installs busybox-static). Its archive's sum is in SHA256SUMS and in
/// the krew manifest, and its SBOM is CycloneDX.
///
/// A release build of the CLI takes many minutes on a CI machine: this runs `hack/release.sh`
/// only with `SEALED_RELEASE_TEST=1`; otherwise it checks the archive already in `dist/` (a
/// run of the script) and skips, saying so, when there is none.
#[test]
fn the_release_cli_runs_in_an_empty_chroot() {
    const TEST: &str = "the_release_cli_runs_in_an_empty_chroot";
    let root = repo_root();
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => {
            eprintln!("{TEST}: skipped: no release build for {other}");
            return;
        }
    };
    let scratch = tempfile::tempdir().expect("tempdir");
    let dist = if std::env::var("SEALED_RELEASE_TEST").is_ok_and(|v| v == "1") {
        let dist = scratch.path().join("dist");
        let out = Command::new(root.join("hack/release.sh"))
            .env("SEALED_RELEASE_DIR", &dist)
            .current_dir(&root)
            .status()
            .expect("run hack/release.sh");
        assert!(out.success(), "hack/release.sh failed ({out})");
        dist
    } else {
        root.join("dist")
    };
    let archive = std::fs::read_dir(&dist).ok().and_then(|entries| {
        entries.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(&format!("-linux-{arch}.tar.gz")))
        })
    });
    let Some(archive) = archive else {
        eprintln!(
            "{TEST}: skipped: no dist/sealed-*-linux-{arch}.tar.gz (a release build takes \
             minutes: run hack/release.sh, or set SEALED_RELEASE_TEST=1)"
        );
        return;
    };
    let name = archive
        .file_name()
        .and_then(|n| n.to_str())
        .expect("archive name")
        .to_owned();

    // The sums and the krew manifest name this very archive.
    let sums = std::fs::read_to_string(dist.join("SHA256SUMS")).expect("SHA256SUMS");
    let out = Command::new("sha256sum")
        .arg(&archive)
        .output()
        .expect("sha256sum");
    let sum = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a sum")
        .to_owned();
    assert!(
        sums.contains(&format!("{sum}  {name}")),
        "{name} not in SHA256SUMS:\n{sums}"
    );
    let krew = std::fs::read_to_string(dist.join("sealed.yaml")).expect("krew manifest");
    assert!(
        krew.contains(&format!("sha256: {sum}")) && krew.contains(&name),
        "the krew manifest does not name {name} with its sum:\n{krew}"
    );
    let sbom_path = dist.join(name.replace(".tar.gz", ".cdx.json"));
    let sbom: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&sbom_path).expect("SBOM")).expect("SBOM JSON");
    assert_eq!(sbom["bomFormat"], "CycloneDX");
    assert!(sbom["components"].as_array().is_some_and(|c| c.len() > 20));

    // The chroot: the binary and busybox, no /lib, no /usr.
    let jail = scratch.path().join("jail");
    std::fs::create_dir_all(jail.join("bin")).expect("jail");
    let untar = Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(jail.join("bin"))
        .status()
        .expect("tar");
    assert!(untar.success());
    let Ok(busybox) = std::fs::read("/bin/busybox") else {
        eprintln!("{TEST}: skipped: no /bin/busybox (hack/ci-cluster.sh installs busybox-static)");
        return;
    };
    std::fs::write(jail.join("bin/busybox"), busybox).expect("busybox");
    Command::new("chmod")
        .args(["755"])
        .arg(jail.join("bin/busybox"))
        .status()
        .expect("chmod");
    let run = Command::new("chroot")
        .arg(&jail)
        .args([
            "/bin/busybox",
            "sh",
            "-c",
            "test ! -e /lib && test ! -e /usr && /bin/sealed --version",
        ])
        // Nothing of this machine's environment; PATH only to find chroot itself.
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .expect("run chroot");
    if !run.status.success()
        && String::from_utf8_lossy(&run.stderr).contains("Operation not permitted")
    {
        eprintln!("{TEST}: skipped: chroot needs root");
        return;
    }
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.starts_with("sealed "),
        "sealed --version in the chroot: {}\n{stdout}{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let version = name
        .trim_start_matches("sealed-")
        .split("-linux-")
        .next()
        .expect("version");
    assert!(
        stdout.contains(version),
        "{stdout} is not version {version}"
    );
}
