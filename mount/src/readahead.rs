//! Readahead: a window per open file that doubles on sequential reads and resets on a seek,
//! with one global budget on the bytes being read ahead at once (`fetch/budget.rs`; not per
//! file: per-file windows with no global bound are how FUSE filesystems run out of memory).
//!
//! Chunks read ahead land in the node's memory tier, which is itself bounded for the node.

use std::ops::Range;
use std::sync::Arc;

use sealed_store::{ChunkRef, ChunkStore};
use tokio::sync::Semaphore;

use crate::cold_start::ColdStart;
use crate::fetch::{NodeCache, Want};
use crate::tree::chunk_range;

/// How readahead grows.
#[derive(Clone, Copy, Debug)]
pub struct ReadaheadPolicy {
    /// Window after the first read and after every seek, bytes.
    pub initial: u64,
    /// Largest window, bytes.
    pub max: u64,
}

impl Default for ReadaheadPolicy {
    fn default() -> Self {
        ReadaheadPolicy {
            initial: 4 << 20,
            max: 64 << 20,
        }
    }
}

impl ReadaheadPolicy {
    /// This policy with its windows no larger than `ceiling` bytes. Without a disk tier,
    /// read-ahead chunks live only in the bounded memory tier: a window as large as it (or as
    /// the readahead budget) evicts chunks fetched ahead before the reader gets to them, and
    /// they are fetched again (measured: `--readahead 256Mi --no-disk-cache` fetched 1.78x a
    /// 512 MiB file from a 25 ms store, at half the rate).
    pub fn fitted(self, ceiling: Option<u64>) -> ReadaheadPolicy {
        match ceiling {
            Some(c) if self.max > c => ReadaheadPolicy {
                initial: self.initial.min(c),
                max: c,
            },
            _ => self,
        }
    }
}

/// The readahead state of one open file.
#[derive(Debug, Default)]
pub(crate) struct Readahead {
    /// End of the furthest read so far.
    next: u64,
    window: u64,
    /// Readahead has been issued up to here.
    issued_until: u64,
}

/// Kernel readahead sends several requests at once over several FUSE threads, so requests of
/// a sequential stream arrive slightly out of order: a read this close to the stream still
/// counts as sequential.
const REORDER_SLACK: u64 = 8 << 20;

impl Readahead {
    /// Records a read of `[offset, offset + len)` and returns the range to read ahead, if any.
    pub fn on_read(
        &mut self,
        policy: &ReadaheadPolicy,
        offset: u64,
        len: u64,
        file_size: u64,
    ) -> Option<Range<u64>> {
        if policy.max == 0 {
            return None;
        }
        let end = offset.saturating_add(len).min(file_size);
        let slack = REORDER_SLACK.max(self.window);
        let sequential =
            offset <= self.next.saturating_add(slack) && offset.saturating_add(slack) >= self.next;
        if sequential && self.window > 0 {
            self.window = (self.window * 2).min(policy.max);
        } else {
            self.window = policy.initial.min(policy.max);
            self.issued_until = end;
        }
        if sequential {
            self.next = self.next.max(end);
        } else {
            self.next = end;
        }
        let start = self.issued_until.max(end);
        let stop = end.saturating_add(self.window).min(file_size);
        if start >= stop {
            return None;
        }
        self.issued_until = stop;
        Some(start..stop)
    }

    /// Readahead could not be issued from `offset` on (budget spent): try again next read.
    pub fn retract(&mut self, offset: u64) {
        self.issued_until = self.issued_until.min(offset);
    }

    /// Starts the fetches of the chunks that hold `ahead` (a range [`Readahead::on_read`]
    /// returned), each in the background, not waited for: a chunk in memory or in flight is
    /// skipped; each fetch takes a slot of the mount and bytes of the node's budget, and
    /// when either is spent the rest of the window is retracted for the next read to issue.
    /// `starts` are the file's chunk offsets followed by its size.
    pub(crate) fn issue(
        &mut self,
        fetcher: &AheadFetcher<'_>,
        ahead: Range<u64>,
        chunks: &[ChunkRef],
        starts: &[u64],
    ) {
        let cache = fetcher.cache;
        for i in chunk_range(starts, ahead.start, ahead.end) {
            let (Some(&chunk), Some(&start)) = (chunks.get(i), starts.get(i)) else {
                return;
            };
            if cache.is_hot(&chunk.digest) {
                continue;
            }
            let len = u64::from(chunk.len);
            // Readahead takes a fetch slot of the mount or waits for a later read: it never
            // queues, so a window over tiny chunks cannot start a fetch per chunk.
            let Ok(slot) = fetcher.slots.clone().try_acquire_owned() else {
                self.retract(start);
                return;
            };
            if !cache.budget().try_acquire(len) {
                self.retract(start);
                return;
            }
            let flight = cache.flight(
                fetcher.store,
                &chunk,
                Want::Readahead,
                Some(slot),
                Some(fetcher.tally.clone()),
            );
            let cache = cache.clone();
            tokio::spawn(async move {
                // Errors are the reader's to see when it gets there; here they are counted.
                let _ = flight.await;
                cache.budget().release(len);
            });
        }
    }
}

/// What readahead's fetches go through: the mount's cache, store, fetch slots and cold-start
/// tally.
pub(crate) struct AheadFetcher<'a> {
    pub cache: &'a NodeCache,
    pub store: &'a ChunkStore,
    pub slots: &'a Arc<Semaphore>,
    pub tally: &'a Arc<ColdStart>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn window_grows_on_sequential_reads_and_resets_on_seek() {
        let policy = ReadaheadPolicy {
            initial: 2 * MIB,
            max: 8 * MIB,
        };
        let size = 1 << 40;
        let mut ra = Readahead::default();
        assert_eq!(ra.on_read(&policy, 0, MIB, size), Some(MIB..3 * MIB));
        assert_eq!(ra.on_read(&policy, MIB, MIB, size), Some(3 * MIB..6 * MIB));
        assert_eq!(
            ra.on_read(&policy, 2 * MIB, MIB, size),
            Some(6 * MIB..11 * MIB)
        );
        assert_eq!(
            ra.on_read(&policy, 3 * MIB, MIB, size),
            Some(11 * MIB..12 * MIB)
        );
        // A seek far away resets the window.
        assert_eq!(
            ra.on_read(&policy, 500 * MIB, MIB, size),
            Some(501 * MIB..503 * MIB)
        );
        // Never past the end of the file.
        let mut ra = Readahead::default();
        assert_eq!(ra.on_read(&policy, 0, MIB, MIB + 10), Some(MIB..MIB + 10));
        assert_eq!(ra.on_read(&policy, MIB, 10, MIB + 10), None);
        // Off means off.
        assert_eq!(
            ra.on_read(&ReadaheadPolicy { initial: 0, max: 0 }, 0, MIB, size),
            None
        );
    }

    #[test]
    fn windows_fit_under_the_ceiling() {
        let p = ReadaheadPolicy {
            initial: 4 << 20,
            max: 256 << 20,
        };
        let fitted = p.fitted(Some(128 << 20));
        assert_eq!((fitted.initial, fitted.max), (4 << 20, 128 << 20));
        let tiny = p.fitted(Some(1 << 20));
        assert_eq!((tiny.initial, tiny.max), (1 << 20, 1 << 20));
        let free = p.fitted(None);
        assert_eq!((free.initial, free.max), (p.initial, p.max));
        let small = ReadaheadPolicy { initial: 0, max: 0 }.fitted(Some(1 << 20));
        assert_eq!(small.max, 0, "off stays off");
    }

    #[test]
    fn only_a_cache_without_disk_caps_the_window() {
        use crate::fetch::{NodeCache, NodeCacheOptions};
        let memory_only = NodeCache::new(&NodeCacheOptions {
            memory_bytes: 64 << 20,
            readahead_bytes: 256 << 20,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(memory_only.readahead_ceiling(), Some(16 << 20));
        let dir = tempfile::tempdir().unwrap();
        let with_disk = NodeCache::new(&NodeCacheOptions {
            disk_dir: Some(dir.path().to_path_buf()),
            memory_bytes: 64 << 20,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(with_disk.readahead_ceiling(), None);
    }
}
