use std::process::ExitCode;

use clap::Args;
use sealed_store::diff::diff;

use crate::context::{Context, resolve_digest};
use crate::output::{bytes, print_json};

#[derive(Args, Debug)]
pub struct DiffArgs {
    /// The earlier version
    pub from: String,
    /// The later version
    pub to: String,
}

pub async fn run(ctx: &Context, args: DiffArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let a = resolve_digest(&store, &args.from).await?;
    let b = resolve_digest(&store, &args.to).await?;
    let (ma, mb) = (store.get_manifest(&a).await?, store.get_manifest(&b).await?);
    let report = diff(&ma, &mb);
    if ctx.json() {
        print_json(&report)?;
        return Ok(ExitCode::SUCCESS);
    }
    for p in &report.added {
        println!("+ {p}");
    }
    for p in &report.removed {
        println!("- {p}");
    }
    for c in &report.changed {
        println!("~ {} ({})", c.path, c.what);
    }
    let pct = if report.total_bytes == 0 {
        0.0
    } else {
        100.0 * report.new_bytes as f64 / report.total_bytes as f64
    };
    println!(
        "{} added, {} removed, {} changed; pushing {} after {} uploads {} in {} chunks ({pct:.1}% of {})",
        report.added.len(),
        report.removed.len(),
        report.changed.len(),
        b,
        a,
        bytes(report.new_bytes),
        report.new_chunks,
        bytes(report.total_bytes)
    );
    Ok(ExitCode::SUCCESS)
}
