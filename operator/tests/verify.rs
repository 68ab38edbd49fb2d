//! Verify at seal, against the real API server (`hack/cluster.sh`) with an inline operator and
//! a local file store: a volume whose `spec.verify` names a public key (from a Secret of its
//! namespace) gets versions whose `model.sig` is checked against the sealed manifest. A
//! signed version becomes Ready and Verified with the signer in its status; a version with a
//! changed file is not Ready, and an Event names the file; a version without a signature
//! names the missing file.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Secret};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use sealed_crds::volume::{KeyRef, Verify};
use sealed_crds::{
    CONDITION_READY, CONDITION_VERIFIED, Retention, SealedVolume, SealedVolumeSpec,
    SealedVolumeVersion, SealedVolumeVersionSpec, SecretKeyRef, Source,
};
use sealed_operator::config::OperatorConfig;
use sealed_operator::metrics::Metrics;
use sealed_provenance::SigningKey;
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress, StoreOptions};

const TIMEOUT: Duration = Duration::from_secs(60);

async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {TIMEOUT:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn verified_volume(name: &str) -> SealedVolume {
    SealedVolume::new(
        name,
        SealedVolumeSpec {
            source: Source::upload(),
            tags: BTreeMap::new(),
            retention: Retention::default(),
            shared: false,
            warm: None,
            verify: Some(Verify {
                keys: vec![KeyRef {
                    secret_key_ref: Some(SecretKeyRef {
                        name: "publisher".into(),
                        key: "key.pub.pem".into(),
                    }),
                    config_map_key_ref: None,
                }],
                certificates: None,
                signature_path: "model.sig".into(),
                ignore_paths: vec![],
            }),
        },
    )
}

fn write_tree(dir: &Path, weights_seed: u8) {
    std::fs::create_dir_all(dir.join("tokenizer")).expect("mkdir");
    let data: Vec<u8> = (0..(1 << 20))
        .map(|i: usize| (i as u8) ^ weights_seed)
        .collect();
    std::fs::write(dir.join("weights.bin"), data).expect("write");
    std::fs::write(dir.join("config.json"), b"{\"layers\": 2}\n").expect("write");
    std::fs::write(dir.join("tokenizer/vocab.txt"), b"a\nb\n").expect("write");
}

async fn push_to(store: &ChunkStore, dir: &Path, volume: Option<String>) -> Digest {
    push(
        store,
        dir,
        &PushOptions {
            volume,
            ..Default::default()
        },
        Arc::new(NoProgress),
    )
    .await
    .expect("push")
    .digest
}

async fn events(client: &Client, ns: &str, reason: &str) -> Vec<String> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some(reason))
                .filter_map(|e| e.message)
                .collect()
        })
        .unwrap_or_default()
}

fn condition(v: &SealedVolumeVersion, type_: &str) -> Option<(String, String, String)> {
    let c = v.status.as_ref()?.condition(type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn version_with(
    versions: &Api<SealedVolumeVersion>,
    volume: &str,
    digest: &Digest,
    what: &str,
) -> SealedVolumeVersion {
    let name = SealedVolumeVersionSpec::object_name(volume, &digest.to_string());
    wait_for(what, || async {
        versions
            .get_opt(&name)
            .await
            .ok()
            .flatten()
            .filter(|v| condition(v, CONDITION_VERIFIED).is_some())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_version_is_verified_and_a_tampered_one_is_not_ready() {
    let Some(cluster) = sealed_e2e::cluster("verify").await else {
        return;
    };
    let client = cluster.client.clone();
    sealed_e2e::install_crds(&client, "sealed-operator-test")
        .await
        .expect("install CRDs");
    let ns = cluster
        .temp_namespace("svol-verify")
        .await
        .expect("namespace");
    let store_dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", store_dir.path().display());
    let store = ChunkStore::open(
        &url,
        &StoreOptions {
            create: true,
            ..Default::default()
        },
    )
    .await
    .expect("store");

    // The publisher's key pair; the public key in a Secret of the namespace.
    let key_pair = rcgen::KeyPair::generate().expect("key");
    let signer = SigningKey::from_pem(&key_pair.serialize_pem()).expect("signing key");
    let public = signer.public_key();
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "publisher"},
        "stringData": {"key.pub.pem": public.to_pem().expect("pem")},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create Secret");

    // The model signed as `sealed push --sign` signs it (model_signing's format, BLAKE3
    // from the manifest), model.sig written into the tree; a copy of the tree with one
    // changed file and the same signature; a tree with no signature.
    let work = tempfile::tempdir().expect("tempdir");
    let (good, bad, none) = (
        work.path().join("good"),
        work.path().join("bad"),
        work.path().join("none"),
    );
    write_tree(&good, 1);
    let unsigned = push_to(&store, &good, None).await;
    let manifest = store.get_manifest(&unsigned).await.expect("manifest");
    let sig = sealed_provenance::sign_manifest(&manifest, "good", &["model.sig".into()], &signer)
        .expect("sign");
    std::fs::write(good.join("model.sig"), &sig).expect("write");
    write_tree(&bad, 2);
    std::fs::write(bad.join("model.sig"), &sig).expect("write");
    write_tree(&none, 1);

    let mut config = OperatorConfig::inline(&url, &ns);
    config.upload_poll = Duration::from_secs(1);
    let operator = {
        let (client, store) = (client.clone(), store.clone());
        tokio::spawn(async move {
            if let Err(e) =
                sealed_operator::controller::run(client, config, store, Arc::new(Metrics::new()))
                    .await
            {
                panic!("operator stopped: {e:#}");
            }
        })
    };
    let volumes: Api<SealedVolume> = Api::namespaced(client.clone(), &ns);
    let versions: Api<SealedVolumeVersion> = Api::namespaced(client.clone(), &ns);
    for name in ["good", "bad", "none"] {
        volumes
            .create(&PostParams::default(), &verified_volume(name))
            .await
            .expect("create volume");
    }
    let good_digest = push_to(&store, &good, Some(format!("{ns}/good"))).await;
    let bad_digest = push_to(&store, &bad, Some(format!("{ns}/bad"))).await;
    let none_digest = push_to(&store, &none, Some(format!("{ns}/none"))).await;

    // Signed: Verified and Ready, the signer in the status.
    let v = version_with(
        &versions,
        "good",
        &good_digest,
        "the signed version checked",
    )
    .await;
    let (status, reason, message) = condition(&v, CONDITION_VERIFIED).expect("Verified");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Signed"),
        "{message}"
    );
    assert_eq!(
        condition(&v, CONDITION_READY).map(|c| c.0).as_deref(),
        Some("True")
    );
    let verification = v
        .status
        .as_ref()
        .and_then(|s| s.verification.clone())
        .expect("status.verification");
    let hint = public.hint().expect("hint");
    assert_eq!(verification.signer, format!("P-256 key {hint}"));
    assert_eq!(verification.mode, "key");
    assert_eq!(verification.algorithm, "blake3");
    assert_eq!(verification.files, 3);
    assert_eq!(verification.signature_path, "model.sig");
    assert_eq!(verification.model.as_deref(), Some("good"));

    // One changed file: not Ready, an Event names it.
    let v = version_with(
        &versions,
        "bad",
        &bad_digest,
        "the tampered version checked",
    )
    .await;
    let (status, reason, message) = condition(&v, CONDITION_VERIFIED).expect("Verified");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "VerificationFailed")
    );
    assert!(message.contains("changed file weights.bin"), "{message}");
    let ready = condition(&v, CONDITION_READY).expect("Ready");
    assert_eq!(
        (ready.0.as_str(), ready.1.as_str()),
        ("False", "NotVerified")
    );
    assert!(
        v.status
            .as_ref()
            .and_then(|s| s.verification.as_ref())
            .is_none()
    );
    let told = wait_for(
        "a VerificationFailed Event for the changed file",
        || async {
            let e = events(&client, &ns, "VerificationFailed").await;
            e.into_iter()
                .find(|m| m.contains("changed file weights.bin"))
        },
    )
    .await;
    assert!(
        told.starts_with("signature model.sig does not verify: key"),
        "{told}"
    );

    // No signature at all: not Ready, the missing file named.
    let v = version_with(
        &versions,
        "none",
        &none_digest,
        "the unsigned version checked",
    )
    .await;
    let (status, _, message) = condition(&v, CONDITION_VERIFIED).expect("Verified");
    assert_eq!(status, "False");
    assert!(
        message.contains("the version has no file model.sig"),
        "{message}"
    );
    assert_eq!(
        condition(&v, CONDITION_READY).map(|c| c.0).as_deref(),
        Some("False")
    );

    operator.abort();
    let _ = cluster.delete_namespace(&ns).await;
}
