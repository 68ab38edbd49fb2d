//! CSI node plugin for Sealed Volumes.
//!
//! Shaped like csi-driver-host-path: one file per CSI service ([`identity`], [`node`]), the
//! driver state apart from the gRPC layer ([`driver`]: its publish/unpublish and restart
//! recovery, with the kernel calls in [`mounts`], the on-disk records in [`records`] and the
//! fd holder behind [`holder`]), and errors mapped to gRPC status codes in one place
//! ([`error`]). [`server`] serves the sockets, [`plugin`] runs the whole lifecycle for
//! `main`, and [`proto`] holds the generated gRPC code.

pub mod attest;
pub mod authority;
pub mod cold_start;
pub mod digest_locks;
pub mod driver;
pub mod error;
pub mod gpu;
pub mod holder;
pub mod identity;
pub mod kube_access;
pub mod lease;
pub mod manifest_cache;
pub mod metrics;
pub mod mounts;
pub mod node;
pub mod peer;
pub mod plugin;
pub mod proto;
pub mod records;
pub mod registration;
pub mod server;
pub mod state_dir;
pub mod store_slot;
pub mod targets;
pub mod warm;

pub use driver::{Driver, DriverConfig};
pub use error::CsiError;
pub use identity::{DRIVER_NAME, IdentityService};
pub use kube_access::KubeAccess;
pub use node::NodeService;
