//! Learned prefetch (`--learned-prefetch`, on unless turned off): the first mount of a version
//! records the order in which its readers first asked for chunks and stores it beside the
//! manifest as an immutable profile (`sealed_store::prefetch_profile`); a later mount of the version,
//! on any node, finds the profile and fetches those chunks in that order, many at once, before
//! the loader asks for them.
//!
//! - **Recording** counts only reader demand (`SealedFs::read`), not the mount's readahead or
//!   prefetches: those guess from the reader's position, and recording them would replay the
//!   guess, not what the workload read. It ends with the cold start (readers quiet for
//!   [`crate::cold_start::QUIET`] after their first byte, or [`crate::cold_start::LONGEST`]) or at unmount,
//!   and the profile is written once (conditional create: the first mount to finish wins).
//! - **Scope.** A profile is stored and looked up under the mount's scope
//!   ([`sealed_store::prefetch_profile::ProfileScope`]: in the CSI plugin the pod's namespace and
//!   SealedVolume, for `sealed mount` its `--profile-scope`): readers in one tenant's scope
//!   never steer what another's mounts fetch. Unscoped profiles of earlier releases are not
//!   read.
//! - **Replay** trusts the profile for order only: it is decoded with bounds, must name this
//!   manifest and only its chunks, and every chunk is still fetched through the verified path.
//!   A profile that fails any check is ignored (logged, counted by reason), never a mount
//!   error. It needs the disk tier: the bounded memory tier would evict chunks fetched far
//!   ahead of the loader before it reads them.
//! - **Replay follows the readers** ([`ReplayWatch`]): it starts at the first read and fetches
//!   at most [`REPLAY_READ_MULTIPLE`](crate::REPLAY_READ_MULTIPLE) times the bytes of the chunks readers asked for so far,
//!   and it stops for good as soon as readers diverge from the profile (more than one in
//!   [`DIVERGENCE_RATIO`](crate::DIVERGENCE_RATIO) of the chunks they asked for is not in it) or go quiet. Even within
//!   one scope, a profile steers no mount much further than its own readers go.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use sealed_store::prefetch_profile::ProfileScope;
use sealed_store::{ChunkRef, Digest, Profile, ProfileError};
use tokio::task::JoinHandle;

use crate::error::FetchError;
use crate::fs::SealedFs;
use crate::metrics::MountMetrics;
use crate::profile_recorder::{Admit, ProfileRecorder, ReplayWatch};

/// How often the recording looks whether the cold start is over.
const POLL: Duration = Duration::from_millis(500);
/// How long an unmount waits for the profile to be written.
const WRITE_AT_UNMOUNT: Duration = Duration::from_secs(5);
/// A mount's learned prefetch: replaying a stored profile, or recording one.
pub(crate) struct LearnedPrefetch {
    task: JoinHandle<()>,
    scope: ProfileScope,
}

impl LearnedPrefetch {
    /// Starts it for `fs` in `scope` (needs a tokio runtime context), before the mount serves
    /// its first request: recording begins at once, so that reads made while the stored
    /// profile is looked up are not missed; a profile found there ends the recording
    /// unwritten.
    pub(crate) fn start(fs: Arc<SealedFs>, scope: ProfileScope) -> LearnedPrefetch {
        fs.start_recording();
        LearnedPrefetch {
            task: tokio::spawn(run(fs, scope.clone())),
            scope,
        }
    }

    /// The mount is ending: a recording under way is written now (what was read so far),
    /// waiting at most [`WRITE_AT_UNMOUNT`]; a replay stops.
    pub(crate) async fn finish(&self, fs: &SealedFs) {
        if fs.recorder().is_some() {
            let _ = tokio::time::timeout(WRITE_AT_UNMOUNT, write(fs, &self.scope)).await;
        }
        self.task.abort();
        if let Some(watch) = fs.replay_watch() {
            watch.end();
        }
    }
}

impl Drop for LearnedPrefetch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(fs: Arc<SealedFs>, scope: ProfileScope) {
    let digest = *fs.digest();
    let metrics = fs.metrics();
    let stored = match fs.store().get_profile_bytes(&digest, &scope).await {
        Ok(stored) => stored,
        Err(sealed_store::Error::ResponseTooLarge { .. }) => {
            abandon_recording(&fs);
            let oversized = ProfileError::Oversized {
                len: sealed_store::prefetch_profile::MAX_PROFILE_BYTES.saturating_add(1),
                limit: sealed_store::prefetch_profile::MAX_PROFILE_BYTES,
            };
            ignored(metrics, &digest, &oversized);
            return;
        }
        Err(e) => {
            // Not knowing whether one is there, this mount neither replays nor records.
            abandon_recording(&fs);
            tracing::warn!(%digest, error = %e, "cannot read the learned prefetch profile");
            return;
        }
    };
    let Some(bytes) = stored else {
        record(&fs, &scope).await;
        return;
    };
    // A profile is stored (usable or not): this mount is not the first, nothing to record.
    let chunks = match resolve(&fs, &bytes) {
        Ok(chunks) => chunks,
        Err(e) => {
            abandon_recording(&fs);
            ignored(metrics, &digest, &e);
            return;
        }
    };
    if fs.cache().disk().is_none() {
        abandon_recording(&fs);
        tracing::info!(%digest, "no disk cache: the learned prefetch profile is not replayed");
        return;
    }
    // Watching from before the recording ends, whose reads so far count too (a chunk seen
    // by both counts once).
    let watch = fs.watch_replay(chunks.iter().map(|c| c.digest).collect());
    if let Some(early) = fs.recorder().and_then(ProfileRecorder::finish) {
        let known: HashMap<Digest, ChunkRef> = fs
            .tree()
            .files()
            .flat_map(|(_, f)| f.chunks.iter().map(|c| (c.digest, *c)))
            .collect();
        let read: Vec<ChunkRef> = early
            .chunks
            .iter()
            .filter_map(|d| known.get(d).copied())
            .collect();
        watch.observe(&read);
    }
    replay(&fs, watch, chunks).await;
    watch.end();
}

/// The profile in `bytes` as chunks of this mount's version, in profile order.
fn resolve(fs: &SealedFs, bytes: &[u8]) -> Result<Vec<ChunkRef>, ProfileError> {
    let profile = Profile::decode(bytes, fs.digest())?;
    let known: HashMap<Digest, ChunkRef> = fs
        .tree()
        .files()
        .flat_map(|(_, f)| f.chunks.iter().map(|c| (c.digest, *c)))
        .collect();
    profile.resolve(&known)
}

fn ignored(metrics: &MountMetrics, digest: &Digest, e: &ProfileError) {
    metrics.count_ignored_profile(e.reason());
    tracing::warn!(%digest, reason = e.reason(), error = %e, "learned prefetch profile ignored");
}

/// Ends the recording without writing it.
fn abandon_recording(fs: &SealedFs) {
    if let Some(recorder) = fs.recorder() {
        let _ = recorder.finish();
    }
}

/// Records until the cold start is over (or the mount ends), then writes the profile.
async fn record(fs: &SealedFs, scope: &ProfileScope) {
    let Some(recorder) = fs.recorder() else {
        return;
    };
    loop {
        tokio::time::sleep(POLL).await;
        if recorder.is_finished() || fs.cold_start().snapshot().is_over() {
            break;
        }
    }
    write(fs, scope).await;
}

/// Ends the recording and writes its profile in `scope` (once; nothing if nothing was read).
async fn write(fs: &SealedFs, scope: &ProfileScope) {
    let Some(profile) = fs.recorder().and_then(ProfileRecorder::finish) else {
        return;
    };
    let metrics = fs.metrics();
    let entries = profile.chunks.len();
    match fs.store().put_profile(&profile, scope).await {
        Ok(written) => {
            if written {
                MountMetrics::inc(&metrics.learned_profiles_written);
            }
            tracing::info!(digest = %profile.manifest, %scope, entries, written, "learned prefetch profile recorded");
        }
        Err(e) => {
            MountMetrics::inc(&metrics.learned_profile_write_failures);
            tracing::warn!(digest = %profile.manifest, error = %e, "cannot store the learned prefetch profile");
        }
    }
}

/// Fetches `chunks` in order, as many at once as the mount's prefetch slots allow and as far
/// as `watch` lets it (see [`ReplayWatch`]), then assembles the files it completed for
/// passthrough.
async fn replay(fs: &SealedFs, watch: &ReplayWatch, chunks: Vec<ChunkRef>) {
    let digest = fs.digest();
    let metrics = fs.metrics();
    MountMetrics::inc(&metrics.learned_profiles_replayed);
    let entries = chunks.len();
    let width = fs.fetches_per_read().max(1);
    let mut pending = chunks.into_iter();
    let mut flights = futures::stream::FuturesUnordered::new();
    let (mut tally, mut stopped, mut exhausted) = (Tally::default(), false, false);
    // A plain loop, not stream combinators: closures over references that return futures make
    // the task's future lose `Send` (a higher-ranked lifetime the compiler cannot prove).
    loop {
        let next = if stopped || exhausted || flights.len() >= width {
            None
        } else {
            let next = pending.next();
            exhausted = next.is_none();
            next
        };
        let Some(chunk) = next else {
            match flights.next().await {
                Some(result) => tally.add(result, metrics, digest),
                None if stopped || exhausted => break,
                None => {}
            }
            continue;
        };
        // Waiting for the readers while the fetches under way go on.
        let admission = admit(fs, watch, chunk);
        tokio::pin!(admission);
        let admitted = loop {
            tokio::select! {
                admitted = &mut admission => break admitted,
                Some(result) = flights.next(), if !flights.is_empty() => {
                    tally.add(result, metrics, digest);
                }
            }
        };
        match admitted {
            Some(chunk) => flights.push(crate::prefetch::fetch_ahead(fs, chunk)),
            None => stopped = true,
        }
    }
    if stopped {
        MountMetrics::inc(&metrics.learned_replays_stopped);
    }
    tracing::info!(%digest, entries, admitted = tally.done, failed = tally.failed, stopped,
        "learned prefetch profile replayed");
    fs.cache().flush().await;
    // Only files whose every chunk is here: assembling fetches what is missing, which would
    // step past the replay's bound.
    for (_, file) in fs.tree().files() {
        let complete = file.chunks.len() > 1
            && file
                .chunks
                .iter()
                .all(|c| fs.cache().is_local_or_coming(&c.digest));
        if complete && let Err(e) = crate::hydrate::assemble(fs.cache(), fs.store(), file).await {
            tracing::warn!(blake3 = %file.blake3, error = %e, "assembling a replayed file failed");
        }
    }
}

/// The replay's fetches so far.
#[derive(Default)]
struct Tally {
    done: u64,
    failed: u64,
}

impl Tally {
    fn add(&mut self, result: Result<bool, FetchError>, metrics: &MountMetrics, digest: &Digest) {
        self.done += 1;
        match result {
            Ok(true) => MountMetrics::inc(&metrics.learned_prefetch_chunks),
            Ok(false) => {}
            Err(e) => {
                self.failed += 1;
                tracing::debug!(%digest, error = %e, "learned prefetch of a chunk failed");
            }
        }
    }
}

/// Waits until `watch` lets the replay fetch `chunk`; `None` once readers diverged from the
/// profile, or went quiet before asking for enough.
async fn admit(fs: &SealedFs, watch: &ReplayWatch, chunk: ChunkRef) -> Option<ChunkRef> {
    loop {
        // Registered before looking, so that a read in between is not missed.
        let grew = watch.grew.notified();
        tokio::pin!(grew);
        grew.as_mut().enable();
        let local = fs.cache().is_local_or_coming(&chunk.digest);
        match watch.admit(u64::from(chunk.len), local) {
            Admit::Fetch => return Some(chunk),
            Admit::Diverged => {
                tracing::info!(digest = %fs.digest(), "readers diverged from the learned prefetch profile: replay stopped");
                return None;
            }
            Admit::Wait => {}
        }
        if fs.cold_start().snapshot().is_over() {
            return None;
        }
        tokio::select! {
            _ = &mut grew => {}
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::profile_recorder::REPLAY_READ_MULTIPLE;

    fn c(i: u8) -> ChunkRef {
        ChunkRef {
            digest: Digest::of(&[i]),
            len: 1,
        }
    }

    #[test]
    fn keeps_first_reads_in_order_and_once() {
        let r = ProfileRecorder::new(Digest::of(b"m"));
        r.record(&[c(2), c(0)]);
        r.record(&[c(2), c(1), c(0)]);
        let p = r.finish().expect("a profile");
        assert_eq!(p.chunks, vec![c(2).digest, c(0).digest, c(1).digest]);
        assert_eq!(p.manifest, Digest::of(b"m"));
        r.record(&[c(4)]);
        assert!(r.finish().is_none(), "finished once");
    }

    #[test]
    fn replay_stays_within_a_multiple_of_what_was_read() {
        let w = ReplayWatch::new([c(0).digest, c(1).digest].into());
        assert_eq!(w.admit(1, false), Admit::Wait, "nothing read yet");
        assert_eq!(
            w.admit(1, true),
            Admit::Fetch,
            "a local chunk costs nothing"
        );
        w.observe(&[c(0)]);
        for _ in 0..REPLAY_READ_MULTIPLE {
            assert_eq!(w.admit(1, false), Admit::Fetch);
        }
        assert_eq!(w.admit(1, false), Admit::Wait);
        w.observe(&[c(0)]);
        assert_eq!(
            w.admit(1, false),
            Admit::Wait,
            "a chunk read again is no new demand"
        );
    }

    #[test]
    fn replay_stops_when_readers_leave_the_profile() {
        let profile: HashSet<Digest> = (0..20).map(|i| c(i).digest).collect();
        let w = ReplayWatch::new(profile);
        w.observe(&[c(100)]);
        assert_eq!(w.admit(1, true), Admit::Diverged, "a miss before any hit");
        let w = ReplayWatch::new((0..20).map(|i| c(i).digest).collect());
        w.observe(&(0..16).map(c).collect::<Vec<_>>());
        w.observe(&[c(100), c(101)]);
        assert_eq!(w.admit(1, false), Admit::Fetch, "two misses in eighteen");
        w.observe(&[c(102)]);
        assert_eq!(w.admit(1, false), Admit::Diverged);
    }

    #[test]
    fn nothing_read_is_no_profile() {
        assert!(ProfileRecorder::new(Digest::of(b"m")).finish().is_none());
    }
}
