//! `tree-b3 DIR [--sleep]`: prints `<blake3 hex>  <path>` for every regular file under DIR
//! (paths relative to DIR, sorted bytewise), then `TREE-B3-DONE`. With `--sleep` it then
//! keeps reading every file once a second and prints `read N ok TOTAL` (TOTAL: the BLAKE3 of
//! the sums text, each line ending in a newline) or `read N failed: ERR`, forever (a
//! long-running pod whose log says whether its volume still works, and which bytes it sees).
//!
//! Packed into an image by `tests/journey.rs` and run in pods that mount a sealed volume;
//! the sums are compared with each file's whole-content BLAKE3 in the version's manifest.

use std::io::Read;
use std::path::{Path, PathBuf};

fn files(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            files(root, &path, out)?;
        } else if kind.is_file() {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            out.push((rel.to_string_lossy().into_owned(), path));
        }
    }
    Ok(())
}

fn b3(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().to_hex().to_string())
}

fn sums(root: &Path) -> std::io::Result<Vec<String>> {
    let mut list = Vec::new();
    files(root, root, &mut list)?;
    list.sort();
    list.iter()
        .map(|(rel, path)| Ok(format!("{}  {rel}", b3(path)?)))
        .collect()
}

fn total(lines: &[String]) -> String {
    let mut text = String::new();
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: tree-b3 DIR [--sleep]");
        std::process::exit(2);
    };
    let sleep = args.next().as_deref() == Some("--sleep");
    let root = PathBuf::from(dir);
    match sums(&root) {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            println!("TREE-B3-DONE");
        }
        Err(e) => {
            println!("TREE-B3-ERROR: {e}");
            std::process::exit(1);
        }
    }
    if !sleep {
        return;
    }
    for i in 1u64.. {
        std::thread::sleep(std::time::Duration::from_secs(1));
        match sums(&root) {
            Ok(lines) => println!("read {i} ok {}", total(&lines)),
            Err(e) => println!("read {i} failed: {e}"),
        }
    }
}
