//! The plugin's side of the FUSE fd holder: the blocking client of `sealed_fd_holder` (the
//! protocol, read top to bottom in that crate) behind one async facade. Every call goes
//! through [`FdHolder::call`]: one `spawn_blocking`, one error type ([`HolderError`]).

use std::os::fd::{AsFd as _, OwnedFd};
use std::path::PathBuf;

pub use sealed_fd_holder::{HeldMount, HolderClient, HolderError};

#[derive(Clone, Debug)]
pub struct FdHolder {
    client: HolderClient,
}

impl FdHolder {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        FdHolder {
            client: HolderClient::new(socket),
        }
    }

    /// Every mount whose fd the holder keeps.
    pub async fn list(&self) -> Result<Vec<HeldMount>, HolderError> {
        self.call("listing held fds", |c| c.list()).await
    }

    /// Hands the holder `fuse` (a duplicate of the FUSE fd of the mount at `key`).
    pub async fn put(&self, key: String, digest: String, fuse: OwnedFd) -> Result<(), HolderError> {
        self.call("handing over an fd", move |c| {
            c.put(&key, &digest, fuse.as_fd())
        })
        .await
    }

    /// The digest and a duplicate of the fd held for `key`, or None.
    pub async fn get(&self, key: String) -> Result<Option<(String, OwnedFd)>, HolderError> {
        self.call("taking an fd back", move |c| c.get(&key)).await
    }

    /// Closes the holder's fd for `key`; unknown keys are fine.
    pub async fn drop_fd(&self, key: String) -> Result<(), HolderError> {
        self.call("dropping an fd", move |c| c.drop_fd(&key)).await
    }

    /// Runs one blocking call of the client off the async threads (each is a short unix
    /// socket exchange, bounded by the client's I/O timeout).
    async fn call<T, F>(&self, what: &'static str, f: F) -> Result<T, HolderError>
    where
        T: Send + 'static,
        F: FnOnce(&HolderClient) -> Result<T, HolderError> + Send + 'static,
    {
        let client = self.client.clone();
        match tokio::task::spawn_blocking(move || f(&client)).await {
            Ok(result) => result,
            Err(e) => Err(HolderError::Io {
                socket: self.client.socket().to_path_buf(),
                what,
                source: std::io::Error::other(e),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_call_names_the_socket_when_no_holder_answers() {
        let holder = FdHolder::new("/nonexistent/holder.sock");
        let errors = [
            holder.list().await.map(drop).unwrap_err(),
            holder.get("k".into()).await.map(drop).unwrap_err(),
            holder.drop_fd("k".into()).await.unwrap_err(),
        ];
        for e in errors {
            assert!(e.to_string().contains("/nonexistent/holder.sock"), "{e}");
        }
    }
}
