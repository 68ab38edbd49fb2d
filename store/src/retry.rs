//! Jittered exponential backoff for the workspace's own retry loops (a lease waiting for a
//! collection, gc waiting for writers, a source download broken off, the CSI plugin's store
//! retries). The schedule is `backon`'s (a maintained crate, already in the tree through
//! kube-runtime), with its jitter: the n-th delay is uniform in `[d, 2d)` where `d` doubles
//! from `first` and stops at `cap / 2`, so every delay is in `[first, cap)`.
//!
//! Why jitter: a fleet whose store went away at one instant otherwise retries in lockstep, at
//! 50 ms, 100 ms, 200 ms..., every node at once. With jitter, the retries of a given round
//! spread over a window as wide as the round's base delay (the width full jitter has, shifted
//! up so that no retry comes almost at once).
//!
//! The object store client's own retries (`object_store`'s `RetryConfig`, see
//! [`crate::store`]) are jittered by `object_store` itself (decorrelated jitter).

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Where a retry loop's delays start and the bound they stay under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    first: Duration,
    cap: Duration,
}

impl RetryPolicy {
    /// Delays in `[first, cap)`, the base doubling per attempt. A `cap` below `2 * first`
    /// is raised to it (the first delay's jitter needs room).
    pub fn new(first: Duration, cap: Duration) -> Self {
        let first = first.max(Duration::from_millis(1));
        Self {
            first,
            cap: cap.max(first.saturating_mul(2)),
        }
    }

    /// The first delay's lower bound.
    pub fn first(&self) -> Duration {
        self.first
    }

    /// The bound every delay stays under.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    fn builder(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_jitter()
            .with_factor(2.0)
            .with_min_delay(self.first)
            .with_max_delay(self.cap / 2)
            .without_max_times()
    }

    /// A schedule of its own (a random seed): two loops, or two nodes, get different delays.
    pub fn schedule(&self) -> Schedule {
        Schedule {
            inner: self.builder().build(),
            policy: *self,
        }
    }

    /// A schedule from a given seed (tests).
    pub fn schedule_seeded(&self, seed: u64) -> Schedule {
        Schedule {
            inner: self.builder().with_jitter_seed(seed).build(),
            policy: *self,
        }
    }

    /// The delay before retry `attempt` (1-based) of a loop that counts attempts instead of
    /// keeping a [`Schedule`]: drawn anew, in the same bounds as the schedule's.
    pub fn delay(&self, attempt: u32) -> Duration {
        // Past 64 doublings the base is at the cap for any durations: no need to draw them.
        let skip = usize::try_from(attempt.saturating_sub(1).min(64)).unwrap_or(64);
        self.schedule().nth(skip).unwrap_or(self.first)
    }
}

/// The delays of one retry loop, endless: the caller's deadline or attempt count ends it.
#[derive(Debug)]
pub struct Schedule {
    inner: ExponentialBackoff,
    policy: RetryPolicy,
}

impl Schedule {
    /// The delay before the next retry.
    pub fn next_delay(&mut self) -> Duration {
        // backon's schedule without a count or total never ends; the clamp keeps the bound
        // even if its arithmetic saturated.
        self.inner
            .next()
            .unwrap_or(self.policy.cap)
            .clamp(self.policy.first, self.policy.cap)
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: fn() -> RetryPolicy =
        || RetryPolicy::new(Duration::from_millis(50), Duration::from_secs(1));

    /// Each delay is in `[base, 2 * base)` for its round's base (`first` doubling, at most
    /// `cap / 2`), so in `[first, cap)`.
    fn assert_bounded(delays: &[Duration], policy: RetryPolicy) {
        let mut base = policy.first();
        for (n, d) in delays.iter().enumerate() {
            assert!(
                *d >= base && *d < base * 2 && *d < policy.cap() && *d >= policy.first(),
                "delay {n} = {d:?} outside [{base:?}, {:?}) (cap {:?})",
                base * 2,
                policy.cap()
            );
            base = (base * 2).min(policy.cap() / 2);
        }
    }

    #[test]
    fn two_schedules_differ_and_stay_in_bounds() {
        let policy = POLICY();
        let a: Vec<_> = policy.schedule_seeded(1).take(12).collect();
        let b: Vec<_> = policy.schedule_seeded(2).take(12).collect();
        assert_bounded(&a, policy);
        assert_bounded(&b, policy);
        // Not one round in lockstep: the fleet's retries spread.
        for (n, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_ne!(x, y, "round {n} in lockstep: {a:?} / {b:?}");
        }
        // Two unseeded schedules (two nodes) differ too, and stay in bounds.
        let c: Vec<_> = policy.schedule().take(12).collect();
        let d: Vec<_> = policy.schedule().take(12).collect();
        assert_bounded(&c, policy);
        assert_bounded(&d, policy);
        assert_ne!(c, d);
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let policy = POLICY();
        let a: Vec<_> = policy.schedule_seeded(7).take(8).collect();
        let b: Vec<_> = policy.schedule_seeded(7).take(8).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn many_draws_spread_over_the_rounds_window() {
        // 200 nodes' first retries: spread over [first, 2 first), not all at one instant.
        let policy = POLICY();
        let firsts: std::collections::BTreeSet<_> = (0..200)
            .map(|_| policy.delay(1).as_micros() / 1000)
            .collect();
        assert!(firsts.len() >= 25, "{firsts:?}");
        assert!(firsts.iter().all(|ms| (50..100).contains(ms)), "{firsts:?}");
        // A late attempt stays under the cap (and the last one costs no more than the 65th).
        for attempt in (0..100).map(|_| 40).chain([u32::MAX]) {
            let late = policy.delay(attempt);
            assert!(late >= policy.cap() / 2 && late < policy.cap(), "{late:?}");
        }
    }

    #[test]
    fn a_cap_below_the_first_jitter_window_is_raised() {
        let policy = RetryPolicy::new(Duration::from_secs(1), Duration::from_millis(10));
        assert_eq!(policy.cap(), Duration::from_secs(2));
        let delays: Vec<_> = policy.schedule().take(5).collect();
        assert_bounded(&delays, policy);
    }
}
