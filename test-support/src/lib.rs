//! What the crates' tests share: the real servers they run against ([`servers`]: moto's S3
//! server, Azurite, the Hub stand-in), hand-made HTTP servers ([`http`]), an object store
//! wrapper that watches or disturbs GETs ([`hooked_store`]) and deterministic test data
//! ([`trees`]). It depends on none of the workspace's crates, so the store's own
//! tests can use it too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod hooked_store;
pub mod http;
pub mod servers;
pub mod trees;

pub use hooked_store::*;
pub use http::*;
pub use servers::*;
pub use trees::*;
