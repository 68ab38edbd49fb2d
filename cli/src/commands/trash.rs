//! `sealed trash ls`: deleted versions and until when each can be restored.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use sealed_store::Digest;
use sealed_store::trash::list_trash;

use crate::context::Context;
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct TrashArgs {
    #[command(subcommand)]
    pub command: TrashCommand,
}

#[derive(Subcommand, Debug)]
pub enum TrashCommand {
    /// List deleted versions, newest deletion first
    Ls,
}

#[derive(serde::Serialize)]
struct Row {
    digest: Digest,
    deleted_at: String,
    restorable_until: String,
    /// False once the retention has passed: the next `sealed gc` reclaims it.
    restorable: bool,
}

pub async fn run(ctx: &Context, args: TrashArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        TrashCommand::Ls => ls(ctx).await,
    }
}

async fn ls(ctx: &Context) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let fmt = "%Y-%m-%dT%H:%M:%SZ";
    let rows: Vec<Row> = list_trash(&store)
        .await?
        .into_iter()
        .map(|r| Row {
            digest: r.digest,
            deleted_at: r.deleted_at.format(fmt).to_string(),
            restorable_until: r.restorable_until.format(fmt).to_string(),
            restorable: !r.is_expired(),
        })
        .collect();
    if ctx.json() {
        print_json(&rows)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<71} {:<20}  RESTORABLE UNTIL", "DIGEST", "DELETED");
    for r in rows {
        println!(
            "{:<71} {:<20}  {}{}",
            r.digest.to_string(),
            r.deleted_at,
            r.restorable_until,
            if r.restorable {
                ""
            } else {
                " (expired: reclaimed by the next gc)"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}
