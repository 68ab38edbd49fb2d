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
