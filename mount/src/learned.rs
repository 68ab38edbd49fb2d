//! Learned prefetch (`--learned-prefetch`, on unless turned off): the first mount of a version
//! records the order in which its readers first asked for chunks and stores it beside the
//! manifest as an immutable profile (`sealed_store::profile`); a later mount of the version,
//! on any node, finds the profile and fetches those chunks in that order, many at once, before
//! the loader asks for them.
//!
//! - **Recording** counts only reader demand (`SealedFs::read`), not the mount's readahead or
//!   prefetches: those guess from the reader's position, and recording them would replay the
//!   guess, not what the workload read. It ends with the cold start (readers quiet for
//!   [`crate::cold_start::QUIET`] after their first byte, or [`crate::cold_start::LONGEST`]) or at unmount,
//!   and the profile is written once (conditional create: the first mount to finish wins).
//! - **Replay** trusts the profile for order only: it is decoded with bounds, must name this
//!   manifest and only its chunks, and every chunk is still fetched through the verified path.
//!   A profile that fails any check is ignored (logged, counted by reason), never a mount
//!   error. It needs the disk tier: the bounded memory tier would evict chunks fetched far
//!   ahead of the loader before it reads them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;
use sealed_store::profile::MAX_PROFILE_ENTRIES;
use sealed_store::{ChunkRef, Digest, Profile, ProfileError};
use tokio::task::JoinHandle;

use crate::fs::SealedFs;
use crate::metrics::MountMetrics;

/// How often the recording looks whether the cold start is over.
const POLL: Duration = Duration::from_millis(500);
/// How long an unmount waits for the profile to be written.
const WRITE_AT_UNMOUNT: Duration = Duration::from_secs(5);

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

    fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Ends the recording once; `None` when it was ended already or nothing was read.
    fn finish(&self) -> Option<Profile> {
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

/// A mount's learned prefetch: replaying a stored profile, or recording one.
pub(crate) struct LearnedPrefetch {
    task: JoinHandle<()>,
}

impl LearnedPrefetch {
    /// Starts it for `fs` (needs a tokio runtime context), before the mount serves its first
    /// request: recording begins at once, so that reads made while the stored profile is
    /// looked up are not missed; a profile found there ends the recording unwritten.
    pub(crate) fn start(fs: Arc<SealedFs>) -> LearnedPrefetch {
        fs.start_recording();
        LearnedPrefetch {
            task: tokio::spawn(run(fs)),
        }
    }

    /// The mount is ending: a recording under way is written now (what was read so far),
    /// waiting at most [`WRITE_AT_UNMOUNT`]; a replay stops.
    pub(crate) async fn finish(&self, fs: &SealedFs) {
        if fs.recorder().is_some() {
            let _ = tokio::time::timeout(WRITE_AT_UNMOUNT, write(fs)).await;
        }
        self.task.abort();
    }
}

impl Drop for LearnedPrefetch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(fs: Arc<SealedFs>) {
    let digest = *fs.digest();
    let metrics = fs.metrics();
    let stored = match fs.store().get_profile_bytes(&digest).await {
        Ok(stored) => stored,
        Err(sealed_store::Error::ResponseTooLarge { .. }) => {
            abandon_recording(&fs);
            let oversized = ProfileError::Oversized {
                len: sealed_store::profile::MAX_PROFILE_BYTES.saturating_add(1),
                limit: sealed_store::profile::MAX_PROFILE_BYTES,
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
        record(&fs).await;
        return;
    };
    // A profile is stored (usable or not): this mount is not the first, nothing to record.
    abandon_recording(&fs);
    match resolve(&fs, &bytes) {
        Ok(chunks) => replay(&fs, chunks).await,
        Err(e) => ignored(metrics, &digest, &e),
    }
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
async fn record(fs: &SealedFs) {
    let Some(recorder) = fs.recorder() else {
        return;
    };
    loop {
        tokio::time::sleep(POLL).await;
        if recorder.is_finished() || fs.cold_start().snapshot().is_over() {
            break;
        }
    }
    write(fs).await;
}

/// Ends the recording and writes its profile (once; nothing if nothing was read).
async fn write(fs: &SealedFs) {
    let Some(profile) = fs.recorder().and_then(ProfileRecorder::finish) else {
        return;
    };
    let metrics = fs.metrics();
    let entries = profile.chunks.len();
    match fs.store().put_profile(&profile).await {
        Ok(written) => {
            if written {
                MountMetrics::inc(&metrics.learned_profiles_written);
            }
            tracing::info!(digest = %profile.manifest, entries, written, "learned prefetch profile recorded");
        }
        Err(e) => {
            MountMetrics::inc(&metrics.learned_profile_write_failures);
            tracing::warn!(digest = %profile.manifest, error = %e, "cannot store the learned prefetch profile");
        }
    }
}

/// Fetches `chunks` in order, as many at once as the mount's prefetch slots allow, then
/// assembles the files they complete for passthrough.
async fn replay(fs: &SealedFs, chunks: Vec<ChunkRef>) {
    let digest = fs.digest();
    if fs.cache().disk().is_none() {
        tracing::info!(%digest, "no disk cache: the learned prefetch profile is not replayed");
        return;
    }
    let metrics = fs.metrics();
    MountMetrics::inc(&metrics.learned_profiles_replayed);
    let entries = chunks.len();
    let wanted: HashSet<Digest> = chunks.iter().map(|c| c.digest).collect();
    let results: Vec<_> = futures::stream::iter(chunks)
        .map(|chunk| crate::prefetch::fetch_ahead(fs, chunk))
        .buffered(fs.fetches_per_read())
        .collect()
        .await;
    let mut failed = 0u64;
    for result in results {
        match result {
            Ok(true) => MountMetrics::inc(&metrics.learned_prefetch_chunks),
            Ok(false) => {}
            Err(e) => {
                failed += 1;
                tracing::debug!(%digest, error = %e, "learned prefetch of a chunk failed");
            }
        }
    }
    tracing::info!(%digest, entries, failed, "learned prefetch profile replayed");
    fs.cache().flush().await;
    for (_, file) in fs.tree().files() {
        let complete =
            file.chunks.len() > 1 && file.chunks.iter().all(|c| wanted.contains(&c.digest));
        if complete && let Err(e) = crate::hydrate::assemble(fs.cache(), fs.store(), file).await {
            tracing::warn!(blake3 = %file.blake3, error = %e, "assembling a replayed file failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn nothing_read_is_no_profile() {
        assert!(ProfileRecorder::new(Digest::of(b"m")).finish().is_none());
    }
}
