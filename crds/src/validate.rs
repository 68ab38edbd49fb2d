//! The admission rules of the CRDs, in Rust: for clients (the CLI, the operator) that build
//! objects in code and want the API server's verdict before calling it. Each check here has
//! a twin in the schema (a pattern or a CEL rule); `crds/tests/apiserver.rs` checks that the
//! API server agrees.

use crate::schema::{DIGEST_LEN, MAX_TAGS, TAG_NAME_MAX_LEN};
use crate::{SealedVolumeSpec, SealedVolumeVersionSpec};

/// A field that breaks a rule, and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidSpec {
    /// The field's path, e.g. `spec.tags.prod`.
    pub field: String,
    /// What is wrong, for people.
    pub message: String,
}

impl InvalidSpec {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// What a valid digest looks like.
pub const DIGEST_HELP: &str = "must be a digest: blake3: and 64 lowercase hex digits";
/// What a valid tag name looks like.
pub const TAG_NAME_HELP: &str = "a tag name has lowercase letters, digits, '-' and '.', starts and ends with a letter or digit, and is at most 63 characters";
/// What a valid duration looks like.
pub const DURATION_HELP: &str =
    "must be a duration such as 168h, 72h, 1h30m or 0 (units: h, m, s, ms, us, ns)";

/// True for `blake3:` and 64 lowercase hex digits (the schema's `DIGEST_PATTERN`).
pub fn is_digest(s: &str) -> bool {
    s.len() == DIGEST_LEN
        && s.strip_prefix("blake3:")
            .is_some_and(|hex| hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// True for a valid tag name (the schema's `TAG_NAME_PATTERN`, at most 63 characters).
pub fn is_tag_name(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= TAG_NAME_MAX_LEN
        && alnum(&b[0])
        && alnum(&b[b.len() - 1])
        && b.iter().all(|c| alnum(c) || *c == b'-' || *c == b'.')
}

/// True for a non-negative Go duration in the schema's `DURATION_PATTERN`: `0`, or one or
/// more `<number>[.<digits>]<unit>` with unit h, m, s, ms, us or ns.
pub fn is_duration(s: &str) -> bool {
    parse_duration(s).is_some()
}

/// Parses a duration that [`is_duration`] accepts.
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    if s == "0" {
        return Some(std::time::Duration::ZERO);
    }
    if s.is_empty() {
        return None;
    }
    let mut rest = s;
    let mut total = 0f64;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        if int_len == 0 {
            return None;
        }
        let mut num_len = int_len;
        if rest[num_len..].starts_with('.') {
            let frac = rest[num_len + 1..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            if frac == 0 {
                return None;
            }
            num_len += 1 + frac;
        }
        let value: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let (unit, seconds) = [
            ("ns", 1e-9),
            ("us", 1e-6),
            ("ms", 1e-3),
            ("s", 1.0),
            ("m", 60.0),
            ("h", 3600.0),
        ]
        .into_iter()
        .find(|(u, _)| rest.starts_with(u))?;
        rest = &rest[unit.len()..];
        total += value * seconds;
    }
    std::time::Duration::try_from_secs_f64(total).ok()
}

/// `^https?://[^/]+`: a scheme and a host.
fn is_http_url(s: &str) -> bool {
    s.strip_prefix("https://")
        .or_else(|| s.strip_prefix("http://"))
        .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'))
}

impl SealedVolumeSpec {
    /// Every rule the API server enforces on create, as a list of what is wrong (empty when
    /// valid).
    pub fn validate(&self) -> Vec<InvalidSpec> {
        let mut errors = vec![];
        if let Err(e) = self.source.kind() {
            errors.push(e);
        }
        if let Some(hf) = &self.source.hugging_face {
            let valid_part = |p: &str| {
                p.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
                    && p.bytes()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            };
            let parts: Vec<&str> = hf.repo.split('/').collect();
            if parts.len() > 2 || !parts.iter().all(|p| valid_part(p)) {
                errors.push(InvalidSpec::new(
                    "spec.source.huggingFace.repo",
                    "must be a Hugging Face repository id: org/name",
                ));
            }
            if let Some(e) = &hf.endpoint
                && !is_http_url(e)
            {
                errors.push(InvalidSpec::new(
                    "spec.source.huggingFace.endpoint",
                    "must be an http(s) URL such as https://huggingface.co",
                ));
            }
            if hf.revision.is_empty() {
                errors.push(InvalidSpec::new(
                    "spec.source.huggingFace.revision",
                    "must not be empty",
                ));
            }
        }
        if let Some(os) = &self.source.object_store {
            let schemes = [
                "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "file",
            ];
            let ok = os
                .url
                .split_once("://")
                .is_some_and(|(scheme, rest)| schemes.contains(&scheme) && !rest.is_empty());
            if let Some(e) = &os.endpoint
                && !is_http_url(e)
            {
                errors.push(InvalidSpec::new(
                    "spec.source.objectStore.endpoint",
                    "must be an http(s) URL such as https://s3.example.com",
                ));
            }
            if !ok {
                errors.push(InvalidSpec::new(
                    "spec.source.objectStore.url",
                    "must be a URL such as s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or https://host/bucket/prefix",
                ));
            }
        }
        if self.tags.len() > MAX_TAGS {
            errors.push(InvalidSpec::new(
                "spec.tags",
                format!("at most {MAX_TAGS} tags"),
            ));
        }
        for (name, digest) in &self.tags {
            if !is_tag_name(name) {
                errors.push(InvalidSpec::new(
                    format!("spec.tags.{name}"),
                    format!("invalid tag name {name:?}: {TAG_NAME_HELP}"),
                ));
            }
            if !is_digest(digest) {
                errors.push(InvalidSpec::new(format!("spec.tags.{name}"), DIGEST_HELP));
            }
        }
        if !is_duration(&self.retention.deleted_versions) {
            errors.push(InvalidSpec::new(
                "spec.retention.deletedVersions",
                DURATION_HELP,
            ));
        }
        errors
    }
}

impl SealedVolumeVersionSpec {
    /// Every rule the API server enforces on create (see [`SealedVolumeSpec::validate`]).
    pub fn validate(&self) -> Vec<InvalidSpec> {
        let mut errors = vec![];
        if !is_digest(&self.digest) {
            errors.push(InvalidSpec::new("spec.digest", DIGEST_HELP));
        }
        if self.volume.is_empty() {
            errors.push(InvalidSpec::new("spec.volume", "must name a SealedVolume"));
        }
        errors
    }

    /// The rules the API server enforces on update from `old`: both fields are immutable.
    pub fn validate_update(&self, old: &Self) -> Vec<InvalidSpec> {
        let mut errors = self.validate();
        if self.digest != old.digest {
            errors.push(InvalidSpec::new(
                "spec.digest",
                "spec.digest is immutable: a sealed version never changes; create a new SealedVolumeVersion instead",
            ));
        }
        if self.volume != old.volume {
            errors.push(InvalidSpec::new("spec.volume", "spec.volume is immutable"));
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "blake3:8f3a000000000000000000000000000000000000000000000000000000000001";

    #[test]
    fn digests() {
        assert!(is_digest(D));
        assert!(!is_digest(&D.to_uppercase()));
        assert!(!is_digest(&D.replace("blake3", "sha256")));
        assert!(!is_digest(&D[..70]));
        assert!(!is_digest(&format!("{D}0")));
        assert!(!is_digest(&D.replace('f', "g")));
        assert!(!is_digest(""));
    }

    #[test]
    fn tag_names() {
        for ok in ["prod", "v1.2", "a", "staging-2", "0", &"a".repeat(63)] {
            assert!(is_tag_name(ok), "{ok}");
        }
        for bad in [
            "",
            "Prod",
            "-a",
            "a-",
            ".a",
            "a.",
            "a_b",
            "a/b",
            &"a".repeat(64),
            "ä",
        ] {
            assert!(!is_tag_name(bad), "{bad}");
        }
    }

    #[test]
    fn durations() {
        let h = std::time::Duration::from_secs(3600);
        assert_eq!(parse_duration("168h"), Some(168 * h));
        assert_eq!(parse_duration("1h30m"), Some(h + h / 2));
        assert_eq!(parse_duration("1.5h"), Some(h + h / 2));
        assert_eq!(parse_duration("0"), Some(std::time::Duration::ZERO));
        assert_eq!(
            parse_duration("250ms"),
            Some(std::time::Duration::from_millis(250))
        );
        for bad in ["", "7d", "-1h", "h", "1", "1.h", "1h ", " 1h", "+1h", "1.5"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn version_name_is_short_and_valid() {
        assert_eq!(
            SealedVolumeVersionSpec::object_name("llama", D),
            "llama-8f3a000000000000"
        );
        let long = "a".repeat(253);
        let name = SealedVolumeVersionSpec::object_name(&long, D);
        assert_eq!(name.len(), 253);
        // Never panics, whatever it is given.
        let _ = SealedVolumeVersionSpec::object_name(&"ä".repeat(200), "blake3:ääää");
    }
}
