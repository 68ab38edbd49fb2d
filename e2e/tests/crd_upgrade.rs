//! `helm upgrade` updates the CRDs (issue 39): from the previous chart (the chart as it was
//! before the last change of the CRDs' schema, read from git history) to this one, on the real
//! API server of the test cluster.
//!
//! Both charts are cut down to their CRDs (every other template removed) and the CRDs' group
//! renamed to `upgrade-test.sealedvolumes.io`, so that the test neither installs an operator
//! nor puts an old schema under the CRDs other tests on the shared cluster use. What it
//! checks is helm's: the previous chart's CRDs (in its crds/ directory: installed once, never
//! upgraded) are taken over by `helm upgrade --take-ownership` (docs/helm.md, "Upgrading")
//! and get the new schema; a second upgrade keeps them; `helm uninstall` leaves them (keep
//! policy). A few seconds.
//!
//! Runs with `SEALED_E2E_CLUSTER=1` (skips, saying so, without), in a git checkout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::DeleteParams;
use serde_json::Value;

const CHART: &str = "charts/sealed-volumes";
const GROUP: &str = "sealedvolumes.io";
const TEST_GROUP: &str = "upgrade-test.sealedvolumes.io";
const RELEASE: &str = "crd-upgrade";
/// The CRD whose schema the previous chart's differs from (spec.warm came after it).
const PLURAL: &str = "sealedvolumes";
const STORE: &str = "store.url=s3://models/sealed";

fn root() -> PathBuf {
    sealed_e2e::repo_root()
}

fn run(what: &str, cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("cannot run {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn helm_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("SEALED_HELM") {
        return Ok(PathBuf::from(path));
    }
    let dir = run(
        "hack/build-k8s.sh --print-bin-dir",
        Command::new(root().join("hack/build-k8s.sh")).arg("--print-bin-dir"),
    )?;
    let helm = Path::new(dir.trim()).join("helm");
    ensure!(helm.is_file(), "no helm at {}", helm.display());
    Ok(helm)
}

/// The commit before the last one that changed the generated CRDs: its chart is "the
/// previous chart" (reproducible from history, and its CRD schema differs from ours).
/// `None` when the history is not here: a shallow clone that cannot be deepened.
fn previous_chart_commit() -> Result<Option<String>> {
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(root())
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
    };
    let shallow = git(&["rev-parse", "--is-shallow-repository"])
        .is_some_and(|out| out.stdout.starts_with(b"true"));
    // A shallow clone's oldest commit has no parent here: deepen it once if its remote
    // answers, else the caller skips.
    if shallow && git(&["fetch", "--quiet", "--unshallow"]).is_none() {
        return Ok(None);
    }
    let last = run(
        "git log",
        Command::new("git").current_dir(root()).args([
            "log",
            "-n1",
            "--format=%H",
            "--",
            "crds/yaml",
        ]),
    )?;
    let last = last.trim();
    ensure!(!last.is_empty(), "no commit changed crds/yaml");
    Ok(Some(format!("{last}^")))
}

/// Copies the chart at `commit` (None: the working tree) into `dir`, keeping only what
/// renders the CRDs, with the CRDs' group renamed to [`TEST_GROUP`].
fn cut_down_chart(commit: Option<&str>, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    match commit {
        Some(commit) => {
            let archive = Command::new("git")
                .current_dir(root())
                .args(["archive", "--format=tar", commit, CHART])
                .output()
                .context("git archive")?;
            ensure!(
                archive.status.success(),
                "git archive {commit} {CHART} failed"
            );
            let mut tar = Command::new("tar")
                .args(["-x", "--strip-components=2", "-C"])
                .arg(dir)
                .stdin(std::process::Stdio::piped())
                .spawn()
                .context("tar")?;
            use std::io::Write;
            tar.stdin
                .take()
                .context("tar stdin")?
                .write_all(&archive.stdout)?;
            ensure!(tar.wait()?.success(), "tar -x failed");
        }
        None => {
            run(
                "cp -r",
                Command::new("cp")
                    .arg("-r")
                    .arg(root().join(CHART).join("."))
                    .arg(dir),
            )?;
        }
    }
    // Only the CRDs: no operator, plugin, CSIDriver or RBAC on the shared cluster.
    for entry in std::fs::read_dir(dir.join("templates"))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name != "_helpers.tpl" && name != "crds.yaml" {
            std::fs::remove_file(&path)?;
        }
    }
    let mut renamed = 0;
    for sub in ["crds", "files/crds"] {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for entry in entries {
            let path = entry?.path();
            let text = std::fs::read_to_string(&path)?;
            // The name (PLURAL.GROUP) first: the group's own line then ends in the new group.
            let text = text
                .replace(&format!(".{GROUP}\n"), &format!(".{TEST_GROUP}\n"))
                .replace(
                    &format!("group: {GROUP}\n"),
                    &format!("group: {TEST_GROUP}\n"),
                );
            std::fs::write(&path, text)?;
            renamed += 1;
        }
    }
    ensure!(renamed >= 2, "{} holds {renamed} CRD files", dir.display());
    Ok(())
}

/// Every property path of an OpenAPI schema (`spec.warm.nodes`, ...).
fn property_paths(schema: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (name, sub) in props {
            let path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            out.insert(path.clone());
            property_paths(sub, &path, out);
        }
    }
    if let Some(items) = schema.get("items") {
        property_paths(items, &format!("{prefix}[]"), out);
    }
}

fn crd_paths(crd: &Value) -> Result<BTreeSet<String>> {
    let versions = crd["spec"]["versions"]
        .as_array()
        .context("CRD without spec.versions")?;
    let mut out = BTreeSet::new();
    for v in versions {
        let name = v["name"].as_str().unwrap_or("?");
        property_paths(&v["schema"]["openAPIV3Schema"], name, &mut out);
    }
    Ok(out)
}

/// The schema's property paths of the [`PLURAL`] CRD file in a cut-down chart.
fn file_paths(chart: &Path) -> Result<BTreeSet<String>> {
    for sub in ["crds", "files/crds"] {
        let path = chart.join(sub).join(format!("{GROUP}_{PLURAL}.yaml"));
        if let Ok(text) = std::fs::read_to_string(&path) {
            let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
                .with_context(|| format!("{} does not parse", path.display()))?;
            let crd = docs
                .into_iter()
                .find(|d| d["kind"] == "CustomResourceDefinition")
                .with_context(|| format!("{} holds no CRD", path.display()))?;
            return crd_paths(&crd);
        }
    }
    bail!("{} has no {PLURAL} CRD", chart.display())
}

async fn live(crds: &Api<CustomResourceDefinition>, name: &str) -> Result<Option<Value>> {
    Ok(crds
        .get_opt(name)
        .await?
        .map(serde_json::to_value)
        .transpose()?)
}

async fn delete_test_crds(crds: &Api<CustomResourceDefinition>) {
    for plural in ["sealedvolumes", "sealedvolumeversions"] {
        let _ = crds
            .delete(&format!("{plural}.{TEST_GROUP}"), &DeleteParams::default())
            .await;
    }
}

#[tokio::test]
async fn helm_upgrade_from_the_previous_chart_updates_the_crds() -> Result<()> {
    const TEST: &str = "helm_upgrade_from_the_previous_chart_updates_the_crds";
    let Some(cluster) = sealed_e2e::cluster(TEST).await else {
        return Ok(());
    };
    if !root().join(".git").exists() {
        eprintln!(
            "{TEST}: skipped: not a git checkout (the previous chart comes from git history)"
        );
        return Ok(());
    }
    let helm = helm_binary()?;
    let tmp = tempfile::tempdir()?;
    let (old_chart, new_chart) = (tmp.path().join("old"), tmp.path().join("new"));
    let Some(previous) = previous_chart_commit()? else {
        eprintln!(
            "{TEST}: skipped: a shallow clone whose history cannot be fetched (the previous chart comes from git history)"
        );
        return Ok(());
    };
    cut_down_chart(Some(&previous), &old_chart)?;
    cut_down_chart(None, &new_chart)?;
    let (old_paths, new_paths) = (file_paths(&old_chart)?, file_paths(&new_chart)?);
    let added: Vec<_> = new_paths.difference(&old_paths).cloned().collect();
    ensure!(
        !added.is_empty(),
        "the chart at {previous} has the same {PLURAL} schema as this one: nothing to upgrade"
    );

    let ns = cluster.temp_namespace("crd-upgrade").await?;
    let crds: Api<CustomResourceDefinition> = Api::all(cluster.client.clone());
    let name = format!("{PLURAL}.{TEST_GROUP}");
    delete_test_crds(&crds).await;
    sealed_e2e::wait_for("the test CRDs gone", Duration::from_secs(30), || async {
        Ok(live(&crds, &name).await?.is_none())
    })
    .await?;
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    let helm_run = |args: &[&str]| {
        let mut cmd = Command::new(&helm);
        cmd.args(["--kubeconfig", &kubeconfig, "-n", &ns])
            .args(args)
            .args(["--set", STORE]);
        run(&format!("helm {}", args.join(" ")), &mut cmd)
    };
    let result = async {
        let old = old_chart.to_string_lossy();
        let new = new_chart.to_string_lossy();
        helm_run(&["install", RELEASE, &old])?;
        let installed = live(&crds, &name)
            .await?
            .context("the previous chart installed no CRD")?;
        ensure!(
            crd_paths(&installed)? == old_paths,
            "the previous chart's install did not put its own schema"
        );

        // The documented upgrade from a chart that kept its CRDs in crds/ (docs/helm.md).
        helm_run(&["upgrade", RELEASE, &new, "--take-ownership"])?;
        let upgraded = live(&crds, &name).await?.context("the CRD is gone")?;
        let live_paths = crd_paths(&upgraded)?;
        let missing: Vec<_> = added.iter().filter(|p| !live_paths.contains(*p)).collect();
        ensure!(
            missing.is_empty(),
            "helm upgrade left the old schema: {missing:?} not in the live CRD"
        );
        ensure!(
            live_paths == new_paths,
            "the live schema is not the chart's"
        );
        let meta = &upgraded["metadata"];
        ensure!(
            meta["annotations"]["helm.sh/resource-policy"] == "keep"
                && meta["annotations"]["meta.helm.sh/release-name"] == RELEASE,
            "the CRD is not the release's with the keep policy: {meta}"
        );

        // A later upgrade (templates to templates) needs no flag; uninstall keeps the CRDs.
        helm_run(&["upgrade", RELEASE, &new])?;
        run(
            "helm uninstall",
            Command::new(&helm).args([
                "--kubeconfig",
                &kubeconfig,
                "-n",
                &ns,
                "uninstall",
                RELEASE,
            ]),
        )?;
        ensure!(
            live(&crds, &name).await?.is_some(),
            "helm uninstall deleted the CRD (and every object of it)"
        );
        Ok::<(), anyhow::Error>(())
    }
    .await;
    delete_test_crds(&crds).await;
    let _ = cluster.delete_namespace(&ns).await;
    result
}
