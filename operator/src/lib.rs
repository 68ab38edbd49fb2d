//! The Sealed Volumes operator: reconcilers for `SealedVolume` and `SealedVolumeVersion`,
//! syncs (inline or as Jobs), deletion to the store's trash, garbage collection, metrics.

pub mod attestation;
pub mod config;
pub mod context;
pub mod controller;
pub mod error;
pub mod fleet_pki;
pub mod gc_loop;
pub mod guard;
pub mod metrics;
pub mod publications;
pub mod source_spec;
pub mod sync;
pub mod verify;
pub mod version;
pub mod volume;
pub mod webhook;
