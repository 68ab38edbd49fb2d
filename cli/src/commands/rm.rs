//! `sealed rm DIGEST`: move a version to the trash, restorable for a retention period.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use sealed_store::trash::trash_version;

use crate::context::{Context, resolve_digest};
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// How long the version stays restorable with `sealed restore` (Go duration: 168h, 30m, 0)
    #[arg(long, default_value = "168h", value_parser = parse_duration_arg)]
    pub retention: Duration,
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
    let record = trash_version(&store, &digest, args.retention)
        .await
        .with_context(|| format!("cannot delete {digest}"))?;
    if ctx.json() {
        print_json(&record)?;
    } else {
        println!(
            "deleted {} (restorable until {}; `sealed restore {}` brings it back)",
            record.digest,
            record.restorable_until.format("%Y-%m-%dT%H:%M:%SZ"),
            record.digest
        );
    }
    Ok(ExitCode::SUCCESS)
}
