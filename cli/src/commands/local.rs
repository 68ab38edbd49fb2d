//! A local directory sealed in memory, as `sealed push` would seal it, without writing
//! anything anywhere: the manifest (and so the digest) a push would make, for `sealed push
//! --dry-run` and `sealed diff DIR ...`.
//!
//! The same scan as push's (`sealed_store::scan::scan`, same chunker parameters, filters and
//! symlink rules), so the digest is the one a push prints. Files the stat cache vouches for
//! are not read (their chunks are the cache's, as for a push); the cache is only read, never
//! written.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use sealed_store::scan::{FollowSymlinks, PathFilter, ScanOptions, scan};
use sealed_store::stat_cache::{StatCache, StatCacheConfig};
use sealed_store::{ChunkParams, Manifest, Progress};

/// What decides which files a push seals and how: the flags `push` and `diff` share.
#[derive(Args, Debug, Clone, Default)]
pub struct ScanArgs {
    /// Threads for chunking and hashing (default: every core)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seal what symlinks point to instead of the links (a `huggingface-cli download`
    /// snapshot: links into its blobs/ directory, which is allowed); a link that dangles,
    /// loops or leaves the allowed roots is refused
    #[arg(long)]
    pub follow_symlinks: bool,
    /// With --follow-symlinks, also allow targets under DIR (repeatable)
    #[arg(long, value_name = "DIR", requires = "follow_symlinks")]
    pub allow_root: Vec<PathBuf>,
    /// Seal only paths matching GLOB (repeatable; `*` crosses `/`, as the operator's
    /// Hugging Face sync matches)
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Leave out paths matching GLOB (repeatable)
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Read and hash every file, even those the stat cache says are unchanged (the cache
    /// under ~/.cache/sealed/stat is rewritten by a push)
    #[arg(long)]
    pub rehash: bool,
}

impl ScanArgs {
    pub fn filter(&self) -> anyhow::Result<PathFilter> {
        Ok(PathFilter::new(&self.include, &self.exclude)?)
    }

    pub fn follow(&self) -> Option<FollowSymlinks> {
        self.follow_symlinks.then(|| FollowSymlinks {
            roots: self.allow_root.clone(),
        })
    }
}

/// A directory sealed in memory.
pub struct LocalTree {
    pub manifest: Manifest,
    /// Bytes of file content read and hashed (the rest came from the stat cache).
    pub bytes_read: u64,
}

/// Scans and hashes `dir` as a push to the store named `store_name` would (its stat cache is
/// the one that push uses), writing nothing.
pub async fn seal_locally(
    dir: &Path,
    store_name: &str,
    args: &ScanArgs,
    progress: Arc<dyn Progress>,
) -> anyhow::Result<LocalTree> {
    let params = ChunkParams::default();
    let mut opts = ScanOptions {
        threads: args.threads,
        follow_symlinks: args.follow(),
        filter: args.filter()?,
        stat_cache: None,
    };
    if !args.rehash
        && let Some(cfg) = StatCacheConfig::user_default()
    {
        opts.stat_cache = Some(Arc::new(StatCache::load(&cfg, dir, store_name, &params)));
    }
    let dir = dir.to_path_buf();
    let shown = dir.display().to_string();
    let tree = tokio::task::spawn_blocking(move || {
        let p = progress.clone();
        let tree = scan(
            &dir,
            &params,
            &opts,
            &|total| p.start(sealed_store::progress::Phase::Scan, total),
            &|n| progress.advance(n),
            // Nothing is uploaded: the chunks' bytes are dropped once hashed.
            &|_, _| Ok(()),
        );
        progress.finish();
        tree
    })
    .await
    .context("the hashing task failed")?
    .with_context(|| format!("cannot seal {shown}"))?;
    Ok(LocalTree {
        manifest: tree.manifest,
        bytes_read: tree.bytes_read,
    })
}
