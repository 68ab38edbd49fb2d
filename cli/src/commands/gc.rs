//! `sealed gc`: reclaim expired trash and the chunks no live or restorable version uses.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use sealed_store::gc::{GcOptions, collect};

use crate::commands::rm::parse_duration_arg;
use crate::context::Context;
use crate::output::{bytes, print_json};

#[derive(Args, Debug)]
pub struct GcArgs {
    /// Report what would be deleted; delete nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Never delete a chunk written less than this long ago (Go duration: 1h, 30m, 0)
    #[arg(long, default_value = "1h", value_parser = parse_duration_arg)]
    pub grace: Duration,
    /// How long to wait for pushes in flight before skipping this run
    #[arg(long, default_value = "30s", value_parser = parse_duration_arg)]
    pub writer_wait: Duration,
}

pub async fn run(ctx: &Context, args: GcArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let opts = GcOptions {
        dry_run: args.dry_run,
        grace: args.grace,
        writer_wait: args.writer_wait,
        ..Default::default()
    };
    let report = collect(&store, &opts)
        .await
        .with_context(|| format!("garbage collection of {} failed", store.name()))?;
    if ctx.json() {
        print_json(&report)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(why) = &report.skipped {
        println!("{why}; nothing was deleted, run `sealed gc` again later");
        return Ok(ExitCode::SUCCESS);
    }
    let verb = if report.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    println!(
        "scanned {} manifests, {} trash entries, {} chunks ({} in use)",
        report.manifests_scanned, report.trash_scanned, report.chunks_scanned, report.chunks_marked
    );
    println!(
        "{verb} {} expired trash entr{}, {} chunks, {}",
        report.trash_expired,
        if report.trash_expired == 1 {
            "y"
        } else {
            "ies"
        },
        report.chunks_deleted,
        bytes(report.bytes_freed)
    );
    if report.chunks_in_grace > 0 {
        println!(
            "kept {} unused chunks younger than the grace period",
            report.chunks_in_grace
        );
    }
    if report.dry_run && !report.active_writers.is_empty() {
        println!(
            "{} writers are active; a real run would wait for them",
            report.active_writers.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
