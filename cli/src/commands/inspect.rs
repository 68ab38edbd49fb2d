use std::process::ExitCode;

use clap::Args;
use sealed_store::{ChunkParams, Digest, EntryKind};

use crate::context::{Context, resolve_digest};
use crate::output::{bytes, print_json};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// With --output json, include every chunk's digest and length
    #[arg(long)]
    pub chunks: bool,
}

#[derive(serde::Serialize)]
struct InspectJson<'a> {
    digest: Digest,
    chunking: &'a ChunkParams,
    files: u64,
    directories: u64,
    symlinks: u64,
    bytes: u64,
    chunks: u64,
    unique_chunks: u64,
    unique_bytes: u64,
    manifest_bytes: u64,
    entries: Vec<EntryJson<'a>>,
}

#[derive(serde::Serialize)]
struct EntryJson<'a> {
    path: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    executable: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    blake3: Option<Digest>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chunk_count: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chunks: Option<Vec<(Digest, u32)>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<&'a str>,
}

pub async fn run(ctx: &Context, args: InspectArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let digest = resolve_digest(&store, &args.digest).await?;
    let raw = store.get_manifest_bytes(&digest).await?;
    let manifest = sealed_store::Manifest::parse(&raw)?;
    let unique = manifest.unique_chunks();
    let mut doc = InspectJson {
        digest,
        chunking: &manifest.chunking,
        files: 0,
        directories: 0,
        symlinks: 0,
        bytes: manifest.total_size(),
        chunks: 0,
        unique_chunks: unique.len() as u64,
        unique_bytes: unique.iter().map(|c| u64::from(c.len)).sum(),
        manifest_bytes: raw.len() as u64,
        entries: Vec::new(),
    };
    for e in &manifest.entries {
        let mut j = EntryJson {
            path: &e.path,
            kind: "directory",
            size: None,
            executable: None,
            blake3: None,
            chunk_count: None,
            chunks: None,
            target: None,
        };
        match &e.kind {
            EntryKind::Dir => doc.directories += 1,
            EntryKind::File(f) => {
                doc.files += 1;
                doc.chunks += f.chunks.len() as u64;
                j.kind = "file";
                j.size = Some(f.size);
                j.executable = Some(f.executable);
                j.blake3 = Some(f.blake3);
                j.chunk_count = Some(f.chunks.len());
                if args.chunks {
                    j.chunks = Some(f.chunks.iter().map(|c| (c.digest, c.len)).collect());
                }
            }
            EntryKind::Symlink { target } => {
                doc.symlinks += 1;
                j.kind = "symlink";
                j.target = Some(target);
            }
        }
        doc.entries.push(j);
    }
    if ctx.json() {
        print_json(&doc)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!("Version:   {}", doc.digest);
    println!(
        "Contents:  {} files, {} directories, {} symlinks, {}",
        doc.files,
        doc.directories,
        doc.symlinks,
        bytes(doc.bytes)
    );
    println!(
        "Chunks:    {} ({} distinct, {})",
        doc.chunks,
        doc.unique_chunks,
        bytes(doc.unique_bytes)
    );
    let c = &manifest.chunking;
    println!(
        "Chunking:  {} ({}), min {} / avg {} / max {}",
        c.algorithm,
        c.implementation,
        bytes(u64::from(c.min_size)),
        bytes(u64::from(c.avg_size)),
        bytes(u64::from(c.max_size))
    );
    println!();
    let wide = ctx.wide();
    if wide {
        println!(
            "{:<10} {:>12} {:>7}  {:<71}  PATH",
            "MODE", "SIZE", "CHUNKS", "BLAKE3 (b3sum of the file)"
        );
    } else {
        println!("{:<10} {:>12} {:>7}  PATH", "MODE", "SIZE", "CHUNKS");
    }
    for e in &doc.entries {
        let mode = match (e.kind, e.executable) {
            ("directory", _) => "drwxr-xr-x",
            ("symlink", _) => "lrwxrwxrwx",
            (_, Some(true)) => "-rwxr-xr-x",
            _ => "-rw-r--r--",
        };
        let name = match e.target {
            Some(t) => format!("{} -> {t}", e.path),
            None => e.path.to_string(),
        };
        let size = e.size.map(bytes).unwrap_or_else(|| "-".into());
        let chunks = e
            .chunk_count
            .map(|n| n.to_string())
            .unwrap_or_else(|| "-".into());
        if wide {
            let blake3 = e
                .blake3
                .map(|d| d.to_string())
                .unwrap_or_else(|| "-".into());
            println!("{mode:<10} {size:>12} {chunks:>7}  {blake3:<71}  {name}");
        } else {
            println!("{mode:<10} {size:>12} {chunks:>7}  {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
