//! Content digests: BLAKE3, written `blake3:<64 lowercase hex>`.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

const PREFIX: &str = "blake3:";

/// A BLAKE3 digest naming a chunk, a file's whole content or a sealed version.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

impl Digest {
    pub const LEN: usize = 32;

    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Digest(bytes)
    }

    /// BLAKE3 of `data`.
    pub fn of(data: &[u8]) -> Self {
        Digest(*blake3::hash(data).as_bytes())
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 hex characters without the `blake3:` prefix (used in object keys).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses `blake3:<64 hex>`; a bare 64-hex string is accepted too, since users paste both.
    pub fn parse(text: &str) -> Result<Self> {
        let hex_part = text.strip_prefix(PREFIX).unwrap_or(text);
        let malformed = || Error::MalformedDigest {
            input: text.chars().take(100).collect(),
        };
        if hex_part.len() != 64
            || !hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(malformed());
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut bytes).map_err(|_| malformed())?;
        Ok(Digest(bytes))
    }
}

/// Hash and compare: `Err(actual)` when `data` does not hash to `expected`.
pub(crate) fn verify_digest(expected: &Digest, data: &[u8]) -> std::result::Result<(), Digest> {
    let actual = Digest::of(data);
    if actual == *expected {
        Ok(())
    } else {
        Err(actual)
    }
}

impl From<blake3::Hash> for Digest {
    fn from(h: blake3::Hash) -> Self {
        Digest(*h.as_bytes())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Digest {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Digest::parse(s)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Digest::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed() {
        let d = Digest::of(b"hello");
        assert_eq!(Digest::parse(&d.to_string()).unwrap(), d);
        assert_eq!(Digest::parse(&d.hex()).unwrap(), d);
        for bad in [
            "",
            "blake3:",
            "sha256:ea8f163db38682925e4491c5e58d4bb3506ef8c14eb78a86e908c5624a67200f",
            "blake3:EA8F163DB38682925E4491C5E58D4BB3506EF8C14EB78A86E908C5624A67200F",
            "blake3:ea8f163db38682925e4491c5e58d4bb3506ef8c14eb78a86e908c5624a6720",
            "blake3:zz8f163db38682925e4491c5e58d4bb3506ef8c14eb78a86e908c5624a67200f",
        ] {
            let err = Digest::parse(bad).unwrap_err().to_string();
            assert!(err.contains("malformed digest"), "{bad}: {err}");
        }
    }
}
