//! Listeners that neighbours cannot starve a node through (design invariant 8): every
//! connection to the peer port and the metrics/health port is admitted by a [`Gate`] (a cap
//! in total and per source address, and a process-wide budget of file descriptors that keeps
//! a reserve for the FUSE mounts and the cache), has a header-read deadline (a first request
//! must come within it: an idle connection, one that sent only the HTTP/2 preface, is closed)
//! and an idle deadline (no request in flight and none for that long, or no byte either way
//! for that long: closed), and a TLS handshake waits for one of a bounded number of slots
//! within its own deadline.
//!
//! Descriptors: a process calls [`prepare_descriptors`] at start (the node plugin, `sealed
//! mount`): the soft `RLIMIT_NOFILE` is raised to the hard limit, and connections may hold at
//! most [`connection_budget`] descriptors, half the limit (the rest, at least 256, stays
//! for mounts, cache files, the store's connections). A connection over the budget is closed
//! at once; the listening socket's backlog holds the others, not descriptors. Counting
//! admitted connections is cheap and exact for what a listener adds; the reserve absorbs
//! what the rest of the process holds.
//!
//! Counters (`/metrics`, appended by [`crate::http`] whatever the process renders):
//! `sealed_listener_connections_open{listener}`,
//! `sealed_listener_connections_refused_total{listener,reason}` (reason: `total`,
//! `per_source`, `descriptors`), `sealed_listener_connections_closed_total{listener,reason}`
//! (`header_timeout`, `idle_timeout`), `sealed_listener_tls_handshakes_failed_total{listener,
//! reason}` (`timeout`, `error`). Listener names are fixed strings (`peer`, `metrics`): the
//! cardinality is bounded.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The bounds of one listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one source address.
    pub max_per_source: usize,
    /// A connection's first request head must have come within this (after the TLS
    /// handshake, if any); HTTP/1.1 request heads after it too.
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long, or no byte either way for this
    /// long, is closed.
    pub idle_timeout: Duration,
    /// A TLS handshake (the wait for a slot included) must be done within this.
    pub handshake_timeout: Duration,
    /// TLS handshakes at once; the others wait for a slot within their deadline.
    pub max_handshakes: usize,
}

impl ConnLimits {
    /// The peer port: every node of a fleet keeps a pooled connection or two to each owner.
    pub fn peer() -> ConnLimits {
        ConnLimits {
            max_connections: 512,
            max_per_source: 32,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 64,
        }
    }

    /// The metrics and health port: a scraper and the kubelet's probes.
    pub fn metrics() -> ConnLimits {
        ConnLimits {
            max_connections: 64,
            max_per_source: 16,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 8,
        }
    }

    /// These bounds with the caps and deadlines of a binary's flags (counts and
    /// milliseconds; a count past `usize` saturates); the handshake deadline is the header
    /// deadline.
    pub fn with_flags(self, max: u64, per_source: u64, header_ms: u64, idle_ms: u64) -> ConnLimits {
        let count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        ConnLimits {
            max_connections: count(max),
            max_per_source: count(per_source),
            header_timeout: Duration::from_millis(header_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            handshake_timeout: Duration::from_millis(header_ms),
            ..self
        }
    }

    /// Refuses bounds that would admit nothing or close everything at once.
    pub fn validate(&self, what: &str) -> Result<(), String> {
        if self.max_connections == 0 || self.max_per_source == 0 || self.max_handshakes == 0 {
            return Err(format!("{what}: connection caps must be at least 1"));
        }
        if self.header_timeout.is_zero()
            || self.idle_timeout.is_zero()
            || self.handshake_timeout.is_zero()
        {
            return Err(format!("{what}: connection timeouts must be above zero"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// File descriptors

/// Descriptors always kept for the rest of the process, whatever the limit.
const MIN_RESERVE: u64 = 256;

/// The process's descriptor limit and the share connections may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptors {
    /// The soft `RLIMIT_NOFILE` in force.
    pub limit: u64,
    /// What listeners' connections may hold together.
    pub budget: u64,
}

impl Descriptors {
    /// Half of `limit` for connections, the rest (at least [`MIN_RESERVE`]) kept.
    pub fn of_limit(limit: u64) -> Descriptors {
        let reserve = (limit / 2).max(MIN_RESERVE).min(limit);
        Descriptors {
            limit,
            budget: limit.saturating_sub(reserve),
        }
    }
}

struct FdBudget {
    capacity: usize,
    used: AtomicUsize,
}

static BUDGET: OnceLock<FdBudget> = OnceLock::new();

fn soft_nofile() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (container runtimes often start a
/// process at 1024 with a far higher hard limit) and returns the soft limit in force.
pub fn raise_nofile_limit() -> io::Result<u64> {
    let (soft, hard) = soft_nofile()?;
    // An unlimited hard limit is not a valid soft one for descriptors: the kernel's
    // nr_open (1Mi by default) is.
    let target = if hard == libc::RLIM_INFINITY {
        1 << 20
    } else {
        hard
    };
    if soft >= target {
        return Ok(soft);
    }
    let lim = libc::rlimit {
        rlim_cur: target,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        let e = io::Error::last_os_error();
        tracing::warn!(soft, hard, error = %e, "cannot raise the open-files limit");
        return Ok(soft);
    }
    Ok(target)
}

/// At a process's start: raises the descriptor limit ([`raise_nofile_limit`]) and fixes the
/// connections' budget from it. Later calls return the first answer.
pub fn prepare_descriptors() -> Descriptors {
    let limit = match raise_nofile_limit() {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-files limit; assuming 1024");
            1024
        }
    };
    let budget = budget();
    let d = Descriptors {
        limit,
        budget: budget.capacity as u64,
    };
    if BUDGET_LOGGED.set(()).is_ok() {
        tracing::info!(
            open_files_limit = limit,
            connection_budget = d.budget,
            "descriptors: connections are refused before the reserve for mounts and cache"
        );
    }
    d
}

static BUDGET_LOGGED: OnceLock<()> = OnceLock::new();

/// The budget, fixed from the limit in force when first asked (a process that never called
/// [`prepare_descriptors`] gets one from its current limit).
fn budget() -> &'static FdBudget {
    BUDGET.get_or_init(|| {
        let limit = soft_nofile().map(|(soft, _)| soft).unwrap_or(1024);
        let d = Descriptors::of_limit(limit);
        FdBudget {
            capacity: usize::try_from(d.budget).unwrap_or(usize::MAX),
            used: AtomicUsize::new(0),
        }
    })
}

/// How many descriptors all listeners' connections may hold together.
pub fn connection_budget() -> u64 {
    budget().capacity as u64
}

impl FdBudget {
    fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used < self.capacity).then(|| used.saturating_add(1))
            })
            .is_ok()
    }

    fn give_back(&self) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(1))
            });
    }
}

// ---------------------------------------------------------------------------------------------
// Counters

/// One listener's counters (shared by every listener of that name in the process).
#[derive(Debug, Default)]
pub struct ListenerStats {
    pub open: AtomicU64,
    pub refused_total: AtomicU64,
    pub refused_per_source: AtomicU64,
    pub refused_descriptors: AtomicU64,
    pub closed_header_timeout: AtomicU64,
    pub closed_idle_timeout: AtomicU64,
    pub tls_timeout: AtomicU64,
    pub tls_error: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

static LISTENERS: Mutex<Vec<(&'static str, Arc<ListenerStats>)>> = Mutex::new(Vec::new());

/// The counters of the listener called `name` (created on first use).
pub fn stats(name: &'static str) -> Arc<ListenerStats> {
    let mut all = LISTENERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, s)) = all.iter().find(|(n, _)| *n == name) {
        return s.clone();
    }
    let s = Arc::new(ListenerStats::default());
    all.push((name, s.clone()));
    s
}

/// Every listener's counters in the Prometheus text format.
pub fn render_prometheus() -> String {
    let all: Vec<(&'static str, Arc<ListenerStats>)> =
        LISTENERS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if all.is_empty() {
        return String::new();
    }
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, rows: &dyn Fn(&mut String)| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        rows(&mut out);
    };
    family(
        "sealed_listener_connections_open",
        "gauge",
        "Connections open on the listener",
        &|o| {
            for (n, s) in &all {
                o.push_str(&format!(
                    "sealed_listener_connections_open{{listener=\"{n}\"}} {}\n",
                    get(&s.open)
                ));
            }
        },
    );
    family(
        "sealed_listener_connections_refused_total",
        "counter",
        "Connections closed at accept: over the listener's cap, its per-source cap, or the descriptors connections may hold",
        &|o| {
            for (n, s) in &all {
                for (reason, c) in [
                    ("total", &s.refused_total),
                    ("per_source", &s.refused_per_source),
                    ("descriptors", &s.refused_descriptors),
                ] {
                    o.push_str(&format!(
                        "sealed_listener_connections_refused_total{{listener=\"{n}\",reason=\"{reason}\"}} {}\n",
                        get(c)
                    ));
                }
            }
        },
    );
    family(
        "sealed_listener_connections_closed_total",
        "counter",
        "Connections closed for sending no request head in time, or for idling",
        &|o| {
            for (n, s) in &all {
                for (reason, c) in [
                    ("header_timeout", &s.closed_header_timeout),
                    ("idle_timeout", &s.closed_idle_timeout),
                ] {
                    o.push_str(&format!(
                        "sealed_listener_connections_closed_total{{listener=\"{n}\",reason=\"{reason}\"}} {}\n",
                        get(c)
                    ));
                }
            }
        },
    );
    family(
        "sealed_listener_tls_handshakes_failed_total",
        "counter",
        "TLS handshakes that did not finish in time (the wait for a slot included) or failed",
        &|o| {
            for (n, s) in &all {
                for (reason, c) in [("timeout", &s.tls_timeout), ("error", &s.tls_error)] {
                    o.push_str(&format!(
                        "sealed_listener_tls_handshakes_failed_total{{listener=\"{n}\",reason=\"{reason}\"}} {}\n",
                        get(c)
                    ));
                }
            }
        },
    );
    out
}

// ---------------------------------------------------------------------------------------------
// Admission

/// Admits a listener's connections: its caps and the process's descriptor budget.
pub struct Gate {
    name: &'static str,
    limits: ConnLimits,
    per_source: Mutex<HashMap<IpAddr, usize>>,
    open: AtomicUsize,
    handshakes: Arc<tokio::sync::Semaphore>,
    stats: Arc<ListenerStats>,
}

/// Why a connection was closed at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    Total,
    PerSource,
    Descriptors,
}

/// An admitted connection's place; given back when dropped.
pub struct Admitted {
    gate: Arc<Gate>,
    source: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let gate = &self.gate;
        {
            let mut map = gate.per_source.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = map.get_mut(&self.source) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(&self.source);
                }
            }
        }
        let _ = gate
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| {
                Some(o.saturating_sub(1))
            });
        gate.stats.open.fetch_sub(1, Ordering::Relaxed);
        budget().give_back();
    }
}

impl Gate {
    pub fn new(name: &'static str, limits: ConnLimits) -> Arc<Gate> {
        Arc::new(Gate {
            name,
            handshakes: Arc::new(tokio::sync::Semaphore::new(limits.max_handshakes.max(1))),
            limits,
            per_source: Mutex::new(HashMap::new()),
            open: AtomicUsize::new(0),
            stats: stats(name),
        })
    }

    pub fn limits(&self) -> &ConnLimits {
        &self.limits
    }

    pub fn stats(&self) -> &Arc<ListenerStats> {
        &self.stats
    }

    /// Admits a connection from `source`, or says why not (and counts it).
    pub fn admit(self: &Arc<Self>, source: IpAddr) -> Result<Admitted, Refused> {
        // ::ffff:a.b.c.d is a.b.c.d: one source, not two.
        let source = source.to_canonical();
        let mut map = self.per_source.lock().unwrap_or_else(|p| p.into_inner());
        let refused = if self.open.load(Ordering::Acquire) >= self.limits.max_connections {
            Some(Refused::Total)
        } else if map.get(&source).copied().unwrap_or(0) >= self.limits.max_per_source {
            Some(Refused::PerSource)
        } else if !budget().try_take() {
            Some(Refused::Descriptors)
        } else {
            None
        };
        if let Some(why) = refused {
            inc(match why {
                Refused::Total => &self.stats.refused_total,
                Refused::PerSource => &self.stats.refused_per_source,
                Refused::Descriptors => &self.stats.refused_descriptors,
            });
            return Err(why);
        }
        *map.entry(source).or_insert(0) += 1;
        self.open.fetch_add(1, Ordering::AcqRel);
        self.stats.open.fetch_add(1, Ordering::Relaxed);
        Ok(Admitted {
            gate: self.clone(),
            source,
        })
    }

    /// Runs `handshake` in one of the bounded handshake slots, the wait and the handshake
    /// within [`ConnLimits::handshake_timeout`]; `None` (counted) when it fails or is late.
    pub async fn handshake<T, E: std::fmt::Display>(
        &self,
        remote: SocketAddr,
        handshake: impl Future<Output = Result<T, E>>,
    ) -> Option<T> {
        let slots = self.handshakes.clone();
        let bounded = tokio::time::timeout(self.limits.handshake_timeout, async move {
            let _slot = slots.acquire_owned().await;
            handshake.await
        });
        match bounded.await {
            Ok(Ok(stream)) => Some(stream),
            Ok(Err(e)) => {
                inc(&self.stats.tls_error);
                tracing::debug!(listener = self.name, %remote, error = %e, "TLS handshake failed");
                None
            }
            Err(_) => {
                inc(&self.stats.tls_timeout);
                tracing::debug!(listener = self.name, %remote, "TLS handshake not done in time");
                None
            }
        }
    }
}

/// Accepts connections on `listener` until `shutdown` completes: each one the gate admits is
/// handed to `serve` (with its place, which it holds until it ends); the others are closed at
/// once. Aborting the task closes every connection too.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    gate: Arc<Gate>,
    shutdown: impl Future<Output = ()>,
    mut serve: F,
) -> io::Result<()>
where
    F: FnMut(TcpStream, SocketAddr, Admitted) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, remote) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors after all (the reserve is the rest of the process's):
                    // wait rather than spin.
                    tracing::warn!(listener = gate.name, error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        match gate.admit(remote.ip()) {
            Ok(admitted) => {
                connections.spawn(serve(tcp, remote, admitted));
            }
            Err(why) => {
                tracing::debug!(listener = gate.name, %remote, ?why, "connection refused");
                drop(tcp);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Serving one connection

/// What a connection's watchdog reads: requests started and in flight, and when the last
/// request ended and the last byte moved.
struct ConnState {
    born: Instant,
    started: AtomicU64,
    in_flight: AtomicUsize,
    /// Milliseconds since `born`.
    last_request: AtomicU64,
    last_io: AtomicU64,
}

impl ConnState {
    fn now(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
    fn touch_io(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }
}

/// A request's place in [`ConnState::in_flight`], held by its response body until it ends.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn start(state: &Arc<ConnState>) -> InFlight {
        state.started.fetch_add(1, Ordering::Relaxed);
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        state.last_request.store(state.now(), Ordering::Relaxed);
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last_request.store(self.0.now(), Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted in flight until it is done or dropped.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's socket, noting when bytes move.
struct Watched<I> {
    inner: I,
    state: Arc<ConnState>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.touch_io();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.state.touch_io();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.state.touch_io();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Which HTTP versions a connection may speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocols {
    /// HTTP/1.1, or HTTP/2 with prior knowledge (h2c).
    Http1AndH2c,
    /// HTTP/2 only (after ALPN `h2`).
    Http2,
}

/// Serves `router` on one admitted connection within `gate`'s deadlines: closed when no
/// request head came within the header deadline, when no request was in flight for the idle
/// deadline (gracefully: HTTP/2 GOAWAY, then closed after another header deadline), or when
/// no byte moved either way for the idle deadline.
pub async fn serve_connection<I>(
    io: I,
    remote: SocketAddr,
    router: Router,
    gate: &Gate,
    protocols: Protocols,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = &gate.limits;
    let state = Arc::new(ConnState {
        born: Instant::now(),
        started: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
        last_request: AtomicU64::new(0),
        last_io: AtomicU64::new(0),
    });
    let io = TokioIo::new(Watched {
        inner: io,
        state: state.clone(),
    });
    let tower = TowerToHyperService::new(router);
    let service = {
        let state = state.clone();
        hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::start(&state);
            let call = hyper::service::Service::call(&tower, req);
            async move {
                let response = match call.await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|inner| {
                    Body::new(TrackedBody {
                        inner,
                        _in_flight: in_flight,
                    })
                }))
            }
        })
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder.http2().timer(TokioTimer::new());
    if protocols == Protocols::Http2 {
        builder = builder.http2_only();
    }
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);

    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let (header_ms, idle_ms) = (ms(limits.header_timeout), ms(limits.idle_timeout));
    let tick = (limits.header_timeout.min(limits.idle_timeout) / 4)
        .clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut draining_since: Option<u64> = None;
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(listener = gate.name, %remote, error = %e, "connection ended");
                }
                return;
            }
            _ = tokio::time::sleep(tick) => {}
        }
        let now = state.now();
        if state.started.load(Ordering::Relaxed) == 0 && now >= header_ms {
            inc(&gate.stats.closed_header_timeout);
            tracing::debug!(listener = gate.name, %remote, "no request head in time: closed");
            return;
        }
        let quiet_io = now.saturating_sub(state.last_io.load(Ordering::Relaxed)) >= idle_ms;
        let idle = state.in_flight.load(Ordering::Acquire) == 0
            && now.saturating_sub(state.last_request.load(Ordering::Relaxed)) >= idle_ms;
        if quiet_io && state.started.load(Ordering::Relaxed) > 0 && !idle {
            // A request in flight and nothing moving: a reader that stopped reading.
            inc(&gate.stats.closed_idle_timeout);
            return;
        }
        match draining_since {
            None if idle => {
                inc(&gate.stats.closed_idle_timeout);
                conn.as_mut().graceful_shutdown();
                draining_since = Some(now);
            }
            Some(since) if now.saturating_sub(since) >= header_ms => return,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_half_and_at_least_256() {
        assert_eq!(Descriptors::of_limit(1024).budget, 512);
        assert_eq!(Descriptors::of_limit(400).budget, 144);
        assert_eq!(Descriptors::of_limit(100).budget, 0);
        assert_eq!(Descriptors::of_limit(1 << 20).budget, 1 << 19);
    }

    #[tokio::test]
    async fn caps_in_total_and_per_source() {
        let gate = Gate::new(
            "test-caps",
            ConnLimits {
                max_connections: 3,
                max_per_source: 2,
                ..ConnLimits::metrics()
            },
        );
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = gate.admit(a).unwrap();
        let _a2 = gate.admit("::ffff:10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(gate.admit(a).err(), Some(Refused::PerSource));
        let _b1 = gate.admit(b).unwrap();
        assert_eq!(gate.admit(b).err(), Some(Refused::Total));
        drop(a1);
        assert!(gate.admit(b).is_ok());
        let stats = gate.stats();
        assert_eq!(stats.refused_per_source.load(Ordering::Relaxed), 1);
        assert_eq!(stats.refused_total.load(Ordering::Relaxed), 1);
        let text = render_prometheus();
        assert!(
            text.contains(
                "sealed_listener_connections_refused_total{listener=\"test-caps\",reason=\"per_source\"} 1"
            ),
            "{text}"
        );
    }
}
