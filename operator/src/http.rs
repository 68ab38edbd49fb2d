//! `/healthz` and `/metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::metrics::Metrics;

/// What `/healthz` reports: false once the controllers have stopped.
#[derive(Clone, Default)]
pub struct Health(Arc<AtomicBool>);

impl Health {
    pub fn set(&self, ok: bool) {
        self.0.store(ok, Ordering::SeqCst);
    }
    pub fn ok(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Health,
}

/// Serves until the process ends; the listener is bound before this returns, so a bad
/// address is an error at start-up.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Health,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(render_metrics))
        .with_state(AppState { metrics, health });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr} for /metrics and /healthz: {e}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    }))
}

async fn healthz(State(state): State<AppState>) -> (StatusCode, &'static str) {
    if state.health.ok() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "controllers not running\n")
    }
}

async fn render_metrics(State(state): State<AppState>) -> String {
    state.metrics.render()
}
