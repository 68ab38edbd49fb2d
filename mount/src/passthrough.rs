//! FUSE passthrough for hydrated files (`FOPEN_PASSTHROUGH`, Linux >= 6.9, CAP_SYS_ADMIN):
//! an open of a file whose complete, verified copy is in the disk cache (`crate::hydrate`) is
//! answered with that copy as the backing file, and the kernel then serves reads, `mmap` and
//! `O_DIRECT` from it without asking the daemon.
//!
//! The kernel's rules, kept here per inode:
//! - one backing file per inode: every passthrough open of an inode shares one `BackingId`,
//!   dropped (and the cache entry unpinned) when its last handle is released;
//! - an inode is open either in passthrough or in cached mode, never both (a mixed open
//!   fails with EIO): while daemon-served handles are open, new opens stay daemon-served
//!   even if the file became hydrated meanwhile, and vice versa.
//!
//! A restartable mount records each inode's mode (`crate::io_modes`) before answering the
//! open that set it, and a process that resumes the mount inherits the record: recorded
//! inodes keep their mode and backing id while it serves, for the previous process's handles
//! may still be open. With no record to inherit, a resumed process serves every read itself.
//!
//! Only a copy this process verified is registered (`crate::verify`): an open of a copy found
//! on disk and not yet checked does not wait for its check. It starts (or joins) the check in
//! the background and is daemon-served at once, every chunk read from the copy verified
//! against its digest in the manifest (a damaged chunk is fetched again through the tiers, or
//! EIO); opens of the inode after its daemon-served handles closed and the check matched are
//! passthrough. An inode whose backing copy was dropped as damaged since it
//! was registered fails new opens with EIO until its last handle closes: the kernel would
//! serve them from the damaged file, and offers no way to swap it under open handles.
//!
//! While a backing file is registered its cache entry is pinned, so eviction never takes
//! it from under an open handle. Where passthrough is unavailable (the kernel did not offer
//! `FUSE_PASSTHROUGH`, the daemon lacks CAP_SYS_ADMIN, the backing file is refused), opens
//! fall back to the daemon's read path: logged once, counted in `passthrough_fallbacks`.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};

use fuser::{BackingId, FileHandle, FopenFlags, ReplyOpen};
use parking_lot::Mutex;

use crate::cache::Key;
use crate::error::FsError;
use crate::fs::SealedFs;
use crate::io_modes::{IoModeRecord, Recorded};
use crate::metrics::MountMetrics;

/// How an inode is open now.
enum InodeIo {
    /// Served by the daemon: this many handles of ours.
    Cached { opens: u32, inherited: bool },
    /// Served by the kernel from a backing file.
    Passthrough {
        /// The registered backing file's id; `backing` owns it once this process has used
        /// it (an inherited id is wrapped at its first open here).
        id: u32,
        backing: Option<BackingId>,
        /// The cache entry pinned while the backing file is registered.
        key: Option<Key>,
        /// The backing file's inode: new opens are refused once the cache no longer holds
        /// it (dropped as damaged, or replaced by a copy fetched again).
        backing_ino: Option<u64>,
        /// Kept open with the registration (the kernel holds its own reference too).
        _file: Option<File>,
        opens: u32,
        inherited: bool,
    },
}

impl InodeIo {
    fn recorded(&self) -> Recorded {
        match self {
            InodeIo::Cached { .. } => Recorded::Cached,
            InodeIo::Passthrough { id, .. } => Recorded::Passthrough(*id),
        }
    }
}

/// The passthrough state of one mount.
pub(crate) struct Passthrough {
    /// Off when not asked for, or once the kernel did not offer it at init.
    enabled: AtomicBool,
    inodes: Mutex<HashMap<u64, InodeIo>>,
    /// Open handles and their inode, for `release`.
    handles: Mutex<HashMap<u64, u64>>,
    /// Where a restartable mount records its inodes' modes.
    record: Option<IoModeRecord>,
    warned: AtomicBool,
}

impl Passthrough {
    pub fn new(wanted: bool, record: Option<IoModeRecord>) -> Self {
        Passthrough {
            enabled: AtomicBool::new(wanted),
            inodes: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            record,
            warned: AtomicBool::new(false),
        }
    }

    /// Before an open of `ino` that sets the inode's mode: if its file has a copy on disk
    /// this process has not verified, starts (or joins) its check in the background, and
    /// returns at once; true if there was such a copy (this open is daemon-served, unless
    /// the check is done by the time the mode is chosen).
    fn start_check(&self, fs: &SealedFs, ino: u64) -> bool {
        let Some(copy) = fs.hydrated_copy(ino) else {
            return false;
        };
        if copy.verified {
            return false;
        }
        let cache = fs.cache();
        // Not waited for: the daemon serves this open, every chunk verified as it is read.
        drop(cache.integrity().verify(cache, copy.key));
        true
    }

    pub fn wanted(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// The kernel's answer at init: passthrough works only if it offered the capability.
    pub fn set_available(&self, available: bool, reason: &str) {
        if !available && self.enabled.swap(false, Ordering::Relaxed) {
            self.warn_once(reason);
        }
    }

    fn warn_once(&self, reason: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                reason,
                "FUSE passthrough unavailable: hydrated files are served by the daemon"
            );
        }
    }

    /// A new FUSE connection: what an earlier one recorded means nothing to it.
    pub fn start_fresh(&self) {
        if let Some(record) = &self.record
            && let Err(e) = record.remove()
        {
            tracing::warn!(path = %record.path().display(), error = %e, "removing an old io mode record");
        }
    }

    /// Resuming a live connection: takes over the modes the previous process recorded.
    pub fn inherit(&self, fs: &SealedFs) {
        // The previous process's handles may be in either mode: serving every open ourselves
        // (cached) is right unless it used passthrough, which it records.
        let modes = match self.record.as_ref().map(|record| (record, record.load())) {
            Some((_, Ok(Some(modes)))) => modes,
            Some((record, Err(e))) => {
                let reason = format!("reading {}: {e}", record.path().display());
                self.set_available(false, &reason);
                return;
            }
            _ => {
                self.set_available(false, "no record of the previous server's io modes");
                return;
            }
        };
        let mut inodes = self.inodes.lock();
        for (ino, mode) in modes {
            let io = match mode {
                Recorded::Cached => InodeIo::Cached {
                    opens: 0,
                    inherited: true,
                },
                Recorded::Passthrough(id) => {
                    // The previous server verified what it registered; this one checks the
                    // copy too (the mount's walker), and refuses new opens if it is dropped.
                    let copy = fs.hydrated_copy(ino);
                    if let (Some(copy), Some(disk)) = (&copy, fs.cache().disk()) {
                        disk.pin(copy.key);
                    }
                    let backing_ino = copy
                        .as_ref()
                        .and_then(|c| std::fs::metadata(&c.path).ok())
                        .map(|m| m.ino());
                    InodeIo::Passthrough {
                        id,
                        backing: None,
                        key: copy.map(|c| c.key),
                        backing_ino,
                        _file: None,
                        opens: 0,
                        inherited: true,
                    }
                }
            };
            inodes.insert(ino, io);
        }
        tracing::info!(
            inodes = inodes.len(),
            "inherited the previous server's io modes"
        );
    }

    /// Writes the record after a change of `inodes`, before the kernel hears of it.
    fn write_record(&self, inodes: &HashMap<u64, InodeIo>) {
        if let Some(record) = &self.record
            && let Err(e) = record.write(inodes.iter().map(|(ino, io)| (*ino, io.recorded())))
        {
            tracing::warn!(
                path = %record.path().display(),
                error = %e,
                "recording io modes failed: a server that resumes this mount may fail opens"
            );
        }
    }

    /// Answers an open of `ino` (handle `fh`, from [`SealedFs::open`]): passthrough if the
    /// file is hydrated and the inode allows it, daemon-served otherwise.
    pub fn open(&self, fs: &SealedFs, ino: u64, fh: u64, reply: ReplyOpen) {
        let flags = FopenFlags::FOPEN_KEEP_CACHE;
        // The kernel refuses (EIO) a passthrough open with any flag outside
        // FOPEN_PASSTHROUGH_MASK, KEEP_CACHE included: the page cache is the backing file's.
        let passthrough = FopenFlags::empty();
        // A copy not yet checked starts its check (a thread of its own), not under the lock.
        let unchecked =
            self.wanted() && !self.inodes.lock().contains_key(&ino) && self.start_check(fs, ino);
        let mut inodes = self.inodes.lock();
        match inodes.get_mut(&ino) {
            Some(InodeIo::Passthrough {
                key: Some(key),
                backing_ino: Some(backing_ino),
                ..
            }) if !fs
                .cache()
                .disk()
                .is_some_and(|d| d.still_holds(key, *backing_ino)) =>
            {
                tracing::error!(
                    ino,
                    "the cache copy this file is open on by passthrough was dropped as damaged: \
                     new opens fail until its open handles close"
                );
                drop(inodes);
                fs.release(fh);
                return reply.error(fuser::Errno::from_i32(FsError::DamagedBacking.errno()));
            }
            _ => {}
        }
        self.handles.lock().insert(fh, ino);
        match inodes.get_mut(&ino) {
            Some(InodeIo::Passthrough {
                id, backing, opens, ..
            }) => {
                *opens += 1;
                // SAFETY: an inherited id was registered on this connection by the previous
                // server, which records an id before answering with it and forgets it
                // before closing it, so the id names this inode's backing file.
                let backing = backing.get_or_insert_with(|| unsafe { reply.wrap_backing(*id) });
                MountMetrics::inc(&fs.metrics().passthrough_opens);
                return reply.opened_passthrough(FileHandle(fh), passthrough, backing);
            }
            Some(InodeIo::Cached { opens, .. }) => {
                *opens += 1;
                return reply.opened(FileHandle(fh), flags);
            }
            None => {}
        }
        if let Some(copy) = fs.hydrated_copy(ino).filter(|c| c.verified) {
            let (path, key) = (copy.path, copy.key);
            if !self.wanted() {
                MountMetrics::inc(&fs.metrics().passthrough_fallbacks);
            } else if let Some(disk) = fs.cache().disk() {
                // Pinned first, then looked up again: an eviction between the two would
                // otherwise delete the file this open is about to register.
                disk.pin(key);
                let registered = fs
                    .hydrated_copy(ino)
                    .filter(|c| c.verified && c.key == key)
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
                    .and_then(|_| File::open(&path))
                    .and_then(|file| Ok((file.metadata()?.ino(), file)))
                    .and_then(|(ino, file)| {
                        reply
                            .open_backing(&file)
                            .map(|backing| (file, backing, ino))
                    });
                match registered {
                    Ok((file, backing, backing_ino)) => {
                        MountMetrics::inc(&fs.metrics().passthrough_opens);
                        // fuser shows the raw id only by giving up ownership; take it back.
                        let id = backing.into_raw();
                        // SAFETY: `id` was registered just now and nothing else owns it.
                        let backing = unsafe { reply.wrap_backing(id) };
                        inodes.insert(
                            ino,
                            InodeIo::Passthrough {
                                id,
                                backing: Some(backing),
                                key: Some(key),
                                backing_ino: Some(backing_ino),
                                _file: Some(file),
                                opens: 1,
                                inherited: false,
                            },
                        );
                        self.write_record(&inodes);
                        if let Some(InodeIo::Passthrough {
                            backing: Some(backing),
                            ..
                        }) = inodes.get(&ino)
                        {
                            reply.opened_passthrough(FileHandle(fh), passthrough, backing);
                        }
                        return;
                    }
                    Err(e) => {
                        disk.unpin(key);
                        MountMetrics::inc(&fs.metrics().passthrough_fallbacks);
                        if e.raw_os_error() == Some(libc::EPERM) {
                            // Not privileged: no open will do better.
                            self.enabled.store(false, Ordering::Relaxed);
                        }
                        self.warn_once(&format!("registering the backing file failed: {e}"));
                    }
                }
            }
        }
        if unchecked && fs.hydrated_copy(ino).is_some_and(|c| !c.verified) {
            // Served by the daemon while the copy's check runs: every chunk is read from the
            // copy and verified against the manifest's digest before it is served.
            MountMetrics::inc(&fs.metrics().unverified_opens);
        }
        inodes.insert(
            ino,
            InodeIo::Cached {
                opens: 1,
                inherited: false,
            },
        );
        self.write_record(&inodes);
        reply.opened(FileHandle(fh), flags);
    }

    /// A handle is released: the backing file goes with the inode's last passthrough handle
    /// (an inherited inode keeps its mode: the previous server's handles may be open).
    pub fn release(&self, fs: &SealedFs, fh: u64) {
        let Some(ino) = self.handles.lock().remove(&fh) else {
            return;
        };
        let mut inodes = self.inodes.lock();
        let last = match inodes.get_mut(&ino) {
            Some(InodeIo::Cached { opens, inherited })
            | Some(InodeIo::Passthrough {
                opens, inherited, ..
            }) => {
                *opens = opens.saturating_sub(1);
                *opens == 0 && !*inherited
            }
            None => false,
        };
        if !last {
            return;
        }
        let Some(gone) = inodes.remove(&ino) else {
            return;
        };
        // Forgotten in the record before the id is closed (when `gone` drops), so a resumed
        // server never inherits a closed id.
        self.write_record(&inodes);
        if let InodeIo::Passthrough { key: Some(key), .. } = &gone
            && let Some(disk) = fs.cache().disk()
        {
            disk.unpin(*key);
        }
        drop(gone);
    }
}

impl Drop for Passthrough {
    /// A restartable mount outlives this server: its backing ids stay registered for the
    /// next one, which inherits them from the record (the kernel drops them at unmount).
    fn drop(&mut self) {
        if self.record.is_none() {
            return;
        }
        for io in self.inodes.get_mut().drain().map(|(_, io)| io) {
            if let InodeIo::Passthrough {
                backing: Some(backing),
                ..
            } = io
            {
                backing.into_raw();
            }
        }
    }
}
