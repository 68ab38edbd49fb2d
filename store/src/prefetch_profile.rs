//! Learned prefetch profiles: the order in which a version's chunks were first read on a
//! mount, stored beside the manifest (`profiles/<manifest hex>.<scope id hex>`, see
//! [`crate::layout`]) so a later mount of the same version *in the same scope* can fetch them
//! early in that order. The scope ([`ProfileScope`]) is who the readers were (the CSI plugin:
//! the pod's namespace and SealedVolume): one tenant's readers never steer another's mounts.
//!
//! A profile only changes what is fetched early, never which bytes are served: every chunk
//! it names is still fetched through the verified path. So it is written unsigned, but its
//! decoding is bounded (size cap before reading, count checked before allocating) and it is
//! checked to name its own manifest and only that manifest's chunks.
//!
//! Format (little-endian), version 1:
//!
//! ```text
//! "SVPF" | version u8 = 1 | manifest digest [32] | count u32 | count x chunk digest [32]
//!        | BLAKE3 of everything before [32]
//! ```

use std::collections::HashMap;

use crate::digest::Digest;
use crate::manifest::Manifest;

const MAGIC: &[u8; 4] = b"SVPF";
const VERSION: u8 = 1;
const HEADER_BYTES: usize = 4 + 1 + 32 + 4;
const DIGEST_BYTES: usize = 32;

/// Hard cap on entries, whatever the manifest's chunk count (8 MiB of digests).
pub const MAX_PROFILE_ENTRIES: usize = 1 << 18;
/// The largest well-formed profile; a stored object above this is not read.
pub const MAX_PROFILE_BYTES: u64 =
    (HEADER_BYTES + MAX_PROFILE_ENTRIES * DIGEST_BYTES + DIGEST_BYTES) as u64;

/// Whose readers a profile was learned from; a mount replays only its own scope's profile.
/// The CSI plugin uses `<pod namespace>/<SealedVolume name>`, `sealed mount` its
/// `--profile-scope` (default [`ProfileScope::CLI`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProfileScope(String);

/// Why a scope name is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("profile scope {0:?}: {1}")]
pub struct ScopeError(String, &'static str);

impl ProfileScope {
    /// What `sealed mount` uses unless told otherwise. It holds no `/`, so it is never the
    /// scope of a CSI volume.
    pub const CLI: &'static str = "cli";
    /// Longer names are refused: a namespace and a volume name are 63 and 253 bytes at most.
    pub const MAX_BYTES: usize = 512;
    /// Key-derivation context of [`ProfileScope::id`].
    const ID_CONTEXT: &'static str = "sealed-volumes 2026 learned prefetch profile scope v1";

    /// `scope`: 1 to [`ProfileScope::MAX_BYTES`] bytes, no control characters.
    pub fn new(scope: &str) -> Result<ProfileScope, ScopeError> {
        let refuse = |why| Err(ScopeError(scope.chars().take(64).collect(), why));
        if scope.is_empty() {
            return refuse("empty");
        }
        if scope.len() > Self::MAX_BYTES {
            return refuse("longer than 512 bytes");
        }
        if scope.chars().any(char::is_control) {
            return refuse("holds a control character");
        }
        Ok(ProfileScope(scope.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What names the scope in the store's keys: derived by BLAKE3 from the name, so any
    /// name makes a valid key and the store's listing names no tenant.
    pub fn id(&self) -> Digest {
        Digest::from_bytes(blake3::derive_key(Self::ID_CONTEXT, self.0.as_bytes()))
    }
}

impl Default for ProfileScope {
    fn default() -> Self {
        ProfileScope(Self::CLI.to_owned())
    }
}

impl std::fmt::Display for ProfileScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for ProfileScope {
    type Err = ScopeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ProfileScope::new(s)
    }
}

/// Why a stored profile is not used. Each is ignored (logged, counted), never a mount error.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProfileError {
    #[error("profile is {len} bytes, above the {limit}-byte cap")]
    Oversized { len: u64, limit: u64 },
    #[error("profile is corrupt: {0}")]
    Corrupt(&'static str),
    #[error("profile format version {0} is not supported")]
    UnsupportedVersion(u8),
    #[error("profile names manifest {found}, not {expected}")]
    Foreign { expected: Digest, found: Digest },
    #[error("profile entry {index} names chunk {chunk}, not in manifest {manifest}")]
    Stale {
        manifest: Digest,
        index: usize,
        chunk: Digest,
    },
}

impl ProfileError {
    /// A short label for metrics: `foreign`, `corrupt`, `oversized`, `stale`.
    pub fn reason(&self) -> &'static str {
        match self {
            ProfileError::Oversized { .. } => "oversized",
            ProfileError::Corrupt(_) | ProfileError::UnsupportedVersion(_) => "corrupt",
            ProfileError::Foreign { .. } => "foreign",
            ProfileError::Stale { .. } => "stale",
        }
    }
}

/// A version's chunks in the order readers first asked for them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    pub manifest: Digest,
    pub chunks: Vec<Digest>,
}

impl Profile {
    /// Encodes; entries beyond [`MAX_PROFILE_ENTRIES`] are dropped (the recorder caps first).
    pub fn encode(&self) -> Vec<u8> {
        let chunks = &self.chunks[..self.chunks.len().min(MAX_PROFILE_ENTRIES)];
        let mut out = Vec::with_capacity(HEADER_BYTES + (chunks.len() + 1) * DIGEST_BYTES);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(self.manifest.as_bytes());
        // Bounded by MAX_PROFILE_ENTRIES, which fits in u32.
        out.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
        for c in chunks {
            out.extend_from_slice(c.as_bytes());
        }
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    /// Decodes a profile that must name `expected`. Bounded: the length is checked before
    /// anything else, the count against the length before allocating.
    pub fn decode(bytes: &[u8], expected: &Digest) -> Result<Profile, ProfileError> {
        let len = bytes.len() as u64;
        if len > MAX_PROFILE_BYTES {
            return Err(ProfileError::Oversized {
                len,
                limit: MAX_PROFILE_BYTES,
            });
        }
        let body_len = bytes
            .len()
            .checked_sub(DIGEST_BYTES)
            .filter(|n| *n >= HEADER_BYTES)
            .ok_or(ProfileError::Corrupt("truncated"))?;
        let (body, sum) = bytes.split_at(body_len);
        if blake3::hash(body).as_bytes() != sum {
            return Err(ProfileError::Corrupt("checksum mismatch"));
        }
        if &body[..4] != MAGIC {
            return Err(ProfileError::Corrupt("bad magic"));
        }
        if body[4] != VERSION {
            return Err(ProfileError::UnsupportedVersion(body[4]));
        }
        let manifest = Digest::from_bytes(digest_at(body, 5)?);
        if manifest != *expected {
            return Err(ProfileError::Foreign {
                expected: *expected,
                found: manifest,
            });
        }
        let count_bytes: [u8; 4] = body
            .get(37..41)
            .and_then(|b| b.try_into().ok())
            .ok_or(ProfileError::Corrupt("truncated"))?;
        let count = u32::from_le_bytes(count_bytes) as usize;
        if count > MAX_PROFILE_ENTRIES {
            return Err(ProfileError::Corrupt("too many entries"));
        }
        let want = count
            .checked_mul(DIGEST_BYTES)
            .and_then(|n| n.checked_add(HEADER_BYTES))
            .ok_or(ProfileError::Corrupt("count overflows"))?;
        if want != body.len() {
            return Err(ProfileError::Corrupt("count does not match length"));
        }
        let chunks = body[HEADER_BYTES..]
            .chunks_exact(DIGEST_BYTES)
            .map(|c| {
                let mut d = [0u8; 32];
                d.copy_from_slice(c);
                Digest::from_bytes(d)
            })
            .collect();
        Ok(Profile { manifest, chunks })
    }

    /// Checks every entry is a chunk of `manifest` (whose digest is `self.manifest`) and
    /// that there are no more entries than it has chunks.
    pub fn check_against(&self, manifest: &Manifest) -> Result<(), ProfileError> {
        let known: HashMap<Digest, ()> = manifest
            .files()
            .flat_map(|(_, f)| f.chunks.iter().map(|c| (c.digest, ())))
            .collect();
        self.resolve(&known).map(drop)
    }

    /// The entries looked up in `known` (a version's chunks by digest), in profile order:
    /// [`ProfileError::Stale`] at the first entry that is not there, and `Corrupt` when
    /// there are more entries than `known` has chunks (a profile names each chunk once).
    pub fn resolve<T: Copy>(&self, known: &HashMap<Digest, T>) -> Result<Vec<T>, ProfileError> {
        if self.chunks.len() > known.len() {
            return Err(ProfileError::Corrupt(
                "more entries than the manifest has chunks",
            ));
        }
        self.chunks
            .iter()
            .enumerate()
            .map(|(index, chunk)| {
                known.get(chunk).copied().ok_or(ProfileError::Stale {
                    manifest: self.manifest,
                    index,
                    chunk: *chunk,
                })
            })
            .collect()
    }
}

fn digest_at(body: &[u8], at: usize) -> Result<[u8; 32], ProfileError> {
    body.get(at..at + DIGEST_BYTES)
        .and_then(|b| b.try_into().ok())
        .ok_or(ProfileError::Corrupt("truncated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Profile {
        Profile {
            manifest: Digest::of(b"manifest"),
            chunks: (0u8..5).map(|i| Digest::of(&[i])).collect(),
        }
    }

    #[test]
    fn round_trip() {
        let p = sample();
        assert_eq!(Profile::decode(&p.encode(), &p.manifest), Ok(p));
    }

    #[test]
    fn foreign_is_refused() {
        let p = sample();
        let err = Profile::decode(&p.encode(), &Digest::of(b"other")).unwrap_err();
        assert_eq!(err.reason(), "foreign");
    }

    #[test]
    fn any_flipped_byte_is_corrupt() {
        let p = sample();
        let bytes = p.encode();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            let err = Profile::decode(&b, &p.manifest).unwrap_err();
            assert_eq!(err.reason(), "corrupt", "byte {i}");
        }
    }

    #[test]
    fn every_truncation_is_corrupt() {
        let p = sample();
        let bytes = p.encode();
        for n in 0..bytes.len() {
            assert!(
                Profile::decode(&bytes[..n], &p.manifest).is_err(),
                "len {n}"
            );
        }
    }

    /// A huge count with a valid checksum is refused before any allocation.
    #[test]
    fn hostile_count_is_bounded() {
        let m = Digest::of(b"manifest");
        for count in [u32::MAX, (MAX_PROFILE_ENTRIES + 1) as u32, 6] {
            let mut body = Vec::new();
            body.extend_from_slice(MAGIC);
            body.push(VERSION);
            body.extend_from_slice(m.as_bytes());
            body.extend_from_slice(&count.to_le_bytes());
            body.extend_from_slice(&[0u8; 32]);
            let sum = blake3::hash(&body);
            body.extend_from_slice(sum.as_bytes());
            let err = Profile::decode(&body, &m).unwrap_err();
            assert_eq!(err.reason(), "corrupt", "count {count}");
        }
    }

    #[test]
    fn oversized_is_refused_before_parsing() {
        let m = Digest::of(b"manifest");
        let big = vec![0u8; MAX_PROFILE_BYTES as usize + 1];
        assert_eq!(Profile::decode(&big, &m).unwrap_err().reason(), "oversized");
    }

    /// First writer wins; a second write is not an error and changes nothing.
    #[tokio::test]
    async fn put_profile_is_a_conditional_create() {
        let store = crate::ChunkStore::memory();
        let scope = ProfileScope::new("ml/llama").unwrap();
        let first = sample();
        let mut second = sample();
        second.chunks.reverse();
        assert!(store.put_profile(&first, &scope).await.unwrap());
        assert!(!store.put_profile(&second, &scope).await.unwrap());
        let bytes = store
            .get_profile_bytes(&first.manifest, &scope)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(Profile::decode(&bytes, &first.manifest), Ok(first.clone()));
        assert!(
            store
                .get_profile_bytes(&Digest::of(b"none"), &scope)
                .await
                .unwrap()
                .is_none()
        );
        // Another scope sees none, and writes its own.
        let other = ProfileScope::new("team-b/llama").unwrap();
        let none = store.get_profile_bytes(&first.manifest, &other).await;
        assert!(none.unwrap().is_none());
        assert!(store.put_profile(&second, &other).await.unwrap());
    }

    #[test]
    fn scopes_are_bounded_and_distinct() {
        assert!(ProfileScope::new("").is_err());
        assert!(ProfileScope::new("a\nb").is_err());
        assert!(ProfileScope::new(&"x".repeat(ProfileScope::MAX_BYTES + 1)).is_err());
        let a = ProfileScope::new("ml/llama").unwrap();
        let b = ProfileScope::new("ml/llama2").unwrap();
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id(), ProfileScope::new("ml/llama").unwrap().id());
        assert_eq!(ProfileScope::default().as_str(), ProfileScope::CLI);
    }

    #[test]
    fn encode_caps_entries() {
        let p = Profile {
            manifest: Digest::of(b"m"),
            chunks: vec![Digest::of(b"c"); MAX_PROFILE_ENTRIES + 10],
        };
        let bytes = p.encode();
        assert_eq!(bytes.len() as u64, MAX_PROFILE_BYTES);
        let back = Profile::decode(&bytes, &p.manifest).unwrap();
        assert_eq!(back.chunks.len(), MAX_PROFILE_ENTRIES);
    }
}
