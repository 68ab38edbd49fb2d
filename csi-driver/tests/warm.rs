//! Warming a new version (`spec.warm.nodes`, docs/peer.md "Warming a new version") with three
//! real `sealed-csi` processes in API-server mode against the test cluster's API server, as
//! peers of each other (a fixed list): a version made by the operator with the warm count 2
//! is fetched into exactly two plugins' disk caches (every chunk), the third fetches nothing,
//! and each of the two records a `Warmed` Event on the version. The plugins allow warming
//! only in labelled namespaces (`--warming=labelled`): before the namespace is labelled the
//! two picked plugins fetch nothing and say why (`WarmNotAllowed` Events). A plugin
//! restarted after its cache lost the version's chunks does not warm it again (its state
//! directory records it) and records no second Event.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`. It connects to the running
//! cluster (`KUBECONFIG`, else the cluster's own kubeconfig) and never starts or stops it.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{Made, Plugin};
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use sealed_crds::SealedVolumeVersion;

const TOKEN: &str = "csi-warm-test-token-0123456789abcdef";

/// Chunk files (and assembled files) in a plugin's disk cache.
fn cached_chunks(cache: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for sub in ["chunks", "files"] {
        let Ok(shards) = std::fs::read_dir(cache.join(sub)) else {
            continue;
        };
        for shard in shards.flatten() {
            for f in std::fs::read_dir(shard.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                out.push(f.file_name().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

async fn warmed_events(client: &Client, ns: &str, version: &str) -> Result<Vec<Event>> {
    events_of(client, ns, version, &["Warmed", "WarmFailed"]).await
}

async fn events_of(
    client: &Client,
    ns: &str,
    version: &str,
    reasons: &[&str],
) -> Result<Vec<Event>> {
    Ok(Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.name.as_deref() == Some(version)
                && e.reason.as_deref().is_some_and(|r| reasons.contains(&r))
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_is_warmed_on_exactly_n_plugins() -> Result<()> {
    if !sealed_e2e::enabled() {
        eprintln!(
            "a_version_is_warmed_on_exactly_n_plugins: skipped: set SEALED_E2E_CLUSTER=1 with \
             the test cluster up"
        );
        return Ok(());
    }
    // The running cluster only: this test never starts one.
    let kubeconfig = std::env::var_os("KUBECONFIG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(sealed_e2e::kubeconfig_path);
    let cluster = sealed_e2e::connect(&kubeconfig)
        .await
        .context("the test cluster does not answer")?;
    let client = cluster.client.clone();
    sealed_e2e::install_crds(&client, "sealed-csi-warm-test").await?;
    let ns = cluster.temp_namespace("csi-warm").await?;
    let nodes = Api::<Node>::all(client.clone());
    let names: Vec<String> = (0..3).map(|i| format!("sealed-warm-{i}-{ns}")).collect();
    for name in &names {
        let node: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        nodes.create(&PostParams::default(), &node).await?;
    }
    let result = run(&cluster, &ns, &names).await;
    for name in &names {
        let _ = nodes.delete(name, &DeleteParams::default()).await;
    }
    cluster.delete_namespace(&ns).await?;
    result
}

async fn run(cluster: &sealed_e2e::Cluster, ns: &str, names: &[String]) -> Result<()> {
    let client = cluster.client.clone();
    // 8 MiB of pseudo-random weights (about 8 chunks), this run's own digest.
    let work = tempfile::tempdir()?;
    let source = work.path().join("tree");
    std::fs::create_dir_all(&source)?;
    std::fs::write(
        source.join("config.json"),
        format!(r#"{{"model": "{ns}"}}"#),
    )?;
    let weights = sealed_test_support::trees::pseudo_random(8 << 20, 43);
    std::fs::write(source.join("model.safetensors"), &weights)?;
    let store = common::store_of(work, source).await;
    let digest = store.digest.to_string();
    let chunk_store =
        sealed_store::ChunkStore::open(&store.url, &sealed_store::StoreOptions::default()).await?;
    let manifest = chunk_store.get_manifest(&store.digest).await?;
    let mut want: Vec<String> = manifest
        .unique_chunks()
        .iter()
        .map(|c| c.digest.hex())
        .collect();
    want.sort();
    want.dedup();

    let attestation =
        common::attestation_secret(&client, ns, "sealed-attestation", &common::key_material())
            .await?;
    let volume = common::sealed_volume(&client, ns, "llama", &[], false).await?;
    // The API server holds spec.warm.nodes to 0..=1000.
    let volumes = Api::<sealed_crds::SealedVolume>::namespaced(client.clone(), ns);
    let too_many = serde_json::json!({"spec": {"warm": {"nodes": 1001}}});
    let refused = volumes
        .patch("llama", &PatchParams::default(), &Patch::Merge(&too_many))
        .await;
    ensure!(refused.is_err(), "spec.warm.nodes 1001 was accepted");
    let fine = serde_json::json!({"spec": {"warm": {"nodes": 2}}});
    volumes
        .patch("llama", &PatchParams::default(), &Patch::Merge(&fine))
        .await?;

    let token = store.dir.path().join("token");
    std::fs::write(&token, TOKEN)?;
    let peers: Vec<SocketAddr> = (0..3)
        .map(|_| sealed_test_support::servers::free_addr())
        .collect();
    let list = peers
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let flags = |peer: &SocketAddr| {
        vec![
            attestation.flag(),
            format!("--peer-listen={peer}"),
            format!("--peers={list}"),
            format!("--peer-token-file={}", token.display()),
            "--warming=labelled".into(),
        ]
    };
    let mut plugins: Vec<Plugin> = peers
        .iter()
        .zip(names)
        .map(|(peer, name)| {
            let flags = flags(peer);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            Plugin::start_api(&store.url, name, &cluster.kubeconfig, &flags)
        })
        .collect();
    // The plugins pick by the same hashing: the test predicts who is picked.
    let ring = sealed_peer::Ring::new(peers.iter().map(|p| p.to_string()), 64);
    let picked: Vec<bool> = peers
        .iter()
        .map(|p| ring.picks(&store.digest, 2, &p.to_string()))
        .collect();
    ensure!(picked.iter().filter(|p| **p).count() == 2);

    // A version as the operator makes it, with the warm count the operator copies.
    let version = common::sealed_version(
        &client,
        &volume,
        &digest,
        None,
        Made::ByOperator(&attestation.key),
    )
    .await?;
    let version_name = version.metadata.name.clone().context("version name")?;
    Api::<SealedVolumeVersion>::namespaced(client.clone(), ns)
        .patch(
            &version_name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {
                (sealed_crds::WARM_ANNOTATION): "2"
            }}})),
        )
        .await?;

    let logs = |plugins: &[Plugin]| {
        plugins
            .iter()
            .map(|p| p.log())
            .collect::<Vec<_>>()
            .join("\n----\n")
    };
    // The namespace is not labelled: the picked plugins refuse, say so, and fetch nothing.
    let waited = sealed_e2e::wait_for("two WarmNotAllowed events", Duration::from_secs(60), || {
        let client = client.clone();
        let version_name = version_name.clone();
        async move {
            let events = events_of(&client, ns, &version_name, &["WarmNotAllowed"]).await?;
            Ok(events.len() >= 2)
        }
    })
    .await;
    if let Err(e) = waited {
        eprintln!("plugin logs:\n{}", logs(&plugins));
        return Err(e);
    }
    let refused = events_of(&client, ns, &version_name, &["WarmNotAllowed"]).await?;
    ensure!(
        refused.iter().all(|e| e
            .message
            .as_deref()
            .is_some_and(|m| m.contains("sealedvolumes.io/warming=allowed"))),
        "the refusal does not say which label allows warming: {refused:?}"
    );
    ensure!(warmed_events(&client, ns, &version_name).await?.is_empty());
    for (i, plugin) in plugins.iter().enumerate() {
        let cached = cached_chunks(&plugin.dir.path().join("cache"));
        ensure!(
            cached.is_empty(),
            "plugin {i} warmed a refused version: {} chunks",
            cached.len()
        );
    }
    // The admin allows the namespace; a change to the version has the plugins look again.
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {
                "sealedvolumes.io/warming": "allowed"
            }}})),
        )
        .await?;
    Api::<SealedVolumeVersion>::namespaced(client.clone(), ns)
        .patch(
            &version_name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {
                "test/allowed": "now"
            }}})),
        )
        .await?;
    let waited = sealed_e2e::wait_for("two Warmed events", Duration::from_secs(90), || {
        let client = client.clone();
        let version_name = version_name.clone();
        async move {
            let events = warmed_events(&client, ns, &version_name).await?;
            Ok(events.len() >= 2)
        }
    })
    .await;
    if let Err(e) = waited {
        eprintln!("plugin logs:\n{}", logs(&plugins));
        return Err(e);
    }
    let events = warmed_events(&client, ns, &version_name).await?;
    for e in &events {
        eprintln!(
            "{:?} {:?} from {:?}: {:?}",
            e.type_,
            e.reason,
            e.source.as_ref().and_then(|s| s.host.clone()),
            e.message
        );
    }
    ensure!(
        events.iter().all(|e| e.reason.as_deref() == Some("Warmed")),
        "a warming failed: {events:?}"
    );
    let hosts: Vec<String> = events
        .iter()
        .filter_map(|e| e.source.as_ref().and_then(|s| s.host.clone()))
        .collect();
    for (i, plugin) in plugins.iter().enumerate() {
        let cached = cached_chunks(&plugin.dir.path().join("cache"));
        if picked[i] {
            ensure!(
                cached == want,
                "plugin {i} was picked but holds {} of {} chunks\n{}",
                cached.len(),
                want.len(),
                plugin.log()
            );
            ensure!(
                hosts.contains(&names[i]),
                "no Warmed event from {}",
                names[i]
            );
        } else {
            ensure!(
                cached.is_empty(),
                "plugin {i} was not picked but holds {} chunks",
                cached.len()
            );
            ensure!(
                !hosts.contains(&names[i]),
                "a Warmed event from {}",
                names[i]
            );
        }
    }

    // Restart-safe: a picked plugin restarted after its cache lost the version (evicted,
    // say) does not warm it again: its state directory records the version as warmed.
    let first = picked.iter().position(|p| *p).context("a picked plugin")?;
    let dir = plugins.remove(first).terminate();
    for sub in ["chunks", "files"] {
        let _ = std::fs::remove_dir_all(dir.path().join("cache").join(sub));
    }
    let flags = flags(&peers[first]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let restarted =
        Plugin::start_api_in(dir, &store.url, &names[first], &cluster.kubeconfig, &flags);
    let waited = sealed_e2e::wait_for(
        "the restarted plugin to look",
        Duration::from_secs(30),
        || {
            let log = restarted.log();
            async move { Ok(log.contains("recorded as warmed here")) }
        },
    )
    .await;
    // A warm pass runs at start and on every membership change: give it time to (not) act.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cached = cached_chunks(&restarted.dir.path().join("cache"));
    ensure!(
        cached.is_empty(),
        "the restarted plugin warmed the version again: {} chunks\n{}",
        cached.len(),
        restarted.log()
    );
    if let Err(e) = waited {
        eprintln!("restarted plugin log:\n{}", restarted.log());
        return Err(e);
    }
    let again = warmed_events(&client, ns, &version_name).await?;
    ensure!(
        again.len() == 2,
        "a restart recorded another event: {again:?}"
    );
    Ok(())
}
