//! A reconcile that panics becomes a reconcile error of its own object, so one bad object
//! (or a bug) cannot take the operator down: kube-runtime polls reconcile futures inside the
//! controller's stream, and without this a panic there unwinds through the controller and
//! ends the process, a crash loop for every tenant. The panic is logged, counted
//! (`reconcile_panics_total`), and its object requeued with a backoff that doubles with each
//! panic in a row ([`PanicBackoff`]); the controller goes on serving every other object.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// The first requeue after a panic; each panic in a row doubles it, up to [`MAX_DELAY`].
pub const FIRST_DELAY: Duration = Duration::from_secs(30);
/// The longest requeue after panics.
pub const MAX_DELAY: Duration = Duration::from_secs(600);

/// Panics in a row per object (`Kind namespace/name`), for the requeue delay; an object's
/// count is dropped when it reconciles without one.
#[derive(Debug, Default)]
pub struct PanicBackoff {
    panics: Mutex<HashMap<String, u32>>,
}

impl PanicBackoff {
    fn record(&self, key: &str) {
        if let Ok(mut panics) = self.panics.lock() {
            let n = panics.entry(key.to_owned()).or_default();
            *n = n.saturating_add(1);
        }
    }

    fn clear(&self, key: &str) {
        if let Ok(mut panics) = self.panics.lock() {
            panics.remove(key);
        }
    }

    /// How long `key` waits before its next reconcile: [`FIRST_DELAY`] doubled for each
    /// panic in a row after the first, at most [`MAX_DELAY`].
    pub fn delay(&self, key: &str) -> Duration {
        let n = self
            .panics
            .lock()
            .ok()
            .and_then(|p| p.get(key).copied())
            .unwrap_or(1);
        let factor = 1u32 << n.saturating_sub(1).min(10);
        FIRST_DELAY.saturating_mul(factor).min(MAX_DELAY)
    }
}

/// The text of a panic's payload (`panic!("...")` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs `reconcile` for `key` (`Kind namespace/name`, also the backoff's key) of `kind`;
/// a panic inside it is returned as [`Error::Panicked`], logged and counted.
pub async fn guarded<F>(
    kind: &str,
    key: String,
    metrics: &Metrics,
    backoff: &PanicBackoff,
    reconcile: F,
) -> Result<Action>
where
    F: Future<Output = Result<Action>>,
{
    // AssertUnwindSafe: nothing the future borrows is used again after a panic except the
    // metrics and the backoff, which stay consistent (counters; a map behind a mutex).
    match AssertUnwindSafe(reconcile).catch_unwind().await {
        Ok(result) => {
            backoff.clear(&key);
            result
        }
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            backoff.record(&key);
            metrics.reconcile_panics.with_label_values(&[kind]).inc();
            metrics.reconciles.with_label_values(&[kind, "panic"]).inc();
            tracing::error!(
                object = %key,
                panic = %message,
                retry_in = ?backoff.delay(&key),
                "reconcile panicked (a bug: please report it); the object is retried later, \
                 the others go on"
            );
            Err(Error::Panicked {
                object: key,
                message,
            })
        }
    }
}

/// `Kind namespace/name` of an object, the key of [`guarded`] and [`PanicBackoff`].
pub fn object_key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{} {}/{}",
        K::kind(&()),
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

/// [`guarded`] for a reconciler of the controller: `reconcile(obj, ctx)` with its panics
/// caught.
pub async fn reconcile_guarded<K, F, Fut>(
    obj: Arc<K>,
    ctx: Arc<Context>,
    reconcile: F,
) -> Result<Action>
where
    K: Resource<DynamicType = ()>,
    F: FnOnce(Arc<K>, Arc<Context>) -> Fut,
    Fut: Future<Output = Result<Action>>,
{
    let key = object_key(obj.as_ref());
    let kind = K::kind(&()).into_owned();
    let metrics = ctx.metrics.clone();
    let reconciled = reconcile(obj, ctx.clone());
    guarded(&kind, key, &metrics, &ctx.panics, reconciled).await
}

/// The requeue after an error of `key`: the panic backoff for a panic, `otherwise` for the
/// rest.
pub fn requeue_after(ctx: &Context, key: &str, error: &Error, otherwise: Duration) -> Action {
    match error {
        Error::Panicked { .. } => Action::requeue(ctx.panics.delay(key)),
        _ => Action::requeue(otherwise),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics_total(metrics: &Metrics, kind: &str) -> u64 {
        metrics.reconcile_panics.with_label_values(&[kind]).get()
    }

    #[tokio::test]
    async fn a_panic_is_an_error_of_its_object_and_the_others_go_on() {
        let metrics = Metrics::new();
        let backoff = PanicBackoff::default();
        let ok = |secs| async move { Ok(Action::requeue(Duration::from_secs(secs))) };
        // What an unchecked timestamp computation did before its bound existed.
        let boom = async { panic!("DateTime overflow adding {}h", 3_000_000_000u64) };
        let (a, b, c) = tokio::join!(
            guarded(
                "SealedVolume",
                "SealedVolume ns/a".into(),
                &metrics,
                &backoff,
                ok(1)
            ),
            guarded(
                "SealedVolume",
                "SealedVolume ns/b".into(),
                &metrics,
                &backoff,
                boom
            ),
            guarded(
                "SealedVolume",
                "SealedVolume ns/c".into(),
                &metrics,
                &backoff,
                ok(3)
            ),
        );
        assert_eq!(a.unwrap(), Action::requeue(Duration::from_secs(1)));
        assert_eq!(c.unwrap(), Action::requeue(Duration::from_secs(3)));
        let err = b.unwrap_err();
        assert!(matches!(err, Error::Panicked { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("SealedVolume ns/b"), "{text}");
        assert!(
            text.contains("DateTime overflow adding 3000000000h"),
            "{text}"
        );
        assert_eq!(panics_total(&metrics, "SealedVolume"), 1);
        assert_eq!(
            metrics
                .reconciles
                .with_label_values(&["SealedVolume", "panic"])
                .get(),
            1
        );
        assert!(metrics.render().contains("reconcile_panics_total"));
    }

    #[tokio::test]
    async fn panics_in_a_row_back_off_and_a_success_resets() {
        let metrics = Metrics::new();
        let backoff = PanicBackoff::default();
        let key = "SealedVolumeVersion ns/v";
        let mut delays = vec![];
        for _ in 0..7 {
            let r = guarded(
                "SealedVolumeVersion",
                key.into(),
                &metrics,
                &backoff,
                async { panic!("boom {}", 1) },
            )
            .await;
            assert!(matches!(r, Err(Error::Panicked { ref message, .. }) if message == "boom 1"));
            delays.push(backoff.delay(key).as_secs());
        }
        assert_eq!(delays, [30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(panics_total(&metrics, "SealedVolumeVersion"), 7);
        // Another object is not slowed by this one's panics.
        assert_eq!(backoff.delay("SealedVolumeVersion ns/other"), FIRST_DELAY);
        guarded(
            "SealedVolumeVersion",
            key.into(),
            &metrics,
            &backoff,
            async { Ok(Action::await_change()) },
        )
        .await
        .unwrap();
        assert_eq!(backoff.delay(key), FIRST_DELAY);
    }
}
