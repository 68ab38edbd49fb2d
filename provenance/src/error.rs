use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a signature was refused. Each variant names what failed: the file, the key, the model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The signature file is not a `model_signing` Sigstore bundle we can read.
    #[error("the signature file is not a model_signing bundle: {why}")]
    Malformed { why: String },
    /// A key could not be read.
    #[error("key: {why}")]
    Key { why: String },
    /// The bundle says which key signed it (the SHA-256 of its PEM), and it is not this one.
    #[error(
        "wrong key: the signature was made with the key whose hint is {signed_hint}, the key \
         given ({curve}) has hint {given_hint}"
    )]
    WrongKey {
        signed_hint: String,
        given_hint: String,
        curve: &'static str,
    },
    /// The DSSE signature does not verify with the key: another key signed it, or the signed
    /// statement was altered after signing.
    #[error(
        "the signature does not verify with the given {curve} key: another key signed it, or \
         the signed statement was altered"
    )]
    BadSignature { curve: &'static str },
    /// Something this implementation does not verify (yet); the message says what.
    #[error("not supported: {what}")]
    Unsupported { what: String },
    /// The statement's subject digest is not the SHA-256 over its file digests.
    #[error(
        "the signed statement is inconsistent: its subject digest {subject} is not the SHA-256 \
         of its file digests ({computed})"
    )]
    Inconsistent { subject: String, computed: String },
    /// Not one file of the signature is in the version with the signed digest.
    #[error(
        "signature for another model: it signs model {model:?} ({signed} files), and no file \
         of this version has the digest it signs"
    )]
    OtherModel { model: String, signed: usize },
    /// The version differs from what was signed: changed, added or removed files.
    #[error(
        "the version does not match the signature of model {model:?}: {}",
        Problems(problems)
    )]
    Mismatch {
        model: String,
        problems: Vec<Problem>,
    },
    /// The statement signs another digest than BLAKE3, which the manifest does not hold.
    #[error(
        "the signature lists a {algorithm} digest per file; a sealed manifest records only \
         each file's BLAKE3, so the {algorithm} of {files} files must be computed from their \
         bytes (sealed verify --read-files)"
    )]
    NeedsDigests { algorithm: String, files: usize },
    /// Certificate mode: something about the certificates other than the cases below.
    #[error("certificate: {why}")]
    Certificate { why: String },
    /// Certificate mode: the signing certificate does not chain to a CA of the bundle.
    #[error(
        "wrong CA: the signing certificate {subject} (issued by {issuer}) does not chain to a CA \
         of the bundle ({})",
        cas.join("; ")
    )]
    WrongCa {
        subject: String,
        issuer: String,
        cas: Vec<String>,
    },
    /// Certificate mode: a certificate of the path had expired at the time checked
    /// (`certificate` is its role and subject, `at` the time and which time it is).
    #[error("expired certificate: {certificate} expired at {not_after}, before {at}")]
    CertificateExpired {
        certificate: String,
        not_after: String,
        at: String,
    },
    /// Certificate mode: a certificate of the path was not valid yet at the time checked.
    #[error("certificate not valid yet: {certificate} is valid from {not_before}, after {at}")]
    CertificateNotYetValid {
        certificate: String,
        not_before: String,
        at: String,
    },
    /// Certificate mode: the signing certificate names none of the accepted identities.
    #[error(
        "wrong identity: the signing certificate {subject} names {}, none of the accepted \
         identities {}",
        if found.is_empty() { "no email, URI or DNS name".to_string() } else { found.join(", ") },
        wanted.join(", ")
    )]
    WrongIdentity {
        subject: String,
        wanted: Vec<String>,
        found: Vec<String>,
    },
    /// A symlink in the version where the signature does not allow one.
    #[error(
        "{path} is a symlink, and the signature was made without allow_symlinks (model_signing \
         refuses symlinks then)"
    )]
    Symlink { path: String },
}

/// One difference between the signed files and the version.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "problem", rename_all = "snake_case")]
pub enum Problem {
    /// The file is in both, with another digest.
    Changed {
        path: String,
        algorithm: String,
        signed: String,
        sealed: String,
    },
    /// The version has a file the signature does not list (and no ignore path covers).
    Added { path: String },
    /// The signature lists a file the version does not have.
    Removed { path: String },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Changed {
                path,
                algorithm,
                signed,
                sealed,
            } => write!(
                f,
                "changed file {path} (signed {algorithm}:{signed}, sealed {algorithm}:{sealed})"
            ),
            Problem::Added { path } => write!(f, "added file {path} (not signed)"),
            Problem::Removed { path } => {
                write!(f, "removed file {path} (signed, not in the version)")
            }
        }
    }
}

/// At most this many problems are spelled out in an error message; the rest are counted.
const SHOWN_PROBLEMS: usize = 20;

struct Problems<'a>(&'a [Problem]);

impl fmt::Display for Problems<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().take(SHOWN_PROBLEMS).enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{p}")?;
        }
        if self.0.len() > SHOWN_PROBLEMS {
            write!(f, "; and {} more", self.0.len() - SHOWN_PROBLEMS)?;
        }
        Ok(())
    }
}
