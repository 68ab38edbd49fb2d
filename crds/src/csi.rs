//! The CSI driver's name and the volume attributes a pod spec carries: one home for the
//! names the node plugin reads, the admission webhook rewrites and `sealed pin` edits.

/// The name in `CSIDriver` objects and pod specs.
pub const DRIVER_NAME: &str = "csi.sealedvolumes.io";

/// The volume attribute that names the version to mount.
pub const DIGEST_ATTRIBUTE: &str = "digest";
/// With [`TAG_ATTRIBUTE`], names a version by a tag of a SealedVolume in the pod's namespace.
pub const VOLUME_ATTRIBUTE: &str = "volume";
/// The tag of [`VOLUME_ATTRIBUTE`] to mount.
pub const TAG_ATTRIBUTE: &str = "tag";
/// Set by the admission webhook when it pins a tag to a digest: `volume:tag`, so the pod
/// still says which tag it followed.
pub const FROM_TAG_ATTRIBUTE: &str = "fromTag";
/// What to prefetch on the version's mount: `none | model | all | GLOBS`.
pub const PREFETCH_ATTRIBUTE: &str = "prefetch";
/// `"false"` keeps the version's mount from replaying or recording a learned prefetch profile.
pub const LEARNED_PREFETCH_ATTRIBUTE: &str = "learnedPrefetch";
/// Set by kubelet on ephemeral inline volumes.
pub const EPHEMERAL_ATTRIBUTE: &str = "csi.storage.k8s.io/ephemeral";
