//! `sealed mount` / `sealed umount` (being built under the FUSE mount issue).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::context::Context;

#[derive(Args, Debug)]
pub struct MountArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// Directory to mount it on
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct UmountArgs {
    /// Mounted directory
    pub dir: PathBuf,
}

pub async fn run_mount(_ctx: &Context, _args: MountArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("sealed mount is not built yet")
}

pub async fn run_umount(_ctx: &Context, _args: UmountArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("sealed umount is not built yet")
}
