//! The store flags of the daemons (plugin, operator, sync Job) and the environment names
//! every binary reads them from. The CLI keeps its short global flags (`--endpoint`,
//! `--region`, ...) but reads the same variables, so one environment configures all.

use std::time::Duration;

use sealed_store::{StoreOptions, limits};

/// The environment variables of the store settings, one name each for every binary.
pub mod env {
    pub const STORE: &str = "SEALED_STORE";
    pub const ENDPOINT: &str = "SEALED_STORE_ENDPOINT";
    pub const REGION: &str = "SEALED_STORE_REGION";
    pub const TIMEOUT: &str = "SEALED_STORE_TIMEOUT";
    pub const RETRIES: &str = "SEALED_STORE_RETRIES";
}

/// `--store-timeout`'s bound in seconds (the store's own: one day).
pub const MAX_TIMEOUT_SECS: u64 = limits::MAX_TIMEOUT.as_secs();
/// `--store-retries`' bound (the store's own).
pub const MAX_RETRIES: u64 = limits::MAX_RETRIES as u64;

/// Where a daemon's chunks and manifests are.
#[derive(clap::Args, Clone, Debug)]
pub struct StoreArgs {
    /// Store URL: s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///dir
    #[arg(long, env = env::STORE)]
    pub store: String,
    /// Endpoint of an S3-compatible server (MinIO, R2, CoreWeave) or an Azure emulator:
    /// http://host[:port] or https://host[:port]
    #[arg(long, env = env::ENDPOINT, value_parser = |s: &str| endpoint_flag("--store-endpoint", s))]
    pub store_endpoint: Option<String>,
    /// Region of the store's bucket
    #[arg(long, env = env::REGION)]
    pub store_region: Option<String>,
    /// Seconds before a store request is retried (1 to 86400, one day)
    #[arg(long, env = env::TIMEOUT, default_value_t = StoreOptions::default().timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_SECS))]
    pub store_timeout: u64,
    /// Retries of a failed store request (0 to 100)
    #[arg(long, env = env::RETRIES, default_value_t = StoreOptions::default().retries as u32,
          value_parser = clap::value_parser!(u32).range(0..=MAX_RETRIES as i64))]
    pub store_retries: u32,
}

impl StoreArgs {
    /// The options to open the store with. An empty endpoint or region (a chart value left
    /// blank) means none.
    pub fn options(&self) -> StoreOptions {
        StoreOptions {
            endpoint: self.store_endpoint.clone().filter(|s| !s.is_empty()),
            region: self.store_region.clone().filter(|s| !s.is_empty()),
            timeout: Duration::from_secs(self.store_timeout),
            retries: usize::try_from(self.store_retries).unwrap_or(limits::MAX_RETRIES),
            create: false,
        }
    }
}

/// An endpoint flag's value parser: the endpoint must say which protocol the server speaks,
/// so `127.0.0.1:9` is refused with "`flag` 127.0.0.1:9 has no scheme: write http://… or
/// https://…". An empty value (a blank chart value) is let through as "none".
pub fn endpoint_flag(flag: &str, value: &str) -> Result<String, String> {
    if value.is_empty() {
        return Ok(String::new());
    }
    limits::check_endpoint(value)
        .map(|()| value.to_owned())
        .map_err(|reason| format!("{flag} {value} {reason}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Daemon {
        #[command(flatten)]
        store: StoreArgs,
    }

    #[test]
    fn flags_become_store_options() {
        let d = Daemon::try_parse_from([
            "d",
            "--store=s3://b/p",
            "--store-endpoint=http://127.0.0.1:9000",
            "--store-region=",
            "--store-timeout=5",
            "--store-retries=0",
        ])
        .expect("parse");
        let o = d.store.options();
        assert_eq!(d.store.store, "s3://b/p");
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(o.region, None, "an empty region is none");
        assert_eq!(o.timeout, Duration::from_secs(5));
        assert_eq!(o.retries, 0);
    }

    #[test]
    fn out_of_range_and_schemeless_values_are_refused_with_why() {
        let parse = |extra: &str| {
            Daemon::try_parse_from(["d", "--store=file:///x", extra])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(parse("--store-timeout=0").contains("1..=86400"));
        assert!(parse("--store-retries=101").contains("0..=100"));
        let e = parse("--store-endpoint=127.0.0.1:9");
        assert!(
            e.contains("--store-endpoint 127.0.0.1:9 has no scheme"),
            "{e}"
        );
    }
}
