//! The keys of `model_signing`'s key mode: ECDSA over NIST P-256 (SHA-256) or P-384
//! (SHA-384), as `model_signing._signing.sign_ec_key` uses them. The signature over the DSSE
//! PAE is ASN.1 DER, as Python's `cryptography` writes it.
//!
//! No cryptography is written here: the RustCrypto `p256`/`p384` crates sign (RFC 6979,
//! deterministic) and verify.

use p256::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePublicKey, LineEnding};
use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};

/// A public key that verifies `model_signing` key-mode signatures.
#[derive(Clone, Debug)]
pub enum PublicKey {
    P256(p256::ecdsa::VerifyingKey),
    P384(p384::ecdsa::VerifyingKey),
}

/// A private key that makes them.
pub enum SigningKey {
    P256(p256::ecdsa::SigningKey),
    P384(p384::ecdsa::SigningKey),
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        write!(f, "SigningKey({})", self.public_key().curve())
    }
}

impl PublicKey {
    /// A PEM `PUBLIC KEY` (SubjectPublicKeyInfo), as `openssl ec -pubout` writes it.
    pub fn from_pem(pem: &str) -> Result<Self> {
        if let Ok(k) = p256::ecdsa::VerifyingKey::from_public_key_pem(pem) {
            return Ok(PublicKey::P256(k));
        }
        if let Ok(k) = p384::ecdsa::VerifyingKey::from_public_key_pem(pem) {
            return Ok(PublicKey::P384(k));
        }
        Err(Error::Key {
            why: "not a PEM public key (SubjectPublicKeyInfo, -----BEGIN PUBLIC KEY-----) on \
                  P-256 or P-384, the curves supported here (model_signing also allows P-521)"
                .into(),
        })
    }

    /// A DER SubjectPublicKeyInfo (a certificate's key).
    pub fn from_spki_der(der: &[u8]) -> Result<Self> {
        if let Ok(k) = p256::ecdsa::VerifyingKey::from_public_key_der(der) {
            return Ok(PublicKey::P256(k));
        }
        if let Ok(k) = p384::ecdsa::VerifyingKey::from_public_key_der(der) {
            return Ok(PublicKey::P384(k));
        }
        Err(Error::Key {
            why: "the signing certificate's key is not an EC key on P-256 or P-384, the curves \
                  supported here (model_signing also allows P-521)"
                .into(),
        })
    }

    pub fn curve(&self) -> &'static str {
        match self {
            PublicKey::P256(_) => "P-256",
            PublicKey::P384(_) => "P-384",
        }
    }

    /// The key's PEM as Python's `cryptography` writes it (64-column base64, LF endings).
    pub fn to_pem(&self) -> Result<String> {
        let pem = match self {
            PublicKey::P256(k) => k.to_public_key_pem(LineEnding::LF),
            PublicKey::P384(k) => k.to_public_key_pem(LineEnding::LF),
        };
        pem.map_err(|e| Error::Key {
            why: format!("cannot encode the public key: {e}"),
        })
    }

    /// The bundle's `verificationMaterial.publicKey.hint`: SHA-256 (hex) of [`Self::to_pem`],
    /// as `model_signing` computes it.
    pub fn hint(&self) -> Result<String> {
        Ok(hex::encode(Sha256::digest(self.to_pem()?.as_bytes())))
    }

    /// Whether `der_signature` is this key's ECDSA signature over `message` (hashed with
    /// SHA-256 on P-256, SHA-384 on P-384).
    pub fn verify(&self, message: &[u8], der_signature: &[u8]) -> bool {
        use p256::ecdsa::signature::Verifier as _;
        match self {
            PublicKey::P256(k) => p256::ecdsa::DerSignature::from_bytes(der_signature)
                .is_ok_and(|sig| k.verify(message, &sig).is_ok()),
            PublicKey::P384(k) => p384::ecdsa::DerSignature::from_bytes(der_signature)
                .is_ok_and(|sig| k.verify(message, &sig).is_ok()),
        }
    }
}

impl SigningKey {
    /// A PEM private key, unencrypted: PKCS#8 (`-----BEGIN PRIVATE KEY-----`) or SEC1
    /// (`-----BEGIN EC PRIVATE KEY-----`, what `openssl ecparam -genkey` writes).
    pub fn from_pem(pem: &str) -> Result<Self> {
        if pem.contains("ENCRYPTED") {
            return Err(Error::Key {
                why: "the private key is encrypted; give an unencrypted PEM key \
                      (openssl pkcs8 -in KEY -nocrypt)"
                    .into(),
            });
        }
        if let Ok(k) =
            p256::SecretKey::from_pkcs8_pem(pem).or_else(|_| p256::SecretKey::from_sec1_pem(pem))
        {
            return Ok(SigningKey::P256(k.into()));
        }
        if let Ok(k) =
            p384::SecretKey::from_pkcs8_pem(pem).or_else(|_| p384::SecretKey::from_sec1_pem(pem))
        {
            return Ok(SigningKey::P384(k.into()));
        }
        Err(Error::Key {
            why: "not a PEM EC private key (PKCS#8 or SEC1) on P-256 or P-384".into(),
        })
    }

    pub fn public_key(&self) -> PublicKey {
        match self {
            SigningKey::P256(k) => PublicKey::P256(*k.verifying_key()),
            SigningKey::P384(k) => PublicKey::P384(*k.verifying_key()),
        }
    }

    /// The DER ECDSA signature over `message` (RFC 6979: deterministic, no randomness needed).
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        use p256::ecdsa::signature::Signer as _;
        match self {
            SigningKey::P256(k) => {
                let sig: p256::ecdsa::Signature = k.sign(message);
                sig.to_der().as_bytes().to_vec()
            }
            SigningKey::P384(k) => {
                let sig: p384::ecdsa::Signature = k.sign(message);
                sig.to_der().as_bytes().to_vec()
            }
        }
    }
}
