//! `sealed rm DIGEST`: move a version to the trash, restorable for a retention period.
//! `sealed rm DIGEST --volume NS/NAME`: remove one volume's reference to it (what the
//! operator does when a SealedVolumeVersion is deleted); the version goes to the trash only
//! when no other volume references it (docs/gc.md).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use sealed_store::refs::{RemoveReport, remove_all_references, remove_reference};

use crate::context::{Context, resolve_digest};
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// How long the version stays restorable with `sealed restore` (Go duration: 168h, 30m, 0)
    #[arg(long, default_value = "168h", value_parser = parse_duration_arg)]
    pub retention: Duration,
    /// Remove only this volume's reference (NAME or NAMESPACE/NAME); without it, every
    /// volume's reference goes and the version moves to the trash
    #[arg(long, value_name = "NS/NAME")]
    pub volume: Option<String>,
}

/// Parses a Go-style duration (`168h`, `1h30m`, `0`) as the CRDs' `retention` fields do,
/// at most 876000h (100 years): `--retention 3000000000h` is refused here, not a panic
/// when it is added to the clock.
pub fn parse_duration_arg(s: &str) -> Result<Duration, String> {
    sealed_crds::validate::parse_duration_checked(s).map_err(|e| e.to_string())
}

pub async fn run(ctx: &Context, args: RmArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let digest = resolve_digest(&store, &args.digest).await?;
    let report: RemoveReport = match &args.volume {
        Some(volume) => remove_reference(&store, volume, &digest, args.retention)
            .await
            .with_context(|| format!("cannot remove {volume}'s reference to {digest}"))?,
        None => remove_all_references(&store, &digest, args.retention)
            .await
            .with_context(|| format!("cannot delete {digest}"))?,
    };
    if ctx.json() {
        // The trash record's fields (as before references existed) plus what happened to them.
        let mut out = match &report.trashed {
            Some(record) => serde_json::to_value(record)?,
            None => serde_json::json!({ "digest": report.digest }),
        };
        if let Some(map) = out.as_object_mut() {
            map.insert("trashed".into(), report.trashed.is_some().into());
            if let Some(volume) = &args.volume {
                map.insert("volume".into(), volume.as_str().into());
            }
            map.insert("references_removed".into(), report.removed.clone().into());
            map.insert(
                "still_referenced_by".into(),
                report.still_referenced_by.clone().into(),
            );
        }
        print_json(&out)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(volume) = &args.volume {
        println!("removed {volume}'s reference to {}", report.digest);
    } else if !report.removed.is_empty() {
        println!(
            "removed {} volume reference(s) to {}: {}",
            report.removed.len(),
            report.digest,
            report.removed.join(", ")
        );
    }
    match &report.trashed {
        Some(record) => println!(
            "deleted {} (restorable until {}; `sealed restore {}` brings it back)",
            record.digest,
            record.restorable_until.format("%Y-%m-%dT%H:%M:%SZ"),
            record.digest
        ),
        None => println!(
            "{} stays live: still referenced by {}",
            report.digest,
            report.still_referenced_by.join(", ")
        ),
    }
    Ok(ExitCode::SUCCESS)
}
