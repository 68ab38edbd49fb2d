//! `sealed pin FILE|DIR`: rewrite the `volume` + `tag` references of CSI inline volumes in
//! Kubernetes manifests to the digest each tag names now, so a Git repository pins bytes;
//! `sealed pin --check` changes nothing and fails while any reference floats (for CI).
//!
//! The YAML is parsed to find the references (and where they are), the two attribute
//! entries are edited in the text (comments, order and quoting elsewhere stay as they were),
//! and the result is parsed again: it must be the original with exactly those attributes
//! changed, or the file is left alone with an error. Every tag is resolved before any file
//! is written, so a tag that does not resolve changes nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Args;
use kube::{Api, Client};
use sealed_crds::SealedVolume;
use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use crate::context::Context;
use crate::errors::NotFoundError;
use crate::output::print_json;

/// The CSI driver's name (`csi-driver/src/identity.rs`) and its volume attributes
/// (`csi-driver/src/node.rs`, `version_from_context`): `digest`, or `volume` + `tag`.
const DRIVER: &str = "csi.sealedvolumes.io";
const DIGEST: &str = "digest";
const VOLUME: &str = "volume";
const TAG: &str = "tag";
/// Bounds on what is read: a manifest is small, a repository has a few thousand.
const MAX_FILE_BYTES: u64 = 16 << 20;
const MAX_FILES: usize = 100_000;

#[derive(Args, Debug)]
pub struct PinArgs {
    /// Manifests: YAML files, or directories searched for *.yaml and *.yml (symlinks and
    /// hidden directories are skipped)
    #[arg(required = true, value_name = "FILE|DIR")]
    pub paths: Vec<PathBuf>,
    /// Change nothing; list every reference by volume + tag and exit 1 if there is one
    /// (needs no cluster)
    #[arg(long)]
    pub check: bool,
    /// kubectl's --kubeconfig, --context and -n (the namespace of manifests that name none)
    #[command(flatten)]
    pub kube: crate::kube_args::KubeArgs,
}

/// One `volumeAttributes: {volume, tag}` of a CSI inline volume of our driver.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Reference {
    file: PathBuf,
    line: u64,
    /// `metadata.namespace` of its document, if it names one.
    #[serde(skip)]
    doc_namespace: Option<String>,
    namespace: Option<String>,
    volume: String,
    tag: String,
    digest: Option<String>,
    /// Which document of the file, and the JSON pointer of its `volumeAttributes`.
    #[serde(skip)]
    doc: usize,
    #[serde(skip)]
    pointer: String,
    #[serde(skip)]
    volume_at: (u64, u64),
    #[serde(skip)]
    tag_at: (u64, u64),
}

pub async fn run(ctx: &Context, args: PinArgs) -> anyhow::Result<ExitCode> {
    let files = manifest_files(&args.paths)?;
    let mut texts = Vec::with_capacity(files.len());
    let mut refs = Vec::new();
    for (file, explicit) in &files {
        let text = match read_manifest(file) {
            Ok(t) => t,
            Err(e) if !*explicit => {
                eprintln!("warning: skipped {}: {e:#}", file.display());
                continue;
            }
            Err(e) => return Err(e),
        };
        match find_references(file, &text) {
            Ok(found) => {
                if !found.is_empty() {
                    refs.extend(found);
                    texts.push((file.clone(), text));
                }
            }
            // A Helm template or another YAML-like file in a directory: not a manifest.
            Err(e) if !*explicit => eprintln!("warning: skipped {}: {e:#}", file.display()),
            Err(e) => return Err(e),
        }
    }

    if args.check {
        return check(ctx, &files, &refs);
    }
    if refs.is_empty() {
        eprintln!(
            "no reference by volume + tag in {} file(s): nothing to pin",
            files.len()
        );
        return finish(ctx, &refs);
    }
    let (client, fallback) = args.kube.client().await?;
    for r in &mut refs {
        r.namespace = Some(r.doc_namespace.clone().unwrap_or_else(|| fallback.clone()));
    }
    resolve(&client, &mut refs).await?;

    // Every new text is made and checked before the first file is written.
    let mut rewritten = Vec::with_capacity(texts.len());
    for (file, text) in &texts {
        let mine: Vec<&Reference> = refs.iter().filter(|r| &r.file == file).collect();
        let new = rewrite(text, &mine)
            .with_context(|| format!("cannot pin {} safely; pin it by hand", file.display()))?;
        rewritten.push((file, new));
    }
    for (file, new) in rewritten {
        write_atomically(file, &new)?;
    }
    if !ctx.json() {
        for r in &refs {
            eprintln!(
                "{}:{}: {}/{} tag {} -> {}",
                r.file.display(),
                r.line,
                r.namespace.as_deref().unwrap_or_default(),
                r.volume,
                r.tag,
                r.digest.as_deref().unwrap_or_default()
            );
        }
        eprintln!(
            "pinned {} reference(s) in {} file(s)",
            refs.len(),
            texts.len()
        );
    }
    finish(ctx, &refs)
}

fn finish(ctx: &Context, refs: &[Reference]) -> anyhow::Result<ExitCode> {
    if ctx.json() {
        print_json(&refs)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `--check`: every reference by tag floats; exit 1 when there is one.
fn check(ctx: &Context, files: &[(PathBuf, bool)], refs: &[Reference]) -> anyhow::Result<ExitCode> {
    if ctx.json() {
        print_json(&refs)?;
    } else {
        for r in refs {
            println!(
                "{}:{}: volume {} tag {} floats (`sealed pin` pins it to the digest)",
                r.file.display(),
                r.line,
                r.volume,
                r.tag
            );
        }
        if refs.is_empty() {
            eprintln!(
                "every reference is pinned by digest ({} file(s))",
                files.len()
            );
        } else {
            eprintln!(
                "{} floating reference(s): run `sealed pin` on these files and commit the result",
                refs.len()
            );
        }
    }
    Ok(if refs.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The files to look at, each with whether it was named on the command line (an error in a
/// named file is fatal; one in a file found in a directory is a warning).
fn manifest_files(paths: &[PathBuf]) -> anyhow::Result<Vec<(PathBuf, bool)>> {
    let mut files = Vec::new();
    for path in paths {
        let meta =
            std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
        if !meta.is_dir() {
            files.push((path.clone(), true));
            continue;
        }
        let mut dirs = vec![path.clone()];
        while let Some(dir) = dirs.pop() {
            let mut entries: Vec<_> = std::fs::read_dir(&dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .collect::<Result<_, _>>()
                .with_context(|| format!("cannot list {}", dir.display()))?;
            entries.sort_by_key(|e| e.file_name());
            for entry in entries {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                let kind = entry
                    .file_type()
                    .with_context(|| format!("cannot stat {}", entry.path().display()))?;
                if kind.is_dir() && !name.starts_with('.') {
                    dirs.push(entry.path());
                } else if kind.is_file() && (name.ends_with(".yaml") || name.ends_with(".yml")) {
                    files.push((entry.path(), false));
                }
                if files.len() > MAX_FILES {
                    bail!(
                        "more than {MAX_FILES} YAML files under {}: name the directories that hold manifests",
                        path.display()
                    );
                }
            }
        }
    }
    Ok(files)
}

fn read_manifest(file: &Path) -> anyhow::Result<String> {
    let meta =
        std::fs::metadata(file).with_context(|| format!("cannot read {}", file.display()))?;
    if meta.len() > MAX_FILE_BYTES {
        bail!(
            "{} is {} bytes, more than a manifest ({MAX_FILE_BYTES} at most)",
            file.display(),
            meta.len()
        );
    }
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", file.display()))
}

/// A YAML node with the location of each value, as far as finding references needs.
#[derive(Debug)]
enum Node {
    Map(Vec<(Option<String>, Spanned<Node>)>),
    Seq(Vec<Spanned<Node>>),
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Node;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a YAML node")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Node, E> {
                Ok(Node::Str(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Node, E> {
                Ok(Node::Str(v))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_i128<E: de::Error>(self, _: i128) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_u128<E: de::Error>(self, _: u128) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_none<E: de::Error>(self) -> Result<Node, E> {
                Ok(Node::Other)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
                Node::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<Spanned<Node>>()? {
                    items.push(item);
                }
                Ok(Node::Seq(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<Node>()? {
                    let value = map.next_value::<Spanned<Node>>()?;
                    let key = match key {
                        Node::Str(s) => Some(s),
                        _ => None,
                    };
                    entries.push((key, value));
                }
                Ok(Node::Map(entries))
            }
        }
        d.deserialize_any(V)
    }
}

impl Node {
    fn get(&self, key: &str) -> Option<&Spanned<Node>> {
        match self {
            Node::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.as_deref() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    fn str(&self) -> Option<&str> {
        match self {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// The references of `text` (every document): CSI volumes of our driver, in any `volumes`
/// list (a Pod's, or a Deployment, StatefulSet, DaemonSet, Job or CronJob template's), whose
/// `volumeAttributes` name a volume and a tag.
fn find_references(file: &Path, text: &str) -> anyhow::Result<Vec<Reference>> {
    let docs: Vec<Spanned<Node>> = serde_saphyr::from_multiple(text)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{} is not YAML", file.display()))?;
    let mut refs = Vec::new();
    for (doc, node) in docs.iter().enumerate() {
        let namespace = node
            .value
            .get("metadata")
            .and_then(|m| m.value.get("namespace"))
            .and_then(|n| n.value.str())
            .map(str::to_owned);
        let mut found = Vec::new();
        walk(&node.value, String::new(), false, 0, &mut found);
        for (pointer, attrs) in found {
            let (Some(volume), Some(tag)) = (attrs.get(VOLUME), attrs.get(TAG)) else {
                continue;
            };
            let (Some(v), Some(t)) = (volume.value.str(), tag.value.str()) else {
                bail!(
                    "{}: volumeAttributes {VOLUME} and {TAG} must be strings",
                    file.display()
                );
            };
            if attrs.get(DIGEST).is_some() {
                bail!(
                    "{}:{}: volumeAttributes name both a {DIGEST} and a {VOLUME}/{TAG}, which the \
                     CSI plugin refuses: keep one",
                    file.display(),
                    volume.referenced.line()
                );
            }
            refs.push(Reference {
                file: file.to_path_buf(),
                line: volume.referenced.line(),
                doc_namespace: namespace.clone(),
                namespace: namespace.clone(),
                volume: v.to_owned(),
                tag: t.to_owned(),
                digest: None,
                doc,
                pointer,
                volume_at: (volume.referenced.line(), volume.referenced.column()),
                tag_at: (tag.referenced.line(), tag.referenced.column()),
            });
        }
    }
    Ok(refs)
}

/// Collects the `volumeAttributes` maps (with their JSON pointers) of `csi` entries of our
/// driver in elements of a `volumes` list below `node`.
fn walk<'a>(
    node: &'a Node,
    pointer: String,
    in_volumes: bool,
    depth: usize,
    found: &mut Vec<(String, &'a Node)>,
) {
    // Manifests nest a dozen levels; the parser bounds the rest.
    if depth > 64 {
        return;
    }
    match node {
        Node::Map(entries) => {
            if in_volumes
                && let Some(csi) = node.get("csi")
                && csi.value.get("driver").and_then(|d| d.value.str()) == Some(DRIVER)
                && let Some(attrs) = csi.value.get("volumeAttributes")
            {
                found.push((format!("{pointer}/csi/volumeAttributes"), &attrs.value));
            }
            for (key, value) in entries {
                let Some(key) = key else { continue };
                let child = format!("{pointer}/{}", key.replace('~', "~0").replace('/', "~1"));
                walk(&value.value, child, key == "volumes", depth + 1, found);
            }
        }
        Node::Seq(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(
                    &item.value,
                    format!("{pointer}/{i}"),
                    in_volumes,
                    depth + 1,
                    found,
                );
            }
        }
        Node::Str(_) | Node::Other => {}
    }
}

/// Asks the cluster for the digest of every reference's tag; every one that does not
/// resolve is named in one error, and nothing is written.
async fn resolve(client: &Client, refs: &mut [Reference]) -> anyhow::Result<()> {
    let mut volumes: BTreeMap<(String, String), Option<SealedVolume>> = BTreeMap::new();
    for r in refs.iter() {
        let key = (r.namespace.clone().unwrap_or_default(), r.volume.clone());
        if volumes.contains_key(&key) {
            continue;
        }
        let api: Api<SealedVolume> = Api::namespaced(client.clone(), &key.0);
        let volume = api
            .get_opt(&key.1)
            .await
            .with_context(|| format!("cannot read SealedVolume {}/{}", key.0, key.1))?;
        volumes.insert(key, volume);
    }
    let mut problems = Vec::new();
    for r in refs.iter_mut() {
        let ns = r.namespace.clone().unwrap_or_default();
        let volume = volumes
            .get(&(ns.clone(), r.volume.clone()))
            .and_then(Option::as_ref);
        match tag_digest(volume, &r.tag) {
            Ok(digest) => r.digest = Some(digest),
            Err(why) => problems.push(format!(
                "{}:{}: {ns}/{} tag {}: {why}",
                r.file.display(),
                r.line,
                r.volume,
                r.tag
            )),
        }
    }
    if !problems.is_empty() {
        return Err(anyhow::Error::new(NotFoundError(problems.join("\n")))
            .context("these references do not resolve; no file was changed"));
    }
    Ok(())
}

/// The digest `tag` of `volume` names now, as the operator resolved it (a tag that names no
/// version of the volume does not mount, so it is not pinned either).
fn tag_digest(volume: Option<&SealedVolume>, tag: &str) -> Result<String, String> {
    let Some(volume) = volume else {
        return Err("no such SealedVolume".into());
    };
    let Some(status) = volume.status.as_ref() else {
        return Err("the operator has not resolved its tags yet".into());
    };
    if status.observed_generation != volume.metadata.generation {
        return Err(
            "the operator has not caught up with its latest spec yet; try again in a moment".into(),
        );
    }
    let Some(resolved) = status.tags.get(tag) else {
        return Err("no such tag".into());
    };
    if resolved.version.is_none() {
        return Err(format!(
            "names {}, which is no version of this volume",
            resolved.digest
        ));
    }
    if volume.spec.tags.get(tag) != Some(&resolved.digest) {
        return Err("the tag is moving; try again in a moment".into());
    }
    Ok(resolved.digest.clone())
}

/// An edit of one `key: value` entry on one line, columns in characters (1-based value
/// column, as the parser reports it).
struct Edit<'a> {
    line: u64,
    column: u64,
    key: &'static str,
    /// `Some(text)` replaces the entry by `text`; `None` removes it.
    with: Option<&'a str>,
}

/// `text` with each reference's `volume: V` entry replaced by `digest: "D"` and its `tag: T`
/// entry removed, checked by parsing both: anything else that changed is an error.
fn rewrite(text: &str, refs: &[&Reference]) -> anyhow::Result<String> {
    let digests: Vec<String> = refs
        .iter()
        .map(|r| {
            r.digest
                .as_ref()
                .map(|d| format!("{DIGEST}: \"{d}\""))
                .context("a reference without a digest")
        })
        .collect::<anyhow::Result<_>>()?;
    let mut edits = Vec::new();
    for (r, replacement) in refs.iter().zip(&digests) {
        edits.push(Edit {
            line: r.volume_at.0,
            column: r.volume_at.1,
            key: VOLUME,
            with: Some(replacement),
        });
        edits.push(Edit {
            line: r.tag_at.0,
            column: r.tag_at.1,
            key: TAG,
            with: None,
        });
    }
    // From the end, so earlier positions stay where the parser saw them.
    edits.sort_by_key(|e| std::cmp::Reverse((e.line, e.column)));
    let mut lines: Vec<String> = text.split_inclusive('\n').map(str::to_owned).collect();
    for edit in &edits {
        let index = usize::try_from(edit.line)
            .ok()
            .and_then(|l| l.checked_sub(1))
            .filter(|&i| i < lines.len())
            .with_context(|| format!("line {} is not in the file", edit.line))?;
        match apply(&lines[index], edit)? {
            Some(line) => lines[index] = line,
            None => {
                lines.remove(index);
            }
        }
    }
    let new = lines.concat();
    verify(text, &new, refs)?;
    Ok(new)
}

/// The line after `edit`; `None` when the line goes (a block entry of its own).
fn apply(line: &str, edit: &Edit) -> anyhow::Result<Option<String>> {
    let chars: Vec<char> = line.chars().collect();
    let at = || format!("line {}", edit.line);
    let value = usize::try_from(edit.column)
        .ok()
        .and_then(|c| c.checked_sub(1))
        .filter(|&v| v < chars.len())
        .with_context(|| format!("{}: no value at column {}", at(), edit.column))?;
    let end = value_end(&chars, value).with_context(|| format!("{}: an unclosed quote", at()))?;
    let start = key_start(&chars, value, edit.key)
        .with_context(|| format!("{}: no `{}:` before the value", at(), edit.key))?;
    let before: String = chars[..start].iter().collect();
    let after: String = chars[end..].iter().collect();
    if let Some(with) = edit.with {
        return Ok(Some(format!("{before}{with}{after}")));
    }
    let rest = after.trim();
    if before.trim().is_empty() && (rest.is_empty() || rest.starts_with('#')) {
        return Ok(None);
    }
    // In a flow mapping: the entry goes with one comma beside it.
    if let Some(tail) = after.trim_start().strip_prefix(',') {
        return Ok(Some(format!("{before}{}", tail.trim_start())));
    }
    if let Some(head) = before.trim_end().strip_suffix(',') {
        return Ok(Some(format!("{head}{after}")));
    }
    bail!("{}: cannot tell how to remove `{}`", at(), edit.key)
}

/// Where the scalar starting at `start` ends (exclusive).
fn value_end(chars: &[char], start: usize) -> Option<usize> {
    match chars.get(start)? {
        '"' => {
            let mut i = start + 1;
            while i < chars.len() {
                match chars[i] {
                    '\\' => i += 2,
                    '"' => return Some(i + 1),
                    _ => i += 1,
                }
            }
            None
        }
        '\'' => {
            let mut i = start + 1;
            while i < chars.len() {
                if chars[i] == '\'' {
                    if chars.get(i + 1) == Some(&'\'') {
                        i += 2;
                        continue;
                    }
                    return Some(i + 1);
                }
                i += 1;
            }
            None
        }
        _ => {
            let mut end = start;
            while end < chars.len() {
                let c = chars[end];
                if c == ',' || c == '}' || c == '\n' || c == '\r' {
                    break;
                }
                if c == '#' && end > start && chars[end - 1].is_whitespace() {
                    break;
                }
                end += 1;
            }
            while end > start && chars[end - 1].is_whitespace() {
                end -= 1;
            }
            Some(end)
        }
    }
}

/// Where the key `key` of the value at `value` starts: `key: value`, the key maybe quoted.
fn key_start(chars: &[char], value: usize, key: &str) -> Option<usize> {
    let mut i = value;
    while i > 0 && chars[i - 1].is_whitespace() {
        i -= 1;
    }
    if i == 0 || chars[i - 1] != ':' {
        return None;
    }
    i -= 1;
    while i > 0 && chars[i - 1].is_whitespace() {
        i -= 1;
    }
    let end = i;
    let quote = chars.get(end.checked_sub(1)?).copied();
    let start = if matches!(quote, Some('"' | '\'')) {
        let open = chars[..end - 1].iter().rposition(|&c| Some(c) == quote)?;
        let inner: String = chars[open + 1..end - 1].iter().collect();
        (inner == key).then_some(open)?
    } else {
        let begin = chars[..end]
            .iter()
            .rposition(|&c| c.is_whitespace() || c == '{' || c == ',')
            .map_or(0, |p| p + 1);
        let word: String = chars[begin..end].iter().collect();
        (word == key).then_some(begin)?
    };
    Some(start)
}

/// `new` must parse to `old` with, at each reference, `volume` and `tag` replaced by
/// `digest`, and nothing else changed.
fn verify(old: &str, new: &str, refs: &[&Reference]) -> anyhow::Result<()> {
    let parse = |t: &str| -> anyhow::Result<Vec<serde_json::Value>> {
        serde_saphyr::from_multiple(t).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let mut expected = parse(old)?;
    for r in refs {
        let attrs = expected
            .get_mut(r.doc)
            .and_then(|d| d.pointer_mut(&r.pointer))
            .and_then(|a| a.as_object_mut())
            .context("the reference moved")?;
        attrs.remove(VOLUME);
        attrs.remove(TAG);
        attrs.insert(DIGEST.into(), r.digest.clone().unwrap_or_default().into());
    }
    let got = parse(new).context("the edited text is not YAML")?;
    if got != expected {
        bail!("the edited text would change more than the references");
    }
    Ok(())
}

/// Replaces `file` by `text` through a temporary file beside it (same permissions), so a
/// reader never sees half a manifest.
fn write_atomically(file: &Path, text: &str) -> anyhow::Result<()> {
    let name = file
        .file_name()
        .with_context(|| format!("{} has no file name", file.display()))?;
    let tmp = file.with_file_name(format!(".{}.sealed-pin", name.to_string_lossy()));
    let perms = std::fs::metadata(file)
        .with_context(|| format!("cannot read {}", file.display()))?
        .permissions();
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, perms)
        .with_context(|| format!("cannot set the permissions of {}", tmp.display()))?;
    std::fs::rename(&tmp, file).with_context(|| format!("cannot replace {}", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "blake3:8f3a5b0c1d2e3f405162738495a6b7c8d9eaf00112233445566778899aabbccd";

    fn pin(text: &str) -> anyhow::Result<String> {
        let mut refs = find_references(Path::new("m.yaml"), text)?;
        for r in &mut refs {
            r.digest = Some(D.into());
        }
        let refs: Vec<&Reference> = refs.iter().collect();
        rewrite(text, &refs)
    }

    const DEPLOYMENT: &str = r#"# the model server
apiVersion: apps/v1
kind: Deployment
metadata:
  name: server
  namespace: ml
spec:
  template:
    spec:
      containers:
      - name: s
        image: x   # keep me
      volumes:
      - name: weights
        csi:
          driver: csi.sealedvolumes.io
          readOnly: true
          volumeAttributes:
            volume: llama   # which volume
            tag: "prod"
      - name: other
        csi:
          driver: other.csi.example.com
          volumeAttributes: {volume: llama, tag: prod}
"#;

    #[test]
    fn block_attributes_become_a_digest_and_the_rest_stays() {
        let refs = find_references(Path::new("m.yaml"), DEPLOYMENT).unwrap();
        assert_eq!(refs.len(), 1, "another driver's volume is not ours");
        let r = &refs[0];
        assert_eq!((r.volume.as_str(), r.tag.as_str()), ("llama", "prod"));
        assert_eq!(r.doc_namespace.as_deref(), Some("ml"));
        assert_eq!(r.line, 19);
        let new = pin(DEPLOYMENT).unwrap();
        let expected = DEPLOYMENT.replace(
            "            volume: llama   # which volume\n            tag: \"prod\"\n",
            &format!("            digest: \"{D}\"   # which volume\n"),
        );
        assert_eq!(new, expected);
        assert!(
            find_references(Path::new("m.yaml"), &new)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn flow_attributes_and_every_document() {
        let text = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: a}}\nspec:\n  volumes:\n  - name: w\n    csi: {{driver: {DRIVER}, volumeAttributes: {{volume: llama, tag: prod}}}}\n---\n# second\napiVersion: batch/v1\nkind: CronJob\nmetadata:\n  name: b\n  namespace: team\nspec:\n  jobTemplate:\n    spec:\n      template:\n        spec:\n          volumes:\n          - name: w\n            csi:\n              driver: {DRIVER}\n              volumeAttributes: {{ 'tag': canary , \"volume\": \"llama\" }}\n"
        );
        let refs = find_references(Path::new("m.yaml"), &text).unwrap();
        assert_eq!(refs.len(), 2);
        assert_eq!(refs[0].doc_namespace, None);
        assert_eq!(refs[1].doc_namespace.as_deref(), Some("team"));
        assert_eq!(refs[1].tag, "canary");
        assert_eq!(refs[1].line, 24, "lines count across documents");
        let new = pin(&text).unwrap();
        assert!(
            new.contains(&format!("volumeAttributes: {{digest: \"{D}\"}}}}\n")),
            "{new}"
        );
        assert!(
            new.contains(&format!("volumeAttributes: {{ digest: \"{D}\" }}\n")),
            "{new}"
        );
        assert!(new.contains("# second\n"));
    }

    #[test]
    fn pinned_and_foreign_references_are_left_alone() {
        let pinned = DEPLOYMENT.replace(
            "            volume: llama   # which volume\n            tag: \"prod\"\n",
            &format!("            digest: \"{D}\"\n"),
        );
        assert!(
            find_references(Path::new("m.yaml"), &pinned)
                .unwrap()
                .is_empty()
        );
        // Outside a `volumes` list (a ConfigMap's data, say) nothing is a reference.
        let text = format!(
            "kind: ConfigMap\ndata:\n  csi: {{driver: {DRIVER}, volumeAttributes: {{volume: a, tag: b}}}}\n"
        );
        assert!(
            find_references(Path::new("m.yaml"), &text)
                .unwrap()
                .is_empty()
        );
        // Both a digest and a tag: the plugin refuses it, so pin says so.
        let both = DEPLOYMENT.replace(
            "tag: \"prod\"",
            &format!("tag: prod\n            digest: {D}"),
        );
        let e = find_references(Path::new("m.yaml"), &both).unwrap_err();
        assert!(format!("{e:#}").contains("both a digest"), "{e:#}");
    }

    #[test]
    fn what_cannot_be_edited_safely_is_refused() {
        // The value on the line after its key: the textual edit cannot place it.
        let text = DEPLOYMENT.replace("tag: \"prod\"", "tag:\n              prod");
        assert!(pin(&text).is_err());
        // Not YAML at all (a Helm template).
        assert!(find_references(Path::new("t.yaml"), "a: {{ .Values.x }\n").is_err());
    }

    #[test]
    fn scalar_ends_and_key_starts() {
        let chars: Vec<char> = "  'tag' : \"a\\\"b\" , x".chars().collect();
        let v = chars.iter().position(|&c| c == '"').unwrap();
        assert_eq!(value_end(&chars, v), Some(16));
        assert_eq!(key_start(&chars, v, "tag"), Some(2));
        assert_eq!(key_start(&chars, v, "volume"), None);
        let chars: Vec<char> = "volume: llama # c".chars().collect();
        assert_eq!(value_end(&chars, 8), Some(13));
        assert_eq!(value_end(&"'unclosed".chars().collect::<Vec<_>>(), 0), None);
    }

    #[test]
    fn a_tag_resolves_only_to_a_version_of_its_volume() {
        use sealed_crds::{SealedVolumeSpec, SealedVolumeStatus, Source, TagStatus};
        let mut v = SealedVolume::new(
            "llama",
            SealedVolumeSpec {
                source: Source::upload(),
                tags: [("prod".to_string(), D.to_string())].into(),
                retention: Default::default(),
                shared: false,
                warm: None,
            },
        );
        assert!(
            tag_digest(None, "prod")
                .unwrap_err()
                .contains("no such SealedVolume")
        );
        assert!(tag_digest(Some(&v), "prod").is_err(), "no status yet");
        v.metadata.generation = Some(2);
        let mut status = SealedVolumeStatus {
            observed_generation: Some(2),
            ..Default::default()
        };
        status.tags.insert(
            "prod".into(),
            TagStatus {
                digest: D.into(),
                version: None,
            },
        );
        v.status = Some(status.clone());
        assert!(
            tag_digest(Some(&v), "prod")
                .unwrap_err()
                .contains("no version")
        );
        assert!(
            tag_digest(Some(&v), "canary")
                .unwrap_err()
                .contains("no such tag")
        );
        status.tags.get_mut("prod").unwrap().version = Some("llama-8f3a".into());
        v.status = Some(status.clone());
        assert_eq!(tag_digest(Some(&v), "prod"), Ok(D.to_string()));
        status.observed_generation = Some(1);
        v.status = Some(status);
        assert!(
            tag_digest(Some(&v), "prod")
                .unwrap_err()
                .contains("caught up")
        );
    }
}
