//! Warming new versions (`spec.warm.nodes` of a SealedVolume, copied by the operator onto
//! each new SealedVolumeVersion as the `sealedvolumes.io/warm-nodes` annotation): the plugin
//! watches SealedVolumeVersions, and for one asking for N warm nodes fetches the whole
//! version into its disk cache if its own node is among the top N of the live membership by
//! rendezvous hashing of the version's digest (`sealed_peer::Ring::top`, the peer ring's
//! hashing). Without the peer tier the membership is this node alone.
//!
//! Chunks go through the normal verified fetch path (`NodeCache::serve_peer`: memory, disk,
//! then the origin, single flight with readers, verified, kept on disk), a few at once, never
//! more bytes than the disk cache holds. Not through the peer tier: a chunk's owner keeps
//! what it serves, so warming N nodes would fill other nodes' caches too. Once per digest per node: after a restart the cache itself says what is there (a
//! version whose chunks are all on disk is not fetched again and gets no second Event).
//! Only versions the operator made (as for a mount) are warmed. See `docs/peer.md`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use prometheus::IntCounter;
use sealed_crds::SealedVolumeVersion;
use sealed_mount::{MountLimits, NodeCache};
use sealed_peer::{Ring, RingView};
use sealed_store::{ChunkRef, Digest, Manifest};

use crate::kube_access::KubeAccess;
use crate::state::Driver;

/// Chunk fetches one warming has in flight (readers keep the rest of the fetch slots).
pub const WARM_CONCURRENCY: usize = 8;
/// A warming that failed is tried again after this long (or when the membership changes).
const RETRY_AFTER: Duration = Duration::from_secs(300);

/// How this node warms.
#[derive(Clone)]
pub struct WarmConfig {
    pub cache: NodeCache,
    /// The disk cache's bound (`--cache-size`): a warming never fetches more.
    pub disk_bytes: u64,
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
        })
    }

    pub fn register(&self, driver: &Driver) -> Result<(), prometheus::Error> {
        for c in [&self.versions, &self.bytes, &self.failures] {
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

/// Starts warming for the plugin configured by `plugin`: its metrics registered, this node
/// named by its peer address (or node name without the peer tier).
pub fn start(
    kube: &Arc<KubeAccess>,
    driver: &Arc<Driver>,
    plugin: &crate::plugin::PluginConfig,
    cache: &NodeCache,
    peer: Option<&sealed_peer::PeerNode>,
) -> anyhow::Result<()> {
    let metrics = WarmMetrics::new()?;
    metrics.register(driver)?;
    let config = WarmConfig {
        cache: cache.clone(),
        disk_bytes: plugin.cache.disk_bytes,
        limits: plugin.mount.limits,
        me: match &plugin.peer {
            Some(p) => p.advertise.clone(),
            None => plugin.driver.node_id.clone(),
        },
        ring: peer.map(|p| p.ring.clone()),
    };
    tracing::info!(node = %config.me, "warming versions whose volume sets spec.warm");
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
        Warmer {
            kube,
            driver,
            config,
            metrics,
            wants: BTreeMap::new(),
            done: HashSet::new(),
            failed: HashMap::new(),
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
    /// Digests warmed (or found warm) here.
    done: HashSet<Digest>,
    /// Digests whose warming failed, and when.
    failed: HashMap<Digest, Instant>,
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
                    self.done.insert(digest);
                }
                Ok(Some(warmed)) => {
                    self.done.insert(digest);
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
                            "; the version is larger than the disk cache ({} bytes): only what fits was warmed",
                            self.config.disk_bytes
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

    /// Fetches what fits of `digest` into the disk cache; `None` when it was all there.
    async fn warm(&self, digest: &Digest) -> anyhow::Result<Option<Warmed>> {
        let cache = &self.config.cache;
        anyhow::ensure!(cache.has_disk(), "this node has no disk cache");
        let store = self.driver.store().await?;
        let bytes = store.get_manifest_bytes(digest).await?;
        self.config
            .limits
            .check_encoded(*digest, bytes.len() as u64)?;
        let manifest = Manifest::parse(&bytes)?;
        self.config.limits.check_manifest(*digest, &manifest)?;
        for (_, file) in manifest.files() {
            cache.register_on_disk(file);
        }
        let (chunks, cut) = within_budget(&manifest, self.config.disk_bytes);
        if cut {
            tracing::warn!(%digest, size = manifest.total_size(), cache = self.config.disk_bytes,
                "version larger than the disk cache: warming only what fits");
        }
        let missing: Vec<ChunkRef> = chunks
            .into_iter()
            .filter(|c| !cache.on_disk(&c.digest))
            .collect();
        if missing.is_empty() {
            return Ok(None);
        }
        let results: Vec<(ChunkRef, Result<(), sealed_mount::FetchError>)> =
            futures::stream::iter(missing)
                .map(|c| {
                    let (cache, store) = (cache.clone(), store.clone());
                    // From the origin, not the peer tier: a chunk asked of its owner would be
                    // kept on the owner's disk too, and warming N nodes would fill others.
                    async move { (c, cache.serve_peer(&store, &c).await.map(drop)) }
                })
                .buffer_unordered(WARM_CONCURRENCY)
                .collect()
                .await;
        // On disk before the Event says so.
        cache.flush().await;
        let mut warmed = Warmed {
            cut,
            ..Warmed::default()
        };
        let mut first_error = None;
        for (c, r) in results {
            match r {
                Ok(()) => {
                    warmed.chunks += 1;
                    warmed.bytes = warmed.bytes.saturating_add(u64::from(c.len));
                    self.metrics.bytes.inc_by(u64::from(c.len));
                }
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

#[derive(Debug, Default)]
struct Warmed {
    chunks: u64,
    bytes: u64,
    cut: bool,
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
