//! Hand-written schema fragments for fields whose Rust type does not say enough
//! (digest patterns, `metav1.Condition` lists, timestamps). Used with
//! `#[schemars(schema_with = "...")]`.

use schemars::{Schema, SchemaGenerator, json_schema};

/// A version digest: `blake3:` and 64 lowercase hex digits.
pub const DIGEST_PATTERN: &str = "^blake3:[0-9a-f]{64}$";
/// Longest digest text (`blake3:` + 64).
pub const DIGEST_LEN: usize = 71;
/// A tag name: lowercase letters, digits, `-` and `.`, starting and ending with a letter or
/// digit (a DNS-1123 label that may also contain dots, so `v1.2` works), at most 63 characters.
pub const TAG_NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$";
/// Longest tag name.
pub const TAG_NAME_MAX_LEN: usize = 63;
/// Most tags one volume may have.
pub const MAX_TAGS: usize = 256;
/// A Go duration as `time.ParseDuration` (and `kube::core::Duration`) reads it, not negative:
/// `168h`, `30m`, `1h30m`, `90s`, `0`.
pub const DURATION_PATTERN: &str = "^(0|([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+)$";
/// A Kubernetes object name (DNS-1123 subdomain).
pub const OBJECT_NAME_PATTERN: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

/// Schema of a digest string.
pub fn digest(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "pattern": DIGEST_PATTERN,
        "maxLength": DIGEST_LEN,
    })
}

/// Schema of the name of an object in the same namespace.
pub fn object_name(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": 253,
        "pattern": OBJECT_NAME_PATTERN,
    })
}

/// Schema of `spec.tags`: tag name → digest. The value pattern names the bad tag in the
/// API server's message (`spec.tags.prod: Invalid value: ...`); tag names are checked by a
/// CEL rule on the field (structural schemas have no `propertyNames`).
pub fn tags(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "maxProperties": MAX_TAGS,
        "additionalProperties": {
            "type": "string",
            "pattern": DIGEST_PATTERN,
            "maxLength": DIGEST_LEN,
        },
    })
}

/// Schema of a `metav1.Time` (RFC 3339).
pub fn time(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "format": "date-time",
    })
}

/// Schema of a list of `metav1.Condition`, keyed by `type` so server-side apply merges
/// conditions one by one.
pub fn conditions(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "maxItems": 16,
        "items": {
            "type": "object",
            "description": "A condition in the Kubernetes convention (metav1.Condition).",
            "required": ["type", "status", "reason", "message", "lastTransitionTime"],
            "properties": {
                "type": {
                    "type": "string",
                    "description": "The kind of condition: Synced or Ready.",
                    "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                },
                "status": {
                    "type": "string",
                    "description": "True, False or Unknown.",
                    "enum": ["True", "False", "Unknown"],
                },
                "reason": {
                    "type": "string",
                    "description": "A CamelCase word saying why the condition is what it is.",
                    "minLength": 1,
                    "maxLength": 1024,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                },
                "message": {
                    "type": "string",
                    "description": "What happened, for people.",
                    "maxLength": 32768,
                },
                "observedGeneration": {
                    "type": "integer",
                    "format": "int64",
                    "minimum": 0,
                    "description": "The metadata.generation the condition was set for.",
                },
                "lastTransitionTime": {
                    "type": "string",
                    "format": "date-time",
                    "description": "When the status last changed.",
                },
            },
        },
    })
}
