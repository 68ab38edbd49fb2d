use std::collections::HashMap;
use std::process::ExitCode;

use clap::Args;
use sealed_store::Digest;

use crate::context::Context;
use crate::output::{bytes, print_json};

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only versions pushed to this volume
    #[arg(long)]
    pub volume: Option<String>,
}

#[derive(serde::Serialize)]
struct Row {
    digest: Digest,
    bytes: u64,
    files: u64,
    stored_at: String,
    volumes: Vec<String>,
}

pub async fn run(ctx: &Context, args: LsArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let mut volumes: HashMap<Digest, Vec<String>> = HashMap::new();
    for r in store.list_volume_records().await? {
        volumes.entry(r.digest).or_default().push(r.volume);
    }
    let mut rows = Vec::new();
    for v in store.list_versions().await? {
        let vols = volumes.remove(&v.digest).unwrap_or_default();
        if let Some(want) = &args.volume
            && !vols.contains(want)
        {
            continue;
        }
        let m = store.get_manifest(&v.digest).await?;
        rows.push(Row {
            digest: v.digest,
            bytes: m.total_size(),
            files: m.files().count() as u64,
            stored_at: v.stored_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            volumes: vols,
        });
    }
    if ctx.json() {
        print_json(&rows)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<71} {:>10} {:>7} {:<20}  VOLUMES",
        "DIGEST", "SIZE", "FILES", "STORED"
    );
    for r in rows {
        println!(
            "{:<71} {:>10} {:>7} {:<20}  {}",
            r.digest.to_string(),
            bytes(r.bytes),
            r.files,
            r.stored_at,
            r.volumes.join(",")
        );
    }
    Ok(ExitCode::SUCCESS)
}
