//! The kernel io mode of every open inode of a restartable mount, kept in a small file for
//! the process that resumes the mount after this one (`MountOptions::io_mode_record`).
//!
//! While any handle of an inode is open the kernel keeps the inode either in passthrough mode,
//! tied to one backing id, or in cached mode, and fails (EIO) an open in the other mode or
//! with another backing id. Handles a crashed or upgraded process opened stay open (pods keep
//! reading through the restart) and the next process never learns of them, so each change of
//! an inode's mode is written here before the open is answered, and a resumed process starts
//! from the record: every recorded inode stays in its recorded mode, with the same backing id,
//! for as long as that process serves the mount (it cannot tell when the old handles close).
//!
//! A process crash leaves the file intact (the page cache outlives the process); a machine
//! crash ends the FUSE connection, and with it the ids, so nothing is fsynced.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

const HEADER: &str = "sealed-io-modes v1";

/// An inode's recorded mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    Cached,
    /// In passthrough with this backing id, registered on the mount's FUSE connection.
    Passthrough(u32),
}

/// The record file of one mount.
#[derive(Clone, Debug)]
pub(crate) struct IoModeRecord {
    path: PathBuf,
}

impl IoModeRecord {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        IoModeRecord { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded modes; `Ok(None)` when there is no record (the previous process kept
    /// none), an error when the file cannot be read or is not a record.
    pub fn load(&self) -> io::Result<Option<BTreeMap<u64, Recorded>>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        parse(&text).map(Some).map_err(|line| {
            io::Error::new(io::ErrorKind::InvalidData, format!("bad line {line:?}"))
        })
    }

    /// Replaces the record with `modes` (written aside, then renamed over it).
    pub fn write(&self, modes: impl IntoIterator<Item = (u64, Recorded)>) -> io::Result<()> {
        let mut text = format!("{HEADER}\n");
        for (ino, mode) in modes {
            match mode {
                Recorded::Cached => text.push_str(&format!("c {ino}\n")),
                Recorded::Passthrough(id) => text.push_str(&format!("p {ino} {id}\n")),
            }
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        drop(file);
        std::fs::rename(&tmp, &self.path)
    }

    /// Forgets the record: the mount is new (ids of an old connection mean nothing) or gone.
    pub fn remove(&self) -> io::Result<()> {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// Parses a record; the error is the first line that is not one.
fn parse(text: &str) -> Result<BTreeMap<u64, Recorded>, String> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(text.lines().next().unwrap_or_default().to_string());
    }
    let mut modes = BTreeMap::new();
    for line in lines {
        let fields: Vec<&str> = line.split(' ').collect();
        let parsed = match fields.as_slice() {
            ["c", ino] => ino.parse().ok().map(|ino| (ino, Recorded::Cached)),
            ["p", ino, id] => match (ino.parse(), id.parse()) {
                (Ok(ino), Ok(id)) => Some((ino, Recorded::Passthrough(id))),
                _ => None,
            },
            _ => None,
        };
        let (ino, mode) = parsed.ok_or_else(|| line.to_string())?;
        modes.insert(ino, mode);
    }
    Ok(modes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_record_loads_back() {
        let dir = tempfile::tempdir().unwrap();
        let record = IoModeRecord::new(dir.path().join("sub/modes"));
        assert_eq!(record.load().unwrap(), None, "no record yet");
        let modes = [(2, Recorded::Cached), (7, Recorded::Passthrough(3))];
        record.write(modes).unwrap();
        assert_eq!(record.load().unwrap(), Some(modes.into_iter().collect()));
        record.write([]).unwrap();
        assert_eq!(record.load().unwrap(), Some(BTreeMap::new()));
        record.remove().unwrap();
        assert_eq!(record.load().unwrap(), None);
        record.remove().unwrap();
    }

    #[test]
    fn a_damaged_record_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let record = IoModeRecord::new(dir.path().join("modes"));
        for bad in [
            "",
            "something else\n",
            "sealed-io-modes v1\np 7\n",
            "sealed-io-modes v1\nc x\n",
            "sealed-io-modes v1\np 7 -1\n",
        ] {
            std::fs::write(record.path(), bad).unwrap();
            let err = record.load().expect_err(bad);
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{bad:?}");
        }
    }
}
