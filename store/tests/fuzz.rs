//! Fuzzing with proptest: the parsers of untrusted input never panic, what they accept is
//! canonical, and symlink resolution never lets an accepted tree lead out of itself.
//!
//! - `Manifest::parse` on arbitrary bytes, on bytes after a valid header, and on valid
//!   manifests mutated (bytes flipped, inserted, removed, truncated): never a panic; accepted
//!   ⇒ the manifest re-encodes to exactly those bytes (so to the same digest).
//! - `Digest::parse` on arbitrary and nearly valid text: never a panic; accepted ⇒ the digest
//!   prints back as the input (with the `blake3:` prefix).
//! - random trees of directories, files and symlinks (targets drawn from `..`, `.`, names that
//!   exist and names that do not): validate accepts ⇔ a simple reference resolver (one
//!   component at a time, links followed, at most 40) finds no link that leaves the tree or
//!   loops; and for accepted trees, the kernel itself (`openat2` with `RESOLVE_BENEATH`, on
//!   the tree written to disk) never resolves a link to outside it.
//!
//! Case counts are proptest's defaults (256) so CI stays quick; for a longer run set
//! `PROPTEST_CASES`, e.g. `PROPTEST_CASES=100000 cargo test -p sealed-store --test fuzz`.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use proptest::prelude::*;
use sealed_store::manifest::{MAX_LINK_HOPS, resolve_symlinks, validate_symlink_target};
use sealed_store::{ChunkParams, ChunkRef, Digest, Entry, EntryKind, FileEntry, Manifest};

// ---------------------------------------------------------------------------------------
// Trees

#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    Dir,
    File,
    Link(String),
}

const NAMES: &[&str] = &["a", "b", "up", "l"];

/// A random tree: paths of up to three components from a small alphabet (so links often
/// name each other), every parent a directory, each leaf a directory, a file or a link.
fn arb_tree() -> impl Strategy<Value = BTreeMap<String, Kind>> {
    let name = prop::sample::select(NAMES);
    let path = prop::collection::vec(name, 1..4).prop_map(|c| c.join("/"));
    let component = prop::sample::select(&["..", "..", ".", "a", "b", "up", "l", "missing"][..]);
    let target =
        (prop::collection::vec(component, 1..6), any::<bool>()).prop_map(|(parts, trailing)| {
            let mut t = parts.join("/");
            if trailing {
                t.push('/');
            }
            t
        });
    let kind = prop_oneof![
        1 => Just(Kind::Dir),
        1 => Just(Kind::File),
        3 => target.prop_map(Kind::Link),
    ];
    prop::collection::vec((path, kind), 0..14).prop_map(|items| {
        let mut tree: BTreeMap<String, Kind> = BTreeMap::new();
        for (path, kind) in items {
            // Every ancestor must be (or become) a directory; skip paths under a non-dir.
            let parts: Vec<&str> = path.split('/').collect();
            let mut ok = true;
            for i in 1..parts.len() {
                let ancestor = parts[..i].join("/");
                match tree.get(&ancestor) {
                    None | Some(Kind::Dir) => {}
                    _ => ok = false,
                }
            }
            if !ok || tree.contains_key(&path) {
                continue;
            }
            for i in 1..parts.len() {
                tree.insert(parts[..i].join("/"), Kind::Dir);
            }
            tree.insert(path, kind);
        }
        tree
    })
}

fn to_manifest(tree: &BTreeMap<String, Kind>) -> Manifest {
    let mut entries: Vec<Entry> = tree
        .iter()
        .map(|(path, kind)| Entry {
            path: path.clone(),
            kind: match kind {
                Kind::Dir => EntryKind::Dir,
                Kind::File => EntryKind::File(FileEntry {
                    executable: false,
                    size: 1,
                    blake3: Digest::of(b"x"),
                    chunks: vec![ChunkRef {
                        digest: Digest::of(b"x"),
                        len: 1,
                    }],
                }),
                Kind::Link(t) => EntryKind::Symlink { target: t.clone() },
            },
        })
        .collect();
    entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    Manifest {
        chunking: ChunkParams::default(),
        entries,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Inside,
    Escapes,
    Loops,
}

/// The reference resolver: the kernel's walk written plainly (a stack of components still
/// to walk, the resolved position so far), without memoisation. Names that do not exist, or
/// are below a file, are kept as plain names (conservatively: they may be created later), so
/// that `..` after them is still counted against the root.
fn reference(tree: &BTreeMap<String, Kind>, link: &str) -> Outcome {
    let Some(Kind::Link(target)) = tree.get(link) else {
        return Outcome::Inside;
    };
    let mut pos: Vec<String> = link.split('/').map(str::to_owned).collect();
    pos.pop();
    let mut todo: Vec<String> = target.rsplit('/').map(str::to_owned).collect();
    let mut hops: u32 = 1;
    while let Some(c) = todo.pop() {
        match c.as_str() {
            "" | "." => {}
            ".." => {
                if pos.pop().is_none() {
                    return Outcome::Escapes;
                }
            }
            _ => {
                pos.push(c);
                if let Some(Kind::Link(t)) = tree.get(&pos.join("/")) {
                    hops += 1;
                    if hops > MAX_LINK_HOPS {
                        return Outcome::Loops;
                    }
                    pos.pop();
                    todo.extend(t.rsplit('/').map(str::to_owned));
                }
            }
        }
    }
    Outcome::Inside
}

/// `tree` without the links [`Manifest::validate`] refuses: lexically bad ones first, then
/// those [`resolve_symlinks`] names, one at a time (removing one can make others fine).
fn accepted_part(mut tree: BTreeMap<String, Kind>) -> BTreeMap<String, Kind> {
    tree.retain(|p, k| match k {
        Kind::Link(t) => validate_symlink_target(p, t).is_ok(),
        _ => true,
    });
    while let Err(e) = resolve_symlinks(&to_manifest(&tree).entries) {
        assert!(tree.remove(&e.link).is_some(), "{e} names no entry");
    }
    tree
}

/// Writes the tree under `root` (files empty, links as links).
fn materialise(root: &Path, tree: &BTreeMap<String, Kind>) {
    for (path, kind) in tree {
        let p = root.join(path);
        match kind {
            Kind::Dir => std::fs::create_dir(&p).unwrap(),
            Kind::File => std::fs::write(&p, b"x").unwrap(),
            Kind::Link(t) => std::os::unix::fs::symlink(t, &p).unwrap(),
        }
    }
}

/// The kernel's verdict on resolving `rel` beneath `root`: `Err(errno)` or Ok.
fn kernel_resolve_beneath(root: &OwnedFd, rel: &str) -> Result<(), i32> {
    let path = CString::new(rel).unwrap();
    // SAFETY: open_how is plain data; zeroed is a valid value, then the fields are set.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: a valid directory fd, a NUL-terminated path and a properly sized open_how.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    Ok(())
}

proptest! {
    #[test]
    fn symlink_resolution_agrees_with_the_reference(tree in arb_tree()) {
        let m = to_manifest(&tree);
        let verdict = m.validate();
        let lexical_ok = tree.iter().all(|(p, k)| match k {
            Kind::Link(t) => validate_symlink_target(p, t).is_ok(),
            _ => true,
        });
        let bad: Vec<(&String, Outcome)> = tree
            .keys()
            .map(|p| (p, reference(&tree, p)))
            .filter(|(_, o)| *o != Outcome::Inside)
            .collect();
        match &verdict {
            Ok(()) => {
                prop_assert!(lexical_ok);
                prop_assert!(bad.is_empty(), "accepted, but the reference finds {:?}", bad);
            }
            Err(e) => {
                prop_assert!(!lexical_ok || !bad.is_empty(), "refused ({}), but every link resolves inside", e);
                let msg = e.to_string();
                prop_assert!(msg.contains("symlink '"), "{}", msg);
            }
        }
        // Whatever validate says, the encoding refuses what validate refuses.
        prop_assert_eq!(verdict.is_ok(), m.encode().is_ok());
    }

    #[test]
    fn the_kernel_never_resolves_an_accepted_link_out_of_the_tree(tree in arb_tree()) {
        // Make the tree acceptable by dropping the links refused (one at a time, as named by
        // the error), so that every case tests something.
        let tree = accepted_part(tree);
        let m = to_manifest(&tree);
        prop_assert!(m.validate().is_ok());
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        materialise(&root, &tree);
        let dir = std::fs::File::open(&root).unwrap();
        let dir = OwnedFd::from(dir);
        for (path, kind) in &tree {
            if !matches!(kind, Kind::Link(_)) {
                continue;
            }
            // The link itself, and names below it (as a reader would walk into it).
            for rel in [path.clone(), format!("{path}/a"), format!("{path}/.."), format!("{path}/up/..")] {
                match kernel_resolve_beneath(&dir, &rel) {
                    Err(libc::EXDEV) => {
                        // `..` typed by the reader after the link is the reader's own walk;
                        // only the links' own resolution must stay inside.
                        prop_assert!(
                            rel != *path && rel != format!("{path}/a"),
                            "{} resolves out of the tree (manifest accepted)", rel
                        );
                    }
                    Err(libc::ELOOP) => prop_assert!(rel != *path, "{}: kernel loops (accepted)", rel),
                    _ => {}
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Manifest bytes

fn arb_valid_manifest() -> impl Strategy<Value = Manifest> {
    (
        arb_tree(),
        prop::collection::vec((any::<[u8; 32]>(), 1u32..=(4 << 20)), 0..4),
        any::<bool>(),
    )
        .prop_map(|(tree, chunks, exec)| {
            let mut m = to_manifest(&tree);
            let chunks: Vec<ChunkRef> = chunks
                .into_iter()
                .map(|(d, len)| ChunkRef {
                    digest: Digest::from_bytes(d),
                    len,
                })
                .collect();
            for e in &mut m.entries {
                if let EntryKind::File(f) = &mut e.kind {
                    f.executable = exec;
                    f.chunks = chunks.clone();
                    f.size = chunks.iter().map(|c| u64::from(c.len)).sum();
                }
            }
            m
        })
        .prop_filter("valid", |m| m.validate().is_ok())
}

#[derive(Clone, Debug)]
enum Mutation {
    Set(usize, u8),
    Xor(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
    /// A little-endian u16/u32/u64 written over the bytes at an offset: lengths and counts.
    Number(usize, u64, u8),
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    let big = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::from(u32::MAX)),
        Just(4096),
        Just(4097),
        any::<u64>()
    ];
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        (any::<usize>(), 1u8..).prop_map(|(i, v)| Mutation::Xor(i, v)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..40).prop_map(|(i, n)| Mutation::Remove(i, n)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), big, prop::sample::select(&[2u8, 4, 8][..]))
            .prop_map(|(i, v, w)| Mutation::Number(i, v, w)),
    ]
}

fn mutate(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    let at = |i: usize| i % bytes.len();
    match m {
        Mutation::Set(i, v) => {
            let i = at(*i);
            bytes[i] = *v;
        }
        Mutation::Xor(i, v) => {
            let i = at(*i);
            bytes[i] ^= *v;
        }
        Mutation::Insert(i, v) => {
            let i = at(*i);
            bytes.splice(i..i, v.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let i = at(*i);
            let end = (i + n).min(bytes.len());
            bytes.drain(i..end);
        }
        Mutation::Truncate(i) => {
            let i = at(*i);
            bytes.truncate(i);
        }
        Mutation::Number(i, v, w) => {
            let w = usize::from(*w);
            if bytes.len() >= w {
                let i = *i % (bytes.len() - w + 1);
                bytes[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
        }
    }
}

/// Accepted bytes are canonical: they re-encode to themselves, so to the same digest.
fn check_parse(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(m) = Manifest::parse(bytes) {
        let again = m
            .encode()
            .map_err(|e| TestCaseError::fail(format!("parsed but does not encode: {e}")))?;
        prop_assert_eq!(&again[..], bytes);
        let (sealed, digest) = m.seal().unwrap();
        prop_assert_eq!(&sealed[..], bytes);
        prop_assert_eq!(digest, Digest::of(bytes));
    }
    Ok(())
}

/// The bytes of a valid header with no entries yet (count 0), to prefix random tails.
fn header() -> Vec<u8> {
    let m = Manifest {
        chunking: ChunkParams::default(),
        entries: vec![],
    };
    let mut b = m.encode().unwrap();
    b.truncate(b.len() - 8);
    b
}

proptest! {
    #[test]
    fn parse_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        check_parse(&bytes)?;
    }

    #[test]
    fn parse_never_panics_after_a_valid_header(
        count in prop_oneof![0u64..4, Just(u64::MAX), any::<u64>()],
        tail in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = header();
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&tail);
        check_parse(&bytes)?;
    }

    #[test]
    fn valid_manifests_round_trip(m in arb_valid_manifest()) {
        let (bytes, digest) = m.seal().unwrap();
        let back = Manifest::parse(&bytes).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(back.seal().unwrap(), (bytes, digest));
    }

    #[test]
    fn mutated_manifests_never_panic_and_accepted_ones_are_canonical(
        m in arb_valid_manifest(),
        mutations in prop::collection::vec(arb_mutation(), 1..4),
    ) {
        let mut bytes = m.encode().unwrap();
        for mutation in &mutations {
            mutate(&mut bytes, mutation);
        }
        check_parse(&bytes)?;
    }

    #[test]
    fn digest_parse_never_panics(text in "\\PC{0,80}") {
        if let Ok(d) = Digest::parse(&text) {
            let hex = text.strip_prefix("blake3:").unwrap_or(&text);
            prop_assert_eq!(d.to_string(), format!("blake3:{hex}"));
            prop_assert_eq!(d.hex(), hex);
        }
    }

    #[test]
    fn digest_parse_accepts_exactly_lowercase_hex(
        prefix in prop::sample::select(&["", "blake3:", "BLAKE3:", "sha256:", "blake3"][..]),
        body in "[0-9a-fA-Fg]{62,66}",
    ) {
        let text = format!("{prefix}{body}");
        let valid = (prefix.is_empty() || prefix == "blake3:")
            && body.len() == 64
            && body.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        match Digest::parse(&text) {
            Ok(d) => {
                prop_assert!(valid, "{} accepted", text);
                prop_assert_eq!(d.hex(), body);
            }
            Err(e) => {
                prop_assert!(!valid, "{} refused", text);
                prop_assert!(e.to_string().contains("malformed digest"));
            }
        }
    }
}
