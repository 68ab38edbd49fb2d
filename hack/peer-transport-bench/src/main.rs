//! Peer transport benchmark: the same in-memory chunks served over HTTP/2 (as `sealed-peer`
//! does it) and over iroh-blobs, each server in its own process, fetched by another process
//! on 127.0.0.1. `compare` runs the whole interleaved comparison and prints Markdown; `serve`
//! and `fetch` are the two sides it starts (docs/peer.md, "Transport").

mod data;
mod http2;
mod irohb;
mod measure;
mod tls;

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

/// The peer tier's (and the chunker's) largest chunk.
const MAX_CHUNK: usize = 4 << 20;

#[derive(Parser)]
#[command(about = "HTTP/2 vs iroh-blobs for peer chunk transfer, on loopback")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize, Debug)]
#[serde(rename_all = "kebab-case")]
enum Transport {
    /// h2c with TCP_NODELAY on the server's sockets: the peer tier without TLS.
    Http2,
    Iroh,
    /// HTTP/2 over mTLS (rustls, ring), TCP_NODELAY: the peer tier with `--peer-tls-*`.
    Http2Tls,
    /// h2c with Nagle left on (plain `axum::serve`): the peer tier before TCP_NODELAY was
    /// set, kept as a diagnostic.
    Http2Nagle,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Http2 => "http2",
            Transport::Iroh => "iroh",
            Transport::Http2Tls => "http2-tls",
            Transport::Http2Nagle => "http2-nagle",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Transport::Http2 => "HTTP/2 (h2c, the peer tier)",
            Transport::Iroh => "iroh-blobs",
            Transport::Http2Tls => "HTTP/2 over mTLS (the peer tier with TLS)",
            Transport::Http2Nagle => "HTTP/2 h2c, Nagle on (before the fix)",
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Hold the chunks and serve them until stdin closes; prints one JSON line when ready.
    Serve {
        #[arg(long, value_enum)]
        transport: Transport,
        #[arg(long, default_value_t = 1024)]
        chunks: usize,
        /// Bytes per chunk (suffix K or M); at most 4M.
        #[arg(long, default_value = "1M", value_parser = parse_size)]
        chunk_size: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Where to write the chunk keys for `fetch`.
        #[arg(long)]
        keys: PathBuf,
    },
    /// Fetch the first `limit` chunks of `keys` from a server; prints one JSON line.
    Fetch {
        #[arg(long, value_enum)]
        transport: Transport,
        /// The server's ready line.
        #[arg(long)]
        server: String,
        #[arg(long)]
        keys: PathBuf,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        #[arg(long)]
        limit: Option<usize>,
    },
    /// The whole comparison: per chunk size, one server process per transport, then R
    /// interleaved rounds of fetch processes (A, B, A, B, ...) at C and at 1.
    Compare {
        /// Transports, comma-separated, run in this order each round.
        #[arg(
            long,
            default_value = "http2,iroh,http2-tls",
            value_delimiter = ',',
            value_enum
        )]
        transports: Vec<Transport>,
        /// Chunk sizes, comma-separated.
        #[arg(long, default_value = "256K,1M,4M", value_delimiter = ',', value_parser = parse_size)]
        sizes: Vec<usize>,
        /// Bytes per data set; chunks = this / chunk size.
        #[arg(long, default_value_t = 1024)]
        total_mib: usize,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Chunks fetched one at a time in the C=1 rows.
        #[arg(long, default_value_t = 256)]
        serial_chunks: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Scratch directory for the key lists.
        #[arg(long, default_value = "/tmp/peer-transport-bench")]
        dir: PathBuf,
        /// Also write every run as CSV here.
        #[arg(long)]
        csv: Option<PathBuf>,
    },
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (digits, unit) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    let n: usize = digits.parse().map_err(|e| format!("{s:?}: {e}"))?;
    let size = n.checked_mul(unit).ok_or("too large")?;
    if size == 0 || size > MAX_CHUNK {
        return Err(format!("{s:?}: chunks are 1 byte to 4 MiB"));
    }
    Ok(size)
}

#[derive(Serialize, Deserialize)]
struct Ready {
    pid: u32,
    addr: String,
    /// The iroh endpoint id, for iroh.
    id: Option<String>,
    /// The client's certificate, key and CA, for HTTP/2 over TLS.
    tls: Option<tls::Side>,
}

#[derive(Serialize, Deserialize, Clone)]
struct RunResult {
    transport: Transport,
    chunk_size: usize,
    concurrency: usize,
    chunks: usize,
    bytes: u64,
    wall_s: f64,
    fetch_cpu_s: f64,
    serve_cpu_s: f64,
    p50_ms: f64,
    p99_ms: f64,
}

impl RunResult {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.wall_s / 1e9
    }
    fn cpu_per_gb(&self) -> f64 {
        (self.fetch_cpu_s + self.serve_cpu_s) / (self.bytes as f64 / 1e9)
    }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Serve {
            transport,
            chunks,
            chunk_size,
            seed,
            keys,
        } => runtime()?.block_on(serve(transport, chunks, chunk_size, seed, &keys)),
        Cmd::Fetch {
            transport,
            server,
            keys,
            concurrency,
            limit,
        } => {
            let server: Ready = serde_json::from_str(&server)?;
            let mut keys = data::read_keys(&keys)?;
            keys.truncate(limit.unwrap_or(usize::MAX));
            let result = runtime()?.block_on(fetch(transport, &server, &keys, concurrency))?;
            println!("{}", serde_json::to_string(&result)?);
            Ok(())
        }
        Cmd::Compare {
            transports,
            sizes,
            total_mib,
            concurrency,
            runs,
            serial_chunks,
            seed,
            dir,
            csv,
        } => compare(&Plan {
            transports,
            sizes,
            total_mib,
            concurrency,
            runs,
            serial_chunks,
            seed,
            dir,
            csv,
        }),
    }
}

// The default multi-threaded runtime, one worker per core: what the node's processes run.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

async fn serve(
    transport: Transport,
    chunks: usize,
    chunk_size: usize,
    seed: u64,
    keys: &Path,
) -> anyhow::Result<()> {
    let set = data::generate(chunks, chunk_size, seed);
    data::write_keys(keys, &set)?;
    let pid = std::process::id();
    // Served until the parent closes our stdin (or dies): no orphaned servers.
    let until_stdin_closes = async {
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    };
    match transport {
        Transport::Http2 | Transport::Http2Nagle | Transport::Http2Tls => {
            let served = http2::listen(set).await?;
            let sides = (transport == Transport::Http2Tls)
                .then(tls::make)
                .transpose()?;
            let ready = Ready {
                pid,
                addr: served.listener.local_addr()?.to_string(),
                id: None,
                tls: sides.as_ref().map(|(_, client)| client.clone()),
            };
            println!("{}", serde_json::to_string(&ready)?);
            let http2::Served {
                listener,
                router,
                metrics,
                members: _members,
            } = served;
            match (transport, sides) {
                (Transport::Http2Tls, Some((server, _))) => {
                    let tls = server.peer_tls()?;
                    tokio::select! {
                        served = sealed_peer::server::serve_tls(listener, router, &tls, metrics) => served?,
                        () = until_stdin_closes => {}
                    }
                }
                // The diagnostic: plain axum::serve, Nagle left on.
                (Transport::Http2Nagle, _) => tokio::select! {
                    served = axum::serve(listener, router) => served?,
                    () = until_stdin_closes => {}
                },
                _ => tokio::select! {
                    served = sealed_peer::server::serve(listener, router) => served?,
                    () = until_stdin_closes => {}
                },
            }
        }
        Transport::Iroh => {
            let server = irohb::serve(set).await?;
            let ready = Ready {
                pid,
                addr: server.addr.to_string(),
                id: Some(server.id.to_string()),
                tls: None,
            };
            println!("{}", serde_json::to_string(&ready)?);
            until_stdin_closes.await;
            server.router.shutdown().await?;
        }
    }
    Ok(())
}

async fn fetch(
    transport: Transport,
    server: &Ready,
    keys: &[(blake3::Hash, usize)],
    concurrency: usize,
) -> anyhow::Result<RunResult> {
    let concurrency = concurrency.max(1);
    // Client state is made before the clock starts; connecting is inside the window.
    let peer = match transport {
        Transport::Http2 | Transport::Http2Tls | Transport::Http2Nagle => {
            let tls = server.tls.as_ref().map(tls::Side::peer_tls).transpose()?;
            Some(http2::client(&server.addr, tls)?)
        }
        Transport::Iroh => None,
    };
    let endpoint = match transport {
        Transport::Iroh => Some(irohb::client().await?),
        Transport::Http2 | Transport::Http2Tls | Transport::Http2Nagle => None,
    };
    let (cpu0, serve0, t0) = (
        measure::self_cpu_seconds(),
        measure::proc_cpu_seconds(server.pid)?,
        Instant::now(),
    );
    let mut latencies = match (&endpoint, &server.id) {
        (Some(endpoint), Some(id)) => {
            let addr = server.addr.parse()?;
            let connection = irohb::connect(endpoint, id, addr).await?;
            let latencies = irohb::fetch_all(&connection, keys, concurrency).await?;
            connection.close(0u32.into(), b"done");
            latencies
        }
        (None, None) => match &peer {
            Some((client, _members)) => http2::fetch_all(client, keys, concurrency).await?,
            None => bail!("no peer client for transport {}", transport.name()),
        },
        _ => bail!("server line does not match transport {}", transport.name()),
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let fetch_cpu_s = measure::self_cpu_seconds() - cpu0;
    let serve_cpu_s = measure::proc_cpu_seconds(server.pid)? - serve0;
    if let Some(endpoint) = endpoint {
        endpoint.close().await;
    }
    latencies.sort_by(f64::total_cmp);
    Ok(RunResult {
        transport,
        chunk_size: keys.first().map_or(0, |k| k.1),
        concurrency,
        chunks: keys.len(),
        bytes: keys.iter().map(|k| k.1 as u64).sum(),
        wall_s,
        fetch_cpu_s,
        serve_cpu_s,
        p50_ms: measure::percentile(&latencies, 50.0) * 1e3,
        p99_ms: measure::percentile(&latencies, 99.0) * 1e3,
    })
}

struct Plan {
    transports: Vec<Transport>,
    sizes: Vec<usize>,
    total_mib: usize,
    concurrency: usize,
    runs: usize,
    serial_chunks: usize,
    seed: u64,
    dir: PathBuf,
    csv: Option<PathBuf>,
}

struct ServerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    ready: String,
    keys: PathBuf,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

fn start_server(plan: &Plan, transport: Transport, size: usize) -> anyhow::Result<ServerProcess> {
    let keys = plan
        .dir
        .join(format!("keys-{}-{size}.txt", transport.name()));
    let chunks = (plan.total_mib << 20) / size;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["serve", "--transport", transport.name()])
        .args(["--chunks", &chunks.to_string()])
        .args(["--chunk-size", &size.to_string()])
        .args(["--seed", &plan.seed.to_string()])
        .arg("--keys")
        .arg(&keys)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().context("no server stdout")?;
    let mut ready = String::new();
    BufReader::new(stdout).read_line(&mut ready)?;
    if ready.trim().is_empty() {
        bail!("the {} server exited before it was ready", transport.name());
    }
    Ok(ServerProcess {
        child,
        stdin,
        ready: ready.trim().to_owned(),
        keys,
    })
}

fn run_fetch(
    transport: Transport,
    server: &ServerProcess,
    concurrency: usize,
    limit: usize,
) -> anyhow::Result<RunResult> {
    let output = Command::new(std::env::current_exe()?)
        .args(["fetch", "--transport", transport.name()])
        .args(["--server", &server.ready])
        .arg("--keys")
        .arg(&server.keys)
        .args(["--concurrency", &concurrency.to_string()])
        .args(["--limit", &limit.to_string()])
        .stderr(Stdio::inherit())
        .output()?;
    if !output.status.success() {
        bail!("fetch {} failed: {}", transport.name(), output.status);
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn compare(plan: &Plan) -> anyhow::Result<()> {
    std::fs::create_dir_all(&plan.dir)?;
    let transports = &plan.transports;
    if transports.is_empty() {
        bail!("no transports to compare");
    }
    let mut all = Vec::new();
    for &size in &plan.sizes {
        eprintln!(
            "[peer-transport-bench] {} KiB chunks, {} MiB: starting one server per transport",
            size >> 10,
            plan.total_mib
        );
        let servers = transports
            .iter()
            .map(|&t| start_server(plan, t, size))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Every server holds the same chunks under the same keys.
        let first = std::fs::read(&servers[0].keys)?;
        for s in &servers[1..] {
            if std::fs::read(&s.keys)? != first {
                bail!("the servers hold different chunks");
            }
        }
        let chunks = (plan.total_mib << 20) / size;
        for round in 1..=plan.runs {
            for (concurrency, limit) in [
                (plan.concurrency, chunks),
                (1, plan.serial_chunks.min(chunks)),
            ] {
                for (t, server) in transports.iter().zip(&servers) {
                    let r = run_fetch(*t, server, concurrency, limit)?;
                    eprintln!(
                        "[peer-transport-bench] round {round} {:>13} {:>4} KiB C={:<3} {:.3} GB/s, {:.2} CPU s/GB (fetch {:.2} s, serve {:.2} s), p50 {:.2} ms, p99 {:.2} ms",
                        t.name(),
                        size >> 10,
                        concurrency,
                        r.gbps(),
                        r.cpu_per_gb(),
                        r.fetch_cpu_s,
                        r.serve_cpu_s,
                        r.p50_ms,
                        r.p99_ms
                    );
                    all.push(r);
                }
            }
        }
    }
    if let Some(path) = &plan.csv {
        write_csv(path, &all)?;
    }
    print_tables(plan, &all);
    Ok(())
}

fn write_csv(path: &Path, runs: &[RunResult]) -> anyhow::Result<()> {
    let mut f = std::fs::File::create(path)?;
    writeln!(
        f,
        "transport,chunk_size,concurrency,chunks,bytes,wall_s,fetch_cpu_s,serve_cpu_s,p50_ms,p99_ms"
    )?;
    for r in runs {
        writeln!(
            f,
            "{},{},{},{},{},{:.4},{:.3},{:.3},{:.3},{:.3}",
            r.transport.name(),
            r.chunk_size,
            r.concurrency,
            r.chunks,
            r.bytes,
            r.wall_s,
            r.fetch_cpu_s,
            r.serve_cpu_s,
            r.p50_ms,
            r.p99_ms
        )?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

struct Summary {
    best_gbps: f64,
    median_gbps: f64,
    cpu_per_gb: f64,
    fetch_per_gb: f64,
    serve_per_gb: f64,
    p50_ms: f64,
    p99_ms: f64,
}

fn summarize(runs: &[&RunResult]) -> Summary {
    let per_gb = |f: fn(&RunResult) -> f64| {
        median(runs.iter().map(|r| f(r) / (r.bytes as f64 / 1e9)).collect())
    };
    Summary {
        best_gbps: runs.iter().map(|r| r.gbps()).fold(0.0, f64::max),
        median_gbps: median(runs.iter().map(|r| r.gbps()).collect()),
        cpu_per_gb: median(runs.iter().map(|r| r.cpu_per_gb()).collect()),
        fetch_per_gb: per_gb(|r| r.fetch_cpu_s),
        serve_per_gb: per_gb(|r| r.serve_cpu_s),
        p50_ms: median(runs.iter().map(|r| r.p50_ms).collect()),
        p99_ms: median(runs.iter().map(|r| r.p99_ms).collect()),
    }
}

fn print_tables(plan: &Plan, all: &[RunResult]) {
    println!(
        "{} runs each, interleaved; GB = 10^9 bytes; CPU = user+sys of both processes \
         (fetch + serve); p50/p99 per chunk, median over runs.\n",
        plan.runs
    );
    println!(
        "| transport | chunk | C | chunks | GB/s best | GB/s median | CPU s/GB (fetch + serve) | p50 ms | p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for &size in &plan.sizes {
        for concurrency in [plan.concurrency, 1] {
            let mut row = Vec::new();
            for &t in &plan.transports {
                let runs: Vec<&RunResult> = all
                    .iter()
                    .filter(|r| {
                        r.transport == t && r.chunk_size == size && r.concurrency == concurrency
                    })
                    .collect();
                let Some(first) = runs.first() else { continue };
                let s = summarize(&runs);
                println!(
                    "| {} | {} KiB | {} | {} | {:.2} | {:.2} | {:.2} ({:.2} + {:.2}) | {:.2} | {:.2} |",
                    t.label(),
                    size >> 10,
                    concurrency,
                    first.chunks,
                    s.best_gbps,
                    s.median_gbps,
                    s.cpu_per_gb,
                    s.fetch_per_gb,
                    s.serve_per_gb,
                    s.p50_ms,
                    s.p99_ms
                );
                row.push((t, s));
            }
            ratios.push((size, concurrency, row));
        }
    }
    // Every other transport against the peer tier's HTTP/2 as it is.
    for &t in &plan.transports {
        if t == Transport::Http2 {
            continue;
        }
        println!(
            "\n| {} / HTTP/2 | chunk | C | GB/s (median) | CPU s/GB | p50 | p99 |",
            t.label()
        );
        println!("|---|---|---|---|---|---|---|");
        for (size, c, row) in &ratios {
            let find = |want| row.iter().find(|(t, _)| *t == want).map(|(_, s)| s);
            if let (Some(h), Some(o)) = (find(Transport::Http2), find(t)) {
                println!(
                    "| | {} KiB | {c} | {:.2}× | {:.2}× | {:.2}× | {:.2}× |",
                    size >> 10,
                    o.median_gbps / h.median_gbps,
                    o.cpu_per_gb / h.cpu_per_gb,
                    o.p50_ms / h.p50_ms,
                    o.p99_ms / h.p99_ms
                );
            }
        }
    }
}
