//! Where the tensors of a model file are: the header of a safetensors or GGUF file, parsed
//! with strict bounds into the byte ranges of its tensors, for the model-aware prefetch
//! (`crate::prefetch`). Pure functions over the first bytes of a file; no I/O.
//!
//! The header only decides the *order* chunks are fetched in: every byte a reader gets is
//! still verified chunk by chunk against the manifest, whatever the header says. So a header
//! that lies can waste a fetch, never change a byte, and a header this module refuses
//! (`HeaderError::Bad`) just means the caller prefetches the file in plain order instead.
//!
//! The file is someone else's bytes, so nothing here trusts a length or a count: every read
//! is checked against the bytes at hand, every sum and product is checked arithmetic, no
//! allocation is sized by a count from the file, nesting is bounded, and the header may not
//! reach past [`header_limit`] (at most [`MAX_HEADER_BYTES`], never past the file). Each step
//! of the GGUF walk consumes at least one byte, so a hostile count ends at that limit instead
//! of looping.
//!
//! - **safetensors**: an 8-byte little-endian length `N`, then `N` bytes of JSON
//!   `{"name": {"dtype": …, "shape": […], "data_offsets": [begin, end]}, "__metadata__": {…}}`,
//!   offsets relative to the end of the header. Parsed by a streaming visitor that keeps two
//!   integers per tensor (no JSON tree is built).
//! - **GGUF** (versions 2 and 3, little-endian): magic `GGUF`, version, tensor count, KV count,
//!   typed metadata KVs (skipped, except `general.alignment`), tensor infos (name, dims, type,
//!   offset relative to the data section), then the data section at the header's end rounded
//!   up to the alignment (default 32). A tensor's extent is taken to run to the next tensor's
//!   offset (the last to the end of the file): that needs no table of quantisation block sizes,
//!   and is exact up to the alignment padding.

use std::ops::Range;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};

/// Most bytes a header may take (the safetensors reference implementation's own bound).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Most tensors one file may list (16 bytes each are kept).
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata KVs of a GGUF file (real files have a few dozen; the vocabularies are arrays).
pub const MAX_GGUF_KVS: u64 = 1 << 20;
/// Most nesting of GGUF arrays (arrays of arrays): real files use one level.
pub const MAX_GGUF_DEPTH: u32 = 4;
/// Most dimensions of a GGUF tensor (`GGML_MAX_DIMS`).
pub const MAX_GGUF_DIMS: u32 = 4;
/// Longest GGUF string allowed as a key or tensor name.
pub const MAX_GGUF_NAME: u64 = 65_535;

/// The model formats the prefetch knows, by file name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    Safetensors,
    Gguf,
}

impl ModelFormat {
    /// The format a file name says (`*.safetensors`, `*.gguf`, any case), if any.
    pub fn of_name(name: &str) -> Option<ModelFormat> {
        let ends = |suffix: &str| {
            name.len() > suffix.len()
                && name.is_char_boundary(name.len() - suffix.len())
                && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        };
        if ends(".safetensors") {
            Some(ModelFormat::Safetensors)
        } else if ends(".gguf") {
            Some(ModelFormat::Gguf)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ModelFormat::Safetensors => "safetensors",
            ModelFormat::Gguf => "gguf",
        }
    }
}

/// Where a model file's header ends and its tensors are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelLayout {
    /// Bytes of header from the start of the file (the tensor data is at or after here).
    pub header_len: u64,
    /// Absolute byte ranges of the tensors, sorted by start; empty tensors are left out.
    /// Every range is within the file.
    pub tensors: Vec<Range<u64>>,
}

/// Why a header gave no layout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The first `.0` bytes of the file are needed to go on: more than the caller passed,
    /// and within [`header_limit`].
    #[error("the first {0} bytes of the file are needed")]
    NeedMore(u64),
    /// Not a header this module accepts (malformed, out of bounds, over a cap).
    #[error("{0}")]
    Bad(String),
}

fn bad<T>(reason: impl Into<String>) -> Result<T, HeaderError> {
    Err(HeaderError::Bad(reason.into()))
}

/// How far into a file of `file_size` bytes its header may reach.
pub fn header_limit(file_size: u64) -> u64 {
    file_size.min(MAX_HEADER_BYTES)
}

/// The layout of a `format` file of `file_size` bytes whose first bytes are `prefix`.
/// `NeedMore(n)` asks for a prefix of `n` bytes (always more than given, at most
/// [`header_limit`]); the caller reads more and calls again.
pub fn parse(
    format: ModelFormat,
    prefix: &[u8],
    file_size: u64,
) -> Result<ModelLayout, HeaderError> {
    // Only the part of the prefix the header may use counts.
    let limit = header_limit(file_size);
    let prefix = &prefix[..prefix
        .len()
        .min(usize::try_from(limit).unwrap_or(usize::MAX))];
    match format {
        ModelFormat::Safetensors => safetensors(prefix, file_size),
        ModelFormat::Gguf => gguf(prefix, file_size),
    }
}

// ---- safetensors -------------------------------------------------------------------------

fn safetensors(prefix: &[u8], file_size: u64) -> Result<ModelLayout, HeaderError> {
    if file_size < 8 {
        return bad(format!(
            "a file of {file_size} bytes has no room for the 8-byte header length"
        ));
    }
    let Some(len_bytes) = prefix.get(..8) else {
        return Err(HeaderError::NeedMore(8));
    };
    let n = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES - 8 {
        return bad(format!(
            "header length {n} is over the limit of {} bytes",
            MAX_HEADER_BYTES - 8
        ));
    }
    if n > file_size - 8 {
        return bad(format!(
            "header length {n} runs past the end of the {file_size}-byte file"
        ));
    }
    let header_len = 8 + n;
    let Some(json) = prefix.get(8..header_len as usize) else {
        return Err(HeaderError::NeedMore(header_len));
    };
    let data_len = file_size - header_len;
    let mut de = serde_json::Deserializer::from_slice(json);
    let visitor = TensorsVisitor {
        header_len,
        data_len,
    };
    let mut tensors = de::Deserializer::deserialize_map(&mut de, visitor)
        .and_then(|t| de.end().map(|()| t))
        .map_err(|e| HeaderError::Bad(format!("header JSON: {e}")))?;
    tensors.sort_by_key(|r| (r.start, r.end));
    tensors.retain(|r| r.start < r.end);
    Ok(ModelLayout {
        header_len,
        tensors,
    })
}

/// What is kept of one tensor's entry; `dtype` and `shape` are the loader's to check.
#[derive(Deserialize)]
struct TensorEntry {
    data_offsets: (u64, u64),
}

/// A key of the header object: the metadata, or a tensor's name (not kept).
enum Key {
    Metadata,
    Tensor,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a tensor name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(if v == "__metadata__" {
                    Key::Metadata
                } else {
                    Key::Tensor
                })
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

struct TensorsVisitor {
    header_len: u64,
    data_len: u64,
}

impl<'de> Visitor<'de> for TensorsVisitor {
    type Value = Vec<Range<u64>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object of tensors")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tensors = Vec::new();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Metadata => {
                    map.next_value::<IgnoredAny>()?;
                }
                Key::Tensor => {
                    if tensors.len() as u64 >= MAX_TENSORS {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_TENSORS} tensors"
                        )));
                    }
                    let entry: TensorEntry = map.next_value()?;
                    let (begin, end) = entry.data_offsets;
                    if begin > end {
                        return Err(de::Error::custom(format!(
                            "data_offsets [{begin}, {end}] begin after they end"
                        )));
                    }
                    if end > self.data_len {
                        return Err(de::Error::custom(format!(
                            "data_offsets [{begin}, {end}] run past the {} bytes of tensor data",
                            self.data_len
                        )));
                    }
                    // Cannot overflow (end <= file size - header), checked all the same.
                    let at = |o: u64| {
                        self.header_len
                            .checked_add(o)
                            .ok_or_else(|| de::Error::custom("data offset overflows"))
                    };
                    tensors.push(at(begin)?..at(end)?);
                }
            }
        }
        Ok(tensors)
    }
}

// ---- GGUF --------------------------------------------------------------------------------

const GGUF_TYPE_UINT32: u32 = 4;
const GGUF_TYPE_STRING: u32 = 8;
const GGUF_TYPE_ARRAY: u32 = 9;
const GGUF_DEFAULT_ALIGNMENT: u64 = 32;

/// A position in the prefix, every step checked against it and against the header limit.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: u64,
    limit: u64,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], HeaderError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or_else(|| HeaderError::Bad("a length overflows".into()))?;
        if end > self.limit {
            return bad(format!(
                "the header runs past byte {}: {}",
                self.limit,
                if self.limit < MAX_HEADER_BYTES {
                    "the file is truncated or a length is wrong"
                } else {
                    "over the limit on header bytes"
                }
            ));
        }
        if end > self.bytes.len() as u64 {
            return Err(HeaderError::NeedMore(end));
        }
        let out = &self.bytes[self.pos as usize..end as usize];
        self.pos = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, HeaderError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64, HeaderError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    /// A GGUF string: u64 length, then the bytes (not checked as UTF-8: never shown whole).
    fn string(&mut self, max: u64) -> Result<&'a [u8], HeaderError> {
        let len = self.u64()?;
        if len > max {
            return bad(format!(
                "a string of {len} bytes is over the limit of {max}"
            ));
        }
        self.take(len)
    }

    /// Skips a metadata value of type `ty`.
    fn skip_value(&mut self, ty: u32, depth: u32) -> Result<(), HeaderError> {
        if let Some(size) = fixed_size(ty) {
            return self.take(size).map(drop);
        }
        match ty {
            GGUF_TYPE_STRING => self.string(u64::MAX).map(drop),
            GGUF_TYPE_ARRAY => {
                if depth >= MAX_GGUF_DEPTH {
                    return bad(format!("arrays nested deeper than {MAX_GGUF_DEPTH}"));
                }
                let elem = self.u32()?;
                let count = self.u64()?;
                if let Some(size) = fixed_size(elem) {
                    let total = count.checked_mul(size).ok_or_else(|| {
                        HeaderError::Bad(format!("an array of {count} overflows"))
                    })?;
                    return self.take(total).map(drop);
                }
                if elem != GGUF_TYPE_STRING && elem != GGUF_TYPE_ARRAY {
                    return bad(format!("unknown array element type {elem}"));
                }
                // Each element takes at least 8 bytes, so this ends at the header limit.
                for _ in 0..count {
                    self.skip_value(elem, depth + 1)?;
                }
                Ok(())
            }
            other => bad(format!("unknown metadata value type {other}")),
        }
    }
}

/// Bytes of a fixed-size GGUF value type.
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1), // u8, i8, bool
        2 | 3 => Some(2),     // u16, i16
        4..=6 => Some(4),     // u32, i32, f32
        10..=12 => Some(8),   // u64, i64, f64
        _ => None,
    }
}

fn gguf(prefix: &[u8], file_size: u64) -> Result<ModelLayout, HeaderError> {
    let mut c = Cursor {
        bytes: prefix,
        pos: 0,
        limit: header_limit(file_size),
    };
    if c.take(4)? != b"GGUF" {
        return bad("no GGUF magic");
    }
    let version = c.u32()?;
    if version != 2 && version != 3 {
        return bad(format!("GGUF version {version} (only 2 and 3 are read)"));
    }
    let tensor_count = c.u64()?;
    if tensor_count > MAX_TENSORS {
        return bad(format!(
            "{tensor_count} tensors is over the limit of {MAX_TENSORS}"
        ));
    }
    let kv_count = c.u64()?;
    if kv_count > MAX_GGUF_KVS {
        return bad(format!(
            "{kv_count} metadata entries is over the limit of {MAX_GGUF_KVS}"
        ));
    }
    let mut alignment = GGUF_DEFAULT_ALIGNMENT;
    for _ in 0..kv_count {
        let key = c.string(MAX_GGUF_NAME)?;
        let ty = c.u32()?;
        if key == b"general.alignment" {
            if ty != GGUF_TYPE_UINT32 {
                return bad(format!("general.alignment has type {ty}, not uint32"));
            }
            let value = c.u32()?;
            if value == 0 || !value.is_power_of_two() {
                return bad(format!("general.alignment {value} is not a power of two"));
            }
            alignment = u64::from(value);
        } else {
            c.skip_value(ty, 0)?;
        }
    }
    // Not sized by the count: a count the bytes do not back fails at the limit first.
    let mut offsets = Vec::with_capacity(tensor_count.min(4096) as usize);
    for _ in 0..tensor_count {
        c.string(MAX_GGUF_NAME)?;
        let dims = c.u32()?;
        if dims > MAX_GGUF_DIMS {
            return bad(format!(
                "a tensor of {dims} dimensions (at most {MAX_GGUF_DIMS})"
            ));
        }
        c.take(u64::from(dims) * 8)?;
        let _ggml_type = c.u32()?;
        offsets.push(c.u64()?);
    }
    let header_end = c.pos;
    let data_start = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| HeaderError::Bad("the data section's start overflows".into()))?;
    if data_start > file_size {
        return bad(format!(
            "the data section starts at {data_start}, past the end of the {file_size}-byte file"
        ));
    }
    let mut starts = Vec::with_capacity(offsets.len());
    for offset in offsets {
        if offset % alignment != 0 {
            return bad(format!(
                "tensor offset {offset} is not a multiple of the alignment {alignment}"
            ));
        }
        let at = data_start
            .checked_add(offset)
            .filter(|&at| at <= file_size)
            .ok_or_else(|| {
                HeaderError::Bad(format!(
                    "tensor offset {offset} runs past the end of the {file_size}-byte file"
                ))
            })?;
        starts.push(at);
    }
    starts.sort_unstable();
    starts.dedup();
    let tensors = starts
        .iter()
        .enumerate()
        .map(|(i, &start)| start..starts.get(i + 1).copied().unwrap_or(file_size))
        .filter(|r| r.start < r.end)
        .collect();
    Ok(ModelLayout {
        header_len: data_start,
        tensors,
    })
}

/// Writes model headers by hand, for the tests (the integration tests write their own).
#[cfg(test)]
pub(crate) mod write {
    /// A GGUF string.
    pub fn string(out: &mut Vec<u8>, s: &[u8]) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s);
    }

    /// A GGUF v3 header: a few metadata KVs (a string, an array of strings, a u32, and
    /// `general.alignment` when given), then `tensors` as (name, dims, offset), padded to
    /// the alignment. Returns the header; the data section follows it.
    pub fn gguf(alignment: Option<u32>, tensors: &[(&str, &[u64], u64)]) -> Vec<u8> {
        let mut out = gguf_unpadded(alignment, tensors);
        let align = u64::from(alignment.unwrap_or(32));
        while !(out.len() as u64).is_multiple_of(align) {
            out.push(0);
        }
        out
    }

    /// [`gguf`] without the padding to the data section.
    pub fn gguf_unpadded(alignment: Option<u32>, tensors: &[(&str, &[u64], u64)]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        let kvs = 3 + u64::from(alignment.is_some());
        out.extend_from_slice(&kvs.to_le_bytes());
        string(&mut out, b"general.architecture");
        out.extend_from_slice(&8u32.to_le_bytes());
        string(&mut out, b"llama");
        string(&mut out, b"tokenizer.ggml.tokens");
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&3u64.to_le_bytes());
        for t in [&b"<s>"[..], b"</s>", b"hello"] {
            string(&mut out, t);
        }
        string(&mut out, b"llama.block_count");
        out.extend_from_slice(&4u32.to_le_bytes());
        out.extend_from_slice(&2u32.to_le_bytes());
        if let Some(a) = alignment {
            string(&mut out, b"general.alignment");
            out.extend_from_slice(&4u32.to_le_bytes());
            out.extend_from_slice(&a.to_le_bytes());
        }
        for (name, dims, offset) in tensors {
            string(&mut out, name.as_bytes());
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&0u32.to_le_bytes()); // F32
            out.extend_from_slice(&offset.to_le_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(json: &str, data_len: u64) -> (Vec<u8>, u64) {
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        let size = out.len() as u64 + data_len;
        (out, size)
    }

    fn st_bad(json: &str, data_len: u64) -> String {
        let (bytes, size) = st(json, data_len);
        match parse(ModelFormat::Safetensors, &bytes, size) {
            Err(HeaderError::Bad(reason)) => reason,
            other => panic!("{json}: expected Bad, got {other:?}"),
        }
    }

    #[test]
    fn model_files_are_known_by_name() {
        use ModelFormat::*;
        assert_eq!(
            ModelFormat::of_name("model-00001-of-00002.safetensors"),
            Some(Safetensors)
        );
        assert_eq!(ModelFormat::of_name("M.SafeTensors"), Some(Safetensors));
        assert_eq!(ModelFormat::of_name("llama-q4_k_m.gguf"), Some(Gguf));
        assert_eq!(ModelFormat::of_name(".gguf"), None);
        assert_eq!(ModelFormat::of_name("config.json"), None);
        assert_eq!(ModelFormat::of_name("model.safetensors.index.json"), None);
        assert_eq!(ModelFormat::of_name("é.gguf"), Some(Gguf));
        assert_eq!(ModelFormat::of_name("ééé"), None);
    }

    #[test]
    fn safetensors_layout_in_offset_order() {
        let json = r#"{"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            "__metadata__": {"format": "pt", "nested": {"x": [1, 2, {"y": null}]}},
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "empty": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]}}   "#;
        let (bytes, size) = st(json, 16);
        let header_len = 8 + json.len() as u64;
        let layout = parse(ModelFormat::Safetensors, &bytes, size).unwrap();
        assert_eq!(layout.header_len, header_len);
        assert_eq!(
            layout.tensors,
            vec![header_len..header_len + 8, header_len + 8..header_len + 16]
        );
        // A prefix asks for what it lacks, never more than the header.
        assert_eq!(
            parse(ModelFormat::Safetensors, &bytes[..5], size),
            Err(HeaderError::NeedMore(8))
        );
        assert_eq!(
            parse(ModelFormat::Safetensors, &bytes[..20], size),
            Err(HeaderError::NeedMore(header_len))
        );
        // No tensors at all is a layout too.
        let (bytes, size) = st("{}", 0);
        assert_eq!(
            parse(ModelFormat::Safetensors, &bytes, size)
                .unwrap()
                .tensors,
            vec![]
        );
    }

    #[test]
    fn hostile_safetensors_headers_are_refused() {
        // Too small for a length, a huge length, a length past the file.
        assert!(matches!(
            parse(ModelFormat::Safetensors, b"abc", 3),
            Err(HeaderError::Bad(_))
        ));
        let huge = u64::MAX.to_le_bytes();
        let e = parse(ModelFormat::Safetensors, &huge, 1 << 40).unwrap_err();
        assert!(e.to_string().contains("over the limit"), "{e}");
        let e = parse(ModelFormat::Safetensors, &1000u64.to_le_bytes(), 500).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
        // N at the cap is allowed; one more is not.
        let at_cap = (MAX_HEADER_BYTES - 8).to_le_bytes();
        assert_eq!(
            parse(ModelFormat::Safetensors, &at_cap, 1 << 40),
            Err(HeaderError::NeedMore(MAX_HEADER_BYTES))
        );
        let over = (MAX_HEADER_BYTES - 7).to_le_bytes();
        assert!(matches!(
            parse(ModelFormat::Safetensors, &over, 1 << 40),
            Err(HeaderError::Bad(_))
        ));
        for (json, needle) in [
            ("{not json", "header JSON"),
            ("[1, 2]", "header JSON"),
            (r#"{"a": {"data_offsets": [0, 8]}} trailing"#, "trailing"),
            (r#"{"a": {"dtype": "F32"}}"#, "data_offsets"),
            (r#"{"a": {"data_offsets": [0, 17]}}"#, "run past"),
            (r#"{"a": {"data_offsets": [9, 8]}}"#, "begin after"),
            (
                r#"{"a": {"data_offsets": [0, 18446744073709551616]}}"#,
                "header JSON",
            ),
            (r#"{"a": {"data_offsets": [-1, 8]}}"#, "header JSON"),
            (r#"{"a": {"data_offsets": [0.5, 8]}}"#, "header JSON"),
            (r#"{"a": {"data_offsets": [0, 8, 9]}}"#, "header JSON"),
            (r#"{"a": {"data_offsets": "0,8"}}"#, "header JSON"),
        ] {
            let reason = st_bad(json, 16);
            assert!(reason.contains(needle), "{json}: {reason}");
        }
        // Deep nesting where nothing is kept is skipped without recursion (no stack
        // overflow); an unclosed one is malformed.
        let deep = format!(
            r#"{{"__metadata__": {}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let (bytes, size) = st(&deep, 0);
        let layout = parse(ModelFormat::Safetensors, &bytes, size).unwrap();
        assert!(layout.tensors.is_empty());
        let open = format!(r#"{{"__metadata__": {}}}"#, "[".repeat(100_000));
        assert!(st_bad(&open, 0).contains("header JSON"));
    }

    fn gguf_file(alignment: Option<u32>, tensors: &[(&str, &[u64], u64)], data: u64) -> Vec<u8> {
        let mut out = write::gguf(alignment, tensors);
        out.resize(out.len() + data as usize, 0xab);
        out
    }

    #[test]
    fn gguf_layout_in_offset_order() {
        let file = gguf_file(
            None,
            &[("b", &[4, 2], 64), ("a", &[16], 0), ("c", &[1], 96)],
            128,
        );
        let size = file.len() as u64;
        let layout = parse(ModelFormat::Gguf, &file, size).unwrap();
        let start = size - 128;
        assert_eq!(layout.header_len, start);
        assert_eq!(start % 32, 0);
        assert_eq!(
            layout.tensors,
            vec![start..start + 64, start + 64..start + 96, start + 96..size]
        );
        // Any prefix asks for more, never past the file.
        for cut in [0, 3, 4, 9, 30, 60, 100] {
            match parse(ModelFormat::Gguf, &file[..cut], size) {
                Err(HeaderError::NeedMore(n)) => assert!(n > cut as u64 && n <= size, "{cut}"),
                other => panic!("prefix of {cut}: {other:?}"),
            }
        }
        // general.alignment moves the data section.
        let file = gguf_file(Some(256), &[("a", &[16], 0), ("b", &[16], 256)], 512);
        let size = file.len() as u64;
        let layout = parse(ModelFormat::Gguf, &file, size).unwrap();
        assert_eq!(layout.header_len % 256, 0);
        assert_eq!(layout.tensors.len(), 2);
        assert_eq!(layout.tensors[1].end, size);
    }

    #[test]
    fn hostile_gguf_headers_are_refused() {
        let good = gguf_file(None, &[("a", &[16], 0)], 64);
        let size = good.len() as u64;
        let bad_of = |bytes: &[u8], size: u64| match parse(ModelFormat::Gguf, bytes, size) {
            Err(HeaderError::Bad(reason)) => reason,
            other => panic!("expected Bad, got {other:?}"),
        };
        // Truncated: the file ends inside the header.
        let cut = &good[..40];
        assert!(bad_of(cut, 40).contains("truncated"));
        // Wrong magic, unknown version.
        let mut f = good.clone();
        f[0] = b'X';
        assert!(bad_of(&f, size).contains("magic"));
        let mut f = good.clone();
        f[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(bad_of(&f, size).contains("version 1"));
        // Counts beyond the caps, and counts the bytes do not back.
        let mut f = good.clone();
        f[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(bad_of(&f, size).contains("tensors"));
        let mut f = good.clone();
        f[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(bad_of(&f, size).contains("metadata entries"));
        // A count within the cap that the bytes do not back: the walk ends, refused.
        let mut f = good.clone();
        f[16..24].copy_from_slice(&(MAX_GGUF_KVS).to_le_bytes());
        bad_of(&f, size);
        // A key length beyond anything.
        let mut f = good.clone();
        f[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(bad_of(&f, size).contains("over the limit"));

        let hand = |body: &dyn Fn(&mut Vec<u8>)| {
            let mut out = b"GGUF".to_vec();
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes()); // tensors
            out.extend_from_slice(&1u64.to_le_bytes()); // one KV
            write::string(&mut out, b"k");
            body(&mut out);
            out.resize(out.len() + 64, 0);
            out
        };
        // A string value as long as the file and then some; an array whose byte size
        // overflows; an array of strings with a hostile count; nesting too deep; unknown types.
        for (body, needle) in [
            (
                &(|o: &mut Vec<u8>| {
                    o.extend_from_slice(&8u32.to_le_bytes());
                    o.extend_from_slice(&(1u64 << 62).to_le_bytes());
                }) as &dyn Fn(&mut Vec<u8>),
                "runs past",
            ),
            (
                &|o: &mut Vec<u8>| {
                    o.extend_from_slice(&9u32.to_le_bytes());
                    o.extend_from_slice(&10u32.to_le_bytes());
                    o.extend_from_slice(&(u64::MAX / 4).to_le_bytes());
                },
                "overflows",
            ),
            (
                &|o: &mut Vec<u8>| {
                    o.extend_from_slice(&9u32.to_le_bytes());
                    o.extend_from_slice(&8u32.to_le_bytes());
                    o.extend_from_slice(&u64::MAX.to_le_bytes());
                },
                "runs past",
            ),
            (
                &|o: &mut Vec<u8>| {
                    // An array of arrays of arrays …, one element each.
                    o.extend_from_slice(&9u32.to_le_bytes());
                    for _ in 0..MAX_GGUF_DEPTH {
                        o.extend_from_slice(&9u32.to_le_bytes());
                        o.extend_from_slice(&1u64.to_le_bytes());
                    }
                },
                "nested",
            ),
            (
                &|o: &mut Vec<u8>| o.extend_from_slice(&13u32.to_le_bytes()),
                "unknown metadata value type",
            ),
            (
                &|o: &mut Vec<u8>| {
                    o.extend_from_slice(&9u32.to_le_bytes());
                    o.extend_from_slice(&77u32.to_le_bytes());
                    o.extend_from_slice(&1u64.to_le_bytes());
                },
                "unknown array element type",
            ),
        ] {
            let f = hand(body);
            let size = f.len() as u64;
            let reason = bad_of(&f, size);
            assert!(reason.contains(needle), "{needle}: {reason}");
        }

        // Alignment not a power of two, or of the wrong type.
        let mut f = gguf_file(Some(32), &[("a", &[16], 0)], 64);
        let at = f
            .windows(17)
            .position(|w| w == b"general.alignment")
            .unwrap()
            + 17
            + 4;
        f[at..at + 4].copy_from_slice(&24u32.to_le_bytes());
        let size = f.len() as u64;
        assert!(bad_of(&f, size).contains("power of two"));
        f[at - 4..at].copy_from_slice(&5u32.to_le_bytes());
        assert!(bad_of(&f, size).contains("not uint32"));

        // Tensor offsets past the file, misaligned, overflowing; too many dimensions.
        for (offset, needle) in [
            (4096, "past the end"),
            (8, "multiple of the alignment"),
            (u64::MAX - 31, "past the end"),
        ] {
            let f = gguf_file(None, &[("a", &[16], offset)], 64);
            let size = f.len() as u64;
            let reason = bad_of(&f, size);
            assert!(reason.contains(needle), "{offset}: {reason}");
        }
        let f = gguf_file(None, &[("a", &[1, 1, 1, 1, 1], 0)], 64);
        let size = f.len() as u64;
        assert!(bad_of(&f, size).contains("dimensions"));
        // The file ends after the tensor infos, before the aligned data section.
        let f = (1..40)
            .map(|n| write::gguf_unpadded(None, &[(&"a".repeat(n), &[16], 0)]))
            .find(|f| f.len() % 32 != 0)
            .unwrap();
        let size = f.len() as u64;
        assert!(bad_of(&f, size).contains("past the end"));
    }

    #[test]
    fn the_header_never_reaches_past_the_cap() {
        // A string value claiming 200 MB in a file of 1 TB: refused at the cap, not read.
        let mut f = b"GGUF".to_vec();
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(&0u64.to_le_bytes());
        f.extend_from_slice(&1u64.to_le_bytes());
        write::string(&mut f, b"k");
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend_from_slice(&200_000_000u64.to_le_bytes());
        let e = parse(ModelFormat::Gguf, &f, 1 << 40).unwrap_err();
        assert!(
            e.to_string().contains("over the limit on header bytes"),
            "{e}"
        );
        // Just under the cap it asks for the bytes (the caller bounds its reads the same way).
        let len = MAX_HEADER_BYTES - f.len() as u64;
        let n = f.len();
        f[n - 8..].copy_from_slice(&len.to_le_bytes());
        assert_eq!(
            parse(ModelFormat::Gguf, &f, 1 << 40),
            Err(HeaderError::NeedMore(MAX_HEADER_BYTES))
        );
    }
}
