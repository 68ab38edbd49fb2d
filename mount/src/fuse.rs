//! The thin `fuser` adapter: FUSE requests in, calls on [`SealedFs`] out, errno at the edge.
//!
//! Reads run as tasks on the tokio runtime and reply when their chunks arrive, so a FUSE
//! worker thread is never blocked on the object store; metadata answers come straight from
//! the in-memory tree. Attributes and entries never expire (the data is immutable) and files
//! open with `FOPEN_KEEP_CACHE`, so the page cache survives reopening.
//!
//! Each operation that reaches [`SealedFs`] runs in a `fuse` span (debug level, named by the
//! operation, with its inode), so what a slow read fetched is traced under the read that
//! waited (`RUST_LOG=sealed_mount=debug`).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use tokio::runtime::Handle;
use tracing::Instrument;

use crate::error::FsError;
use crate::fs::SealedFs;
use crate::passthrough::Passthrough;
use crate::tree::{Attr, NodeType};

/// "Forever" for the kernel's attribute and entry caches: the data cannot change.
const TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Largest read or write request the kernel sends.
pub const MAX_REQUEST: u32 = 1 << 20;

pub struct FuseAdapter {
    fs: Arc<SealedFs>,
    runtime: Handle,
    uid: u32,
    gid: u32,
    passthrough: Passthrough,
}

impl FuseAdapter {
    pub fn new(fs: Arc<SealedFs>, runtime: Handle) -> Self {
        Self::with_passthrough(fs, runtime, true, None)
    }

    /// `passthrough`: answer opens of hydrated files with FUSE passthrough where the kernel
    /// and privileges allow (`crate::passthrough`); false serves every read in the daemon.
    /// `io_mode_record`: where a restartable mount records its inodes' io modes for the
    /// server that resumes it (`crate::io_modes`).
    pub fn with_passthrough(
        fs: Arc<SealedFs>,
        runtime: Handle,
        passthrough: bool,
        io_mode_record: Option<&std::path::Path>,
    ) -> Self {
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        FuseAdapter {
            fs,
            runtime,
            uid,
            gid,
            passthrough: Passthrough::new(
                passthrough,
                io_mode_record.map(crate::io_modes::IoModeRecord::new),
            ),
        }
    }

    /// Before serving a connection this process mounted.
    pub(crate) fn start_fresh(&self) {
        self.passthrough.start_fresh();
    }

    /// Before serving a live connection another server left: takes over its io modes.
    pub(crate) fn inherit_io_modes(&self) {
        self.passthrough.inherit(&self.fs);
    }

    fn attr(&self, a: &Attr) -> FileAttr {
        let kind = match a.kind {
            NodeType::Dir => FileType::Directory,
            NodeType::File => FileType::RegularFile,
            NodeType::Symlink => FileType::Symlink,
        };
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind,
            perm: a.perm,
            nlink: a.nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: MAX_REQUEST,
            flags: 0,
        }
    }
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_REQUEST);
        if let Err(nearest) = config.set_max_readahead(MAX_REQUEST) {
            let _ = config.set_max_readahead(nearest);
        }
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        // FUSE_ASYNC_DIO: the kernel sends the 1 MiB pieces of one large O_DIRECT read
        // (fastsafetensors' default on an unknown filesystem) at once, not one after another,
        // so a daemon-served O_DIRECT read is fetched in parallel like a buffered one.
        let wanted = InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ASYNC_DIO;
        let _ = config.add_capabilities(wanted & config.capabilities());
        if self.passthrough.wanted() {
            let offered = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH);
            // Backing files on a plain filesystem (stack depth 0) under this one (depth 1).
            let enabled = offered
                && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            self.passthrough
                .set_available(enabled, "the kernel does not offer FUSE_PASSTHROUGH");
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _span = tracing::debug_span!("fuse", op = "lookup", parent = parent.0).entered();
        match self.fs.lookup(parent.0, name.as_bytes()) {
            Ok(a) => reply.entry(&TTL, &self.attr(&a), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _span = tracing::debug_span!("fuse", op = "getattr", ino = ino.0).entered();
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&TTL, &self.attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _span = tracing::debug_span!("fuse", op = "readlink", ino = ino.0).entered();
        match self.fs.readlink(ino.0) {
            Ok(target) => reply.data(target.as_bytes()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &Path,
        reply: ReplyEntry,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _span = tracing::debug_span!("fuse", op = "open", ino = ino.0).entered();
        let write = flags.acc_mode() != OpenAccMode::O_RDONLY
            || flags.0 & (libc::O_TRUNC | libc::O_APPEND) != 0;
        match self.fs.open(ino.0, write) {
            Ok(fh) if self.fs.tree().kind(ino.0) == Some(NodeType::File) => {
                {
                    // Model-aware prefetch starts in the background (`crate::prefetch`).
                    let _runtime = self.runtime.enter();
                    crate::prefetch::on_open(&self.fs, ino.0);
                }
                self.passthrough.open(&self.fs, ino.0, fh, reply)
            }
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let fs = self.fs.clone();
        let span = tracing::debug_span!("fuse", op = "read", ino = ino.0, fh = fh.0, offset, size);
        self.runtime.spawn(
            async move {
                match fs.read(ino.0, Some(fh.0), offset, size).await {
                    Ok(data) => reply.data(&data),
                    Err(e) => reply.error(errno(&e)),
                }
            }
            .instrument(span),
        );
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _span = tracing::debug_span!("fuse", op = "release", ino = ino.0, fh = fh.0).entered();
        self.fs.release(fh.0);
        self.passthrough.release(&self.fs, fh.0);
        reply.ok();
        let _runtime = self.runtime.enter();
        self.fs.released(ino.0);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        // ENOSYS once makes the kernel stop asking for the life of the mount.
        reply.error(errno(&FsError::NotSupported));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: ReplyXattr) {
        reply.error(errno(&FsError::NotSupported));
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _span = tracing::debug_span!("fuse", op = "opendir", ino = ino.0).entered();
        match self.fs.getattr(ino.0) {
            Ok(a) if a.kind == NodeType::Dir => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Ok(_) => reply.error(errno(&FsError::NotDir)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _span = tracing::debug_span!("fuse", op = "readdir", ino = ino.0, offset).entered();
        let walked = self.fs.readdir_with(ino.0, offset, |entry, next| {
            let kind = match entry.kind {
                NodeType::Dir => FileType::Directory,
                NodeType::File => FileType::RegularFile,
                NodeType::Symlink => FileType::Symlink,
            };
            reply.add(INodeNo(entry.ino), next, kind, &entry.name)
        });
        if let Err(e) = walked {
            return reply.error(errno(&e));
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks,
            0,
            0,
            s.files,
            0,
            s.block_size,
            s.name_max,
            s.block_size,
        );
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(errno(&FsError::ReadOnly));
    }
}
