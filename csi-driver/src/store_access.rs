//! How the plugin reaches the store: opened on first use and never remembered as down
//! ([`StoreSlot`]), and the read-only view a FUSE mount reads through ([`MountView`]): its
//! version's manifest from the copy under the state dir, everything else from the store.
//!
//! The view is what lets a held mount resume while the store is down: the manifest is
//! already here, and chunk reads that need the store fail within the fetch policy's bound
//! (EIO) until it answers again, instead of the mount not being served at all.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt as _, TryStreamExt as _};
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use sealed_store::{ChunkStore, Digest, StoreOptions};

/// The store, opened (and probed) on first use. A failed open is not remembered: the next
/// caller tries again. No lock is held while opening, so a store that hangs keeps only its
/// own callers waiting.
pub struct StoreSlot {
    url: String,
    options: StoreOptions,
    opened: Mutex<Option<ChunkStore>>,
}

impl StoreSlot {
    pub fn new(url: String, options: StoreOptions) -> Arc<Self> {
        Arc::new(StoreSlot {
            url,
            options,
            opened: Mutex::new(None),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn get(&self) -> Result<ChunkStore, sealed_store::Error> {
        if let Some(store) = self.cached() {
            return Ok(store);
        }
        let store = ChunkStore::open(&self.url, &self.options).await?;
        let mut slot = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        Ok(slot.get_or_insert(store).clone())
    }

    fn cached(&self) -> Option<ChunkStore> {
        self.opened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A mount's view of the store: `manifests/<digest>` of its own version answered from
/// `manifest` (verified bytes read from the state dir or fetched once), every other read
/// passed to the store. Read-only: a mount never writes.
pub struct MountView {
    digest: Digest,
    manifest_key: ObjectPath,
    manifest: Bytes,
    store: Arc<StoreSlot>,
}

impl MountView {
    /// A [`ChunkStore`] over the view, for `MountHandle::spawn` / `resume`. `manifest` must
    /// be the verified bytes of `digest` (see `manifest_cache`).
    pub fn chunk_store(digest: Digest, manifest: Bytes, store: Arc<StoreSlot>) -> ChunkStore {
        let name = store.url().to_string();
        let view = MountView {
            digest,
            manifest_key: ChunkStore::manifest_key(&digest),
            manifest,
            store,
        };
        ChunkStore::from_object_store(Arc::new(view), name)
    }

    async fn remote(&self) -> object_store::Result<Arc<dyn ObjectStore>> {
        remote(&self.store).await
    }

    fn read_only(&self) -> object_store::Error {
        object_store::Error::NotSupported {
            source: "a mount's view of the store is read-only".into(),
        }
    }

    fn manifest_result(&self, options: &GetOptions) -> object_store::Result<GetResult> {
        let len = self.manifest.len() as u64;
        let range = match &options.range {
            None => 0..len,
            Some(r) => r.as_range(len).map_err(|e| object_store::Error::Generic {
                store: "sealed-csi",
                source: e.to_string().into(),
            })?,
        };
        let start = usize::try_from(range.start).unwrap_or(usize::MAX);
        let end = usize::try_from(range.end).unwrap_or(usize::MAX);
        let bytes = self
            .manifest
            .get(start..end)
            .map(Bytes::copy_from_slice)
            .unwrap_or_default();
        let meta = ObjectMeta {
            location: self.manifest_key.clone(),
            last_modified: chrono_epoch(),
            size: len,
            e_tag: Some(self.digest.hex()),
            version: None,
        };
        let payload = if options.head {
            futures::stream::empty().boxed()
        } else {
            futures::stream::once(async move { Ok(bytes) }).boxed()
        };
        Ok(GetResult {
            payload: GetResultPayload::Stream(payload),
            meta,
            range,
            attributes: Default::default(),
        })
    }
}

fn chrono_epoch() -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::<chrono::Utc>::UNIX_EPOCH
}

async fn remote(slot: &StoreSlot) -> object_store::Result<Arc<dyn ObjectStore>> {
    slot.get()
        .await
        .map(|s| s.object_store().clone())
        .map_err(|e| object_store::Error::Generic {
            store: "sealed-csi",
            source: Box::new(e),
        })
}

impl fmt::Display for MountView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MountView({}, {})", self.digest, self.store.url())
    }
}

impl fmt::Debug for MountView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[async_trait]
impl ObjectStore for MountView {
    async fn put_opts(
        &self,
        _location: &ObjectPath,
        _payload: PutPayload,
        _opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        Err(self.read_only())
    }

    async fn put_multipart_opts(
        &self,
        _location: &ObjectPath,
        _opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(self.read_only())
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if *location == self.manifest_key {
            return self.manifest_result(&options);
        }
        self.remote().await?.get_opts(location, options).await
    }

    async fn get_range(
        &self,
        location: &ObjectPath,
        range: Range<u64>,
    ) -> object_store::Result<Bytes> {
        if *location == self.manifest_key {
            let options = GetOptions {
                range: Some(range.into()),
                ..Default::default()
            };
            return self.manifest_result(&options)?.bytes().await;
        }
        self.remote().await?.get_range(location, range).await
    }

    async fn delete(&self, _location: &ObjectPath) -> object_store::Result<()> {
        Err(self.read_only())
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let store = self.store.clone();
        let prefix = prefix.cloned();
        futures::stream::once(async move {
            let remote = remote(&store).await?;
            Ok::<_, object_store::Error>(remote.list(prefix.as_ref()))
        })
        .try_flatten()
        .boxed()
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.remote().await?.list_with_delimiter(prefix).await
    }

    async fn copy(&self, _from: &ObjectPath, _to: &ObjectPath) -> object_store::Result<()> {
        Err(self.read_only())
    }

    async fn copy_if_not_exists(
        &self,
        _from: &ObjectPath,
        _to: &ObjectPath,
    ) -> object_store::Result<()> {
        Err(self.read_only())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_manifest_is_served_without_the_store() {
        // A store URL nothing answers at: only the manifest may be read.
        let slot = StoreSlot::new(
            "s3://nowhere".into(),
            StoreOptions {
                endpoint: Some("http://127.0.0.1:9".into()),
                timeout: std::time::Duration::from_secs(1),
                retries: 0,
                ..Default::default()
            },
        );
        let bytes = Bytes::from_static(b"not really a manifest");
        let digest = Digest::of(&bytes);
        let store = MountView::chunk_store(digest, bytes.clone(), slot);
        let got = store.get_manifest_bytes(&digest).await.unwrap();
        assert_eq!(got, bytes);
        let other = Digest::of(b"other");
        assert!(store.get_manifest_bytes(&other).await.is_err());
        assert!(store.put_manifest(b"x".to_vec()).await.is_err());
    }
}
