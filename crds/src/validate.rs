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
pub const DURATION_HELP: &str = "must be a duration such as 168h, 72h, 1h30m or 0 (units: h, m, s, ms, us, ns), at most 876000h (100 years)";

/// The longest duration [`parse_duration`] accepts: 100 years of 365 days, `876000h`. A
/// retention or grace period longer than that is a typo, and it would overflow the
/// timestamps it is added to; the CRD's CEL rule on `retention.deletedVersions` has the
/// same bound (`duration(self) <= duration('876000h')`).
pub const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(876_000 * 3600);
/// [`MAX_DURATION`] as the schema and messages write it.
pub const MAX_DURATION_TEXT: &str = "876000h";

/// Why a string is not a duration [`parse_duration`] accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error(
        "invalid duration '{0}': use a number with a unit, e.g. 168h, 1h30m, 90s or 0 (units: h, m, s, ms, us, ns)"
    )]
    Malformed(String),
    #[error("invalid duration '{0}': longer than the maximum of {MAX_DURATION_TEXT} (100 years)")]
    TooLong(String),
}

/// True for `blake3:` and 64 lowercase hex digits (the schema's `DIGEST_PATTERN`).
pub fn is_digest(s: &str) -> bool {
    s.len() == DIGEST_LEN
        && s.strip_prefix("blake3:")
            .is_some_and(|hex| hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// A DNS-1123 label: what a namespace name may be.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && alnum(&b[0])
        && alnum(&b[b.len() - 1])
        && b.iter().all(|c| alnum(c) || *c == b'-')
}

/// A DNS-1123 subdomain (`crate::schema::OBJECT_NAME_PATTERN`, at most 253
/// characters): what a SealedVolume's (or a Secret's) name may be.
pub fn is_object_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
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

/// Parses a duration that [`is_duration`] accepts: at most [`MAX_DURATION`].
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    parse_duration_checked(s).ok()
}

/// Parses a non-negative Go duration (`168h`, `1h30m`, `1.5h`, `250ms`, `0`) exactly, in
/// integer nanoseconds (fractions below a nanosecond are dropped, as Go drops them), and
/// refuses one over [`MAX_DURATION`] with [`DurationError::TooLong`]. Never overflows: the
/// sum is checked against the bound after every term.
pub fn parse_duration_checked(s: &str) -> Result<std::time::Duration, DurationError> {
    const MAX_NS: u128 = MAX_DURATION.as_nanos();
    let shown = || s.chars().take(64).collect::<String>();
    let malformed = || DurationError::Malformed(shown());
    if s == "0" {
        return Ok(std::time::Duration::ZERO);
    }
    if s.is_empty() {
        return Err(malformed());
    }
    let mut rest = s;
    let mut total: u128 = 0;
    let mut too_long = false;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        if int_len == 0 {
            return Err(malformed());
        }
        let int_digits = &rest[..int_len];
        rest = &rest[int_len..];
        let mut frac_digits = "";
        if let Some(after) = rest.strip_prefix('.') {
            let frac_len = after.bytes().take_while(u8::is_ascii_digit).count();
            if frac_len == 0 {
                return Err(malformed());
            }
            frac_digits = &after[..frac_len];
            rest = &after[frac_len..];
        }
        let (unit, unit_ns): (&str, u128) = [
            ("ns", 1),
            ("us", 1_000),
            ("ms", 1_000_000),
            ("s", 1_000_000_000),
            ("m", 60_000_000_000),
            ("h", 3_600_000_000_000),
        ]
        .into_iter()
        .find(|(u, _)| rest.starts_with(u))
        .ok_or_else(malformed)?;
        rest = &rest[unit.len()..];
        if too_long {
            continue; // keep checking the syntax, the value is refused anyway
        }
        // Integer part: stop as soon as it passes the bound (a thousand digits cannot
        // overflow anything).
        let mut int: u128 = 0;
        for d in int_digits.bytes() {
            int = int * 10 + u128::from(d - b'0');
            if int > MAX_NS {
                too_long = true;
                break;
            }
        }
        // Fraction: at most 20 digits matter below a nanosecond of an hour.
        let (mut frac, mut scale): (u128, u128) = (0, 1);
        for d in frac_digits.bytes().take(20) {
            frac = frac * 10 + u128::from(d - b'0');
            scale *= 10;
        }
        let term = int
            .checked_mul(unit_ns)
            .and_then(|ns| ns.checked_add(frac * unit_ns / scale));
        match term.and_then(|t| total.checked_add(t)) {
            Some(sum) if sum <= MAX_NS && !too_long => total = sum,
            _ => too_long = true,
        }
    }
    if too_long {
        return Err(DurationError::TooLong(shown()));
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| DurationError::TooLong(shown()))?;
    let nanos = u32::try_from(total % 1_000_000_000).map_err(|_| malformed())?;
    Ok(std::time::Duration::new(secs, nanos))
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
        if let Some(warm) = &self.warm
            && warm.nodes > crate::volume::MAX_WARM_NODES
        {
            errors.push(InvalidSpec::new(
                "spec.warm.nodes",
                format!("must be from 0 to {}", crate::volume::MAX_WARM_NODES),
            ));
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
        if let Err(e) = self.retention.deleted_versions() {
            errors.push(e);
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
    fn namespaces_and_object_names() {
        assert!(is_dns_label("ml") && is_dns_label("team-a") && is_dns_label(&"a".repeat(63)));
        assert!(!is_dns_label("m.l") && !is_dns_label("") && !is_dns_label("-a"));
        assert!(!is_dns_label("A") && !is_dns_label(&"a".repeat(64)));
        assert!(is_object_name("llama-3.8b") && !is_object_name(&"a".repeat(254)));
        assert!(!is_object_name("llama..8b") && !is_object_name("Llama"));
    }

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
            assert!(matches!(
                parse_duration_checked(bad),
                Err(DurationError::Malformed(_))
            ));
        }
        // Exact, not through floating point.
        assert_eq!(
            parse_duration("1h0.000000001s"),
            Some(h + std::time::Duration::from_nanos(1))
        );
        assert_eq!(
            parse_duration("1.000000000000000000009h"),
            Some(h),
            "digits below a nanosecond are dropped"
        );
        assert_eq!(
            parse_duration("2m3s4ms5us6ns").unwrap().as_nanos(),
            123_004_005_006
        );
    }

    #[test]
    fn durations_are_bounded() {
        assert_eq!(parse_duration("876000h"), Some(MAX_DURATION));
        assert_eq!(parse_duration("875999h60m"), Some(MAX_DURATION));
        assert_eq!(parse_duration("52560000m"), Some(MAX_DURATION));
        for long in [
            "876000h1ns",
            "876001h",
            "3000000000h",
            "438000h438000h1s",
            "18446744073709551615s",
            "99999999999999999999999999999999999999999999999999h",
            "1e9h",
        ] {
            let got = parse_duration_checked(long);
            assert!(
                matches!(
                    got,
                    Err(DurationError::TooLong(_)) | Err(DurationError::Malformed(_))
                ),
                "{long}: {got:?}"
            );
            assert_eq!(parse_duration(long), None, "{long}");
        }
        let e = parse_duration_checked("3000000000h")
            .unwrap_err()
            .to_string();
        assert!(e.contains("3000000000h") && e.contains("876000h"), "{e}");
        // A long one is still checked for syntax after the bound is passed.
        assert!(matches!(
            parse_duration_checked("3000000000h7d"),
            Err(DurationError::Malformed(_))
        ));
        // Every string the schema admits parses without a panic, however long.
        let _ = parse_duration_checked(&"9".repeat(10_000));
        let _ = parse_duration_checked(&format!("{}h", "9".repeat(10_000)));
        let _ = parse_duration_checked(&format!("1.{}h", "9".repeat(10_000)));
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
