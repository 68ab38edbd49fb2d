//! `sealed trash ls`: deleted versions and until when each can be restored.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use sealed_store::trash::{list_trash, read_trashed_manifest};
use sealed_store::{Digest, Manifest};

use crate::context::Context;
use crate::output::{bytes, print_json};

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
    /// With `-o wide`: the version's size and files, from its trashed manifest.
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    files: Option<u64>,
}

pub async fn run(ctx: &Context, args: TrashArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        TrashCommand::Ls => ls(ctx).await,
    }
}

async fn ls(ctx: &Context) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let fmt = "%Y-%m-%dT%H:%M:%SZ";
    let mut rows: Vec<Row> = list_trash(&store)
        .await?
        .into_iter()
        .map(|r| Row {
            digest: r.digest,
            deleted_at: r.deleted_at.format(fmt).to_string(),
            restorable_until: r.restorable_until.format(fmt).to_string(),
            restorable: !r.is_expired(),
            bytes: None,
            files: None,
        })
        .collect();
    if ctx.wide() {
        for r in &mut rows {
            // A manifest already collected (or damaged) leaves its columns empty.
            if let Ok(Some(raw)) = read_trashed_manifest(&store, &r.digest).await
                && let Ok(m) = Manifest::parse(&raw)
            {
                r.bytes = Some(m.total_size());
                r.files = Some(m.files().count() as u64);
            }
        }
        print_wide(&rows);
        return Ok(ExitCode::SUCCESS);
    }
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

/// `-o wide`: each version's size and file count too.
fn print_wide(rows: &[Row]) {
    println!(
        "{:<71} {:>10} {:>7} {:<20}  {:<20}  RESTORABLE",
        "DIGEST", "SIZE", "FILES", "DELETED", "RESTORABLE UNTIL"
    );
    for r in rows {
        println!(
            "{:<71} {:>10} {:>7} {:<20}  {:<20}  {}",
            r.digest.to_string(),
            r.bytes.map(bytes).unwrap_or_else(|| "-".into()),
            r.files.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
            r.deleted_at,
            r.restorable_until,
            if r.restorable { "yes" } else { "expired" }
        );
    }
}
