//! Warming new versions (`spec.warm.nodes` of a SealedVolume, copied by the operator onto
//! each new SealedVolumeVersion as the `sealedvolumes.io/warm-nodes` annotation): the plugin
//! watches SealedVolumeVersions, and for one asking for N warm nodes fetches the whole
//! version into its disk cache if its own node is among the top N of the live membership by
//! rendezvous hashing of the version's digest (`sealed_peer::Ring::top`, the peer ring's
//! hashing). Without the peer tier the membership is this node alone.
//!
//! Warming is work one tenant causes on nodes it may not run on, so it is bounded
//! ([`WarmSettings`]): off unless the admin allows the version's namespace
//! (`sealed_crds::warming`, checked here whoever set the annotation; a refusal is an Event
//! `WarmNotAllowed` on the version); at most a share of the disk cache per version; never
//! evicting an entry used within a recent window (`NodeCache::warm_chunk`: a cache full of
//! recently used data ends the warm early, said in its Event); paced to a byte rate per node.
//! Chunks come verified from the origin, a few at once. Not through the peer tier: a chunk's
//! owner keeps what it serves, so warming N nodes would fill other nodes' caches too.
//! Once per digest per node: a version warmed (or found warm) is recorded in the plugin's
//! state directory, and a restarted plugin does not warm it again (nor records a second
//! Event), even if its chunks were evicted since. Only versions the operator made (as for a
//! mount) are warmed. See `docs/peer.md`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, EventSource, Namespace, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use prometheus::IntCounter;
use sealed_crds::SealedVolumeVersion;
use sealed_crds::warming::WarmingPolicy;
use sealed_mount::{MountLimits, NodeCache};
use sealed_peer::{Ring, RingView};
use sealed_store::{ChunkRef, ChunkStore, Digest, Manifest};

use crate::driver::Driver;
use crate::kube_access::KubeAccess;

/// Chunk fetches one warming has in flight (readers keep the rest of the fetch slots).
pub const WARM_CONCURRENCY: usize = 8;
/// A warming that failed is tried again after this long (or when the membership changes).
const RETRY_AFTER: Duration = Duration::from_secs(300);

/// The admin's bounds on warming (`--warming*`, `--warm-*`; chart `warming.*`).
#[derive(Clone, Debug)]
pub struct WarmSettings {
    /// Which namespaces' versions may be warmed.
    pub policy: WarmingPolicy,
    /// Percent of the disk cache one version may take (1 to 100).
    pub cache_share: u8,
    /// A warm evicts no cache entry used within this long.
    pub spare_recent: Duration,
    /// Bytes per second all warming on this node fetches together; 0: no bound.
    pub rate: u64,
}

impl Default for WarmSettings {
    fn default() -> Self {
        WarmSettings {
            policy: WarmingPolicy::Off,
            cache_share: 25,
            spare_recent: Duration::from_secs(3600),
            rate: 32 << 20,
        }
    }
}

impl WarmSettings {
    /// The bytes one version may take of a disk cache of `disk_bytes`.
    pub fn budget(&self, disk_bytes: u64) -> u64 {
        let share = u64::from(self.cache_share.clamp(1, 100));
        // Divided first: no overflow, and a few bytes under is fine.
        (disk_bytes / 100).saturating_mul(share)
    }
}

/// How this node warms.
#[derive(Clone)]
pub struct WarmConfig {
    pub cache: NodeCache,
    /// The disk cache's bound (`--cache-size`).
    pub disk_bytes: u64,
    pub settings: WarmSettings,
    /// Where warmed digests are recorded (one empty file each), so that a restart does not
    /// warm them again; `None`: remembered in memory only.
    pub record_dir: Option<PathBuf>,
    pub limits: MountLimits,
    /// This node's name in the membership: its peer address, or the node name alone.
    pub me: String,
    /// The live membership (the peer tier's); `None`: this node alone.
    pub ring: Option<RingView>,
}

/// `sealed_warm_*` counters.
#[derive(Clone)]
pub struct WarmMetrics {
    pub versions: IntCounter,
    pub bytes: IntCounter,
    pub failures: IntCounter,
    pub refused: IntCounter,
    pub stopped: IntCounter,
}

impl WarmMetrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        Ok(WarmMetrics {
            versions: IntCounter::new(
                "sealed_warm_versions_total",
                "Versions this node warmed into its disk cache (spec.warm of their volume)",
            )?,
            bytes: IntCounter::new(
                "sealed_warm_bytes_total",
                "Chunk bytes fetched into the disk cache by warming",
            )?,
            failures: IntCounter::new(
                "sealed_warm_failures_total",
                "Warmings that failed (store or peers unreachable, manifest refused)",
            )?,
            refused: IntCounter::new(
                "sealed_warm_refused_total",
                "Versions not warmed because the admin does not allow their namespace to warm",
            )?,
            stopped: IntCounter::new(
                "sealed_warm_stopped_total",
                "Warmings ended early: the rest of the disk cache was used recently by others",
            )?,
        })
    }

    pub fn register(&self, driver: &Driver) -> Result<(), prometheus::Error> {
        for c in [
            &self.versions,
            &self.bytes,
            &self.failures,
            &self.refused,
            &self.stopped,
        ] {
            driver.metrics().register(Box::new(c.clone()))?;
        }
        Ok(())
    }
}

/// Whether `me` is among the `n` members `ring` picks for `digest`. An empty ring (the
/// peer tier's membership not listed yet) picks nobody.
pub fn selected(ring: &Ring, digest: &Digest, n: u32, me: &str) -> bool {
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    ring.picks(digest, n, me)
}

/// The unique chunks of `manifest` in order, cut where the next would take them over
/// `budget` bytes, and whether it was cut.
pub fn within_budget(manifest: &Manifest, budget: u64) -> (Vec<ChunkRef>, bool) {
    let mut total = 0u64;
    let mut out = Vec::new();
    for c in manifest.unique_chunks() {
        match total.checked_add(u64::from(c.len)) {
            Some(t) if t <= budget => {
                total = t;
                out.push(c);
            }
            _ => return (out, true),
        }
    }
    (out, false)
}

/// A version that asks to be warmed.
#[derive(Clone)]
struct Want {
    nodes: u32,
    /// The version it was asked by (the Event goes there).
    version: Arc<SealedVolumeVersion>,
}

/// Starts warming with `config` (the plugin builds it from its flags): the metrics
/// registered, then [`spawn`].
pub fn start(
    kube: &Arc<KubeAccess>,
    driver: &Arc<Driver>,
    config: WarmConfig,
) -> anyhow::Result<()> {
    let metrics = WarmMetrics::new()?;
    metrics.register(driver)?;
    tracing::info!(node = %config.me, settings = ?config.settings,
        "warming versions whose volume sets spec.warm, as far as the admin allows");
    spawn(kube.clone(), driver.clone(), config, metrics);
    Ok(())
}

/// Watches SealedVolumeVersions and warms the ones that pick this node, until the process
/// ends.
pub fn spawn(
    kube: Arc<KubeAccess>,
    driver: Arc<Driver>,
    config: WarmConfig,
    metrics: WarmMetrics,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let done = config
            .record_dir
            .as_deref()
            .map(read_records)
            .unwrap_or_default();
        tracing::info!(
            versions = done.len(),
            "versions recorded as warmed here: not warmed again"
        );
        Warmer {
            kube,
            driver,
            pace: Pace::new(config.settings.rate),
            config,
            metrics,
            wants: BTreeMap::new(),
            done,
            failed: HashMap::new(),
            refused: HashSet::new(),
        }
        .run()
        .await;
    })
}

struct Warmer {
    kube: Arc<KubeAccess>,
    driver: Arc<Driver>,
    config: WarmConfig,
    metrics: WarmMetrics,
    /// By digest: the latest version asking for it, for this watch's view.
    wants: BTreeMap<Digest, Want>,
    /// Digests warmed (or found warm) here, this run or before a restart.
    done: HashSet<Digest>,
    /// Digests whose warming failed, and when.
    failed: HashMap<Digest, Instant>,
    /// Versions (namespace/name) refused by the policy and told so.
    refused: HashSet<String>,
    /// The node's warm egress bound.
    pace: Pace,
}

impl Warmer {
    async fn run(mut self) {
        let api: Api<SealedVolumeVersion> = Api::all(self.kube.client().clone());
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        let mut ring = self.config.ring.clone();
        let mut tick = tokio::time::interval(Duration::from_secs(60));
        let mut pending: BTreeMap<Digest, Want> = BTreeMap::new();
        loop {
            tokio::select! {
                event = events.next() => {
                    use watcher::Event as E;
                    match event {
                        None => return,
                        Some(Ok(E::Init)) => pending.clear(),
                        Some(Ok(E::InitApply(v))) => add(&mut pending, v),
                        Some(Ok(E::InitDone)) => self.wants = std::mem::take(&mut pending),
                        Some(Ok(E::Apply(v))) => {
                            // A changed version (its attestation written) is looked at again now.
                            if let Ok(d) = Digest::parse(&v.spec.digest) {
                                self.failed.remove(&d);
                            }
                            add(&mut self.wants, v);
                        }
                        Some(Ok(E::Delete(v))) => {
                            if let Ok(d) = Digest::parse(&v.spec.digest) {
                                self.wants.remove(&d);
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "watching SealedVolumeVersions to warm");
                            continue;
                        }
                    }
                }
                changed = async {
                    match ring.as_mut() {
                        Some(r) => r.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    if !changed {
                        ring = None;
                    }
                }
                _ = tick.tick() => {}
            }
            self.warm_selected().await;
        }
    }

    fn ring(&self) -> Arc<Ring> {
        match &self.config.ring {
            Some(view) => view.borrow().clone(),
            None => Arc::new(Ring::new([self.config.me.clone()], 1)),
        }
    }

    /// Warms, one after the other, every wanted version that picks this node and is not warm.
    async fn warm_selected(&mut self) {
        let ring = self.ring();
        let todo: Vec<(Digest, Want)> = self
            .wants
            .iter()
            .filter(|(d, w)| {
                !self.done.contains(d)
                    && self
                        .failed
                        .get(d)
                        .is_none_or(|t| t.elapsed() >= RETRY_AFTER)
                    && selected(&ring, d, w.nodes, &self.config.me)
            })
            .map(|(d, w)| (*d, w.clone()))
            .collect();
        for (digest, want) in todo {
            if let Err(why) = self.allowed(&want.version).await {
                let key = format!(
                    "{}/{}",
                    want.version.namespace().unwrap_or_default(),
                    want.version.name_any()
                );
                // Looked at again after the retry delay (the namespace may be labelled since);
                // told once per version.
                self.failed.insert(digest, Instant::now());
                if self.refused.insert(key) {
                    self.metrics.refused.inc();
                    tracing::info!(%digest, version = %want.version.name_any(), "not warming: {why}");
                    let message = format!(
                        "not warming {digest} on node {}: {why}",
                        self.kube.node_name()
                    );
                    self.event(&want.version, "Warning", "WarmNotAllowed", message)
                        .await;
                }
                continue;
            }
            if !self.kube.made_by_operator(&want.version).await {
                tracing::info!(%digest, version = %want.version.name_any(),
                    "not warming a version the operator did not make (yet)");
                // Its attestation may still come (a status update looks again at once).
                self.failed.insert(digest, Instant::now());
                continue;
            }
            let started = Instant::now();
            match self.warm(&digest).await {
                Ok(None) => {
                    tracing::info!(%digest, "version already warm in the disk cache");
                    self.record(digest);
                }
                Ok(Some(warmed)) => {
                    self.record(digest);
                    self.failed.remove(&digest);
                    self.metrics.versions.inc();
                    let seconds = started.elapsed().as_secs_f64();
                    let mut message = format!(
                        "warmed {digest} on node {}: {} bytes fetched in {seconds:.1} s ({} chunks)",
                        self.kube.node_name(),
                        warmed.bytes,
                        warmed.chunks
                    );
                    if warmed.cut {
                        message.push_str(&format!(
                            "; the version is larger than its share of the disk cache ({} of {} bytes): only what fits was warmed",
                            self.config.settings.budget(self.config.disk_bytes),
                            self.config.disk_bytes
                        ));
                    }
                    if warmed.stopped {
                        self.metrics.stopped.inc();
                        message.push_str(&format!(
                            "; stopped early: the rest of the disk cache was used within the last {} s by others, and warming evicts none of it",
                            self.config.settings.spare_recent.as_secs()
                        ));
                    }
                    tracing::info!(%digest, bytes = warmed.bytes, seconds, cut = warmed.cut, "warmed");
                    self.event(&want.version, "Normal", "Warmed", message).await;
                }
                Err(e) => {
                    self.failed.insert(digest, Instant::now());
                    self.metrics.failures.inc();
                    tracing::warn!(%digest, error = %e, "warming failed");
                    let message = format!(
                        "warming {digest} on node {} failed: {e}",
                        self.kube.node_name()
                    );
                    self.event(&want.version, "Warning", "WarmFailed", message)
                        .await;
                }
            }
        }
    }

    async fn warm(&self, digest: &Digest) -> anyhow::Result<Option<Warmed>> {
        let store = self.driver.store().await?;
        warm_version(&self.config, &store, digest, &self.pace, &self.metrics).await
    }

    /// An Event on the version. Best effort: a failure is logged.
    async fn event(&self, v: &SealedVolumeVersion, type_: &str, reason: &str, message: String) {
        let namespace = v.namespace().unwrap_or_default();
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", v.name_any())),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some(sealed_crds::API_VERSION.into()),
                kind: Some("SealedVolumeVersion".into()),
                namespace: Some(namespace.clone()),
                name: Some(v.name_any()),
                uid: v.metadata.uid.clone(),
                ..ObjectReference::default()
            },
            reason: Some(reason.into()),
            message: Some(message),
            type_: Some(type_.into()),
            source: Some(EventSource {
                component: Some("sealed-csi".into()),
                host: Some(self.kube.node_name().to_owned()),
            }),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            ..Event::default()
        };
        if let Err(e) = Api::<Event>::namespaced(self.kube.client().clone(), &namespace)
            .create(&PostParams::default(), &event)
            .await
        {
            tracing::warn!(error = %e, version = %v.name_any(), reason, "cannot record an event on the version");
        }
    }
}

/// What a warm fetched.
#[derive(Debug, Default)]
pub struct Warmed {
    pub chunks: u64,
    pub bytes: u64,
    /// Larger than its share of the cache.
    pub cut: bool,
    /// Ended where the cache had no room but recently used entries.
    pub stopped: bool,
}

impl Warmer {
    /// Whether the policy allows warming `version`'s namespace; why not otherwise. The
    /// namespace is read each time (only when a warm is due): a label added is seen at once.
    async fn allowed(&self, version: &SealedVolumeVersion) -> Result<(), String> {
        let policy = &self.config.settings.policy;
        let namespace = version.namespace().unwrap_or_default();
        if !policy.needs_labels() {
            return policy.allows(&namespace, None);
        }
        let labels = Api::<Namespace>::all(self.kube.client().clone())
            .get(&namespace)
            .await
            .map_err(|e| format!("cannot read namespace {namespace}: {e}"))?
            .metadata
            .labels
            .unwrap_or_default();
        policy.allows(&namespace, Some(&labels))
    }

    /// Remembers `digest` as warm here, across restarts when there is a record directory.
    fn record(&mut self, digest: Digest) {
        self.done.insert(digest);
        if let Some(dir) = &self.config.record_dir {
            let written = crate::state_dir::private_dir(dir)
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    crate::state_dir::write_atomically(&dir.join(digest.hex()), b"")
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = written {
                tracing::warn!(%digest, error = %e, "cannot record the warmed version; a restart may warm it again");
            }
        }
    }
}

/// The digests recorded as warmed in `dir` (none if it cannot be read).
fn read_records(dir: &std::path::Path) -> HashSet<Digest> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Digest::parse(e.file_name().to_str()?).ok())
        .collect()
}

/// Paces warm fetches to a byte rate: each chunk waits for its turn on a virtual clock that
/// advances by its length over the rate (so the long-run rate is bounded, and at most
/// [`WARM_CONCURRENCY`] chunks are early).
pub struct Pace {
    rate: u64,
    next: Mutex<Option<tokio::time::Instant>>,
}

impl Pace {
    /// A pace of `rate` bytes per second; 0: none.
    pub fn new(rate: u64) -> Pace {
        Pace {
            rate,
            next: Mutex::new(None),
        }
    }

    /// Waits for the turn of `len` bytes.
    pub async fn wait(&self, len: u64) {
        if self.rate == 0 {
            return;
        }
        let cost = Duration::from_secs_f64(len as f64 / self.rate as f64);
        let at = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let now = tokio::time::Instant::now();
            let at = next.map_or(now, |n| n.max(now));
            *next = Some(at + cost);
            at
        };
        tokio::time::sleep_until(at).await;
    }
}

/// Records `v` in `wants` if it asks for warming (a bad annotation is logged, not warmed).
fn add(wants: &mut BTreeMap<Digest, Want>, v: SealedVolumeVersion) {
    let Ok(digest) = Digest::parse(&v.spec.digest) else {
        return;
    };
    if v.metadata.deletion_timestamp.is_some() {
        wants.remove(&digest);
        return;
    }
    match sealed_crds::warm_nodes(v.annotations()) {
        Ok(Some(nodes)) if nodes > 0 => {
            wants.insert(
                digest,
                Want {
                    nodes,
                    version: Arc::new(v),
                },
            );
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(version = %v.name_any(), "not warming: {e}"),
    }
}

/// Fetches what the settings allow of `digest` into the disk cache: at most its share of
/// the cache, evicting nothing used recently, paced by `pace`; `None` when it was all there.
pub async fn warm_version(
    config: &WarmConfig,
    store: &ChunkStore,
    digest: &Digest,
    pace: &Pace,
    metrics: &WarmMetrics,
) -> anyhow::Result<Option<Warmed>> {
    let cache = &config.cache;
    anyhow::ensure!(cache.has_disk(), "this node has no disk cache");
    let bytes = store.get_manifest_bytes(digest).await?;
    config.limits.check_encoded(*digest, bytes.len() as u64)?;
    let manifest = Manifest::parse(&bytes)?;
    config.limits.check_manifest(*digest, &manifest)?;
    for (_, file) in manifest.files() {
        cache.register_on_disk(file);
    }
    let budget = config.settings.budget(config.disk_bytes);
    let (chunks, cut) = within_budget(&manifest, budget);
    if cut {
        tracing::warn!(%digest, size = manifest.total_size(), budget,
            "version larger than its share of the disk cache: warming only what fits");
    }
    let missing: Vec<ChunkRef> = chunks
        .into_iter()
        .filter(|c| !cache.on_disk(&c.digest))
        .collect();
    if missing.is_empty() {
        return Ok(None);
    }
    let spare = config.settings.spare_recent;
    // Set once a chunk finds no room: the chunks after it are not fetched.
    let full = std::sync::atomic::AtomicBool::new(false);
    let results: Vec<(ChunkRef, Result<bool, sealed_mount::FetchError>)> =
        futures::stream::iter(missing)
            .map(|c| {
                let (cache, store, full, pace) = (cache.clone(), store.clone(), &full, pace);
                // From the origin, not the peer tier: a chunk asked of its owner would be
                // kept on the owner's disk too, and warming N nodes would fill others.
                async move {
                    if full.load(std::sync::atomic::Ordering::Relaxed) {
                        return (c, Ok(false));
                    }
                    pace.wait(u64::from(c.len)).await;
                    let r = cache.warm_chunk(&store, &c, spare).await;
                    if matches!(r, Ok(false)) {
                        full.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    (c, r)
                }
            })
            .buffer_unordered(WARM_CONCURRENCY)
            .collect()
            .await;
    let mut warmed = Warmed {
        cut,
        ..Warmed::default()
    };
    let mut first_error = None;
    for (c, r) in results {
        match r {
            Ok(true) => {
                warmed.chunks += 1;
                warmed.bytes = warmed.bytes.saturating_add(u64::from(c.len));
                metrics.bytes.inc_by(u64::from(c.len));
            }
            Ok(false) => warmed.stopped = true,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        None => Ok(Some(warmed)),
        Some(e) => Err(anyhow::anyhow!(
            "{} chunks ({} bytes) fetched, then a chunk failed: {e}",
            warmed.chunks,
            warmed.bytes
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_alone_warms_what_asks_for_one_or_more() {
        let digest = Digest::of(b"v");
        let alone = Ring::new(["node-a"], 1);
        assert!(selected(&alone, &digest, 1, "node-a"));
        assert!(selected(&alone, &digest, 1000, "node-a"));
        assert!(!selected(&alone, &digest, 0, "node-a"));
        // Peers not listed yet: nobody is picked (the next membership change looks again).
        assert!(!selected(&Ring::default(), &digest, 3, "node-a"));
    }

    #[test]
    fn exactly_n_of_the_members_warm() {
        let addrs: Vec<String> = (0..5).map(|i| format!("10.0.0.{i}:7070")).collect();
        let ring = Ring::new(addrs.clone(), 64);
        for i in 0..50u32 {
            let digest = Digest::of(&i.to_le_bytes());
            for n in 0..=6 {
                let picked = addrs
                    .iter()
                    .filter(|a| selected(&ring, &digest, n, a))
                    .count();
                assert_eq!(picked, (n as usize).min(5));
            }
        }
    }
}
