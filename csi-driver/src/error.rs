//! Every failure of the plugin, and the one place it becomes a gRPC status code.

use std::path::PathBuf;

use sealed_mount::MountError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// A required request field is empty (`volume_id`, `target_path`, ...).
    #[error("{0} is required")]
    Missing(&'static str),
    #[error("{0}")]
    InvalidArgument(String),
    #[error(
        "sealed volumes are read-only: {0} (set readOnly: true on the volume, and an access mode \
         of ReadOnlyMany or ReadWriteOnce)"
    )]
    Writable(String),
    #[error("volume {volume_id} is not published at {path}")]
    NotPublished { volume_id: String, path: PathBuf },
    #[error("{path} already holds volume {existing}; it cannot also hold {requested}")]
    TargetInUse {
        path: PathBuf,
        existing: String,
        requested: String,
    },
    #[error("{0} is not implemented: sealed volumes need no staging, expansion or controller")]
    Unimplemented(&'static str),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// Something the plugin needs is not there yet (the attestation Secret): kubelet retries.
    #[error("{0}")]
    Unavailable(String),
    /// A call to the API server failed (not a refusal of the request itself).
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("store {store} is not reachable: {reason}")]
    StoreUnreachable { store: String, reason: String },
    #[error(transparent)]
    Store(#[from] sealed_store::Error),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl CsiError {
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CsiError::Io {
            what,
            path: path.into(),
            source,
        }
    }

    /// A store error as the plugin reports it: a store that does not answer (down, timing
    /// out, not there) is [`CsiError::StoreUnreachable`], naming `store`; an answer (no such
    /// version, corrupt bytes, a bad URL) is [`CsiError::Store`].
    pub fn from_store(store: &str, e: sealed_store::Error) -> Self {
        if store_unreachable(&e) {
            CsiError::StoreUnreachable {
                store: store.into(),
                reason: e.to_string(),
            }
        } else {
            CsiError::Store(e)
        }
    }

    pub fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        CsiError::Kube {
            what: what.into(),
            source,
        }
    }

    pub fn code(&self) -> Code {
        match self {
            CsiError::Missing(_) | CsiError::InvalidArgument(_) | CsiError::Writable(_) => {
                Code::InvalidArgument
            }
            CsiError::NotPublished { .. } | CsiError::NotFound(_) => Code::NotFound,
            CsiError::PermissionDenied(_) => Code::PermissionDenied,
            CsiError::FailedPrecondition(_) => Code::FailedPrecondition,
            CsiError::Kube { source, .. } => kube_code(source),
            CsiError::TargetInUse { .. } => Code::AlreadyExists,
            CsiError::Unimplemented(_) => Code::Unimplemented,
            CsiError::StoreUnreachable { .. } | CsiError::Unavailable(_) => Code::Unavailable,
            CsiError::Store(e) => store_code(e),
            CsiError::Mount(MountError::Store(e)) => store_code(e),
            CsiError::Mount(MountError::BadManifest { .. }) => Code::DataLoss,
            // The version is larger than this node's per-mount caps allow: not a fault of the
            // plugin, and retrying does not help until the caps change.
            CsiError::Mount(MountError::OverLimit { .. }) => Code::ResourceExhausted,
            CsiError::Mount(_) | CsiError::Io { .. } => Code::Internal,
        }
    }
}

/// An API server that is down or overloaded is retried by kubelet (`Unavailable`); a refusal
/// of the plugin's own call (RBAC, a missing CRD) is a deployment problem (`Internal`).
fn kube_code(e: &kube::Error) -> Code {
    match e {
        kube::Error::Api(status) if status.code == 429 || status.code >= 500 => Code::Unavailable,
        kube::Error::Api(_) => Code::Internal,
        _ => Code::Unavailable,
    }
}

/// Whether the store did not answer (worth trying again), as opposed to answering no.
pub fn store_unreachable(e: &sealed_store::Error) -> bool {
    use sealed_store::Error as E;
    matches!(
        e,
        E::Backend { .. } | E::Timeout { .. } | E::StoreNotFound { .. }
    )
}

fn store_code(e: &sealed_store::Error) -> Code {
    use sealed_store::Error as E;
    match e {
        E::MalformedDigest { .. } => Code::InvalidArgument,
        E::UnknownVersion { .. } => Code::NotFound,
        E::Backend { .. } | E::Timeout { .. } | E::StoreNotFound { .. } => Code::Unavailable,
        E::ManifestDigestMismatch { .. }
        | E::InvalidManifest(_)
        | E::CorruptChunk { .. }
        | E::MissingChunk { .. } => Code::DataLoss,
        E::InFile { source, .. } => store_code(source),
        _ => Code::Internal,
    }
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Status {
        let code = e.code();
        // The full chain, so the message names the cause (kubelet shows it in pod events).
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let text = s.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            source = s.source();
        }
        match code {
            Code::Internal | Code::DataLoss | Code::Unavailable => {
                tracing::warn!(?code, %message, "request failed")
            }
            _ => tracing::info!(?code, %message, "request refused"),
        }
        Status::new(code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_store::{Digest, Error as StoreError};

    #[test]
    fn codes() {
        let digest = Digest::of(b"x");
        let cases: Vec<(CsiError, Code)> = vec![
            (CsiError::Missing("volume_id"), Code::InvalidArgument),
            (
                CsiError::Writable("readonly=false".into()),
                Code::InvalidArgument,
            ),
            (
                StoreError::MalformedDigest { input: "x".into() }.into(),
                Code::InvalidArgument,
            ),
            (
                StoreError::UnknownVersion {
                    digest,
                    store: "s".into(),
                }
                .into(),
                Code::NotFound,
            ),
            (
                CsiError::Mount(MountError::Store(StoreError::UnknownVersion {
                    digest,
                    store: "s".into(),
                })),
                Code::NotFound,
            ),
            (
                StoreError::Timeout {
                    store: "s".into(),
                    what: "w".into(),
                    seconds: 1,
                }
                .into(),
                Code::Unavailable,
            ),
            (
                CsiError::StoreUnreachable {
                    store: "s".into(),
                    reason: "r".into(),
                },
                Code::Unavailable,
            ),
            (
                CsiError::Mount(MountError::BadManifest {
                    digest,
                    reason: "r".into(),
                }),
                Code::DataLoss,
            ),
            (
                CsiError::Mount(MountError::OverLimit {
                    digest,
                    what: "chunk references",
                    field: "max_chunks",
                    count: 5,
                    limit: 4,
                }),
                Code::ResourceExhausted,
            ),
            (
                CsiError::Unimplemented("NodeStageVolume"),
                Code::Unimplemented,
            ),
            (
                CsiError::Unavailable("attestation Secret s/a not found".into()),
                Code::Unavailable,
            ),
            (
                CsiError::PermissionDenied("no valid attestation".into()),
                Code::PermissionDenied,
            ),
            (
                CsiError::FailedPrecondition("podInfoOnMount".into()),
                Code::FailedPrecondition,
            ),
        ];
        for (error, code) in cases {
            let text = error.to_string();
            let status = Status::from(error);
            assert_eq!(status.code(), code, "{text}");
            assert!(status.message().starts_with(&text), "{}", status.message());
        }
    }

    #[test]
    fn store_errors_are_unreachable_or_answers() {
        let timeout = StoreError::Timeout {
            store: "s".into(),
            what: "w".into(),
            seconds: 1,
        };
        let e = CsiError::from_store("s3://b", timeout);
        assert!(matches!(e, CsiError::StoreUnreachable { .. }), "{e}");
        assert!(
            e.to_string().starts_with("store s3://b is not reachable"),
            "{e}"
        );
        let missing = StoreError::UnknownVersion {
            digest: Digest::of(b"x"),
            store: "s".into(),
        };
        let e = CsiError::from_store("s3://b", missing);
        assert_eq!(e.code(), Code::NotFound);
        let url = StoreError::InvalidStoreUrl {
            url: "x".into(),
            reason: "r".into(),
        };
        assert!(matches!(
            CsiError::from_store("x", url),
            CsiError::Store(StoreError::InvalidStoreUrl { .. })
        ));
    }

    #[test]
    fn status_message_carries_the_cause() {
        let e = CsiError::io(
            "bind-mounting onto",
            "/t",
            std::io::Error::from_raw_os_error(libc::EPERM),
        );
        let status = Status::from(e);
        assert_eq!(status.code(), Code::Internal);
        assert!(status.message().contains("/t"), "{}", status.message());
        assert!(
            status.message().contains("not permitted"),
            "{}",
            status.message()
        );
    }
}
