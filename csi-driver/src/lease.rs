//! The node publications Lease (`sealed_crds::publications`): which digests this node has
//! published, for which namespaces, so that the operator does not trash a version a running
//! pod still reads.
//!
//! One `coordination.k8s.io/v1` Lease per node in `--publications-namespace`, named
//! `NodePublications::lease_name(node)`, labelled `LABEL=<node>`, its `ANNOTATION` the JSON
//! `NodePublications` of the driver's publication table. It is rewritten right after every
//! publish (before NodePublishVolume returns, unless the API server takes longer than
//! [`REPORT_WAIT`]) and unpublish, and renewed every `RENEW_SECONDS`. Writing it is best
//! effort: a failure is logged and never fails a publish.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::PostParams;
use kube::{Api, Client};
use sealed_crds::publications::{ANNOTATION, LABEL, NodePublications, Publication, RENEW_SECONDS};

use crate::driver::Driver;
use crate::error::CsiError;

/// How long a publish or unpublish waits for its Lease write; a slower one goes on in the
/// background.
pub const REPORT_WAIT: Duration = Duration::from_secs(2);

/// The Lease of one node.
pub struct PublicationsLease {
    client: Client,
    namespace: String,
    node: String,
    /// The Lease as last written (its resourceVersion saves a read on the next write).
    last: tokio::sync::Mutex<Option<Lease>>,
}

/// The label value for `node`: node names are DNS subdomains (253 characters), label
/// values at most 63; a longer name is cut with a hash suffix, as the Lease's name is.
pub fn label_value(node: &str) -> String {
    if node.len() <= 63 {
        return node.to_string();
    }
    let hash = sealed_store::Digest::of(node.as_bytes()).hex();
    let head: String = node.chars().take(50).collect();
    format!("{}-{}", head.trim_end_matches(['-', '.']), &hash[..12])
}

/// The annotation's JSON: `published` sorted and without repeats.
pub fn annotation(node: &str, mut published: Vec<Publication>) -> String {
    published.sort();
    published.dedup();
    let doc = NodePublications {
        node: node.to_string(),
        published,
    };
    serde_json::to_string(&doc).unwrap_or_else(|_| "{}".to_string())
}

impl PublicationsLease {
    pub fn new(client: Client, namespace: String, node: String) -> Self {
        PublicationsLease {
            client,
            namespace,
            node,
            last: tokio::sync::Mutex::new(None),
        }
    }

    pub fn name(&self) -> String {
        NodePublications::lease_name(&self.node)
    }

    /// Sets what the Lease must say on `lease` (keeping labels and annotations of others).
    fn fill(&self, lease: &mut Lease, json: &str) {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        lease.metadata.name = Some(self.name());
        lease.metadata.namespace = Some(self.namespace.clone());
        lease
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(LABEL.to_string(), label_value(&self.node));
        lease
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(ANNOTATION.to_string(), json.to_string());
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(self.node.clone());
        spec.lease_duration_seconds = Some(2 * RENEW_SECONDS);
        spec.acquire_time.get_or_insert_with(|| now.clone());
        spec.renew_time = Some(now);
    }

    /// Writes the driver's current publications (read under the Lease's lock, so the last
    /// writer always writes the newest table).
    pub async fn sync(&self, driver: &Driver) -> Result<usize, CsiError> {
        let api = Api::<Lease>::namespaced(self.client.clone(), &self.namespace);
        let name = self.name();
        let what = || format!("writing Lease {}/{name}", self.namespace);
        let mut last = self.last.lock().await;
        let published = driver.publications().await;
        let count = published.len();
        let json = annotation(&self.node, published);
        for _ in 0..3 {
            let base = match last.take() {
                Some(l) => Some(l),
                None => api
                    .get_opt(&name)
                    .await
                    .map_err(|e| CsiError::kube(what(), e))?,
            };
            let Some(mut lease) = base else {
                let mut lease = Lease::default();
                self.fill(&mut lease, &json);
                match api.create(&PostParams::default(), &lease).await {
                    Ok(l) => {
                        *last = Some(l);
                        return Ok(count);
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => continue,
                    Err(e) => return Err(CsiError::kube(what(), e)),
                }
            };
            self.fill(&mut lease, &json);
            match api.replace(&name, &PostParams::default(), &lease).await {
                Ok(l) => {
                    *last = Some(l);
                    return Ok(count);
                }
                // Changed or deleted by someone else since: read it again.
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => continue,
                Err(e) => return Err(CsiError::kube(what(), e)),
            }
        }
        Err(CsiError::Unavailable(format!(
            "{}: conflicts on every attempt",
            what()
        )))
    }
}

/// Keeps the Lease in step with the driver.
pub struct Reporter {
    lease: PublicationsLease,
    driver: Arc<Driver>,
}

impl Reporter {
    pub fn new(lease: PublicationsLease, driver: Arc<Driver>) -> Arc<Self> {
        Arc::new(Reporter { lease, driver })
    }

    async fn sync_logged(&self, why: &str) {
        match self.lease.sync(&self.driver).await {
            Ok(n) => tracing::debug!(lease = %self.lease.name(), published = n, why,
                "node publications Lease written"),
            Err(e) => tracing::warn!(lease = %self.lease.name(), error = %e, why,
                "cannot write the node publications Lease; the operator may trash a version \
                 this node still mounts once the Lease is stale"),
        }
    }

    /// Writes the Lease now and waits up to [`REPORT_WAIT`] for it; a slower write goes on
    /// in the background. Never fails.
    pub async fn report(self: &Arc<Self>, why: &'static str) {
        let this = self.clone();
        let task = tokio::spawn(async move { this.sync_logged(why).await });
        if tokio::time::timeout(REPORT_WAIT, task).await.is_err() {
            tracing::warn!(
                lease = %self.lease.name(),
                "node publications Lease write takes longer than {} s; going on",
                REPORT_WAIT.as_secs()
            );
        }
    }

    /// Renews the Lease every `RENEW_SECONDS`, starting now.
    pub fn spawn_renewals(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let period = Duration::from_secs(u64::try_from(RENEW_SECONDS).unwrap_or(30));
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                this.sync_logged("renewal").await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_annotation_is_sorted_and_deduplicated() {
        let p = |ns: &str, d: &str| Publication {
            namespace: ns.into(),
            digest: d.into(),
        };
        let json = annotation(
            "node-1",
            vec![
                p("ml", "blake3:bb"),
                p("a", "blake3:cc"),
                p("ml", "blake3:aa"),
                p("ml", "blake3:bb"),
            ],
        );
        let doc: NodePublications = serde_json::from_str(&json).unwrap();
        assert_eq!(doc.node, "node-1");
        assert_eq!(
            doc.published,
            vec![
                p("a", "blake3:cc"),
                p("ml", "blake3:aa"),
                p("ml", "blake3:bb")
            ]
        );
        assert!(doc.has_digest("blake3:aa") && !doc.has_digest("blake3:dd"));
    }

    #[test]
    fn label_values_fit() {
        assert_eq!(label_value("node-1"), "node-1");
        let long = format!("{}.example.internal", "n".repeat(70));
        let v = label_value(&long);
        assert!(v.len() <= 63, "{v}");
        assert_ne!(
            v,
            label_value(&format!("{}.example.internal", "m".repeat(70)))
        );
    }
}
