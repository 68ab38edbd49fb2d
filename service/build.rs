//! Records what built the binary, for the `*_build_info` metrics (`sealed_service::build`):
//! the compiler's version line. The git commit comes from `SEALED_GIT_COMMIT` (set by
//! `hack/images.sh`, the Dockerfile and the release workflow), read with `option_env!`, so a
//! local build does not rebuild every crate on each commit.

use std::process::Command;

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SEALED_RUSTC_VERSION={version}");
    println!("cargo:rerun-if-changed=build.rs");
}
