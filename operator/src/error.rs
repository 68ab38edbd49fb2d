//! Errors of the reconcilers. Each says what failed and on which object.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),

    #[error("store: {0}")]
    Store(#[from] sealed_store::Error),

    #[error("{object}: {message}")]
    Invalid { object: String, message: String },

    /// Not an error of anyone's: the thing waits (a version still mounted somewhere).
    #[error("{object}: {message}")]
    InUse { object: String, message: String },

    #[error("finalizer of {object}: {message}")]
    Finalizer { object: String, message: String },

    /// The reconcile panicked (a bug); caught by `crate::guard`, retried with a backoff.
    #[error("{object}: reconcile panicked: {message}")]
    Panicked { object: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
