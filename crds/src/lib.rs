//! Kubernetes API types: SealedVolume and SealedVolumeVersion (not built yet).
