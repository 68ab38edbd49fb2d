//! Where a pod with a sealed volume can run: not on nodes whose GPU the node plugin's
//! DaemonSet excludes (T4 and L4 by default, `--excluded-gpu-products`). The admission adds
//! the same `nvidia.com/gpu.product NotIn [...]` requirement the chart gives the DaemonSet
//! (each product as given and with `-SHARED`), and refuses a pod that asks only for excluded
//! products, instead of letting it hang in `ContainerCreating` on a node without the plugin.

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod,
};

/// The node label GPU feature discovery sets to the GPU model (as the plugin reads it).
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// The suffix GPU feature discovery adds under time-slicing.
const SHARED_SUFFIX: &str = "-SHARED";

/// The excluded GPU products, as the chart's `node.excludedGpuProducts` lists them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exclusion {
    products: Vec<String>,
}

impl Exclusion {
    /// From a comma-separated list (the plugin's `--excluded-gpu-products` format); empty
    /// entries are ignored, so `""` excludes nothing.
    pub fn parse(list: &str) -> Self {
        Exclusion {
            products: list
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(str::to_owned)
                .collect(),
        }
    }

    /// Whether a node labelled `product` gets no plugin: exact and case-insensitive after
    /// dropping `-SHARED`, as the plugin judges it (`L4` does not exclude `NVIDIA-L40S`).
    pub fn is_excluded(&self, product: &str) -> bool {
        let bare = |p: &str| {
            let lower = p.trim().to_ascii_lowercase();
            lower
                .strip_suffix(&SHARED_SUFFIX.to_ascii_lowercase())
                .map(str::to_owned)
                .unwrap_or(lower)
        };
        let product = bare(product);
        self.products.iter().any(|p| bare(p) == product)
    }

    /// The label values the DaemonSet's affinity excludes: each product and its `-SHARED`.
    fn label_values(&self) -> Vec<String> {
        self.products
            .iter()
            .flat_map(|p| [p.clone(), format!("{p}{SHARED_SUFFIX}")])
            .collect()
    }

    fn requirement(&self) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: GPU_PRODUCT_LABEL.into(),
            operator: "NotIn".into(),
            values: Some(self.label_values()),
        }
    }

    /// The pod's affinity with the exclusion added to every required node selector term (terms
    /// are ORed, so each needs it), `Ok(None)` when it is there already or nothing is
    /// excluded; `Err` naming the rule when the pod asks only for excluded products.
    pub fn place(&self, pod: &Pod) -> Result<Option<Affinity>, String> {
        if self.products.is_empty() {
            return Ok(None);
        }
        let Some(spec) = &pod.spec else {
            return Ok(None);
        };
        if let Some(product) = spec
            .node_selector
            .as_ref()
            .and_then(|s| s.get(GPU_PRODUCT_LABEL))
            .filter(|p| self.is_excluded(p))
        {
            return Err(self.refusal(&format!(
                "its nodeSelector asks for {GPU_PRODUCT_LABEL}={product}"
            )));
        }
        let mut affinity = spec.affinity.clone().unwrap_or_default();
        let node = affinity
            .node_affinity
            .get_or_insert_with(NodeAffinity::default);
        let required = node
            .required_during_scheduling_ignored_during_execution
            .get_or_insert_with(NodeSelector::default);
        if required.node_selector_terms.is_empty() {
            required
                .node_selector_terms
                .push(NodeSelectorTerm::default());
        } else if let Some(asked) = required
            .node_selector_terms
            .iter()
            .map(|t| self.only_excluded(t))
            .collect::<Option<Vec<String>>>()
        {
            return Err(self.refusal(&format!(
                "every term of its required node affinity asks for {GPU_PRODUCT_LABEL} in [{}]",
                asked.join(", ")
            )));
        }
        let wanted = self.requirement();
        let mut changed = false;
        for term in &mut required.node_selector_terms {
            let exprs = term.match_expressions.get_or_insert_with(Vec::new);
            if !exprs.contains(&wanted) {
                exprs.push(wanted.clone());
                changed = true;
            }
        }
        Ok(changed.then_some(affinity))
    }

    /// The products `term` asks for when it asks for the GPU label `In` excluded products
    /// only (such a term matches no node the plugin runs on).
    fn only_excluded(&self, term: &NodeSelectorTerm) -> Option<String> {
        term.match_expressions.iter().flatten().find_map(|e| {
            let values = e.values.as_deref().unwrap_or_default();
            (e.key == GPU_PRODUCT_LABEL
                && e.operator == "In"
                && !values.is_empty()
                && values.iter().all(|v| self.is_excluded(v)))
            .then(|| values.join(", "))
        })
    }

    fn refusal(&self, what: &str) -> String {
        format!(
            "sealed volumes: {what}, and the sealed-volumes node plugin does not run on nodes \
             whose {GPU_PRODUCT_LABEL} is one of [{}] (the chart's node.excludedGpuProducts, \
             operator and plugin flag --excluded-gpu-products), so the volume could never be \
             mounted there; choose another node type, or change that list (docs/csi.md, \
             \"Where pods can mount\")",
            self.products.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": spec}))
            .expect("pod")
    }

    fn default() -> Exclusion {
        Exclusion::parse("Tesla-T4,NVIDIA-T4,T4,NVIDIA-L4,L4")
    }

    #[test]
    fn a_pod_without_affinity_gets_the_exclusion() {
        let a = default()
            .place(&pod(serde_json::json!({"containers": []})))
            .expect("placed")
            .expect("changed");
        let terms = a
            .node_affinity
            .and_then(|n| n.required_during_scheduling_ignored_during_execution)
            .expect("required")
            .node_selector_terms;
        assert_eq!(terms.len(), 1);
        let e = &terms[0].match_expressions.as_ref().expect("exprs")[0];
        assert_eq!(
            (e.key.as_str(), e.operator.as_str()),
            (GPU_PRODUCT_LABEL, "NotIn")
        );
        assert!(
            e.values
                .as_ref()
                .expect("values")
                .contains(&"NVIDIA-L4-SHARED".to_string())
        );
    }

    #[test]
    fn every_term_gets_it_once() {
        let p = pod(
            serde_json::json!({"containers": [], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In",
                                       "values": ["NVIDIA-A100", "NVIDIA-L4"]}]}]}}}}),
        );
        let a = default().place(&p).expect("placed").expect("changed");
        let mut again = p.clone();
        if let Some(s) = again.spec.as_mut() {
            s.affinity = Some(a.clone());
        }
        assert_eq!(default().place(&again), Ok(None), "idempotent");
        let terms = a
            .node_affinity
            .and_then(|n| n.required_during_scheduling_ignored_during_execution)
            .expect("required")
            .node_selector_terms;
        assert!(
            terms
                .iter()
                .all(|t| t.match_expressions.as_ref().expect("e").len() == 2)
        );
    }

    #[test]
    fn asking_for_an_excluded_product_is_refused_with_the_rule() {
        for spec in [
            serde_json::json!({"containers": [], "nodeSelector": {GPU_PRODUCT_LABEL: "Tesla-T4"}}),
            serde_json::json!({"containers": [], "nodeSelector": {GPU_PRODUCT_LABEL: "nvidia-l4-shared"}}),
            serde_json::json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In",
                                           "values": ["T4", "L4"]}]}]}}}}),
        ] {
            let e = default().place(&pod(spec.clone())).expect_err("refused");
            assert!(
                e.contains("excludedGpuProducts") && e.contains(GPU_PRODUCT_LABEL),
                "{e}"
            );
        }
        // L40S is not L4; an empty list excludes nothing.
        let l40 = pod(
            serde_json::json!({"containers": [], "nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-L40S"}}),
        );
        assert!(default().place(&l40).is_ok());
        let t4 =
            pod(serde_json::json!({"containers": [], "nodeSelector": {GPU_PRODUCT_LABEL: "T4"}}));
        assert_eq!(Exclusion::parse("").place(&t4), Ok(None));
    }
}
