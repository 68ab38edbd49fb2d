//! Reads the node plugins' publication Leases (`sealed_crds::publications`): which nodes
//! still have a digest mounted for pods.

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::ListParams;
use sealed_crds::publications::{ANNOTATION, LABEL, NodePublications, STALE_AFTER_SECONDS};

use crate::context::Context;
use crate::error::Result;

/// The nodes whose fresh Lease lists `digest` (for pods of any namespace), sorted. A Lease
/// whose annotation does not parse counts as listing everything: better late to trash than
/// to take chunks from a running pod.
pub async fn nodes_publishing(ctx: &Context, digest: &str) -> Result<Vec<String>> {
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.config.namespace);
    let list = leases.list(&ListParams::default().labels(LABEL)).await?;
    let now = k8s_openapi::jiff::Timestamp::now();
    let mut nodes: Vec<String> = list
        .items
        .iter()
        .filter(|lease| is_fresh(lease, now))
        .filter_map(|lease| {
            let node = lease
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL))
                .cloned()
                .unwrap_or_default();
            let raw = lease.metadata.annotations.as_ref()?.get(ANNOTATION)?;
            match serde_json::from_str::<NodePublications>(raw) {
                Ok(p) if p.has_digest(digest) => Some(node),
                Ok(_) => None,
                Err(_) => Some(node),
            }
        })
        .collect();
    nodes.sort();
    nodes.dedup();
    Ok(nodes)
}

/// Renewed within [`STALE_AFTER_SECONDS`] by our clock (the window is wide because the
/// node's clock and ours may disagree; a Lease with no renew time is not fresh).
fn is_fresh(lease: &Lease, now: k8s_openapi::jiff::Timestamp) -> bool {
    let Some(renewed) = lease
        .spec
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0)
    else {
        return false;
    };
    let age = now.as_second().saturating_sub(renewed.as_second());
    age <= STALE_AFTER_SECONDS
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn lease(renewed_ago: Option<i64>) -> Lease {
        let now = k8s_openapi::jiff::Timestamp::now().as_second();
        Lease {
            spec: Some(LeaseSpec {
                renew_time: renewed_ago.map(|ago| {
                    MicroTime(k8s_openapi::jiff::Timestamp::from_second(now - ago).unwrap())
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn freshness() {
        let now = k8s_openapi::jiff::Timestamp::now();
        assert!(is_fresh(&lease(Some(0)), now));
        assert!(is_fresh(&lease(Some(STALE_AFTER_SECONDS - 5)), now));
        assert!(!is_fresh(&lease(Some(STALE_AFTER_SECONDS + 5)), now));
        assert!(!is_fresh(&lease(None), now));
        // A node whose clock runs ahead renews "in the future": still fresh.
        assert!(is_fresh(&lease(Some(-3600)), now));
    }
}
