use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use sealed_store::push::{PushOptions, push};

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
}

pub async fn run(ctx: &Context, args: PushArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let opts = PushOptions {
        threads: args.threads,
        concurrency: args.concurrency,
        volume: args.volume,
        ..Default::default()
    };
    let bars = Arc::new(Bars::new(ctx.progress));
    let report = push(&store, &args.dir, &opts, bars).await?;
    if ctx.json() {
        print_json(&report)?;
    } else {
        eprintln!(
            "sealed {} files, {} in {} chunks: uploaded {} ({} chunks), reused {}",
            report.files,
            bytes(report.bytes),
            report.chunks,
            bytes(report.bytes_uploaded),
            report.chunks_uploaded,
            bytes(report.bytes_reused),
        );
        // The digest alone on stdout, so `d=$(sealed push ./model)` works.
        println!("{}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}
