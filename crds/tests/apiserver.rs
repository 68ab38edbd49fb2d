//! The CRDs against the real API server of the local cluster (`hack/cluster.sh`): they
//! install, valid objects are accepted and defaulted, invalid ones are rejected at admission
//! with a message that says what is wrong, and the printer columns print.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource};
use sealed_crds::{
    HuggingFaceSource, ObjectStoreSource, Retention, SealedVolume, SealedVolumeSpec,
    SealedVolumeVersion, SealedVolumeVersionSpec, Source,
};

const D1: &str = "blake3:8f3a5b0c1d2e3f405162738495a6b7c8d9eaf00112233445566778899aabbccd";
const D2: &str = "blake3:1c2d000000000000000000000000000000000000000000000000000000000002";
const MANAGER: &str = "sealed-crds-test";

fn hf_volume(name: &str) -> SealedVolume {
    SealedVolume::new(
        name,
        SealedVolumeSpec {
            source: Source::hugging_face(HuggingFaceSource {
                repo: "meta-llama/Meta-Llama-3-8B".into(),
                revision: "main".into(),
                repo_type: Default::default(),
                include: vec!["*.safetensors".into(), "*.json".into()],
                exclude: vec![],
                token_secret_ref: Some(sealed_crds::SecretKeyRef {
                    name: "hf-token".into(),
                    key: "token".into(),
                }),
                endpoint: None,
            }),
            tags: BTreeMap::from([("prod".into(), D1.into()), ("staging".into(), D2.into())]),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: None,
        },
    )
}

fn version(name: &str, volume: &str, digest: &str) -> SealedVolumeVersion {
    SealedVolumeVersion::new(
        name,
        SealedVolumeVersionSpec {
            volume: volume.into(),
            digest: digest.into(),
        },
    )
}

/// Expects `result` to be a 422 rejection whose message contains every one of `needles`.
fn expect_rejected<T: std::fmt::Debug>(
    what: &str,
    result: kube::Result<T>,
    needles: &[&str],
) -> Result<String> {
    match result {
        Ok(obj) => bail!("{what}: the API server accepted an invalid object: {obj:?}"),
        Err(kube::Error::Api(status)) => {
            if status.code != 422 {
                bail!(
                    "{what}: expected 422 Invalid, got {}: {}",
                    status.code,
                    status.message
                );
            }
            for n in needles {
                if !status.message.contains(n) {
                    bail!(
                        "{what}: the rejection does not say {n:?}: {}",
                        status.message
                    );
                }
            }
            eprintln!("{what}: rejected: {}", status.message);
            Ok(status.message)
        }
        Err(e) => bail!("{what}: unexpected error: {e}"),
    }
}

#[tokio::test]
async fn crds_install_accept_valid_and_reject_invalid_objects() -> Result<()> {
    let Some(cluster) =
        sealed_e2e::cluster("crds_install_accept_valid_and_reject_invalid_objects").await
    else {
        return Ok(());
    };
    let client = cluster.client.clone();
    sealed_e2e::install_crds(&client, MANAGER).await?;
    let ns = cluster.temp_namespace("crds").await?;
    let mut result = run(&client, &ns).await;
    if result.is_ok() {
        result = kubectl_shows_docs_and_short_names(&cluster, &ns);
    }
    cluster.delete_namespace(&ns).await?;
    result
}

/// `kubectl explain` prints the doc comments; `kubectl get` knows the short names and
/// prints the columns.
fn kubectl_shows_docs_and_short_names(cluster: &sealed_e2e::Cluster, ns: &str) -> Result<()> {
    let bin = Command::new(sealed_e2e::repo_root().join("hack/build-k8s.sh"))
        .arg("--print-bin-dir")
        .output()
        .context("cannot run hack/build-k8s.sh")?;
    let kubectl = std::path::PathBuf::from(String::from_utf8(bin.stdout)?.trim()).join("kubectl");
    // A private discovery cache: a shared one may predate the CRDs just applied.
    let cache = std::env::temp_dir().join(format!("sealed-crds-kubectl-{}", std::process::id()));
    let run = |args: &[&str]| -> Result<String> {
        let out = Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&cluster.kubeconfig)
            .arg("--cache-dir")
            .arg(&cache)
            .args(args)
            .output()
            .with_context(|| format!("cannot run {}", kubectl.display()))?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    };
    for (path, needle) in [
        ("sealedvolume.spec.tags", "Movable names for versions"),
        (
            "svol.spec.source",
            "exactly one of huggingFace, objectStore or upload",
        ),
        ("svol.spec.retention.deletedVersions", "stays restorable"),
        ("svv.spec.digest", "Immutable"),
        ("svv.status.bytesReused", "already in the store"),
    ] {
        let text = run(&["explain", path])?;
        if !text.contains(needle) {
            bail!("kubectl explain {path} does not say {needle:?}:\n{text}");
        }
    }
    let text = run(&["get", "svol", "-n", ns, "llama-3-8b"])?;
    for col in [
        "NAME",
        "SOURCE",
        "LATEST",
        "READY",
        "SYNCED",
        "AGE",
        "hf://meta-llama",
        "blake3:8f3a5b0c ",
    ] {
        if !text.contains(col) {
            bail!("kubectl get svol does not print {col}:\n{text}");
        }
    }
    // The full digest only with -o wide.
    if text.contains(D1) {
        bail!("kubectl get svol prints the full digest:\n{text}");
    }
    let wide = run(&["get", "svol", "-n", ns, "llama-3-8b", "-o", "wide"])?;
    if !wide.contains("LATEST DIGEST") || !wide.contains(D1) {
        bail!("kubectl get svol -o wide does not print the full digest:\n{wide}");
    }
    let text = run(&["get", "svv", "-n", ns])?;
    for col in ["VOLUME", "DIGEST", "READY", "SIZE", "FILES", "14.9 GiB"] {
        if !text.contains(col) {
            bail!("kubectl get svv does not print {col}:\n{text}");
        }
    }
    let wide = run(&["get", "svv", "-n", ns, "-o", "wide"])?;
    if !wide.contains("BYTES") || !wide.contains("16000000000") {
        bail!("kubectl get svv -o wide does not print the exact size:\n{wide}");
    }
    eprintln!("kubectl get svv:\n{text}");
    // The category lists both kinds (discovery may take a moment to show a changed CRD).
    let mut text = String::new();
    for _ in 0..20 {
        let _ = std::fs::remove_dir_all(&cache);
        match run(&["get", "sealed", "-n", ns, "-o", "name"]) {
            Ok(t) => {
                text = t;
                break;
            }
            Err(e) => text = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let _ = std::fs::remove_dir_all(&cache);
    for name in [
        "sealedvolume.sealedvolumes.io/llama-3-8b",
        "sealedvolumeversion.sealedvolumes.io/llama-3-8b-8f3a5b0c",
    ] {
        if !text.contains(name) {
            bail!("kubectl get sealed does not list {name}:\n{text}");
        }
    }
    Ok(())
}

async fn run(client: &Client, ns: &str) -> Result<()> {
    let volumes: Api<SealedVolume> = Api::namespaced(client.clone(), ns);
    let versions: Api<SealedVolumeVersion> = Api::namespaced(client.clone(), ns);
    let pp = PostParams::default();

    // --- valid objects are accepted, and defaults filled in -----------------------------
    let created = volumes.create(&pp, &hf_volume("llama-3-8b")).await?;
    assert_eq!(created.spec, hf_volume("llama-3-8b").spec);

    // The design's example as YAML, with revision and retention left to their defaults.
    let yaml = r#"
apiVersion: sealedvolumes.io/v1alpha1
kind: SealedVolume
metadata: {name: from-yaml}
spec:
  source:
    huggingFace: {repo: meta-llama/Meta-Llama-3-8B, include: ["*.safetensors", "*.json"],
                  tokenSecretRef: {name: hf-token, key: token}}
  tags: {prod: "blake3:8f3a5b0c1d2e3f405162738495a6b7c8d9eaf00112233445566778899aabbccd"}
"#;
    let from_yaml: SealedVolume = serde_saphyr::from_str(yaml)?;
    let created = volumes.create(&pp, &from_yaml).await?;
    let hf = created.spec.source.hugging_face.as_ref().unwrap();
    assert_eq!(hf.revision, "main", "revision defaults to main");
    assert_eq!(created.spec.retention.deleted_versions, "168h");

    let bucket = SealedVolume::new(
        "from-bucket",
        SealedVolumeSpec {
            source: Source::object_store(ObjectStoreSource {
                url: "s3://models/llama".into(),
                endpoint: Some("http://127.0.0.1:5000".into()),
                region: Some("us-east-1".into()),
                credentials_secret_ref: Some(sealed_crds::SecretRef { name: "s3".into() }),
            }),
            tags: BTreeMap::new(),
            retention: Retention {
                deleted_versions: "1h30m".into(),
            },
            shared: true,
            warm: None,
            verify: None,
        },
    );
    volumes.create(&pp, &bucket).await?;
    // The longest retention there is: accepted, and read back as it was written.
    let mut longest = hf_volume("longest-retention");
    longest.spec.retention.deleted_versions = "876000h".into();
    let created = volumes.create(&pp, &longest).await?;
    assert_eq!(
        created.spec.retention.deleted_versions(),
        Ok(sealed_crds::validate::MAX_DURATION)
    );
    let upload = SealedVolume::new(
        "pushed",
        SealedVolumeSpec {
            source: Source::upload(),
            tags: BTreeMap::new(),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: None,
        },
    );
    let created = volumes.create(&pp, &upload).await?;
    assert!(
        created.spec.source.upload.is_some(),
        "upload: {{}} survives"
    );

    let v1 = versions
        .create(&pp, &version("llama-3-8b-8f3a5b0c", "llama-3-8b", D1))
        .await?;
    assert_eq!(v1.spec.digest, D1);

    // Status through the status subresource, then the printer columns as the server prints them.
    let status = serde_json::json!({
        "status": {
            "observedGeneration": 1,
            "source": "hf://meta-llama/Meta-Llama-3-8B@main",
            "latestDigest": D1,
            "latestShort": sealed_crds::short_digest(D1),
            "latestVersion": "llama-3-8b-8f3a5b0c",
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "Sealed", "message": "",
                 "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1},
                {"type": "Synced", "status": "False", "reason": "Syncing", "message": "4/9 files",
                 "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1},
            ],
            "sync": {"bytesDone": 10, "bytesTotal": 20, "filesDone": 4, "filesTotal": 9,
                     "progress": "50% (10 B of 20 B, 4/9 files)"},
        }
    });
    let patched = volumes
        .patch_status(
            "llama-3-8b",
            &PatchParams::default(),
            &Patch::Merge(&status),
        )
        .await?;
    let st = patched
        .status
        .as_ref()
        .context("no status after the patch")?;
    assert_eq!(
        st.condition(sealed_crds::CONDITION_READY).unwrap().status,
        "True"
    );
    assert_eq!(st.sync.as_ref().unwrap().files_total, 9);
    let table = get_table(client, ns, "sealedvolumes", "llama-3-8b").await?;
    assert_eq!(
        table_row(&table)?,
        vec![
            ("Name", "llama-3-8b".to_string()),
            ("Source", "hf://meta-llama/Meta-Llama-3-8B@main".into()),
            ("Latest", D1[..15].into()),
            ("Ready", "True".into()),
            ("Synced", "False".into()),
            ("Progress", "50% (10 B of 20 B, 4/9 files)".into()),
            ("Latest Digest", D1.into()),
        ]
    );
    let vstatus = serde_json::json!({"status": {"sizeBytes": 16_000_000_000i64,
        "size": "14.9 GiB", "files": 9,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Sealed", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}],
        "chunks": 15000, "bytesNew": 1000, "bytesReused": 15_999_999_000i64,
        "sealedAt": "2026-01-01T00:00:00Z", "sourceRevision": "8afc5e2"}});
    versions
        .patch_status(
            "llama-3-8b-8f3a5b0c",
            &PatchParams::default(),
            &Patch::Merge(&vstatus),
        )
        .await?;
    let table = get_table(client, ns, "sealedvolumeversions", "llama-3-8b-8f3a5b0c").await?;
    assert_eq!(
        table_row(&table)?,
        vec![
            ("Name", "llama-3-8b-8f3a5b0c".to_string()),
            ("Volume", "llama-3-8b".into()),
            ("Digest", D1.into()),
            ("Ready", "True".into()),
            ("Size", "14.9 GiB".into()),
            ("Files", "9".into()),
            ("Bytes", "16000000000".into()),
            ("Reused", "15999999000".into()),
            ("Revision", "8afc5e2".into()),
        ]
    );

    // Conditions are a list-map keyed by type: two field managers applying one condition
    // each (as the operator's sync and tag reconcilers may) keep both.
    let cond = |type_: &str, status: &str, reason: &str| sealed_crds::Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: format!("{type_} is {status}"),
        observed_generation: Some(1),
        last_transition_time: serde_json::from_value(serde_json::json!("2026-01-02T00:00:00Z"))
            .unwrap(),
    };
    for (manager, c) in [
        ("sealed-test-sync", cond("Synced", "True", "SyncSucceeded")),
        ("sealed-test-tags", cond("Ready", "False", "TagNotFound")),
    ] {
        let status = sealed_crds::SealedVolumeStatus {
            conditions: vec![c],
            ..Default::default()
        };
        let apply = serde_json::json!({
            "apiVersion": sealed_crds::API_VERSION, "kind": "SealedVolume",
            "status": status,
        });
        volumes
            .patch_status(
                "from-bucket",
                &PatchParams::apply(manager).force(),
                &Patch::Apply(&apply),
            )
            .await?;
    }
    let got = volumes.get_status("from-bucket").await?;
    let st = got.status.context("no status")?;
    assert_eq!(st.conditions.len(), 2, "{:?}", st.conditions);
    assert_eq!(st.condition("Synced").unwrap().reason, "SyncSucceeded");
    assert_eq!(st.condition("Ready").unwrap().reason, "TagNotFound");

    // spec.digest is selectable: the CSI driver's "is this digest in this namespace" lookup.
    let found = versions
        .list(&kube::api::ListParams::default().fields(&format!("spec.digest={D1}")))
        .await?;
    assert_eq!(found.items.len(), 1);
    let none = versions
        .list(&kube::api::ListParams::default().fields(&format!("spec.digest={D2}")))
        .await?;
    assert!(none.items.is_empty());

    // --- invalid objects are rejected with a message that says what is wrong ------------
    // Each case also goes through the Rust mirror of the rules, which must agree.
    let mut cases: Vec<(&str, SealedVolume, Vec<&str>)> = vec![];

    let mut two = hf_volume("two-sources");
    two.spec.source.upload = Some(Default::default());
    cases.push((
        "two sources",
        two,
        vec![
            "spec.source",
            "set exactly one of huggingFace, objectStore or upload",
        ],
    ));

    let mut none = hf_volume("no-source");
    none.spec.source = Source::default();
    cases.push((
        "no source",
        none,
        vec![
            "spec.source",
            "set exactly one of huggingFace, objectStore or upload",
        ],
    ));

    let mut bad_tag = hf_volume("bad-tag-name");
    bad_tag.spec.tags.insert("Bad_Tag".into(), D1.into());
    cases.push((
        "bad tag name",
        bad_tag,
        vec![
            "spec.tags",
            "invalid tag name: a tag name has lowercase letters",
            "at most 63 characters",
        ],
    ));

    let mut long_tag = hf_volume("long-tag-name");
    long_tag.spec.tags.insert("a".repeat(64), D1.into());
    cases.push((
        "tag name too long",
        long_tag,
        vec!["spec.tags", "invalid tag name"],
    ));

    let mut bad_tag_digest = hf_volume("bad-tag-digest");
    bad_tag_digest
        .spec
        .tags
        .insert("prod".into(), "sha256:1234".into());
    cases.push((
        "tag naming a bad digest",
        bad_tag_digest,
        vec!["spec.tags.prod", "^blake3:[0-9a-f]{64}$"],
    ));

    let mut bad_retention = hf_volume("bad-retention");
    bad_retention.spec.retention.deleted_versions = "7d".into();
    cases.push((
        "retention in days",
        bad_retention,
        vec![
            "spec.retention.deletedVersions",
            "must be a duration such as 168h",
        ],
    ));

    // Past 100 years (the value that once overflowed the trash's timestamps, and one past
    // Go's int64 nanoseconds, which CEL's duration() cannot hold): refused, with the range.
    for (name, value) in [
        ("retention-past-bound", "876001h"),
        ("retention-overflow", "3000000000h"),
        ("retention-huge", "99999999999999999999h"),
    ] {
        let mut long = hf_volume(name);
        long.spec.retention.deleted_versions = value.into();
        cases.push((
            "retention over 100 years",
            long,
            vec![
                "spec.retention.deletedVersions",
                "at most 876000h (100 years)",
            ],
        ));
    }

    let mut bad_repo = hf_volume("bad-repo");
    bad_repo.spec.source.hugging_face.as_mut().unwrap().repo = "https://huggingface.co/x/y".into();
    cases.push((
        "repo as a URL",
        bad_repo,
        vec![
            "spec.source.huggingFace.repo",
            "must be a Hugging Face repository id",
        ],
    ));

    let mut bad_url = bucket.clone();
    bad_url.metadata.name = Some("bad-url".into());
    bad_url.spec.source.object_store.as_mut().unwrap().url = "models/llama".into();
    cases.push((
        "object store URL without a scheme",
        bad_url,
        vec!["spec.source.objectStore.url", "must be a URL such as s3://"],
    ));

    let mut bad_endpoint = bucket.clone();
    bad_endpoint.metadata.name = Some("bad-endpoint".into());
    bad_endpoint
        .spec
        .source
        .object_store
        .as_mut()
        .unwrap()
        .endpoint = Some("127.0.0.1:5000".into());
    cases.push((
        "endpoint without a scheme",
        bad_endpoint,
        vec!["spec.source.objectStore.endpoint", "must be an http(s) URL"],
    ));

    for (what, obj, needles) in cases {
        let local = obj.spec.validate();
        assert!(
            !local.is_empty(),
            "{what}: the Rust rules accept what the API server must reject"
        );
        expect_rejected(what, volumes.create(&pp, &obj).await, &needles)?;
    }
    for (what, obj) in [
        ("the design example", from_yaml.spec),
        ("the bucket volume", bucket.spec),
        ("the upload volume", upload.spec),
    ] {
        assert!(obj.validate().is_empty(), "{what}: {:?}", obj.validate());
    }

    // Bad digests on a version.
    for (what, digest) in [
        (
            "uppercase digest",
            D1.to_uppercase().replace("BLAKE3", "blake3"),
        ),
        ("sha256 digest", D1.replace("blake3", "sha256")),
        ("short digest", D1[..40].to_string()),
    ] {
        let v = version("bad-digest", "llama-3-8b", &digest);
        assert!(
            !v.spec.validate().is_empty(),
            "{what}: Rust rules accept it"
        );
        expect_rejected(
            what,
            versions.create(&pp, &v).await,
            &["spec.digest", "^blake3:[0-9a-f]{64}$"],
        )?;
    }

    // spec.digest and spec.volume are immutable.
    let mut changed = versions.get("llama-3-8b-8f3a5b0c").await?;
    let old = changed.spec.clone();
    changed.spec.digest = D2.into();
    assert!(!changed.spec.validate_update(&old).is_empty());
    expect_rejected(
        "changing spec.digest (update)",
        versions.replace("llama-3-8b-8f3a5b0c", &pp, &changed).await,
        &["spec.digest", "spec.digest is immutable"],
    )?;
    let patch = serde_json::json!({"spec": {"digest": D2}});
    expect_rejected(
        "changing spec.digest (patch)",
        versions
            .patch(
                "llama-3-8b-8f3a5b0c",
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await,
        &["spec.digest is immutable"],
    )?;
    let patch = serde_json::json!({"spec": {"volume": "other"}});
    expect_rejected(
        "changing spec.volume",
        versions
            .patch(
                "llama-3-8b-8f3a5b0c",
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await,
        &["spec.volume is immutable"],
    )?;
    // ...while the same digest is fine (a no-op update), and labels may change.
    let patch =
        serde_json::json!({"metadata": {"labels": {sealed_crds::VOLUME_LABEL: "llama-3-8b"}}});
    versions
        .patch(
            "llama-3-8b-8f3a5b0c",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;

    // Tags are movable: moving a tag is an ordinary update.
    let patch = serde_json::json!({"spec": {"tags": {"prod": D2}}});
    let moved = volumes
        .patch("llama-3-8b", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    assert_eq!(moved.spec.tags["prod"], D2);
    assert_eq!(moved.meta().generation, Some(2));
    Ok(())
}

/// Gets one object as the server's Table (what `kubectl get` prints).
async fn get_table(
    client: &Client,
    ns: &str,
    plural: &str,
    name: &str,
) -> Result<serde_json::Value> {
    let url = format!("/apis/sealedvolumes.io/v1alpha1/namespaces/{ns}/{plural}/{name}");
    let req = http::Request::get(url)
        .header(
            "Accept",
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
        )
        .body(vec![])?;
    let text = client.request_text(req).await?;
    Ok(serde_json::from_str(&text)?)
}

/// The columns and cells of a one-row Table, without the Age column (it changes).
fn table_row(table: &serde_json::Value) -> Result<Vec<(&str, String)>> {
    let cols = table["columnDefinitions"]
        .as_array()
        .context("no columnDefinitions")?;
    let cells = table["rows"][0]["cells"].as_array().context("no row")?;
    Ok(cols
        .iter()
        .zip(cells)
        .map(|(c, v)| {
            let name = c["name"].as_str().unwrap_or("?");
            let v = match v {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (name, v)
        })
        .filter(|(n, _)| *n != "Age")
        .collect())
}
