//! Wires the reconcilers to the API server: one controller for SealedVolumes (woken by
//! their versions and their sync Jobs), one for SealedVolumeVersions,
//! and the garbage collection loop. Every reconcile runs inside [`guard`], so a panic is
//! an error of its object, never the end of the process.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_store::ChunkStore;

use crate::config::{OperatorConfig, SyncExecutor};
use crate::context::Context;
use crate::metrics::Metrics;
use crate::sync::Executor;
use crate::sync::inline::InlineExecutor;
use crate::sync::job::{JobExecutor, LABEL_VOLUME_NAME, LABEL_VOLUME_NAMESPACE};
use crate::{gc_loop, guard, version, volume};

/// Runs the controllers until the process is asked to stop.
pub async fn run(
    client: Client,
    config: OperatorConfig,
    store: ChunkStore,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    let executor: Box<dyn Executor> = match config.executor {
        SyncExecutor::Inline => Box::new(InlineExecutor::new(store.clone(), metrics.clone())),
        SyncExecutor::Job => Box::new(JobExecutor::new(client.clone(), config.clone())),
    };
    let attestation =
        crate::attestation::ensure_key(&client, &config.namespace, &config.attestation_secret)
            .await?;
    let ctx = Arc::new(Context::new(
        client.clone(),
        config.clone(),
        store,
        metrics,
        executor,
        attestation,
    ));

    let (volumes, versions): (Api<SealedVolume>, Api<SealedVolumeVersion>) =
        match config.single_watch_namespace() {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
    let mut volume_controller = Controller::new(volumes, watcher::Config::default()).watches(
        versions.clone(),
        watcher::Config::default(),
        |v| {
            let ns = v.namespace()?;
            Some(ObjectRef::new(&v.spec.volume).within(&ns))
        },
    );
    if config.executor == SyncExecutor::Job {
        let jobs: Api<Job> = Api::namespaced(client.clone(), &config.namespace);
        volume_controller = volume_controller.watches(
            jobs,
            watcher::Config::default().labels("app.kubernetes.io/managed-by=sealed-operator"),
            |job| {
                let labels = job.labels();
                let ns = labels.get(LABEL_VOLUME_NAMESPACE)?;
                let name = labels.get(LABEL_VOLUME_NAME)?;
                Some(ObjectRef::new(name).within(ns))
            },
        );
    }
    let volume_loop = volume_controller
        .shutdown_on_signal()
        .run(
            |v, ctx| guard::reconcile_guarded(v, ctx, volume::reconcile),
            volume::error_policy,
            ctx.clone(),
        )
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "SealedVolume reconcile");
            }
        });
    let version_loop = Controller::new(versions, watcher::Config::default())
        .shutdown_on_signal()
        .run(
            |v, ctx| guard::reconcile_guarded(v, ctx, version::reconcile),
            version::error_policy,
            ctx.clone(),
        )
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "SealedVolumeVersion reconcile");
            }
        });
    tracing::info!(
        store = %ctx.store.name(),
        executor = ?config.executor,
        namespace = %config.namespace,
        "controllers running"
    );
    tokio::select! {
        _ = futures::future::join(volume_loop, version_loop) => {}
        _ = gc_loop::run(ctx.clone()) => {}
    }
    Ok(())
}
