//! The node plugin while the store hangs (moto behind a proxy that stops answering, see
//! `common::outage`), with real FUSE, the real plugin and fd-holder binaries:
//!
//! - a plugin restarted while the store is down serves at once (socket, `/healthz`),
//!   resumes its held mount from the manifest it kept, reads of cached data go on, a read
//!   that needs the store fails (EIO) within the fetch bound instead of hanging, and the
//!   mount survives a second restart and works fully once the store is back;
//! - an unpublish never waits behind a publish stuck on the store.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::outage::StoreProxy;
use common::servers::{Server, start_moto};
use common::{FdHolder, Plugin, can_mount};
use sealed_csi::proto::csi::NodeUnpublishVolumeRequest;
use sealed_csi::proto::csi::node_client::NodeClient;
use sealed_store::push::{PushOptions, push};
use sealed_store::{ChunkStore, Digest, NoProgress, StoreOptions};

const BUCKET: &str = "sealed";

/// Per-attempt store timeout and retries the plugins run with: a read that needs the store
/// fails after about 2 × 2 s (plus a short backoff).
const STORE_TIMEOUT_S: u64 = 2;
const STORE_RETRIES: u32 = 1;

/// Bytes nobody else has: `seed` makes each file's chunks its own.
fn bytes(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// A version with a file the test reads before the outage and one it does not, pushed to
/// moto's bucket (directly, not through the proxy).
async fn push_version(moto: &Server, dir: &Path, name: &str, seed: u32) -> Digest {
    let tree = dir.join(format!("tree-{name}"));
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("config.json"), format!(r#"{{"model":"{name}"}}"#)).unwrap();
    std::fs::write(tree.join("read.bin"), bytes(2_000_000, seed)).unwrap();
    std::fs::write(
        tree.join("unread.bin"),
        bytes(2_000_000, seed ^ 0x5555_5555),
    )
    .unwrap();
    // SAFETY: set before any store in this process reads the environment; every test sets
    // the same values (moto accepts any).
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
    }
    let options = StoreOptions {
        endpoint: Some(moto.url.clone()),
        region: Some("us-east-1".into()),
        ..StoreOptions::default()
    };
    let store = ChunkStore::open(&format!("s3://{BUCKET}"), &options)
        .await
        .unwrap();
    let report = push(&store, &tree, &PushOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    report.digest
}

fn store_args(proxy: &StoreProxy) -> Vec<String> {
    vec![
        format!("--store-endpoint={}", proxy.endpoint()),
        "--store-region=us-east-1".into(),
        format!("--store-timeout={STORE_TIMEOUT_S}"),
        format!("--store-retries={STORE_RETRIES}"),
    ]
}

/// What every test here starts from: moto, a proxy in front of it that can stop answering,
/// a work dir, and the plugin's store flags. `None` (with the reason printed) where FUSE or
/// moto is not available.
struct Outage {
    moto: Server,
    proxy: StoreProxy,
    work: tempfile::TempDir,
    args: Vec<String>,
}

impl Outage {
    fn start() -> Option<Outage> {
        if !can_mount() {
            eprintln!("SKIPPED: needs root and /dev/fuse to mount FUSE");
            return None;
        }
        let moto = start_moto(BUCKET, false)?;
        let proxy = StoreProxy::start(moto.port);
        let args = store_args(&proxy);
        Some(Outage {
            moto,
            proxy,
            work: tempfile::tempdir().unwrap(),
            args,
        })
    }

    async fn version(&self, name: &str, seed: u32) -> Digest {
        push_version(&self.moto, self.work.path(), name, seed).await
    }

    /// An fd holder in the work dir, and the plugin flag that points at it.
    fn holder(&mut self) -> FdHolder {
        let holder = FdHolder::start(&self.work.path().join("fd-holder.sock"));
        self.args
            .push(format!("--fd-holder={}", holder.socket.display()));
        holder
    }

    fn plugin(&self) -> Plugin {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        Plugin::start(&format!("s3://{BUCKET}"), &args)
    }

    fn restart(&self, plugin: Plugin) -> Plugin {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        Plugin::start_in(plugin.crash(), &format!("s3://{BUCKET}"), &args)
    }
}

async fn publish(plugin: &Plugin, volume_id: &str, target: &Path, digest: &Digest) {
    NodeClient::new(plugin.channel().await)
        .node_publish_volume(common::publish_digest(
            volume_id,
            target,
            &digest.to_string(),
        ))
        .await
        .unwrap_or_else(|e| panic!("publish {volume_id}: {e:?}"));
}

async fn unpublish(plugin: &Plugin, volume_id: &str, target: &Path) {
    NodeClient::new(plugin.channel().await)
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: volume_id.into(),
            target_path: target.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("unpublish {volume_id}: {e:?}"));
    assert!(!sealed_csi::mounts::is_mount_point(target));
}

/// Reads `path` in a child process (its pages dropped first, so the read goes through
/// FUSE): its SHA-256, or the error; SIGKILLed after `limit` (reported as a hang).
fn read_file(path: &Path, limit: Duration) -> Result<String, String> {
    const READ: &str = r#"
import hashlib, os, sys
h = hashlib.sha256()
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        h.update(b)
except OSError as e:
    print("error: %s" % e)
    sys.exit(1)
print(h.hexdigest())
"#;
    let out = Command::new("timeout")
        .args(["-s", "KILL", &format!("{}", limit.as_secs())])
        .arg("python3")
        .arg("-c")
        .arg(READ)
        .arg(path)
        .output()
        .expect("run python3");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match out.status.code() {
        Some(0) => Ok(text),
        Some(1) => Err(text),
        _ => Err(format!(
            "hung: killed after {} s ({})",
            limit.as_secs(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

fn sha256(data: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, data).unwrap();
    let out = Command::new("sha256sum").arg(&path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `/healthz` answers 200 within `limit` of `since`: how long it took.
fn healthy_within(addr: std::net::SocketAddr, since: Instant, limit: Duration) -> Duration {
    loop {
        let (status, body) = common::http_get(addr, "/healthz");
        if status == 200 {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < limit,
            "/healthz not healthy {limit:?} after the start: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_while_the_store_hangs_resumes_held_mounts_and_bounds_reads() {
    let Some(mut outage) = Outage::start() else {
        return;
    };
    let digest = outage.version("restart-outage", 7).await;
    let holder = outage.holder();
    let metrics_addr = sealed_test_support::servers::free_addr();
    outage.args.push(format!("--metrics-addr={metrics_addr}"));
    let (proxy, work) = (&outage.proxy, &outage.work);
    let plugin = outage.plugin();
    let target = plugin.pods().join("a/volume");
    publish(&plugin, "vol", &target, &digest).await;
    let tree = work.path().join("tree-restart-outage");
    let read_sha = sha256(&std::fs::read(tree.join("read.bin")).unwrap());
    let unread_sha = sha256(&std::fs::read(tree.join("unread.bin")).unwrap());
    assert_eq!(
        read_file(&target.join("read.bin"), Duration::from_secs(30)).as_deref(),
        Ok(read_sha.as_str())
    );
    // The chunks just read reach the node disk cache off the readers' path.
    std::thread::sleep(Duration::from_secs(2));

    // The store hangs, and the plugin dies: twice.
    proxy.down();
    let mut plugin = plugin;
    for round in 1..=2 {
        let started = Instant::now();
        plugin = outage.restart(plugin);
        let socket_in = started.elapsed();
        let healthy_in = healthy_within(metrics_addr, started, Duration::from_secs(10));
        eprintln!("restart {round}: socket after {socket_in:?}, /healthz 200 after {healthy_in:?}");

        // Cached data: read through the resumed mount without the store.
        let read = read_file(&target.join("read.bin"), Duration::from_secs(20));
        assert_eq!(
            read.as_deref(),
            Ok(read_sha.as_str()),
            "restart {round}: cached data through the resumed mount; log:\n{}",
            plugin.log()
        );
        // Data only the store has: an error within the fetch bound, not a hang.
        let asked = Instant::now();
        let unread = read_file(&target.join("unread.bin"), Duration::from_secs(20));
        let took = asked.elapsed();
        let error = unread.expect_err("a read that needs a hanging store cannot succeed");
        assert!(
            error.contains("Input/output error"),
            "restart {round}: EIO, not {error:?}; log:\n{}",
            plugin.log()
        );
        assert!(
            took < Duration::from_secs(15),
            "restart {round}: the failing read took {took:?}"
        );
        eprintln!("restart {round}: uncached read failed after {took:?}: {error}");
    }
    let page = common::http_get(metrics_addr, "/metrics").1;
    assert_eq!(
        common::sample(&page, "sealed_csi_mounts_resumed_total"),
        Some(1.0),
        "the second restart resumed the mount too"
    );
    assert_eq!(
        common::sample(&page, "sealed_csi_published_volumes"),
        Some(1.0)
    );

    // The store is back: the same mount serves everything, nothing stays broken.
    proxy.up();
    let started = Instant::now();
    loop {
        match read_file(&target.join("unread.bin"), Duration::from_secs(20)) {
            Ok(sha) => {
                assert_eq!(sha, unread_sha);
                break;
            }
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(30),
                "reads still fail 30 s after the store came back: {e}"
            ),
        }
    }
    unpublish(&plugin, "vol", &target).await;
    assert!(holder.client().list().expect("list").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_does_not_wait_for_a_publish_stuck_on_the_store() {
    let Some(outage) = Outage::start() else {
        return;
    };
    let a = outage.version("lock-a", 11).await;
    let b = outage.version("lock-b", 13).await;
    let plugin = outage.plugin();
    let target_a = plugin.pods().join("a/volume");
    let target_b = plugin.pods().join("b/volume");
    publish(&plugin, "vol-a", &target_a, &a).await;
    let mut client = NodeClient::new(plugin.channel().await);

    outage.proxy.down();
    let mut stuck_client = NodeClient::new(plugin.channel().await);
    let request = common::publish_digest("vol-b", &target_b, &b.to_string());
    let stuck = tokio::spawn(async move {
        let result = stuck_client.node_publish_volume(request).await;
        (result, Instant::now())
    });
    // The publish of B is in the plugin, waiting for the store.
    let started = Instant::now();
    while !plugin.log().contains("volume_id=vol-b") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "publish B never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!stuck.is_finished(), "publish B did not wait for the store");

    let asked = Instant::now();
    client
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "vol-a".into(),
            target_path: target_a.display().to_string(),
        })
        .await
        .expect("unpublish A");
    let unpublished = Instant::now();
    let took = unpublished - asked;
    assert!(!sealed_csi::mounts::is_mount_point(&target_a));

    let (result, publish_done) = stuck.await.unwrap();
    let status = result.expect_err("publish B cannot succeed while the store hangs");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    eprintln!(
        "unpublish A took {took:?}; publish B failed {:?} after it: {}",
        publish_done.saturating_duration_since(unpublished),
        status.message()
    );
    assert!(
        unpublished < publish_done,
        "unpublish A finished only after the stuck publish of B gave up ({took:?})"
    );
    assert!(took < Duration::from_secs(2), "unpublish A took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_mount_that_cannot_be_resumed_fails_its_readers_instead_of_hanging() {
    let Some(mut outage) = Outage::start() else {
        return;
    };
    let digest = outage.version("give-up", 17).await;
    let holder = outage.holder();
    outage.args.push("--resume-deadline=3".into());
    let plugin = outage.plugin();
    let target = plugin.pods().join("a/volume");
    publish(&plugin, "vol", &target, &digest).await;
    assert!(read_file(&target.join("read.bin"), Duration::from_secs(30)).is_ok());

    // A restart with the store down and no kept manifest (a mount made by an older plugin):
    // nothing can serve the mount, so its readers must get an error after the deadline.
    outage.proxy.down();
    let home = plugin.crash();
    for entry in std::fs::read_dir(home.path().join("state/manifests")).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    let args: Vec<&str> = outage.args.iter().map(String::as_str).collect();
    let plugin = Plugin::start_in(home, &format!("s3://{BUCKET}"), &args);
    let asked = Instant::now();
    let read = read_file(&target.join("read.bin"), Duration::from_secs(30));
    let took = asked.elapsed();
    let error = read.expect_err("nothing serves the mount");
    assert!(
        (error.contains("not connected") || error.contains("connection abort"))
            && took < Duration::from_secs(20),
        "the reader of an abandoned mount got {error:?} after {took:?}; log:\n{}",
        plugin.log()
    );
    eprintln!("reader of the abandoned mount: {error} after {took:?}");
    assert!(
        holder.client().list().expect("list").is_empty(),
        "the holder let go of the abandoned mount's fd"
    );
    // Its target still unpublishes.
    unpublish(&plugin, "vol", &target).await;
}
