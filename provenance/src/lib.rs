//! Provenance for sealed versions: OpenSSF model signatures (`model_signing`, PyPI) verified
//! against a sealed manifest without reading a byte of the model, and made from one.
//!
//! A `model_signing` signature (`model.sig`) is a Sigstore bundle wrapping a DSSE envelope whose
//! payload is an in-toto statement listing every file of the model with its digest
//! ([`bundle`] has the layout). A sealed manifest already holds every file's BLAKE3, so a
//! BLAKE3 statement is checked from the manifest alone, in milliseconds whatever the model's
//! size: [`verify_with_key`]. [`sign_manifest`] makes the signature `model_signing verify key`
//! accepts.
//!
//! Modes: key mode (ECDSA P-256 / P-384 public key, [`verify_with_key`]) and certificate mode
//! (an X.509 chain to a CA bundle and an identity, [`verify_with_certificate`], see
//! [`certificate`]). Sigstore keyless (Fulcio certificate, Rekor log proofs: needs Sigstore's
//! online trust root) is recognised and refused with [`Error::Unsupported`].

pub mod bundle;
pub mod certificate;
pub mod check;
pub mod error;
pub mod keys;

pub use bundle::{Bundle, Resource, Statement};
pub use certificate::{CertificatePolicy, SignerCertificate, ValidAt};
pub use check::{
    CheckOptions, Checked, DEFAULT_SIGNATURE_NAME, GIT_PATHS, check_manifest, sign_manifest,
    statement_for,
};
pub use error::{Error, Problem, Result};
pub use keys::{PublicKey, SigningKey};

use sealed_store::manifest::Manifest;

/// What a verified signature established.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Verified {
    /// `key` or `certificate`.
    pub mode: &'static str,
    /// The signer's key: its curve and hint (SHA-256 of its PEM).
    pub key_curve: &'static str,
    pub key_hint: String,
    /// Certificate mode: the signing certificate (identity, subject, CA, validity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub certificate: Option<SignerCertificate>,
    #[serde(flatten)]
    pub checked: Checked,
}

/// Key mode, end to end: the bundle signed by `key`, its statement consistent, and the
/// manifest exactly the signed files (less ignored paths).
pub fn verify_with_key(
    signature: &[u8],
    key: &PublicKey,
    manifest: &Manifest,
    opts: &CheckOptions,
) -> Result<Verified> {
    let bundle = Bundle::parse(signature)?;
    let statement = bundle.verify_with_key(key)?;
    let checked = check_manifest(&statement, manifest, opts)?;
    Ok(Verified {
        mode: "key",
        key_curve: key.curve(),
        key_hint: key.hint()?,
        certificate: None,
        checked,
    })
}

impl Verified {
    /// Who signed, in a few words: the certificate's identity, or the key.
    pub fn signer(&self) -> String {
        match &self.certificate {
            Some(c) => c.identity.clone(),
            None => format!("{} key {}", self.key_curve, self.key_hint),
        }
    }
}

/// Certificate mode, end to end: the bundle's signing certificate trusted under `policy`
/// (chain to one of its CAs, validity, usage, identity), the bundle signed with its key, and
/// the manifest exactly the signed files (less ignored paths).
pub fn verify_with_certificate(
    signature: &[u8],
    policy: &CertificatePolicy,
    manifest: &Manifest,
    opts: &CheckOptions,
) -> Result<Verified> {
    let bundle = Bundle::parse(signature)?;
    let (statement, key, certificate) = bundle.verify_with_certificate(policy)?;
    let checked = check_manifest(&statement, manifest, opts)?;
    Ok(Verified {
        mode: "certificate",
        key_curve: key.curve(),
        key_hint: key.hint()?,
        certificate: Some(certificate),
        checked,
    })
}
