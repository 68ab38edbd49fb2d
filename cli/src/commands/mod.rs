//! One module per subcommand.

pub mod diff;
pub mod gc;
pub mod inspect;
pub mod local;
pub mod ls;
pub mod mount;
pub mod pin;
pub mod pull;
pub mod push;
pub mod restore;
pub mod rm;
pub mod sync;
pub mod tag;
pub mod trash;
pub mod verify;

use anyhow::Context as _;
use sealed_store::Digest;

/// Parses a digest argument with a message that names the argument; a malformed one is a
/// usage error (exit 2).
pub fn parse_digest(arg: &str) -> anyhow::Result<Digest> {
    Digest::parse(arg).with_context(|| crate::errors::UsageError(format!("argument '{arg}'")))
}
