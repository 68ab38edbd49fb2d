//! A verified statement against a sealed manifest, without reading a byte of any file: the
//! manifest holds every file's BLAKE3, which is what a BLAKE3 statement signs. Statements over
//! another hash need that hash of each file from the caller ([`CheckOptions::digests`]).

use std::collections::{BTreeMap, HashMap};

use sealed_store::manifest::{EntryKind, Manifest};

use crate::bundle::{Resource, Statement, normalize_rel};
use crate::error::{Error, Problem, Result};
use crate::keys::SigningKey;

/// Where `model_signing` writes the signature, and the name ignored by default.
pub const DEFAULT_SIGNATURE_NAME: &str = "model.sig";
/// What `model_signing` leaves out by default besides the signature (`--ignore-git-paths`).
pub const GIT_PATHS: [&str; 4] = [".git", ".gitattributes", ".github", ".gitignore"];
/// Symlink hops followed inside a version before giving up (as the kernel's ELOOP).
const MAX_SYMLINK_HOPS: usize = 40;

#[derive(Clone, Debug, Default)]
pub struct CheckOptions {
    /// More paths (relative to the version's root, files or directories) to leave out, besides
    /// the statement's own `ignore_paths`; the signature file itself goes here.
    pub ignore_paths: Vec<String>,
    /// For a statement over another hash than BLAKE3: that digest of each file, by path.
    pub digests: Option<HashMap<String, Vec<u8>>>,
}

/// What a successful check established.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Checked {
    pub model_name: String,
    pub algorithm: String,
    /// Files signed and found with the signed digest.
    pub files: usize,
    /// Files of the version left out by an ignore path.
    pub ignored: Vec<String>,
}

/// A file a signature covers: its path, the file it is (itself, or a symlink's target) and
/// that file's BLAKE3.
type Covered = (String, String, [u8; 32]);

fn is_ignored(path: &str, ignore: &[String]) -> bool {
    ignore.iter().any(|i| {
        !i.is_empty()
            && (path == i
                || path
                    .strip_prefix(i.as_str())
                    .is_some_and(|rest| rest.starts_with('/')))
    })
}

/// The file a path leads to inside the version, following symlinks that stay inside it.
fn resolve<'m>(
    manifest: &'m HashMap<&str, &'m EntryKind>,
    path: &str,
) -> Option<(String, &'m EntryKind)> {
    let mut current = path.to_string();
    for _ in 0..MAX_SYMLINK_HOPS {
        let kind = *manifest.get(current.as_str())?;
        let EntryKind::Symlink { target } = kind else {
            return Some((current, kind));
        };
        if target.starts_with('/') {
            return None;
        }
        let mut parts: Vec<&str> = current.split('/').collect();
        parts.pop();
        for c in target.split('/') {
            match c {
                "" | "." => {}
                ".." => {
                    parts.pop()?;
                }
                c => parts.push(c),
            }
        }
        current = parts.join("/");
    }
    None
}

/// The files of the version a signature covers: every regular file (and, with
/// `allow_symlinks`, every symlink to one inside the version), less the ignored ones.
/// Returns them with the ignored paths.
fn covered_files(
    manifest: &Manifest,
    ignore: &[String],
    allow_symlinks: bool,
) -> Result<(Vec<Covered>, Vec<String>)> {
    let by_path: HashMap<&str, &EntryKind> = manifest
        .entries
        .iter()
        .map(|e| (e.path.as_str(), &e.kind))
        .collect();
    let mut files = Vec::new();
    let mut ignored = Vec::new();
    for entry in &manifest.entries {
        if matches!(entry.kind, EntryKind::Dir) {
            continue;
        }
        if is_ignored(&entry.path, ignore) {
            ignored.push(entry.path.clone());
            continue;
        }
        match &entry.kind {
            EntryKind::Dir => {}
            EntryKind::File(f) => {
                files.push((entry.path.clone(), entry.path.clone(), *f.blake3.as_bytes()))
            }
            EntryKind::Symlink { .. } => {
                if !allow_symlinks {
                    return Err(Error::Symlink {
                        path: entry.path.clone(),
                    });
                }
                match resolve(&by_path, &entry.path) {
                    Some((target, EntryKind::File(f))) => {
                        files.push((entry.path.clone(), target, *f.blake3.as_bytes()))
                    }
                    // model_signing hashes what a link leads to; a link to a directory or out of
                    // the version has no digest in the manifest.
                    _ => {
                        return Err(Error::Unsupported {
                            what: format!(
                                "symlink {} leads to a directory or out of the version; only \
                                 links to files inside it are checked",
                                entry.path
                            ),
                        });
                    }
                }
            }
        }
    }
    Ok((files, ignored))
}

/// Checks a verified statement against a sealed manifest: every signed file present with the
/// signed digest, and no file of the version left unsigned (besides ignored paths).
pub fn check_manifest(
    statement: &Statement,
    manifest: &Manifest,
    opts: &CheckOptions,
) -> Result<Checked> {
    if statement.method != "files" {
        return Err(Error::Unsupported {
            what: format!(
                "serialization method {:?}: only \"files\" (one digest per file) is checked; \
                 shard digests are not in a sealed manifest",
                statement.method
            ),
        });
    }
    let mut ignore = statement.ignore_paths.clone();
    ignore.extend(opts.ignore_paths.iter().map(|p| normalize_rel(p)));
    let (files, ignored) = covered_files(manifest, &ignore, statement.allow_symlinks)?;

    let mut signed: BTreeMap<&str, &Resource> = BTreeMap::new();
    for r in &statement.resources {
        if signed.insert(r.name.as_str(), r).is_some() {
            return Err(Error::Malformed {
                why: format!("the statement lists {:?} twice", r.name),
            });
        }
    }
    let algorithm = statement.hash_type.clone();
    let mut need_other = 0usize;
    for r in &statement.resources {
        match r.algorithm.as_str() {
            "blake3" => {}
            "sha256" | "blake2b" => need_other += 1,
            other => {
                return Err(Error::Unsupported {
                    what: format!("digest algorithm {other:?} of {:?}", r.name),
                });
            }
        }
    }
    if need_other > 0 && opts.digests.is_none() {
        let other = statement
            .resources
            .iter()
            .find(|r| r.algorithm != "blake3")
            .map_or(algorithm.clone(), |r| r.algorithm.clone());
        return Err(Error::NeedsDigests {
            algorithm: other,
            files: need_other,
        });
    }

    let mut problems = Vec::new();
    let mut matched = 0usize;
    let mut seen = std::collections::HashSet::new();
    for (path, target, b3) in &files {
        let Some(r) = signed.get(path.as_str()) else {
            problems.push(Problem::Added { path: path.clone() });
            continue;
        };
        seen.insert(path.as_str());
        let sealed: Option<Vec<u8>> = if r.algorithm == "blake3" {
            Some(b3.to_vec())
        } else {
            opts.digests
                .as_ref()
                .and_then(|d| d.get(target.as_str()).or_else(|| d.get(path.as_str())))
                .cloned()
        };
        let Some(sealed) = sealed else {
            return Err(Error::NeedsDigests {
                algorithm: r.algorithm.clone(),
                files: 1,
            });
        };
        if sealed == r.digest {
            matched += 1;
        } else {
            problems.push(Problem::Changed {
                path: path.clone(),
                algorithm: r.algorithm.clone(),
                signed: hex::encode(&r.digest),
                sealed: hex::encode(&sealed),
            });
        }
    }
    for name in signed.keys() {
        if !seen.contains(name) {
            problems.push(Problem::Removed {
                path: (*name).to_string(),
            });
        }
    }
    if problems.is_empty() {
        return Ok(Checked {
            model_name: statement.model_name.clone(),
            algorithm,
            files: matched,
            ignored,
        });
    }
    if matched == 0 && !statement.resources.is_empty() {
        return Err(Error::OtherModel {
            model: statement.model_name.clone(),
            signed: statement.resources.len(),
        });
    }
    problems.sort_by(|a, b| problem_path(a).cmp(problem_path(b)));
    Err(Error::Mismatch {
        model: statement.model_name.clone(),
        problems,
    })
}

fn problem_path(p: &Problem) -> &str {
    match p {
        Problem::Changed { path, .. } | Problem::Added { path } | Problem::Removed { path } => path,
    }
}

/// The statement `model_signing` would sign for this version with BLAKE3 (`hash_type
/// blake3`), from the manifest alone: every file not under `ignore_paths`, in the order
/// Python sorts paths (component by component).
pub fn statement_for(
    manifest: &Manifest,
    model_name: &str,
    ignore_paths: &[String],
) -> Result<Statement> {
    let ignore: Vec<String> = ignore_paths.iter().map(|p| normalize_rel(p)).collect();
    // Without allow_symlinks a version with a symlink is refused, as model_signing refuses it.
    let (mut files, _) = covered_files(manifest, &ignore, false)?;
    files.sort_by(|a, b| a.0.split('/').cmp(b.0.split('/')));
    Ok(Statement {
        model_name: model_name.to_string(),
        method: "files".into(),
        hash_type: "blake3".into(),
        allow_symlinks: false,
        ignore_paths: ignore,
        resources: files
            .into_iter()
            .map(|(path, _, b3)| Resource {
                name: path,
                algorithm: "blake3".into(),
                digest: b3.to_vec(),
            })
            .collect(),
    })
}

/// A `model_signing`-compatible key-mode signature (bundle JSON) of this version.
pub fn sign_manifest(
    manifest: &Manifest,
    model_name: &str,
    ignore_paths: &[String],
    key: &SigningKey,
) -> Result<Vec<u8>> {
    statement_for(manifest, model_name, ignore_paths)?.sign(key)
}
