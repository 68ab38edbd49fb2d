use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use sealed_store::pull::{PullOptions, pull};

use crate::context::{Context, resolve_digest};
use crate::output::{Bars, bytes, print_json};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// New (or empty) directory to write the version into
    pub dir: PathBuf,
    /// Chunks in flight at once across all files (fetched, or fetched and not yet written)
    #[arg(long, default_value_t = sealed_store::pull::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
}

pub async fn run(ctx: &Context, args: PullArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let digest = resolve_digest(&store, &args.digest).await?;
    let bars = Arc::new(Bars::new(ctx.progress));
    let opts = PullOptions {
        concurrency: args.concurrency,
    };
    let report = pull(&store, &digest, &args.dir, &opts, bars).await?;
    if ctx.json() {
        print_json(&report)?;
    } else {
        eprintln!(
            "pulled {} into {}: {} files, {}, every chunk verified",
            report.digest,
            report.destination.display(),
            report.files,
            bytes(report.bytes)
        );
    }
    Ok(ExitCode::SUCCESS)
}
