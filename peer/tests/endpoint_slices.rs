//! The peer tier's membership from EndpointSlices, against the real API server of the test
//! cluster (`hack/cluster.sh`): the ring follows slices as they are created, patched and
//! deleted, counting only ready, non-terminating IP endpoints of the plugins' own Service.
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use sealed_peer::RingView;
use sealed_peer::membership::from_endpoint_slices;

const SERVICE: &str = "sealed-peers";
const PORT: u16 = 7070;
const TIMEOUT: Duration = Duration::from_secs(30);

/// One endpoint: its addresses and conditions (`None` leaves a condition unset, which
/// Kubernetes reads as ready / not terminating).
struct Endpoint<'a> {
    addresses: &'a [&'a str],
    ready: Option<bool>,
    terminating: Option<bool>,
}

const fn ready(addresses: &'static [&'static str]) -> Endpoint<'static> {
    Endpoint {
        addresses,
        ready: Some(true),
        terminating: None,
    }
}

fn slice(
    name: &str,
    service: &str,
    address_type: &str,
    endpoints: &[Endpoint],
) -> Result<EndpointSlice> {
    let endpoints: Vec<serde_json::Value> = endpoints
        .iter()
        .map(|e| {
            let mut conditions = serde_json::Map::new();
            if let Some(r) = e.ready {
                conditions.insert("ready".into(), r.into());
            }
            if let Some(t) = e.terminating {
                conditions.insert("terminating".into(), t.into());
            }
            serde_json::json!({ "addresses": e.addresses, "conditions": conditions })
        })
        .collect();
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": { "kubernetes.io/service-name": service },
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{ "name": "peer", "port": PORT, "protocol": "TCP" }],
    }))?)
}

fn members(view: &RingView) -> BTreeSet<String> {
    view.borrow()
        .members()
        .iter()
        .map(|m| m.addr.clone())
        .collect()
}

/// Waits until the ring lists exactly `want`.
async fn wait_members(view: &mut RingView, want: &[&str], step: &str) -> Result<()> {
    let want: BTreeSet<String> = want.iter().map(|s| (*s).to_owned()).collect();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let now = members(view);
        if now == want {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            bail!("{step}: the ring lists {now:?}, not {want:?}, after {TIMEOUT:?}");
        }
        // A change wakes us; the timeout bounds a wait for one that never comes.
        if let Ok(Err(_)) = tokio::time::timeout(left, view.changed()).await {
            bail!("{step}: the membership's watch task stopped");
        }
    }
}

async fn create(api: &Api<EndpointSlice>, slice: &EndpointSlice) -> Result<()> {
    api.create(&PostParams::default(), slice)
        .await
        .with_context(|| format!("creating EndpointSlice {:?}", slice.metadata.name))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_follows_the_services_endpoint_slices() -> Result<()> {
    let Some(cluster) = sealed_e2e::cluster("the_ring_follows_the_services_endpoint_slices").await
    else {
        return Ok(());
    };
    let ns = cluster.temp_namespace("peer-slices").await?;
    let result = run(cluster.client.clone(), &ns).await;
    cluster.delete_namespace(&ns).await?;
    result
}

async fn run(client: Client, ns: &str) -> Result<()> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    // A slice that exists before the watch starts arrives with the first list.
    create(
        &api,
        &slice(
            "peers-a",
            SERVICE,
            "IPv4",
            &[
                ready(&["10.0.0.1"]),
                Endpoint {
                    addresses: &["10.0.0.2"],
                    ready: Some(false),
                    terminating: None,
                },
                Endpoint {
                    addresses: &["10.0.0.3"],
                    ready: Some(true),
                    terminating: Some(true),
                },
                // No conditions at all: Kubernetes reads that as ready.
                Endpoint {
                    addresses: &["10.0.0.9"],
                    ready: None,
                    terminating: None,
                },
            ],
        )?,
    )
    .await?;
    let membership = from_endpoint_slices(client.clone(), ns, SERVICE, PORT, 4);
    let mut view = membership.view.clone();
    wait_members(&mut view, &["10.0.0.1:7070", "10.0.0.9:7070"], "first list").await?;

    // A second slice of the same Service adds to the ring; another Service's slice and an
    // FQDN slice (no IP to dial) do not.
    create(
        &api,
        &slice("peers-b", SERVICE, "IPv6", &[ready(&["fd00::4"])])?,
    )
    .await?;
    create(
        &api,
        &slice("other", "someone-else", "IPv4", &[ready(&["10.9.9.9"])])?,
    )
    .await?;
    create(
        &api,
        &slice("peers-fqdn", SERVICE, "FQDN", &[ready(&["node-x.example"])])?,
    )
    .await?;
    wait_members(
        &mut view,
        &["10.0.0.1:7070", "10.0.0.9:7070", "[fd00::4]:7070"],
        "second slice",
    )
    .await?;

    // The unready endpoint turns ready, and the terminating one is replaced.
    let patched = slice(
        "peers-a",
        SERVICE,
        "IPv4",
        &[
            ready(&["10.0.0.1"]),
            ready(&["10.0.0.2"]),
            Endpoint {
                addresses: &["10.0.0.9"],
                ready: Some(false),
                terminating: None,
            },
        ],
    )?;
    api.patch(
        "peers-a",
        &PatchParams::apply("sealed-peer-test").force(),
        &Patch::Apply(&patched),
    )
    .await
    .context("patching peers-a")?;
    wait_members(
        &mut view,
        &["10.0.0.1:7070", "10.0.0.2:7070", "[fd00::4]:7070"],
        "patched slice",
    )
    .await?;

    // A deleted slice leaves the ring.
    api.delete("peers-b", &DeleteParams::default())
        .await
        .context("deleting peers-b")?;
    wait_members(
        &mut view,
        &["10.0.0.1:7070", "10.0.0.2:7070"],
        "deleted slice",
    )
    .await?;
    drop(membership);
    Ok(())
}
