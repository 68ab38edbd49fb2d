//! `sealed restore DIGEST`: bring a deleted version back from the trash.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use sealed_store::trash::restore_version;

use crate::context::{Context, resolve_trashed_digest};
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Version digest (blake3:…), as `sealed trash ls` shows it
    pub digest: String,
}

pub async fn run(ctx: &Context, args: RestoreArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let digest = resolve_trashed_digest(&store, &args.digest).await?;
    let report = restore_version(&store, &digest)
        .await
        .with_context(|| format!("cannot restore {digest}"))?;
    if ctx.json() {
        print_json(&report)?;
    } else if report.restored {
        println!("restored {}", report.digest);
        if !report.references_restored.is_empty() {
            println!(
                "references restored: {}",
                report.references_restored.join(", ")
            );
        }
    } else {
        println!("{} is not deleted; nothing to restore", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}
