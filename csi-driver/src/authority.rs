//! A connection shim that lets gRPC clients which send a unix socket path as the HTTP/2
//! `:authority` talk to a tonic server.
//!
//! kubelet's plugin watcher (grpc-go, without `WithAuthority`) sends
//! `:authority: %2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F…-reg.sock`; h2 refuses a request
//! whose authority is not a valid URI authority with `RST_STREAM PROTOCOL_ERROR` before any
//! handler runs, and has no option to relax that (hyperium/h2#442, the open hyperium/h2#487).
//! So every connection on the registration socket goes through this shim: frames from the
//! client are passed on unchanged except header blocks (HEADERS + CONTINUATION), which are
//! HPACK-decoded with the client's dynamic table, get an invalid `:authority` replaced by
//! `localhost` (what grpc-go itself sends for `unix:` targets), and are re-encoded as
//! literals that never touch the server's dynamic table. Frames from the server are copied
//! unchanged. A client that sends a valid authority (tonic, grpc-go with `unix://`) goes
//! through byte-for-byte apart from the header encoding.

use std::io;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio::net::UnixStream;

/// What replaces an `:authority` that is not a valid URI authority.
pub const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// The HTTP/2 connection preface (RFC 7540 3.5).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
pub const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
pub const CONTINUATION: u8 = 0x9;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// SETTINGS_MAX_FRAME_SIZE's initial value; h2 (and so tonic) never advertises more unless
/// told to, so frames we write stay within it, and a longer frame from the client is one the
/// server would refuse anyway (FRAME_SIZE_ERROR): we refuse it before buffering it.
const MAX_FRAME: usize = 16_384;
/// Bound on one compressed header block (HEADERS + CONTINUATIONs). kubelet's requests carry
/// a few hundred bytes of headers.
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Bound on one decoded header list, counted as RFC 7540 6.5.2 counts
/// SETTINGS_MAX_HEADER_LIST_SIZE (name + value + 32 a field). Without it, HPACK's
/// amplification lets one small block decode to gigabytes: a header the client put in the
/// dynamic table (up to 64 KiB) is named again by every 1-byte indexed field after it.
pub const MAX_HEADER_LIST: usize = 64 * 1024;
/// What RFC 7540 6.5.2 adds to each field's name and value length.
const FIELD_OVERHEAD: usize = 32;

/// The client-to-server half of the shim, as a pure byte transformer: feed it what the client
/// sent, in any pieces, and it appends what the server should see.
pub struct HeaderRewriter {
    decoder: loona_hpack::Decoder<'static>,
    preface_seen: usize,
    input: Vec<u8>,
    /// A header block waiting for its CONTINUATION frames: stream id, END_STREAM, fragment.
    pending: Option<(u32, bool, Vec<u8>)>,
    /// How many `:authority` values were replaced, for the log and tests.
    pub rewritten: u64,
}

impl Default for HeaderRewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderRewriter {
    pub fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        // The server never advertises SETTINGS_HEADER_TABLE_SIZE, so the client's encoder
        // works with 4096; allow table size updates up to 64 KiB and no more.
        decoder.set_max_allowed_table_size(64 * 1024);
        HeaderRewriter {
            decoder,
            preface_seen: 0,
            input: Vec::new(),
            pending: None,
            rewritten: 0,
        }
    }

    /// Appends to `out` what the server should see after `bytes` from the client.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let mut bytes = bytes;
        if self.preface_seen < PREFACE.len() {
            let n = bytes.len().min(PREFACE.len() - self.preface_seen);
            out.extend_from_slice(&bytes[..n]);
            self.preface_seen += n;
            bytes = &bytes[n..];
        }
        self.input.extend_from_slice(bytes);
        // Taken out so the frames can be read while the decoder changes; an error ends the
        // connection, so what is left unread then does not matter.
        let mut input = std::mem::take(&mut self.input);
        let result = self.frames(&input, out);
        if let Ok(at) = result {
            input.drain(..at);
            self.input = input;
        }
        result.map(|_| ())
    }

    /// Handles the whole frames at the start of `input`; returns how many bytes they took.
    fn frames(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        let mut at = 0;
        while input.len() - at >= FRAME_HEADER {
            let head = &input[at..at + FRAME_HEADER];
            let len =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            if len > MAX_FRAME {
                return Err(protocol(
                    "frame larger than SETTINGS_MAX_FRAME_SIZE (16384)",
                ));
            }
            if input.len() - at < FRAME_HEADER + len {
                break;
            }
            let kind = head[3];
            let flags = head[4];
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let payload = &input[at + FRAME_HEADER..at + FRAME_HEADER + len];
            let frame = &input[at..at + FRAME_HEADER + len];
            match (kind, &mut self.pending) {
                (HEADERS, None) => {
                    let fragment = headers_fragment(flags, payload)?;
                    if flags & END_HEADERS != 0 {
                        let block = self.rewrite_block(fragment)?;
                        write_headers(out, stream, flags & END_STREAM != 0, &block);
                    } else {
                        self.pending = Some((stream, flags & END_STREAM != 0, fragment.to_vec()));
                    }
                }
                (CONTINUATION, Some((pending_stream, end_stream, block))) => {
                    if *pending_stream != stream {
                        return Err(protocol("CONTINUATION on another stream"));
                    }
                    if block.len() + payload.len() > MAX_HEADER_BLOCK {
                        return Err(protocol("header block larger than 64 KiB"));
                    }
                    block.extend_from_slice(payload);
                    if flags & END_HEADERS != 0 {
                        let end_stream = *end_stream;
                        let fragment = std::mem::take(block);
                        self.pending = None;
                        let block = self.rewrite_block(&fragment)?;
                        write_headers(out, stream, end_stream, &block);
                    }
                }
                (_, Some(_)) => return Err(protocol("frame inside a header block")),
                // A client never sends PUSH_PROMISE; its header block would desynchronise
                // the HPACK decoder, so end the connection as the server would.
                (PUSH_PROMISE, None) => return Err(protocol("PUSH_PROMISE from a client")),
                (_, None) => out.extend_from_slice(frame),
            }
            at += FRAME_HEADER + len;
        }
        Ok(at)
    }

    /// Decodes one header block with the client's table and re-encodes it as literals, an
    /// invalid `:authority` replaced.
    ///
    /// Fields are re-encoded as they are decoded (the decoder lends them from its table, so
    /// nothing is copied but what we write), and the decoded list is counted: past
    /// [`MAX_HEADER_LIST`] nothing more is written and the block is refused, so memory stays
    /// within the bound whatever the block expands to.
    fn rewrite_block(&mut self, fragment: &[u8]) -> io::Result<Vec<u8>> {
        if fragment.len() > MAX_HEADER_BLOCK {
            return Err(protocol("header block larger than 64 KiB"));
        }
        let mut block = Vec::with_capacity(fragment.len().saturating_mul(2).min(MAX_HEADER_LIST));
        let mut list_size = 0usize;
        let mut over = false;
        let mut rewritten = 0u64;
        self.decoder
            .decode_with_cb(fragment, |name, value| {
                if over {
                    return;
                }
                list_size = list_size
                    .saturating_add(name.len())
                    .saturating_add(value.len())
                    .saturating_add(FIELD_OVERHEAD);
                if list_size > MAX_HEADER_LIST {
                    over = true;
                    return;
                }
                let value: &[u8] = if &*name == b":authority"
                    && http::uri::Authority::try_from(&*value).is_err()
                {
                    rewritten += 1;
                    tracing::debug!(
                        authority = %String::from_utf8_lossy(&value),
                        "replacing an invalid :authority with localhost"
                    );
                    REPLACEMENT_AUTHORITY
                } else {
                    &value
                };
                // Literal header field without indexing, new name (RFC 7541 6.2.2), no
                // Huffman.
                block.push(0);
                encode_string(&mut block, &name);
                encode_string(&mut block, value);
            })
            .map_err(|e| protocol(&format!("bad HPACK header block: {e:?}")))?;
        if over {
            return Err(protocol(
                "decoded header list larger than 64 KiB (SETTINGS_MAX_HEADER_LIST_SIZE)",
            ));
        }
        self.rewritten += rewritten;
        Ok(block)
    }
}

/// The header block fragment of a HEADERS frame, without padding and priority.
fn headers_fragment(flags: u8, payload: &[u8]) -> io::Result<&[u8]> {
    let mut start = 0;
    let mut end = payload.len();
    if flags & PADDED != 0 {
        let pad = usize::from(
            *payload
                .first()
                .ok_or_else(|| protocol("empty padded HEADERS"))?,
        );
        start = 1;
        end = end
            .checked_sub(pad)
            .filter(|end| *end >= start)
            .ok_or_else(|| protocol("HEADERS padding longer than the frame"))?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
        if start > end {
            return Err(protocol("HEADERS priority longer than the frame"));
        }
    }
    Ok(&payload[start..end])
}

/// HEADERS (+ CONTINUATION) frames carrying `block`, each at most [`MAX_FRAME`] long.
fn write_headers(out: &mut Vec<u8>, stream: u32, end_stream: bool, block: &[u8]) {
    let mut chunks = block.chunks(MAX_FRAME).peekable();
    let mut kind = HEADERS;
    let mut flags = if end_stream { END_STREAM } else { 0 };
    if chunks.peek().is_none() {
        write_frame(out, HEADERS, flags | END_HEADERS, stream, &[]);
        return;
    }
    while let Some(chunk) = chunks.next() {
        if chunks.peek().is_none() {
            flags |= END_HEADERS;
        }
        write_frame(out, kind, flags, stream, chunk);
        kind = CONTINUATION;
        flags = 0;
    }
}

/// Appends one HTTP/2 frame (RFC 7540 4.1); public for the tests that play hostile clients.
pub fn write_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// An HPACK string literal without Huffman coding (RFC 7541 5.2).
pub fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 5.1, `n` 1 to 8); `first` holds the
/// bits above it.
pub fn encode_integer(out: &mut Vec<u8>, first: u8, n: u32, mut value: usize) {
    let max = (1usize << n.clamp(1, 8)) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

fn protocol(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from the client: {what}"),
    )
}

/// Puts the shim between `client` and the server: the server is handed the returned stream.
pub fn shim(client: UnixStream) -> DuplexStream {
    let (ours, server) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        if let Err(e) = proxy(client, ours).await {
            tracing::debug!(error = %e, "registration connection ended");
        }
    });
    server
}

async fn proxy(client: UnixStream, server: DuplexStream) -> io::Result<()> {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let up = async {
        let mut rewriter = HeaderRewriter::new();
        let mut buf = vec![0u8; 16 * 1024];
        let mut out = Vec::with_capacity(32 * 1024);
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                server_write.shutdown().await?;
                return Ok::<_, io::Error>(rewriter.rewritten);
            }
            out.clear();
            rewriter.feed(&buf[..n], &mut out)?;
            server_write.write_all(&out).await?;
        }
    };
    let down = async {
        tokio::io::copy(&mut server_read, &mut client_write).await?;
        client_write.shutdown().await
    };
    tokio::pin!(up, down);
    tokio::select! {
        // The server is done: close the connection.
        result = &mut down => result,
        // The client is done sending: let the server finish answering.
        result = &mut up => {
            result?;
            down.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_block(authority: &[u8]) -> Vec<u8> {
        let mut encoder = loona_hpack::Encoder::new();
        encoder.encode(vec![
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ])
    }

    fn decode_frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut frames = Vec::new();
        while !bytes.is_empty() {
            let len = (usize::from(bytes[0]) << 16)
                | (usize::from(bytes[1]) << 8)
                | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            frames.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        frames
    }

    #[test]
    fn replaces_a_socket_path_authority_and_keeps_the_rest() {
        let bad = b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fcsi.sealedvolumes.io-reg.sock";
        let mut input = PREFACE.to_vec();
        // SETTINGS, then a padded HEADERS with priority split over a CONTINUATION, then DATA.
        write_frame(&mut input, 0x4, 0, 0, &[]);
        let block = request_block(bad);
        let (a, b) = block.split_at(block.len() / 2);
        let mut payload = vec![3u8, 0, 0, 0, 0, 16];
        payload.extend_from_slice(a);
        payload.extend_from_slice(&[0, 0, 0]);
        write_frame(&mut input, HEADERS, PADDED | PRIORITY, 1, &payload);
        write_frame(&mut input, CONTINUATION, END_HEADERS, 1, b);
        write_frame(&mut input, 0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]);
        let mut out = Vec::new();
        let mut rewriter = HeaderRewriter::new();
        // Byte by byte: frames split anywhere must come out the same.
        for byte in &input {
            rewriter.feed(std::slice::from_ref(byte), &mut out).unwrap();
        }
        assert_eq!(rewriter.rewritten, 1);
        assert_eq!(&out[..PREFACE.len()], PREFACE);
        let frames = decode_frames(&out[PREFACE.len()..]);
        assert_eq!(frames.len(), 3, "{frames:?}");
        assert_eq!(frames[0].0, 0x4);
        let (kind, flags, stream, block) = &frames[1];
        assert_eq!((*kind, *flags, *stream), (HEADERS, END_HEADERS, 1));
        let headers = loona_hpack::Decoder::new().decode(block).unwrap();
        let authority = headers.iter().find(|(n, _)| n == b":authority").unwrap();
        assert_eq!(authority.1, b"localhost");
        assert_eq!(headers.len(), 6);
        assert_eq!(frames[2], (0x0, END_STREAM, 1, vec![0, 0, 0, 0, 0]));
    }

    #[test]
    fn keeps_a_valid_authority_and_follows_the_dynamic_table() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        for stream in [1u32, 3] {
            let block = encoder.encode(vec![
                (&b":method"[..], &b"POST"[..]),
                (b":authority", b"localhost:1234"),
                (b"x-custom", b"value"),
            ]);
            write_frame(
                &mut input,
                HEADERS,
                END_HEADERS | END_STREAM,
                stream,
                &block,
            );
        }
        let mut out = Vec::new();
        let mut rewriter = HeaderRewriter::new();
        rewriter.feed(&input, &mut out).unwrap();
        assert_eq!(rewriter.rewritten, 0);
        let frames = decode_frames(&out[PREFACE.len()..]);
        let mut decoder = loona_hpack::Decoder::new();
        for (_, flags, _, block) in &frames {
            assert_eq!(*flags, END_HEADERS | END_STREAM);
            let headers = decoder.decode(block).unwrap();
            assert_eq!(headers[1].1, b"localhost:1234");
            assert_eq!(headers[2], (b"x-custom".to_vec(), b"value".to_vec()));
        }
    }

    #[test]
    fn splits_a_large_block_into_continuations() {
        let big = vec![b'a'; 40_000];
        let mut block = Vec::new();
        block.push(0);
        encode_string(&mut block, b"x-big");
        encode_string(&mut block, &big);
        let mut input = PREFACE.to_vec();
        write_frame(&mut input, HEADERS, 0, 5, &block[..MAX_FRAME]);
        write_frame(
            &mut input,
            CONTINUATION,
            0,
            5,
            &block[MAX_FRAME..2 * MAX_FRAME],
        );
        write_frame(
            &mut input,
            CONTINUATION,
            END_HEADERS,
            5,
            &block[2 * MAX_FRAME..],
        );
        let mut out = Vec::new();
        HeaderRewriter::new().feed(&input, &mut out).unwrap();
        let frames = decode_frames(&out[PREFACE.len()..]);
        assert_eq!(
            frames.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(),
            vec![(HEADERS, 0), (CONTINUATION, 0), (CONTINUATION, END_HEADERS)]
        );
        let joined: Vec<u8> = frames.iter().flat_map(|f| f.3.clone()).collect();
        let headers = loona_hpack::Decoder::new().decode(&joined).unwrap();
        assert_eq!(headers, vec![(b"x-big".to_vec(), big)]);
    }

    /// A block that puts one `value_len`-byte header in the dynamic table and names it again
    /// `repeats` times with 1-byte indexed fields (index 62: the newest dynamic entry).
    fn amplifying_block(value_len: usize, repeats: usize) -> Vec<u8> {
        let mut block = Vec::new();
        // Literal with incremental indexing, new name (RFC 7541 6.2.1).
        block.push(0x40);
        encode_string(&mut block, b"x-a");
        encode_string(&mut block, &vec![b'v'; value_len]);
        block.extend(std::iter::repeat_n(0x80 | 62, repeats));
        block
    }

    /// `block` as HEADERS + CONTINUATION frames on stream 1.
    fn frames_of(block: &[u8]) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        let mut frames = Vec::new();
        write_headers(&mut frames, 1, true, block);
        input.extend_from_slice(&frames);
        input
    }

    #[test]
    fn refuses_a_block_that_decodes_past_the_header_list_bound() {
        // 4000 bytes named 60,000 times: 240 MB decoded from a 64 KB block.
        let block = amplifying_block(4000, 60_000);
        assert!(block.len() <= MAX_HEADER_BLOCK);
        let mut out = Vec::new();
        let err = HeaderRewriter::new()
            .feed(&frames_of(&block), &mut out)
            .unwrap_err();
        assert!(err.to_string().contains("decoded header list"), "{err}");
        assert!(
            out.len() <= PREFACE.len() + MAX_HEADER_LIST,
            "{}",
            out.len()
        );
        // Just under the bound still goes through: 15 copies of 4000 bytes.
        let block = amplifying_block(4000, 14);
        let mut out = Vec::new();
        HeaderRewriter::new()
            .feed(&frames_of(&block), &mut out)
            .unwrap();
        let frames = decode_frames(&out[PREFACE.len()..]);
        let joined: Vec<u8> = frames.iter().flat_map(|f| f.3.clone()).collect();
        let headers = loona_hpack::Decoder::new().decode(&joined).unwrap();
        assert_eq!(headers.len(), 15);
    }

    #[test]
    fn refuses_frames_and_blocks_over_their_bounds() {
        // One frame longer than SETTINGS_MAX_FRAME_SIZE is refused from its header alone.
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(&[0x10, 0, 0, HEADERS, 0, 0, 0, 0, 1]);
        let err = HeaderRewriter::new()
            .feed(&input, &mut Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("SETTINGS_MAX_FRAME_SIZE"), "{err}");
        // CONTINUATIONs that add up past the block bound.
        let mut input = PREFACE.to_vec();
        write_frame(&mut input, HEADERS, 0, 1, &[0u8; MAX_FRAME]);
        for _ in 0..4 {
            write_frame(&mut input, CONTINUATION, 0, 1, &[0u8; MAX_FRAME]);
        }
        let err = HeaderRewriter::new()
            .feed(&input, &mut Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("header block larger"), "{err}");
    }

    #[test]
    fn refuses_garbage() {
        let mut input = PREFACE.to_vec();
        write_frame(&mut input, HEADERS, PADDED | END_HEADERS, 1, &[200, 1, 2]);
        assert!(HeaderRewriter::new().feed(&input, &mut Vec::new()).is_err());
        let mut input = PREFACE.to_vec();
        write_frame(
            &mut input,
            HEADERS,
            END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff],
        );
        assert!(HeaderRewriter::new().feed(&input, &mut Vec::new()).is_err());
    }
}
