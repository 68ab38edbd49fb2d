//! The Grafana dashboard and the alert rules of the chart query only series the binaries
//! export: the real `sealed-operator` and `sealed-csi` processes are started (prebuilt, as
//! `cargo build -p sealed-operator -p sealed-csi` leaves them), their `/metrics` scraped, and
//! every `sealed_*` name in an expression of `files/dashboard.json` or `files/alerts.yaml`
//! must be one of them. A panel or alert on a renamed or never-exported series fails here.
//!
//! The operator needs no cluster for this: it serves `/metrics` while it waits for a leader
//! lease on an API server that does not answer. The plugin runs `--standalone`, with its peer
//! tier on (a fleet of one) so that the peer series are exported too.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sealed_test_support::servers::{built_binary, free_port, repo_root};

const FILES: &str = "charts/sealed-volumes/files";

/// A child process killed when the test ends (and the silent API server it talks to).
struct Running {
    child: Child,
    _api: Option<std::net::TcpListener>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /metrics` on 127.0.0.1:`port`, retried until the process serves it (or 20 s pass).
fn scrape(port: u16, child: &mut Child, what: &str) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited ({status}) before serving /metrics");
        }
        if let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)) {
            conn.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(
                conn,
                "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            )?;
            let mut text = String::new();
            conn.read_to_string(&mut text)?;
            if text.starts_with("HTTP/1.1 200") {
                return Ok(text);
            }
        }
        if Instant::now() > deadline {
            bail!("{what} did not serve /metrics on port {port} within 20 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The series names of a text exposition: each `# TYPE` family, with `_bucket`, `_sum` and
/// `_count` for histograms and summaries.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (words.next(), words.next(), words.next(), words.next())
        {
            names.insert(name.to_owned());
            if kind == "histogram" || kind == "summary" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
    names
}

/// Every `sealed_…` identifier in a PromQL expression.
fn queried(expr: &str) -> BTreeSet<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    expr.split(|c: char| !ident(c))
        .filter(|w| w.starts_with("sealed_"))
        .map(str::to_owned)
        .collect()
}

/// The expressions of the dashboard's panels and template variables.
fn dashboard_exprs(path: &Path) -> Result<Vec<String>> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    let mut exprs = Vec::new();
    for panel in json["panels"].as_array().context("no panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(
                target["expr"]
                    .as_str()
                    .context("a target without expr")?
                    .to_owned(),
            );
        }
    }
    for var in json["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = var["query"]["query"].as_str() {
            exprs.push(q.to_owned());
        }
    }
    Ok(exprs)
}

/// The `expr` of every rule in the alert rules file.
fn alert_exprs(path: &Path) -> Result<Vec<String>> {
    let rules: serde_json::Value = serde_saphyr::from_str(&std::fs::read_to_string(path)?)
        .with_context(|| format!("{} is not YAML", path.display()))?;
    let mut exprs = Vec::new();
    for group in rules["groups"].as_array().context("no groups")? {
        for rule in group["rules"].as_array().context("a group without rules")? {
            exprs.push(
                rule["expr"]
                    .as_str()
                    .context("a rule without expr")?
                    .to_owned(),
            );
        }
    }
    Ok(exprs)
}

/// The plugin with its peer tier on (a fleet of one, itself), so the peer series exist too.
fn start_plugin(bin: &Path, dir: &Path, port: u16) -> Result<Running> {
    std::fs::create_dir_all(dir.join("store"))?;
    let token = dir.join("peer-token");
    std::fs::write(&token, "dashboard-test-peer-token-0123456789")?;
    let peer = format!("127.0.0.1:{}", free_port());
    let child = Command::new(bin)
        .arg(format!("--peer-listen={peer}"))
        .arg(format!("--peers={peer}"))
        .arg(format!("--peer-token-file={}", token.display()))
        .arg("--standalone")
        .arg(format!(
            "--endpoint=unix://{}",
            dir.join("csi.sock").display()
        ))
        .arg("--node-id=node-1")
        .arg(format!("--store=file://{}", dir.join("store").display()))
        .arg(format!("--cache-dir={}", dir.join("cache").display()))
        .arg(format!("--state-dir={}", dir.join("state").display()))
        .arg(format!("--metrics-addr=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    Ok(Running { child, _api: None })
}

fn start_operator(bin: &Path, dir: &Path, port: u16) -> Result<Running> {
    std::fs::create_dir_all(dir.join("store"))?;
    // An API server that never answers: the port accepts connections (the kernel's
    // backlog) and no one reads them, so the operator waits on leader election (with nothing
    // listening it would exit at once).
    let kubeconfig = dir.join("kubeconfig");
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let dead = silent.local_addr()?.port();
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \
             'http://127.0.0.1:{dead}'}}}}]\nusers: [{{name: u, user: {{}}}}]\ncontexts: \
             [{{name: x, context: {{cluster: c, user: u}}}}]\ncurrent-context: x\n"
        ),
    )?;
    let child = Command::new(bin)
        .env("KUBECONFIG", &kubeconfig)
        .args([
            "run",
            "--leader-elect",
            "--sync-executor=inline",
            "--gc-interval=0",
        ])
        .arg(format!("--store=file://{}", dir.join("store").display()))
        .arg(format!("--metrics-addr=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    Ok(Running {
        child,
        _api: Some(silent),
    })
}

#[test]
fn the_dashboard_and_alerts_query_only_exported_series() -> Result<()> {
    let files = repo_root().join(FILES);
    let mut wanted: Vec<(String, String)> = Vec::new();
    for (what, exprs) in [
        (
            "dashboard.json",
            dashboard_exprs(&files.join("dashboard.json"))?,
        ),
        ("alerts.yaml", alert_exprs(&files.join("alerts.yaml"))?),
    ] {
        assert!(!exprs.is_empty(), "{what} has no expressions");
        for expr in exprs {
            let names = queried(&expr);
            assert!(
                !names.is_empty(),
                "{what}: {expr:?} queries no sealed_ series"
            );
            wanted.extend(names.into_iter().map(|n| (what.to_owned(), n)));
        }
    }

    let (Some(operator), Some(plugin)) =
        (built_binary("sealed-operator"), built_binary("sealed-csi"))
    else {
        let msg = "sealed-operator or sealed-csi not built (cargo build -p sealed-operator -p sealed-csi)";
        assert!(
            std::env::var("SEALED_REQUIRE_SERVERS").as_deref() != Ok("1"),
            "{msg}"
        );
        eprintln!("the_dashboard_and_alerts_query_only_exported_series: skipped: {msg}");
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let (op_port, csi_port) = (free_port(), free_port());
    let mut op = start_operator(&operator, &dir.path().join("operator"), op_port)?;
    let mut csi = start_plugin(&plugin, &dir.path().join("plugin"), csi_port)?;
    let mut have = exported(&scrape(op_port, &mut op.child, "sealed-operator")?);
    let from_operator = have.len();
    have.extend(exported(&scrape(csi_port, &mut csi.child, "sealed-csi")?));
    assert!(
        from_operator > 5 && have.contains("sealed_csi_build_info"),
        "the scrapes look wrong: {have:?}"
    );
    let missing: Vec<String> = wanted
        .iter()
        .filter(|(_, name)| !have.contains(name))
        .map(|(what, name)| format!("{what}: {name}"))
        .collect();
    assert!(
        missing.is_empty(),
        "series queried but exported by neither binary:\n  {}\nexported: {have:?}",
        missing.join("\n  ")
    );
    eprintln!(
        "the_dashboard_and_alerts_query_only_exported_series: {} queries, {} series exported",
        wanted.len(),
        have.len()
    );
    Ok(())
}

#[test]
fn series_names_are_read_from_expressions_and_expositions() {
    let names = queried(
        r#"sum by (le) (rate(sealed_csi_publish_duration_seconds_bucket{code!="OK"}[5m])) / sealed_x"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["sealed_csi_publish_duration_seconds_bucket", "sealed_x"]
    );
    let have = exported("# HELP h x\n# TYPE h histogram\nh_bucket{le=\"1\"} 0\n# TYPE c counter\n");
    assert!(have.contains("h_count") && have.contains("c") && !have.contains("c_count"));
}
