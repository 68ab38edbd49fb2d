//! What built this binary, for the `sealed_operator_build_info` and `sealed_csi_build_info`
//! gauges (always 1; the labels carry the facts, as Prometheus' own `build_info` does).

/// The facts of one build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuildInfo {
    /// The binary's package version (`CARGO_PKG_VERSION` of the binary crate).
    pub version: &'static str,
    /// The commit it was built from: `SEALED_GIT_COMMIT` at build time, else `unknown`.
    pub git_commit: &'static str,
    /// The compiler: `rustc 1.91.0 (f8297e351 2025-10-28)`.
    pub rustc: &'static str,
}

/// The label names of a `build_info` gauge, in the order of [`BuildInfo::label_values`].
pub const LABELS: [&str; 3] = ["version", "git_commit", "rustc"];

impl BuildInfo {
    /// This build, with the version of the binary crate: `BuildInfo::of(env!("CARGO_PKG_VERSION"))`.
    pub const fn of(version: &'static str) -> BuildInfo {
        BuildInfo {
            version,
            git_commit: match option_env!("SEALED_GIT_COMMIT") {
                Some(c) => c,
                None => "unknown",
            },
            rustc: env!("SEALED_RUSTC_VERSION"),
        }
    }

    /// The values of [`LABELS`].
    pub fn label_values(&self) -> [&'static str; 3] {
        [self.version, self.git_commit, self.rustc]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compiler_is_known_at_build_time() {
        let info = BuildInfo::of("1.2.3");
        assert!(info.rustc.starts_with("rustc "), "{info:?}");
        assert_eq!(info.label_values()[0], "1.2.3");
        assert!(!info.git_commit.is_empty());
    }
}
