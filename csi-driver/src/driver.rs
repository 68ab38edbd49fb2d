//! The node's driver state, apart from the gRPC layer: which versions are FUSE-mounted and
//! which target paths are bind-mounted onto them.
//!
//! One FUSE mount per digest per node, under `<state-dir>/mounts/<hex>`, shared by every
//! target through a read-only bind mount and reference counted by its targets. Publish and
//! unpublish ([`publish`]) are idempotent; a restarted plugin takes over what the last one
//! left ([`recovery`]).
//!
//! Two kinds of lock. The driver's tables (`mounts`) are locked only for local work (the
//! tables, bind mounts, unmounts), never across store I/O. A version's lock
//! (`digest_locks`) is held while it is mounted, resumed or released, store I/O included:
//! concurrent publishes of one digest fetch its manifest once and mount it once, and a
//! publish stuck on the store holds up only publishes of the same digest.

mod publish;
mod recovery;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sealed_mount::{MountHandle, MountOptions, NodeCache};
use sealed_store::{ChunkStore, Digest, Manifest, StoreOptions};
use tokio::sync::Mutex;

use crate::digest_locks::DigestLocks;
use crate::error::CsiError;
use crate::holder::FdHolder;
use crate::manifest_cache::ManifestCache;
use crate::metrics::Metrics;
use crate::records::PublicationRecords;
use crate::store_slot::StoreSlot;
use crate::targets::TargetRules;

pub use publish::{Publish, VolumeStats};
pub use recovery::Recovery;

/// Default of [`DriverConfig::resume_deadline`].
pub const DEFAULT_RESUME_DEADLINE: Duration = Duration::from_secs(120);

/// Settings of the node plugin.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub node_id: String,
    pub state_dir: PathBuf,
    pub store_url: String,
    pub store_options: StoreOptions,
    /// Most volumes this node publishes (`NodeGetInfo.max_volumes_per_node`); 0: no limit.
    pub max_volumes: i64,
    /// No API server: no authorization or node-label checks.
    pub standalone: bool,
    /// The FUSE fd holder's socket: mounts survive restarts of the plugin (see `holder`).
    pub fd_holder: Option<PathBuf>,
    /// kubelet's root directory: targets must be under `<kubelet-root>/pods` (see `targets`).
    pub kubelet_root: PathBuf,
    /// How long a restarted plugin keeps trying to resume a held mount whose manifest it
    /// has no copy of (the store is down), while that mount's readers wait; then it gives
    /// up and aborts the mount's connection, so they get an error.
    pub resume_deadline: Duration,
}

/// A published target: what `unpublish` and `stats` match a request against.
struct Publication {
    volume_id: String,
    digest: Digest,
    namespace: String,
}

struct VersionMount {
    handle: MountHandle,
    targets: BTreeSet<PathBuf>,
}

/// The publication table.
#[derive(Default)]
struct Mounts {
    versions: HashMap<Digest, VersionMount>,
    targets: HashMap<PathBuf, Publication>,
}

pub struct Driver {
    config: DriverConfig,
    cache: NodeCache,
    mount_options: MountOptions,
    store: Arc<StoreSlot>,
    manifests: ManifestCache,
    records: PublicationRecords,
    /// Never held across store I/O (see the module's comment).
    mounts: Mutex<Mounts>,
    digest_locks: DigestLocks,
    metrics: Arc<Metrics>,
    holder: Option<FdHolder>,
}

impl Driver {
    pub fn new(
        config: DriverConfig,
        cache: NodeCache,
        mut mount_options: MountOptions,
    ) -> Result<Arc<Self>, prometheus::Error> {
        let metrics = Arc::new(Metrics::new(cache.metrics().clone())?);
        let holder = config.fd_holder.as_ref().map(FdHolder::new);
        mount_options.restartable = holder.is_some();
        let store = StoreSlot::new(config.store_url.clone(), config.store_options.clone());
        let manifests = ManifestCache::new(&config.state_dir);
        let records = PublicationRecords::new(&config.state_dir);
        Ok(Arc::new(Driver {
            config,
            cache,
            mount_options,
            store,
            manifests,
            records,
            mounts: Mutex::new(Mounts::default()),
            digest_locks: DigestLocks::default(),
            metrics,
            holder,
        }))
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn config(&self) -> &DriverConfig {
        &self.config
    }

    fn mounts_dir(&self) -> PathBuf {
        self.config.state_dir.join("mounts")
    }

    /// Where the FUSE mount of `digest` records its io modes for the plugin that resumes it.
    fn io_mode_record(&self, digest: &Digest) -> PathBuf {
        self.config.state_dir.join("io-modes").join(digest.hex())
    }

    /// The options of the FUSE mount of `digest`: a restartable mount (with an fd holder)
    /// records its io modes, so a plugin that resumes it keeps passthrough working.
    fn mount_options_for(&self, digest: &Digest) -> MountOptions {
        let mut options = self.mount_options.clone();
        if options.restartable {
            options.io_mode_record = Some(self.io_mode_record(digest));
        }
        options
    }

    /// [`Driver::mount_options_for`] with the prefetch a publish asked for (its `prefetch`
    /// and `learnedPrefetch` attributes), else the plugin's defaults (`--prefetch`,
    /// `--learned-prefetch`), and the publish's learned-profile scope.
    fn mount_options_with(&self, digest: &Digest, publish: &Publish) -> MountOptions {
        let mut options = self.mount_options_for(digest);
        if let Some(selection) = &publish.prefetch {
            options.prefetch = selection.clone();
        }
        if let Some(on) = publish.learned_prefetch {
            options.learned_prefetch = on;
        }
        options.profile_scope = publish.profile_scope.clone();
        options
    }

    /// The gauges of FUSE mounts and published targets, after a change of the table.
    fn count(&self, mounts: &Mounts) {
        self.metrics
            .set_counts(mounts.versions.len(), mounts.targets.len());
    }

    /// The store, opened on first use: a store that is down when the plugin starts must not
    /// keep the plugin from serving, and must not be remembered as down.
    pub async fn store(&self) -> Result<ChunkStore, CsiError> {
        self.store
            .get()
            .await
            .map_err(|e| CsiError::from_store(&self.config.store_url, e))
    }

    /// The store a mount reads its chunks through, without waiting for the store (see
    /// `store_slot`).
    fn mount_store(&self) -> Result<ChunkStore, CsiError> {
        self.store
            .for_mount()
            .map_err(|e| CsiError::from_store(&self.config.store_url, e))
    }

    /// The manifest in `bytes` (verified against `digest`: kept or fetched), refused when
    /// it is over this node's per-mount caps before it is parsed.
    fn parse_manifest(&self, digest: &Digest, bytes: &[u8]) -> Result<Manifest, CsiError> {
        self.mount_options
            .limits
            .check_encoded(*digest, bytes.len() as u64)?;
        Ok(Manifest::parse(bytes)?)
    }

    /// `InvalidArgument` unless `target` is a place kubelet publishes volumes to (under
    /// `<kubelet-root>/pods`, outside the state directory; see `targets`).
    pub fn check_target(&self, target: &Path) -> Result<(), CsiError> {
        TargetRules::new(&self.config.kubelet_root, &self.config.state_dir).check(target)
    }

    /// What this node has published: (pod namespace, digest) of every target, sorted and
    /// without repeats, for the node publications Lease.
    pub async fn publications(&self) -> Vec<sealed_crds::publications::Publication> {
        let mounts = self.mounts.lock().await;
        let set: BTreeSet<sealed_crds::publications::Publication> = mounts
            .targets
            .values()
            .map(|p| sealed_crds::publications::Publication {
                namespace: p.namespace.clone(),
                digest: p.digest.to_string(),
            })
            .collect();
        set.into_iter().collect()
    }
}
