//! Step 9 of the journey: a hostile tenant in its own namespace (`attacker_ns`) against the
//! victim of steps 2-8 (namespace `ns`, volume `tiny`, digest v1). Every attack of issue 11 is
//! refused with a clear condition or Event and seals or mounts nothing of the victim's; the
//! legitimate path (a shared volume) keeps working. docs/security.md is the threat model.

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Secret};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use object_store::PutPayload;
use sealed_crds::{SealedVolume, SealedVolumeVersion, SealedVolumeVersionSpec};
use sealed_e2e::wait_for;
use sealed_store::Digest;

use super::{HOST_IP, Journey, REGION, SOURCE_BUCKET, SOURCE_PREFIX, STORE_BUCKET, VOLUME};
use super::{by_digest, expected_sums, reader_pod, say, step};

/// A TCP server on every address that records the head of each request it gets (an
/// attacker's endpoint): it must get no credential, and here no request at all.
struct Recorder {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    fn start() -> Result<Recorder> {
        let listener = TcpListener::bind("0.0.0.0:0")?;
        let port = listener.local_addr()?.port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                let mut buf = vec![0u8; 16 * 1024];
                let n = conn.read(&mut buf).unwrap_or(0);
                log.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = conn.write_all(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n");
            }
        });
        Ok(Recorder { port, seen })
    }

    fn endpoint(&self) -> String {
        format!("http://{HOST_IP}:{}", self.port)
    }

    fn requests(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn object_store_volume(name: &str, source: serde_json::Value) -> Result<SealedVolume> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolume",
        "metadata": { "name": name },
        "spec": { "source": { "objectStore": source } },
    }))?)
}

/// Waits for `Synced=False` on volume `name` and returns (reason, message).
async fn refusal(volumes: &Api<SealedVolume>, name: &str) -> Result<(String, String)> {
    let got = Mutex::new(None);
    wait_for(
        &format!("SealedVolume {name} to be refused"),
        Duration::from_secs(60),
        || async {
            let v = volumes.get(name).await?;
            let c = v
                .status
                .as_ref()
                .and_then(|s| s.condition(sealed_crds::CONDITION_SYNCED))
                .cloned();
            if let Some(c) = c.filter(|c| c.status == "False" && c.reason != "Syncing") {
                *got.lock().unwrap() = Some((c.reason, c.message));
                return Ok(true);
            }
            Ok(false)
        },
    )
    .await?;
    got.into_inner().unwrap().context("no condition")
}

/// Every Event message in `ns`, for checking that no secret leaked into one.
async fn all_event_text(client: &Client, ns: &str) -> Result<String> {
    let events = Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    Ok(events
        .items
        .iter()
        .map(|e| {
            format!(
                "{} {}",
                e.reason.clone().unwrap_or_default(),
                e.message.clone().unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

async fn impersonating(j: &Journey, user: &str) -> Result<Client> {
    let kc = Kubeconfig::read_from(&j.cluster.kubeconfig)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.auth_info.impersonate = Some(user.into());
    Ok(Client::try_from(config)?)
}

pub(super) async fn tenant(j: &Journey, v1: &Digest) -> Result<()> {
    step(9, "a hostile tenant gets nothing of another namespace");
    let a = &j.attacker_ns;
    let client = j.client();
    let volumes: Api<SealedVolume> = Api::namespaced(client.clone(), a);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), a);
    let recorder = Recorder::start()?;
    let opted_in: Secret = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "a-keys", "labels": { sealed_crds::SOURCE_CREDENTIALS_LABEL: "true" } },
        "stringData": { "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "attacker-secret-0001" },
    }))?;
    secrets.create(&PostParams::default(), &opted_in).await?;
    let not_opted: Secret = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "someone-elses-keys" },
        "stringData": { "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "victim-secret-0002" },
    }))?;
    secrets.create(&PostParams::default(), &not_opted).await?;
    let moto = j.moto.pod_endpoint();
    let attacks = [
        (
            "steal-store",
            "the store's own bucket as a source",
            serde_json::json!({ "url": format!("s3://{STORE_BUCKET}/"), "endpoint": moto,
                "region": REGION, "credentialsSecretRef": { "name": "a-keys" } }),
            "SourceRefused",
        ),
        (
            "steal-files",
            "the sync process's own files",
            serde_json::json!({ "url": "file:///var/run/secrets/kubernetes.io/" }),
            "SourceRefused",
        ),
        (
            "leak-ambient",
            "an attacker's endpoint with no Secret (ambient credentials)",
            serde_json::json!({ "url": format!("s3://{SOURCE_BUCKET}/{SOURCE_PREFIX}"),
                "endpoint": recorder.endpoint(), "region": REGION }),
            "CredentialsRequired",
        ),
        (
            "leak-secret",
            "an attacker's endpoint with a Secret that did not opt in",
            serde_json::json!({ "url": format!("s3://{SOURCE_BUCKET}/{SOURCE_PREFIX}"),
                "endpoint": recorder.endpoint(), "region": REGION,
                "credentialsSecretRef": { "name": "someone-elses-keys" } }),
            "SecretNotOptedIn",
        ),
        (
            "userinfo",
            "userinfo in an endpoint",
            serde_json::json!({ "url": format!("s3://{SOURCE_BUCKET}/{SOURCE_PREFIX}"),
                "endpoint": format!("http://mallory:hunter2-pass@{HOST_IP}:{}", recorder.port),
                "region": REGION, "credentialsSecretRef": { "name": "a-keys" } }),
            "InvalidSource",
        ),
    ];
    for (name, what, source, _) in &attacks {
        volumes
            .create(
                &PostParams::default(),
                &object_store_volume(name, source.clone())?,
            )
            .await
            .with_context(|| format!("creating SealedVolume {name} ({what})"))?;
    }
    for (name, what, _, want) in &attacks {
        let (reason, message) = refusal(&volumes, name).await?;
        ensure!(
            reason == *want,
            "{what} ({name}): reason {reason}, want {want}: {message}"
        );
        say(format!("{what}: refused, {reason}: {message}"));
    }
    // What the attacker can read back: Events and status (the spec is its own writing). No
    // secret it named, nor the store's URL, is in there.
    let text = all_event_text(&client, a).await?;
    let statuses: Vec<_> = volumes
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|v| v.status)
        .collect();
    let statuses = serde_json::to_string(&statuses)?;
    let store_url = format!("s3://{STORE_BUCKET}/{}", super::STORE_PREFIX);
    for secret in [
        "hunter2-pass",
        "attacker-secret-0001",
        "victim-secret-0002",
        store_url.as_str(),
    ] {
        ensure!(
            !text.contains(secret) && !statuses.contains(secret),
            "{secret:?} appears in the attacker's Events or status"
        );
    }
    let jobs = Api::<Job>::namespaced(client.clone(), &j.release_ns)
        .list(&ListParams::default().labels(&format!("sealedvolumes.io/volume-namespace={a}")))
        .await?
        .items;
    ensure!(
        jobs.is_empty(),
        "refused sources started sync Jobs: {:?}",
        jobs.iter().map(|j| j.name_any()).collect::<Vec<_>>()
    );
    let requests = recorder.requests();
    ensure!(
        requests.is_empty(),
        "the attacker's endpoint received {} request(s): {requests:?}",
        requests.len()
    );
    say(
        "no sync Job ran for the attacker, its endpoint received nothing, no secret or store name in its Events or status",
    );

    // A version made by hand with the victim's digest.
    let grab: SealedVolume = serde_json::from_value(serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION, "kind": "SealedVolume",
        "metadata": { "name": "grab" }, "spec": { "source": { "upload": {} } },
    }))?;
    volumes.create(&PostParams::default(), &grab).await?;
    let mut fake = SealedVolumeVersion::new(
        "grab-v1",
        SealedVolumeVersionSpec {
            volume: "grab".into(),
            digest: v1.to_string(),
        },
    );
    fake.metadata.namespace = Some(a.clone());
    // As a tenant whose RBAC would even allow it: the admission policy refuses.
    let role: Role = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "mallory" },
        "rules": [{ "apiGroups": ["sealedvolumes.io"], "resources": ["sealedvolumeversions"],
                    "verbs": ["create", "get", "list"] }],
    }))?;
    Api::<Role>::namespaced(client.clone(), a)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "mallory" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mallory" },
        "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "mallory" }],
    }))?;
    Api::<RoleBinding>::namespaced(client.clone(), a)
        .create(&PostParams::default(), &binding)
        .await?;
    let mallory = impersonating(j, "mallory").await?;
    let denied = Api::<SealedVolumeVersion>::namespaced(mallory, a)
        .create(&PostParams::default(), &fake)
        .await;
    match denied {
        Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => {
            ensure!(
                e.message.contains("made by the sealed-volumes operator"),
                "refused, but not by the admission policy: {}",
                e.message
            );
            say(format!(
                "a tenant creating a SealedVolumeVersion is refused: {}",
                e.message
            ));
        }
        Err(e) => bail!("creating a version as a tenant failed oddly: {e}"),
        Ok(_) => bail!("the admission policy let a tenant create a SealedVolumeVersion"),
    }
    // An admin (past the policy) makes it anyway, with the victim version's attestation
    // copied into its status: the plugin still refuses the mount.
    let versions: Api<SealedVolumeVersion> = Api::namespaced(client.clone(), a);
    versions.create(&PostParams::default(), &fake).await?;
    let victim = j
        .versions()
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|v| v.spec.digest == v1.to_string())
        .context("the victim's v1 version")?;
    let stolen = victim
        .status
        .and_then(|s| s.attestation)
        .context("v1 has no attestation")?;
    versions
        .patch_status(
            "grab-v1",
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({ "status": { "attestation": stolen } })),
        )
        .await?;
    let attacker_pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), a);
    attacker_pods
        .create(
            &PostParams::default(),
            &reader_pod("steal-v1", &j.node, by_digest(v1), false)?,
        )
        .await?;
    let refusal_event = Mutex::new(String::new());
    wait_for(
        "a FailedMount event on pod steal-v1",
        Duration::from_secs(90),
        || async {
            let events = Api::<Event>::namespaced(client.clone(), a)
                .list(&ListParams::default().fields("involvedObject.name=steal-v1"))
                .await?;
            for e in events.items {
                let m = e.message.unwrap_or_default();
                if e.reason.as_deref() == Some("FailedMount") && m.contains("PermissionDenied") {
                    *refusal_event.lock().unwrap() = m;
                    return Ok(true);
                }
            }
            Ok(false)
        },
    )
    .await?;
    let phase = attacker_pods
        .get("steal-v1")
        .await?
        .status
        .and_then(|s| s.phase);
    ensure!(
        phase.as_deref() == Some("Pending"),
        "pod steal-v1 is {phase:?}"
    );
    say(format!(
        "a hand-made version with v1's digest and a copied attestation mounts nothing: {}",
        refusal_event.into_inner().unwrap()
    ));
    let ready = wait_for(
        "the hand-made version NotAttested",
        Duration::from_secs(60),
        || async {
            Ok(versions.get("grab-v1").await?.status.and_then(|s| {
                s.condition(sealed_crds::CONDITION_READY)
                    .map(|c| c.reason.clone())
            }) == Some("NotAttested".into()))
        },
    )
    .await;
    ensure!(
        ready.is_ok(),
        "the operator did not mark the hand-made version NotAttested"
    );

    // A store record written under the attacker's prefix, naming v1 without the proof.
    let record = serde_json::json!({
        "volume": format!("{a}/grab"), "digest": v1, "pushed_at": "2026-01-01T00:00:00Z",
        "proof": "00".repeat(32),
    });
    j.store
        .object_store()
        .put(
            &sealed_store::layout::volume_record_key(&format!("{a}/grab"), v1),
            PutPayload::from(serde_json::to_vec(&record)?),
        )
        .await?;
    wait_for(
        "a RecordRejected event",
        Duration::from_secs(60),
        || async { Ok(all_event_text(&client, a).await?.contains("RecordRejected")) },
    )
    .await?;
    let imported = SealedVolumeVersionSpec::object_name("grab", &v1.to_string());
    ensure!(
        versions.get_opt(&imported).await?.is_none(),
        "the forged record was imported"
    );
    say(
        "a store record naming v1 for the attacker's volume, without proof: RecordRejected, nothing imported",
    );

    // The legitimate path: the victim shares its volume, and the same pod mounts.
    let _ = attacker_pods.delete("steal-v1", &Default::default()).await;
    j.volumes()
        .patch(
            VOLUME,
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({ "spec": { "shared": true } })),
        )
        .await?;
    attacker_pods
        .create(
            &PostParams::default(),
            &reader_pod("shared-v1", &j.node, by_digest(v1), false)?,
        )
        .await?;
    let want = expected_sums(&j.store, v1).await?;
    wait_for(
        "pod shared-v1 to read the shared version",
        Duration::from_secs(90),
        || async {
            let log = attacker_pods
                .logs("shared-v1", &Default::default())
                .await
                .unwrap_or_default();
            Ok(log.contains("TREE-B3-DONE"))
        },
    )
    .await?;
    let log = attacker_pods.logs("shared-v1", &Default::default()).await?;
    let sums = super::sums_in(&log).context("no sums")?;
    ensure!(sums == want, "the shared volume read other bytes");
    j.volumes()
        .patch(
            VOLUME,
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({ "spec": { "shared": false } })),
        )
        .await?;
    say(
        "once the victim sets spec.shared: true, a pod of the other namespace reads v1 (then shared: false again)",
    );
    Ok(())
}
