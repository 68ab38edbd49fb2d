//! A fleet on this machine: real `sealed mount` processes (each its own cache dir and peer
//! port) over one S3-compatible server (moto), with the fleet's token. Used by the fleet
//! and fault tests.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sealed_test_support::servers::{Server, free_port, start_moto};

pub const BUCKET: &str = "fleet";
pub const TOKEN: &str = "fleet-test-token-0123456789";

pub fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: FUSE mounts need root and /dev/fuse");
        return false;
    }
    true
}

/// The `sealed` binary, built if needed (it is another crate's binary, so Cargo does not
/// build it for this crate's tests).
pub fn sealed_bin() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--quiet", "-p", "sealed-cli", "--bin", "sealed"])
            .status()
            .expect("cargo build sealed-cli");
        assert!(status.success(), "building sealed failed");
    });
    // target/debug/deps/fleet-… → target/debug/sealed
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("sealed")
}

/// A store (moto) with one version pushed, and a work dir.
pub struct Fleet {
    pub moto: Server,
    pub work: tempfile::TempDir,
    pub digest: String,
    /// The version's files and their contents.
    pub files: Vec<(String, Vec<u8>)>,
    pub token_file: PathBuf,
}

impl Fleet {
    /// A version of `files` pseudo-random files of `mib` MiB each. `None` (with the
    /// reason printed) where FUSE or moto is not available.
    pub fn start(files: usize, mib: usize) -> Option<Fleet> {
        if !can_mount() {
            return None;
        }
        let moto = start_moto(BUCKET, false)?;
        let work = tempfile::tempdir().unwrap();
        let src = work.path().join("model");
        std::fs::create_dir(&src).unwrap();
        let files: Vec<(String, Vec<u8>)> = (0..files)
            .map(|i| {
                let name = format!("model-{i:02}.safetensors");
                let data = sealed_test_support::trees::pseudo_random(mib << 20, 7 + i as u64);
                std::fs::write(src.join(&name), &data).unwrap();
                (name, data)
            })
            .collect();
        let token_file = work.path().join("token");
        std::fs::write(&token_file, TOKEN).unwrap();
        let mut fleet = Fleet {
            moto,
            work,
            digest: String::new(),
            files,
            token_file,
        };
        let out = fleet.sealed().arg("push").arg(&src).output().unwrap();
        assert!(
            out.status.success(),
            "push: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        fleet.digest = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        Some(fleet)
    }

    pub fn version_bytes(&self) -> u64 {
        self.files.iter().map(|(_, d)| d.len() as u64).sum()
    }

    pub fn sealed(&self) -> Command {
        let mut c = Command::new(sealed_bin());
        c.env("SEALED_STORE", format!("s3://{BUCKET}"))
            .env("SEALED_STORE_ENDPOINT", &self.moto.url)
            .env("SEALED_STORE_REGION", "us-east-1")
            // Static credentials, so an s3:// store never asks an instance-metadata service.
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env_remove("SEALED_LOG");
        c
    }

    /// Node `i`: `sealed mount` in the foreground with its own cache and mount dir, serving
    /// peers on `port`, with the membership from `peers` (`--peers` or `--peers-file` args).
    pub fn node(&self, i: usize, port: u16, membership: &[String], extra: &[&str]) -> Node {
        self.node_limited(i, port, membership, extra, None)
    }

    /// [`Fleet::node`] under an open-files limit (soft and hard), as a container runtime
    /// may start it.
    pub fn node_limited(
        &self,
        i: usize,
        port: u16,
        membership: &[String],
        extra: &[&str],
        nofile: Option<u64>,
    ) -> Node {
        let dir = self.work.path().join(format!("node-{i}"));
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let mut command = self.sealed();
        if let Some(limit) = nofile {
            use std::os::unix::process::CommandExt as _;
            // SAFETY: setrlimit is async-signal-safe and touches only the child.
            unsafe {
                command.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: limit,
                        rlim_max: limit,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command
            .args(["-o", "json", "mount", &self.digest])
            .arg(&mnt)
            .arg(format!("--cache-dir={}", dir.join("cache").display()))
            .arg(format!("--peer-listen=127.0.0.1:{port}"))
            .arg(format!("--peer-token-file={}", self.token_file.display()))
            .args(membership)
            .args(extra)
            .env("SEALED_LOG", "sealed_peer=info,warn")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut node = Node {
            child,
            mnt,
            dir,
            port,
            addr: format!("127.0.0.1:{port}"),
        };
        node.wait_mounted();
        node
    }
}

/// `n` free ports and their peer addresses.
pub fn ports(n: usize) -> (Vec<u16>, Vec<String>) {
    let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let addrs = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    (ports, addrs)
}

pub struct Node {
    pub child: Child,
    pub mnt: PathBuf,
    pub dir: PathBuf,
    pub port: u16,
    pub addr: String,
}

impl Node {
    fn wait_mounted(&mut self) {
        let started = Instant::now();
        while !is_mounted(&self.mnt) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("node exited ({status}) before mounting: {}", self.log());
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "not mounted in 30s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// Waits (at most `within`) until the node's last membership change left it with
    /// `members` peers, as its log says (`sealed_peer` logs each change at info).
    pub fn wait_members(&self, members: usize, within: Duration) {
        let want = format!("members={members}");
        let started = Instant::now();
        loop {
            let log = self.log();
            let last = log.lines().rfind(|l| l.contains("peer membership changed"));
            if last.is_some_and(|l| l.contains(&want)) {
                return;
            }
            assert!(
                started.elapsed() < within,
                "node on port {} did not see {members} peers in {within:?}: {log}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM: unmounts and prints the mount's and the peer tier's counters.
    pub fn stop(mut self) -> serde_json::Value {
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let mut out = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "node exited {status}: {}", self.log());
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("node printed no counters ({e}): {out:?}"))
    }

    /// SIGKILL, as a node that dies; its FUSE mount is detached afterwards.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mnt)
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mnt)
            .stderr(Stdio::null())
            .status();
    }
}

pub fn is_mounted(dir: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(dir.to_str().unwrap_or("")))
}

/// Where readers stop until the test lets them go on: before opening file number `at` of the
/// version, each reader waits for [`Gate::open`]. A file boundary, not a byte count: no
/// readahead reaches into a file nobody has opened, so every byte after the gate is fetched
/// with whatever the test changed meanwhile, however fast this machine is.
pub struct Gate {
    at: usize,
    open: std::sync::atomic::AtomicBool,
    waiting: AtomicU64,
}

impl Gate {
    pub fn before_file(at: usize) -> Arc<Gate> {
        Arc::new(Gate {
            at,
            open: std::sync::atomic::AtomicBool::new(false),
            waiting: AtomicU64::new(0),
        })
    }

    /// A gate readers never stop at.
    pub fn none() -> Arc<Gate> {
        Gate::before_file(usize::MAX)
    }

    pub fn open(&self) {
        self.open.store(true, Ordering::Relaxed);
    }

    /// Readers stopped at the gate now.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    fn pass(&self, file: usize) {
        if file < self.at || self.open.load(Ordering::Relaxed) {
            return;
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        while !self.open.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Reads every file of the version through `mnt` in 1 MiB reads, adding to `progress`,
/// sleeping `pause` after each read and stopping at `gate`; returns the files whose bytes
/// differ.
pub fn read_all(
    mnt: &Path,
    files: &[(String, Vec<u8>)],
    progress: &AtomicU64,
    pause: Duration,
    gate: &Gate,
) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    for (i, (name, want)) in files.iter().enumerate() {
        gate.pass(i);
        let mut f =
            std::fs::File::open(mnt.join(name)).unwrap_or_else(|e| panic!("open {name}: {e}"));
        let mut got = Vec::with_capacity(want.len());
        loop {
            let n = f
                .read(&mut buf)
                .unwrap_or_else(|e| panic!("read {name}: {e}"));
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            progress.fetch_add(n as u64, Ordering::Relaxed);
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
        if got != *want {
            wrong.push(name.clone());
        }
    }
    wrong
}

/// Every node in `mnts` reads the whole version at once; returns the shared progress
/// counter and the readers' handles (each: the files it read wrong).
pub fn read_at_once(
    mnts: Vec<PathBuf>,
    files: &Arc<Vec<(String, Vec<u8>)>>,
    pause: Duration,
) -> (Arc<AtomicU64>, Vec<std::thread::JoinHandle<Vec<String>>>) {
    read_at_once_gated(mnts, files, pause, Gate::none())
}

/// [`read_at_once`], the readers stopping at `gate`.
pub fn read_at_once_gated(
    mnts: Vec<PathBuf>,
    files: &Arc<Vec<(String, Vec<u8>)>>,
    pause: Duration,
    gate: Arc<Gate>,
) -> (Arc<AtomicU64>, Vec<std::thread::JoinHandle<Vec<String>>>) {
    let progress = Arc::new(AtomicU64::new(0));
    let handles = mnts
        .into_iter()
        .map(|mnt| {
            let (files, progress, gate) = (files.clone(), progress.clone(), gate.clone());
            std::thread::spawn(move || read_all(&mnt, &files, &progress, pause, &gate))
        })
        .collect();
    (progress, handles)
}

/// Every node reads every file of the fleet's version at once, without pauses, and waits for
/// them: the files each node read wrong, in node order (empty where every byte was right).
pub fn read_everywhere(fleet: &Fleet, nodes: &[Node]) -> Vec<Vec<String>> {
    let files = Arc::new(fleet.files.clone());
    let (_, readers) = read_at_once(
        nodes.iter().map(|n| n.mnt.clone()).collect(),
        &files,
        Duration::ZERO,
    );
    readers
        .into_iter()
        .map(|r| r.join().expect("a reader thread panicked"))
        .collect()
}

pub fn counter(stats: &serde_json::Value, key: &str) -> u64 {
    stats[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {key} in {stats}"))
}

pub fn peer_counter(stats: &serde_json::Value, key: &str) -> u64 {
    counter(&stats["peer"], key)
}
