//! Short digests: `blake3:8f3a1c2d` (at least 8 hex digits) wherever a command takes a
//! version, when exactly one version (in the trash, for restore) starts with it.

mod common;
use common::Env;

impl Env {
    fn ok(&self, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.run(args);
        assert!(ok, "sealed {args:?} failed: {stderr}");
        stdout
    }
    fn push_tree(&self, name: &str, content: &[u8]) -> String {
        let d = self.path(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("f.bin"), content).unwrap();
        self.ok(&["push", d.to_str().unwrap()]).trim().to_owned()
    }
    fn code(&self, args: &[&str]) -> (Option<i32>, String) {
        let out = self.sealed().args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn short(digest: &str) -> &str {
    &digest[.."blake3:".len() + 8]
}

#[test]
fn a_unique_prefix_names_its_version_everywhere() {
    let env = Env::new();
    let a = env.push_tree("a", b"first");
    let b = env.push_tree("b", b"second");
    let (sa, sb) = (short(&a), short(&b));

    let v: serde_json::Value =
        serde_json::from_str(&env.ok(&["inspect", sa, "-o", "json"])).unwrap();
    assert_eq!(v["digest"], a);
    // Bare hex, as pasted from elsewhere, works too.
    let v: serde_json::Value =
        serde_json::from_str(&env.ok(&["inspect", &sa["blake3:".len()..], "-o", "json"])).unwrap();
    assert_eq!(v["digest"], a);
    assert!(env.ok(&["verify", sb]).contains(&b));
    let diff: serde_json::Value =
        serde_json::from_str(&env.ok(&["diff", sa, sb, "-o", "json"])).unwrap();
    assert_eq!(diff["changed"][0]["path"], "f.bin");
    let out = env.path("out");
    env.ok(&["pull", sa, out.to_str().unwrap()]);
    assert_eq!(std::fs::read(out.join("f.bin")).unwrap(), b"first");

    // rm by prefix; then restore finds it by prefix in the trash (no longer among the live).
    assert!(env.ok(&["rm", sa]).contains(&a));
    let (code, err) = env.code(&["inspect", sa]);
    assert_eq!(code, Some(4), "{err}");
    assert!(env.ok(&["restore", sa]).contains(&format!("restored {a}")));
    let (code, err) = env.code(&["restore", sb]);
    assert_eq!(code, Some(4), "b is not in the trash: {err}");
    assert!(err.contains("in the trash"), "{err}");
}

#[test]
fn unknown_ambiguous_and_too_short_prefixes_are_refused() {
    let env = Env::new();
    env.push_tree("a", b"x");
    // No version starts with it: not found (exit 4).
    let (code, err) = env.code(&["inspect", "blake3:00000000"]);
    assert_eq!(code, Some(4), "{err}");
    assert!(
        err.contains("no version") && err.contains("blake3:00000000"),
        "{err}"
    );

    // Two versions sharing 8 digits (forged names: the listing is all that is consulted).
    let manifests = env.path("store/manifests");
    let one = format!("abcdef01{}", "1".repeat(56));
    let two = format!("abcdef01{}", "2".repeat(56));
    for name in [&one, &two] {
        std::fs::write(manifests.join(name), b"x").unwrap();
    }
    let (code, err) = env.code(&["verify", "blake3:abcdef01"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("ambiguous"), "{err}");
    assert!(
        err.contains(&format!("blake3:{one}")) && err.contains(&format!("blake3:{two}")),
        "{err}"
    );
    // One more digit settles it: the command then reads that version (garbage here: corrupt).
    let (code, err) = env.code(&["inspect", "blake3:abcdef011"]);
    assert_eq!(code, Some(3), "{err}");
    assert!(err.contains(&one), "{err}");

    // Under 8 digits is not a digest at all: a usage error.
    let (code, err) = env.code(&["inspect", "blake3:abcdef0"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("at least 8 hex digits"), "{err}");
}
