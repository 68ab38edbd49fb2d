//! Fuzzing the registration socket's HTTP/2 header shim (`sealed_csi::authority`) with
//! proptest: whatever a client sends, the shim never panics, its output stays within the
//! header-list bound, it does not depend on how the bytes were split into reads, and real
//! requests come out with the same headers (an invalid `:authority` replaced, nothing else).
//!
//! Case counts are proptest's defaults (256) so CI stays quick; for a longer run set
//! `PROPTEST_CASES`, e.g. `PROPTEST_CASES=100000 cargo test -p sealed-csi --test hpack_fuzz --release`.

use proptest::prelude::*;
use sealed_csi::authority::{
    CONTINUATION, END_HEADERS, END_STREAM, HEADERS, HeaderRewriter, MAX_HEADER_LIST, PREFACE,
    REPLACEMENT_AUTHORITY, write_frame,
};

const DATA: u8 = 0x0;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame(&mut out, kind, flags, stream, payload);
    out
}

/// Feeds `input` in pieces cut at `cuts` (positions modulo the length).
fn feed_in_pieces(input: &[u8], cuts: &[usize]) -> std::io::Result<(Vec<u8>, u64)> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| if input.is_empty() { 0 } else { c % input.len() })
        .collect();
    at.push(0);
    at.push(input.len());
    at.sort_unstable();
    at.dedup();
    let mut rewriter = HeaderRewriter::new();
    let mut out = Vec::new();
    for piece in at.windows(2) {
        rewriter.feed(&input[piece[0]..piece[1]], &mut out)?;
    }
    Ok((out, rewriter.rewritten))
}

/// One frame: kind, flags, stream, payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// Splits the output into frames; `None` if it is not a whole number of frames.
fn parse_frames(mut bytes: &[u8]) -> Option<Vec<Frame>> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < 9 {
            return None;
        }
        let len =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        if bytes.len() < 9 + len {
            return None;
        }
        let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
        frames.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
        bytes = &bytes[9 + len..];
    }
    Some(frames)
}

/// One frame of any kind with random flags and payload (bounded so cases stay small).
fn any_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![Just(DATA), Just(HEADERS), Just(CONTINUATION), 0u8..=0xff],
        any::<u8>(),
        prop_oneof![Just(0u32), Just(1u32), Just(3u32), any::<u32>()],
        prop::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(kind, flags, stream, payload)| frame(kind, flags, stream, &payload))
}

/// A header list as a gRPC client sends it, with a valid or an invalid `:authority`.
fn request_headers() -> impl Strategy<Value = Vec<(Vec<u8>, Vec<u8>)>> {
    let authority = prop_oneof![
        "[a-z]{1,10}(:[0-9]{1,5})?".prop_map(String::into_bytes),
        "(%2F[a-z._-]{1,12}){1,6}".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..40),
    ];
    let extra = prop::collection::vec(
        (
            "x-[a-z0-9-]{1,12}".prop_map(String::into_bytes),
            prop::collection::vec(any::<u8>(), 0..200),
        ),
        0..6,
    );
    (authority, extra).prop_map(|(authority, extra)| {
        let mut headers = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (
                b":path".to_vec(),
                b"/pluginregistration.Registration/GetInfo".to_vec(),
            ),
            (b":authority".to_vec(), authority),
        ];
        headers.extend(extra);
        headers
    })
}

fn expected(headers: &[(Vec<u8>, Vec<u8>)]) -> Vec<(Vec<u8>, Vec<u8>)> {
    headers
        .iter()
        .map(|(name, value)| {
            if name == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err() {
                (name.clone(), REPLACEMENT_AUTHORITY.to_vec())
            } else {
                (name.clone(), value.clone())
            }
        })
        .collect()
}

proptest! {
    /// Bytes of any shape: no panic, and what comes out is bounded by what went in plus at
    /// most one decoded header list per frame.
    #[test]
    fn arbitrary_bytes(body in prop::collection::vec(any::<u8>(), 0..4096),
                       cuts in prop::collection::vec(any::<usize>(), 0..8)) {
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(&body);
        if let Ok((out, _)) = feed_in_pieces(&input, &cuts) {
            let frames = body.len() / 9 + 1;
            prop_assert!(out.len() <= input.len() + frames * (MAX_HEADER_LIST + 64));
        }
    }

    /// Well-framed but random frames: the result never depends on how reads split the bytes,
    /// and an accepted stream comes out as whole frames.
    #[test]
    fn random_frames_any_split(frames in prop::collection::vec(any_frame(), 0..12),
                               cuts in prop::collection::vec(any::<usize>(), 0..12)) {
        let mut input = PREFACE.to_vec();
        for f in &frames {
            input.extend_from_slice(f);
        }
        let whole = feed_in_pieces(&input, &[]);
        let split = feed_in_pieces(&input, &cuts);
        match (whole, split) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(&a, &b);
                prop_assert_eq!(&a.0[..PREFACE.len()], PREFACE);
                prop_assert!(parse_frames(&a.0[PREFACE.len()..]).is_some());
            }
            (Err(_), Err(_)) => {}
            (a, b) => prop_assert!(false, "whole {:?} vs split {:?}", a.is_ok(), b.is_ok()),
        }
    }

    /// Real requests (one HPACK encoder across streams, so the dynamic table is used), header
    /// blocks cut into HEADERS + CONTINUATION, DATA in between, any read split: the server
    /// sees the same headers, an invalid authority replaced, and DATA byte for byte.
    #[test]
    fn requests_come_out_the_same(requests in prop::collection::vec(request_headers(), 1..4),
                                  piece in 1usize..200,
                                  cuts in prop::collection::vec(any::<usize>(), 0..12)) {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        let mut invalid = 0u64;
        for (i, headers) in requests.iter().enumerate() {
            let stream = 1 + 2 * i as u32;
            let block = encoder.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
            let pieces: Vec<&[u8]> = block.chunks(piece).collect();
            for (j, p) in pieces.iter().enumerate() {
                let kind = if j == 0 { HEADERS } else { CONTINUATION };
                let flags = if j + 1 == pieces.len() { END_HEADERS } else { 0 };
                input.extend(frame(kind, flags, stream, p));
            }
            input.extend(frame(DATA, END_STREAM, stream, &[0, 0, 0, 0, 0]));
            invalid += u64::from(expected(headers) != *headers);
        }
        let (out, rewritten) = feed_in_pieces(&input, &cuts).expect("a valid request refused");
        prop_assert_eq!(rewritten, invalid);
        let frames = parse_frames(&out[PREFACE.len()..]).expect("not whole frames");
        // Re-encoded blocks are literals without indexing, so a fresh decoder reads them.
        let mut decoder = loona_hpack::Decoder::new();
        let mut seen = Vec::new();
        let mut block = Vec::new();
        for (kind, flags, stream, payload) in frames {
            match kind {
                HEADERS | CONTINUATION => {
                    block.extend_from_slice(&payload);
                    if flags & END_HEADERS != 0 {
                        let headers = decoder.decode(&block).expect("re-encoded block");
                        seen.push((stream, headers));
                        block.clear();
                    }
                }
                DATA => prop_assert_eq!(payload, vec![0, 0, 0, 0, 0]),
                other => prop_assert!(false, "unexpected frame kind {}", other),
            }
        }
        prop_assert_eq!(seen.len(), requests.len());
        for (i, (stream, headers)) in seen.into_iter().enumerate() {
            prop_assert_eq!(stream, 1 + 2 * i as u32);
            prop_assert_eq!(headers, expected(&requests[i]));
        }
    }
}
