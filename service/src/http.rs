//! The one HTTP endpoint of the daemons: `GET /metrics` (Prometheus text) and `GET /healthz`
//! (200 with a short text when healthy, else 503 with why). Other paths are 404, other
//! methods 405.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::future::BoxFuture;
use tokio::net::TcpListener;

/// What `/healthz` asks: `Ok` with a short text when healthy, else why not.
pub trait HealthCheck: Send + Sync + 'static {
    fn check(&self) -> BoxFuture<'_, Result<String, String>>;
}

/// What `/metrics` renders: the Prometheus text format.
pub trait RenderMetrics: Send + Sync + 'static {
    fn render(&self) -> String;
}

/// A health that is one switch: healthy until [`Switch::set`] turns it off, then `down`.
pub struct Switch {
    on: AtomicBool,
    down: &'static str,
}

impl Switch {
    /// Starts off; `down` is what `/healthz` says while it is.
    pub fn new(down: &'static str) -> Self {
        Switch {
            on: AtomicBool::new(false),
            down,
        }
    }
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::SeqCst);
    }
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }
}

impl HealthCheck for Switch {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        let state = if self.is_on() {
            Ok("ok".to_owned())
        } else {
            Err(self.down.to_owned())
        };
        Box::pin(async move { state })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on {addr} for /metrics and /healthz: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the /metrics and /healthz server stopped: {0}")]
    Serve(std::io::Error),
}

/// Binds first, so a bad or taken address is an error at start-up, not in a task.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, HttpError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })
}

#[derive(Clone)]
struct Endpoints {
    metrics: Arc<dyn RenderMetrics>,
    health: Arc<dyn HealthCheck>,
}

/// Serves until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<dyn RenderMetrics>,
    health: Arc<dyn HealthCheck>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), HttpError> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics and /healthz");
    }
    let app = Router::new()
        .route("/metrics", get(render_metrics).fallback(get_only))
        .route("/healthz", get(healthz).fallback(get_only))
        .fallback(not_found)
        .with_state(Endpoints { metrics, health });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(HttpError::Serve)
}

async fn render_metrics(State(endpoints): State<Endpoints>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        endpoints.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(endpoints): State<Endpoints>) -> Response {
    match endpoints.health.check().await {
        Ok(text) => (StatusCode::OK, format!("{text}\n")).into_response(),
        Err(why) => {
            tracing::warn!(%why, "healthz: unhealthy");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("unhealthy: {why}\n"),
            )
                .into_response()
        }
    }
}

async fn get_only() -> Response {
    (StatusCode::METHOD_NOT_ALLOWED, "GET only\n").into_response()
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        "not found: try /metrics or /healthz\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Fixed;
    impl RenderMetrics for Fixed {
        fn render(&self) -> String {
            "sealed_test_total 7\n".into()
        }
    }

    async fn request(addr: SocketAddr, method: &str, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await.expect("write");
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.expect("read");
        reply
    }

    #[tokio::test]
    async fn routes_health_metrics_and_the_rest() {
        let listener = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let health = Arc::new(Switch::new("controllers not running"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Arc::new(Fixed), health.clone(), async {
            let _ = stopped.await;
        }));

        let down = request(addr, "GET", "/healthz").await;
        assert!(down.starts_with("HTTP/1.1 503"), "{down}");
        assert!(
            down.ends_with("unhealthy: controllers not running\n"),
            "{down}"
        );
        health.set(true);
        let up = request(addr, "GET", "/healthz").await;
        assert!(
            up.starts_with("HTTP/1.1 200") && up.ends_with("\r\n\r\nok\n"),
            "{up}"
        );

        let metrics = request(addr, "GET", "/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(metrics.contains("text/plain; version=0.0.4"), "{metrics}");
        assert!(metrics.ends_with("sealed_test_total 7\n"), "{metrics}");

        let post = request(addr, "POST", "/metrics").await;
        assert!(
            post.starts_with("HTTP/1.1 405") && post.ends_with("GET only\n"),
            "{post}"
        );
        let other = request(addr, "GET", "/nope").await;
        assert!(other.starts_with("HTTP/1.1 404"), "{other}");

        stop.send(()).expect("stop");
        server.await.expect("join").expect("serve");
    }

    #[tokio::test]
    async fn a_taken_address_is_an_error_naming_it() {
        let taken = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = taken.local_addr().expect("addr");
        let err = bind(addr).await.expect_err("taken");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
