//! The bandwidth-delay product of each store link, measured from the node's own fetches, so
//! that readahead keeps enough bytes in flight to fill the link and no more.
//!
//! A window smaller than the link's bandwidth-delay product leaves it idle for part of every
//! round trip: a fixed 64 MiB window caps a 50 ms store at ~1.3 GB/s per file. A larger fixed
//! one spends memory on links that do not need it. So each store's link keeps two numbers, in
//! the way BBR does: the shortest recent fetch time (the round trip plus one chunk's transfer,
//! a slight over-estimate of the delay) and the highest recent delivery rate (bytes of
//! completed fetches per interval). Their product is the bytes the link holds in flight at
//! full rate. A window-limited link delivers `window / rtt`, so a window of twice the product
//! grows while the rate keeps rising and settles at twice the product once the link, not
//! the window, is the limit.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The delivery rate is measured over intervals this long.
const RATE_INTERVAL: Duration = Duration::from_millis(250);
/// The highest rate of the last this many intervals counts (2 s): a lull (the reader
/// computing) does not shrink the window at once.
const RATE_INTERVALS: usize = 8;
/// The shortest fetch time of the last this long counts: a route change is noticed.
const RTT_WINDOW: Duration = Duration::from_secs(10);

/// Every store's link, by store name. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Links {
    stores: Arc<Mutex<HashMap<String, Arc<Link>>>>,
}

impl Links {
    /// The link to `store` (made on first use).
    pub(crate) fn get(&self, store: &str) -> Arc<Link> {
        let mut stores = self.stores.lock();
        if let Some(link) = stores.get(store) {
            return link.clone();
        }
        stores
            .entry(store.to_owned())
            .or_insert_with(|| Arc::new(Link::new(Instant::now())))
            .clone()
    }
}

/// One store link's estimate.
pub(crate) struct Link {
    /// The bandwidth-delay product in bytes, read on every FUSE read without a lock.
    bdp: AtomicU64,
    state: Mutex<Estimate>,
}

struct Estimate {
    /// Windowed minimum of fetch times: the current window's and the previous one's.
    rtt: Option<Duration>,
    previous_rtt: Option<Duration>,
    rtt_window_start: Instant,
    /// Bytes delivered in the interval that began at `interval_start`.
    interval_start: Instant,
    interval_bytes: u64,
    /// Bytes per second of the last [`RATE_INTERVALS`] completed intervals.
    rates: [u64; RATE_INTERVALS],
    next_rate: usize,
}

impl Link {
    fn new(now: Instant) -> Link {
        Link {
            bdp: AtomicU64::new(0),
            state: Mutex::new(Estimate {
                rtt: None,
                previous_rtt: None,
                rtt_window_start: now,
                interval_start: now,
                interval_bytes: 0,
                rates: [0; RATE_INTERVALS],
                next_rate: 0,
            }),
        }
    }

    /// A fetch of `bytes` from the store completed at `now` after `took`.
    pub(crate) fn record(&self, now: Instant, took: Duration, bytes: u64) {
        let mut e = self.state.lock();
        if now.saturating_duration_since(e.rtt_window_start) >= RTT_WINDOW {
            e.previous_rtt = e.rtt.take();
            e.rtt_window_start = now;
        }
        e.rtt = Some(e.rtt.map_or(took, |r| r.min(took)));
        // Close every interval that ended before `now` (idle ones deliver nothing).
        let mut closed = 0;
        while now.saturating_duration_since(e.interval_start) >= RATE_INTERVAL
            && closed <= RATE_INTERVALS
        {
            let rate = per_second(e.interval_bytes, RATE_INTERVAL);
            let slot = e.next_rate;
            e.rates[slot] = rate;
            e.next_rate = (slot + 1) % RATE_INTERVALS;
            e.interval_bytes = 0;
            e.interval_start += RATE_INTERVAL;
            closed += 1;
        }
        if closed > RATE_INTERVALS {
            // Idle for longer than the whole rate window: start afresh from now.
            e.interval_start = now;
        }
        e.interval_bytes = e.interval_bytes.saturating_add(bytes);
        let bdp = e.bdp();
        self.bdp.store(bdp, Ordering::Relaxed);
    }

    /// The link's bandwidth-delay product in bytes; 0 until it has been measured.
    pub(crate) fn bdp(&self) -> u64 {
        self.bdp.load(Ordering::Relaxed)
    }
}

impl Estimate {
    fn bdp(&self) -> u64 {
        let rtt = match (self.rtt, self.previous_rtt) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return 0,
        };
        let rate = self.rates.iter().copied().max().unwrap_or(0);
        let bdp = u128::from(rate).saturating_mul(rtt.as_micros()) / 1_000_000;
        u64::try_from(bdp).unwrap_or(u64::MAX)
    }
}

fn per_second(bytes: u64, over: Duration) -> u64 {
    let rate = u128::from(bytes).saturating_mul(1_000_000) / over.as_micros().max(1);
    u64::try_from(rate).unwrap_or(u64::MAX)
}

/// The largest readahead window for a link holding `bdp` bytes in flight: twice the product
/// (so that a window-limited link is seen to be one and the window grows), never below
/// `floor` (the configured window: a link not yet measured, or a short one, reads as before)
/// nor above `ceiling` (what memory allows). A floor of 0 is readahead turned off.
pub(crate) fn window_for(floor: u64, ceiling: u64, bdp: u64) -> u64 {
    if floor == 0 {
        return 0;
    }
    bdp.saturating_mul(2).clamp(floor, ceiling.max(floor))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Fetches of `chunk` bytes taking `rtt` each, `in_flight` at once, for `secs` seconds.
    fn drive(link: &Link, start: Instant, rtt: Duration, chunk: u64, in_flight: u64, secs: u64) {
        let rounds = secs * 1000 / rtt.as_millis() as u64;
        for round in 1..=rounds {
            let now = start + rtt * round as u32;
            for _ in 0..in_flight {
                link.record(now, rtt, chunk);
            }
        }
    }

    #[test]
    fn the_product_is_the_rate_times_the_round_trip() {
        let start = Instant::now();
        let link = Link::new(start);
        assert_eq!(link.bdp(), 0, "nothing measured yet");
        // 64 fetches of 1 MiB every 50 ms: 1.34 GB/s over a 50 ms trip, 64 MiB in flight.
        drive(&link, start, Duration::from_millis(50), MIB, 64, 3);
        let bdp = link.bdp();
        assert!((60 * MIB..=68 * MIB).contains(&bdp), "{bdp}");
    }

    #[test]
    fn a_window_limited_link_grows_its_window_until_the_ceiling() {
        // One store at 500 ms: each window's worth of chunks arrives once per trip, so the
        // rate the link shows is window / rtt and twice that product is a larger window.
        let start = Instant::now();
        let link = Link::new(start);
        let (floor, ceiling) = (64 * MIB, 1024 * MIB);
        let mut window = floor;
        let mut now = start;
        for _ in 0..12 {
            for _ in 0..6 {
                now += Duration::from_millis(500);
                for _ in 0..window / MIB {
                    link.record(now, Duration::from_millis(500), MIB);
                }
            }
            window = window_for(floor, ceiling, link.bdp());
        }
        assert_eq!(window, ceiling, "grew to the memory bound");
    }

    #[test]
    fn a_short_link_keeps_the_configured_window() {
        let start = Instant::now();
        let link = Link::new(start);
        // A local store: 1 ms trips; 4 MiB in flight is all it holds.
        drive(&link, start, Duration::from_millis(1), MIB, 4, 2);
        assert!(link.bdp() < 8 * MIB, "{}", link.bdp());
        assert_eq!(window_for(64 * MIB, 256 * MIB, link.bdp()), 64 * MIB);
    }

    #[test]
    fn window_bounds() {
        assert_eq!(window_for(0, 256 * MIB, 1 << 40), 0, "off stays off");
        assert_eq!(window_for(64 * MIB, 256 * MIB, 100 * MIB), 200 * MIB);
        assert_eq!(window_for(64 * MIB, 256 * MIB, u64::MAX), 256 * MIB);
        assert_eq!(
            window_for(64 * MIB, 32 * MIB, 0),
            64 * MIB,
            "a ceiling under the floor"
        );
    }

    #[test]
    fn the_round_trip_is_forgotten_after_two_windows() {
        let start = Instant::now();
        let link = Link::new(start);
        link.record(start, Duration::from_millis(1), MIB);
        // The route got slower: after two RTT windows the fast sample no longer counts.
        let later = start + RTT_WINDOW * 2 + Duration::from_secs(1);
        drive(&link, later, Duration::from_millis(100), MIB, 10, 12);
        let bdp = link.bdp();
        // 10 MiB per 100 ms over 100 ms: ~10 MiB (with the 1 ms sample it would be ~0.1 MiB).
        assert!(bdp > 8 * MIB, "{bdp}");
    }

    #[test]
    fn a_long_idle_spell_restarts_the_intervals() {
        let start = Instant::now();
        let link = Link::new(start);
        link.record(
            start + Duration::from_secs(3600),
            Duration::from_millis(5),
            MIB,
        );
        link.record(
            start + Duration::from_secs(3601),
            Duration::from_millis(5),
            MIB,
        );
        assert!(link.bdp() <= 2 * MIB, "{}", link.bdp());
    }
}
