//! Trust in the node disk cache's whole-file copies: what lets the kernel serve them by FUSE
//! passthrough, where no per-read check can happen.
//!
//! A copy found on disk when this process started (a hydrated file `files/<BLAKE3>`, or a
//! single-chunk file's chunk file) is not trusted until this process hashed it and the
//! digest its name says matched ([`DiskCache::check`]). Until then its file is served by the
//! daemon, every chunk verified as it is read. Three things check copies:
//!
//! - a mount's **walker** hashes its version's unverified copies one after another as soon as
//!   the mount is up (multi-threaded BLAKE3 over an mmap, which also fills the page cache the
//!   reader is about to use): by the time a loader opens a file its check is done or under way;
//! - an **open** of an unverified copy starts its check (or joins the walker's) and does not
//!   wait for it: it is daemon-served at once, every chunk read from the copy verified against
//!   the manifest as the lazy path does; opens after the check matched (and the inode's
//!   daemon-served handles closed: one mode per inode) are passthrough;
//! - the **scrub** re-hashes everything the cache holds, paced to a rate in bytes per second,
//!   reading around the page cache (`O_DIRECT`), so that damage after a check is found.
//!
//! A copy that does not match is dropped (index, file, located chunks), counted
//! (`verification_failures`; by the scrub also `scrub_failures`), and its file is fetched
//! again through the tiers and assembled anew for every mount that has it. Handles already
//! open by passthrough on a dropped copy keep the kernel's backing file until they close (the
//! kernel offers no way to revoke it); new opens of that inode fail with EIO meanwhile
//! (`crate::passthrough`).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::cache::{Checked, Hashing, Key};
use crate::fetch::{NodeCache, WeakNodeCache};
use crate::fs::SealedFs;
use crate::metrics::MountMetrics;

/// Checks of copies this large are logged at info.
const LOGGED_BYTES: u64 = 64 << 20;

/// The background scrub of the disk cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScrubOptions {
    /// Bytes hashed per second at most; 0 turns the scrub off.
    pub bytes_per_second: u64,
    /// Pause between the start of one pass over the cache and the next.
    pub pass_interval: Duration,
}

impl ScrubOptions {
    /// The rate `sealed mount` and the node plugin scrub at unless told otherwise, MiB/s.
    pub const DEFAULT_MIB_PER_SECOND: u64 = 32;

    pub fn off() -> ScrubOptions {
        ScrubOptions {
            bytes_per_second: 0,
            pass_interval: Duration::from_secs(600),
        }
    }

    /// A scrub at `mib` MiB/s (0: off), a pass at most every 10 minutes.
    pub fn at_mib_per_second(mib: u64) -> ScrubOptions {
        ScrubOptions {
            bytes_per_second: mib.saturating_mul(1 << 20),
            ..ScrubOptions::off()
        }
    }
}

impl Default for ScrubOptions {
    /// Off: a library user (or a test) asks for it.
    fn default() -> Self {
        ScrubOptions::off()
    }
}

/// One check of one copy, joined by everyone who asks while it runs.
pub(crate) struct Check {
    outcome: Mutex<Option<bool>>,
    done: Condvar,
}

impl Check {
    fn finished(good: bool) -> Arc<Check> {
        Arc::new(Check {
            outcome: Mutex::new(Some(good)),
            done: Condvar::new(),
        })
    }

    fn finish(&self, good: bool) {
        *self.outcome.lock() = Some(good);
        self.done.notify_all();
    }

    /// Waits for the check: true if the copy matched, false if it did not (or is gone).
    pub(crate) fn wait(&self) -> bool {
        let mut outcome = self.outcome.lock();
        loop {
            if let Some(good) = *outcome {
                return good;
            }
            self.done.wait(&mut outcome);
        }
    }
}

/// The node cache's checks under way, and the mounts whose files a bad copy is refetched for.
#[derive(Default)]
pub(crate) struct Integrity {
    checks: Mutex<HashMap<Key, Arc<Check>>>,
    mounts: Mutex<Vec<(Weak<SealedFs>, tokio::runtime::Handle)>>,
}

impl Integrity {
    /// The check of `key`: done if this process verified it already, joined if under way,
    /// started on a thread of its own otherwise.
    pub(crate) fn verify(&self, cache: &NodeCache, key: Key) -> Arc<Check> {
        let Some(disk) = cache.disk() else {
            return Check::finished(false);
        };
        if disk.is_verified(&key) {
            return Check::finished(true);
        }
        let check = {
            let mut checks = self.checks.lock();
            if let Some(check) = checks.get(&key) {
                return check.clone();
            }
            let check = Arc::new(Check {
                outcome: Mutex::new(None),
                done: Condvar::new(),
            });
            checks.insert(key, check.clone());
            check
        };
        let (cache2, check2) = (cache.clone(), check.clone());
        let spawned = std::thread::Builder::new()
            .name("sealed-verify".into())
            .spawn(move || {
                let good = check_now(&cache2, key, Hashing::Fast);
                cache2.integrity().checks.lock().remove(&key);
                check2.finish(good);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a verification thread: the copy stays daemon-served");
            self.checks.lock().remove(&key);
            check.finish(false);
        }
        check
    }

    /// Records a mount, whose files a bad copy is fetched again for (`runtime` runs that).
    pub(crate) fn add_mount(&self, fs: &Arc<SealedFs>, runtime: tokio::runtime::Handle) {
        let mut mounts = self.mounts.lock();
        mounts.retain(|(m, _)| m.strong_count() > 0);
        mounts.push((Arc::downgrade(fs), runtime));
    }

    /// Fetches the files whose whole copy was `key` again through the tiers, and assembles
    /// them anew: once, by the first mount that has such a file.
    fn refetch(&self, key: Key) {
        let mounts: Vec<_> = self
            .mounts
            .lock()
            .iter()
            .filter_map(|(m, rt)| Some((m.upgrade()?, rt.clone())))
            .collect();
        // A whole copy is named by its file's BLAKE3 (a file of one chunk: that chunk's digest
        // is its BLAKE3). A plain chunk names no file: it is fetched again when read.
        let digest = match key {
            Key::Chunk(d) | Key::File(d) => d,
        };
        for (fs, runtime) in mounts {
            let found = fs
                .tree()
                .files()
                .map(|(_, file)| file)
                .find(|file| file.blake3 == digest && file.size > 0)
                .cloned();
            let Some(file) = found else {
                continue;
            };
            let (cache, store) = (fs.cache().clone(), fs.store().clone());
            let guard = cache.background_assembly();
            runtime.spawn(async move {
                let _guard = guard;
                match crate::hydrate::assemble(&cache, &store, &file).await {
                    Ok(_) => tracing::info!(blake3 = %file.blake3, "a damaged cache copy was fetched again"),
                    Err(e) => tracing::warn!(blake3 = %file.blake3, error = %e, "fetching a damaged cache copy again failed"),
                }
            });
            return;
        }
    }
}

/// Checks `key` now (blocking), counts it, and refetches it if it was bad.
fn check_now(cache: &NodeCache, key: Key, hashing: Hashing) -> bool {
    let Some(disk) = cache.disk() else {
        return false;
    };
    let metrics = cache.metrics();
    let started = Instant::now();
    let outcome = disk.check(key, hashing);
    let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    match outcome {
        Checked::Good(bytes) => {
            MountMetrics::inc(&metrics.files_verified);
            MountMetrics::add(&metrics.verified_bytes, bytes);
            MountMetrics::add(&metrics.verify_micros, took);
            // One line per large file (the benchmark sums them); small ones at debug.
            if bytes >= LOGGED_BYTES {
                tracing::info!(?key, bytes, micros = took, "cache copy verified");
            } else {
                tracing::debug!(?key, bytes, micros = took, "cache copy verified");
            }
            true
        }
        Checked::Bad => {
            cache.integrity().refetch(key);
            false
        }
        Checked::Gone => false,
    }
}

/// Starts a mount's walker: every whole copy of its files that this process has not verified
/// is checked, one after another, in the manifest's order (the order loaders open shards).
pub(crate) fn walk_mount(fs: &Arc<SealedFs>) {
    let Some(disk) = fs.cache().disk() else {
        return;
    };
    let keys: Vec<Key> = fs
        .tree()
        .files()
        .filter(|(_, file)| file.size > 0)
        .filter_map(|(_, file)| disk.whole_file(file))
        .filter(|copy| !copy.verified)
        .map(|copy| copy.key)
        .collect();
    if keys.is_empty() {
        return;
    }
    let weak = Arc::downgrade(fs);
    let spawned = std::thread::Builder::new()
        .name("sealed-verify-walk".into())
        .spawn(move || {
            for key in keys {
                // The mount ended: its copies are checked when next mounted.
                let Some(fs) = weak.upgrade() else { return };
                let cache = fs.cache().clone();
                drop(fs);
                cache.integrity().verify(&cache, key).wait();
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the verification walker: copies are checked at open");
    }
}

/// Starts the scrub of `cache`'s disk tier, if `options` turn it on. It stops once the cache
/// is dropped.
pub(crate) fn start_scrub(cache: &NodeCache, options: ScrubOptions) {
    if options.bytes_per_second == 0 || cache.disk().is_none() {
        return;
    }
    let weak = cache.downgrade();
    let spawned = std::thread::Builder::new()
        .name("sealed-scrub".into())
        .spawn(move || scrub(weak, options));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the disk cache scrub");
    }
}

fn scrub(weak: WeakNodeCache, options: ScrubOptions) {
    let rate = options.bytes_per_second.max(1);
    tracing::info!(
        bytes_per_second = rate,
        pass_interval_s = options.pass_interval.as_secs(),
        "disk cache scrub started"
    );
    loop {
        let pass = Instant::now();
        let Some(keys) = weak.upgrade().and_then(|c| c.disk().map(|d| d.keys())) else {
            return;
        };
        // Paced over the whole pass: after n bytes, not before n / rate seconds.
        let mut hashed = 0u64;
        for key in keys {
            let Some(cache) = weak.upgrade() else { return };
            // A copy being checked right now needs no second look.
            if cache.integrity().checks.lock().contains_key(&key) {
                continue;
            }
            let mut pace = |bytes: u64| {
                hashed = hashed.saturating_add(bytes);
                let due = Duration::from_secs_f64(hashed as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(pass.elapsed()) {
                    std::thread::sleep(wait);
                }
            };
            let Some(disk) = cache.disk() else { return };
            let metrics = cache.metrics();
            match disk.check(key, Hashing::Paced(&mut pace)) {
                Checked::Good(bytes) => {
                    MountMetrics::inc(&metrics.scrub_files);
                    MountMetrics::add(&metrics.scrub_bytes, bytes);
                }
                Checked::Bad => {
                    MountMetrics::inc(&metrics.scrub_files);
                    MountMetrics::inc(&metrics.scrub_failures);
                    cache.integrity().refetch(key);
                }
                Checked::Gone => {}
            }
        }
        // Sleeps in short steps, so that a dropped cache ends the thread soon.
        while pass.elapsed() < options.pass_interval {
            if weak.upgrade().is_none() {
                return;
            }
            std::thread::sleep(
                options
                    .pass_interval
                    .saturating_sub(pass.elapsed())
                    .min(Duration::from_millis(200)),
            );
        }
    }
}
