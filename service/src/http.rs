//! The one HTTP endpoint of the daemons: `GET /metrics` (Prometheus text) and `GET /healthz`
//! (200 with a short text when healthy, else 503 with why). Other paths are 404, other
//! methods 405. Connections are capped and timed out as every listener's ([`crate::listen`]:
//! [`ConnLimits::metrics`] unless [`serve_with_limits`] is given others), and `/metrics`
//! ends with the listeners' own counters.

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

use crate::listen::{self, ConnLimits, Gate, Protocols};

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

/// Serves until `shutdown` completes, with the metrics port's connection bounds.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<dyn RenderMetrics>,
    health: Arc<dyn HealthCheck>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), HttpError> {
    serve_with_limits(listener, metrics, health, ConnLimits::metrics(), shutdown).await
}

/// Serves until `shutdown` completes, each connection within `limits`.
pub async fn serve_with_limits(
    listener: TcpListener,
    metrics: Arc<dyn RenderMetrics>,
    health: Arc<dyn HealthCheck>,
    limits: ConnLimits,
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
    let gate = Gate::new("metrics", limits);
    listen::accept_loop(
        listener,
        gate.clone(),
        shutdown,
        move |tcp, remote, admitted| {
            let (app, gate) = (app.clone(), gate.clone());
            async move {
                let _admitted = admitted;
                listen::serve_connection(tcp, remote, app, &gate, Protocols::Http1AndH2c).await;
            }
        },
    )
    .await
    .map_err(HttpError::Serve)
}

async fn render_metrics(State(endpoints): State<Endpoints>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        // The listeners' own counters after the process's: one scrape has both.
        format!(
            "{}{}",
            endpoints.metrics.render(),
            listen::render_prometheus()
        ),
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
        assert!(
            metrics.contains("\r\n\r\nsealed_test_total 7\n"),
            "{metrics}"
        );
        assert!(
            metrics.contains("sealed_listener_connections_open{listener=\"metrics\"}"),
            "{metrics}"
        );

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

    /// Whether the server closes `conn` within `within`.
    async fn closed_within(conn: &mut tokio::net::TcpStream, within: std::time::Duration) -> bool {
        let mut buf = [0u8; 1024];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => continue,
                Ok(_) => return true,
                Err(_) => return false,
            }
        }
    }

    #[tokio::test]
    async fn idle_connections_are_capped_and_closed() {
        use std::time::Duration;
        let listener = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let health = Arc::new(Switch::new("down"));
        health.set(true);
        let limits = ConnLimits {
            max_connections: 6,
            max_per_source: 3,
            header_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(600),
            ..ConnLimits::metrics()
        };
        let server = tokio::spawn(serve_with_limits(
            listener,
            Arc::new(Fixed),
            health,
            limits,
            std::future::pending(),
        ));
        let connect = || tokio::net::TcpStream::connect(addr);

        // One that sends nothing, one the HTTP/2 preface only, one a request and then
        // nothing (HTTP/1.1 keep-alive): the first two go at the header deadline, the third
        // at the idle one.
        let mut silent = connect().await.expect("connect");
        let mut preface = connect().await.expect("connect");
        preface
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .expect("write");
        // A fourth from the same address is over the per-source cap: closed at once.
        let mut keep = connect().await.expect("connect");
        let mut over = connect().await.expect("connect");
        assert!(closed_within(&mut over, Duration::from_millis(200)).await);
        keep.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 256];
        let n = keep.read(&mut buf).await.expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);

        let started = std::time::Instant::now();
        assert!(closed_within(&mut silent, Duration::from_secs(3)).await);
        assert!(closed_within(&mut preface, Duration::from_secs(3)).await);
        let header_closed = started.elapsed();
        assert!(closed_within(&mut keep, Duration::from_secs(3)).await);
        assert!(
            header_closed < Duration::from_secs(2),
            "closed after {header_closed:?}"
        );

        // Their places are free again: a request from the same address is answered.
        let ok = request(addr, "GET", "/healthz").await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        let metrics = request(addr, "GET", "/metrics").await;
        for line in [
            "sealed_listener_connections_closed_total{listener=\"metrics\",reason=\"header_timeout\"}",
            "sealed_listener_connections_refused_total{listener=\"metrics\",reason=\"per_source\"}",
        ] {
            assert!(metrics.contains(line), "{metrics}");
        }
        server.abort();
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
