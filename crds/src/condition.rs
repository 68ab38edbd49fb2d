//! Status conditions, in the Kubernetes convention (`metav1.Condition`).

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// `Synced`: the last sync of the source finished (`True`), is running or failed (`False`,
/// with a reason such as `Syncing`, `RepoNotFound`, `Unauthorized`).
pub const CONDITION_SYNCED: &str = "Synced";
/// `Ready`: the volume (or version) can be mounted: a sealed version exists and every tag
/// names a version of this volume.
pub const CONDITION_READY: &str = "Ready";

/// A condition of `type_` that holds (`ok`: status `True`) or not (`False`), for the object
/// at `generation`, as of `at`. Every condition the operator writes is made here.
pub fn new_condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
    at: Time,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time: at,
    }
}

/// The condition of type `type_`, if there is one.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Adds `new` or replaces the condition of the same type. When the status does not change,
/// the old `lastTransitionTime` is kept (that is what the field means). Returns true when
/// anything changed.
pub fn set_condition(conditions: &mut Vec<Condition>, mut new: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(old) => {
            if old.status == new.status {
                new.last_transition_time = old.last_transition_time.clone();
            }
            if *old == new {
                return false;
            }
            *old = new;
            true
        }
        None => {
            conditions.push(new);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(status: &str, reason: &str, at: &str) -> Condition {
        Condition {
            type_: CONDITION_READY.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            observed_generation: Some(1),
            last_transition_time: serde_json::from_value(serde_json::json!(at)).unwrap(),
        }
    }

    #[test]
    fn new_condition_says_true_or_false() {
        let at: Time = serde_json::from_value(serde_json::json!("2026-01-01T00:00:00Z")).unwrap();
        let c = new_condition(
            CONDITION_SYNCED,
            true,
            "Synced",
            "done",
            Some(3),
            at.clone(),
        );
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            ("Synced", "True", "Synced")
        );
        assert_eq!(
            (c.message.as_str(), c.observed_generation),
            ("done", Some(3))
        );
        assert_eq!(c.last_transition_time, at);
        let c = new_condition(CONDITION_READY, false, "NoVersion", "none", None, at);
        assert_eq!(c.status, "False");
    }

    #[test]
    fn set_condition_keeps_transition_time_when_status_is_unchanged() {
        let mut cs = vec![];
        assert!(set_condition(
            &mut cs,
            cond("False", "Syncing", "2026-01-01T00:00:00Z")
        ));
        assert!(set_condition(
            &mut cs,
            cond("False", "SyncFailed", "2026-01-02T00:00:00Z")
        ));
        assert_eq!(cs.len(), 1);
        assert_eq!(cs[0].reason, "SyncFailed");
        let t: Time = serde_json::from_value(serde_json::json!("2026-01-01T00:00:00Z")).unwrap();
        assert_eq!(cs[0].last_transition_time, t);
        assert!(!set_condition(
            &mut cs,
            cond("False", "SyncFailed", "2026-01-03T00:00:00Z")
        ));
        assert!(set_condition(
            &mut cs,
            cond("True", "Sealed", "2026-01-04T00:00:00Z")
        ));
        let t: Time = serde_json::from_value(serde_json::json!("2026-01-04T00:00:00Z")).unwrap();
        assert_eq!(cs[0].last_transition_time, t);
        assert_eq!(find_condition(&cs, CONDITION_READY).unwrap().status, "True");
        assert!(find_condition(&cs, CONDITION_SYNCED).is_none());
    }
}
