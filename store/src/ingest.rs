//! Ingest: seal a version from streams instead of a local directory.
//!
//! A source (a Hugging Face repository, a bucket prefix) hands each file over as an
//! [`AsyncRead`]; the bytes go through a bounded channel to the same chunker `push` uses
//! ([`chunk_reader_with_sink`], on a blocking thread), and every distinct chunk goes to the
//! same background [`Uploader`] push uses, which uploads the chunks the store lacks,
//! `concurrency` at a time. Nothing is staged on disk; memory stays at the chunker's read block
//! per file in flight plus `concurrency` chunks.
//!
//! [`Ingest::seal`] then builds the manifest exactly as `push` would for a directory holding
//! the same files (every parent directory synthesised, entries sorted by path), so the same
//! files give the same digest whichever way they arrive. The order is push's: every chunk
//! durable, then `sync`, then the manifest (conditional create), then the volume record.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

use crate::chunker::{ChunkParams, chunk_reader_with_sink};
use crate::error::{Error, Result};
use crate::manifest::{
    ChunkRef, Entry, EntryKind, FileEntry, Manifest, validate_path, validate_symlink_target,
};
use crate::progress::{Phase, Progress};
use crate::push::PushReport;
use crate::scan::check_symlink_loops;
use crate::seal::seal_manifest;
use crate::store::{ChunkStore, validate_volume_name};
use crate::upload::{ChunkSender, Uploader, UploaderStopped};
use crate::writer_lease::WriterLease;

/// How to ingest: the same knobs as a push.
#[derive(Clone, Debug)]
pub struct IngestOptions {
    /// The chunker; the default is the one `push` uses, which a digest-compatible sync needs.
    pub params: ChunkParams,
    /// Chunk existence checks and uploads in flight at once.
    pub concurrency: usize,
    /// Record the version under this volume name (`ns/name`).
    pub volume: Option<String>,
    /// Who holds the writer lease, for `sealed gc` to show ("sync hf://org/repo@commit").
    pub purpose: String,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            params: ChunkParams::default(),
            concurrency: 16,
            volume: None,
            purpose: "ingest".into(),
        }
    }
}

/// What an ingest sealed: the same numbers a push reports.
pub type IngestReport = PushReport;

/// Bytes the feeder gathers from the source before handing them to the chunker.
const FEED_BLOCK: usize = 1024 * 1024;
/// Blocks queued between the feeder and the chunker.
const FEED_DEPTH: usize = 4;

/// A version being sealed from streams. Add files (several at once if you like: every method
/// takes `&self`), then [`seal`](Ingest::seal) it, or [`abort`](Ingest::abort) it on failure.
pub struct Ingest {
    store: ChunkStore,
    params: ChunkParams,
    volume: Option<String>,
    progress: Arc<dyn Progress>,
    entries: Mutex<BTreeMap<String, EntryKind>>,
    /// Where every file's chunker hands its chunks; `None` once sealing began.
    chunks_tx: Option<ChunkSender>,
    uploader: Uploader,
    /// Held from before the first chunk check until the manifest is written, so no garbage
    /// collection sweeps a chunk this ingest found present (docs/gc.md).
    lease: Option<WriterLease>,
}

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::Other("ingest state poisoned by a panic".into()))
}

impl Ingest {
    /// Starts an ingest into `store`: takes a writer lease (waiting for a running garbage
    /// collection to end), then accepts files.
    pub async fn new(
        store: &ChunkStore,
        opts: &IngestOptions,
        progress: Arc<dyn Progress>,
    ) -> Result<Ingest> {
        opts.params.ensure_supported()?;
        if let Some(volume) = &opts.volume {
            validate_volume_name(volume)?;
        }
        let lease = WriterLease::acquire(store, &opts.purpose).await?;
        let (uploader, chunks_tx) = Uploader::start(store, opts.concurrency, progress.clone());
        Ok(Ingest {
            store: store.clone(),
            params: opts.params.clone(),
            volume: opts.volume.clone(),
            progress,
            entries: Mutex::new(BTreeMap::new()),
            chunks_tx: Some(chunks_tx),
            uploader,
            lease: Some(lease),
        })
    }

    /// Tells the progress reporter how many bytes of files are coming (when the source knows).
    pub fn start(&self, total_bytes: u64) {
        self.progress.start(Phase::Scan, total_bytes);
    }

    /// Chunks `reader` to its end as the regular file `path` (relative, `/`-separated) and
    /// uploads the chunks the store lacks. `size`, when given, is the length the source
    /// announced: a stream of another length fails (a truncated download is never sealed).
    /// When this returns an error nothing of the file is recorded; calling it again for the
    /// same path (a retry) is fine.
    pub async fn add_file<R>(
        &self,
        path: &str,
        executable: bool,
        size: Option<u64>,
        reader: R,
    ) -> Result<FileEntry>
    where
        R: AsyncRead + Unpin + Send,
    {
        validate_path(path)?;
        if lock(&self.entries)?.contains_key(path) {
            return Err(duplicate(path));
        }
        let chunks_tx = self
            .chunks_tx
            .clone()
            .ok_or_else(|| Error::Other("ingest already sealed".into()))?;
        let (feed_tx, feed_rx) = mpsc::channel::<io::Result<Bytes>>(FEED_DEPTH);
        let params = self.params.clone();
        let progress = self.progress.clone();
        let chunker = tokio::task::spawn_blocking(move || {
            let sink = |chunk: &ChunkRef, bytes: &[u8]| chunks_tx.send_blocking(chunk, bytes);
            let reader = ChannelReader {
                rx: feed_rx,
                current: Bytes::new(),
            };
            chunk_reader_with_sink(reader, &params, &|n| progress.advance(n), &sink)
        });
        let (fed, chunked) = tokio::join!(feed(reader, feed_tx), chunker);
        let chunked = chunked.map_err(|e| Error::Other(format!("chunking task failed: {e}")))?;
        // The real cause first: the uploader's failure, then the source's, then the chunker's.
        if let Err(e) = &chunked
            && UploaderStopped::caused(e)
        {
            return Err(self.uploader.take_error().in_file(path));
        }
        fed.map_err(|e| Error::io(PathBuf::from(path), e))?;
        let content = chunked.map_err(|e| Error::io(PathBuf::from(path), e))?;
        if let Some(expected) = size
            && expected != content.size
        {
            return Err(Error::FileChanged {
                path: PathBuf::from(path),
                detail: format!(
                    "the source announced {expected} bytes and sent {}",
                    content.size
                ),
            });
        }
        let file = FileEntry {
            executable,
            size: content.size,
            blake3: content.blake3,
            chunks: content.chunks,
        };
        let mut entries = lock(&self.entries)?;
        if entries.contains_key(path) {
            return Err(duplicate(path));
        }
        entries.insert(path.to_owned(), EntryKind::File(file.clone()));
        Ok(file)
    }

    /// Records the symlink `path` → `target` (relative, never leaving the volume).
    pub fn add_symlink(&self, path: &str, target: &str) -> Result<()> {
        validate_path(path)?;
        validate_symlink_target(path, target)?;
        let mut entries = lock(&self.entries)?;
        if entries.contains_key(path) {
            return Err(duplicate(path));
        }
        entries.insert(
            path.to_owned(),
            EntryKind::Symlink {
                target: target.to_owned(),
            },
        );
        Ok(())
    }

    /// Records a directory (only needed for empty ones: parents of files are implied).
    pub fn add_dir(&self, path: &str) -> Result<()> {
        validate_path(path)?;
        let mut entries = lock(&self.entries)?;
        match entries.get(path) {
            None => {
                entries.insert(path.to_owned(), EntryKind::Dir);
                Ok(())
            }
            Some(EntryKind::Dir) => Ok(()),
            Some(_) => Err(duplicate(path)),
        }
    }

    /// Waits for every upload, makes them durable, writes the manifest (conditional create)
    /// and the volume record, and reports what was sealed. On error nothing is sealed.
    /// The writer lease is released either way.
    pub async fn seal(mut self) -> Result<IngestReport> {
        let lease = self
            .lease
            .take()
            .ok_or_else(|| Error::Other("ingest already sealed".into()))?;
        let result = self.seal_leased(&lease).await;
        lease.release_keeping(result).await
    }

    async fn seal_leased(&mut self, lease: &WriterLease) -> Result<IngestReport> {
        let stats = self.finish_uploads().await?;
        self.progress.finish();
        let entries = std::mem::take(&mut *lock(&self.entries)?);
        let manifest = Manifest {
            chunking: self.params.clone(),
            entries: with_parents(entries)?,
        };
        check_symlink_loops(&manifest.entries)?;
        seal_manifest(
            &self.store,
            &manifest,
            lease,
            self.volume.as_deref(),
            &stats,
        )
        .await
    }

    /// Gives up: stops the uploads in flight, releases the writer lease and seals nothing.
    /// Chunks already uploaded stay (harmless, reused by the next attempt). Dropping an
    /// `Ingest` does the same in the background.
    pub async fn abort(mut self) {
        self.chunks_tx = None;
        self.uploader.abort().await;
        if let Some(lease) = self.lease.take()
            && let Err(e) = lease.release().await
        {
            tracing::warn!(error = %e, "cannot release writer lease");
        }
    }

    async fn finish_uploads(&mut self) -> Result<crate::upload::UploadStats> {
        // Closing our sender ends the uploader once every add_file's chunker has finished.
        self.chunks_tx = None;
        self.uploader.finish().await
    }
}

fn duplicate(path: &str) -> Error {
    Error::InvalidManifest(format!(
        "'{path}' was added twice (or as both a file and a directory)"
    ))
}

/// Reads the source into blocks for the chunker. Stops quietly when the chunker has stopped
/// (its error is the real one); a read error is passed on so the chunker fails too.
async fn feed<R: AsyncRead + Unpin>(
    mut reader: R,
    tx: mpsc::Sender<io::Result<Bytes>>,
) -> io::Result<()> {
    loop {
        let mut block = BytesMut::with_capacity(FEED_BLOCK);
        let mut eof = false;
        while block.len() < FEED_BLOCK {
            match reader.read_buf(&mut block).await {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    let copy = io::Error::new(e.kind(), e.to_string());
                    let _ = tx.send(Err(copy)).await;
                    return Err(e);
                }
            }
        }
        if !block.is_empty() && tx.send(Ok(block.freeze())).await.is_err() {
            return Ok(());
        }
        if eof {
            return Ok(());
        }
    }
}

/// The blocking end of the feed: a `Read` over blocks from the channel.
struct ChannelReader {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    current: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(block) => self.current = block?,
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// The manifest's entries: every parent directory of every entry added, sorted by path bytes
/// (a `BTreeMap<String, _>` iterates in byte order), as a scan of the same tree would give.
fn with_parents(mut entries: BTreeMap<String, EntryKind>) -> Result<Vec<Entry>> {
    let mut parents = Vec::new();
    for path in entries.keys() {
        let mut end = 0;
        while let Some(slash) = path[end..].find('/') {
            end += slash;
            parents.push(path[..end].to_owned());
            end += 1;
        }
    }
    for parent in parents {
        match entries.get(&parent) {
            None => {
                entries.insert(parent, EntryKind::Dir);
            }
            Some(EntryKind::Dir) => {}
            Some(_) => {
                return Err(Error::InvalidManifest(format!(
                    "'{parent}' is both a file (or symlink) and the directory of other entries"
                )));
            }
        }
    }
    Ok(entries
        .into_iter()
        .map(|(path, kind)| Entry { path, kind })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_are_synthesised_in_byte_order() {
        let mut entries = BTreeMap::new();
        entries.insert("a/b/c.txt".to_owned(), EntryKind::Dir);
        entries.insert("a.txt".to_owned(), EntryKind::Dir);
        entries.insert("a-b/x".to_owned(), EntryKind::Dir);
        let paths: Vec<String> = with_parents(entries)
            .unwrap()
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(paths, ["a", "a-b", "a-b/x", "a.txt", "a/b", "a/b/c.txt"]);
    }

    #[test]
    fn a_file_cannot_be_a_parent() {
        let file = EntryKind::Symlink { target: "x".into() };
        let mut entries = BTreeMap::new();
        entries.insert("a".to_owned(), file);
        entries.insert("a/b".to_owned(), EntryKind::Dir);
        assert!(with_parents(entries).is_err());
    }
}
