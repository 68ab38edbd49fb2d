//! Deterministic test data: the same bytes and trees on every run and machine.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// xorshift64: a specified generator, so trees (and test vectors) are the same everywhere.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A tree with every kind of entry the format supports.
pub fn rich_tree(root: &Path) {
    fs::create_dir_all(root.join("weights/shards")).unwrap();
    fs::create_dir_all(root.join("empty/nested-empty")).unwrap();
    fs::create_dir_all(root.join("a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p")).unwrap();
    fs::write(
        root.join("weights/shards/model-00001.safetensors"),
        pseudo_random(9 << 20, 1),
    )
    .unwrap();
    fs::write(
        root.join("weights/shards/model-00002.safetensors"),
        pseudo_random(3 << 20, 2),
    )
    .unwrap();
    fs::write(root.join("config.json"), b"{\"hidden\": 4096}\n").unwrap();
    fs::write(root.join("empty-file"), b"").unwrap();
    fs::write(
        root.join("a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/deep.txt"),
        b"deep\n",
    )
    .unwrap();
    fs::write(root.join("tokenizer-\u{00e9}\u{6f22}\u{1f600}.json"), b"{}").unwrap();
    fs::write(root.join("run.sh"), b"#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(root.join("run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink(
        "shards/model-00001.safetensors",
        root.join("weights/current"),
    )
    .unwrap();
    std::os::unix::fs::symlink("missing-target", root.join("dangling")).unwrap();
}

/// Compares two trees: same entries, bytes, executable bits and link targets.
pub fn assert_same_tree(a: &Path, b: &Path) {
    let list = |root: &Path| -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                let m = fs::symlink_metadata(&p).unwrap();
                let desc = if m.file_type().is_symlink() {
                    format!("link {}", fs::read_link(&p).unwrap().display())
                } else if m.is_dir() {
                    stack.push(p.clone());
                    "dir".into()
                } else {
                    format!(
                        "file {} exec={} {}",
                        m.len(),
                        m.permissions().mode() & 0o111 != 0,
                        blake3::hash(&fs::read(&p).unwrap()).to_hex()
                    )
                };
                out.push((rel, desc));
            }
        }
        out.sort();
        out
    };
    assert_eq!(list(a), list(b));
}

/// A model-shaped tree: nested directories, an empty file, a file over 8 MiB, one shorter than
/// the minimum chunk, JSON. (Sources carry no empty directories, symlinks or modes.)
pub fn model_tree(root: &Path) {
    fs::create_dir_all(root.join("weights")).unwrap();
    fs::create_dir_all(root.join("sub/dir")).unwrap();
    fs::write(root.join("config.json"), b"{\"hidden\": 4096}\n").unwrap();
    fs::write(root.join("tokenizer.json"), pseudo_random(300 << 10, 3)).unwrap();
    fs::write(root.join("empty.txt"), b"").unwrap();
    fs::write(root.join("tiny.bin"), pseudo_random(1000, 4)).unwrap();
    fs::write(
        root.join("weights/model-00001.safetensors"),
        pseudo_random(9 << 20, 1),
    )
    .unwrap();
    fs::write(
        root.join("weights/model-00002.safetensors"),
        pseudo_random(2 << 20, 2),
    )
    .unwrap();
    fs::write(root.join("sub/dir/deep.txt"), b"deep\n").unwrap();
}
