//! The data set: deterministic pseudo-random chunks (BLAKE3 in XOF mode, keyed by the seed),
//! so two server processes hold the same bytes without sharing them.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use bytes::Bytes;

pub struct Chunk {
    pub key: blake3::Hash,
    pub data: Bytes,
}

pub fn generate(chunks: usize, chunk_size: usize, seed: u64) -> Vec<Chunk> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    (0..chunks as u64)
        .map(|i| {
            let mut hasher = blake3::Hasher::new_keyed(&key);
            hasher.update(&i.to_le_bytes());
            let mut data = vec![0u8; chunk_size];
            hasher.finalize_xof().fill(&mut data);
            let data = Bytes::from(data);
            Chunk {
                key: blake3::hash(&data),
                data,
            }
        })
        .collect()
}

/// What a fetcher asks for: the chunk keys and lengths, one "hex len" a line.
pub fn write_keys(path: &Path, chunks: &[Chunk]) -> anyhow::Result<()> {
    let mut text = String::with_capacity(chunks.len() * 72);
    for c in chunks {
        writeln!(text, "{} {}", c.key.to_hex(), c.data.len())?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

pub fn read_keys(path: &Path) -> anyhow::Result<Vec<(blake3::Hash, usize)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut keys = Vec::new();
    for line in text.lines() {
        let Some((hex, len)) = line.split_once(' ') else {
            bail!("bad key line {line:?} in {}", path.display());
        };
        keys.push((blake3::Hash::from_hex(hex)?, len.parse()?));
    }
    Ok(keys)
}
