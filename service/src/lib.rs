//! What every Sealed Volumes binary shares, so each exists once: the log set-up
//! ([`logging`]), the `/metrics` and `/healthz` endpoint ([`http`]) and the store flags with
//! their environment names ([`store_args`]). Nothing here knows Kubernetes.

pub mod http;
pub mod logging;
pub mod store_args;
