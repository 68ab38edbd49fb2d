//! One mount's cold start in numbers: how long the mount took to be ready, when the first
//! byte was read, how many bytes its readers got, and from which tier the chunks this mount
//! brought into the node came. The node-wide counters ([`crate::MountMetrics`]) mix every
//! mount on the node; these are one mount's, so that the CSI plugin can tell a team why
//! *their* cold start was slow (a pod Event and the `sealed_cold_start_*` metrics).
//!
//! Tier bytes count each chunk once, for the mount whose read or readahead started its
//! fetch: a chunk another reader already had in flight or in memory is a memory hit here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::metrics::Tier;

/// Readers quiet this long after their first byte: the cold start is over.
pub const QUIET: Duration = Duration::from_secs(5);
/// The cold start is over by then however the mount is read (a mount nobody reads included).
pub const LONGEST: Duration = Duration::from_secs(600);

/// Nanoseconds since the mount began; `NONE` until the event happens.
const NONE: u64 = u64::MAX;

#[derive(Debug)]
pub struct ColdStart {
    /// When the record was made (with the filesystem, after the manifest was fetched);
    /// times are counted from the start of the mount, `shift_ns` earlier.
    began: Instant,
    shift_ns: AtomicU64,
    ready_ns: AtomicU64,
    first_read_ns: AtomicU64,
    last_read_ns: AtomicU64,
    bytes_read: AtomicU64,
    tier_bytes: [AtomicU64; 4],
}

impl Default for ColdStart {
    fn default() -> Self {
        ColdStart::new(Instant::now())
    }
}

/// A copy of a [`ColdStart`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ColdStartSnapshot {
    /// From the start of the mount (manifest fetch included) to serving requests.
    pub ready: Option<Duration>,
    /// From the start of the mount to the first byte returned to a reader.
    pub first_byte: Option<Duration>,
    /// From the start of the mount to the latest byte returned to a reader.
    pub last_read: Option<Duration>,
    /// Since the start of the mount, when the copy was taken.
    pub age: Duration,
    pub bytes_read: u64,
    /// Chunk bytes by [`Tier`] (memory, disk, peer, origin).
    pub tier_bytes: [u64; 4],
}

impl ColdStart {
    /// A record of a mount that began at `began` (before its manifest was fetched).
    pub fn new(began: Instant) -> ColdStart {
        ColdStart {
            began,
            shift_ns: AtomicU64::new(0),
            ready_ns: AtomicU64::new(NONE),
            first_read_ns: AtomicU64::new(NONE),
            last_read_ns: AtomicU64::new(NONE),
            bytes_read: AtomicU64::new(0),
            tier_bytes: Default::default(),
        }
    }

    fn since_began(&self) -> u64 {
        // `NONE` is out of reach: u64 nanoseconds is 584 years.
        u64::try_from(self.began.elapsed().as_nanos())
            .unwrap_or(NONE - 1)
            .saturating_add(self.shift_ns.load(Ordering::Relaxed))
            .min(NONE - 1)
    }

    /// The mount that began at `started` serves requests now. Before this, nothing is read.
    pub(crate) fn mark_ready(&self, started: Instant) {
        let shift = self.began.saturating_duration_since(started);
        let shift = u64::try_from(shift.as_nanos()).unwrap_or(0);
        let _ = self
            .shift_ns
            .compare_exchange(0, shift, Ordering::Relaxed, Ordering::Relaxed);
        let _ = self.ready_ns.compare_exchange(
            NONE,
            self.since_began(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// `bytes` returned to a reader just now.
    pub(crate) fn record_read(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let now = self.since_began();
        let _ =
            self.first_read_ns
                .compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed);
        // `NONE` is the largest value, so a plain max would never move it: replace it first.
        let _ = self
            .last_read_ns
            .compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed);
        self.last_read_ns.fetch_max(now, Ordering::Relaxed);
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A chunk of `bytes` this mount got from `tier`.
    pub(crate) fn record_chunk(&self, tier: Tier, bytes: u64) {
        self.tier_bytes[tier as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> ColdStartSnapshot {
        let at = |a: &AtomicU64| match a.load(Ordering::Relaxed) {
            NONE => None,
            ns => Some(Duration::from_nanos(ns)),
        };
        let mut tier_bytes = [0u64; 4];
        for (out, a) in tier_bytes.iter_mut().zip(&self.tier_bytes) {
            *out = a.load(Ordering::Relaxed);
        }
        ColdStartSnapshot {
            ready: at(&self.ready_ns),
            first_byte: at(&self.first_read_ns),
            last_read: at(&self.last_read_ns),
            age: Duration::from_nanos(self.since_began()),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            tier_bytes,
        }
    }
}

impl ColdStartSnapshot {
    /// Bytes read per second from the mount being ready to the latest read (what a loader
    /// saw, its waits on cold chunks included); `None` before any read.
    pub fn effective_bytes_per_second(&self) -> Option<f64> {
        let span = self
            .last_read?
            .checked_sub(self.ready.unwrap_or_default())?;
        let secs = span.as_secs_f64();
        (secs > 0.0).then(|| self.bytes_read as f64 / secs)
    }

    /// How long readers have been quiet: since the latest read, or since the mount was ready
    /// when nothing was read yet.
    pub fn idle(&self) -> Duration {
        let since = self.last_read.or(self.ready).unwrap_or_default();
        self.age.saturating_sub(since)
    }

    pub fn tier(&self, tier: Tier) -> u64 {
        self.tier_bytes[tier as usize]
    }

    /// The cold start is over: readers went quiet for [`QUIET`] after reading, or the
    /// mount is [`LONGEST`] old. (The CSI plugin then records it; the learned prefetch
    /// writes its profile.)
    pub fn is_over(&self) -> bool {
        (self.first_byte.is_some() && self.idle() >= QUIET) || self.age >= LONGEST
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_set_first_and_last_byte_and_the_rate() {
        let started = Instant::now() - Duration::from_secs(10);
        // The record is made once the manifest is in, 4 s into the mount.
        let c = ColdStart::new(started + Duration::from_secs(4));
        assert_eq!(c.snapshot().first_byte, None);
        assert_eq!(c.snapshot().effective_bytes_per_second(), None);
        c.mark_ready(started);
        assert!(c.snapshot().ready.unwrap() >= Duration::from_secs(10));
        c.record_read(0);
        assert_eq!(
            c.snapshot().first_byte,
            None,
            "an empty read is no first byte"
        );
        c.record_read(1000);
        std::thread::sleep(Duration::from_millis(20));
        c.record_read(1000);
        c.record_chunk(Tier::Origin, 4096);
        c.record_chunk(Tier::Memory, 10);
        let s = c.snapshot();
        let (first, last) = (s.first_byte.unwrap(), s.last_read.unwrap());
        assert!(first >= Duration::from_secs(10) && last >= first + Duration::from_millis(20));
        assert_eq!(s.bytes_read, 2000);
        assert_eq!((s.tier(Tier::Origin), s.tier(Tier::Memory)), (4096, 10));
        let rate = s.effective_bytes_per_second().unwrap();
        assert!(rate > 0.0 && rate <= 2000.0 / 0.02, "{rate}");
        // The second ready mark does not move the first.
        let ready = s.ready;
        c.mark_ready(Instant::now());
        assert_eq!(c.snapshot().ready, ready);
    }
}
