//! Garbage collection: reclaim expired trash and the chunks no live or restorable version
//! names. Race-free against concurrent writers by the `gc/running` marker and writer leases;
//! the argument is in `docs/gc.md`.
//!
//! 1. wait up to `writer_wait` for no unexpired lease (else report "skipped");
//! 2. take the marker `gc/running` (conditional create; an expired one may be taken over),
//!    then list leases again: any unexpired one and the run is skipped (marker removed);
//! 3. delete expired trash entries (`trash/<hex>` then `trash/<hex>.json`);
//! 4. mark the chunks of every manifest under `manifests/` and every trash manifest left;
//! 5. sweep chunks neither marked nor younger than `started - grace`, in batches, each only
//!    while the marker is known to be unexpired;
//! 6. remove the marker.
//!
//! A dry run takes no marker and deletes nothing; it reports what a collection would do now.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, PutMode, PutOptions, PutPayload, UpdateVersion};

use crate::bounded::{MAX_LISTED_OBJECTS, MAX_MANIFEST_BYTES, list_capped, read_capped};
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::lease::{
    DEFAULT_LEASE_TTL, GC_MARKER_KEY, GcMarker, Keepalive, LeaseRecord, StoreClock, delete_quietly,
    hostname, list_leases, random_id,
};
use crate::manifest::Manifest;
use crate::store::ChunkStore;
use crate::trash::{
    TRASH_PREFIX, TrashRecord, delete_if_present, manifest_digest, record_digest, trash_key,
    trash_record_key,
};

/// Chunks younger than this are never swept, whatever marks them (defence in depth against
/// writers that take no lease, e.g. older clients, and against clock trouble).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);

/// Chunks deleted per request batch; the marker's liveness is checked before each batch.
const SWEEP_BATCH: usize = 256;

#[derive(Clone, Debug)]
pub struct GcOptions {
    /// Report only; take no marker, delete nothing.
    pub dry_run: bool,
    /// Unmarked chunks are swept only when last modified before `start - grace`.
    pub grace: Duration,
    /// "Now" for trash expiry and the grace cutoff (tests); `None`: the clock. Lease and
    /// marker expiry always use the clock.
    pub now: Option<DateTime<Utc>>,
    /// How long to wait for active writers to finish before skipping this run.
    pub writer_wait: Duration,
    /// Lifetime of the `gc/running` marker without renewal (renewed every TTL/3).
    pub marker_ttl: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            dry_run: false,
            grace: DEFAULT_GRACE,
            now: None,
            writer_wait: Duration::from_secs(30),
            marker_ttl: DEFAULT_LEASE_TTL,
        }
    }
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GcReport {
    pub dry_run: bool,
    /// Set when the run did nothing, with the reason ("skipped: 2 writers active").
    pub skipped: Option<String>,
    /// Writers whose unexpired leases made the run skip (or, in a dry run, were seen).
    pub active_writers: Vec<LeaseRecord>,
    pub started_at: Option<DateTime<Utc>>,
    /// Manifests under `manifests/` whose chunks were marked.
    pub manifests_scanned: u64,
    /// Trash entries looked at.
    pub trash_scanned: u64,
    /// Trash entries past their `restorable_until`, reclaimed (or, dry run, that would be).
    pub trash_expired: u64,
    pub expired_versions: Vec<Digest>,
    pub chunks_scanned: u64,
    /// Distinct chunks named by a live or restorable manifest.
    pub chunks_marked: u64,
    /// Unmarked chunks kept because they are younger than the grace period.
    pub chunks_in_grace: u64,
    pub chunks_deleted: u64,
    pub bytes_freed: u64,
    /// Expired lease objects of crashed writers that were removed.
    pub stale_leases_removed: u64,
}

/// Runs one collection (see the module docs). Fails with [`Error::GcBusy`] when another
/// collection holds the store.
pub async fn collect(store: &ChunkStore, opts: &GcOptions) -> Result<GcReport> {
    // Durations that would overflow a timestamp are refused before anything is taken.
    let now = opts.now.unwrap_or_else(Utc::now);
    crate::limits::earlier(now, opts.grace, "grace period")?;
    crate::limits::later(Utc::now(), opts.marker_ttl, "garbage-collection marker TTL")?;
    let mut report = GcReport {
        dry_run: opts.dry_run,
        ..Default::default()
    };
    // Every expiry and the grace cutoff are judged by the store's clock: this host's may be
    // minutes off, and a collector running ahead must not find live leases expired.
    let clock = StoreClock::read(store).await?;
    if opts.dry_run {
        let start = opts.now.unwrap_or_else(|| clock.now());
        report.started_at = Some(start);
        report.active_writers = live_leases(store, &clock).await?.0;
        run(store, opts, start, None, &mut report).await?;
        return Ok(report);
    }

    // Writers first: wait for those in flight without holding the marker, so nobody new is
    // held up meanwhile.
    if !wait_for_writers(store, &clock, opts.writer_wait, &mut report).await? {
        return Ok(report);
    }
    let mut marker = Marker::take(store, &clock, opts.marker_ttl).await?;
    let start = opts.now.unwrap_or_else(|| clock.now());
    report.started_at = Some(start);
    let result = async {
        // With the marker down, look again: a writer whose lease landed before the marker is
        // seen here (and one whose lease lands after it sees the marker and waits). Defer to
        // it rather than hold it up.
        if !wait_for_writers(store, &clock, Duration::ZERO, &mut report).await? {
            return Ok(());
        }
        run(store, opts, start, Some(&marker), &mut report).await
    }
    .await;
    let removed = marker.remove().await;
    result?;
    removed?;
    tracing::info!(
        skipped = report.skipped.as_deref().unwrap_or(""),
        trash_expired = report.trash_expired,
        chunks_deleted = report.chunks_deleted,
        bytes_freed = report.bytes_freed,
        "garbage collection finished"
    );
    Ok(report)
}

/// Unexpired leases, and the expired ones, by the store's clock.
async fn live_leases(
    store: &ChunkStore,
    clock: &StoreClock,
) -> Result<(Vec<LeaseRecord>, Vec<LeaseRecord>)> {
    let now = clock.now();
    Ok(list_leases(store)
        .await?
        .into_iter()
        .partition(|l| l.expires_at > now))
}

/// Waits up to `wait` until no unexpired lease is left. False, with `report.skipped` set,
/// when writers (running or waiting for a collection) are still there.
async fn wait_for_writers(
    store: &ChunkStore,
    clock: &StoreClock,
    wait: Duration,
    report: &mut GcReport,
) -> Result<bool> {
    let waiting_since = Instant::now();
    let mut backoff = Duration::from_millis(50);
    loop {
        let (live, expired) = live_leases(store, clock).await?;
        if live.is_empty() {
            // Leases of crashed writers: their holders can no longer seal anything.
            for lease in &expired {
                delete_quietly(store, &ObjectPath::from(format!("leases/{}", lease.id))).await;
            }
            report.stale_leases_removed += expired.len() as u64;
            return Ok(true);
        }
        if waiting_since.elapsed() >= wait {
            report.skipped = Some(format!(
                "skipped: {} writer{} active ({})",
                live.len(),
                if live.len() == 1 { "" } else { "s" },
                live.iter()
                    .map(|l| format!(
                        "{} on {} pid {}{}",
                        l.purpose,
                        l.host,
                        l.pid,
                        if l.waiting { ", waiting" } else { "" }
                    ))
                    .collect::<Vec<_>>()
                    .join("; ")
            ));
            report.active_writers = live;
            return Ok(false);
        }
        tokio::time::sleep(backoff.min(wait)).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Steps 3–5. With `marker: None` (dry run) nothing is deleted.
async fn run(
    store: &ChunkStore,
    opts: &GcOptions,
    start: DateTime<Utc>,
    marker: Option<&Marker>,
    report: &mut GcReport,
) -> Result<()> {
    let fence = |what: &str| -> Result<()> {
        match marker {
            Some(m) => m.fence(store, what),
            None => Ok(()),
        }
    };

    // 3. Expired trash. The manifest copy goes first, its record second, so a crash in
    //    between leaves a record without a manifest (restore says "reclaimed"), never a
    //    restorable-looking manifest whose chunks were swept.
    let trash = list_prefix(store, TRASH_PREFIX).await?;
    let mut trash_manifests: HashSet<Digest> = HashSet::new();
    let mut records: Vec<Digest> = Vec::new();
    for meta in &trash {
        if let Some(d) = record_digest(&meta.location) {
            records.push(d);
        } else if let Some(d) = manifest_digest(&meta.location) {
            trash_manifests.insert(d);
        }
    }
    report.trash_scanned = records.len().max(trash_manifests.len()) as u64;
    for digest in records {
        let Some(record) = read_record_strict(store, &digest).await? else {
            continue; // unreadable: keep its manifest (marked below)
        };
        if !record.expired_at(start) {
            continue;
        }
        report.trash_expired += 1;
        report.expired_versions.push(digest);
        trash_manifests.remove(&digest);
        if marker.is_some() {
            fence("reclaiming expired trash")?;
            delete_if_present(store, &trash_key(&digest)).await?;
            delete_if_present(store, &trash_record_key(&digest)).await?;
            tracing::info!(%digest, "expired trash entry reclaimed");
        }
    }

    // 4. Mark. Every manifest left in the store or the trash keeps all its chunks; one that
    //    cannot be read stops the collection (we cannot know what it names).
    let mut marked: HashSet<Digest> = HashSet::new();
    for meta in list_prefix(store, "manifests").await? {
        let Some(digest) = meta.location.filename().and_then(|f| Digest::parse(f).ok()) else {
            continue;
        };
        let manifest = match store.get_manifest(&digest).await {
            Ok(m) => m,
            // Deleted to the trash since the listing (only possible in a dry run): the trash
            // listing above may have missed it, so read it from there.
            Err(Error::UnknownVersion { .. }) => {
                trash_manifests.insert(digest);
                continue;
            }
            Err(e) => return Err(unreadable(store, &meta.location, e)),
        };
        report.manifests_scanned += 1;
        marked.extend(manifest.unique_chunks().into_iter().map(|c| c.digest));
    }
    for digest in &trash_manifests {
        let key = trash_key(digest);
        let bytes = match store.object_store().get(&key).await {
            Ok(r) => {
                let what = format!("trashed manifest {key}");
                read_capped(store, r, &what, MAX_MANIFEST_BYTES).await?
            }
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(store.backend(e)),
        };
        let actual = Digest::of(&bytes);
        if actual != *digest {
            return Err(Error::CorruptRecord {
                store: store.name().to_owned(),
                what: "trashed manifest".into(),
                key: key.to_string(),
                reason: format!(
                    "its bytes hash to {actual}; garbage collection stops rather than guess \
                     which chunks it names (remove or repair the object)"
                ),
            });
        }
        let manifest = Manifest::parse(&bytes).map_err(|e| unreadable(store, &key, e))?;
        marked.extend(manifest.unique_chunks().into_iter().map(|c| c.digest));
    }
    report.chunks_marked = marked.len() as u64;

    // 5. Sweep.
    let cutoff = crate::limits::earlier(start, opts.grace, "grace period")?;
    let mut doomed: Vec<ObjectMeta> = Vec::new();
    let mut listing = store.object_store().list(Some(&ObjectPath::from("chunks")));
    while let Some(meta) = listing.try_next().await.map_err(|e| store.backend(e))? {
        let Some(digest) = meta.location.filename().and_then(|f| Digest::parse(f).ok()) else {
            continue; // not a chunk of ours
        };
        report.chunks_scanned += 1;
        if marked.contains(&digest) {
            continue;
        }
        if meta.last_modified >= cutoff {
            report.chunks_in_grace += 1;
            continue;
        }
        doomed.push(meta);
    }
    if marker.is_none() {
        report.chunks_deleted = doomed.len() as u64;
        report.bytes_freed = doomed.iter().map(|m| m.size).sum();
        return Ok(());
    }
    let sizes: HashMap<ObjectPath, u64> = doomed
        .iter()
        .map(|m| (m.location.clone(), m.size))
        .collect();
    for batch in doomed.chunks(SWEEP_BATCH) {
        fence("sweeping chunks")?;
        let paths = futures::stream::iter(batch.iter().map(|m| Ok(m.location.clone()))).boxed();
        let mut deleted = store.object_store().delete_stream(paths);
        while let Some(res) = deleted.next().await {
            match res {
                Ok(path) => {
                    report.chunks_deleted += 1;
                    report.bytes_freed += sizes.get(&path).copied().unwrap_or(0);
                }
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store.backend(e)),
            }
        }
    }
    Ok(())
}

fn unreadable(store: &ChunkStore, key: &ObjectPath, e: Error) -> Error {
    Error::CorruptRecord {
        store: store.name().to_owned(),
        what: "manifest".into(),
        key: key.to_string(),
        reason: format!(
            "{e}; garbage collection stops rather than guess which chunks it names \
             (remove or repair the object)"
        ),
    }
}

async fn list_prefix(store: &ChunkStore, prefix: &str) -> Result<Vec<ObjectMeta>> {
    list_capped(store, prefix, MAX_LISTED_OBJECTS).await
}

/// A trash record; `None` when absent or unreadable (unreadable ones never expire).
async fn read_record_strict(store: &ChunkStore, digest: &Digest) -> Result<Option<TrashRecord>> {
    crate::trash::read_record(store, digest).await
}

/// The `gc/running` marker this collection holds.
struct Marker {
    store: ChunkStore,
    record: GcMarker,
    keepalive: Keepalive,
    ttl: Duration,
}

impl Marker {
    async fn take(store: &ChunkStore, clock: &StoreClock, ttl: Duration) -> Result<Marker> {
        let ttl = ttl.max(Duration::from_millis(300));
        let key = ObjectPath::from(GC_MARKER_KEY);
        let id = random_id();
        let host = hostname();
        let pid = std::process::id();
        for _ in 0..3 {
            let written_at = Instant::now();
            let now = Utc::now();
            let record = GcMarker {
                id: id.clone(),
                host: host.clone(),
                pid,
                started_at: now,
                expires_at: crate::limits::later(now, ttl, "garbage-collection marker TTL")?,
                ttl_secs: Some(ttl.as_secs().max(1)),
            };
            let body = serde_json::to_vec(&record)
                .map_err(|e| Error::Other(format!("{GC_MARKER_KEY}: {e}")))?;
            let create = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            let taken = match store
                .object_store()
                .put_opts(&key, PutPayload::from(body.clone()), create)
                .await
            {
                Ok(put) => Some(put.e_tag),
                Err(object_store::Error::AlreadyExists { .. }) => {
                    Self::take_over(store, clock, &key, &body).await?
                }
                // No conditional create on this server: check, then write.
                Err(object_store::Error::NotImplemented) => {
                    if let Some(existing) = crate::lease::read_gc_marker(store).await?
                        && existing.expires_at > clock.now()
                    {
                        return Err(busy(store, existing));
                    }
                    let put = store
                        .object_store()
                        .put(&key, PutPayload::from(body))
                        .await
                        .map_err(|e| store.backend(e))?;
                    Some(put.e_tag)
                }
                Err(e) => return Err(store.backend(e)),
            };
            if let Some(etag) = taken {
                let keepalive = Keepalive::start(store, key, record.clone(), ttl, written_at, etag);
                tracing::info!(marker = %id, "garbage collection started");
                return Ok(Marker {
                    store: store.clone(),
                    record,
                    keepalive,
                    ttl,
                });
            }
        }
        Err(Error::Other(format!(
            "store {}: could not take the garbage-collection marker {GC_MARKER_KEY} after 3 \
             attempts (another collection keeps starting?); try again",
            store.name()
        )))
    }

    /// The marker exists: busy if it is live, else replace it. True when ours now; false to
    /// retry the create.
    async fn take_over(
        store: &ChunkStore,
        clock: &StoreClock,
        key: &ObjectPath,
        body: &[u8],
    ) -> Result<Option<Option<String>>> {
        let meta = match store.object_store().head(key).await {
            Ok(m) => m,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(store.backend(e)),
        };
        // Its expiry by the store's clock (read_gc_marker judges it so).
        let Some(existing) = crate::lease::read_gc_marker(store).await? else {
            return Ok(None);
        };
        if existing.expires_at > clock.now() {
            return Err(busy(store, existing));
        }
        tracing::warn!(
            host = %existing.host,
            pid = existing.pid,
            "taking over the expired marker of a garbage collection that did not finish"
        );
        let update = PutOptions {
            mode: PutMode::Update(UpdateVersion {
                e_tag: meta.e_tag.clone(),
                version: meta.version.clone(),
            }),
            ..Default::default()
        };
        match store
            .object_store()
            .put_opts(key, PutPayload::from(body.to_vec()), update)
            .await
        {
            Ok(put) => Ok(Some(put.e_tag)),
            // Someone else replaced it first.
            Err(object_store::Error::Precondition { .. }) => {
                match crate::lease::read_gc_marker(store).await? {
                    Some(m) => Err(busy(store, m)),
                    None => Ok(None),
                }
            }
            // No conditional update (a local directory): delete it if it is still the stale
            // one, then create again (conditionally, so of two collections doing this at
            // once only one wins).
            Err(object_store::Error::NotImplemented) => {
                match store.object_store().head(key).await {
                    Ok(now)
                        if now.e_tag == meta.e_tag && now.last_modified == meta.last_modified =>
                    {
                        delete_if_present(store, key).await?;
                    }
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(store.backend(e)),
                }
                Ok(None)
            }
            Err(e) => Err(store.backend(e)),
        }
    }

    /// Ok while the marker is known to stay unexpired for longer than one batch of store
    /// requests can take (the store's request bound, at most a quarter of the TTL): only
    /// then may anything be deleted, so no delete lands after a writer could see the marker
    /// expired and start reusing chunks.
    fn fence(&self, store: &ChunkStore, what: &str) -> Result<()> {
        let margin = store.request_bound().min(self.ttl / 4);
        if self.keepalive.is_live_for(margin) {
            return Ok(());
        }
        Err(Error::GcMarkerLapsed {
            store: store.name().to_owned(),
            what: what.to_owned(),
        })
    }

    /// Stops renewal and deletes the marker if it is still ours.
    async fn remove(&mut self) -> Result<()> {
        self.keepalive.stop().await;
        let key = ObjectPath::from(GC_MARKER_KEY);
        match crate::lease::read_gc_marker(&self.store).await? {
            Some(m) if m.id == self.record.id => delete_if_present(&self.store, &key).await,
            _ => {
                tracing::warn!("the gc/running marker is no longer ours; leaving it");
                Ok(())
            }
        }
    }
}

fn busy(store: &ChunkStore, m: GcMarker) -> Error {
    Error::GcBusy {
        store: store.name().to_owned(),
        host: m.host,
        pid: m.pid,
        started_at: m.started_at.to_rfc3339(),
        expires_at: m.expires_at.to_rfc3339(),
    }
}
