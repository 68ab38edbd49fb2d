//! What every reconcile shares.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use sealed_crds::attestation::AttestationKey;
use sealed_store::ChunkStore;

use crate::config::OperatorConfig;
use crate::guard::PanicBackoff;
use crate::metrics::Metrics;
use crate::sync::Executor;

/// The name the operator uses as field manager and event reporter.
pub const MANAGER: &str = "sealed-operator";

pub struct Context {
    pub client: Client,
    pub config: OperatorConfig,
    pub store: ChunkStore,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Where syncs run.
    pub executor: Box<dyn Executor>,
    /// Attests the versions the operator makes (`crate::attestation`).
    pub attestation: AttestationKey,
    /// Panics in a row per object, for their requeue (`crate::guard`).
    pub panics: PanicBackoff,
}

impl Context {
    pub fn new(
        client: Client,
        config: OperatorConfig,
        store: ChunkStore,
        metrics: Arc<Metrics>,
        executor: Box<dyn Executor>,
        attestation: AttestationKey,
    ) -> Self {
        let instance = std::env::var("POD_NAME").ok();
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance,
            },
        );
        Context {
            client,
            config,
            store,
            metrics,
            recorder,
            executor,
            attestation,
            panics: PanicBackoff::default(),
        }
    }

    /// Records an Event; failing to record one is logged, never fatal.
    pub async fn event(
        &self,
        reference: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, reference).await {
            tracing::warn!(error = %e, reason, "cannot record event");
        }
    }
}
