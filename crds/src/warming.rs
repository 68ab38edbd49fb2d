//! Who may warm versions (`spec.warm` of a SealedVolume): the cluster admin's choice, given
//! to the operator (which stamps the warm count only on versions of allowed namespaces) and to
//! the node plugins (which warm only versions of allowed namespaces, whoever set the
//! annotation). Warming is work a tenant causes on nodes it may not run on, so it is off
//! unless the admin allows it (chart `warming.allow`).

use std::collections::BTreeMap;

/// The label that allows a namespace to warm when none is given.
pub const DEFAULT_NAMESPACE_LABEL: &str = "sealedvolumes.io/warming=allowed";

/// Which namespaces may warm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WarmingPolicy {
    /// No namespace (the default).
    Off,
    /// Every namespace.
    All,
    /// Namespaces with this label.
    Labelled { key: String, value: String },
}

impl WarmingPolicy {
    /// From `--warming` (`off`, `all`, `labelled`) and `--warming-namespace-label`
    /// (`KEY=VALUE`, used with `labelled`).
    pub fn parse(mode: &str, label: &str) -> Result<WarmingPolicy, String> {
        match mode {
            "off" => Ok(WarmingPolicy::Off),
            "all" => Ok(WarmingPolicy::All),
            "labelled" => {
                let (key, value) = label
                    .split_once('=')
                    .filter(|(k, _)| !k.is_empty())
                    .ok_or_else(|| {
                        format!("--warming-namespace-label {label:?} is not KEY=VALUE")
                    })?;
                Ok(WarmingPolicy::Labelled {
                    key: key.to_owned(),
                    value: value.to_owned(),
                })
            }
            other => Err(format!("--warming {other:?}: one of off, all, labelled")),
        }
    }

    /// Whether the namespace's labels are needed to decide.
    pub fn needs_labels(&self) -> bool {
        matches!(self, WarmingPolicy::Labelled { .. })
    }

    /// `Ok` if `namespace` (with `labels`, when [`needs_labels`](Self::needs_labels)) may warm,
    /// else why not, in words for its users.
    pub fn allows(
        &self,
        namespace: &str,
        labels: Option<&BTreeMap<String, String>>,
    ) -> Result<(), String> {
        match self {
            WarmingPolicy::All => Ok(()),
            WarmingPolicy::Off => Err(
                "warming is off in this cluster (the admin allows it with the chart's \
                 warming.allow)"
                    .into(),
            ),
            WarmingPolicy::Labelled { key, value } => {
                if labels.and_then(|l| l.get(key)) == Some(value) {
                    Ok(())
                } else {
                    Err(format!(
                        "namespace {namespace} may not warm: warming is allowed only in \
                         namespaces labelled {key}={value}"
                    ))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_unless_allowed() {
        let labels = BTreeMap::from([(
            "sealedvolumes.io/warming".to_string(),
            "allowed".to_string(),
        )]);
        let off = WarmingPolicy::parse("off", "").unwrap();
        assert!(off.allows("a", Some(&labels)).unwrap_err().contains("off"));
        assert!(
            WarmingPolicy::parse("all", "")
                .unwrap()
                .allows("a", None)
                .is_ok()
        );
        let labelled = WarmingPolicy::parse("labelled", DEFAULT_NAMESPACE_LABEL).unwrap();
        assert!(labelled.needs_labels());
        assert!(labelled.allows("a", Some(&labels)).is_ok());
        let e = labelled.allows("b", Some(&BTreeMap::new())).unwrap_err();
        assert!(
            e.contains("namespace b") && e.contains("sealedvolumes.io/warming=allowed"),
            "{e}"
        );
        assert!(WarmingPolicy::parse("labelled", "novalue").is_err());
        assert!(WarmingPolicy::parse("some", "").is_err());
    }
}
