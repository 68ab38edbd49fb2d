//! Periodic garbage collection of the store (`--gc-interval`; the collector itself and its
//! safety argument are in `sealed_store::gc` and docs/gc.md).

use std::sync::Arc;

use crate::context::Context;

/// Runs forever (or returns at once when GC is off).
pub async fn run(ctx: Arc<Context>) {
    let interval = ctx.config.gc_interval;
    if interval.is_zero() {
        return futures::future::pending().await;
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate: let the controllers settle first
    loop {
        ticker.tick().await;
        collect_once(&ctx).await;
    }
}

pub async fn collect_once(ctx: &Context) {
    let options = sealed_store::gc::GcOptions {
        dry_run: ctx.config.gc_dry_run,
        grace: ctx.config.gc_grace,
        ..Default::default()
    };
    match sealed_store::gc::collect(&ctx.store, &options).await {
        Ok(report) => {
            let result = if report.skipped.is_some() {
                "skipped"
            } else {
                "ok"
            };
            ctx.metrics.gc_runs.with_label_values(&[result]).inc();
            if !options.dry_run {
                ctx.metrics.gc_bytes_freed.inc_by(report.bytes_freed);
                ctx.metrics.gc_chunks_deleted.inc_by(report.chunks_deleted);
            }
            tracing::info!(?report, "garbage collection");
        }
        Err(e) => {
            ctx.metrics.gc_runs.with_label_values(&["error"]).inc();
            tracing::warn!(error = %e, "garbage collection failed");
        }
    }
}
