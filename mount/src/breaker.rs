//! A circuit breaker per object store: after a fetch from a store fails by timeout or backend
//! error (after its retries), further fetches from that store fail at once for a short open
//! window instead of each waiting out the timeout again. Then one probe fetch goes through
//! (half-open); its success closes the breaker, its failure opens it again.
//!
//! Why: the kernel answers an EIO from an async readahead request by sending the same range
//! again, synchronously. Without a memory of the failure, that second request waits the
//! whole fetch bound a second time, so one `pread` took twice (or more) the documented bound.
//!
//! Opening the breaker also ends the fetches from that store still waiting on an attempt
//! (they watch [`Admission::Go`]'s receiver), so that no reader waits longer than the bound
//! measured from its own start.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

enum State {
    Closed,
    Open {
        until: Instant,
    },
    /// A probe fetch is under way; everyone else fails fast until it answers.
    HalfOpen,
}

struct Entry {
    state: State,
    /// Bumped every time the breaker opens: fetches under way watch it.
    opened: watch::Sender<u64>,
}

/// What a fetch may do now.
pub(crate) enum Admission {
    /// Go ahead. `opened` changes if the breaker opens meanwhile; `probe` says this fetch is
    /// the half-open probe (its [`ProbeGuard`] reopens the breaker if it never reports).
    Go {
        opened: watch::Receiver<u64>,
        probe: Option<ProbeGuard>,
    },
    /// Fail now: the store failed moments ago; the breaker lets a probe through after this.
    FailFast { retry_in: Duration },
}

/// The breakers of every store a [`crate::NodeCache`] reads from, keyed by the store's name
/// (its URL).
pub(crate) struct Breakers {
    open_for: Duration,
    stores: std::sync::Arc<Mutex<HashMap<String, Entry>>>,
}

impl Breakers {
    /// `open_for` zero turns the breaker off.
    pub(crate) fn new(open_for: Duration) -> Breakers {
        Breakers {
            open_for,
            stores: Default::default(),
        }
    }

    pub(crate) fn admit(&self, store: &str) -> Admission {
        let mut stores = self.stores.lock();
        let entry = stores.entry(store.to_owned()).or_insert_with(|| Entry {
            state: State::Closed,
            opened: watch::channel(0).0,
        });
        let probe = match entry.state {
            State::Closed => None,
            State::HalfOpen => {
                return Admission::FailFast {
                    retry_in: Duration::ZERO,
                };
            }
            State::Open { until } => {
                let now = Instant::now();
                if now < until {
                    return Admission::FailFast {
                        retry_in: until - now,
                    };
                }
                entry.state = State::HalfOpen;
                Some(ProbeGuard {
                    stores: self.stores.clone(),
                    store: store.to_owned(),
                    done: false,
                })
            }
        };
        Admission::Go {
            opened: entry.opened.subscribe(),
            probe,
        }
    }

    /// The store answered: close its breaker.
    pub(crate) fn success(&self, store: &str, probe: Option<ProbeGuard>) {
        if let Some(mut p) = probe {
            p.done = true;
        }
        if let Some(entry) = self.stores.lock().get_mut(store) {
            entry.state = State::Closed;
        }
    }

    /// A fetch from the store failed by timeout or backend error after its retries: open the
    /// breaker (and end the fetches from that store still under way). Returns true if this
    /// opened it (it was not open already).
    pub(crate) fn failure(&self, store: &str, probe: Option<ProbeGuard>) -> bool {
        if let Some(mut p) = probe {
            p.done = true;
        }
        if self.open_for.is_zero() {
            return false;
        }
        let mut stores = self.stores.lock();
        let Some(entry) = stores.get_mut(store) else {
            return false;
        };
        let was_open = matches!(entry.state, State::Open { until } if until > Instant::now());
        entry.state = State::Open {
            until: Instant::now() + self.open_for,
        };
        entry.opened.send_modify(|n| *n = n.wrapping_add(1));
        !was_open
    }
}

/// Held by the half-open probe. A probe that ends without saying how it went (its task was
/// cancelled) leaves the breaker open with no wait, so the next fetch probes again.
pub(crate) struct ProbeGuard {
    stores: std::sync::Arc<Mutex<HashMap<String, Entry>>>,
    store: String,
    done: bool,
}

impl Drop for ProbeGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(entry) = self.stores.lock().get_mut(&self.store)
            && matches!(entry.state, State::HalfOpen)
        {
            entry.state = State::Open {
                until: Instant::now(),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn go(a: Admission) -> (watch::Receiver<u64>, Option<ProbeGuard>) {
        match a {
            Admission::Go { opened, probe } => (opened, probe),
            Admission::FailFast { .. } => panic!("expected Go"),
        }
    }

    #[test]
    fn opens_on_failure_then_lets_one_probe_through() {
        let b = Breakers::new(Duration::from_millis(50));
        let (first, _) = go(b.admit("s3://a"));
        assert!(b.failure("s3://a", None));
        assert!(first.has_changed().unwrap(), "fetches under way hear of it");
        assert!(matches!(b.admit("s3://a"), Admission::FailFast { .. }));
        // Another store is not affected.
        go(b.admit("s3://b"));
        std::thread::sleep(Duration::from_millis(60));
        let (_, probe) = go(b.admit("s3://a"));
        assert!(probe.is_some());
        assert!(matches!(b.admit("s3://a"), Admission::FailFast { .. }));
        b.success("s3://a", probe);
        let (_, probe) = go(b.admit("s3://a"));
        assert!(probe.is_none(), "closed again");
    }

    #[test]
    fn a_probe_that_vanishes_lets_the_next_fetch_probe() {
        let b = Breakers::new(Duration::from_millis(10));
        go(b.admit("x"));
        b.failure("x", None);
        std::thread::sleep(Duration::from_millis(20));
        let (_, probe) = go(b.admit("x"));
        drop(probe);
        let (_, probe) = go(b.admit("x"));
        assert!(probe.is_some());
    }

    #[test]
    fn zero_window_is_off() {
        let b = Breakers::new(Duration::ZERO);
        go(b.admit("x"));
        assert!(!b.failure("x", None));
        let (_, probe) = go(b.admit("x"));
        assert!(probe.is_none());
    }
}
