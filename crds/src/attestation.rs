//! Proof that the operator made a `SealedVolumeVersion`.
//!
//! The CSI node plugin lets a pod mount a digest only through a version that the operator
//! made for a volume of the pod's namespace. Whoever can create a `SealedVolumeVersion` can
//! write any `spec.digest` and any ownerReference, and digests are not secrets (they are in
//! Events, status and pod specs), so the plugin cannot trust the object's content alone. The
//! operator therefore writes `status.attestation`: a keyed BLAKE3 MAC over
//! (namespace, volume, digest) with a key that only the operator and the node plugins hold
//! (a Secret in the operator's namespace). A tenant can neither compute it nor reuse one from
//! another namespace, since the namespace is part of what it covers.
//!
//! Format: `v1:<64 hex>`, the MAC of `"sealedvolumes.io/attestation/v1\0"` followed by
//! namespace, volume and digest, each as its length (u64, little-endian) then its bytes,
//! under the key `blake3::derive_key("sealedvolumes.io attestation key v1", secret bytes)`.

/// The Secret key (in the attestation Secret) that holds the key material.
pub const SECRET_KEY: &str = "key";
/// Key material shorter than this is refused: it would be guessable.
pub const MIN_KEY_BYTES: usize = 32;

const KEY_CONTEXT: &str = "sealedvolumes.io attestation key v1";
const MESSAGE_PREFIX: &[u8] = b"sealedvolumes.io/attestation/v1\0";
const VERSION_PREFIX: &str = "v1:";

/// Why key material is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error(
        "the attestation key has {0} bytes; it needs at least {MIN_KEY_BYTES} random bytes \
         (delete the Secret and the operator makes a new one)"
    )]
    TooShort(usize),
}

/// The MAC key, derived from the Secret's bytes. `Debug` never prints it.
#[derive(Clone)]
pub struct AttestationKey([u8; 32]);

impl std::fmt::Debug for AttestationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttestationKey(<redacted>)")
    }
}

impl AttestationKey {
    /// From the Secret's key material (at least [`MIN_KEY_BYTES`] bytes).
    ///
    /// # Errors
    /// [`KeyError::TooShort`] for short material.
    pub fn from_secret_bytes(material: &[u8]) -> Result<Self, KeyError> {
        if material.len() < MIN_KEY_BYTES {
            return Err(KeyError::TooShort(material.len()));
        }
        Ok(AttestationKey(blake3::derive_key(KEY_CONTEXT, material)))
    }

    fn mac(&self, namespace: &str, volume: &str, digest: &str) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(MESSAGE_PREFIX);
        // Each field length-prefixed, so no two (namespace, volume, digest) give one message.
        for field in [namespace, volume, digest] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        h.finalize()
    }

    /// The attestation of `digest` as a version of volume `namespace/volume`.
    pub fn attest(&self, namespace: &str, volume: &str, digest: &str) -> String {
        format!(
            "{VERSION_PREFIX}{}",
            self.mac(namespace, volume, digest).to_hex()
        )
    }

    /// Whether `attestation` is this key's attestation of (namespace, volume, digest).
    /// The comparison is constant-time.
    pub fn verify(&self, attestation: &str, namespace: &str, volume: &str, digest: &str) -> bool {
        let Some(hex) = attestation.strip_prefix(VERSION_PREFIX) else {
            return false;
        };
        let Ok(given) = blake3::Hash::from_hex(hex) else {
            return false;
        };
        // blake3::Hash's PartialEq is constant-time.
        given == self.mac(namespace, volume, digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "blake3:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn binds_namespace_volume_and_digest() {
        let key = AttestationKey::from_secret_bytes(&[7u8; 32]).unwrap();
        let a = key.attest("team-a", "llama", D);
        assert!(a.starts_with("v1:") && a.len() == 3 + 64, "{a}");
        assert!(key.verify(&a, "team-a", "llama", D));
        assert!(!key.verify(&a, "team-b", "llama", D), "another namespace");
        assert!(!key.verify(&a, "team-a", "other", D), "another volume");
        let d2 = D.replace('1', "2");
        assert!(!key.verify(&a, "team-a", "llama", &d2), "another digest");
        // Field boundaries are unambiguous: ("a\0b", "c") is not ("a", "b\0c").
        assert_ne!(key.attest("a\0b", "c", D), key.attest("a", "b\0c", D));
        let other = AttestationKey::from_secret_bytes(&[8u8; 32]).unwrap();
        assert!(!other.verify(&a, "team-a", "llama", D), "another key");
        assert!(!key.verify("", "team-a", "llama", D));
        assert!(!key.verify("v1:zz", "team-a", "llama", D));
        assert!(!key.verify(&a.replacen("v1:", "v2:", 1), "team-a", "llama", D));
    }

    #[test]
    fn short_keys_are_refused_and_never_printed() {
        assert_eq!(
            AttestationKey::from_secret_bytes(b"short").unwrap_err(),
            KeyError::TooShort(5)
        );
        let key = AttestationKey::from_secret_bytes(&[9u8; 40]).unwrap();
        assert_eq!(format!("{key:?}"), "AttestationKey(<redacted>)");
    }
}
