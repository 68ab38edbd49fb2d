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
//! Modes: key mode (ECDSA P-256 / P-384 public key) is built. Certificate mode (an X.509 chain
//! to a CA bundle) and Sigstore keyless (Fulcio certificate, Rekor log proofs: needs Sigstore's
//! online trust root) are recognised and refused with [`Error::Unsupported`].

pub mod bundle;
pub mod check;
pub mod error;
pub mod keys;

pub use bundle::{Bundle, Resource, Statement};
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
    pub mode: &'static str,
    /// The signer: the key's curve and hint (SHA-256 of its PEM).
    pub key_curve: &'static str,
    pub key_hint: String,
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
        checked,
    })
}
