//! `sealed diff FROM TO`: files added, removed and changed from one version to another, and
//! the bytes a push of TO after FROM uploads. Either side may be a local directory, sealed in
//! memory as `sealed push` would seal it (nothing is uploaded): `sealed diff DIGEST ./model`
//! is what pushing ./model would change. `--exit-code` exits 1 when they differ, as
//! `git diff --exit-code` does.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use sealed_store::diff::diff;
use sealed_store::{ChunkStore, Digest, Manifest};

use crate::commands::local::{ScanArgs, seal_locally};
use crate::context::{Context, resolve_digest};
use crate::output::{Bars, bytes, print_json};

#[derive(Args, Debug)]
pub struct DiffArgs {
    /// The earlier version: a digest (or the start of one), or a local directory
    pub from: String,
    /// The later version: a digest (or the start of one), or a local directory
    pub to: String,
    /// Exit 1 when the two differ (files added, removed or changed), 0 when they are the
    /// same, as `git diff --exit-code`
    #[arg(long)]
    pub exit_code: bool,
    /// How a directory side is sealed (the same flags as `sealed push`)
    #[command(flatten)]
    pub scan: ScanArgs,
}

/// One side of the comparison, as the command line named it.
enum Side {
    Version(String),
    Dir(PathBuf),
}

impl Side {
    /// An existing directory is a directory (write `blake3:` before a short digest that is
    /// also a directory's name); anything else is a digest.
    fn of(arg: &str) -> Side {
        if !arg.starts_with("blake3:") && Path::new(arg).is_dir() {
            Side::Dir(PathBuf::from(arg))
        } else {
            Side::Version(arg.to_owned())
        }
    }
}

#[derive(serde::Serialize)]
struct Report {
    /// The digest of each side (a directory's: what a push of it would print).
    from: Digest,
    to: Digest,
    same: bool,
    #[serde(flatten)]
    diff: sealed_store::diff::DiffReport,
}

pub async fn run(ctx: &Context, args: DiffArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let (a, ma) = side(ctx, &store, &args.from, &args.scan).await?;
    let (b, mb) = side(ctx, &store, &args.to, &args.scan).await?;
    let report = diff(&ma, &mb);
    let same = report.added.is_empty() && report.removed.is_empty() && report.changed.is_empty();
    let code = if args.exit_code && !same {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    };
    if ctx.json() {
        print_json(&Report {
            from: a,
            to: b,
            same,
            diff: report,
        })?;
        return Ok(code);
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
    Ok(code)
}

/// The digest and manifest of one side: a version's from the store, a directory's sealed in
/// memory.
async fn side(
    ctx: &Context,
    store: &ChunkStore,
    arg: &str,
    scan: &ScanArgs,
) -> anyhow::Result<(Digest, Manifest)> {
    match Side::of(arg) {
        Side::Version(v) => {
            let d = resolve_digest(store, &v).await?;
            Ok((d, store.get_manifest(&d).await?))
        }
        Side::Dir(dir) => {
            let bars = Arc::new(Bars::new(ctx.progress));
            let local = seal_locally(&dir, store.name(), scan, bars).await?;
            let (_, d) = local.manifest.seal()?;
            Ok((d, local.manifest))
        }
    }
}
