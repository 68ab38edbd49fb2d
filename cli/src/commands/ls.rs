use std::collections::HashMap;
use std::process::ExitCode;

use clap::Args;
use futures::{StreamExt, TryStreamExt};
use sealed_store::{Digest, EntryKind, Manifest};

use crate::context::Context;
use crate::output::{bytes, print_json};

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only versions pushed to this volume
    #[arg(long)]
    pub volume: Option<String>,
}

/// Manifest GETs in flight at once: enough to hide an object store's round trip, few enough
/// not to look like a burst to a rate-limited bucket.
const MANIFESTS_AT_ONCE: usize = 16;

#[derive(serde::Serialize)]
struct Row {
    digest: Digest,
    bytes: u64,
    files: u64,
    directories: u64,
    symlinks: u64,
    /// Distinct chunks, and their bytes (what the version costs in the store alone).
    unique_chunks: u64,
    unique_bytes: u64,
    stored_at: String,
    volumes: Vec<String>,
}

pub async fn run(ctx: &Context, args: LsArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let mut volumes: HashMap<Digest, Vec<String>> = HashMap::new();
    for r in store.list_volume_records().await? {
        volumes.entry(r.digest).or_default().push(r.volume);
    }
    let mut listed = Vec::new();
    for v in store.list_versions().await? {
        let vols = volumes.remove(&v.digest).unwrap_or_default();
        if let Some(want) = &args.volume
            && !vols.contains(want)
        {
            continue;
        }
        listed.push((v, vols));
    }
    // One GET per version: several in flight (a round trip each on S3), in listing order.
    let rows: Vec<Row> = futures::stream::iter(listed)
        .map(|(v, vols)| {
            let store = &store;
            async move {
                let m = store.get_manifest(&v.digest).await?;
                let stored_at = v.stored_at.format("%Y-%m-%dT%H:%M:%SZ").to_string();
                Ok::<_, anyhow::Error>(row(v.digest, &m, stored_at, vols))
            }
        })
        .buffered(MANIFESTS_AT_ONCE)
        .try_collect()
        .await?;
    if ctx.json() {
        print_json(&rows)?;
        return Ok(ExitCode::SUCCESS);
    }
    if ctx.wide() {
        print_wide(&rows);
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

fn row(digest: Digest, m: &Manifest, stored_at: String, volumes: Vec<String>) -> Row {
    let unique = m.unique_chunks();
    let count = |kind: fn(&EntryKind) -> bool| m.entries.iter().filter(|e| kind(&e.kind)).count();
    Row {
        digest,
        bytes: m.total_size(),
        files: m.files().count() as u64,
        directories: count(|k| matches!(k, EntryKind::Dir)) as u64,
        symlinks: count(|k| matches!(k, EntryKind::Symlink { .. })) as u64,
        unique_chunks: unique.len() as u64,
        unique_bytes: unique.iter().map(|c| u64::from(c.len)).sum(),
        stored_at,
        volumes,
    }
}

/// `-o wide`: directories, symlinks and the distinct chunks too.
fn print_wide(rows: &[Row]) {
    println!(
        "{:<71} {:>10} {:>7} {:>6} {:>6} {:>7} {:>10} {:<20}  VOLUMES",
        "DIGEST", "SIZE", "FILES", "DIRS", "LINKS", "CHUNKS", "UNIQUE", "STORED"
    );
    for r in rows {
        println!(
            "{:<71} {:>10} {:>7} {:>6} {:>6} {:>7} {:>10} {:<20}  {}",
            r.digest.to_string(),
            bytes(r.bytes),
            r.files,
            r.directories,
            r.symlinks,
            r.unique_chunks,
            bytes(r.unique_bytes),
            r.stored_at,
            r.volumes.join(",")
        );
    }
}
