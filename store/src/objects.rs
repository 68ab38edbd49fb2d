//! The store's object primitives: reads where absence is an answer, deletes where absence is
//! fine, JSON writes. `NotFound` is mapped in one place ([`found`]); everything above speaks
//! of chunks, manifests and records.

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{GetResult, ObjectMeta, PutPayload};

use crate::error::{Error, Result};
use crate::store::ChunkStore;

/// `Ok(None)` for a missing object: the one `NotFound` mapping.
pub(crate) fn found<T>(result: object_store::Result<T>) -> object_store::Result<Option<T>> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

impl ChunkStore {
    /// The object at `key`, or `None` when there is none.
    pub(crate) async fn get_optional(&self, key: &ObjectPath) -> Result<Option<GetResult>> {
        found(self.raw().get(key).await).map_err(|e| self.backend(e))
    }

    /// The whole body at `key` read within `limit` ([`crate::bounded::read_capped`]), or
    /// `None` when there is none. `what` names the object for messages.
    pub(crate) async fn read_optional(
        &self,
        key: &ObjectPath,
        what: &str,
        limit: u64,
    ) -> Result<Option<Bytes>> {
        match self.get_optional(key).await? {
            Some(got) => Ok(Some(
                crate::bounded::read_capped(self, got, what, limit).await?,
            )),
            None => Ok(None),
        }
    }

    /// The metadata of `key`, or `None` when there is none.
    pub(crate) async fn head_optional(&self, key: &ObjectPath) -> Result<Option<ObjectMeta>> {
        found(self.raw().head(key).await).map_err(|e| self.backend(e))
    }

    pub(crate) async fn exists(&self, key: &ObjectPath) -> Result<bool> {
        Ok(self.head_optional(key).await?.is_some())
    }

    /// Deletes `key`; a missing object is fine.
    pub(crate) async fn delete_if_exists(&self, key: &ObjectPath) -> Result<()> {
        found(self.raw().delete(key).await)
            .map(drop)
            .map_err(|e| self.backend(e))
    }

    /// [`delete_if_exists`](Self::delete_if_exists) for objects that expire anyway: a failure
    /// is only logged.
    pub(crate) async fn delete_quietly(&self, key: &ObjectPath) {
        if let Err(e) = self.delete_if_exists(key).await {
            tracing::warn!(%key, error = %e, "cannot delete; it will expire");
        }
    }

    /// Writes `value` as JSON at `key`; returns the new object's ETag (when the store gives
    /// one).
    pub(crate) async fn write_json<T: serde::Serialize>(
        &self,
        key: &ObjectPath,
        value: &T,
    ) -> Result<Option<String>> {
        let body = serde_json::to_vec(value).map_err(|e| Error::Other(format!("{key}: {e}")))?;
        let put = self
            .raw()
            .put(key, PutPayload::from(body))
            .await
            .map_err(|e| self.backend(e))?;
        Ok(put.e_tag)
    }
}
