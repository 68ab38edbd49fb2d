use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use sealed_store::pull::{PullOptions, pull};
use sealed_store::scan::PathFilter;

use crate::context::{Context, resolve_digest};
use crate::output::{Bars, bytes, print_json};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// Directory to write the version into: a new or empty one, or one a pull already wrote
    /// into (resumed: files that already hash to the version's content are kept, the others
    /// written; files the version does not name are left alone)
    pub dir: PathBuf,
    /// Chunks in flight at once across all files (fetched, or fetched and not yet written)
    #[arg(long, default_value_t = sealed_store::pull::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Pull only files and links matching GLOB (repeatable; `*` crosses `/`, as push
    /// matches), with the directories that hold them
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
}

pub async fn run(ctx: &Context, args: PullArgs) -> anyhow::Result<ExitCode> {
    let filter = PathFilter::new(&args.include, &[])?;
    let store = ctx.open_store().await?;
    let digest = resolve_digest(&store, &args.digest).await?;
    let bars = Arc::new(Bars::new(ctx.progress));
    let opts = PullOptions {
        concurrency: args.concurrency,
        filter,
    };
    let report = pull(&store, &digest, &args.dir, &opts, bars).await?;
    if ctx.json() {
        print_json(&report)?;
    } else {
        let kept = if report.files_kept > 0 {
            format!(
                " ({} files, {} already there and verified)",
                report.files_kept,
                bytes(report.bytes_kept)
            )
        } else {
            String::new()
        };
        eprintln!(
            "pulled {} into {}: {} files, {}{kept}, every chunk verified",
            report.digest,
            report.destination.display(),
            report.files,
            bytes(report.bytes)
        );
    }
    Ok(ExitCode::SUCCESS)
}
