//! A source reader's error as the operator reports it: a [`SyncFailure`] whose reason is the
//! condition reason and whose message is tenant-visible (conditions, Events, termination
//! messages), so URLs are redacted and the store is "the store", never its URL.

use sealed_sources::{SourceError, redact_urls_in};

use super::SyncFailure;

impl SyncFailure {
    /// The failure a sync of `volume` into the store named `store_name` reports for `e`:
    /// permanent or worth a retry as [`SourceError::is_permanent`] says.
    pub fn from_source(e: &SourceError, store_name: &str, volume: &str) -> SyncFailure {
        let message = match e {
            SourceError::Store(inner) => {
                // The details name the store; they go to the log of the operator (or of
                // the sync Job, in the operator's namespace), not to the tenant.
                tracing::warn!(volume, error = %redact_urls_in(&inner.to_string()), "the store failed during a sync");
                format!(
                    "store: {}",
                    without_urls(&hide_store(&inner.to_string(), store_name))
                )
            }
            _ => hide_store(&e.to_string(), store_name),
        };
        if e.is_permanent() {
            SyncFailure::new(e.reason(), message)
        } else {
            SyncFailure::transient(e.reason(), message)
        }
    }
}

/// `text` for a tenant: URLs redacted, and the store named "the store", never by its URL. A
/// text that still holds a URL after the store's own is replaced (a store error quoting a
/// request to the store's endpoint) keeps only what precedes it.
pub fn hide_store(text: &str, store_url: &str) -> String {
    let mut out = redact_urls_in(text);
    let store = redact_urls_in(store_url);
    let store = store.trim_end_matches('/');
    if !store.is_empty() {
        for form in [
            format!("in store {store}/"),
            format!("in store {store}"),
            format!("store '{store}/'"),
            format!("store '{store}'"),
            format!("store {store}/"),
            format!("store {store}"),
            format!("{store}/"),
            store.to_owned(),
        ] {
            let with = if form.starts_with("in store") {
                "in the store"
            } else {
                "the store"
            };
            out = out.replace(&form, with);
        }
    }
    out
}

/// `text` with every URL replaced by "(the store's endpoint)": for store errors, whose URLs
/// are the store's own (its endpoint and bucket), never the tenant's source.
fn without_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let start = rest[..i]
            .char_indices()
            .rev()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |(j, c)| j + c.len_utf8());
        let after = &rest[i + 3..];
        let end = after
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
            .unwrap_or(after.len());
        out.push_str(&rest[..start]);
        out.push_str("(the store's endpoint)");
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_never_named() {
        let store = "s3://sealed-prod-store/volumes";
        for (text, want) in [
            (
                "version blake3:ab not found in store s3://sealed-prod-store/volumes: check the digest",
                "version blake3:ab not found in the store: check the digest",
            ),
            (
                "store s3://sealed-prod-store/volumes: timed out after 60s waiting for x",
                "the store: timed out after 60s waiting for x",
            ),
            (
                "cannot open store s3://sealed-prod-store/volumes/: denied",
                "cannot open the store: denied",
            ),
            ("https://u:p@hub/x?t=1 failed", "https://hub/x failed"),
        ] {
            assert_eq!(hide_store(text, store), want);
        }
        assert_eq!(
            without_urls(
                "Generic S3 error: Error performing PUT http://10.0.0.5:9000/sealed-prod-store/volumes/chunks/ab in 1s"
            ),
            "Generic S3 error: Error performing PUT (the store's endpoint) in 1s"
        );
    }
}
