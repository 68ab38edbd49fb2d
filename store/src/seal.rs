//! The sealing step push and ingest share: once every chunk a manifest names is uploaded,
//! make the chunks durable, confirm the writer lease, write the manifest (a conditional
//! create) and the volume record, and report what was sealed.

use crate::digest::Digest;
use crate::error::Result;
use crate::manifest::{EntryKind, Manifest};
use crate::store::ChunkStore;
use crate::upload::UploadStats;
use crate::writer_lease::WriterLease;

/// What was sealed: the version and how much of it was uploaded, reused and read.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PushReport {
    pub digest: Digest,
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Bytes of file content in the version.
    pub bytes: u64,
    pub chunks: u64,
    pub unique_chunks: u64,
    pub chunks_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Bytes of distinct chunks the store already had.
    pub bytes_reused: u64,
    pub manifest_bytes: u64,
    /// Bytes of local files read and hashed (0 for a re-push of an unchanged tree).
    pub bytes_read: u64,
    /// Files whose chunks came from the stat cache, unread.
    pub files_cached: u64,
}

/// Seals `manifest` once every chunk it names is uploaded: makes the chunks durable, checks
/// that the writer lease still holds (chunks found present were safe from collection only
/// while it did), writes the manifest with a conditional create and the volume record.
pub(crate) async fn seal_manifest(
    store: &ChunkStore,
    manifest: &Manifest,
    lease: &WriterLease,
    volume: Option<&str>,
    stats: &UploadStats,
) -> Result<PushReport> {
    let (manifest_bytes, digest) = manifest.seal()?;
    store.sync().await?;
    let manifest_len = manifest_bytes.len() as u64;
    // The lease must still be ours, in the store too: a collector that took it for expired
    // may be sweeping the chunks this manifest reuses.
    lease.confirm().await?;
    let record_of = volume.map(|v| (v, manifest_bytes.clone()));
    store.put_manifest(manifest_bytes).await?;
    // And still ours after: lost in between, the manifest may name swept chunks. Say so
    // (the error names `sealed verify`) rather than report success.
    lease.confirm().await?;
    if let Some((volume, bytes)) = record_of {
        store.put_volume_record(volume, &bytes).await?;
        // A deletion of another volume's reference may have trashed the manifest we found
        // present; now that our reference is written, make sure it is live (docs/gc.md).
        crate::refs::keep_live(store, &bytes, lease).await?;
    }

    let mut report = PushReport {
        digest,
        files: 0,
        directories: 0,
        symlinks: 0,
        bytes: manifest.total_size(),
        chunks: 0,
        unique_chunks: manifest.unique_chunks().len() as u64,
        chunks_uploaded: stats.chunks_uploaded,
        bytes_uploaded: stats.bytes_uploaded,
        bytes_reused: stats.bytes_reused,
        manifest_bytes: manifest_len,
        // A stream's every byte is read; push corrects this for files it did not read.
        bytes_read: manifest.total_size(),
        files_cached: 0,
    };
    for entry in &manifest.entries {
        match &entry.kind {
            EntryKind::Dir => report.directories += 1,
            EntryKind::Symlink { .. } => report.symlinks += 1,
            EntryKind::File(f) => {
                report.files += 1;
                report.chunks += f.chunks.len() as u64;
            }
        }
    }
    tracing::info!(
        %digest,
        files = report.files,
        bytes = report.bytes,
        chunks_uploaded = report.chunks_uploaded,
        bytes_uploaded = report.bytes_uploaded,
        "sealed"
    );
    Ok(report)
}
