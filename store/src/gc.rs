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
//!    while the marker is known to be unexpired, then the learned prefetch profiles of
//!    versions neither live nor restorable (also past the grace);
//! 6. remove the marker.
//!
//! A dry run takes no marker and deletes nothing; it reports what a collection would do now.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectMeta;
use object_store::path::Path as ObjectPath;

use crate::bounded::{MAX_LISTED_OBJECTS, list_capped};
use crate::clock::{DEFAULT_LEASE_TTL, StoreClock};
use crate::digest::{Digest, verify_digest};
use crate::error::{Error, Result};
use crate::gc_marker::HeldMarker;
use crate::layout::{self, Prefix, TrashKey};
use crate::manifest::Manifest;
use crate::objects::found;
use crate::retry::RetryPolicy;
use crate::store::ChunkStore;
use crate::trash::read_trashed_bytes;
use crate::writer_lease::{LeaseRecord, list_leases};

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
    /// Trash entries that a volume still references, put back live instead (a deletion
    /// that crashed after racing a push; see docs/gc.md), or, dry run, that would be.
    pub trash_healed: u64,
    /// Tombstones of removed references past their window, deleted (or, dry run, that would be).
    pub tombstones_expired: u64,
    pub chunks_scanned: u64,
    /// Distinct chunks named by a live or restorable manifest.
    pub chunks_marked: u64,
    /// Unmarked chunks kept because they are younger than the grace period.
    pub chunks_in_grace: u64,
    pub chunks_deleted: u64,
    pub bytes_freed: u64,
    /// Learned prefetch profiles of versions that are neither live nor restorable, removed
    /// (or, dry run, that would be).
    pub profiles_deleted: u64,
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
    let mut marker = HeldMarker::take(store, &clock, opts.marker_ttl).await?;
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
    let mut backoff =
        RetryPolicy::new(Duration::from_millis(50), Duration::from_secs(1)).schedule();
    loop {
        let (live, expired) = live_leases(store, clock).await?;
        if live.is_empty() {
            // Leases of crashed writers: their holders can no longer seal anything.
            for lease in &expired {
                store.delete_quietly(&layout::lease_key(&lease.id)).await;
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
        tokio::time::sleep(backoff.next_delay().min(wait)).await;
    }
}

/// Puts back the manifest of a trash entry that a volume references with a proof that
/// holds (`write`: else only says whether it would). The trashed bytes are checked first.
async fn heal_referenced(
    store: &ChunkStore,
    digest: &Digest,
    references: &[crate::store::VolumeRecord],
    write: bool,
) -> Result<bool> {
    let Some(bytes) = read_trashed_bytes(store, digest).await? else {
        return Ok(false);
    };
    if verify_digest(digest, &bytes).is_err() || Manifest::parse(&bytes).is_err() {
        return Ok(false); // the mark step names it as corrupt
    }
    let holds = references
        .iter()
        .any(|r| r.digest == *digest && r.removed.is_none() && ChunkStore::proof_holds(r, &bytes));
    if holds && write {
        store.put_manifest(bytes.to_vec()).await?;
        store.sync().await?;
        store
            .delete_if_exists(&layout::trash_record_key(digest))
            .await?;
        store
            .delete_if_exists(&layout::trash_manifest_key(digest))
            .await?;
        tracing::warn!(%digest, "a referenced version was in the trash; put back live");
    }
    Ok(holds)
}

/// Steps 3–5. With `marker: None` (dry run) nothing is deleted.
async fn run(
    store: &ChunkStore,
    opts: &GcOptions,
    start: DateTime<Utc>,
    marker: Option<&HeldMarker>,
    report: &mut GcReport,
) -> Result<()> {
    let fence = |what: &str| -> Result<()> {
        match marker {
            Some(m) => m.fence(what),
            None => Ok(()),
        }
    };

    // 3. Expired trash. The manifest copy goes first, its record second, so a crash in
    //    between leaves a record without a manifest (restore says "reclaimed"), never a
    //    restorable-looking manifest whose chunks were swept.
    let trash = list_prefix(store, Prefix::Trash).await?;
    let mut trash_manifests: HashSet<Digest> = HashSet::new();
    let mut records: Vec<Digest> = Vec::new();
    for meta in &trash {
        match layout::parse_trash_key(&meta.location) {
            Some(TrashKey::Record(d)) => records.push(d),
            Some(TrashKey::Manifest(d)) => {
                trash_manifests.insert(d);
            }
            None => {}
        }
    }
    report.trash_scanned = records.len().max(trash_manifests.len()) as u64;
    // References: a trash entry a volume still references is put back, never reclaimed;
    // tombstones past their window go. No writer runs meanwhile (the marker), so this read
    // is not raced by a new reference.
    let references = store.list_all_references().await?;
    for tombstone in references.iter().filter(|r| {
        r.removed
            .as_ref()
            .is_some_and(|m| m.restorable_until < start)
    }) {
        report.tombstones_expired += 1;
        if marker.is_some() {
            fence("removing expired tombstones")?;
            store
                .delete_volume_record(&tombstone.volume, &tombstone.digest)
                .await?;
        }
    }
    let referenced: HashSet<Digest> = references
        .iter()
        .filter(|r| r.removed.is_none())
        .map(|r| r.digest)
        .collect();
    for digest in records {
        if referenced.contains(&digest)
            && heal_referenced(store, &digest, &references, marker.is_some()).await?
        {
            report.trash_healed += 1;
            continue;
        }
        let Some(record) = crate::trash::read_record(store, &digest).await? else {
            continue; // absent or unreadable: it never expires, its manifest is marked below
        };
        if !record.expired_at(start) {
            continue;
        }
        report.trash_expired += 1;
        report.expired_versions.push(digest);
        trash_manifests.remove(&digest);
        if marker.is_some() {
            fence("reclaiming expired trash")?;
            store
                .delete_if_exists(&layout::trash_manifest_key(&digest))
                .await?;
            store
                .delete_if_exists(&layout::trash_record_key(&digest))
                .await?;
            tracing::info!(%digest, "expired trash entry reclaimed");
        }
    }

    // 4. Mark. Every manifest left in the store or the trash keeps all its chunks; one that
    //    cannot be read stops the collection (we cannot know what it names).
    let mut marked: HashSet<Digest> = HashSet::new();
    let mut live: HashSet<Digest> = HashSet::new();
    for meta in list_prefix(store, Prefix::Manifests).await? {
        let Some(digest) = layout::parse_manifest_key(&meta.location) else {
            continue;
        };
        live.insert(digest);
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
        let key = layout::trash_manifest_key(digest);
        let Some(bytes) = read_trashed_bytes(store, digest).await? else {
            continue;
        };
        verify_digest(digest, &bytes).map_err(|actual| Error::CorruptRecord {
            store: store.name().to_owned(),
            what: "trashed manifest".into(),
            key: key.to_string(),
            reason: format!(
                "its bytes hash to {actual}; garbage collection stops rather than guess \
                 which chunks it names (remove or repair the object)"
            ),
        })?;
        let manifest = Manifest::parse(&bytes).map_err(|e| unreadable(store, &key, e))?;
        marked.extend(manifest.unique_chunks().into_iter().map(|c| c.digest));
    }
    report.chunks_marked = marked.len() as u64;

    // 5. Sweep.
    let cutoff = crate::limits::earlier(start, opts.grace, "grace period")?;
    let mut doomed: Vec<ObjectMeta> = Vec::new();
    let mut listing = store.raw().list(Some(&Prefix::Chunks.path()));
    while let Some(meta) = listing.try_next().await.map_err(|e| store.backend(e))? {
        let Some(digest) = layout::parse_chunk_key(&meta.location) else {
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
    // A profile only orders fetches of its version's chunks: it goes with the version (a
    // restorable one keeps it). Young ones stay, as chunks do: a mount may be writing one
    // for a version deleted since the listing above.
    let orphan_profiles: Vec<ObjectPath> = list_prefix(store, Prefix::Profiles)
        .await?
        .into_iter()
        .filter(|meta| {
            layout::parse_profile_key(&meta.location).is_some_and(|d| {
                !live.contains(&d) && !trash_manifests.contains(&d) && meta.last_modified < cutoff
            })
        })
        .map(|meta| meta.location)
        .collect();
    if marker.is_none() {
        report.chunks_deleted = doomed.len() as u64;
        report.bytes_freed = doomed.iter().map(|m| m.size).sum();
        report.profiles_deleted = orphan_profiles.len() as u64;
        return Ok(());
    }
    let sizes: HashMap<ObjectPath, u64> = doomed
        .iter()
        .map(|m| (m.location.clone(), m.size))
        .collect();
    for batch in doomed.chunks(SWEEP_BATCH) {
        fence("sweeping chunks")?;
        let paths = futures::stream::iter(batch.iter().map(|m| Ok(m.location.clone()))).boxed();
        let mut deleted = store.raw().delete_stream(paths);
        while let Some(res) = deleted.next().await {
            // Already gone is fine: another collection, or a crash's retry, deleted it.
            if let Some(path) = found(res).map_err(|e| store.backend(e))? {
                report.chunks_deleted += 1;
                report.bytes_freed += sizes.get(&path).copied().unwrap_or(0);
            }
        }
    }
    for key in orphan_profiles {
        fence("removing orphaned profiles")?;
        store.delete_if_exists(&key).await?;
        report.profiles_deleted += 1;
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

async fn list_prefix(store: &ChunkStore, prefix: Prefix) -> Result<Vec<ObjectMeta>> {
    list_capped(store, &prefix.path(), MAX_LISTED_OBJECTS).await
}
