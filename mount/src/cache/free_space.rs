//! The disk cache's free-space guard: the cache's byte bound (`--cache-size`) is its own, but
//! the filesystem under it is shared (a node's root disk, with the kubelet, images and logs).
//! Before a chunk or an assembled file is written, the guard checks the filesystem
//! (`statvfs`): if writing it would leave less than `min_free_percent` of the filesystem
//! free, the cache first evicts its own least recently used entries (unpinned ones; a warming
//! insert evicts none) until the write fits above the floor, and if that is not enough it
//! does not cache the entry. Reads never depend on it: an entry not cached is served from the
//! upper tiers (memory, peers, the store) as before; the node's disk is not filled to the
//! kubelet's eviction threshold or to ENOSPC by the cache.
//!
//! Counted: `sealed_cache_free_space_guard_total` (entries not cached for the floor; its
//! evictions count in `sealed_disk_cache_evictions_total`) and the gauge
//! `sealed_cache_filesystem_free_bytes`; a warning is logged when the floor is first reached
//! and an info line when the filesystem is above it again. docs/operations.md, "The cache is
//! full", says what to do.
//!
//! A child module of `disk` (it evicts through the cache's index and pins).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use super::{DiskCache, Key};
use crate::metrics::MountMetrics;

/// The default floor: the reference node agents keep 10 % free (the kubelet's default
/// `nodefs.available` hard eviction threshold is 10 %).
pub const DEFAULT_MIN_FREE_PERCENT: u8 = 10;

/// Entries evicted for the floor for one insert, at most (each then checked with statvfs).
const MAX_EVICTIONS_PER_INSERT: usize = 4096;

/// The guard's settings and state, one per disk cache.
pub(crate) struct FreeSpaceGuard {
    /// 0: off (only the cache's own byte bound applies).
    min_free_percent: AtomicU8,
    /// Below the floor since the last check (for one warning per episode).
    short: AtomicBool,
}

impl Default for FreeSpaceGuard {
    fn default() -> Self {
        FreeSpaceGuard {
            min_free_percent: AtomicU8::new(DEFAULT_MIN_FREE_PERCENT),
            short: AtomicBool::new(false),
        }
    }
}

/// The cache filesystem's size and free bytes (for unprivileged writers, `f_bavail`).
#[derive(Clone, Copy, Debug)]
struct Space {
    total: u64,
    free: u64,
}

// `u64::from`: the statvfs fields are u64 on 64-bit Linux, narrower elsewhere.
#[allow(clippy::useless_conversion)]
fn space(dir: &Path) -> std::io::Result<Space> {
    let st = nix_statvfs(dir)?;
    let frsize = u64::from(st.f_frsize);
    Ok(Space {
        total: u64::from(st.f_blocks).saturating_mul(frsize),
        free: u64::from(st.f_bavail).saturating_mul(frsize),
    })
}

fn nix_statvfs(dir: &Path) -> std::io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a valid NUL-terminated path and a pointer to writable statvfs storage.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    Ok(unsafe { st.assume_init() })
}

/// Bytes to free so that `incoming` more bytes leave at least `percent` of `space` free.
fn shortfall(space: Space, percent: u8, incoming: u64) -> u64 {
    let floor = space.total / 100 * u64::from(percent.min(100))
        + space.total % 100 * u64::from(percent.min(100)) / 100;
    floor.saturating_add(incoming).saturating_sub(space.free)
}

impl DiskCache {
    /// Sets the floor: `percent` of the cache filesystem kept free (0 turns the guard off).
    /// Values above 90 are taken as 90 (a floor the cache could never stay above).
    pub fn set_min_free_percent(&self, percent: u8) {
        self.free_space
            .min_free_percent
            .store(percent.min(90), Ordering::Relaxed);
    }

    /// The floor now, percent of the filesystem.
    pub fn min_free_percent(&self) -> u8 {
        self.free_space.min_free_percent.load(Ordering::Relaxed)
    }

    /// Whether `len` bytes for `key` may be written with the filesystem staying above the
    /// floor, evicting this cache's least recently used unpinned entries to get there (none
    /// when `spare_recent` is set: a warming insert is refused instead). True when `key` is
    /// cached already, the guard is off, or the filesystem cannot be measured (the cache's
    /// byte bound still holds).
    pub(super) fn free_space_for(
        &self,
        key: Key,
        len: u64,
        spare_recent: Option<Duration>,
    ) -> bool {
        let percent = self.min_free_percent();
        if percent == 0 || self.index.lock().contains(&key) {
            return true;
        }
        let mut victims: Option<std::vec::IntoIter<Key>> = None;
        let mut evicted = 0usize;
        loop {
            let now = match space(&self.dir) {
                Ok(now) => now,
                Err(e) => {
                    tracing::debug!(dir = %self.dir.display(), error = %e, "cannot measure the cache filesystem");
                    return true;
                }
            };
            self.metrics
                .cache_filesystem_free_bytes
                .store(now.free, Ordering::Relaxed);
            if shortfall(now, percent, len) == 0 {
                if evicted > 0 {
                    self.publish();
                }
                if self.free_space.short.swap(false, Ordering::Relaxed) {
                    tracing::info!(dir = %self.dir.display(), free = now.free, min_free_percent = percent,
                        "cache filesystem above its free-space floor again; caching resumed");
                }
                return true;
            }
            let next = if spare_recent.is_some() || evicted >= MAX_EVICTIONS_PER_INSERT {
                None
            } else {
                let victims = victims.get_or_insert_with(|| self.index.lock().keys().into_iter());
                let pins = self.pins.lock();
                victims.find(|k| *k != key && !pins.contains_key(k))
            };
            let Some(victim) = next else {
                if evicted > 0 {
                    self.publish();
                }
                MountMetrics::inc(&self.metrics.cache_free_space_refusals);
                if !self.free_space.short.swap(true, Ordering::Relaxed) {
                    tracing::warn!(dir = %self.dir.display(), free = now.free, total = now.total,
                        min_free_percent = percent, held = self.index.lock().bytes(),
                        "cache filesystem below its free-space floor: not caching new chunks \
                         (reads are served from memory, peers and the store); see docs/operations.md");
                }
                return false;
            };
            // Still indexed (not removed meanwhile by another path): evict it.
            if self.index.lock().remove(&victim).is_some() {
                self.delete([victim]);
                evicted += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::process::Command;
    use std::sync::Arc;

    use bytes::Bytes;
    use sealed_store::Digest;

    #[test]
    fn shortfall_is_the_floor_plus_the_write_minus_what_is_free() {
        let space = Space {
            total: 1000,
            free: 300,
        };
        assert_eq!(shortfall(space, 10, 100), 0);
        assert_eq!(shortfall(space, 10, 200), 0);
        assert_eq!(shortfall(space, 10, 250), 50);
        assert_eq!(shortfall(space, 0, 300), 0);
        assert_eq!(shortfall(space, 100, 0), 700);
        let huge = Space {
            total: u64::MAX,
            free: 0,
        };
        assert!(shortfall(huge, 50, u64::MAX) == u64::MAX);
    }

    /// A tmpfs of `mib` MiB, unmounted on drop.
    struct Tmpfs {
        dir: tempfile::TempDir,
    }

    impl Tmpfs {
        fn mount(mib: u32) -> Option<Tmpfs> {
            let dir = tempfile::tempdir().ok()?;
            let ok = Command::new("mount")
                .args([
                    "-t",
                    "tmpfs",
                    "-o",
                    &format!("size={mib}m,mode=0700"),
                    "tmpfs",
                ])
                .arg(dir.path())
                .status()
                .is_ok_and(|s| s.success());
            ok.then_some(Tmpfs { dir })
        }

        fn path(&self) -> PathBuf {
            self.dir.path().join("cache")
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.dir.path()).status();
        }
    }

    fn tmpfs_or_skip(test: &str, mib: u32) -> Option<Tmpfs> {
        let fs = Tmpfs::mount(mib);
        if fs.is_none() {
            let required = std::env::var("SEALED_REQUIRE_SERVERS").is_ok_and(|v| v == "1");
            assert!(!required, "{test}: cannot mount a tmpfs (needs root)");
            eprintln!("{test}: skipped: cannot mount a tmpfs (needs root)");
        }
        fs
    }

    fn chunk(i: u32, len: usize) -> (Digest, Bytes) {
        let data: Vec<u8> = (0..len)
            .map(|n| (n as u32).wrapping_mul(31).wrapping_add(i) as u8)
            .collect();
        (Digest::of(&data), Bytes::from(data))
    }

    fn free_percent(dir: &Path) -> f64 {
        let s = space(dir).unwrap();
        s.free as f64 * 100.0 / s.total as f64
    }

    /// An 8 MiB filesystem under a cache whose own bound (64 MiB) would never stop it: 16 MiB
    /// of chunks keep the filesystem above the 25 % floor (old entries evicted, the newest
    /// cached and readable), no write hits ENOSPC, and with the guard off the same writes
    /// fill the filesystem (what the code before the guard did).
    #[test]
    fn a_small_filesystem_stays_above_the_floor() {
        const TEST: &str = "a_small_filesystem_stays_above_the_floor";
        let Some(fs) = tmpfs_or_skip(TEST, 8) else {
            return;
        };
        let metrics = Arc::new(MountMetrics::default());
        let cache = DiskCache::open(&fs.path(), 64 << 20, metrics.clone()).unwrap();
        cache.set_min_free_percent(25);
        let chunks: Vec<_> = (0..32).map(|i| chunk(i, 512 << 10)).collect();
        let mut lowest = 100.0f64;
        for (digest, data) in &chunks {
            cache.put(digest, data);
            lowest = lowest.min(free_percent(&fs.path()));
        }
        assert!(
            lowest >= 25.0,
            "the filesystem went down to {lowest:.1} % free"
        );
        // The newest chunk is cached and reads back verified; the oldest were evicted.
        let (newest, data) = chunks.last().unwrap();
        assert_eq!(cache.get(newest).as_ref(), Some(data));
        assert!(cache.get(&chunks[0].0).is_none());
        let snap = metrics.snapshot();
        assert!(snap.disk_evictions >= 16, "{snap:?}");
        assert!(snap.cache_filesystem_free_bytes > 0, "{snap:?}");

        // A warming insert evicts nothing for the floor: it is refused and counted.
        let held: Vec<_> = cache.keys();
        let (warm, warm_data) = chunk(1000, 2 << 20);
        assert!(!cache.put_sparing(&warm, &warm_data, Some(Duration::from_secs(60))));
        assert_eq!(
            cache.keys().len(),
            held.len(),
            "warming evicted for the floor"
        );
        assert!(metrics.snapshot().cache_free_space_refusals >= 1);

        // Off: the same writes run the filesystem full (writes fail with ENOSPC, logged).
        cache.set_min_free_percent(0);
        for i in 100..132 {
            let (digest, data) = chunk(i, 512 << 10);
            cache.put(&digest, &data);
        }
        assert!(
            free_percent(&fs.path()) < 10.0,
            "without the guard the filesystem should have filled: {:.1} % free",
            free_percent(&fs.path())
        );
    }

    /// Pinned entries (open for passthrough) are never evicted for the floor: when only they
    /// are left, the new entry is not cached (and counted), and nothing fails.
    #[test]
    fn pinned_entries_stay_and_the_new_entry_is_not_cached() {
        const TEST: &str = "pinned_entries_stay_and_the_new_entry_is_not_cached";
        let Some(fs) = tmpfs_or_skip(TEST, 8) else {
            return;
        };
        let metrics = Arc::new(MountMetrics::default());
        let cache = DiskCache::open(&fs.path(), 64 << 20, metrics.clone()).unwrap();
        cache.set_min_free_percent(50);
        let first: Vec<_> = (0..6).map(|i| chunk(i, 512 << 10)).collect();
        for (digest, data) in &first {
            cache.put(digest, data);
            cache.pin(Key::Chunk(*digest));
        }
        let (late, data) = chunk(99, 2 << 20);
        assert!(!cache.put_sparing(&late, &data, None));
        assert!(cache.get(&late).is_none());
        for (digest, data) in &first {
            assert_eq!(
                cache.get(digest).as_ref(),
                Some(data),
                "a pinned entry went"
            );
        }
        assert!(metrics.snapshot().cache_free_space_refusals >= 1);
        assert!(free_percent(&fs.path()) >= 50.0);
    }
}
