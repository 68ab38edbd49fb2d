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
//! While a backing file is registered its cache entry is pinned, so eviction never takes
//! it from under an open handle. Where passthrough is unavailable (the kernel did not offer
//! `FUSE_PASSTHROUGH`, the daemon lacks CAP_SYS_ADMIN, the backing file is refused), opens
//! fall back to the daemon's read path: logged once, counted in `passthrough_fallbacks`.

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};

use fuser::{BackingId, FileHandle, FopenFlags, ReplyOpen};
use parking_lot::Mutex;

use crate::cache::Key;
use crate::fs::SealedFs;
use crate::metrics::MountMetrics;

/// How an inode is open now.
enum InodeIo {
    /// Served by the daemon: this many handles.
    Cached(u32),
    /// Served by the kernel from a backing file.
    Passthrough {
        backing: BackingId,
        /// The cache entry pinned while the backing file is registered.
        key: Key,
        /// Kept open with the registration (the kernel holds its own reference too).
        _file: File,
        opens: u32,
    },
}

/// The passthrough state of one mount.
pub(crate) struct Passthrough {
    /// Off when not asked for, or once the kernel did not offer it at init.
    enabled: AtomicBool,
    inodes: Mutex<HashMap<u64, InodeIo>>,
    /// Open handles and their inode, for `release`.
    handles: Mutex<HashMap<u64, u64>>,
    warned: AtomicBool,
}

impl Passthrough {
    pub fn new(wanted: bool) -> Self {
        Passthrough {
            enabled: AtomicBool::new(wanted),
            inodes: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            warned: AtomicBool::new(false),
        }
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

    /// Answers an open of `ino` (handle `fh`, from [`SealedFs::open`]): passthrough if the
    /// file is hydrated and the inode allows it, daemon-served otherwise.
    pub fn open(&self, fs: &SealedFs, ino: u64, fh: u64, reply: ReplyOpen) {
        let flags = FopenFlags::FOPEN_KEEP_CACHE;
        // The kernel refuses (EIO) a passthrough open with any flag outside
        // FOPEN_PASSTHROUGH_MASK, KEEP_CACHE included: the page cache is the backing file's.
        let passthrough = FopenFlags::empty();
        let mut inodes = self.inodes.lock();
        self.handles.lock().insert(fh, ino);
        match inodes.get_mut(&ino) {
            Some(InodeIo::Passthrough { backing, opens, .. }) => {
                *opens += 1;
                MountMetrics::inc(&fs.metrics().passthrough_opens);
                return reply.opened_passthrough(FileHandle(fh), passthrough, backing);
            }
            Some(InodeIo::Cached(opens)) => {
                *opens += 1;
                return reply.opened(FileHandle(fh), flags);
            }
            None => {}
        }
        if let Some((path, key)) = fs.hydrated_copy(ino) {
            if !self.wanted() {
                MountMetrics::inc(&fs.metrics().passthrough_fallbacks);
            } else if let Some(disk) = fs.cache().disk() {
                // Pinned first, then looked up again: an eviction between the two would
                // otherwise delete the file this open is about to register.
                disk.pin(key);
                let registered = fs
                    .hydrated_copy(ino)
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
                    .and_then(|_| File::open(&path))
                    .and_then(|file| reply.open_backing(&file).map(|backing| (file, backing)));
                match registered {
                    Ok((file, backing)) => {
                        MountMetrics::inc(&fs.metrics().passthrough_opens);
                        reply.opened_passthrough(FileHandle(fh), passthrough, &backing);
                        inodes.insert(
                            ino,
                            InodeIo::Passthrough {
                                backing,
                                key,
                                _file: file,
                                opens: 1,
                            },
                        );
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
        inodes.insert(ino, InodeIo::Cached(1));
        reply.opened(FileHandle(fh), flags);
    }

    /// A handle is released: the backing file goes with the inode's last passthrough handle.
    pub fn release(&self, fs: &SealedFs, fh: u64) {
        let Some(ino) = self.handles.lock().remove(&fh) else {
            return;
        };
        let mut inodes = self.inodes.lock();
        let last = match inodes.get_mut(&ino) {
            Some(InodeIo::Cached(opens)) | Some(InodeIo::Passthrough { opens, .. }) => {
                *opens = opens.saturating_sub(1);
                *opens == 0
            }
            None => false,
        };
        if !last {
            return;
        }
        if let Some(InodeIo::Passthrough { key, .. }) = inodes.remove(&ino)
            && let Some(disk) = fs.cache().disk()
        {
            disk.unpin(key);
        }
    }
}
