//! Reads of remote data, each bounded by what the object can legitimately be.
//!
//! A store is remote input: a hostile or broken server can answer a GET with a body far
//! larger than any chunk, manifest or record, or list without end. Every read here refuses a
//! declared size over its cap before reading a byte, streams the body otherwise and stops as
//! soon as the cap is passed, so memory stays within the cap whatever the server sends. The
//! HTTP layer bounds what object_store reads by itself (listing pages, error bodies): see
//! [`crate::http_cap`].

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{GetResult, GetResultPayload, ObjectMeta};

use crate::error::{Error, Result};
use crate::store::ChunkStore;

/// The largest chunk any valid manifest can declare: FastCDC's largest `max_size`, which
/// [`crate::ChunkParams::validate`] enforces (our own writer uses 4 MiB).
pub const MAX_CHUNK_BYTES: u64 = fastcdc::v2020::MAXIMUM_MAX as u64;
/// The largest manifest ([`crate::manifest::MAX_MANIFEST_BYTES`]).
pub const MAX_MANIFEST_BYTES: u64 = crate::manifest::MAX_MANIFEST_BYTES;
/// Leases, the GC marker, volume records and trash records: JSON of a few hundred bytes.
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;
/// The most entries one collected listing (manifests, records, trash) may return: far more
/// than any store holds (each costs a few hundred bytes of memory), so that an endless
/// paginated listing ends with an error instead of exhausting memory.
pub const MAX_LISTED_OBJECTS: u64 = 2_000_000;
/// The most writer leases: one per running writer.
pub const MAX_LISTED_LEASES: u64 = 100_000;

fn too_large(store: &ChunkStore, what: &str, limit: u64, got_at_least: u64) -> Error {
    Error::ResponseTooLarge {
        store: store.name().to_owned(),
        what: what.to_owned(),
        limit,
        got_at_least,
    }
}

/// The whole body of `got`, or [`Error::ResponseTooLarge`] once more than `limit` bytes are
/// declared or arrive. `what` names the object for the message.
pub(crate) async fn read_capped(
    store: &ChunkStore,
    got: GetResult,
    what: &str,
    limit: u64,
) -> Result<Bytes> {
    let declared = got.range.end.saturating_sub(got.range.start);
    if declared > limit {
        return Err(too_large(store, what, limit, declared));
    }
    match got.payload {
        // A local file: the read is of the range stat gave, which is within the cap, in one
        // piece (its stream reads 8 KiB at a time).
        GetResultPayload::File(..) => got.bytes().await.map_err(|e| store.backend(e)),
        GetResultPayload::Stream(body) => {
            let body = body.map_err(|e| store.backend(e));
            collect_capped(body, declared, limit)
                .await
                .map_err(|over| match over {
                    Capped::Over(got_at_least) => too_large(store, what, limit, got_at_least),
                    Capped::Failed(e) => e,
                })
        }
    }
}

enum Capped {
    Over(u64),
    Failed(Error),
}

/// Collects `body`, stopping (and dropping the stream, which closes the connection) as soon
/// as more than `limit` bytes have come.
async fn collect_capped(
    mut body: impl Stream<Item = Result<Bytes>> + Unpin,
    declared: u64,
    limit: u64,
) -> std::result::Result<Bytes, Capped> {
    let mut out = BytesMut::with_capacity(usize::try_from(declared.min(limit)).unwrap_or(0));
    let mut seen: u64 = 0;
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(Capped::Failed)?;
        seen = seen.saturating_add(piece.len() as u64);
        if seen > limit {
            return Err(Capped::Over(seen));
        }
        if out.is_empty() && seen == declared {
            // The common case, one piece with the whole body: no copy.
            return Ok(piece);
        }
        out.extend_from_slice(&piece);
    }
    Ok(out.freeze())
}

/// The objects under `prefix`, or [`Error::ListingTooLong`] once more than `limit` are
/// listed (the listing is streamed and stopped there).
pub(crate) async fn list_capped(
    store: &ChunkStore,
    prefix: &ObjectPath,
    limit: u64,
) -> Result<Vec<ObjectMeta>> {
    let mut listing = store.raw().list(Some(prefix));
    let mut out = Vec::new();
    while let Some(meta) = listing.try_next().await.map_err(|e| store.backend(e))? {
        if out.len() as u64 >= limit {
            return Err(Error::ListingTooLong {
                store: store.name().to_owned(),
                prefix: format!("{prefix}/"),
                limit,
            });
        }
        out.push(meta);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Prefix;

    fn pieces(sizes: &[usize]) -> impl Stream<Item = Result<Bytes>> + Unpin {
        let items: Vec<Result<Bytes>> = sizes
            .iter()
            .map(|&n| Ok(Bytes::from(vec![7u8; n])))
            .collect();
        futures::stream::iter(items)
    }

    #[tokio::test]
    async fn bodies_are_collected_up_to_the_cap_and_no_further() {
        let whole = collect_capped(pieces(&[10]), 10, 10).await.ok().unwrap();
        assert_eq!(whole.len(), 10);
        let joined = collect_capped(pieces(&[4, 4, 2]), 10, 10)
            .await
            .ok()
            .unwrap();
        assert_eq!(joined.len(), 10);
        // A stream that runs past its cap stops at the first piece over it.
        let endless = futures::stream::repeat_with(|| Ok(Bytes::from(vec![0u8; 1000])));
        match collect_capped(endless, 0, 4500).await {
            Err(Capped::Over(seen)) => assert_eq!(seen, 5000),
            _ => panic!("an endless body must stop at its cap"),
        }
    }

    #[tokio::test]
    async fn listings_are_counted_and_stopped_past_their_bound() {
        let store = ChunkStore::memory();
        let trash = Prefix::Trash.path();
        for i in 0..5 {
            let key = trash.child(i.to_string());
            store
                .raw()
                .put(&key, object_store::PutPayload::from_static(b"x"))
                .await
                .unwrap();
        }
        assert_eq!(list_capped(&store, &trash, 5).await.unwrap().len(), 5);
        match list_capped(&store, &trash, 4).await {
            Err(Error::ListingTooLong { prefix, limit, .. }) => {
                assert_eq!((prefix.as_str(), limit), ("trash/", 4));
            }
            other => panic!("expected ListingTooLong, got {other:?}"),
        }
    }
}
