//! Who holds an expiring object (a writer lease, the collector's marker): a random id and the
//! host name, written into the object so `sealed gc` can say who is in the way.

use std::sync::atomic::{AtomicU64, Ordering};

/// 32 hex characters, unique across hosts and processes for our purposes.
pub(crate) fn random_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(hostname().as_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    h.update(&nanos.to_le_bytes());
    let stack_probe = 0u8;
    h.update(&(std::ptr::addr_of!(stack_probe) as usize).to_le_bytes());
    let hash = h.finalize();
    hex::encode(&hash.as_bytes()[..16])
}

pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_32_hex_and_differ() {
        let (a, b) = (random_id(), random_id());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
