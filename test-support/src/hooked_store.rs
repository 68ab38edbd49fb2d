//! One wrapper for tests that need to watch or disturb an object store: [`HookedStore`]
//! forwards every call to the store it wraps, and runs each GET through a [`GetHook`] that
//! may count it, delay it, fail it or record it. (The tests had three hand-written
//! `impl ObjectStore` wrappers that differed only in their GET.)

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// What a test does around each GET of a [`HookedStore`]: `get` is the wrapped store's GET,
/// not started yet; the hook may await it (and do something before and after) or answer
/// without it.
pub trait GetHook: fmt::Debug + Send + Sync + 'static {
    fn around_get<'a>(
        &'a self,
        location: &'a ObjectPath,
        get: BoxFuture<'a, object_store::Result<GetResult>>,
    ) -> BoxFuture<'a, object_store::Result<GetResult>>;
}

impl<H: GetHook> GetHook for Arc<H> {
    fn around_get<'a>(
        &'a self,
        location: &'a ObjectPath,
        get: BoxFuture<'a, object_store::Result<GetResult>>,
    ) -> BoxFuture<'a, object_store::Result<GetResult>> {
        (**self).around_get(location, get)
    }
}

/// `inner` with every GET passed through `hook` (`get_opts`, which `object_store`'s other
/// reads, ranges included, go through by default); everything else forwarded as is.
#[derive(Debug)]
pub struct HookedStore<H> {
    inner: Arc<dyn ObjectStore>,
    hook: H,
}

impl<H: GetHook> HookedStore<H> {
    pub fn new(inner: Arc<dyn ObjectStore>, hook: H) -> Arc<HookedStore<H>> {
        Arc::new(HookedStore { inner, hook })
    }

    pub fn hook(&self) -> &H {
        &self.hook
    }
}

impl<H> fmt::Display for HookedStore<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "hooked({})", self.inner)
    }
}

/// The chunk objects of a sealed store (`chunks/…`): what most hooks watch.
pub fn is_chunk(location: &ObjectPath) -> bool {
    location.as_ref().starts_with("chunks/")
}

#[async_trait]
impl<H: GetHook> ObjectStore for HookedStore<H> {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let get = self.inner.get_opts(location, options);
        self.hook.around_get(location, get).await
    }

    async fn delete(&self, location: &ObjectPath) -> object_store::Result<()> {
        self.inner.delete(location).await
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &ObjectPath, to: &ObjectPath) -> object_store::Result<()> {
        self.inner.copy(from, to).await
    }

    async fn copy_if_not_exists(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
    ) -> object_store::Result<()> {
        self.inner.copy_if_not_exists(from, to).await
    }
}
