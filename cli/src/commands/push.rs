use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use sealed_store::push::{PushOptions, StatCachePolicy, push};
use sealed_store::scan::{FollowSymlinks, PathFilter};
use sealed_store::stat_cache::StatCacheConfig;

use crate::context::Context;
use crate::output::{Bars, bytes, print_json};

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Directory to seal
    pub dir: PathBuf,
    /// Record the version under this volume (NAME or NAMESPACE/NAME)
    #[arg(long)]
    pub volume: Option<String>,
    /// Threads for chunking and hashing (default: every core)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Uploads in flight at once
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
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
    /// under ~/.cache/sealed/stat is rewritten)
    #[arg(long)]
    pub rehash: bool,
}

pub async fn run(ctx: &Context, args: PushArgs) -> anyhow::Result<ExitCode> {
    let filter = PathFilter::new(&args.include, &args.exclude)?;
    // A push may create a file:// store, as the default one is created.
    let store = ctx.open_store_for_push().await?;
    let opts = PushOptions {
        threads: args.threads,
        concurrency: args.concurrency,
        volume: args.volume,
        follow_symlinks: args.follow_symlinks.then_some(FollowSymlinks {
            roots: args.allow_root,
        }),
        filter,
        stat_cache: stat_cache_policy(args.rehash),
        ..Default::default()
    };
    let bars = Arc::new(Bars::new(ctx.progress));
    let report = push(&store, &args.dir, &opts, bars).await?;
    if ctx.json() {
        print_json(&report)?;
    } else {
        eprintln!(
            "sealed {} files, {} in {} chunks: uploaded {} ({} chunks), reused {}; read {} \
             ({} files unchanged since the last push)",
            report.files,
            bytes(report.bytes),
            report.chunks,
            bytes(report.bytes_uploaded),
            report.chunks_uploaded,
            bytes(report.bytes_reused),
            bytes(report.bytes_read),
            report.files_cached,
        );
        // The digest alone on stdout, so `d=$(sealed push ./model)` works.
        println!("{}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}

/// The stat cache under the user's cache directory; without one (no `$HOME`), every file is
/// read, as with `--rehash`.
fn stat_cache_policy(rehash: bool) -> StatCachePolicy {
    match StatCacheConfig::user_default() {
        None => {
            tracing::warn!("no cache directory ($XDG_CACHE_HOME, $HOME): every file is read");
            StatCachePolicy::Off
        }
        Some(cfg) if rehash => StatCachePolicy::Rehash(cfg),
        Some(cfg) => StatCachePolicy::Use(cfg),
    }
}
