//! `sealed`: publish a directory once as an immutable version named by its digest, and get it
//! back anywhere. Installed as `kubectl-sealed` it is also a kubectl plugin.

mod commands;
mod context;
mod errors;
mod kube_args;
mod output;
mod serving_lock;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::context::{Context, GlobalArgs};

#[derive(Parser)]
#[command(
    name = "sealed",
    version,
    about = "Publish model data once; mount it anywhere by content digest"
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Seal a directory as a version; prints its digest (uploads only new chunks)
    Push(commands::push::PushArgs),
    /// Materialise a version into a new directory, verifying every chunk
    Pull(commands::pull::PullArgs),
    /// Show a version's files, sizes and chunks
    Inspect(commands::inspect::InspectArgs),
    /// Compare two versions, or a local directory and a version: files added, removed, changed,
    /// and bytes a push would upload (--exit-code: exit 1 when they differ)
    Diff(commands::diff::DiffArgs),
    /// Check that every chunk of a version is present and intact
    Verify(commands::verify::VerifyArgs),
    /// List the versions in the store
    Ls(commands::ls::LsArgs),
    /// Mount a version read-only; bytes stream in as they are read
    Mount(Box<commands::mount::MountArgs>),
    /// Unmount a directory mounted by `sealed mount`
    Umount(commands::mount::UmountArgs),
    /// Delete a version to the trash; it stays restorable for --retention (default 7 days)
    Rm(commands::rm::RmArgs),
    /// Bring a deleted version back from the trash
    Restore(commands::restore::RestoreArgs),
    /// Deleted versions (`sealed trash ls`)
    Trash(commands::trash::TrashArgs),
    /// Reclaim expired trash and chunks no live or restorable version uses
    Gc(commands::gc::GcArgs),
    /// Have the cluster sync a Hugging Face repo or a bucket into a SealedVolume; prints the digest
    Sync(commands::sync::SyncArgs),
    /// Point a tag of a SealedVolume at one of its versions (--rm: remove the tag)
    Tag(commands::tag::TagArgs),
    /// Rewrite volume + tag references in manifests to the digests they name now (--check: fail while one floats)
    Pin(commands::pin::PinArgs),
    /// Print the version of `sealed` (-o json for scripts)
    Version,
    /// Print a shell completion script: `source <(sealed completions bash)`
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

const STORE_HELP: &str = "The store defaults to a local directory \
    (~/.local/share/sealed-volumes/store); set --store or SEALED_STORE for s3://, gs://, az:// \
    or file:// stores, or to a plain directory path (/srv/models).";

/// The command line, with the exit-code table under `--help`.
fn cli_command() -> clap::Command {
    Cli::command().after_help(format!("{STORE_HELP}\n\n{}", errors::EXIT_CODES_HELP))
}

fn print_version(ctx: &Context) -> anyhow::Result<std::process::ExitCode> {
    let version = env!("CARGO_PKG_VERSION");
    if ctx.json() {
        output::print_json(&serde_json::json!({ "version": version }))?;
    } else {
        println!("sealed {version}");
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn parse_cli() -> Cli {
    let matches = cli_command().get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> std::process::ExitCode {
    let cli = parse_cli();
    // `sealed ls | head` should end quietly, as coreutils do, not panic in println!. A mount
    // is a server instead: a peer that hangs up mid-answer must be an EPIPE on that socket
    // (hyper writes with writev, which has no MSG_NOSIGNAL), not the death of every mount it
    // serves, so it keeps Rust's default of ignoring SIGPIPE.
    if !matches!(cli.command, Command::Mount(_)) {
        // SAFETY: no thread exists yet (the runtime starts below); SIG_DFL is a valid
        // disposition.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    context::init_logging(cli.global.verbose);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let ctx = Context::new(cli.global);
    let result = runtime.block_on(async {
        match cli.command {
            Command::Push(a) => commands::push::run(&ctx, a).await,
            Command::Pull(a) => commands::pull::run(&ctx, a).await,
            Command::Inspect(a) => commands::inspect::run(&ctx, a).await,
            Command::Diff(a) => commands::diff::run(&ctx, a).await,
            Command::Verify(a) => commands::verify::run(&ctx, a).await,
            Command::Ls(a) => commands::ls::run(&ctx, a).await,
            Command::Mount(a) => commands::mount::run_mount(&ctx, *a).await,
            Command::Umount(a) => commands::mount::run_umount(&ctx, a).await,
            Command::Rm(a) => commands::rm::run(&ctx, a).await,
            Command::Restore(a) => commands::restore::run(&ctx, a).await,
            Command::Trash(a) => commands::trash::run(&ctx, a).await,
            Command::Gc(a) => commands::gc::run(&ctx, a).await,
            Command::Sync(a) => commands::sync::run(&ctx, a).await,
            Command::Tag(a) => commands::tag::run(&ctx, a).await,
            Command::Pin(a) => commands::pin::run(&ctx, a).await,
            Command::Version => print_version(&ctx),
            Command::Completions { shell } => {
                let mut cmd = cli_command();
                // As kubectl-sealed the completions are kubectl's; as sealed they are ours.
                clap_complete::generate(shell, &mut cmd, "sealed", &mut std::io::stdout());
                Ok(std::process::ExitCode::SUCCESS)
            }
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => errors::report(&e),
    }
}
