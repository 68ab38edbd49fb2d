//! Reconcilers for SealedVolume resources (not built yet).
