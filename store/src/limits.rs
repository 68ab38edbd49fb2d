//! Bounds on the numbers and addresses users give: durations added to timestamps, request
//! timeouts and retries, store endpoints. Each is checked where it enters, with an error
//! that names the value and the bound, so that no input can overflow a clock or a counter
//! (a panic, or in the operator a crash loop).

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::backend::StoreOptions;
use crate::error::{Error, Result};

/// The longest retention, grace period or other duration accepted anywhere: 100 years of
/// 365 days (876000h). The CRDs' `retention.deletedVersions` has the same bound.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// [`MAX_DURATION`] for messages.
pub const MAX_DURATION_TEXT: &str = "876000h (100 years)";
/// The longest per-request timeout: one day.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The most retries of one store request.
pub const MAX_RETRIES: usize = 100;

fn too_long(what: &str, value: Duration) -> Error {
    Error::OutOfRange {
        what: what.to_owned(),
        value: format!("{value:?}"),
        bound: format!("at most {MAX_DURATION_TEXT}"),
    }
}

fn chrono_of(what: &str, d: Duration) -> Result<chrono::Duration> {
    if d > MAX_DURATION {
        return Err(too_long(what, d));
    }
    chrono::Duration::from_std(d).map_err(|_| too_long(what, d))
}

/// `at + by`, or an error naming `what` if `by` is over [`MAX_DURATION`] or the sum leaves
/// the calendar.
pub fn later(at: DateTime<Utc>, by: Duration, what: &str) -> Result<DateTime<Utc>> {
    at.checked_add_signed(chrono_of(what, by)?)
        .ok_or_else(|| too_long(what, by))
}

/// `at - by`, checked as [`later`] is.
pub fn earlier(at: DateTime<Utc>, by: Duration, what: &str) -> Result<DateTime<Utc>> {
    at.checked_sub_signed(chrono_of(what, by)?)
        .ok_or_else(|| too_long(what, by))
}

/// Why `endpoint` is not an `http://` or `https://` URL with a host, or `Ok`.
///
/// `127.0.0.1:9` is refused ("has no scheme: write http://127.0.0.1:9 or
/// https://127.0.0.1:9") rather than guessed at: which one the server speaks matters.
pub fn check_endpoint(endpoint: &str) -> std::result::Result<(), String> {
    let shown: String = endpoint.chars().take(200).collect();
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return Err(format!(
            "has no scheme: write http://{shown} or https://{shown}"
        ));
    };
    if scheme != "http" && scheme != "https" {
        return Err(format!(
            "has the scheme '{scheme}': an endpoint is http://host[:port] or https://host[:port]"
        ));
    }
    match url::Url::parse(endpoint) {
        Ok(u) if u.host_str().is_some_and(|h| !h.is_empty()) => Ok(()),
        Ok(_) => Err("has no host: write http://host[:port] or https://host[:port]".into()),
        Err(e) => Err(format!(
            "is not a URL ({e}): write http://host[:port] or https://host[:port] (after \
             {scheme}:// came '{}')",
            rest.chars().take(200).collect::<String>()
        )),
    }
}

impl StoreOptions {
    /// Checks every bound: an endpoint with a scheme and a host, a timeout above zero and at
    /// most a day (tests use milliseconds), at most [`MAX_RETRIES`] retries.
    /// [`crate::ChunkStore::open`] checks them too; callers that take these from users check
    /// them first for a message in their own terms.
    pub fn validate(&self) -> Result<()> {
        if let Some(endpoint) = &self.endpoint {
            check_endpoint(endpoint).map_err(|reason| Error::InvalidEndpoint {
                endpoint: endpoint.chars().take(200).collect(),
                reason,
            })?;
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(Error::OutOfRange {
                what: "store request timeout".into(),
                value: format!("{:?}", self.timeout),
                bound: "more than zero and at most one day (86400 s)".into(),
            });
        }
        if self.retries > MAX_RETRIES {
            return Err(Error::OutOfRange {
                what: "store request retries".into(),
                value: self.retries.to_string(),
                bound: format!("at most {MAX_RETRIES}"),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_added_to_timestamps_are_bounded() {
        let now = Utc::now();
        let year = Duration::from_secs(365 * 24 * 3600);
        assert!(later(now, 100 * year, "retention").is_ok());
        assert!(earlier(now, 100 * year, "grace").is_ok());
        for huge in [
            101 * year,
            Duration::from_secs(3_000_000_000 * 3600),
            Duration::MAX,
        ] {
            let e = later(now, huge, "retention").unwrap_err().to_string();
            assert!(e.contains("retention") && e.contains("876000h"), "{e}");
            let e = earlier(now, huge, "grace").unwrap_err().to_string();
            assert!(e.contains("grace") && e.contains("876000h"), "{e}");
        }
        // Within the bound but off the calendar: still an error, not a panic.
        assert!(later(DateTime::<Utc>::MAX_UTC, year, "retention").is_err());
        assert!(earlier(DateTime::<Utc>::MIN_UTC, year, "grace").is_err());
    }

    #[test]
    fn endpoints_need_a_scheme_and_a_host() {
        for ok in [
            "http://127.0.0.1:9",
            "https://s3.example.com",
            "http://[::1]:9000",
            "https://acct.r2.cloudflarestorage.com/",
        ] {
            check_endpoint(ok).unwrap();
        }
        let e = check_endpoint("127.0.0.1:9").unwrap_err();
        assert_eq!(
            e,
            "has no scheme: write http://127.0.0.1:9 or https://127.0.0.1:9"
        );
        assert!(
            check_endpoint("localhost:9000")
                .unwrap_err()
                .contains("no scheme")
        );
        assert!(check_endpoint("ftp://x").unwrap_err().contains("'ftp'"));
        assert!(check_endpoint("http://").is_err());
        assert!(check_endpoint("").is_err());
    }

    #[test]
    fn store_options_are_bounded() {
        StoreOptions::default().validate().unwrap();
        let bad = [
            StoreOptions {
                endpoint: Some("127.0.0.1:9".into()),
                ..Default::default()
            },
            StoreOptions {
                timeout: Duration::from_secs(u64::MAX),
                ..Default::default()
            },
            StoreOptions {
                timeout: Duration::ZERO,
                ..Default::default()
            },
            StoreOptions {
                retries: 4_294_967_295,
                ..Default::default()
            },
        ];
        for opts in bad {
            let e = opts.validate().unwrap_err().to_string();
            assert!(
                e.contains("endpoint") || e.contains("out of range"),
                "{opts:?}: {e}"
            );
        }
    }
}
