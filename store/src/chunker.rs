//! Content-defined chunking with FastCDC v2020 and BLAKE3 keys.
//!
//! Files are read sequentially in large blocks (no mmap: a file truncated under an mmap would
//! kill the process with SIGBUS instead of failing the push with a message). Cut points are found
//! on one thread while the whole-file hash and the chunk hashes run on the others.

use std::io::{self, Read};

use fastcdc::v2020::{self, Normalization};
use rayon::prelude::*;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::manifest::ChunkRef;

/// The chunker named in every manifest. Changing any field changes every digest.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ChunkParams {
    pub algorithm: String,
    /// The implementation and its exact version, pinned in Cargo.toml.
    pub implementation: String,
    pub normalization: u8,
    pub min_size: u32,
    pub avg_size: u32,
    pub max_size: u32,
}

pub const ALGORITHM: &str = "fastcdc-v2020";
pub const IMPLEMENTATION: &str = "fastcdc-rs 5.0.0";

impl Default for ChunkParams {
    fn default() -> Self {
        ChunkParams {
            algorithm: ALGORITHM.into(),
            implementation: IMPLEMENTATION.into(),
            normalization: 1,
            min_size: 256 * 1024,
            avg_size: 1024 * 1024,
            max_size: 4 * 1024 * 1024,
        }
    }
}

impl ChunkParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Error::InvalidManifest(format!("chunking parameters: {why}"));
        if self.algorithm.len() > 255 || self.implementation.len() > 255 {
            return Err(bad("name over 255 bytes".into()));
        }
        let (min, avg, max) = (
            self.min_size as usize,
            self.avg_size as usize,
            self.max_size as usize,
        );
        let within_bounds = (v2020::MINIMUM_MIN..=v2020::MINIMUM_MAX).contains(&min)
            && (v2020::AVERAGE_MIN..=v2020::AVERAGE_MAX).contains(&avg)
            && (v2020::MAXIMUM_MIN..=v2020::MAXIMUM_MAX).contains(&max);
        let ordered = min <= avg && avg <= max;
        let shaped = avg.is_power_of_two() && min % 2 == 0 && max % 2 == 0;
        if !(within_bounds && ordered && shaped) {
            return Err(bad(format!(
                "min {min} / avg {avg} / max {max} are outside FastCDC's bounds or not ordered"
            )));
        }
        if self.normalization > 3 {
            return Err(bad(format!("normalization level {}", self.normalization)));
        }
        Ok(())
    }

    /// Can this build produce the same cut points (needed to push, not to read)?
    pub fn ensure_supported(&self) -> Result<()> {
        self.validate()?;
        if self.algorithm != ALGORITHM || self.implementation != IMPLEMENTATION {
            return Err(Error::Other(format!(
                "chunker {} ({}) is not the one this build uses ({ALGORITHM}, {IMPLEMENTATION})",
                self.algorithm, self.implementation
            )));
        }
        Ok(())
    }

    fn cutter(&self) -> Cutter {
        let level = match self.normalization {
            0 => Normalization::Level0,
            1 => Normalization::Level1,
            2 => Normalization::Level2,
            _ => Normalization::Level3,
        };
        let (mask_s, mask_l) = v2020::select_masks(self.avg_size as usize, level);
        Cutter {
            min: self.min_size as usize,
            avg: self.avg_size as usize,
            max: self.max_size as usize,
            mask_s,
            mask_l,
        }
    }
}

#[derive(Clone, Copy)]
struct Cutter {
    min: usize,
    avg: usize,
    max: usize,
    mask_s: u64,
    mask_l: u64,
}

impl Cutter {
    /// Length of the next chunk at the start of `data` (all of it when shorter than `min`).
    fn next_len(&self, data: &[u8]) -> usize {
        let (_, len) = v2020::cut(
            data,
            self.min,
            self.avg,
            self.max,
            self.mask_s,
            self.mask_l,
            self.mask_s << 1,
            self.mask_l << 1,
        );
        len
    }
}

/// Cut points of an in-memory buffer: the end offset of every chunk.
pub fn cut_points(data: &[u8], params: &ChunkParams) -> Vec<usize> {
    let cutter = params.cutter();
    let mut ends = Vec::new();
    let mut pos = 0;
    while pos < data.len() {
        pos += cutter.next_len(&data[pos..]).max(1);
        ends.push(pos);
    }
    ends
}

/// A file's chunking result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkedContent {
    pub size: u64,
    pub blake3: Digest,
    pub chunks: Vec<ChunkRef>,
}

/// Bytes read per round; cut points need `max_size` of look-ahead, so a round keeps a tail.
const READ_BLOCK: usize = 32 * 1024 * 1024;

/// Receives every chunk with its bytes as soon as it is hashed (from several threads at once).
pub type ChunkSink<'a> = &'a (dyn Fn(&ChunkRef, &[u8]) -> io::Result<()> + Sync);

/// Chunks and hashes everything `reader` yields. `on_bytes` is told of progress.
pub fn chunk_reader<R: Read>(
    reader: R,
    params: &ChunkParams,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> io::Result<ChunkedContent> {
    chunk_reader_with_sink(reader, params, on_bytes, &|_, _| Ok(()))
}

/// As [`chunk_reader`], handing each chunk's bytes to `sink` so a push reads every file once.
pub fn chunk_reader_with_sink<R: Read>(
    mut reader: R,
    params: &ChunkParams,
    on_bytes: &(dyn Fn(u64) + Sync),
    sink: ChunkSink<'_>,
) -> io::Result<ChunkedContent> {
    let cutter = params.cutter();
    let mut whole = blake3::Hasher::new();
    let mut chunks = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut size: u64 = 0;
    let mut eof = false;
    while !eof || !buf.is_empty() {
        // Fill the buffer up to a block (or the end of the input).
        let fresh_from = buf.len();
        if !eof {
            // read_to_end grows the buffer only as bytes arrive: a small file costs a small
            // buffer, not a zero-filled block.
            let want = (READ_BLOCK - buf.len()) as u64;
            let n = (&mut reader).take(want).read_to_end(&mut buf)?;
            eof = (n as u64) < want;
        }
        let fresh = &buf[fresh_from..];
        size += fresh.len() as u64;
        on_bytes(fresh.len() as u64);

        // Cut as far as the data allows: without EOF, a cut needs `max` bytes of look-ahead.
        let mut spans = Vec::new();
        let mut pos = 0;
        while pos < buf.len() && (eof || buf.len() - pos >= cutter.max) {
            let len = cutter.next_len(&buf[pos..]).max(1);
            spans.push((pos, len));
            pos += len;
        }
        let data = &buf;
        let (_, hashed): ((), io::Result<Vec<ChunkRef>>) = rayon::join(
            || {
                whole.update_rayon(fresh);
            },
            || {
                spans
                    .par_iter()
                    .map(|&(start, len)| {
                        let bytes = &data[start..start + len];
                        let chunk = ChunkRef {
                            digest: Digest::of(bytes),
                            len: len as u32,
                        };
                        sink(&chunk, bytes)?;
                        Ok(chunk)
                    })
                    .collect()
            },
        );
        chunks.extend(hashed?);
        buf.drain(..pos);
        if eof && buf.is_empty() {
            break;
        }
    }
    Ok(ChunkedContent {
        size,
        blake3: whole.finalize().into(),
        chunks,
    })
}

#[cfg(test)]
mod tests {
    use sealed_test_support::trees::pseudo_random;

    use super::*;

    #[test]
    fn streaming_matches_the_reference_iterator() {
        let params = ChunkParams::default();
        let data = pseudo_random(70 * 1024 * 1024 + 12345, 7);
        let reference: Vec<usize> =
            v2020::FastCDC::new(&data, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
                .map(|c| c.offset + c.length)
                .collect();
        assert_eq!(cut_points(&data, &params), reference);
        let streamed = chunk_reader(&data[..], &params, &|_| {}).unwrap();
        let mut end = 0usize;
        let ends: Vec<usize> = streamed
            .chunks
            .iter()
            .map(|c| {
                end += c.len as usize;
                end
            })
            .collect();
        assert_eq!(ends, reference);
        assert_eq!(streamed.size, data.len() as u64);
        assert_eq!(streamed.blake3, Digest::of(&data));
    }

    #[test]
    fn empty_and_tiny_inputs() {
        let params = ChunkParams::default();
        let empty = chunk_reader(&b""[..], &params, &|_| {}).unwrap();
        assert!(empty.chunks.is_empty());
        assert_eq!(empty.blake3, Digest::of(b""));
        let tiny = chunk_reader(&b"x"[..], &params, &|_| {}).unwrap();
        assert_eq!(tiny.chunks.len(), 1);
        assert_eq!(tiny.chunks[0].digest, Digest::of(b"x"));
    }
}
