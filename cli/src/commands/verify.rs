use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use sealed_store::verify::verify;

use crate::context::{Context, resolve_digest};
use crate::output::{Bars, bytes, print_json};

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// Chunks checked at once
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
}

pub async fn run(ctx: &Context, args: VerifyArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let digest = resolve_digest(&store, &args.digest).await?;
    let bars = Arc::new(Bars::new(ctx.progress));
    let report = verify(&store, &digest, args.concurrency, bars).await?;
    if ctx.json() {
        print_json(&report)?;
    } else if report.ok() {
        println!(
            "OK {}: {} chunks, {} verified",
            report.digest,
            report.chunks_checked,
            bytes(report.bytes_checked)
        );
    } else {
        for p in &report.problems {
            println!(
                "{:?} chunk {} used by {}",
                p.problem,
                p.chunk,
                p.files.join(", ")
            );
        }
        println!(
            "FAILED {}: {} of {} chunks missing or corrupt",
            report.digest,
            report.problems.len(),
            report.chunks_checked
        );
    }
    Ok(if report.ok() {
        ExitCode::SUCCESS
    } else {
        crate::errors::Failure::Corrupt.code()
    })
}
