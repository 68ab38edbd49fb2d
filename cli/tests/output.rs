//! `-o json|yaml|wide`: the YAML document is the JSON one, and `wide` adds columns.

mod common;
use common::Env;

impl Env {
    fn ok(&self, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.run(args);
        assert!(ok, "sealed {args:?} failed: {stderr}");
        stdout
    }
}

#[test]
fn yaml_is_the_json_document_and_wide_adds_columns() {
    let env = Env::new();
    let d = env.path("model");
    std::fs::create_dir_all(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/w.bin"), b"weights").unwrap();
    std::os::unix::fs::symlink("sub/w.bin", d.join("link")).unwrap();
    let digest = env.ok(&["push", d.to_str().unwrap()]).trim().to_owned();

    for args in [&["ls"][..], &["inspect", &digest][..]] {
        let json: serde_json::Value =
            serde_json::from_str(&env.ok(&[args, &["-o", "json"]].concat())).unwrap();
        let yaml = env.ok(&[args, &["-o", "yaml"]].concat());
        assert!(
            !yaml.trim_start().starts_with(['{', '[']),
            "not YAML: {yaml}"
        );
        let from_yaml: serde_json::Value = serde_saphyr::from_str(&yaml).unwrap();
        assert_eq!(from_yaml, json, "{args:?}");
    }
    let json: serde_json::Value = serde_json::from_str(&env.ok(&["ls", "-o", "json"])).unwrap();
    assert_eq!(json[0]["directories"], 1);
    assert_eq!(json[0]["symlinks"], 1);
    assert_eq!(json[0]["unique_chunks"], 1);

    let text = env.ok(&["ls"]);
    let wide = env.ok(&["ls", "-o", "wide"]);
    assert!(!text.contains("UNIQUE") && wide.contains("UNIQUE") && wide.contains("LINKS"));
    let row = wide.lines().find(|l| l.starts_with(&digest)).unwrap();
    let cols: Vec<&str> = row.split_whitespace().collect();
    // DIGEST SIZE(2 words) FILES DIRS LINKS CHUNKS ...
    assert_eq!(&cols[3..6], ["1", "1", "1"], "{row}");

    let file_hash = blake3::hash(b"weights").to_hex().to_string();
    assert!(!env.ok(&["inspect", &digest]).contains(&file_hash));
    assert!(
        env.ok(&["inspect", &digest, "-o", "wide"])
            .contains(&file_hash)
    );

    env.ok(&["rm", &digest]);
    let trash = env.ok(&["trash", "ls", "-o", "wide"]);
    let row = trash.lines().find(|l| l.starts_with(&digest)).unwrap();
    assert!(row.contains("7 B") && row.contains("yes"), "{trash}");
}
