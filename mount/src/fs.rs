//! The plain read API over one sealed version: what the FUSE adapter calls, and what tests
//! drive without a kernel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use parking_lot::Mutex;
use sealed_store::{ChunkRef, ChunkStore, Digest, FileEntry};
use tokio::sync::Semaphore;

use crate::cold_start::ColdStart;
use crate::error::{FetchError, FsError};
use crate::fetch::{NodeCache, Request, Want};
use crate::limits::MountLimits;
use crate::link::Link;
use crate::metrics::MountMetrics;
use crate::model_prefetch::ModelPrefetch;
use crate::profile_recorder::{ProfileRecorder, ReplayWatch};
use crate::readahead::{AheadFetcher, Readahead, ReadaheadPolicy};
use crate::tree::{Attr, DirEntry, Node, NodeType, ROOT_INO, Tree, chunk_range};

/// What `statfs` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub blocks: u64,
    pub files: u64,
    pub block_size: u32,
    pub name_max: u32,
}

pub const BLOCK_SIZE: u32 = 4096;

/// One mounted version: the tree, where its chunks come from, and open-file state.
pub struct SealedFs {
    digest: Digest,
    tree: Tree,
    store: ChunkStore,
    cache: NodeCache,
    readahead: ReadaheadPolicy,
    handles: Mutex<HashMap<u64, Arc<Mutex<Readahead>>>>,
    next_handle: AtomicU64,
    /// Chunk fetches one read may have in flight.
    fetches_per_read: usize,
    /// The mount's fetches in flight (reads, readahead, model prefetch): a slot per fetch
    /// started.
    fetch_slots: Arc<Semaphore>,
    /// Model-aware prefetch on open (`crate::prefetch`), off unless turned on.
    model: ModelPrefetch,
    /// This mount's own numbers: time to first byte, bytes read, bytes per tier.
    cold_start: Arc<ColdStart>,
    /// Set when this mount records the learned prefetch profile (`crate::learned`).
    recorder: OnceLock<ProfileRecorder>,
    /// Set when this mount replays a learned prefetch profile: what its readers ask for.
    replay: OnceLock<ReplayWatch>,
    /// The store link's measured bandwidth-delay product sizes readahead (`crate::link`).
    link: Arc<Link>,
}

/// Handle numbers start from the clock, so that a process that resumed a mount does not hand
/// out the numbers of handles opened before its restart (they would share readahead state).
fn first_handle() -> u64 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    (secs << 24) | 1
}

impl SealedFs {
    pub fn new(
        digest: Digest,
        tree: Tree,
        store: ChunkStore,
        cache: NodeCache,
        readahead: ReadaheadPolicy,
    ) -> SealedFs {
        let (fetches_per_read, per_mount) = MountLimits::default().fetch_bounds();
        let fitted = readahead.fitted(cache.readahead_ceiling());
        if fitted.max < readahead.max {
            tracing::warn!(
                asked = readahead.max,
                window = fitted.max,
                "readahead window lowered to a quarter of the memory tier and half the readahead budget: \
                 without a disk cache a larger one evicts chunks before they are read"
            );
        }
        let readahead = fitted;
        // Files assembled on this node by earlier mounts serve their chunks from now on.
        if let Some(disk) = cache.disk() {
            for (_, file) in tree.files() {
                disk.register(file);
            }
        }
        let link = cache.link(store.name());
        SealedFs {
            link,
            digest,
            tree,
            store,
            cache,
            readahead,
            handles: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(first_handle()),
            fetches_per_read,
            fetch_slots: Arc::new(Semaphore::new(per_mount)),
            model: ModelPrefetch::new(per_mount),
            cold_start: Arc::new(ColdStart::default()),
            recorder: OnceLock::new(),
            replay: OnceLock::new(),
        }
    }

    /// The fetch bounds of `limits` (the size caps are checked before the tree is built).
    pub fn with_limits(mut self, limits: &MountLimits) -> SealedFs {
        let (per_read, per_mount) = limits.fetch_bounds();
        self.fetches_per_read = per_read;
        self.fetch_slots = Arc::new(Semaphore::new(per_mount));
        let enabled = self.model.enabled();
        self.model = ModelPrefetch::new(per_mount);
        self.model.set_enabled(enabled);
        self
    }

    /// Turns the model-aware prefetch on (or off) for opens from now on: the first open of
    /// each `*.safetensors` / `*.gguf` file fetches its tensors ahead of the reader
    /// (`crate::prefetch`).
    pub fn set_model_prefetch(&self, on: bool) {
        self.model.set_enabled(on);
    }

    /// This mount's cold-start record ([`ColdStart`]).
    pub fn cold_start(&self) -> &Arc<ColdStart> {
        &self.cold_start
    }

    /// Starts recording readers' first asks for the learned prefetch profile; `None` if a
    /// recording was started before.
    pub(crate) fn start_recording(&self) -> Option<&ProfileRecorder> {
        let mut fresh = false;
        let recorder = self.recorder.get_or_init(|| {
            fresh = true;
            ProfileRecorder::new(self.digest)
        });
        fresh.then_some(recorder)
    }

    pub(crate) fn recorder(&self) -> Option<&ProfileRecorder> {
        self.recorder.get()
    }

    /// Starts watching readers for the replay of a profile of these chunks (once per mount).
    pub(crate) fn watch_replay(&self, profile: std::collections::HashSet<Digest>) -> &ReplayWatch {
        self.replay.get_or_init(|| ReplayWatch::new(profile))
    }

    pub(crate) fn replay_watch(&self) -> Option<&ReplayWatch> {
        self.replay.get()
    }

    pub(crate) fn model_prefetch(&self) -> &ModelPrefetch {
        &self.model
    }

    /// Ends every model prefetch under way (the mount is ending).
    pub(crate) fn stop_prefetch(&self) {
        self.model.stop();
    }

    pub(crate) fn fetch_slots(&self) -> &Arc<Semaphore> {
        &self.fetch_slots
    }

    pub(crate) fn fetches_per_read(&self) -> usize {
        self.fetches_per_read
    }

    pub(crate) fn readahead_policy(&self) -> &ReadaheadPolicy {
        &self.readahead
    }

    /// The readahead policy for a read now: the configured window, grown to twice the store
    /// link's bandwidth-delay product when that is larger, within what memory allows.
    pub(crate) fn readahead_now(&self) -> ReadaheadPolicy {
        let max = crate::link::window_for(
            self.readahead.max,
            self.cache.readahead_limit(),
            self.link.bdp(),
        );
        // Written only when it moves: every read calls this, and a store on each would
        // bounce the gauge's cache line between the FUSE worker threads.
        let gauge = &self.metrics().readahead_window_bytes;
        if gauge.load(Ordering::Relaxed) != max {
            gauge.store(max, Ordering::Relaxed);
        }
        ReadaheadPolicy {
            initial: self.readahead.initial,
            max,
        }
    }

    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    pub fn store(&self) -> &ChunkStore {
        &self.store
    }

    pub fn cache(&self) -> &NodeCache {
        &self.cache
    }

    pub fn metrics(&self) -> &MountMetrics {
        self.cache.metrics()
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, FsError> {
        match self.tree.kind(parent) {
            None => return Err(FsError::NotFound),
            Some(NodeType::Dir) => {}
            Some(_) => return Err(FsError::NotDir),
        }
        let ino = self.tree.lookup(parent, name).ok_or(FsError::NotFound)?;
        self.getattr(ino)
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        self.tree.attr(ino).ok_or(FsError::NotFound)
    }

    /// Entries of a directory from position `offset` on: `.`, `..`, then children by name.
    /// Each entry's position + 1 is the offset to continue from.
    pub fn readdir(&self, ino: u64, offset: u64) -> Result<Vec<DirEntry>, FsError> {
        let mut out = Vec::new();
        self.readdir_with(ino, offset, |entry, _next| {
            out.push(entry);
            false
        })?;
        Ok(out)
    }

    /// Like [`SealedFs::readdir`], without building a list: `add(entry, next_offset)` returns
    /// true when the caller's buffer is full, which ends the walk.
    pub fn readdir_with(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(DirEntry, u64) -> bool,
    ) -> Result<(), FsError> {
        let slot = self.tree.slot(ino).ok_or(FsError::NotFound)?;
        let children = self.tree.children(ino).ok_or(FsError::NotDir)?;
        let parent = if ino == ROOT_INO {
            ROOT_INO
        } else {
            slot.parent
        };
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for position in skip..children.len() + 2 {
            let entry = match position {
                0 => DirEntry {
                    ino,
                    name: ".".into(),
                    kind: NodeType::Dir,
                },
                1 => DirEntry {
                    ino: parent,
                    name: "..".into(),
                    kind: NodeType::Dir,
                },
                _ => {
                    let child = children[position - 2];
                    let (Some(slot), Some(kind)) = (self.tree.slot(child), self.tree.kind(child))
                    else {
                        continue;
                    };
                    DirEntry {
                        ino: child,
                        name: slot.name.clone(),
                        kind,
                    }
                }
            };
            if add(entry, position as u64 + 1) {
                break;
            }
        }
        Ok(())
    }

    pub fn readlink(&self, ino: u64) -> Result<&str, FsError> {
        match &self.tree.slot(ino).ok_or(FsError::NotFound)?.node {
            Node::Symlink { target } => Ok(target),
            _ => Err(FsError::NotSymlink),
        }
    }

    /// Opens a file for reading; any write access is EROFS.
    pub fn open(&self, ino: u64, write: bool) -> Result<u64, FsError> {
        match self.tree.kind(ino) {
            None => return Err(FsError::NotFound),
            Some(NodeType::Dir) if write => return Err(FsError::IsDir),
            Some(_) if write => return Err(FsError::ReadOnly),
            Some(_) => {}
        }
        let fh = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, Arc::default());
        Ok(fh)
    }

    pub fn release(&self, fh: u64) {
        self.handles.lock().remove(&fh);
    }

    /// A handle of `ino` was released: if every chunk of the file is on the node now, it is
    /// assembled into a hydrated file in the background (`crate::hydrate`). Needs a tokio
    /// runtime context.
    pub fn released(&self, ino: u64) {
        if let Some(file) = self.file_entry(ino) {
            crate::hydrate::spawn_if_ready(&self.cache, &self.store, file);
        }
    }

    /// The manifest entry of file `ino` and its chunk offsets (followed by the file size).
    pub(crate) fn file_layout(&self, ino: u64) -> Option<(&FileEntry, &[u64])> {
        match &self.tree.slot(ino)?.node {
            Node::File { file, starts } => Some((file, starts)),
            _ => None,
        }
    }

    /// The manifest entry of file `ino`.
    pub fn file_entry(&self, ino: u64) -> Option<&FileEntry> {
        match &self.tree.slot(ino)?.node {
            Node::File { file, .. } => Some(file),
            _ => None,
        }
    }

    /// True if file `ino` has a complete copy in the node disk cache (verified by this
    /// process or not: `crate::verify`).
    pub fn is_hydrated(&self, ino: u64) -> bool {
        self.file_entry(ino)
            .is_some_and(|f| crate::hydrate::is_hydrated(&self.cache, f))
    }

    /// The complete copy of file `ino` on disk, if it is hydrated; passthrough serves it
    /// only once `verified`.
    pub(crate) fn hydrated_copy(&self, ino: u64) -> Option<crate::cache::WholeFile> {
        let file = self.file_entry(ino)?;
        if file.size == 0 {
            return None;
        }
        self.cache.disk()?.whole_file(file)
    }

    pub fn statfs(&self) -> StatFs {
        StatFs {
            blocks: self.tree.total_bytes().div_ceil(u64::from(BLOCK_SIZE)),
            files: self.tree.len() as u64,
            block_size: BLOCK_SIZE,
            name_max: 255,
        }
    }

    /// Up to `size` bytes of file `ino` from `offset` (fewer at the end of the file), every
    /// byte verified. `fh` (from [`SealedFs::open`]) drives readahead; `None` reads without.
    pub async fn read(
        &self,
        ino: u64,
        fh: Option<u64>,
        offset: u64,
        size: u32,
    ) -> Result<Bytes, FsError> {
        let result = self.read_inner(ino, fh, offset, size, true).await;
        match &result {
            Ok(data) => {
                MountMetrics::add(&self.metrics().bytes_read, data.len() as u64);
                self.cold_start.record_read(data.len() as u64);
            }
            Err(FsError::Fetch(e)) => {
                MountMetrics::inc(&self.metrics().read_errors);
                let path = self.tree.path(ino).unwrap_or_default();
                tracing::error!(path, offset, error = %e, "read failed");
            }
            Err(_) => {}
        }
        result
    }

    /// [`SealedFs::read`] for a prefetch of the mount's own (a model header): the same path
    /// and bounds, without readahead, and not counted as a reader's bytes or errors.
    pub(crate) async fn read_for_prefetch(
        &self,
        ino: u64,
        offset: u64,
        size: u32,
    ) -> Result<Bytes, FsError> {
        self.read_inner(ino, None, offset, size, false).await
    }

    async fn read_inner(
        &self,
        ino: u64,
        fh: Option<u64>,
        offset: u64,
        size: u32,
        reader: bool,
    ) -> Result<Bytes, FsError> {
        let (file, starts) = match &self.tree.slot(ino).ok_or(FsError::NotFound)?.node {
            Node::File { file, starts } => (file, starts),
            Node::Dir { .. } => return Err(FsError::IsDir),
            Node::Symlink { .. } => return Err(FsError::NotFound),
        };
        if let Some(fh) = fh {
            self.readahead(fh, &file.chunks, starts, file.size, offset, size);
        }
        if offset >= file.size || size == 0 {
            return Ok(Bytes::new());
        }
        let end = offset.saturating_add(u64::from(size)).min(file.size);
        let range = chunk_range(starts, offset, end);
        let wanted = file.chunks.get(range.clone()).unwrap_or_default();
        if reader {
            if let Some(recorder) = self.recorder.get() {
                recorder.record(wanted);
            }
            if let Some(watch) = self.replay.get() {
                watch.observe(wanted);
            }
        }
        // At most `fetches_per_read` chunks at once, in order: a read over a million tiny
        // chunks must not start a million fetches. Each chunk's bytes are verified against
        // its digest and its declared length (`NodeCache::get`), so the offsets below hold;
        // they are still computed checked, so that a broken invariant is EIO, never a panic
        // in a FUSE worker.
        let (cache, store, slots) = (&self.cache, &self.store, &self.fetch_slots);
        let tally = &self.cold_start;
        // Chunks by value: a closure over `&ChunkRef` would make the read's future lose
        // `Send` (a higher-ranked lifetime the compiler cannot prove general).
        let mut fetched = futures::stream::iter(wanted.iter().copied())
            .map(move |c| async move {
                let request = Request::new(Want::Reader).slots(slots).tally(tally);
                cache.fetch(store, &c, request).await
            })
            .buffered(self.fetches_per_read);
        let want = usize::try_from(end - offset).unwrap_or(0);
        let mut out = match wanted.len() {
            1 => BytesMut::new(),
            _ => BytesMut::with_capacity(want),
        };
        for (i, chunk) in range.zip(wanted) {
            let data = match fetched.next().await {
                Some(result) => result?,
                None => break,
            };
            let piece = starts
                .get(i)
                .and_then(|&chunk_start| {
                    let from = offset.saturating_sub(chunk_start);
                    let to = end.checked_sub(chunk_start)?.min(data.len() as u64);
                    let from = usize::try_from(from).ok()?;
                    let to = usize::try_from(to).ok()?;
                    (from <= to).then(|| data.slice(from..to))
                })
                .ok_or_else(|| {
                    FsError::Fetch(FetchError::Internal {
                        digest: chunk.digest,
                        reason: format!(
                            "chunk {i} of {} bytes does not cover the read at {offset}..{end}",
                            data.len()
                        ),
                    })
                })?;
            // A read inside one chunk is zero-copy.
            if wanted.len() == 1 {
                return Ok(piece);
            }
            out.extend_from_slice(&piece);
        }
        Ok(out.freeze())
    }

    fn readahead(
        &self,
        fh: u64,
        chunks: &[ChunkRef],
        starts: &[u64],
        file_size: u64,
        offset: u64,
        size: u32,
    ) {
        // A handle this process did not open was opened before a restart (the mount was
        // resumed): it gets its readahead state now.
        let state = self.handles.lock().entry(fh).or_default().clone();
        let mut state = state.lock();
        let policy = self.readahead_now();
        let Some(ahead) = state.on_read(&policy, offset, u64::from(size), file_size) else {
            return;
        };
        let fetcher = AheadFetcher {
            cache: &self.cache,
            store: &self.store,
            slots: &self.fetch_slots,
            tally: &self.cold_start,
        };
        state.issue(&fetcher, ahead, chunks, starts);
    }
}
