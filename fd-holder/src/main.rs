//! `sealed-fd-holder`: keeps the node's FUSE fds while the node plugin restarts (see the
//! protocol in this crate's library). Runs as its own DaemonSet beside the plugin.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use sealed_fd_holder::{Holder, listen_at};

#[derive(Parser, Debug)]
#[command(
    name = "sealed-fd-holder",
    version,
    about = "Holds the node's FUSE fds so that restarting the Sealed Volumes node plugin keeps \
             pods' mounts working"
)]
struct Args {
    /// Unix socket the node plugin reaches the holder on (its --fd-holder)
    #[arg(
        long,
        env = "SEALED_FD_HOLDER",
        default_value = "/var/lib/sealed-volumes/fd-holder.sock"
    )]
    socket: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    sealed_service::logging::init("info", false);
    let listener = listen_at(&args.socket)?;
    tracing::info!(socket = %args.socket.display(), "holding FUSE fds for the node plugin");
    // SIGTERM ends the process by default: the fds close with it, and the mounts stay alive
    // as long as the plugin runs (the plugin puts them back when the holder returns).
    Holder::default()
        .serve(listener)
        .with_context(|| format!("serving {}", args.socket.display()))
}
