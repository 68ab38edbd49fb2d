//! The uploader behind push and ingest: the chunker hands each distinct chunk over once (a
//! [`ChunkSender`], deduplicating), and one background task asks the store whether it has the
//! chunk and uploads it if not, `concurrency` at a time, through a bounded channel (so memory
//! stays at `concurrency` chunks however large the tree).
//!
//! When an upload fails the task stops and keeps its error; senders then fail with
//! [`UploaderStopped`], which tells the chunker's caller to report the uploader's error (the
//! cause) rather than its own (the symptom).

use std::collections::HashSet;
use std::io;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::manifest::ChunkRef;
use crate::progress::Progress;
use crate::store::ChunkStore;

/// What one push or ingest uploaded, and what it found the store already had.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct UploadStats {
    pub(crate) chunks_uploaded: u64,
    pub(crate) bytes_uploaded: u64,
    pub(crate) bytes_reused: u64,
}

/// What a [`ChunkSender`] fails with once the uploader has stopped: its error is the real one
/// ([`Uploader::take_error`]).
#[derive(Debug, thiserror::Error)]
#[error("uploader stopped")]
pub(crate) struct UploaderStopped;

impl UploaderStopped {
    /// Whether `e` is a sender's [`UploaderStopped`] (passed through the chunker unchanged).
    pub(crate) fn caused(e: &io::Error) -> bool {
        e.get_ref()
            .is_some_and(|inner| inner.is::<UploaderStopped>())
    }
}

type Item = (ChunkRef, Bytes);

/// The chunker's end: hands each distinct chunk to the uploader once, however often it
/// repeats. Clones share the set of chunks seen.
#[derive(Clone)]
pub(crate) struct ChunkSender {
    tx: mpsc::Sender<Item>,
    seen: Arc<Mutex<HashSet<Digest>>>,
}

impl ChunkSender {
    /// Blocks while the uploader is `concurrency` chunks behind: call it from the chunker's
    /// blocking thread.
    pub(crate) fn send_blocking(&self, chunk: &ChunkRef, bytes: &[u8]) -> io::Result<()> {
        let first = self
            .seen
            .lock()
            .map_err(|_| io::Error::other("chunk set poisoned"))?
            .insert(chunk.digest);
        if first {
            self.tx
                .blocking_send((*chunk, Bytes::copy_from_slice(bytes)))
                .map_err(|_| io::Error::other(UploaderStopped))?;
        }
        Ok(())
    }
}

/// The background upload task. Dropping it stops the uploads in flight.
pub(crate) struct Uploader {
    task: Option<JoinHandle<Option<UploadStats>>>,
    /// The task's first error, for whichever caller notices the uploader stopped.
    error: Arc<Mutex<Option<Error>>>,
}

impl Uploader {
    /// Starts uploading what the returned sender (and its clones) hand over; the uploads end
    /// once every sender is dropped.
    pub(crate) fn start(
        store: &ChunkStore,
        concurrency: usize,
        progress: Arc<dyn Progress>,
    ) -> (Uploader, ChunkSender) {
        let concurrency = concurrency.max(1);
        let (tx, rx) = mpsc::channel(concurrency * 2);
        let error = Arc::new(Mutex::new(None));
        let task = tokio::spawn(upload_missing(
            store.clone(),
            rx,
            concurrency,
            progress,
            error.clone(),
        ));
        let sender = ChunkSender {
            tx,
            seen: Arc::new(Mutex::new(HashSet::new())),
        };
        let uploader = Uploader {
            task: Some(task),
            error,
        };
        (uploader, sender)
    }

    /// Waits for every upload (drop every sender first) and reports what was uploaded, or
    /// the first upload error.
    pub(crate) async fn finish(&mut self) -> Result<UploadStats> {
        let task = self
            .task
            .take()
            .ok_or_else(|| Error::Other("the uploads have already finished".into()))?;
        let stats = task
            .await
            .map_err(|e| Error::Other(format!("upload task failed: {e}")))?;
        stats.ok_or_else(|| self.take_error())
    }

    /// Stops the uploads in flight and waits until they have stopped.
    pub(crate) async fn abort(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// The uploader's error (once; later callers get a pointer to it).
    pub(crate) fn take_error(&self) -> Error {
        let taken = self.error.lock().ok().and_then(|mut slot| slot.take());
        taken.unwrap_or_else(|| Error::Other("a chunk upload failed earlier".into()))
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Uploads each chunk the store lacks, `concurrency` at a time. On failure the error goes to
/// `error` and the result is `None`; dropping the receiver stops the senders.
async fn upload_missing(
    store: ChunkStore,
    rx: mpsc::Receiver<Item>,
    concurrency: usize,
    progress: Arc<dyn Progress>,
    error: Arc<Mutex<Option<Error>>>,
) -> Option<UploadStats> {
    let chunks = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let results = chunks
        .map(|(chunk, data)| {
            let progress = progress.clone();
            let store = &store;
            async move {
                let len = u64::from(chunk.len);
                if store.has_chunk(&chunk.digest).await? {
                    progress.reused(len);
                    return Ok::<_, Error>((false, len));
                }
                store.put_chunk(&chunk.digest, data).await?;
                progress.uploaded(len);
                Ok((true, len))
            }
        })
        .buffer_unordered(concurrency);
    let mut results = std::pin::pin!(results);
    let mut stats = UploadStats::default();
    while let Some(result) = results.next().await {
        match result {
            Ok((true, len)) => {
                stats.chunks_uploaded += 1;
                stats.bytes_uploaded += len;
            }
            Ok((false, len)) => stats.bytes_reused += len,
            Err(e) => {
                if let Ok(mut slot) = error.lock() {
                    slot.get_or_insert(e);
                }
                return None;
            }
        }
    }
    Some(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;

    fn chunk(data: &[u8]) -> ChunkRef {
        ChunkRef {
            digest: Digest::of(data),
            len: data.len() as u32,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_distinct_chunk_is_uploaded_once_and_present_ones_are_reused() {
        let store = ChunkStore::memory();
        store
            .put_chunk(&Digest::of(b"old"), Bytes::from_static(b"old"))
            .await
            .unwrap();
        let (mut uploader, sender) = Uploader::start(&store, 2, Arc::new(NoProgress));
        tokio::task::spawn_blocking(move || {
            for data in [&b"new"[..], b"new", b"old", b"other"] {
                sender.send_blocking(&chunk(data), data).unwrap();
            }
        })
        .await
        .unwrap();
        let stats = uploader.finish().await.unwrap();
        assert_eq!(
            stats,
            UploadStats {
                chunks_uploaded: 2,
                bytes_uploaded: 8,
                bytes_reused: 3,
            }
        );
        assert!(store.has_chunk(&Digest::of(b"other")).await.unwrap());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_uploader_is_reported_as_such_to_senders() {
        let store = ChunkStore::memory();
        let (mut uploader, sender) = Uploader::start(&store, 1, Arc::new(NoProgress));
        uploader.abort().await;
        let sent = tokio::task::spawn_blocking(move || sender.send_blocking(&chunk(b"x"), b"x"))
            .await
            .unwrap();
        let err = sent.unwrap_err();
        assert!(UploaderStopped::caused(&err));
        assert!(!UploaderStopped::caused(&io::Error::other(
            "uploader stopped"
        )));
    }
}
