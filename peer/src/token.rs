//! The shared secret every request between peers carries, so that a pod that can reach a
//! node's peer port cannot read chunks by digest. (Chunks are the cluster's data; the digest
//! alone is not a secret: it sits in pod specs.)

use std::path::Path;
use std::sync::{Arc, RwLock};

use crate::PeerError;

/// Fewest bytes a token may have: a guessable token protects nothing.
pub const MIN_TOKEN_BYTES: usize = 16;
/// Most bytes read from a token file.
const MAX_TOKEN_BYTES: usize = 4096;

/// A peer token, compared in constant time. Clones share it: [`PeerToken::replace`] changes
/// it for the server and the client of a node at once (a rotated Secret, no restart).
#[derive(Clone)]
pub struct PeerToken {
    current: Arc<RwLock<Arc<Current>>>,
}

struct Current {
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
        Ok(PeerToken {
            current: Arc::new(RwLock::new(Arc::new(Current::parse(text)?))),
        })
    }

    /// The token in a file (a mounted Secret, say).
    pub fn from_file(path: &Path) -> Result<PeerToken, PeerError> {
        PeerToken::new(&read_file(path)?)
            .map_err(|e| PeerError::Token(format!("{}: {e}", path.display())))
    }

    /// Replaces the token with `text` for every clone; whether it changed. A bad token
    /// leaves the old one in place.
    pub fn replace(&self, text: &str) -> Result<bool, PeerError> {
        let new = Current::parse(text)?;
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if current.hash == new.hash {
            return Ok(false);
        }
        *current = Arc::new(new);
        Ok(true)
    }

    fn get(&self) -> Arc<Current> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn header_value(&self) -> String {
        format!("Bearer {}", self.get().text)
    }

    /// Whether an `Authorization` header carries this token (constant time in the token:
    /// `blake3::Hash` compares in constant time).
    pub(crate) fn admits(&self, header: Option<&str>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        blake3::hash(given.as_bytes()) == self.get().hash
    }
}

/// A token file's text, bounded.
pub(crate) fn read_file(path: &Path) -> Result<String, PeerError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| PeerError::Token(format!("cannot read {}: {e}", path.display())))?;
    if meta.len() > MAX_TOKEN_BYTES as u64 {
        return Err(PeerError::Token(format!(
            "{} is {} bytes; a token file has at most {MAX_TOKEN_BYTES}",
            path.display(),
            meta.len()
        )));
    }
    std::fs::read_to_string(path)
        .map_err(|e| PeerError::Token(format!("cannot read {}: {e}", path.display())))
}

impl Current {
    fn parse(text: &str) -> Result<Current, PeerError> {
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
        Ok(Current {
            text: text.to_owned(),
            hash: blake3::hash(text.as_bytes()),
        })
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
        // A clone sees the replacement (the server and the client share one token).
        let clone = t.clone();
        assert!(!t.replace("0123456789abcdef0123").unwrap());
        assert!(t.replace("short").is_err());
        assert!(t.replace("abcdefghijklmnopqrstuvwxyz").unwrap());
        assert!(clone.admits(Some("Bearer abcdefghijklmnopqrstuvwxyz")));
        assert!(!clone.admits(Some("Bearer 0123456789abcdef0123")));
    }
}
