//! Checks of the Helm chart `charts/sealed-volumes`, without a cluster: its CRDs are the
//! generated ones and render as templates with the keep policy, `helm lint` passes, and `helm template` renders what the design asks for
//! (GPU exclusion, CSIDriver fields, least-privilege RBAC, one privileged container) and
//! refuses bad values with a message naming the field.
//!
//! helm is the pinned build of `hack/build-k8s.sh` (or `SEALED_HELM`). Without it the helm
//! tests print why they are skipped; with `SEALED_REQUIRE_SERVERS=1` or `CI` set they fail.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, Role};
use k8s_openapi::api::storage::v1::CSIDriver;
use sealed_test_support::servers::built_binary;
use serde_json::Value;

const CHART: &str = "charts/sealed-volumes";
const GPU_LABEL: &str = "nvidia.com/gpu.product";
/// `store.url` has no default (the chart fails without it); every rendering sets one.
const STORE: &str = "store.url=s3://models/sealed";
/// The Kubernetes version offline renders assume (the test cluster's, hack/tools/k8s/go.mod):
/// a source build of helm defaults to 1.20, below the chart's `kubeVersion`.
const KUBE_VERSION: &str = "1.34.4";

fn root() -> PathBuf {
    sealed_e2e::repo_root()
}

fn chart() -> PathBuf {
    root().join(CHART)
}

// ---------------------------------------------------------------------------------------
// CRDs: the chart's copies are the generated files, rendered as templates (so that `helm
// upgrade` updates them) with the keep policy.

/// Where the chart keeps the CRD files templates/crds.yaml renders.
const CHART_CRDS: &str = "charts/sealed-volumes/files/crds";

#[test]
fn chart_crds_are_the_generated_crds() -> Result<()> {
    const FIX: &str = "cp crds/yaml/*.yaml charts/sealed-volumes/files/crds/";
    let generated = yaml_files(&root().join("crds/yaml"))?;
    let in_chart = yaml_files(&root().join(CHART_CRDS))?;
    assert!(!generated.is_empty(), "no CRDs in crds/yaml");
    let mut problems = vec![];
    for name in generated.union(&in_chart) {
        let want = std::fs::read(root().join("crds/yaml").join(name)).ok();
        let have = std::fs::read(root().join(CHART_CRDS).join(name)).ok();
        match (want, have) {
            (Some(w), Some(h)) if w == h => {}
            (Some(_), Some(_)) => problems.push(format!("{CHART_CRDS}/{name} differs")),
            (Some(_), None) => problems.push(format!("{CHART_CRDS}/{name} is missing")),
            (None, _) => problems.push(format!(
                "{CHART_CRDS}/{name} is not in crds/yaml (remove it)"
            )),
        }
    }
    assert!(
        problems.is_empty(),
        "the chart's CRDs are stale: {}; run `{FIX}`",
        problems.join("; ")
    );
    // A crds/ directory would be installed before the templates, unowned by the release, and
    // never upgraded: the templates' copies would then fail as "exists".
    assert!(
        !chart().join("crds").exists(),
        "charts/sealed-volumes/crds/ is back: helm would install those CRDs and never upgrade them"
    );
    Ok(())
}

/// `helm template` renders each generated CRD, unchanged but for the keep policy and the
/// chart's labels; `crds.install=false` renders none, `crds.keep=false` drops the policy.
#[test]
fn crds_render_as_templates_with_the_keep_policy() -> Result<()> {
    let Some(helm) = helm("crds_render_as_templates_with_the_keep_policy") else {
        return Ok(());
    };
    let strip = |mut crd: Value| {
        if let Some(meta) = crd["metadata"].as_object_mut() {
            meta.remove("annotations");
            meta.remove("labels");
        }
        crd
    };
    let mut generated = vec![];
    for name in yaml_files(&root().join("crds/yaml"))? {
        let text = std::fs::read_to_string(root().join("crds/yaml").join(name))?;
        generated.extend(parse_docs(&text)?);
    }
    let docs = render(&helm, &["commonLabels.team=models"])?;
    let rendered = of_kind(&docs, "CustomResourceDefinition");
    assert_eq!(
        rendered.len(),
        generated.len(),
        "one template per generated CRD"
    );
    for crd in &rendered {
        let meta = &crd["metadata"];
        assert_eq!(
            meta["annotations"]["helm.sh/resource-policy"], "keep",
            "{}: helm uninstall would delete every object of it",
            meta["name"]
        );
        assert_eq!(
            meta["labels"]["app.kubernetes.io/part-of"],
            "sealed-volumes"
        );
        assert_eq!(meta["labels"]["team"], "models", "commonLabels");
        assert!(
            generated.contains(&strip((*crd).clone())),
            "{} differs from crds/yaml beyond its labels and annotations",
            meta["name"]
        );
    }
    let none = render(&helm, &["crds.install=false"])?;
    assert!(of_kind(&none, "CustomResourceDefinition").is_empty());
    let unkept = render(&helm, &["crds.keep=false"])?;
    for crd in of_kind(&unkept, "CustomResourceDefinition") {
        assert!(crd["metadata"]["annotations"]["helm.sh/resource-policy"].is_null());
    }
    Ok(())
}

fn yaml_files(dir: &Path) -> Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".yaml") || name.ends_with(".yml") {
            out.insert(name);
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// helm

/// The helm binary, or `None` (after printing why) when there is none and none is required.
fn helm(test: &str) -> Option<PathBuf> {
    static HELM: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    match HELM.get_or_init(find_helm) {
        Ok(path) => Some(path.clone()),
        Err(why) => {
            let required = std::env::var("SEALED_REQUIRE_SERVERS").is_ok_and(|v| v == "1")
                || std::env::var_os("CI").is_some();
            if required {
                panic!("{test}: {why} (required: SEALED_REQUIRE_SERVERS=1 or CI is set)");
            }
            // The test harness captures stderr of passing tests; write to the handle.
            let _ = writeln!(std::io::stderr(), "{test}: skipped: {why}");
            None
        }
    }
}

fn find_helm() -> std::result::Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("SEALED_HELM") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("SEALED_HELM={} does not exist", path.display()))
        };
    }
    let script = root().join("hack/build-k8s.sh");
    let out = Command::new(&script)
        .arg("--print-bin-dir")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    let bin_dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || bin_dir.is_empty() {
        return Err(format!(
            "{} --print-bin-dir failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let helm = Path::new(&bin_dir).join("helm");
    if helm.is_file() {
        Ok(helm)
    } else {
        Err(format!(
            "no helm at {} (hack/build-k8s.sh builds it, or set SEALED_HELM)",
            helm.display()
        ))
    }
}

/// Runs helm with `args`; Ok((stdout, stderr)) on success, Err with both otherwise.
fn run_helm(helm: &Path, args: &[&str]) -> std::result::Result<String, String> {
    let offline = args.first() == Some(&"template") || args.contains(&"--dry-run=client");
    let out = Command::new(helm)
        .args(args)
        .args(if offline {
            &["--kube-version", KUBE_VERSION][..]
        } else {
            &[]
        })
        .current_dir(root())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", helm.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "helm {} failed ({}):\n{stderr}{stdout}",
            args.join(" "),
            out.status
        ))
    }
}

/// `helm template` with `STORE` and `sets` (`--set` unless the entry starts with `json:`,
/// then `--set-json`), parsed into one JSON value per document.
fn render(helm: &Path, sets: &[&str]) -> Result<Vec<Value>> {
    let mut args = vec![
        "template",
        "sv",
        CHART,
        "--namespace",
        "sealed-system",
        "--set",
        STORE,
    ];
    for s in sets {
        match s.strip_prefix("json:") {
            Some(json) => args.extend(["--set-json", json]),
            None => args.extend(["--set", s]),
        }
    }
    parse_docs(&run_helm(helm, &args).map_err(anyhow::Error::msg)?)
}

/// `helm template`'s output, one JSON value per (non-empty) document.
fn parse_docs(yaml: &str) -> Result<Vec<Value>> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml)
        .context("helm template printed YAML that does not parse")?;
    Ok(docs.into_iter().filter(|d| d.is_object()).collect())
}

/// The documents of `kind`.
fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one document of `kind`, as a typed object.
fn one<T: serde::de::DeserializeOwned>(docs: &[Value], kind: &str) -> Result<T> {
    let found = of_kind(docs, kind);
    if found.len() != 1 {
        bail!("expected one {kind}, the chart rendered {}", found.len());
    }
    serde_json::from_value(found[0].clone()).with_context(|| format!("the {kind} does not parse"))
}

/// The DaemonSet of `component` (`node`: the plugin, `fd-holder`).
fn daemonset_of(docs: &[Value], component: &str) -> Result<Option<DaemonSet>> {
    let found: Vec<&Value> = of_kind(docs, "DaemonSet")
        .into_iter()
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
        .collect();
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(serde_json::from_value((*one).clone())?)),
        more => bail!("{} DaemonSets of component {component}", more.len()),
    }
}

/// The node plugin's DaemonSet.
fn daemonset(docs: &[Value]) -> Result<DaemonSet> {
    daemonset_of(docs, "node")?.context("no node plugin DaemonSet")
}

fn holder_daemonset(docs: &[Value]) -> Result<DaemonSet> {
    daemonset_of(docs, "fd-holder")?.context("no fd-holder DaemonSet")
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("the DaemonSet has a pod spec")
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    spec.containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The value of `--flag=` in `c`'s args.
fn flag(c: &Container, name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    c.args
        .iter()
        .flatten()
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_string))
}

/// The values of every `nvidia.com/gpu.product NotIn` expression, one list per node
/// selector term (empty when there is no required node affinity).
fn gpu_exclusions(ds: &DaemonSet) -> Vec<Vec<String>> {
    let Some(required) = pod_spec(ds)
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
    else {
        return vec![];
    };
    required
        .node_selector_terms
        .iter()
        .map(|term| {
            term.match_expressions
                .iter()
                .flatten()
                .filter(|e| e.key == GPU_LABEL)
                .inspect(|e| assert_eq!(e.operator, "NotIn", "{e:?}"))
                .flat_map(|e| e.values.clone().unwrap_or_default())
                .collect()
        })
        .collect()
}

/// The plugin's own default list (`sealed_csi::gpu::DEFAULT_EXCLUDED`), read from its source
/// so the chart's default cannot drift from it.
fn plugin_default_gpu_list() -> Result<Vec<String>> {
    let path = root().join("csi-driver/src/gpu.rs");
    let src = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let line = src
        .lines()
        .find(|l| l.contains("pub const DEFAULT_EXCLUDED: &str"))
        .context("no DEFAULT_EXCLUDED in csi-driver/src/gpu.rs")?;
    let list = line
        .split('"')
        .nth(1)
        .context("DEFAULT_EXCLUDED is not a string literal")?;
    Ok(list.split(',').map(str::to_string).collect())
}

/// Each product as given and with the `-SHARED` suffix (GPU feature discovery under
/// time-slicing), as the plugin matches them.
fn with_shared(products: &[String]) -> BTreeSet<String> {
    products
        .iter()
        .flat_map(|p| [p.clone(), format!("{p}-SHARED")])
        .collect()
}

#[test]
fn helm_lint_passes() {
    let Some(helm) = helm("helm_lint_passes") else {
        return;
    };
    // Plain lint (helm lint lets `required` pass) and strict lint with a store.
    run_helm(&helm, &["lint", CHART]).unwrap();
    run_helm(&helm, &["lint", "--strict", CHART, "--set", STORE]).unwrap();
}

#[test]
fn daemonset_excludes_the_default_gpu_products() -> Result<()> {
    let Some(helm) = helm("daemonset_excludes_the_default_gpu_products") else {
        return Ok(());
    };
    let docs = render(&helm, &[])?;
    let ds = daemonset(&docs)?;
    let defaults = plugin_default_gpu_list()?;
    let terms = gpu_exclusions(&ds);
    assert_eq!(terms.len(), 1, "one node selector term: {terms:?}");
    assert_eq!(
        terms[0].iter().cloned().collect::<BTreeSet<_>>(),
        with_shared(&defaults),
        "the affinity must exclude exactly the plugin's default list (and its -SHARED forms)"
    );
    assert_eq!(
        terms[0].len(),
        defaults.len() * 2,
        "no duplicates: {terms:?}"
    );
    let plugin = container(pod_spec(&ds), "plugin");
    assert_eq!(
        flag(plugin, "--excluded-gpu-products").as_deref(),
        Some(defaults.join(",").as_str()),
        "the plugin enforces the same list"
    );
    Ok(())
}

#[test]
fn a_custom_gpu_list_renders() -> Result<()> {
    let Some(helm) = helm("a_custom_gpu_list_renders") else {
        return Ok(());
    };
    let custom = render(
        &helm,
        &[r#"json:node.excludedGpuProducts=["NVIDIA-A10G","Tesla-V100-SXM2-16GB"]"#],
    )?;
    let ds = daemonset(&custom)?;
    let list = [
        "NVIDIA-A10G".to_string(),
        "Tesla-V100-SXM2-16GB".to_string(),
    ];
    let terms = gpu_exclusions(&ds);
    assert_eq!(terms.len(), 1);
    assert_eq!(
        terms[0].iter().cloned().collect::<BTreeSet<_>>(),
        with_shared(&list)
    );
    let plugin = container(pod_spec(&ds), "plugin");
    assert_eq!(
        flag(plugin, "--excluded-gpu-products").as_deref(),
        Some("NVIDIA-A10G,Tesla-V100-SXM2-16GB")
    );

    // An empty list: no GPU expression (NotIn with no values is invalid), nothing refused.
    let none = daemonset(&render(&helm, &["json:node.excludedGpuProducts=[]"])?)?;
    assert!(
        gpu_exclusions(&none).iter().all(Vec::is_empty),
        "{:?}",
        gpu_exclusions(&none)
    );
    let plugin = container(pod_spec(&none), "plugin");
    assert_eq!(flag(plugin, "--excluded-gpu-products").as_deref(), Some(""));

    // A user's own node affinity is kept, and the exclusion holds in each of its (ORed) terms.
    let affinity = r#"json:node.affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"pool","operator":"In","values":["gpu"]}]},{"matchExpressions":[{"key":"pool","operator":"In","values":["cpu"]}]}]}}}"#;
    let merged = daemonset(&render(&helm, &[affinity])?)?;
    let terms = gpu_exclusions(&merged);
    assert_eq!(terms.len(), 2, "{terms:?}");
    for t in &terms {
        assert_eq!(t.len(), plugin_default_gpu_list()?.len() * 2, "{terms:?}");
    }
    let json = serde_json::to_string(&pod_spec(&merged).affinity)?;
    assert!(
        json.contains(r#""values":["gpu"]"#) && json.contains(r#""values":["cpu"]"#),
        "{json}"
    );
    Ok(())
}

#[test]
fn csidriver_has_the_fields_the_plugin_needs() -> Result<()> {
    let Some(helm) = helm("csidriver_has_the_fields_the_plugin_needs") else {
        return Ok(());
    };
    let driver: CSIDriver = one(&render(&helm, &[])?, "CSIDriver")?;
    assert_eq!(
        driver.metadata.name.as_deref(),
        Some("csi.sealedvolumes.io")
    );
    let spec = driver.spec;
    assert_eq!(spec.attach_required, Some(false));
    assert_eq!(
        spec.pod_info_on_mount,
        Some(true),
        "the plugin authorizes by pod namespace"
    );
    assert_eq!(
        spec.volume_lifecycle_modes,
        Some(vec!["Ephemeral".to_string(), "Persistent".to_string()])
    );
    assert_eq!(spec.fs_group_policy.as_deref(), Some("None"));
    assert_eq!(spec.requires_republish, Some(false));
    Ok(())
}

/// Every RBAC rule the chart renders, with the kind and name of its role.
fn rules(docs: &[Value]) -> Result<Vec<(String, PolicyRule)>> {
    let mut out = vec![];
    for doc in of_kind(docs, "ClusterRole") {
        let role: ClusterRole = serde_json::from_value(doc.clone())?;
        let name = format!("ClusterRole {}", role.metadata.name.unwrap_or_default());
        out.extend(
            role.rules
                .unwrap_or_default()
                .into_iter()
                .map(|r| (name.clone(), r)),
        );
    }
    for doc in of_kind(docs, "Role") {
        let role: Role = serde_json::from_value(doc.clone())?;
        let name = format!("Role {}", role.metadata.name.unwrap_or_default());
        out.extend(
            role.rules
                .unwrap_or_default()
                .into_iter()
                .map(|r| (name.clone(), r)),
        );
    }
    Ok(out)
}

/// The verbs roles whose kind-and-name is `role` (or every role, for "") grant on `resource`.
fn grants(rules: &[(String, PolicyRule)], role: &str, resource: &str) -> BTreeSet<String> {
    rules
        .iter()
        .filter(|(name, _)| role.is_empty() || name == role)
        .filter(|(_, r)| r.resources.iter().flatten().any(|x| x == resource))
        .flat_map(|(_, r)| r.verbs.clone())
        .collect()
}

#[test]
fn rbac_is_least_privilege() -> Result<()> {
    let Some(helm) = helm("rbac_is_least_privilege") else {
        return Ok(());
    };
    const OPERATOR: &str = "ClusterRole sv-sealed-volumes-operator";
    const OPERATOR_NS: &str = "Role sv-sealed-volumes-operator";
    const NODE: &str = "ClusterRole sv-sealed-volumes-node";
    const NODE_NS: &str = "Role sv-sealed-volumes-node";
    for executor in ["job", "inline"] {
        let docs = render(&helm, &[&format!("operator.syncExecutor={executor}")])?;
        let rules = rules(&docs)?;
        assert!(!rules.is_empty());
        for (role, rule) in &rules {
            let all = rule
                .verbs
                .iter()
                .chain(rule.resources.iter().flatten())
                .chain(rule.api_groups.iter().flatten());
            for item in all {
                assert_ne!(item, "*", "{role} has a wildcard: {rule:?}");
            }
            assert!(rule.non_resource_urls.is_none(), "{role}: {rule:?}");
        }
        let roles: BTreeSet<&str> = rules.iter().map(|(name, _)| name.as_str()).collect();
        // With the peer tier (on by default) the plugins read their EndpointSlices.
        assert_eq!(
            roles,
            [
                OPERATOR,
                OPERATOR_NS,
                NODE,
                NODE_NS,
                "Role sv-sealed-volumes-peers"
            ]
            .into(),
            "{executor}"
        );
        for doc in of_kind(&docs, "Role") {
            let role: Role = serde_json::from_value(doc.clone())?;
            assert_eq!(role.metadata.namespace.as_deref(), Some("sealed-system"));
        }

        // Secrets are never listed or watched: the operator gets the ones a source names;
        // with Jobs it also creates each sync's credentials copy in its own namespace; it
        // updates only the certificates it renews, each by name.
        let secrets = grants(&rules, "", "secrets");
        assert!(
            secrets
                .iter()
                .all(|v| v == "get" || v == "create" || v == "update"),
            "secrets: {secrets:?}"
        );
        for (role, rule) in &rules {
            if rule.resources.iter().flatten().any(|r| r == "secrets")
                && rule.verbs.iter().any(|v| v == "update")
            {
                let names = rule.resource_names.clone().unwrap_or_default();
                assert!(
                    names.len() == 1
                        && [
                            "sv-sealed-volumes-peer-tls",
                            "sv-sealed-volumes-webhook-tls"
                        ]
                        .contains(&names[0].as_str()),
                    "{role} updates Secrets beyond the certificates it renews: {rule:?}"
                );
            }
        }
        let expect = |role: &str, resource: &str, verbs: &[&str]| {
            let want: BTreeSet<String> = verbs.iter().map(|v| v.to_string()).collect();
            assert_eq!(
                grants(&rules, role, resource),
                want,
                "{role} on {resource} ({executor})"
            );
        };
        let crud = [
            "get", "list", "watch", "create", "update", "patch", "delete",
        ];
        expect(OPERATOR, "sealedvolumes", &crud);
        expect(OPERATOR, "sealedvolumeversions", &crud);
        expect(
            OPERATOR,
            "sealedvolumes/status",
            &["get", "update", "patch"],
        );
        expect(OPERATOR, "sealedvolumeversions/finalizers", &["update"]);
        expect(OPERATOR, "secrets", &["get"]);
        // spec.verify's keys and CA bundles may be in ConfigMaps (docs/provenance.md).
        expect(OPERATOR, "configmaps", &["get"]);
        expect(OPERATOR, "events", &["create", "patch"]);
        // The pod webhook (docs/csi.md, "Tags and rollouts"): a revision's resolved tags are
        // recorded on its ReplicaSet, Job or ControllerRevision; following workloads get
        // their template patched; its own configuration's caBundle.
        expect(OPERATOR, "jobs", &["get", "patch"]);
        expect(OPERATOR, "replicasets", &["get", "patch"]);
        expect(OPERATOR, "controllerrevisions", &["get", "patch"]);
        expect(OPERATOR, "deployments", &["list", "patch"]);
        expect(OPERATOR, "statefulsets", &["list", "patch"]);
        expect(
            OPERATOR,
            "mutatingwebhookconfigurations",
            &["get", "update"],
        );
        expect(OPERATOR, "pods", &[]);
        expect(OPERATOR, "leases", &[]);
        // Jobs, their pods, the leader Lease and the nodes' publication Leases (read) only in
        // the release namespace.
        expect(
            OPERATOR_NS,
            "jobs",
            &["create", "get", "list", "watch", "delete"],
        );
        expect(OPERATOR_NS, "pods", &["get", "list", "watch"]);
        expect(
            OPERATOR_NS,
            "leases",
            &["get", "list", "watch", "create", "update", "patch"],
        );
        // The attestation key and the peer tier's token and CA (made on first start), with
        // Jobs their credentials copies, and the renewed fleet certificate.
        expect(OPERATOR_NS, "secrets", &["create", "update"]);
        // The node plugin (docs/csi.md): exactly what kube_access.rs calls.
        expect(NODE, "nodes", &["get"]);
        expect(NODE, "sealedvolumeversions", &["list", "watch"]);
        expect(NODE, "sealedvolumes", &["get"]);
        expect(NODE, "events", &["create"]);
        expect(NODE, "secrets", &[]);
        expect(NODE, "csidrivers", &["get"]);
        expect(NODE, "pods", &["get"]);
        // In the release namespace: the attestation Secret (only that one), and its node's
        // publications Lease.
        expect(NODE_NS, "secrets", &["get"]);
        expect(NODE_NS, "leases", &["create", "get", "update"]);
        let names_of = |role: &str, resource: &str| -> Vec<String> {
            rules
                .iter()
                .filter(|(name, r)| {
                    name == role && r.resources.iter().flatten().any(|x| x == resource)
                })
                .flat_map(|(_, r)| r.resource_names.clone().unwrap_or_default())
                .collect()
        };
        assert_eq!(
            names_of(NODE_NS, "secrets"),
            ["sv-sealed-volumes-attestation"]
        );
        assert_eq!(names_of(NODE, "csidrivers"), ["csi.sealedvolumes.io"]);
    }
    // Without leader election the operator only reads Leases (the nodes' publications) and
    // writes none; nothing else touches Leases beyond the node plugins' own.
    let rules = rules(&render(&helm, &["operator.leaderElect=false"])?)?;
    let operator_leases = grants(
        &rules
            .iter()
            .filter(|(name, _)| name == OPERATOR_NS)
            .cloned()
            .collect::<Vec<_>>(),
        "",
        "leases",
    );
    let want: BTreeSet<String> = ["get", "list", "watch"].map(String::from).into();
    assert_eq!(operator_leases, want);
    let others: Vec<(String, PolicyRule)> = rules
        .into_iter()
        .filter(|(name, _)| name != NODE_NS && name != OPERATOR_NS)
        .collect();
    assert!(grants(&others, "", "leases").is_empty());
    Ok(())
}

#[test]
fn only_the_plugin_container_is_privileged() -> Result<()> {
    let Some(helm) = helm("only_the_plugin_container_is_privileged") else {
        return Ok(());
    };
    for registrar in ["true", "false"] {
        let docs = render(&helm, &[&format!("node.registrar.enabled={registrar}")])?;
        let ds = daemonset(&docs)?;
        let deploy: Deployment = one(&docs, "Deployment")?;
        let operator_pod = deploy
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .context("the Deployment has no pod spec")?;
        let holder = holder_daemonset(&docs)?;
        let mut privileged = vec![];
        for spec in [pod_spec(&ds), operator_pod, pod_spec(&holder)] {
            for c in spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
            {
                let sc = c.security_context.clone().unwrap_or_default();
                if sc.privileged == Some(true) {
                    privileged.push(c.name.clone());
                } else {
                    assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
                    let drop = sc.capabilities.and_then(|c| c.drop).unwrap_or_default();
                    assert_eq!(
                        drop,
                        vec!["ALL".to_string()],
                        "{} drops all capabilities",
                        c.name
                    );
                    assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", c.name);
                }
            }
        }
        assert_eq!(
            privileged,
            vec!["plugin".to_string()],
            "registrar {registrar}"
        );
        let names: Vec<&str> = pod_spec(&ds)
            .containers
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        let plugin = container(pod_spec(&ds), "plugin");
        if registrar == "true" {
            assert_eq!(names, ["plugin", "node-driver-registrar"]);
            assert_eq!(
                flag(plugin, "--kubelet-dir"),
                None,
                "one registration, not two"
            );
            // Targets are still held to kubelet's pods directory.
            assert_eq!(
                flag(plugin, "--kubelet-root").as_deref(),
                Some("/var/lib/kubelet")
            );
            let registry = pod_spec(&ds)
                .volumes
                .iter()
                .flatten()
                .filter_map(|v| v.host_path.as_ref())
                .any(|h| h.path == "/var/lib/kubelet/plugins_registry");
            assert!(registry, "the registrar needs kubelet's plugins_registry");
        } else {
            assert_eq!(names, ["plugin"]);
            assert_eq!(
                flag(plugin, "--kubelet-dir").as_deref(),
                Some("/var/lib/kubelet")
            );
        }
        // The operator runs as non-root.
        let psc = operator_pod.security_context.clone().unwrap_or_default();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert!(psc.run_as_user.is_some_and(|u| u != 0));
    }
    Ok(())
}

#[test]
fn node_plugin_mounts_and_flags_follow_the_values() -> Result<()> {
    let Some(helm) = helm("node_plugin_mounts_and_flags_follow_the_values") else {
        return Ok(());
    };
    let docs = render(&helm, &[])?;
    let ds = daemonset(&docs)?;
    let spec = pod_spec(&ds);
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = spec.tolerations.clone().unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "tolerates every taint by default: {tolerations:?}"
    );
    let plugin = container(spec, "plugin");
    assert_eq!(
        flag(plugin, "--cache-size").as_deref(),
        Some("50Gi"),
        "the quantity as given: the plugin reads it with the Kubernetes meaning"
    );
    assert_eq!(flag(plugin, "--node-id").as_deref(), Some("$(NODE_NAME)"));
    assert_eq!(
        flag(plugin, "--store").as_deref(),
        Some("s3://models/sealed")
    );
    assert_eq!(
        flag(plugin, "--metrics-addr").as_deref(),
        Some("0.0.0.0:9809")
    );
    let node_name = plugin
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(node_name.as_deref(), Some("spec.nodeName"));
    // Only operator-attested versions authorize a mount; the node reports what it publishes.
    assert_eq!(
        flag(plugin, "--attestation-secret").as_deref(),
        Some("sealed-system/sv-sealed-volumes-attestation")
    );
    assert_eq!(
        flag(plugin, "--publications-namespace").as_deref(),
        Some("$(POD_NAMESPACE)")
    );
    let pod_namespace = plugin
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "POD_NAMESPACE")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(pod_namespace.as_deref(), Some("metadata.namespace"));
    let mounts = plugin.volume_mounts.clone().unwrap_or_default();
    let kubelet = mounts
        .iter()
        .find(|m| m.mount_path == "/var/lib/kubelet")
        .context("kubelet dir")?;
    assert_eq!(kubelet.mount_propagation.as_deref(), Some("Bidirectional"));
    assert!(mounts.iter().any(|m| m.mount_path == "/dev/fuse"));
    let host_paths: BTreeSet<String> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some(v.host_path.as_ref()?.path.clone()))
        .collect();
    for want in [
        "/var/lib/kubelet",
        "/var/lib/kubelet/plugins/csi.sealedvolumes.io",
        "/dev/fuse",
        "/var/lib/sealed-volumes/cache",
        "/var/lib/sealed-volumes/fd-holder",
    ] {
        assert!(
            host_paths.contains(want),
            "no hostPath {want}: {host_paths:?}"
        );
    }

    // Restart safety: the plugin talks to the holder on the socket the holder serves, in a
    // host directory both mount; the holder survives `helm upgrade` (OnDelete) and keeps off
    // the same GPU nodes as the plugin.
    let holder = holder_daemonset(&docs)?;
    let holder_spec = pod_spec(&holder);
    let holder_c = container(holder_spec, "fd-holder");
    let socket = flag(plugin, "--fd-holder").context("the plugin gets --fd-holder")?;
    assert_eq!(flag(holder_c, "--socket"), Some(socket.clone()));
    let dir_of = |spec: &PodSpec, c: &Container| -> Option<String> {
        let parent = Path::new(&socket).parent()?.to_str()?.to_string();
        let m = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == parent)?;
        let v = spec.volumes.iter().flatten().find(|v| v.name == m.name)?;
        Some(v.host_path.as_ref()?.path.clone())
    };
    assert_eq!(
        dir_of(spec, plugin).as_deref(),
        Some("/var/lib/sealed-volumes/fd-holder")
    );
    assert_eq!(dir_of(spec, plugin), dir_of(holder_spec, holder_c));
    assert_eq!(
        holder
            .spec
            .as_ref()
            .and_then(|s| s.update_strategy.as_ref())
            .and_then(|u| u.type_.as_deref()),
        Some("OnDelete")
    );
    assert_eq!(gpu_exclusions(&holder), gpu_exclusions(&ds));
    assert_eq!(holder_spec.automount_service_account_token, Some(false));
    let docs = render(&helm, &["node.fdHolder.enabled=false"])?;
    assert!(daemonset_of(&docs, "fd-holder")?.is_none());
    assert_eq!(
        flag(
            container(pod_spec(&daemonset(&docs)?), "plugin"),
            "--fd-holder"
        ),
        None
    );

    // Store credentials: a chart-made Secret reaches both containers; an existing one too.
    let docs = render(
        &helm,
        &[
            "store.credentials.AWS_ACCESS_KEY_ID=AKIA",
            "store.region=eu-west-1",
        ],
    )?;
    let secrets = of_kind(&docs, "Secret");
    assert_eq!(secrets.len(), 1);
    assert_eq!(secrets[0]["stringData"]["AWS_ACCESS_KEY_ID"], "AKIA");
    let secret_name = secrets[0]["metadata"]["name"].as_str().unwrap().to_string();
    let deploy: Deployment = one(&docs, "Deployment")?;
    let operator = &deploy.spec.unwrap().template.spec.unwrap().containers[0];
    let plugin = container(pod_spec(&daemonset(&docs)?), "plugin").clone();
    for c in [operator, &plugin] {
        let from = c.env_from.clone().unwrap_or_default();
        assert_eq!(from.len(), 1, "{}", c.name);
        assert_eq!(
            from[0].secret_ref.as_ref().map(|s| s.name.as_str()),
            Some(secret_name.as_str())
        );
        assert_eq!(
            flag(c, "--store-region").as_deref(),
            Some("eu-west-1"),
            "{}",
            c.name
        );
    }
    // The operator hands the same Secret to sync Jobs.
    assert_eq!(flag(operator, "--store-secret"), Some(secret_name.clone()));
    let docs = render(&helm, &["store.existingSecret=my-store"])?;
    assert!(of_kind(&docs, "Secret").is_empty());
    assert!(
        render(&helm, &[])?.iter().all(|d| d["kind"] != "Secret"),
        "no credentials, no Secret"
    );
    let ds = daemonset(&docs)?;
    let from = container(pod_spec(&ds), "plugin")
        .env_from
        .clone()
        .unwrap_or_default();
    assert_eq!(
        from[0].secret_ref.as_ref().map(|s| s.name.as_str()),
        Some("my-store")
    );
    Ok(())
}

/// Hardening as the reference CSI charts have it: the node DaemonSet rolls by a percentage,
/// every pod runs on linux nodes, the operator and the plugin have critical priority classes
/// (overridable), and SELinux options reach both node DaemonSets when set.
#[test]
fn pods_are_placed_prioritised_and_rolled_like_the_reference_charts() -> Result<()> {
    let Some(helm) = helm("pods_are_placed_prioritised_and_rolled_like_the_reference_charts")
    else {
        return Ok(());
    };
    let docs = render(&helm, &[])?;
    let node = daemonset(&docs)?;
    let holder = holder_daemonset(&docs)?;
    let deploy: Deployment = one(&docs, "Deployment")?;
    let operator_pod = deploy.spec.as_ref().and_then(|s| s.template.spec.clone());
    let operator_pod = operator_pod.context("operator pod")?;
    let rolling = node
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.rolling_update.as_ref())
        .and_then(|r| r.max_unavailable.clone());
    assert_eq!(
        rolling,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("10%".into()))
    );
    for (what, spec) in [
        ("node", pod_spec(&node)),
        ("fd holder", pod_spec(&holder)),
        ("operator", &operator_pod),
    ] {
        let os = spec
            .node_selector
            .as_ref()
            .and_then(|n| n.get("kubernetes.io/os"));
        assert_eq!(os.map(String::as_str), Some("linux"), "{what}");
        assert!(
            spec.security_context
                .as_ref()
                .and_then(|c| c.se_linux_options.as_ref())
                .is_none(),
            "{what}: no SELinux options unless asked"
        );
    }
    assert_eq!(
        operator_pod.priority_class_name.as_deref(),
        Some("system-cluster-critical")
    );
    assert_eq!(
        pod_spec(&node).priority_class_name.as_deref(),
        Some("system-node-critical")
    );

    let docs = render(
        &helm,
        &[
            "node.seLinuxOptions.type=spc_t",
            "operator.priorityClassName=platform-high",
            "node.nodeSelector.kubernetes\\.io/os=null",
        ],
    )?;
    for ds in [daemonset(&docs)?, holder_daemonset(&docs)?] {
        let se = pod_spec(&ds)
            .security_context
            .as_ref()
            .and_then(|c| c.se_linux_options.as_ref())
            .and_then(|o| o.type_.clone());
        assert_eq!(se.as_deref(), Some("spc_t"));
        assert!(
            pod_spec(&ds)
                .node_selector
                .as_ref()
                .is_none_or(|n| !n.contains_key("kubernetes.io/os")),
            "the os selector can be dropped"
        );
    }
    let deploy: Deployment = one(&docs, "Deployment")?;
    assert_eq!(
        deploy
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|p| p.priority_class_name)
            .as_deref(),
        Some("platform-high")
    );
    Ok(())
}

#[test]
fn operator_flags_follow_the_values() -> Result<()> {
    let Some(helm) = helm("operator_flags_follow_the_values") else {
        return Ok(());
    };
    let docs = render(&helm, &["image.tag=dev"])?;
    let deploy: Deployment = one(&docs, "Deployment")?;
    assert_eq!(deploy.spec.as_ref().and_then(|s| s.replicas), Some(1));
    let c = deploy.spec.unwrap().template.spec.unwrap().containers[0].clone();
    assert_eq!(c.image.as_deref(), Some("sealed.local/sealed-operator:dev"));
    assert_eq!(
        c.args.as_ref().and_then(|a| a.first()).map(String::as_str),
        Some("run")
    );
    assert_eq!(flag(&c, "--sync-executor").as_deref(), Some("job"));
    assert_eq!(
        flag(&c, "--sync-image").as_deref(),
        Some("sealed.local/sealed-operator:dev")
    );
    assert_eq!(flag(&c, "--metrics-addr").as_deref(), Some("0.0.0.0:8080"));
    assert_eq!(flag(&c, "--gc-interval").as_deref(), Some("1h"));
    let args = c.args.clone().unwrap_or_default();
    assert!(args.iter().any(|a| a == "--leader-elect"));
    assert!(!args.iter().any(|a| a == "--gc-dry-run"));
    let probe = c
        .liveness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .context("liveness")?;
    assert_eq!(probe.path.as_deref(), Some("/healthz"));
    let ds = daemonset(&docs)?;
    assert_eq!(
        container(pod_spec(&ds), "plugin").image.as_deref(),
        Some("sealed.local/sealed-csi:dev")
    );
    // The tag defaults to the chart's appVersion.
    let chart_yaml = std::fs::read_to_string(chart().join("Chart.yaml"))?;
    assert!(chart_yaml.contains("appVersion: \"0.1.0\""), "{chart_yaml}");
    let docs = render(
        &helm,
        &["operator.gcDryRun=true", "operator.syncImage=reg/sync:1"],
    )?;
    let deploy: Deployment = one(&docs, "Deployment")?;
    let c = deploy.spec.unwrap().template.spec.unwrap().containers[0].clone();
    assert_eq!(
        c.image.as_deref(),
        Some("sealed.local/sealed-operator:0.1.0")
    );
    assert_eq!(flag(&c, "--sync-image").as_deref(), Some("reg/sync:1"));
    assert!(
        c.args
            .unwrap_or_default()
            .iter()
            .any(|a| a == "--gc-dry-run")
    );
    // Optional ServiceMonitor.
    assert!(of_kind(&render(&helm, &[])?, "ServiceMonitor").is_empty());
    let monitor = render(&helm, &["metrics.serviceMonitor.enabled=true"])?;
    assert_eq!(of_kind(&monitor, "ServiceMonitor").len(), 1);
    Ok(())
}

#[test]
fn bad_values_fail_with_the_field_named() {
    let Some(helm) = helm("bad_values_fail_with_the_field_named") else {
        return;
    };
    let cases: &[(&[&str], &str)] = &[
        (
            &["--set", "operator.syncExecutor=foo"],
            "/operator/syncExecutor",
        ),
        (&["--set", "cache.size=lots"], "/cache/size"),
        (&["--set", "node.memory=1X"], "/node/memory"),
        (
            &["--set", "operator.gcInterval=hourly"],
            "/operator/gcInterval",
        ),
        (&["--set", "store.url=ftp://host/x"], "/store/url"),
        (
            &["--set-json", r#"node.excludedGpuProducts=["bad value"]"#],
            "/node/excludedGpuProducts/0",
        ),
        (&["--set", "operator.replcias=2"], "'replcias' not allowed"),
        (
            &[
                "--set",
                "operator.replicas=2",
                "--set",
                "operator.leaderElect=false",
            ],
            "/operator/leaderElect",
        ),
        (
            &["--set", "image.pullPolicy=Sometimes"],
            "/image/pullPolicy",
        ),
        (
            &["--set", "operator.image.digest=latest"],
            "/operator/image/digest",
        ),
        (&["--set", "logging.format=xml"], "/logging/format"),
        (&["--set", "peer.uploadRate=100mbit"], "/peer/uploadRate"),
        (
            &[
                "--set",
                "node.updateStrategy.rollingUpdate.maxUnavailable=0%",
            ],
            "/node/updateStrategy/rollingUpdate/maxUnavailable",
        ),
        (
            &["--set", "node.seLinuxOptions.typo=spc_t"],
            "'typo' not allowed",
        ),
        (
            &["--set-json", r#"commonLabels={"team":1}"#],
            "/commonLabels/team",
        ),
    ];
    for (bad, field) in cases {
        let mut args = vec!["template", "sv", CHART, "--set", STORE];
        args.extend_from_slice(bad);
        let err = run_helm(&helm, &args).expect_err(&format!("{bad:?} was accepted"));
        assert!(
            err.contains("schema"),
            "{bad:?}: not a schema error:\n{err}"
        );
        assert!(
            err.contains(field),
            "{bad:?}: the error does not name {field}:\n{err}"
        );
    }
    // No store URL: a clear message rather than a plugin that crash-loops.
    let err = run_helm(&helm, &["template", "sv", CHART]).expect_err("no store.url was accepted");
    assert!(err.contains("store.url is required"), "{err}");
}

#[test]
fn the_binaries_accept_the_flags_the_chart_passes() -> Result<()> {
    let Some(helm) = helm("the_binaries_accept_the_flags_the_chart_passes") else {
        return Ok(());
    };
    let variants: &[&[&str]] = &[
        &[],
        &["peer.enabled=true", "peer.uploadRate=100Mi"],
        &[
            "node.registrar.enabled=true",
            "json:node.excludedGpuProducts=[]",
        ],
        &[
            "store.existingSecret=s",
            "store.endpoint=http://minio:9000",
            "store.region=us-east-1",
            "operator.gcDryRun=true",
            "operator.gcInterval=0",
            "operator.syncExecutor=inline",
            "operator.syncJobResources.requests.cpu=500m",
            "operator.syncJobResources.requests.memory=1Gi",
            "operator.syncJobResources.limits.cpu=2",
            "operator.syncJobResources.limits.memory=4Gi",
            "cache.size=1.5Ti",
            "node.memory=512M",
            "operator.syncJobPod.serviceAccountName=sync",
            r#"json:operator.syncJobPod.tolerations=[{"key":"dedicated","operator":"Exists"}]"#,
            r#"json:operator.syncJobPod.affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"pool","operator":"In","values":["cpu"]}]}]}}}"#,
        ],
    ];
    let mut checked = 0;
    for sets in variants {
        let docs = render(&helm, sets)?;
        let deploy: Deployment = one(&docs, "Deployment")?;
        let operator = deploy
            .spec
            .and_then(|s| s.template.spec)
            .map(|s| s.containers[0].clone())
            .context("no operator container")?;
        let plugin = container(pod_spec(&daemonset(&docs)?), "plugin").clone();
        let holder = container(pod_spec(&holder_daemonset(&docs)?), "fd-holder").clone();
        for (c, name) in [
            (operator, "sealed-operator"),
            (plugin, "sealed-csi"),
            (holder, "sealed-fd-holder"),
        ] {
            let Some(bin) = built_binary(name) else {
                let _ = writeln!(
                    std::io::stderr(),
                    "the_binaries_accept_the_flags_the_chart_passes: {name} skipped: not built \
                     (cargo build -p {name})"
                );
                continue;
            };
            // clap parses and validates every flag before it acts on a trailing --help, so
            // this checks names and values without running anything.
            let mut args: Vec<String> = c
                .args
                .clone()
                .unwrap_or_default()
                .into_iter()
                .map(|a| a.replace("$(NODE_NAME)", "node-1"))
                .collect();
            args.push("--help".into());
            let out = Command::new(&bin).args(&args).output()?;
            assert!(
                out.status.success(),
                "{} rejects the chart's flags {args:?} (values {sets:?}):\n{}",
                bin.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "the_binaries_accept_the_flags_the_chart_passes: {checked} flag sets checked"
    );
    Ok(())
}

#[test]
fn images_labels_logging_and_disruption_follow_the_values() -> Result<()> {
    let Some(helm) = helm("images_labels_logging_and_disruption_follow_the_values") else {
        return Ok(());
    };
    let digest = format!("sha256:{}", "a".repeat(64));
    let pin = format!("operator.image.digest={digest}");
    let docs = render(
        &helm,
        &[
            "commonLabels.team=ml",
            "operator.podLabels.tier=control",
            "node.podLabels.tier=node",
            &pin,
            "operator.image.repository=ghcr.io/org/op",
            "node.image.repository=ghcr.io/org/csi",
            "node.image.tag=1.2.3",
            "logging.level=debug",
            "logging.format=json",
            "operator.podDisruptionBudget.enabled=true",
            r#"json:operator.topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"topology.kubernetes.io/zone","whenUnsatisfiable":"ScheduleAnyway"}]"#,
            r#"json:operator.podSecurityContext={"runAsUser":null,"runAsGroup":null,"fsGroup":null}"#,
        ],
    )?;
    // commonLabels on every object the chart makes.
    for doc in &docs {
        assert_eq!(
            doc["metadata"]["labels"]["team"], "ml",
            "{} {} lacks commonLabels",
            doc["kind"], doc["metadata"]["name"]
        );
    }
    let deploy: Deployment = one(&docs, "Deployment")?;
    let template = deploy.spec.context("spec")?.template;
    let labels = template.metadata.and_then(|m| m.labels).unwrap_or_default();
    assert_eq!(labels.get("tier").map(String::as_str), Some("control"));
    let spec = template.spec.context("pod spec")?;
    let operator = &spec.containers[0];
    assert_eq!(
        operator.image.as_deref(),
        Some(format!("ghcr.io/org/op@{digest}").as_str()),
        "a digest pins the image, over any tag"
    );
    let env = |c: &Container, name: &str| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(env(operator, "SEALED_LOG").as_deref(), Some("debug"));
    assert_eq!(env(operator, "SEALED_LOG_JSON").as_deref(), Some("true"));
    // The pod security context is the value given (OpenShift assigns the UID itself).
    let psc = spec
        .security_context
        .clone()
        .context("pod securityContext")?;
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(psc.run_as_user, None, "{psc:?}");
    let spread = spec
        .topology_spread_constraints
        .clone()
        .context("topologySpreadConstraints")?;
    let selector = spread[0]
        .label_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    assert_eq!(
        selector
            .get("app.kubernetes.io/component")
            .map(String::as_str),
        Some("operator"),
        "a constraint without a selector spreads the operator's own pods"
    );
    let pdb = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(pdb.len(), 1);
    assert_eq!(pdb[0]["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb[0]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "operator"
    );

    for (ds, name) in [
        (daemonset(&docs)?, "plugin"),
        (holder_daemonset(&docs)?, "fd-holder"),
    ] {
        let labels = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        assert_eq!(
            labels.get("tier").map(String::as_str),
            Some("node"),
            "{name}"
        );
        let c = container(pod_spec(&ds), name);
        assert_eq!(c.image.as_deref(), Some("ghcr.io/org/csi:1.2.3"), "{name}");
        assert_eq!(env(c, "SEALED_LOG").as_deref(), Some("debug"), "{name}");
        assert_eq!(env(c, "SEALED_LOG_JSON").as_deref(), Some("true"), "{name}");
    }

    // Defaults: no PDB, text logs, the restricted security context.
    let docs = render(&helm, &[])?;
    assert!(of_kind(&docs, "PodDisruptionBudget").is_empty());
    let deploy: Deployment = one(&docs, "Deployment")?;
    let spec = deploy.spec.context("spec")?.template.spec.context("pod")?;
    assert_eq!(
        env(&spec.containers[0], "SEALED_LOG_JSON").as_deref(),
        Some("false")
    );
    let psc = spec.security_context.context("pod securityContext")?;
    assert_eq!(psc.run_as_user, Some(65532));
    Ok(())
}

/// The chart used as a subchart: a parent passes `global` values and its own values under
/// the subchart's name; the schema must allow `global`.
#[test]
fn it_renders_as_a_subchart() -> Result<()> {
    let Some(helm) = helm("it_renders_as_a_subchart") else {
        return Ok(());
    };
    let parent = tempfile::tempdir()?;
    std::fs::write(
        parent.path().join("Chart.yaml"),
        "apiVersion: v2\nname: platform\nversion: 1.0.0\ndependencies:\n  - name: sealed-volumes\n    version: 0.1.0\n",
    )?;
    let charts = parent.path().join("charts");
    std::fs::create_dir_all(&charts)?;
    copy_dir(&chart(), &charts.join("sealed-volumes"))?;
    let dir = parent.path().to_string_lossy().into_owned();
    let yaml = run_helm(
        &helm,
        &[
            "template",
            "p",
            &dir,
            "--set",
            "global.imageRegistry=registry.example",
            "--set",
            "sealed-volumes.store.url=s3://bucket/models",
        ],
    )
    .map_err(anyhow::Error::msg)?;
    let deploy: Deployment = one(&parse_docs(&yaml)?, "Deployment")?;
    let c = deploy
        .spec
        .context("spec")?
        .template
        .spec
        .context("pod")?
        .containers[0]
        .clone();
    assert_eq!(flag(&c, "--store").as_deref(), Some("s3://bucket/models"));
    Ok(())
}

/// NOTES.txt warns while the images are the local placeholders, and not once a registry is
/// set; the Secret it creates opts in as source credentials. `helm template` skips NOTES.txt
/// (and `helm install --dry-run` has no `--kube-version` for the source-built helm), so a copy
/// of the chart has it as a named template rendered into a ConfigMap by helm's own engine.
#[test]
fn notes_warn_about_local_placeholder_images() -> Result<()> {
    let Some(helm) = helm("notes_warn_about_local_placeholder_images") else {
        return Ok(());
    };
    let copy = tempfile::tempdir()?;
    let copy_chart = copy.path().join("sealed-volumes");
    copy_dir(&chart(), &copy_chart)?;
    // NOTES.txt verbatim as a named template, rendered into a ConfigMap.
    let notes_txt = copy_chart.join("templates/NOTES.txt");
    let text = std::fs::read_to_string(&notes_txt)?;
    std::fs::remove_file(&notes_txt)?;
    std::fs::write(
        copy_chart.join("templates/notes-rendered.yaml"),
        format!(
            "{{{{- define \"test.notes\" }}}}{text}{{{{- end }}}}\napiVersion: v1\nkind: ConfigMap\n\
             metadata:\n  name: notes\ndata:\n  notes: {{{{ include \"test.notes\" . | quote }}}}\n"
        ),
    )?;
    let dir = copy_chart.to_string_lossy().into_owned();
    let notes = |sets: &[&str]| -> Result<String> {
        let mut args = vec!["template", "sv", dir.as_str(), "--set", STORE];
        args.extend(["--show-only", "templates/notes-rendered.yaml"]);
        for s in sets {
            args.extend(["--set", s]);
        }
        let yaml = run_helm(&helm, &args).map_err(anyhow::Error::msg)?;
        let doc: Value = serde_saphyr::from_str(&yaml)?;
        doc["data"]["notes"]
            .as_str()
            .map(str::to_owned)
            .context("no notes in the rendered ConfigMap")
    };
    let local = notes(&[])?;
    assert!(local.contains("Sealed Volumes"), "{local}");
    assert!(
        local.contains("WARNING: the images are the local placeholders"),
        "{local}"
    );
    // The first sync a reader follows must not fail SecretNotOptedIn: the token Secret the
    // notes create carries the operator's opt-in label.
    let opt_in = format!(
        "label secret hf-token {}=true",
        sealed_crds::SOURCE_CREDENTIALS_LABEL
    );
    assert!(
        local.contains(&opt_in),
        "no `{opt_in}` in the notes: {local}"
    );
    let release = notes(&["image.repository=ghcr.io/sealed-volumes"])?;
    assert!(release.contains("Sealed Volumes"), "{release}");
    assert!(!release.contains("WARNING"), "{release}");
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// Sync Jobs' pods get what private registries and workload identity need: `--sync-pod`
/// carries the chart's `operator.syncJobPod`, with the chart's own pull secrets by default.
#[test]
fn sync_job_pod_settings_reach_the_operator() -> Result<()> {
    let Some(helm) = helm("sync_job_pod_settings_reach_the_operator") else {
        return Ok(());
    };
    let sync_pod = |sets: &[&str]| -> Result<Option<Value>> {
        let deploy: Deployment = one(&render(&helm, sets)?, "Deployment")?;
        let c = deploy
            .spec
            .context("spec")?
            .template
            .spec
            .context("pod")?
            .containers[0]
            .clone();
        flag(&c, "--sync-pod")
            .map(|json| serde_json::from_str(&json).context("--sync-pod is not JSON"))
            .transpose()
    };
    assert_eq!(sync_pod(&[])?, None, "nothing to pass by default");
    let pod = sync_pod(&[
        r#"json:imagePullSecrets=[{"name":"registry"}]"#,
        "operator.syncJobPod.serviceAccountName=model-sync",
        "operator.syncJobPod.priorityClassName=batch-low",
        "operator.syncJobPod.nodeSelector.pool=cpu",
    ])?
    .context("no --sync-pod")?;
    assert_eq!(pod["serviceAccountName"], "model-sync");
    assert_eq!(pod["imagePullSecrets"][0]["name"], "registry", "{pod}");
    assert_eq!(pod["priorityClassName"], "batch-low");
    assert_eq!(pod["nodeSelector"]["pool"], "cpu");
    assert!(
        pod.get("affinity").is_none(),
        "empty values are left out: {pod}"
    );
    // Their own pull secrets win over the chart's.
    let pod = sync_pod(&[
        r#"json:imagePullSecrets=[{"name":"registry"}]"#,
        r#"json:operator.syncJobPod.imagePullSecrets=[{"name":"sync-registry"}]"#,
    ])?
    .context("no --sync-pod")?;
    assert_eq!(pod["imagePullSecrets"][0]["name"], "sync-registry");
    Ok(())
}

#[test]
fn alert_rules_dashboard_and_relabelings_render_and_pass_promtool() -> Result<()> {
    let Some(helm) = helm("alert_rules_dashboard_and_relabelings_render_and_pass_promtool") else {
        return Ok(());
    };
    // Off by default: no monitoring.coreos.com objects without their CRDs.
    let docs = render(&helm, &[])?;
    assert!(of_kind(&docs, "PrometheusRule").is_empty());
    assert!(of_kind(&docs, "ConfigMap").is_empty());
    let docs = render(
        &helm,
        &[
            "metrics.prometheusRule.enabled=true",
            "metrics.prometheusRule.labels.release=kps",
            "metrics.grafanaDashboard.enabled=true",
            "metrics.grafanaDashboard.namespace=monitoring",
            "metrics.serviceMonitor.enabled=true",
            r#"json:metrics.serviceMonitor.relabelings=[{"targetLabel":"cluster","replacement":"eu-1"}]"#,
            r#"json:metrics.serviceMonitor.metricRelabelings=[{"action":"drop","sourceLabels":["__name__"],"regex":"sealed_prefetch_.*"}]"#,
        ],
    )?;
    let monitor = of_kind(&docs, "ServiceMonitor");
    let endpoint = &monitor.first().context("no ServiceMonitor")?["spec"]["endpoints"][0];
    assert_eq!(endpoint["relabelings"][0]["targetLabel"], "cluster");
    assert_eq!(endpoint["metricRelabelings"][0]["action"], "drop");

    let dashboard = of_kind(&docs, "ConfigMap");
    let dashboard = dashboard.first().context("no dashboard ConfigMap")?;
    assert_eq!(dashboard["metadata"]["namespace"], "monitoring");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(
        dashboard["data"]["sealed-volumes.json"]
            .as_str()
            .context("no dashboard JSON")?,
    )
    .context("the dashboard is not JSON")?;
    assert_eq!(json["uid"], "sealed-volumes");

    let rule = of_kind(&docs, "PrometheusRule");
    let rule = rule.first().context("no PrometheusRule")?;
    assert_eq!(rule["metadata"]["labels"]["release"], "kps");
    let alerts: BTreeSet<&str> = rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    for want in [
        "SealedVolumesVerificationFailures",
        "SealedVolumesStoreErrors",
        "SealedVolumesUnprotectedMounts",
        "SealedVolumesSyncFailed",
    ] {
        assert!(alerts.contains(want), "no alert {want} in {alerts:?}");
    }
    // The absent() alerts come with their component, so silence means that component is down.
    assert!(alerts.contains("SealedVolumesNoLeader"), "{alerts:?}");
    assert!(
        alerts.contains("SealedVolumesNodeMetricsAbsent"),
        "{alerts:?}"
    );
    let without_operator = render(
        &helm,
        &[
            "metrics.prometheusRule.enabled=true",
            "operator.enabled=false",
        ],
    )?;
    let text = serde_json::to_string(&of_kind(&without_operator, "PrometheusRule"))?;
    assert!(!text.contains("SealedVolumesNoLeader"), "{text}");
    assert!(text.contains("SealedVolumesNodeMetricsAbsent"), "{text}");
    // Helm left Prometheus' own templates ({{ $labels.pod }}) alone.
    let text = serde_json::to_string(&rule["spec"])?;
    assert!(text.contains("{{ $labels.pod }}"), "{text}");

    // promtool checks the rules exactly as rendered (syntax, PromQL, templates).
    if sealed_test_support::servers::missing("promtool", "hack/build-test-tools.sh") {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, serde_saphyr::to_string(&rule["spec"])?)?;
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()?;
    assert!(
        out.status.success(),
        "promtool check rules:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // And it would say so if a rule were broken.
    std::fs::write(
        &file,
        "groups: [{name: g, rules: [{alert: A, expr: 'sum(rate(x[5m]) >'}]}]\n",
    )?;
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()?;
    assert!(!out.status.success(), "promtool passed a broken rule");
    Ok(())
}

#[test]
fn peer_tls_is_on_by_default_and_its_secrets_are_the_operators_not_the_renders() -> Result<()> {
    let Some(helm) =
        helm("peer_tls_is_on_by_default_and_its_secrets_are_the_operators_not_the_renders")
    else {
        return Ok(());
    };
    let (token_name, tls_name) = ("sv-sealed-volumes-peer-token", "sv-sealed-volumes-peer-tls");
    let operator_container = |docs: &[Value]| -> Result<Container> {
        let deploy: Deployment = one(docs, "Deployment")?;
        let spec = deploy
            .spec
            .and_then(|s| s.template.spec)
            .context("no operator pod spec")?;
        Ok(spec.containers[0].clone())
    };
    // The defaults: the peer tier with mTLS; the Secrets are made by the operator (flags),
    // none is rendered, and two renders are the same (no random material in the chart).
    let docs = render(&helm, &["peer.tls.name=fleet-a"])?;
    assert_eq!(
        docs,
        render(&helm, &["peer.tls.name=fleet-a"])?,
        "two renders differ"
    );
    for name in [token_name, tls_name] {
        assert!(
            of_kind(&docs, "Secret")
                .iter()
                .all(|s| s["metadata"]["name"] != name),
            "{name} is rendered: a GitOps render would rotate it"
        );
    }
    let operator = operator_container(&docs)?;
    assert_eq!(
        flag(&operator, "--peer-token-secret").as_deref(),
        Some(token_name)
    );
    assert_eq!(
        flag(&operator, "--peer-tls-secret").as_deref(),
        Some(tls_name)
    );
    assert_eq!(
        flag(&operator, "--peer-tls-name").as_deref(),
        Some("fleet-a")
    );
    assert_eq!(flag(&operator, "--peer-tls-days").as_deref(), Some("365"));
    // The operator may update the certificate it renews, that Secret alone.
    let renews = of_kind(&docs, "Role").into_iter().any(|r| {
        r["metadata"]["name"] == "sv-sealed-volumes-operator"
            && r["rules"].as_array().is_some_and(|rules| {
                rules.iter().any(|rule| {
                    rule["resources"] == serde_json::json!(["secrets"])
                        && rule["verbs"] == serde_json::json!(["update"])
                        && rule["resourceNames"] == serde_json::json!([tls_name])
                })
            })
    });
    assert!(renews, "the operator's Role cannot renew {tls_name}");
    let ds = daemonset(&docs)?;
    let spec = pod_spec(&ds);
    let plugin = container(spec, "plugin");
    let mount = plugin
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "peer-tls")
        .context("the peer TLS Secret is not mounted")?;
    assert_eq!(mount.read_only, Some(true));
    // A directory, not subPath: the kubelet updates the files and the plugin re-reads them.
    assert_eq!(mount.sub_path, None);
    let file = |flag_name: &str, key: &str| -> Result<()> {
        let path = flag(plugin, flag_name).with_context(|| format!("no {flag_name}"))?;
        assert_eq!(path, format!("{}/{key}", mount.mount_path), "{flag_name}");
        Ok(())
    };
    file("--peer-tls-cert", "tls.crt")?;
    file("--peer-tls-key", "tls.key")?;
    file("--peer-tls-ca", "ca.crt")?;
    assert_eq!(flag(plugin, "--peer-tls-name").as_deref(), Some("fleet-a"));
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "peer-tls")
        .context("no peer-tls volume")?;
    assert_eq!(
        volume
            .secret
            .as_ref()
            .and_then(|s| s.secret_name.as_deref()),
        Some(tls_name)
    );

    // TLS off: no flags on either side.
    let docs = render(&helm, &["peer.tls.enabled=false"])?;
    let plugin = container(pod_spec(&daemonset(&docs)?), "plugin").clone();
    assert_eq!(flag(&plugin, "--peer-tls-cert"), None);
    assert_eq!(flag(&operator_container(&docs)?, "--peer-tls-secret"), None);

    // An existing Secret (cert-manager's, say): that one mounted, the operator makes none.
    let docs = render(&helm, &["peer.tls.existingSecret=fleet-cert"])?;
    assert_eq!(flag(&operator_container(&docs)?, "--peer-tls-secret"), None);
    let volume = pod_spec(&daemonset(&docs)?)
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "peer-tls")
        .cloned()
        .context("no peer-tls volume")?;
    assert_eq!(
        volume.secret.and_then(|s| s.secret_name).as_deref(),
        Some("fleet-cert")
    );
    Ok(())
}

#[test]
fn network_policies_admit_peers_from_plugins_and_metrics_from_scrapers() -> Result<()> {
    let Some(helm) = helm("network_policies_admit_peers_from_plugins_and_metrics_from_scrapers")
    else {
        return Ok(());
    };
    let docs = render(&helm, &["peer.port=7171"])?;
    let policies = of_kind(&docs, "NetworkPolicy");
    let node = policies
        .iter()
        .find(|p| p["metadata"]["name"] == "sv-sealed-volumes-node")
        .context("no node NetworkPolicy")?;
    assert_eq!(
        node["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "node"
    );
    assert_eq!(node["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let rules = node["spec"]["ingress"]
        .as_array()
        .context("no ingress rules")?;
    let rule_for = |port: u16| {
        rules
            .iter()
            .find(|r| r["ports"][0]["port"] == port)
            .cloned()
    };
    let peer = rule_for(7171).context("no rule for the peer port")?;
    assert_eq!(peer["from"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        peer["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"], "node",
        "the peer port admits only the plugin pods"
    );
    assert!(peer["from"][0].get("namespaceSelector").is_none());
    let metrics = rule_for(9809).context("no rule for the metrics port")?;
    assert_eq!(
        metrics["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "prometheus"
    );
    assert_eq!(rules.len(), 2, "no other port is admitted: {rules:?}");
    let operator = policies
        .iter()
        .find(|p| p["metadata"]["name"] == "sv-sealed-volumes-operator")
        .context("no operator NetworkPolicy")?;
    let ports: Vec<&Value> = operator["spec"]["ingress"]
        .as_array()
        .context("no operator ingress")?
        .iter()
        .map(|r| &r["ports"][0]["port"])
        .collect();
    assert_eq!(
        ports,
        [&serde_json::json!("webhook"), &serde_json::json!(8080)]
    );

    // A custom scraper selector, and the opt-out.
    let docs = render(
        &helm,
        &[
            r#"json:networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":{"team":"obs"}}}]"#,
        ],
    )?;
    let node = of_kind(&docs, "NetworkPolicy")
        .into_iter()
        .find(|p| p["metadata"]["name"] == "sv-sealed-volumes-node")
        .context("no node NetworkPolicy")?
        .clone();
    assert_eq!(
        node["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]["team"],
        "obs"
    );
    let docs = render(&helm, &["networkPolicy.enabled=false"])?;
    assert!(of_kind(&docs, "NetworkPolicy").is_empty());
    Ok(())
}

#[test]
fn warming_is_off_unless_allowed_and_its_bounds_reach_both_binaries() -> Result<()> {
    let Some(helm) = helm("warming_is_off_unless_allowed_and_its_bounds_reach_both_binaries")
    else {
        return Ok(());
    };
    let docs = render(&helm, &[])?;
    let plugin = container(pod_spec(&daemonset(&docs)?), "plugin").clone();
    assert_eq!(flag(&plugin, "--warming").as_deref(), Some("off"));
    let deploy: Deployment = one(&docs, "Deployment")?;
    let operator = deploy
        .spec
        .and_then(|s| s.template.spec)
        .context("no operator pod spec")?
        .containers[0]
        .clone();
    assert_eq!(flag(&operator, "--warming").as_deref(), Some("off"));
    let reads_namespaces = |docs: &[Value]| {
        of_kind(docs, "ClusterRole")
            .iter()
            .filter(|r| {
                r["rules"].as_array().is_some_and(|rules| {
                    rules
                        .iter()
                        .any(|rule| rule["resources"] == serde_json::json!(["namespaces"]))
                })
            })
            .count()
    };
    assert_eq!(reads_namespaces(&docs), 0);
    let docs = render(
        &helm,
        &[
            "warming.allow=labelled",
            "warming.cacheShare=10",
            "warming.spareRecentSeconds=600",
            "warming.rate=8Mi",
        ],
    )?;
    let plugin = container(pod_spec(&daemonset(&docs)?), "plugin").clone();
    assert_eq!(flag(&plugin, "--warming").as_deref(), Some("labelled"));
    assert_eq!(
        flag(&plugin, "--warming-namespace-label").as_deref(),
        Some("sealedvolumes.io/warming=allowed")
    );
    assert_eq!(flag(&plugin, "--warm-cache-share").as_deref(), Some("10"));
    assert_eq!(
        flag(&plugin, "--warm-spare-recent-secs").as_deref(),
        Some("600")
    );
    assert_eq!(flag(&plugin, "--warm-rate").as_deref(), Some("8Mi"));
    // Both the operator and the plugins read namespaces' labels.
    assert_eq!(reads_namespaces(&docs), 2);
    Ok(())
}

#[test]
fn peer_values_render_the_service_token_and_flags() -> Result<()> {
    let Some(helm) = helm("peer_values_render_the_service_token_and_flags") else {
        return Ok(());
    };
    // Off when asked: no Service, no token, no flags.
    let docs = render(&helm, &["peer.enabled=false"])?;
    let plugin = container(pod_spec(&daemonset(&docs)?), "plugin").clone();
    assert_eq!(flag(&plugin, "--peer-listen"), None);
    assert_eq!(flag(&plugin, "--peer-upload-rate"), None);
    assert!(
        of_kind(&docs, "Service")
            .iter()
            .all(|s| s["metadata"]["name"] != "sv-sealed-volumes-peers")
    );

    let docs = render(
        &helm,
        &[
            "peer.enabled=true",
            "peer.port=7171",
            "peer.fanout=16",
            "peer.uploadRate=100Mi",
        ],
    )?;
    let ds = daemonset(&docs)?;
    let spec = pod_spec(&ds);
    let plugin = container(spec, "plugin");
    assert_eq!(
        flag(plugin, "--peer-listen").as_deref(),
        Some("0.0.0.0:7171")
    );
    assert_eq!(
        flag(plugin, "--peer-advertise").as_deref(),
        Some("$(POD_IP):7171")
    );
    assert_eq!(
        flag(plugin, "--peer-service").as_deref(),
        Some("sealed-system/sv-sealed-volumes-peers")
    );
    assert_eq!(flag(plugin, "--peer-fanout").as_deref(), Some("16"));
    assert_eq!(flag(plugin, "--peer-upload-rate").as_deref(), Some("100Mi"));
    let token_file = flag(plugin, "--peer-token-file").context("no --peer-token-file")?;
    let mount = plugin
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "peer-token")
        .context("the token is not mounted")?;
    assert!(token_file.starts_with(&mount.mount_path));
    assert_eq!(mount.read_only, Some(true));
    assert!(
        plugin
            .ports
            .iter()
            .flatten()
            .any(|p| p.name.as_deref() == Some("peer") && p.container_port == 7171)
    );
    assert!(
        plugin.env.iter().flatten().any(|e| e.name == "POD_IP"),
        "the advertised address needs the pod IP"
    );
    // A headless Service selecting the node plugins: its EndpointSlices are the membership.
    let service = of_kind(&docs, "Service")
        .into_iter()
        .find(|s| s["metadata"]["name"] == "sv-sealed-volumes-peers")
        .context("no peers Service")?;
    assert_eq!(service["spec"]["clusterIP"], "None");
    assert_eq!(
        service["spec"]["selector"]["app.kubernetes.io/component"],
        "node"
    );
    assert_eq!(service["spec"]["ports"][0]["port"], 7171);
    // The token Secret is the operator's to make (not rendered: no render rotates it), and
    // the plugin may only read EndpointSlices in its namespace.
    assert!(
        of_kind(&docs, "Secret")
            .iter()
            .all(|s| s["metadata"]["name"] != "sv-sealed-volumes-peer-token")
    );
    let role = of_kind(&docs, "Role")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "sv-sealed-volumes-peers")
        .context("no peers Role")?;
    assert_eq!(role["rules"][0]["resources"][0], "endpointslices");
    assert_eq!(
        role["rules"][0]["verbs"],
        serde_json::json!(["get", "list", "watch"])
    );

    // An existing Secret instead: that one mounted, the operator makes none.
    let docs = render(
        &helm,
        &["peer.enabled=true", "peer.existingTokenSecret=my-token"],
    )?;
    let deploy: Deployment = one(&docs, "Deployment")?;
    let operator = deploy
        .spec
        .and_then(|s| s.template.spec)
        .context("no operator pod spec")?
        .containers[0]
        .clone();
    assert_eq!(flag(&operator, "--peer-token-secret"), None);
    let volumes = pod_spec(&daemonset(&docs)?)
        .volumes
        .clone()
        .unwrap_or_default();
    let token = volumes
        .iter()
        .find(|v| v.name == "peer-token")
        .context("no token volume")?;
    assert_eq!(
        token.secret.as_ref().and_then(|s| s.secret_name.as_deref()),
        Some("my-token")
    );
    Ok(())
}
