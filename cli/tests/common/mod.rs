//! Shared by the CLI tests: a temporary directory with a `file://` store in it, and the real
//! `sealed` binary pointed at that store.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use assert_cmd::cargo::CommandCargoExt;

pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("store")).unwrap();
        Env { dir }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn store_url(&self) -> String {
        format!("file://{}", self.path("store").display())
    }

    /// `sealed` with this store and default logging.
    pub fn sealed(&self) -> Command {
        let mut c = Command::cargo_bin("sealed").unwrap();
        // The stat cache goes to this test's directory, not the user's.
        c.env("SEALED_STORE", self.store_url())
            .env("XDG_CACHE_HOME", self.path("cache"))
            .env_remove("SEALED_LOG");
        c
    }

    /// Runs `sealed ARGS`: success, stdout, stderr.
    pub fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.sealed().args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}
