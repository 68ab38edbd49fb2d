//! Secrets and URL credentials out of every message: what goes into a condition, an Event, a
//! termination message or a log line passes through here.

/// Replaces every secret value in `text` with `***`, and strips every URL in it of user,
/// password and query ([`redact_urls_in`]).
pub(crate) fn redact(text: &str, secrets: &[String]) -> String {
    let mut out = redact_urls_in(text);
    for secret in secrets {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), "***");
        }
    }
    out
}

/// `url` without its user, password, query and fragment, for messages: what every URL that
/// goes into a condition, Event, termination message or log line passes through.
pub fn redact_url(url: &str) -> String {
    redact_urls_in(url)
}

/// `text` with every URL in it (`scheme://...` up to whitespace or a quote) stripped of user,
/// password, query and fragment. The rest of each URL (scheme, host, port, path) is kept as
/// it was, so messages still say where.
pub fn redact_urls_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let after = &rest[i + 3..];
        let end = after
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
            .unwrap_or(after.len());
        let url = &after[..end];
        let authority_end = url.find(['/', '?', '#']).unwrap_or(url.len());
        let (authority, tail) = url.split_at(authority_end);
        let host = authority
            .rfind('@')
            .map_or(authority, |j| &authority[j + 1..]);
        let path = tail.find(['?', '#']).map_or(tail, |j| &tail[..j]);
        out.push_str(&rest[..i + 3]);
        out.push_str(host);
        out.push_str(path);
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// An error's message with its causes, as one line, URLs redacted ([`redact_urls_in`]).
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let s = c.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        cause = c.source();
    }
    redact_urls_in(&text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceError;

    #[test]
    fn urls_lose_userinfo_query_and_fragment() {
        assert_eq!(
            redact_urls_in(
                "GET https://user:p%40ss@hub.example.com:8443/api/x?token=abc&sig=def#frag failed"
            ),
            "GET https://hub.example.com:8443/api/x failed"
        );
        assert_eq!(
            redact_url("s3://AKIA:secret@models/llm/v1?x-amz-signature=abc"),
            "s3://models/llm/v1"
        );
        // Several URLs, quotes, and text without URLs.
        assert_eq!(
            redact_urls_in(
                "'http://a:b@h1/p?q' then \"https://h2/?sig=1\" and <ftp://u@h3>, no url here"
            ),
            "'http://h1/p' then \"https://h2/\" and <ftp://h3>, no url here"
        );
        // An '@' in a path (hf://org/name@rev) is not userinfo.
        assert_eq!(redact_urls_in("hf://acme/llm@main"), "hf://acme/llm@main");
        assert_eq!(redact_urls_in("no urls: a@b?c"), "no urls: a@b?c");
        assert_eq!(redact_urls_in("trailing ://"), "trailing ://");
        assert_eq!(
            redact_urls_in("ünïcode https://x:y@h/é?q ✓"),
            "ünïcode https://h/é ✓"
        );
    }

    #[test]
    fn redact_scrubs_secrets_and_urls() {
        let secrets = vec!["hf_secret_value".to_owned()];
        assert_eq!(
            redact(
                "token hf_secret_value sent to https://u:pw@h/x?t=hf_secret_value",
                &secrets
            ),
            "token *** sent to https://h/x"
        );
    }

    #[test]
    fn errors_are_redacted_everywhere() {
        #[derive(Debug)]
        struct Inner;
        impl std::fmt::Display for Inner {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("connecting to https://admin:hunter2@10.0.0.1/?key=k3y")
            }
        }
        impl std::error::Error for Inner {}
        #[derive(Debug)]
        struct Outer(Inner);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("request failed")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let chain = error_chain(&Outer(Inner));
        assert_eq!(chain, "request failed: connecting to https://10.0.0.1/");

        let e = SourceError::Unavailable {
            what: "http://u:hunter2@hub/x?sig=k3y".into(),
            detail: "see https://t:hunter2@cdn/y?k=k3y".into(),
        }
        .redacted();
        let text = format!("{e} {e:?}");
        assert!(!text.contains("hunter2") && !text.contains("k3y"), "{text}");
        assert!(
            text.contains("http://hub/x") && text.contains("https://cdn/y"),
            "{text}"
        );
    }
}
