//! The publication records under `<state-dir>/publications/`: one small JSON file per
//! published target, so that a restarted plugin knows which target belongs to which volume
//! and version (shaped like csi-driver-host-path's `pkg/state`: save, load, delete).
//!
//! A record is written before its bind mount and deleted after its unmount, so a crash in
//! between leaves a record without a mount (dropped by `Driver::recover`), never a mount
//! without a record. Writes are atomic (`state_dir::write_atomically`).

use std::path::{Path, PathBuf};

use sealed_store::Digest;
use serde::{Deserialize, Serialize};

use crate::state_dir;

/// A publication as written to disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicationRecord {
    pub volume_id: String,
    /// `blake3:<hex>`; checked by the reader (an unparsable one is dropped).
    pub digest: String,
    pub target: PathBuf,
    /// Absent in records of plugins before the node publications Lease.
    #[serde(default)]
    pub namespace: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("publication record {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("publication record {path} is not a record: {source}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// The records directory.
pub struct PublicationRecords {
    dir: PathBuf,
}

impl PublicationRecords {
    pub fn new(state_dir: &Path) -> Self {
        PublicationRecords {
            dir: state_dir.join("publications"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The record of `target`: named by the hash of its path (any path, one flat file name).
    fn path_of(&self, target: &Path) -> PathBuf {
        let name = Digest::of(target.as_os_str().as_encoded_bytes()).hex();
        self.dir.join(format!("{name}.json"))
    }

    /// Writes (or replaces) the record of `record.target`.
    pub fn save(&self, record: &PublicationRecord) -> Result<(), RecordError> {
        let path = self.path_of(&record.target);
        let bytes = serde_json::to_vec(record).map_err(|source| RecordError::Corrupt {
            path: path.clone(),
            source,
        })?;
        state_dir::write_atomically(&path, &bytes)
            .map_err(|source| RecordError::Io { path, source })
    }

    /// The record in the file at `path`.
    pub fn load(&self, path: &Path) -> Result<PublicationRecord, RecordError> {
        let bytes = std::fs::read(path).map_err(|source| RecordError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| RecordError::Corrupt {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Deletes the record of `target`; none is fine.
    pub fn delete(&self, target: &Path) {
        let _ = std::fs::remove_file(self.path_of(target));
    }

    /// Every record there is. Files that are not records (a temporary file a crash left,
    /// an unreadable record) are deleted, with a warning for the unreadable ones.
    pub fn load_all(&self) -> Vec<PublicationRecord> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            match self.load(&path) {
                Ok(record) => records.push(record),
                Err(e) => {
                    tracing::warn!(error = %e, "dropping an unreadable publication record");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        records
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(target: &str, volume_id: &str) -> PublicationRecord {
        PublicationRecord {
            volume_id: volume_id.into(),
            digest: Digest::of(volume_id.as_bytes()).to_string(),
            target: PathBuf::from(target),
            namespace: "ml".into(),
        }
    }

    fn records() -> (tempfile::TempDir, PublicationRecords) {
        let dir = tempfile::tempdir().unwrap();
        let records = PublicationRecords::new(dir.path());
        state_dir::private_dir(records.dir()).unwrap();
        (dir, records)
    }

    #[test]
    fn saved_records_load_back_and_delete() {
        let (_dir, records) = records();
        let a = record("/pods/a/volume", "vol-a");
        let b = record("/pods/b/volume with space", "vol-b");
        records.save(&a).unwrap();
        records.save(&b).unwrap();
        let mut all = records.load_all();
        all.sort_by(|x, y| x.volume_id.cmp(&y.volume_id));
        assert_eq!(all, vec![a.clone(), b]);
        records.delete(&PathBuf::from("/pods/b/volume with space"));
        assert_eq!(records.load_all(), vec![a]);
        // Deleting what is not there is fine.
        records.delete(&PathBuf::from("/pods/none"));
    }

    #[test]
    fn saving_a_target_again_replaces_its_record_whole() {
        let (_dir, records) = records();
        let target = "/pods/a/volume";
        let mut long = record(target, "a-rather-long-volume-id");
        long.namespace = "n".repeat(200);
        records.save(&long).unwrap();
        let short = record(target, "v");
        records.save(&short).unwrap();
        assert_eq!(records.load_all(), vec![short]);
        let files: Vec<_> = std::fs::read_dir(records.dir()).unwrap().collect();
        assert_eq!(files.len(), 1, "one file per target, no temporary left");
    }

    #[test]
    fn a_corrupt_record_is_an_error_and_is_dropped() {
        let (_dir, records) = records();
        let good = record("/pods/good/volume", "good");
        records.save(&good).unwrap();
        let bad = records.dir().join("bad.json");
        std::fs::write(&bad, b"{\"volume_id\": \"cut off").unwrap();
        let err = records.load(&bad).unwrap_err();
        assert!(matches!(err, RecordError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("bad.json"), "{err}");
        // A leftover temporary file is not a record either.
        std::fs::write(records.dir().join("x.tmp"), b"{}").unwrap();
        assert_eq!(records.load_all(), vec![good]);
        assert_eq!(std::fs::read_dir(records.dir()).unwrap().count(), 1);
    }

    #[test]
    fn old_records_load_without_a_namespace() {
        let (_dir, records) = records();
        let path = records.dir().join("old.json");
        std::fs::write(
            &path,
            br#"{"volume_id":"v","digest":"blake3:00","target":"/t"}"#,
        )
        .unwrap();
        assert_eq!(records.load(&path).unwrap().namespace, "");
    }
}
