//! What every Sealed Volumes binary shares, so each exists once: the log set-up
//! ([`logging`]), the `/metrics` and `/healthz` endpoint ([`http`]) and the store flags with
//! their environment names ([`store_args`]), and what built the binary ([`build`]). Nothing
//! here knows Kubernetes.

pub mod build;
#[cfg(feature = "http")]
pub mod http;
pub mod logging;
#[cfg(feature = "store-args")]
pub mod store_args;
