//! Which digests each node has published to pods, as the node plugins report them to the
//! operator: one `coordination.k8s.io/v1` Lease per node in the plugin's namespace, labelled
//! [`LABEL`], whose [`ANNOTATION`] holds a JSON [`NodePublications`]. The plugin rewrites it
//! on every publish and unpublish and renews it every [`RENEW_SECONDS`]. The operator does not
//! move a version to the trash while a fresh Lease lists its digest (a version still mounted
//! by a running pod must keep its chunks), and ignores Leases not renewed for
//! [`STALE_AFTER_SECONDS`] (a node that is gone), so a dead node delays trashing by at most
//! that long. Freshness is judged generously because the operator's and the node's clocks may
//! disagree; being late to trash only keeps data longer.

use serde::{Deserialize, Serialize};

/// Label on every node publications Lease (value: the node name).
pub const LABEL: &str = "sealedvolumes.io/node-publications";
/// Annotation holding the JSON [`NodePublications`].
pub const ANNOTATION: &str = "sealedvolumes.io/published";
/// How often a plugin renews its Lease.
pub const RENEW_SECONDS: i32 = 30;
/// A Lease not renewed for this long belongs to a node that is gone.
pub const STALE_AFTER_SECONDS: i64 = 600;

/// One digest published on a node for pods of a namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Publication {
    pub namespace: String,
    pub digest: String,
}

/// Everything one node has published, sorted and without repeats.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePublications {
    pub node: String,
    #[serde(default)]
    pub published: Vec<Publication>,
}

impl NodePublications {
    /// The Lease name of `node`: `sealed-node-<node>`, cut to 63 characters with a hash
    /// suffix when the node name is long (names must be DNS labels... or subdomains: Leases
    /// take subdomains, 253 characters, but short names read better in `kubectl get`).
    pub fn lease_name(node: &str) -> String {
        let name = format!("sealed-node-{node}");
        if name.len() <= 63 {
            return name;
        }
        let hash = blake3::hash(node.as_bytes()).to_hex();
        let head: String = name.chars().take(50).collect();
        format!("{}-{}", head.trim_end_matches(['-', '.']), &hash[..12])
    }

    /// Whether `digest` is published here for any namespace.
    pub fn has_digest(&self, digest: &str) -> bool {
        self.published.iter().any(|p| p.digest == digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_fit_and_stay_distinct() {
        assert_eq!(NodePublications::lease_name("node-1"), "sealed-node-node-1");
        let long_a = format!("{}a", "x".repeat(80));
        let long_b = format!("{}b", "x".repeat(80));
        let (a, b) = (
            NodePublications::lease_name(&long_a),
            NodePublications::lease_name(&long_b),
        );
        assert!(a.len() <= 63 && b.len() <= 63);
        assert_ne!(a, b);
    }

    #[test]
    fn json_round_trip() {
        let p = NodePublications {
            node: "n".into(),
            published: vec![Publication {
                namespace: "ml".into(),
                digest: "blake3:00".into(),
            }],
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<NodePublications>(&json).unwrap(), p);
        assert!(p.has_digest("blake3:00") && !p.has_digest("blake3:01"));
    }
}
