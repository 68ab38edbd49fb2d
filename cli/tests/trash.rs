//! `sealed rm`, `sealed restore`, `sealed trash ls` and `sealed gc` as users meet them, on a
//! local directory store.

mod common;
use common::Env;

impl Env {
    fn ok(&self, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.run(args);
        assert!(ok, "sealed {args:?} failed: {stderr}");
        stdout
    }
    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.ok(&all);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }
    fn fails(&self, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.run(args);
        assert!(!ok, "sealed {args:?} succeeded: {stdout}");
        assert!(stdout.is_empty(), "stdout on failure: {stdout}");
        stderr
    }
    /// Pushes a tree of (name, byte, len) files; returns the digest.
    fn push(&self, name: &str, files: &[(&str, u8, usize)]) -> String {
        let d = self.path(name);
        std::fs::create_dir_all(&d).unwrap();
        for (f, byte, len) in files {
            let data: Vec<u8> = (0..*len)
                .map(|i| byte.wrapping_add((i % 251) as u8))
                .collect();
            std::fs::write(d.join(f), data).unwrap();
        }
        self.ok(&["push", d.to_str().unwrap()]).trim().to_owned()
    }
    fn chunk_files(&self) -> usize {
        let mut n = 0;
        if let Ok(dirs) = std::fs::read_dir(self.path("store/chunks")) {
            for d in dirs {
                n += std::fs::read_dir(d.unwrap().path()).unwrap().count();
            }
        }
        n
    }
}

#[test]
fn rm_restore_and_trash_ls() {
    let env = Env::new();
    let digest = env.push("a", &[("w.bin", 1, 100_000)]);

    let out = env.ok(&["rm", &digest]);
    assert!(out.contains(&format!("deleted {digest}")), "{out}");
    assert!(out.contains("restorable until"), "{out}");
    let ls = env.json(&["ls"]);
    assert_eq!(ls.as_array().unwrap().len(), 0, "{ls}");
    let err = env.fails(&["verify", &digest]);
    assert!(err.contains("not found"), "{err}");

    let trash = env.json(&["trash", "ls"]);
    assert_eq!(trash[0]["digest"], digest.as_str());
    assert_eq!(trash[0]["restorable"], true);
    let text = env.ok(&["trash", "ls"]);
    assert!(text.contains(&digest), "{text}");

    // Deleting again is fine; the record is the same.
    let again = env.json(&["rm", &digest]);
    assert_eq!(again["digest"], digest.as_str());

    let restored = env.json(&["restore", &digest]);
    assert_eq!(restored["restored"], true);
    env.ok(&["verify", &digest]);
    assert_eq!(env.json(&["trash", "ls"]).as_array().unwrap().len(), 0);
    let out = env.ok(&["restore", &digest]);
    assert!(out.contains("nothing to restore"), "{out}");
}

#[test]
fn retention_and_durations() {
    let env = Env::new();
    let digest = env.push("a", &[("w.bin", 2, 10_000)]);
    let rec = env.json(&["rm", &digest, "--retention", "2h"]);
    let deleted = rec["deleted_at"].as_str().unwrap();
    let until = rec["restorable_until"].as_str().unwrap();
    assert!(until > deleted, "{rec}");

    let err = env.fails(&["rm", &digest, "--retention", "two days"]);
    assert!(err.contains("invalid duration 'two days'"), "{err}");
    let err = env.fails(&["gc", "--grace=-1h"]);
    assert!(err.contains("invalid duration"), "{err}");
}

#[test]
fn gc_reclaims_expired_trash_but_keeps_shared_chunks() {
    let env = Env::new();
    let a = env.push("a", &[("shared.bin", 3, 50_000), ("a.bin", 4, 60_000)]);
    let b = env.push("b", &[("shared.bin", 3, 50_000), ("b.bin", 5, 70_000)]);
    assert_eq!(env.chunk_files(), 3);

    // A restorable version keeps its chunks through a collection.
    env.ok(&["rm", &a]);
    let report = env.json(&["gc", "--grace", "0"]);
    assert_eq!(report["chunks_deleted"], 0, "{report}");
    assert_eq!(env.chunk_files(), 3);

    // With no retention it goes at the next collection; a dry run only says so.
    env.ok(&["restore", &a]);
    env.ok(&["rm", &a, "--retention", "0"]);
    let dry = env.json(&["gc", "--dry-run", "--grace", "0"]);
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["trash_expired"], 1, "{dry}");
    assert_eq!(dry["chunks_deleted"], 1, "{dry}");
    assert_eq!(dry["bytes_freed"], 60_000);
    assert_eq!(env.chunk_files(), 3, "a dry run deleted chunks");
    let text = env.ok(&["gc", "--dry-run", "--grace", "0"]);
    assert!(
        text.contains("would delete 1 expired trash entry, 1 chunks"),
        "{text}"
    );

    // The default grace keeps young chunks.
    let report = env.json(&["gc"]);
    assert_eq!(report["trash_expired"], 1, "{report}");
    assert_eq!(report["chunks_deleted"], 0, "{report}");
    assert_eq!(report["chunks_in_grace"], 1, "{report}");

    let text = env.ok(&["gc", "--grace", "0"]);
    assert!(
        text.contains("deleted 0 expired trash entries, 1 chunks"),
        "{text}"
    );
    assert_eq!(env.chunk_files(), 2);
    env.ok(&["verify", &b]);

    let err = env.fails(&["restore", &a]);
    assert!(err.contains("reclaimed"), "{err}");
    assert!(err.contains(&a), "{err}");
}

#[test]
fn clear_errors() {
    let env = Env::new();
    let unknown = format!("blake3:{}", "ab".repeat(32));
    let err = env.fails(&["rm", &unknown]);
    assert!(err.contains("not found") && err.contains(&unknown), "{err}");
    let err = env.fails(&["rm", "blake3:nothex"]);
    assert!(err.contains("malformed digest"), "{err}");
    let err = env.fails(&["restore", &unknown]);
    assert!(err.contains("reclaimed"), "{err}");

    // A collection that is running (its marker live) is named, and not trampled.
    std::fs::create_dir_all(env.path("store/gc")).unwrap();
    let marker = serde_json::json!({
        "id": "f".repeat(32), "host": "gc-host", "pid": 7,
        "started_at": "2099-01-01T00:00:00Z", "expires_at": "2099-01-01T00:10:00Z",
    });
    std::fs::write(env.path("store/gc/running"), marker.to_string()).unwrap();
    let err = env.fails(&["gc"]);
    assert!(
        err.contains("another garbage collection") && err.contains("gc-host"),
        "{err}"
    );
}

#[test]
fn rm_of_one_volume_removes_only_its_reference() {
    let env = Env::new();
    let src = env.path("shared");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("w.bin"), vec![7u8; 300_000]).unwrap();
    let dir = src.to_str().unwrap();
    let a = env
        .ok(&["push", dir, "--volume", "team-a/m"])
        .trim()
        .to_owned();
    let b = env
        .ok(&["push", dir, "--volume", "team-b/m"])
        .trim()
        .to_owned();
    let c = env
        .ok(&["push", dir, "--volume", "team-c/m"])
        .trim()
        .to_owned();
    assert!(a == b && b == c, "{a} {b} {c}");

    // One volume's reference: the version stays live for the others.
    let out = env.json(&["rm", &a, "--volume", "team-a/m", "--retention", "0"]);
    assert_eq!(out["trashed"], false, "{out}");
    assert_eq!(out["volume"], "team-a/m", "{out}");
    assert_eq!(
        out["still_referenced_by"],
        serde_json::json!(["team-b/m", "team-c/m"])
    );
    env.ok(&["verify", &a]);
    let text = env.ok(&["rm", &a, "--volume", "team-b/m"]);
    assert!(text.contains("removed team-b/m's reference"), "{text}");
    assert!(
        text.contains("stays live: still referenced by team-c/m"),
        "{text}"
    );

    // The admin's rm removes the rest and says how many.
    let out = env.json(&["rm", &a, "--retention", "2h"]);
    assert_eq!(out["trashed"], true, "{out}");
    assert_eq!(out["references_removed"], serde_json::json!(["team-c/m"]));
    assert!(out["restorable_until"].is_string(), "{out}");
    let err = env.fails(&["verify", &a]);
    assert!(err.contains("not found"), "{err}");
}
