//! The readers' side of the learned prefetch (`crate::learned`): the recorder of a mount's
//! first reads and the watch a replay follows. The filesystem feeds both on every read, so
//! they live apart from the task that writes and replays profiles, which needs the
//! filesystem.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use sealed_store::prefetch_profile::MAX_PROFILE_ENTRIES;
use sealed_store::{ChunkRef, Digest, Profile};
use tokio::sync::Notify;

/// A replay fetches at most this many times the bytes readers asked for: a loader that reads
/// what the profile says is soon far behind it (the bound grows with every chunk it reads),
/// one that reads a small file of a large version makes it fetch little more than that file.
pub const REPLAY_READ_MULTIPLE: u64 = 8;
/// Readers diverged once more than one in this many of the chunks they asked for since the
/// replay began is not in the profile (any miss before eight hits).
pub const DIVERGENCE_RATIO: u64 = 8;

/// Records first reads, at most [`MAX_PROFILE_ENTRIES`] entries.
pub(crate) struct ProfileRecorder {
    manifest: Digest,
    /// Set once the recording ended: reads after it skip the lock.
    finished: AtomicBool,
    inner: Mutex<Recording>,
}

struct Recording {
    seen: HashSet<Digest>,
    order: Vec<Digest>,
}

impl ProfileRecorder {
    pub(crate) fn new(manifest: Digest) -> Self {
        ProfileRecorder {
            manifest,
            finished: AtomicBool::new(false),
            inner: Mutex::new(Recording {
                seen: HashSet::new(),
                order: Vec::new(),
            }),
        }
    }

    /// A reader asked for `chunks`; only each one's first ask is kept, and nothing after the
    /// cap or after [`ProfileRecorder::finish`].
    pub(crate) fn record(&self, chunks: &[ChunkRef]) {
        if self.is_finished() {
            return;
        }
        let mut r = self.inner.lock();
        // Checked again under the lock: `finish` may have taken the order meanwhile.
        if self.is_finished() {
            return;
        }
        for chunk in chunks {
            if r.order.len() >= MAX_PROFILE_ENTRIES {
                return;
            }
            if r.seen.insert(chunk.digest) {
                r.order.push(chunk.digest);
            }
        }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Ends the recording once; `None` when it was ended already or nothing was read.
    pub(crate) fn finish(&self) -> Option<Profile> {
        let mut r = self.inner.lock();
        if self.finished.swap(true, Ordering::AcqRel) {
            return None;
        }
        r.seen = HashSet::new();
        let chunks = std::mem::take(&mut r.order);
        (!chunks.is_empty()).then_some(Profile {
            manifest: self.manifest,
            chunks,
        })
    }
}

/// What readers ask for while a profile is replayed: the replay's budget and its brake.
pub(crate) struct ReplayWatch {
    /// Set once the replay ended: reads after it skip the lock.
    ended: AtomicBool,
    inner: Mutex<Demand>,
    /// Woken when readers ask for a chunk they had not asked for before.
    pub(crate) grew: Notify,
}

struct Demand {
    /// The profile's chunks.
    profile: HashSet<Digest>,
    /// The distinct chunks readers asked for, their bytes, and how many are (not) in the
    /// profile.
    seen: HashSet<Digest>,
    read_bytes: u64,
    on_profile: u64,
    off_profile: u64,
    /// Bytes the replay set out to fetch.
    fetched: u64,
}

/// What the replay may do with its next chunk.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    Fetch,
    Wait,
    Diverged,
}

impl ReplayWatch {
    pub(crate) fn new(profile: HashSet<Digest>) -> ReplayWatch {
        ReplayWatch {
            ended: AtomicBool::new(false),
            inner: Mutex::new(Demand {
                profile,
                seen: HashSet::new(),
                read_bytes: 0,
                on_profile: 0,
                off_profile: 0,
                fetched: 0,
            }),
            grew: Notify::new(),
        }
    }

    /// A reader asked for `chunks`.
    pub(crate) fn observe(&self, chunks: &[ChunkRef]) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        let mut grew = false;
        {
            let mut d = self.inner.lock();
            for chunk in chunks {
                if !d.seen.insert(chunk.digest) {
                    continue;
                }
                d.read_bytes = d.read_bytes.saturating_add(u64::from(chunk.len));
                if d.profile.contains(&chunk.digest) {
                    d.on_profile = d.on_profile.saturating_add(1);
                } else {
                    d.off_profile = d.off_profile.saturating_add(1);
                }
                grew = true;
            }
        }
        if grew {
            self.grew.notify_waiters();
        }
    }

    pub(crate) fn end(&self) {
        self.ended.store(true, Ordering::Release);
        let mut d = self.inner.lock();
        d.seen = HashSet::new();
        d.profile = HashSet::new();
    }

    /// Whether the replay may set out to fetch `len` more bytes now (`local`: the chunk is
    /// here or coming already, and costs nothing).
    pub(crate) fn admit(&self, len: u64, local: bool) -> Admit {
        let mut d = self.inner.lock();
        if d.off_profile > d.on_profile / DIVERGENCE_RATIO {
            return Admit::Diverged;
        }
        if local {
            return Admit::Fetch;
        }
        let budget = d.read_bytes.saturating_mul(REPLAY_READ_MULTIPLE);
        match d.fetched.checked_add(len) {
            Some(total) if total <= budget => {
                d.fetched = total;
                Admit::Fetch
            }
            _ => Admit::Wait,
        }
    }
}
