//! What every Sealed Volumes binary shares, so each exists once: the log set-up
//! ([`logging`]), the `/metrics` and `/healthz` endpoint ([`http`]) and the store flags with
//! their environment names ([`store_args`]), and what built the binary ([`build`]); the
//! bounds every listener keeps (connection caps, deadlines, descriptors: [`listen`]). Nothing
//! here knows Kubernetes.

pub mod build;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "http")]
pub mod listen;
pub mod logging;
#[cfg(feature = "store-args")]
pub mod store_args;
