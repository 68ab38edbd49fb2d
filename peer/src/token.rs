//! The shared secret every request between peers carries, so that a pod that can reach a
//! node's peer port cannot read chunks by digest. (Chunks are the cluster's data; the digest
//! alone is not a secret: it sits in pod specs.)

use std::path::Path;

use crate::PeerError;

/// Fewest bytes a token may have: a guessable token protects nothing.
pub const MIN_TOKEN_BYTES: usize = 16;
/// Most bytes read from a token file.
const MAX_TOKEN_BYTES: usize = 4096;

/// A peer token, compared in constant time.
#[derive(Clone)]
pub struct PeerToken {
    text: String,
    hash: blake3::Hash,
}

impl std::fmt::Debug for PeerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerToken(<redacted>)")
    }
}

impl PeerToken {
    /// A token from its text (surrounding whitespace dropped).
    pub fn new(text: &str) -> Result<PeerToken, PeerError> {
        let text = text.trim();
        if text.len() < MIN_TOKEN_BYTES || text.len() > MAX_TOKEN_BYTES {
            return Err(PeerError::Token(format!(
                "a peer token has {MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES} bytes, this one {}",
                text.len()
            )));
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(PeerError::Token(
                "a peer token is printable ASCII without spaces (it travels in a header)".into(),
            ));
        }
        Ok(PeerToken {
            text: text.to_owned(),
            hash: blake3::hash(text.as_bytes()),
        })
    }

    /// The token in a file (a mounted Secret, say).
    pub fn from_file(path: &Path) -> Result<PeerToken, PeerError> {
        let meta = std::fs::metadata(path)
            .map_err(|e| PeerError::Token(format!("cannot read {}: {e}", path.display())))?;
        if meta.len() > MAX_TOKEN_BYTES as u64 {
            return Err(PeerError::Token(format!(
                "{} is {} bytes; a token file has at most {MAX_TOKEN_BYTES}",
                path.display(),
                meta.len()
            )));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| PeerError::Token(format!("cannot read {}: {e}", path.display())))?;
        PeerToken::new(&text).map_err(|e| PeerError::Token(format!("{}: {e}", path.display())))
    }

    pub(crate) fn header_value(&self) -> String {
        format!("Bearer {}", self.text)
    }

    /// Whether an `Authorization` header carries this token (constant time in the token:
    /// `blake3::Hash` compares in constant time).
    pub(crate) fn admits(&self, header: Option<&str>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        blake3::hash(given.as_bytes()) == self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_spaced_tokens_are_refused_and_the_right_one_admitted() {
        assert!(PeerToken::new("short").is_err());
        assert!(PeerToken::new("has a space in it, long enough").is_err());
        let t = PeerToken::new("  0123456789abcdef0123\n").unwrap();
        assert!(t.admits(Some("Bearer 0123456789abcdef0123")));
        assert!(!t.admits(Some("Bearer 0123456789abcdef0124")));
        assert!(!t.admits(Some("0123456789abcdef0123")));
        assert!(!t.admits(None));
        assert!(!format!("{t:?}").contains("0123"));
    }
}
