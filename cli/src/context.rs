//! What every command shares: the store to use, how to print, logging.

use std::time::Duration;

use anyhow::Context as _;
use clap::builder::RangedU64ValueParser;
use clap::{Args, ValueEnum};
use sealed_service::store_args::{self, MAX_RETRIES, MAX_TIMEOUT_SECS, env as store_env};
use sealed_store::{ChunkStore, Digest, StoreOptions};

use crate::errors::{NotFoundError, UsageError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Tables and lines for people
    Text,
    /// One JSON document
    Json,
    /// The same document as YAML
    Yaml,
    /// Text with more columns (ls, trash ls, inspect)
    Wide,
}

impl OutputFormat {
    /// A document (JSON or YAML) rather than text.
    pub fn is_document(self) -> bool {
        matches!(self, OutputFormat::Json | OutputFormat::Yaml)
    }
}

#[derive(Args, Debug)]
pub struct GlobalArgs {
    /// Store URL: file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix,
    /// or a plain directory path (/srv/models, ./store: the file store there)
    #[arg(long, global = true, env = store_env::STORE)]
    pub store: Option<String>,
    /// Endpoint of an S3-compatible server (MinIO, R2, CoreWeave) or an Azure emulator:
    /// http://host[:port] or https://host[:port]
    #[arg(long, global = true, env = store_env::ENDPOINT, value_parser = parse_endpoint)]
    pub endpoint: Option<String>,
    /// Region of the bucket
    #[arg(long, global = true, env = store_env::REGION)]
    pub region: Option<String>,
    /// Seconds before a store request is retried (1 to 86400, one day)
    #[arg(long, global = true, default_value_t = 30, env = store_env::TIMEOUT,
          value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_SECS))]
    pub timeout: u64,
    /// Retries of a failed store request (at most 100)
    #[arg(long, global = true, default_value_t = 3, env = store_env::RETRIES,
          value_parser = RangedU64ValueParser::<usize>::new().range(0..=MAX_RETRIES))]
    pub retries: usize,
    /// Output format: text, json, yaml, or wide (text with more columns)
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
    /// Log more (-v info, -vv debug); logs go to stderr
    #[arg(long, short = 'v', global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Never draw progress bars
    #[arg(long, global = true)]
    pub no_progress: bool,
}

/// `--endpoint` must say which protocol the server speaks: `127.0.0.1:9` is refused with
/// "--endpoint 127.0.0.1:9 has no scheme: write http://127.0.0.1:9 or https://127.0.0.1:9".
pub fn parse_endpoint(s: &str) -> Result<String, String> {
    store_args::endpoint_flag("--endpoint", s)
}

pub struct Context {
    pub store_url: String,
    pub store_options: StoreOptions,
    pub output: OutputFormat,
    pub progress: bool,
}

impl Context {
    pub fn new(args: GlobalArgs) -> Self {
        // An empty SEALED_STORE means "the default", as an unset one does.
        let store = args.store.filter(|s| !s.is_empty());
        let default_store = store.is_none();
        let store_url = store
            .map(|s| store_url_from_arg(&s))
            .unwrap_or_else(ChunkStore::default_url);
        let store_options = StoreOptions {
            // An empty SEALED_STORE_ENDPOINT means none, as an unset one does.
            endpoint: args.endpoint.filter(|s| !s.is_empty()),
            region: args.region,
            timeout: Duration::from_secs(args.timeout.clamp(1, MAX_TIMEOUT_SECS)),
            retries: args.retries,
            // The embedded default store is created on first use; a named one must exist.
            create: default_store,
        };
        crate::output::set_document_format(args.output);
        Context {
            store_url,
            store_options,
            output: args.output,
            progress: !args.no_progress && !args.output.is_document(),
        }
    }

    pub async fn open_store(&self) -> anyhow::Result<ChunkStore> {
        self.store_options.validate()?;
        ChunkStore::open(&self.store_url, &self.store_options)
            .await
            .with_context(|| format!("cannot open store {}", self.store_url))
    }

    /// [`Context::open_store`], creating a `file://` store's directory if it is missing
    /// (a first push starts a store; every other command needs one that exists).
    pub async fn open_store_for_push(&self) -> anyhow::Result<ChunkStore> {
        let opts = StoreOptions {
            create: self.store_url.starts_with("file://") || self.store_options.create,
            ..self.store_options.clone()
        };
        opts.validate()?;
        ChunkStore::open(&self.store_url, &opts)
            .await
            .with_context(|| format!("cannot open store {}", self.store_url))
    }

    /// Whether results are printed as a document (`-o json` or `-o yaml`, which
    /// [`crate::output::print_json`] renders), not text.
    pub fn json(&self) -> bool {
        self.output.is_document()
    }

    /// `-o wide`: text with more columns.
    pub fn wide(&self) -> bool {
        self.output == OutputFormat::Wide
    }
}

/// A `--store` as users write it: a URL, or a plain directory path taken as the file store
/// there (`/srv/models` is `file:///srv/models`, `./store` is made absolute). A value with a
/// `:` before its first `/` (`s3:/bucket`, `c:...`) is left to the URL parser, so a mistyped
/// scheme is an error rather than a local directory of that name.
pub fn store_url_from_arg(arg: &str) -> String {
    let first_colon = arg.find(':');
    let first_slash = arg.find('/');
    let is_path = match (first_colon, first_slash) {
        (None, _) => true,
        (Some(c), Some(s)) => s < c,
        (Some(_), None) => false,
    };
    if !is_path {
        return arg.to_owned();
    }
    // `absolute` only reads the working directory; without one the path is left as given and
    // the store refuses it with a message naming it.
    std::path::absolute(arg)
        .ok()
        .and_then(|p| url::Url::from_file_path(p).ok())
        .map_or_else(|| arg.to_owned(), String::from)
}

/// Logs on stderr: warnings by default, `-v` info, `-vv` debug; `SEALED_LOG` overrides.
pub fn init_logging(verbose: u8) {
    sealed_service::logging::init(sealed_service::logging::verbosity("warn", verbose), false);
}

/// The fewest hex digits a short digest may have: 8 (32 bits) keeps a chance match between
/// two versions of a store of thousands negligible, as git's 7 does for commits.
pub const MIN_SHORT_DIGEST: usize = 8;

/// A digest argument as typed: a whole digest, or the start of one.
enum DigestArg {
    Full(Digest),
    /// Lowercase hex digits, at least [`MIN_SHORT_DIGEST`] and fewer than 64.
    Prefix(String),
}

fn parse_digest_arg(arg: &str) -> anyhow::Result<DigestArg> {
    let hex = arg.strip_prefix("blake3:").unwrap_or(arg);
    let is_prefix =
        (MIN_SHORT_DIGEST..64).contains(&hex.len()) && hex.bytes().all(|b| b.is_ascii_hexdigit());
    if is_prefix {
        return Ok(DigestArg::Prefix(hex.to_ascii_lowercase()));
    }
    crate::commands::parse_digest(arg)
        .map(DigestArg::Full)
        .with_context(|| {
            UsageError(format!(
                "argument '{}' is neither a digest nor a short one (at least \
                 {MIN_SHORT_DIGEST} hex digits: blake3:8f3a1c2d)",
                arg.chars().take(100).collect::<String>()
            ))
        })
}

/// Which of `candidates` the argument names: a whole digest is taken as is (the command then
/// says whether the store has it); a prefix must match exactly one candidate. `place` says
/// where the candidates are (`in store X`, `of SealedVolume ns/name`).
pub fn pick_digest(
    arg: &str,
    candidates: impl FnOnce() -> Vec<Digest>,
    place: &str,
) -> anyhow::Result<Digest> {
    let prefix = match parse_digest_arg(arg)? {
        DigestArg::Full(d) => return Ok(d),
        DigestArg::Prefix(p) => p,
    };
    let mut matches: Vec<Digest> = candidates()
        .into_iter()
        .filter(|d| d.hex().starts_with(&prefix))
        .collect();
    matches.sort();
    matches.dedup();
    match matches.as_slice() {
        [one] => Ok(*one),
        [] => Err(NotFoundError(format!("no version {place} starts with blake3:{prefix}")).into()),
        many => {
            let list: Vec<String> = many.iter().map(|d| format!("  {d}")).collect();
            anyhow::bail!(
                "blake3:{prefix} is ambiguous: {} versions {place} start with it; give more \
                 digits:\n{}",
                many.len(),
                list.join("\n")
            )
        }
    }
}

/// A version digest argument (`blake3:<64 hex>`, or a prefix of at least 8 hex digits that
/// exactly one version in the store starts with).
pub async fn resolve_digest(store: &ChunkStore, arg: &str) -> anyhow::Result<Digest> {
    let listed = match parse_digest_arg(arg)? {
        DigestArg::Full(d) => return Ok(d),
        DigestArg::Prefix(_) => store.list_versions().await?,
    };
    pick_digest(
        arg,
        || listed.into_iter().map(|v| v.digest).collect(),
        &format!("in store {}", store.name()),
    )
}

/// [`resolve_digest`] among the versions in the trash (`sealed restore`).
pub async fn resolve_trashed_digest(store: &ChunkStore, arg: &str) -> anyhow::Result<Digest> {
    let listed = match parse_digest_arg(arg)? {
        DigestArg::Full(d) => return Ok(d),
        DigestArg::Prefix(_) => sealed_store::trash::list_trash(store).await?,
    };
    pick_digest(
        arg,
        || listed.into_iter().map(|r| r.digest).collect(),
        &format!("in the trash of store {}", store.name()),
    )
}
