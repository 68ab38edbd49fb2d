//! Restart safety against the real binaries and real FUSE: a reader keeps reading a published
//! volume while the node plugin is killed (SIGKILL), stopped (SIGTERM, as an upgrade does) and
//! started again, and while the fd holder itself restarts. With `sealed-fd-holder` every read
//! returns the right bytes; without it (the control) reads fail as soon as the plugin dies.

mod common;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{FdHolder, Plugin, can_mount, store_with_version};
use sealed_csi::proto::csi::node_client::NodeClient;
use sealed_csi::proto::csi::{NodeGetVolumeStatsRequest, NodeUnpublishVolumeRequest};

/// What the reader threads saw.
#[derive(Default)]
struct Counters {
    /// Reads that returned the right bytes, the failures, the slowest good read.
    inner: Mutex<(u64, Vec<String>, Duration)>,
}

impl Counters {
    fn ok(&self, took: Duration) {
        let mut g = self.inner.lock().unwrap();
        g.0 += 1;
        g.2 = g.2.max(took);
    }
    fn fail(&self, e: String) {
        self.inner.lock().unwrap().1.push(e);
    }
    fn oks(&self) -> u64 {
        self.inner.lock().unwrap().0
    }
    fn failures(&self) -> Vec<String> {
        self.inner.lock().unwrap().1.clone()
    }
    fn slowest(&self) -> Duration {
        self.inner.lock().unwrap().2
    }
}

/// Reads `file` again and again in a separate process, as a pod would, and checks every
/// byte against `expected`: one line per read on its stdout, `ok SECONDS` or `failed ERROR`.
/// Its pages are dropped from the page cache before each pass, so every pass goes through
/// FUSE. (Threads of this test process would not do: a process that forks while it holds
/// files open on a mount whose server is down hangs in exec, flushing them.)
const READER: &str = r#"
import hashlib, os, sys, time
path, expected = sys.argv[1], sys.argv[2]
while True:
    started = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            h = hashlib.sha256()
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                h.update(b)
        finally:
            os.close(fd)
        if h.hexdigest() == expected:
            print("ok %.3f" % (time.monotonic() - started), flush=True)
        else:
            print("failed: wrong bytes", flush=True)
    except OSError as e:
        print("failed: %s" % e, flush=True)
        time.sleep(0.1)
"#;

struct Reader {
    child: Child,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        let _ = self.child.kill();
        // A reader blocked on a FUSE request that no server will answer (a failed test)
        // cannot die until the connection ends: do not wait for it for ever.
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                if let Some(t) = self.thread.take() {
                    let _ = t.join();
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn spawn_reader(file: PathBuf, expected_sha256: &str, counters: Arc<Counters>) -> Reader {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(READER)
        .arg(&file)
        .arg(expected_sha256)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the python3 reader");
    let stdout = child.stdout.take().expect("reader stdout");
    let thread = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            match line.strip_prefix("ok ") {
                Some(secs) => counters.ok(Duration::from_secs_f64(secs.parse().unwrap_or(0.0))),
                None => counters.fail(line),
            }
        }
    });
    Reader {
        child,
        thread: Some(thread),
    }
}

fn sha256_hex(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a sha256sum line")
        .to_string()
}

fn wait_for_reads(counters: &Counters, at_least: u64, what: &str) {
    let started = Instant::now();
    while counters.oks() < at_least {
        assert!(
            counters.failures().is_empty(),
            "{what}: reads failed: {:?}",
            counters.failures()
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{what}: only {} of {at_least} reads in 60 s",
            counters.oks()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_keep_reading_through_plugin_kill_upgrade_and_holder_restart() {
    if !can_mount() {
        eprintln!("SKIPPED: needs root and /dev/fuse to mount FUSE");
        return;
    }
    let store = store_with_version("restart_with_holder").await;
    let holder_dir = tempfile::tempdir().unwrap();
    let holder_socket = holder_dir.path().join("fd-holder.sock");
    let mut holder = FdHolder::start(&holder_socket);
    let holder_arg = format!("--fd-holder={}", holder_socket.display());
    let metrics_addr = sealed_test_support::servers::free_addr();
    let metrics_arg = format!("--metrics-addr={metrics_addr}");
    let metric = |name: &str| common::sample(&common::http_get(metrics_addr, "/metrics").1, name);
    let args = [holder_arg.as_str(), metrics_arg.as_str()];
    let plugin = Plugin::start(&store.url, &args);
    let targets = [
        plugin.dir.path().join("pods/a/volume"),
        plugin.dir.path().join("pods/b/volume"),
    ];
    let digest = store.digest.to_string();
    let mut client = NodeClient::new(plugin.channel().await);
    for (i, target) in targets.iter().enumerate() {
        client
            .node_publish_volume(common::publish_digest(&format!("vol-{i}"), target, &digest))
            .await
            .expect("publish");
    }
    let held = holder.client().list().expect("list held fds");
    assert_eq!(held.len(), 1, "one FUSE fd per digest: {held:?}");
    assert_eq!(held[0].digest, digest);

    let expected = sha256_hex(&store.source.join("sub/weights.bin"));
    let counters = Arc::new(Counters::default());
    let readers: Vec<Reader> = targets
        .iter()
        .map(|t| spawn_reader(t.join("sub/weights.bin"), &expected, counters.clone()))
        .collect();
    wait_for_reads(&counters, 20, "before any restart");

    // 1. SIGKILL mid-read: nothing runs on the way out.
    let before = counters.oks();
    let home = plugin.crash();
    std::thread::sleep(Duration::from_secs(1));
    let plugin = Plugin::start_in(home, &store.url, &args);
    wait_for_reads(&counters, before + 20, "after SIGKILL and restart");
    let slowest = counters.slowest();
    eprintln!(
        "after SIGKILL: {} reads ok, 0 failed, slowest read {:.2} s (waited for the new plugin)",
        counters.oks(),
        slowest.as_secs_f64()
    );

    assert_eq!(metric("sealed_csi_mounts_resumed_total"), Some(1.0));
    assert_eq!(metric("sealed_csi_published_volumes"), Some(2.0));

    // The restarted plugin knows the targets it did not publish itself.
    let mut client = NodeClient::new(plugin.channel().await);
    for (i, target) in targets.iter().enumerate() {
        let stats = client
            .node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: format!("vol-{i}"),
                volume_path: target.display().to_string(),
                ..Default::default()
            })
            .await
            .expect("stats of a target published before the restart");
        assert!(!stats.into_inner().usage.is_empty());
    }

    // 2. SIGTERM, as an upgrade stops the old plugin: it must leave the mounts in place.
    let before = counters.oks();
    let home = plugin.terminate();
    assert!(
        std::fs::read_to_string(home.path().join("plugin.log"))
            .unwrap_or_default()
            .contains("leaving the FUSE mounts to the fd holder"),
        "a stopping plugin hands its mounts on"
    );
    let plugin = Plugin::start_in(home, &store.url, &args);
    wait_for_reads(&counters, before + 20, "after SIGTERM and restart");

    // 3. The holder restarts while the plugin runs: the plugin gives it the fds again
    // (every 10 s), and the next plugin crash is survived as before.
    drop(holder);
    holder = FdHolder::start(&holder_socket);
    let started = Instant::now();
    while holder.client().list().expect("list").is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the plugin did not put its fds with the new holder"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The gauge is set just after the put, so give it a moment.
    while metric("sealed_csi_mounts_unprotected") != Some(0.0) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "sealed_csi_mounts_unprotected is {:?}",
            metric("sealed_csi_mounts_unprotected")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = counters.oks();
    let home = plugin.crash();
    let plugin = Plugin::start_in(home, &store.url, &args);
    wait_for_reads(
        &counters,
        before + 20,
        "after a holder restart and a plugin crash",
    );

    drop(readers);
    assert!(counters.failures().is_empty(), "{:?}", counters.failures());

    // Unpublishing through the resumed plugin takes everything down and frees the fd.
    let mut client = NodeClient::new(plugin.channel().await);
    for (i, target) in targets.iter().enumerate() {
        client
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: format!("vol-{i}"),
                target_path: target.display().to_string(),
            })
            .await
            .expect("unpublish");
        assert!(!sealed_csi::mounts::is_mount_point(target));
    }
    let mount_dir = plugin
        .dir
        .path()
        .join("state/mounts")
        .join(store.digest.hex());
    assert!(!sealed_csi::mounts::is_mount_point(&mount_dir));
    assert!(
        holder.client().list().expect("list").is_empty(),
        "the holder let go of the fd"
    );
    eprintln!(
        "{} reads ok through SIGKILL, SIGTERM and a holder restart; none failed",
        counters.oks()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_holder_a_plugin_crash_breaks_running_reads() {
    if !can_mount() {
        eprintln!("SKIPPED: needs root and /dev/fuse to mount FUSE");
        return;
    }
    // The control for the test above: the same reader fails when nobody keeps the fd.
    let store = store_with_version("restart_without_holder").await;
    let plugin = Plugin::start(&store.url, &[]);
    let target = plugin.dir.path().join("pods/a/volume");
    let mut client = NodeClient::new(plugin.channel().await);
    client
        .node_publish_volume(common::publish_digest(
            "vol",
            &target,
            &store.digest.to_string(),
        ))
        .await
        .expect("publish");
    let expected = sha256_hex(&store.source.join("sub/weights.bin"));
    let counters = Arc::new(Counters::default());
    let reader = spawn_reader(target.join("sub/weights.bin"), &expected, counters.clone());
    wait_for_reads(&counters, 5, "before the crash");
    let home = plugin.crash();
    let started = Instant::now();
    while counters.failures().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "reads went on without a server: the control does not control"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(reader);
    let failures = counters.failures();
    assert!(
        // ENOTCONN "Transport endpoint is not connected" or, for a request in flight,
        // ECONNABORTED "Software caused connection abort".
        failures[0].contains("not connected") || failures[0].contains("connection abort"),
        "reads of a mount whose server died fail with ENOTCONN/ECONNABORTED: {failures:?}"
    );
    // The restarted plugin detaches the dead mount, as before.
    let plugin = Plugin::start_in(home, &store.url, &[]);
    drop(plugin);
}

/// Holds `path` open (one `open`, never closed) and, for each line on its stdin, reads the
/// whole file through that one descriptor and prints its SHA-256 (or `failed: ERROR`).
const HOLDER: &str = r#"
import hashlib, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
for _ in sys.stdin:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        h = hashlib.sha256()
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            h.update(b)
        print(h.hexdigest(), flush=True)
    except OSError as e:
        print("failed: %s" % e, flush=True)
"#;

/// A process that keeps one file of the mount open across restarts (see [`HOLDER`]).
struct OpenFile {
    child: Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl OpenFile {
    fn open(path: &Path) -> OpenFile {
        let mut child = Command::new("python3")
            .args(["-c", HOLDER])
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start python3");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = std::io::BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok);
        assert_eq!(first.as_deref(), Some("open"), "the file did not open");
        OpenFile { child, lines }
    }

    /// The SHA-256 of the whole file, read through the descriptor opened at the start.
    fn read_all(&mut self) -> String {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin).expect("ask for a read");
        stdin.flush().expect("flush");
        self.lines
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| "failed: the holder died".into())
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        // Its exit flushes the file, which waits for a server: after a failed test there
        // may be none until the fd holder goes, so do not wait for ever.
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline && !matches!(self.child.try_wait(), Ok(Some(_))) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The lines of the plugin's io mode record for `digest`: `p INO ID` for an inode in
/// passthrough, `c INO` for a daemon-served one.
fn io_modes(home: &Path, digest: &str) -> Vec<String> {
    let hex = digest.trim_start_matches("blake3:");
    std::fs::read_to_string(home.join("state/io-modes").join(hex))
        .unwrap_or_default()
        .lines()
        .skip(1)
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_open_by_passthrough_through_a_crash_can_be_opened_again() {
    if !can_mount() {
        eprintln!("SKIPPED: needs root and /dev/fuse to mount FUSE");
        return;
    }
    // The kernel holds an inode open by passthrough to one backing id and fails (EIO) any
    // other open of it that does not name the same id. A pod keeps its descriptor through
    // a plugin crash; the next plugin must answer new opens with the old plugin's id.
    let store = store_with_version("restart_passthrough").await;
    let holder_dir = tempfile::tempdir().unwrap();
    let holder_socket = holder_dir.path().join("fd-holder.sock");
    let _holder = FdHolder::start(&holder_socket);
    let holder_arg = format!("--fd-holder={}", holder_socket.display());
    let plugin = Plugin::start(&store.url, &[holder_arg.as_str()]);
    let target = plugin.dir.path().join("pods/a/volume");
    let digest = store.digest.to_string();
    let mut client = NodeClient::new(plugin.channel().await);
    client
        .node_publish_volume(common::publish_digest("vol", &target, &digest))
        .await
        .expect("publish");
    let file = target.join("sub/weights.bin");
    let expected = sha256_hex(&store.source.join("sub/weights.bin"));

    // Read until the file is hydrated, then hold it open until its inode is in passthrough.
    let started = Instant::now();
    let mut held = loop {
        assert_eq!(sha256_hex(&file), expected);
        let held = OpenFile::open(&file);
        if io_modes(plugin.dir.path(), &digest)
            .iter()
            .any(|l| l.starts_with("p "))
        {
            break held;
        }
        drop(held);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the file was never opened by passthrough: {:?}\n{}",
            io_modes(plugin.dir.path(), &digest),
            plugin.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let recorded = io_modes(plugin.dir.path(), &digest);

    let home = plugin.crash();
    let plugin = Plugin::start_in(home, &store.url, &[holder_arg.as_str()]);
    // Reads of the held descriptor wait for the new plugin, or need none (passthrough).
    assert_eq!(
        held.read_all(),
        expected,
        "the descriptor held through the crash"
    );
    // A new open of the inode: EIO if the new plugin registered a backing id of its own.
    let started = Instant::now();
    let fresh = loop {
        match std::fs::read(&file) {
            Ok(bytes) => break bytes,
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                // The new plugin is still starting.
                assert!(started.elapsed() < Duration::from_secs(30), "{e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!(
                "opening the file again after the crash: {e}\n{}",
                plugin.log()
            ),
        }
    };
    assert_eq!(
        fresh,
        std::fs::read(store.source.join("sub/weights.bin")).unwrap()
    );
    assert!(
        plugin
            .log()
            .contains("inherited the previous server's io modes"),
        "{}",
        plugin.log()
    );
    assert_eq!(
        io_modes(plugin.dir.path(), &digest),
        recorded,
        "the inode keeps its mode and backing id"
    );
    assert_eq!(held.read_all(), expected);
    drop(held);

    // Unpublishing takes the mount down and its record with it.
    let mut client = NodeClient::new(plugin.channel().await);
    client
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "vol".into(),
            target_path: target.display().to_string(),
        })
        .await
        .expect("unpublish");
    assert!(io_modes(plugin.dir.path(), &digest).is_empty());
}
