//! `sealed pin FILE|DIR`: pin the tags that manifests, Helm values and Kustomize files name
//! to the digests they name now, so a Git repository pins bytes; `sealed pin --check` changes
//! nothing and fails while any reference floats (for CI). Run again after a tag moved, it
//! re-pins from what it left behind, so a bot's commit can follow a tag (docs/gitops.md).
//!
//! What is a reference:
//! - the `volumeAttributes: {volume, tag}` of a CSI inline volume of our driver: pinned to
//!   `{digest}` with a marker comment `# sealed: volume=V tag=T` on the digest's line (the
//!   plugin refuses a digest beside a tag, so the tag goes into the comment);
//! - a marker comment `# sealed: volume=V tag=T` (optionally `namespace=N`) on the line of a
//!   `digest:` value or of a `blake3:` value: that value is re-pinned;
//! - Helm values: a map with string `volume` and `tag` keys and a `digest` key, at any depth
//!   (`digest` empty or null floats);
//! - Kustomize images-style entries: a map with `name` (the volume), `newTag` and a `digest`
//!   that is empty, null or a `blake3:` digest (a `sha256:` one is an image's, left alone).
//!
//! The YAML is parsed to find the references (and where they are), the entries are edited in
//! the text (comments, order and quoting elsewhere stay as they were), and the result is
//! parsed again: it must be the original with exactly those values changed, or the file is
//! left alone with an error. Every tag is resolved before any file is written, so a tag that
//! does not resolve changes nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Args;
use kube::{Api, Client};
use sealed_crds::SealedVolume;
// The CSI driver's name and the volume attributes that name a version: `digest`, or
// `volume` + `tag` (the same keys in Helm values and markers).
use sealed_crds::csi::{
    DIGEST_ATTRIBUTE as DIGEST, DRIVER_NAME as DRIVER, TAG_ATTRIBUTE as TAG,
    VOLUME_ATTRIBUTE as VOLUME,
};
use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use crate::context::Context;
use crate::errors::NotFoundError;
use crate::output::print_json;

/// Kustomize `images:`-style entries: `name`, `newTag`, `digest`.
const NAME: &str = "name";
const NEW_TAG: &str = "newTag";
/// The marker comment `sealed pin` leaves and reads: `# sealed: volume=V tag=T`.
const MARKER: &str = "# sealed:";
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

/// Where a reference is and how it is pinned.
#[derive(Clone, Debug)]
enum Site {
    /// CSI `volumeAttributes: {volume, tag}` at these (line, column) positions: the volume
    /// entry becomes `digest: "D"` with the marker, the tag entry goes.
    Csi {
        volume_at: (u64, u64),
        tag_at: (u64, u64),
    },
    /// A digest value at (line, column), replaced in place (Helm values, Kustomize entries,
    /// marked values).
    Value { at: (u64, u64) },
}

/// One reference to a SealedVolume by tag.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Reference {
    file: PathBuf,
    line: u64,
    /// `csi`, `values` (Helm), `images` (Kustomize-style) or `marker`.
    kind: &'static str,
    /// `metadata.namespace` of its document, or the marker's `namespace=`.
    #[serde(skip)]
    doc_namespace: Option<String>,
    namespace: Option<String>,
    volume: String,
    tag: String,
    /// The digest the file holds now (`None`: the reference floats).
    pinned: Option<String>,
    /// The digest the tag names (after resolving).
    digest: Option<String>,
    /// Which document of the file, and the JSON pointer of the edited node (the
    /// `volumeAttributes` map, or the digest value).
    #[serde(skip)]
    doc: usize,
    #[serde(skip)]
    pointer: String,
    #[serde(skip)]
    site: Site,
}

impl Reference {
    fn floats(&self) -> bool {
        self.pinned.is_none()
    }

    /// Whether pinning changes the file.
    fn changes(&self) -> bool {
        self.digest.is_some() && self.digest != self.pinned
    }
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
        let mine: Vec<&Reference> = refs
            .iter()
            .filter(|r| &r.file == file && r.changes())
            .collect();
        if mine.is_empty() {
            continue;
        }
        let new = rewrite(text, &mine)
            .with_context(|| format!("cannot pin {} safely; pin it by hand", file.display()))?;
        rewritten.push((file, new));
    }
    let files_changed = rewritten.len();
    for (file, new) in rewritten {
        write_atomically(file, &new)?;
    }
    if !ctx.json() {
        for r in &refs {
            let now = r.digest.as_deref().unwrap_or_default();
            let what = match &r.pinned {
                Some(p) if p == now => format!("{now} (unchanged)"),
                Some(p) => format!("{p} -> {now}"),
                None => now.to_owned(),
            };
            eprintln!(
                "{}:{}: {}/{} tag {} {what}",
                r.file.display(),
                r.line,
                r.namespace.as_deref().unwrap_or_default(),
                r.volume,
                r.tag,
            );
        }
        eprintln!(
            "pinned {} reference(s), {} changed, in {files_changed} file(s)",
            refs.len(),
            refs.iter().filter(|r| r.changes()).count(),
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

/// `--check`: exit 1 while a reference floats (a tag without a digest).
fn check(ctx: &Context, files: &[(PathBuf, bool)], refs: &[Reference]) -> anyhow::Result<ExitCode> {
    let refs: Vec<&Reference> = refs.iter().filter(|r| r.floats()).collect();
    if ctx.json() {
        print_json(&refs)?;
    } else {
        for r in &refs {
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

/// The references of `text` (every document), in the order of the text.
fn find_references(file: &Path, text: &str) -> anyhow::Result<Vec<Reference>> {
    let docs: Vec<Spanned<Node>> = serde_saphyr::from_multiple(text)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{} is not YAML", file.display()))?;
    let lines: Vec<&str> = text.lines().collect();
    let mut refs = Vec::new();
    for (doc, node) in docs.iter().enumerate() {
        let namespace = node
            .value
            .get("metadata")
            .and_then(|m| m.value.get("namespace"))
            .and_then(|n| n.value.str())
            .map(str::to_owned);
        let mut found = Found::default();
        walk(&node.value, String::new(), None, false, 0, &mut found);
        let reference = |line, kind, volume: &str, tag: &str, pinned, pointer, site| Reference {
            file: file.to_path_buf(),
            line,
            kind,
            doc_namespace: namespace.clone(),
            namespace: namespace.clone(),
            volume: volume.to_owned(),
            tag: tag.to_owned(),
            pinned,
            digest: None,
            doc,
            pointer,
            site,
        };
        let mut taken = std::collections::BTreeSet::new();
        for (pointer, attrs) in found.csi {
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
            let site = Site::Csi {
                volume_at: (volume.referenced.line(), volume.referenced.column()),
                tag_at: (tag.referenced.line(), tag.referenced.column()),
            };
            let line = volume.referenced.line();
            refs.push(reference(line, "csi", v, t, None, pointer, site));
        }
        // Helm values and Kustomize entries: the digest beside the volume and tag.
        for (pointer, map, kind) in found.fields {
            let (volume_key, tag_key) = if kind == "values" {
                (VOLUME, TAG)
            } else {
                (NAME, NEW_TAG)
            };
            let (Some(v), Some(t), Some(d)) = (
                map.get(volume_key).and_then(|v| v.value.str()),
                map.get(tag_key).and_then(|t| t.value.str()),
                map.get(DIGEST),
            ) else {
                continue;
            };
            let pinned = match &d.value {
                Node::Str(s) if s.is_empty() => None,
                Node::Str(s) if s.starts_with("blake3:") => Some(s.clone()),
                Node::Other => None,
                // A sha256 digest: a container image's entry, not ours.
                _ => continue,
            };
            let at = (d.referenced.line(), d.referenced.column());
            let digest_pointer = format!("{pointer}/{DIGEST}");
            taken.insert(digest_pointer.clone());
            refs.push(reference(
                d.referenced.line(),
                kind,
                v,
                t,
                pinned,
                digest_pointer,
                Site::Value { at },
            ));
        }
        // Values a marker comment names.
        for (pointer, value) in found.values {
            if taken.contains(&pointer) {
                continue;
            }
            let line_no = value.referenced.line();
            let Some(line) = usize::try_from(line_no)
                .ok()
                .and_then(|l| l.checked_sub(1))
                .and_then(|i| lines.get(i))
            else {
                continue;
            };
            let Some(marker) = parse_marker(line) else {
                continue;
            };
            let (volume, tag, ns) = marker.map_err(|why| {
                anyhow::anyhow!("{}:{line_no}: a `{MARKER}` comment {why}", file.display())
            })?;
            let pinned = value
                .value
                .str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned);
            let at = (line_no, value.referenced.column());
            let mut r = reference(
                line_no,
                "marker",
                &volume,
                &tag,
                pinned,
                pointer,
                Site::Value { at },
            );
            if ns.is_some() {
                r.doc_namespace = ns.clone();
                r.namespace = ns;
            }
            refs.push(r);
        }
    }
    // One marked value per line: a marker names the digest of its line.
    for pair in refs.windows(2) {
        if pair[0].kind == "marker" && pair[1].kind == "marker" && pair[0].line == pair[1].line {
            bail!(
                "{}:{}: a `{MARKER}` comment on a line with two digests: put each on its own line",
                file.display(),
                pair[0].line
            );
        }
    }
    refs.sort_by_key(|r| (r.doc, r.line));
    Ok(refs)
}

/// The marker of `line`, if it has one: `# sealed: volume=V tag=T [namespace=N]`, as
/// (volume, tag, namespace) or why it cannot be read.
#[allow(clippy::type_complexity)]
fn parse_marker(line: &str) -> Option<Result<(String, String, Option<String>), String>> {
    let at = line.find(MARKER)?;
    let rest = &line[at + MARKER.len()..];
    // Up to the next comment, if another follows.
    let rest = rest.split(" #").next().unwrap_or_default();
    let (mut volume, mut tag, mut namespace) = (None, None, None);
    for word in rest.split_whitespace() {
        match word.split_once('=') {
            Some((VOLUME, v)) => volume = Some(v.to_owned()),
            Some((TAG, t)) => tag = Some(t.to_owned()),
            Some(("namespace", n)) => namespace = Some(n.to_owned()),
            _ => {
                return Some(Err(format!(
                    "has {word:?}: write volume=V tag=T [namespace=N]"
                )));
            }
        }
    }
    Some(match (volume, tag) {
        (Some(v), Some(t)) if !v.is_empty() && !t.is_empty() => Ok((v, t, namespace)),
        _ => Err("needs volume=V and tag=T".into()),
    })
}

/// What a walk over one document collects.
#[derive(Default)]
struct Found<'a> {
    /// `volumeAttributes` of `csi` entries of our driver in `volumes` lists.
    csi: Vec<(String, &'a Node)>,
    /// Maps with the keys of Helm values (`values`) or Kustomize entries (`images`).
    fields: Vec<(String, &'a Node, &'static str)>,
    /// Values a marker could name: every `digest` entry, and every `blake3:` string.
    values: Vec<(String, &'a Spanned<Node>)>,
}

/// Collects, with their JSON pointers, what [`Found`] holds below `node` (reached as the
/// value of `key`).
fn walk<'a>(
    node: &'a Node,
    pointer: String,
    key: Option<&str>,
    in_volumes: bool,
    depth: usize,
    found: &mut Found<'a>,
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
                found
                    .csi
                    .push((format!("{pointer}/csi/volumeAttributes"), &attrs.value));
            }
            let has = |k| node.get(k).is_some();
            // A CSI volume's own attributes are not Helm values.
            if key != Some("volumeAttributes") && has(DIGEST) {
                if has(VOLUME) && has(TAG) {
                    found.fields.push((pointer.clone(), node, "values"));
                } else if has(NAME) && has(NEW_TAG) {
                    found.fields.push((pointer.clone(), node, "images"));
                }
            }
            for (k, value) in entries {
                let Some(k) = k else { continue };
                let child = format!("{pointer}/{}", k.replace('~', "~0").replace('/', "~1"));
                let marked = match &value.value {
                    Node::Str(s) => k == DIGEST || s.starts_with("blake3:"),
                    Node::Other => k == DIGEST,
                    _ => false,
                };
                if marked {
                    found.values.push((child.clone(), value));
                }
                walk(
                    &value.value,
                    child,
                    Some(k),
                    k == "volumes",
                    depth + 1,
                    found,
                );
            }
        }
        Node::Seq(items) => {
            for (i, item) in items.iter().enumerate() {
                let child = format!("{pointer}/{i}");
                if item.value.str().is_some_and(|s| s.starts_with("blake3:")) {
                    found.values.push((child.clone(), item));
                }
                walk(&item.value, child, None, in_volumes, depth + 1, found);
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
    /// The entry's key, checked before the value (`None`: the value alone is replaced).
    key: Option<&'static str>,
    /// `Some(text)` replaces the entry (or value) by `text`; `None` removes the entry.
    with: Option<&'a str>,
    /// A comment to put at the end of the line.
    comment: Option<&'a str>,
}

/// `text` with each reference pinned: a CSI reference's `volume: V` entry replaced by
/// `digest: "D"` with the marker comment and its `tag: T` entry removed; a digest value
/// replaced by `"D"`. Checked by parsing both: anything else that changed is an error.
fn rewrite(text: &str, refs: &[&Reference]) -> anyhow::Result<String> {
    let digests: Vec<(String, String, String)> = refs
        .iter()
        .map(|r| {
            let d = r.digest.as_ref().context("a reference without a digest")?;
            Ok((
                format!("{DIGEST}: \"{d}\""),
                format!("\"{d}\""),
                format!("{MARKER} {VOLUME}={} {TAG}={}", r.volume, r.tag),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut edits = Vec::new();
    for (r, (entry, value, marker)) in refs.iter().zip(&digests) {
        match &r.site {
            Site::Csi { volume_at, tag_at } => {
                edits.push(Edit {
                    line: volume_at.0,
                    column: volume_at.1,
                    key: Some(VOLUME),
                    with: Some(entry),
                    comment: Some(marker),
                });
                edits.push(Edit {
                    line: tag_at.0,
                    column: tag_at.1,
                    key: Some(TAG),
                    with: None,
                    comment: None,
                });
            }
            Site::Value { at } => edits.push(Edit {
                line: at.0,
                column: at.1,
                key: None,
                with: Some(value),
                comment: None,
            }),
        }
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
        .filter(|&v| v <= chars.len())
        .with_context(|| format!("{}: no value at column {}", at(), edit.column))?;
    let end = value_end(&chars, value).with_context(|| format!("{}: an unclosed quote", at()))?;
    let start = match edit.key {
        Some(key) => key_start(&chars, value, key)
            .with_context(|| format!("{}: no `{key}:` before the value", at()))?,
        None => value,
    };
    let before: String = chars[..start].iter().collect();
    let after: String = chars[end..].iter().collect();
    if let Some(with) = edit.with {
        let mut new = format!("{before}{with}{after}");
        if let Some(comment) = edit.comment {
            let body = new.trim_end_matches(['\n', '\r']).len();
            let ending = new[body..].to_owned();
            new.truncate(body);
            new = format!("{}  {comment}{ending}", new.trim_end());
        }
        return Ok(Some(new));
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
    bail!(
        "{}: cannot tell how to remove `{}`",
        at(),
        edit.key.unwrap_or("the entry")
    )
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

/// `new` must parse to `old` with each reference pinned (a CSI reference's `volume` and
/// `tag` replaced by `digest`, a digest value replaced) and nothing else changed.
fn verify(old: &str, new: &str, refs: &[&Reference]) -> anyhow::Result<()> {
    let parse = |t: &str| -> anyhow::Result<Vec<serde_json::Value>> {
        serde_saphyr::from_multiple(t).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let mut expected = parse(old)?;
    for r in refs {
        let node = expected
            .get_mut(r.doc)
            .and_then(|d| d.pointer_mut(&r.pointer))
            .context("the reference moved")?;
        let digest = r.digest.clone().unwrap_or_default();
        match r.site {
            Site::Csi { .. } => {
                let attrs = node.as_object_mut().context("the reference moved")?;
                attrs.remove(VOLUME);
                attrs.remove(TAG);
                attrs.insert(DIGEST.into(), digest.into());
            }
            Site::Value { .. } => *node = digest.into(),
        }
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
            &format!(
                "            digest: \"{D}\"   # which volume  # sealed: volume=llama tag=prod\n"
            ),
        );
        assert_eq!(new, expected);
        // Pinned, with the marker to re-pin from.
        let again = find_references(Path::new("m.yaml"), &new).unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].kind, "marker");
        assert_eq!(
            (again[0].volume.as_str(), again[0].tag.as_str()),
            ("llama", "prod")
        );
        assert_eq!(again[0].pinned.as_deref(), Some(D));
        assert_eq!(again[0].line, 19);
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
            new.contains(&format!(
                "volumeAttributes: {{digest: \"{D}\"}}}}  # sealed: volume=llama tag=prod\n"
            )),
            "{new}"
        );
        assert!(
            new.contains(&format!(
                "volumeAttributes: {{ digest: \"{D}\" }}  # sealed: volume=llama tag=canary\n"
            )),
            "{new}"
        );
        let again = find_references(Path::new("m.yaml"), &new).unwrap();
        assert_eq!(again.len(), 2);
        assert!(again.iter().all(|r| !r.floats()));
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
                .is_empty(),
            "a digest without a marker is no reference"
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
                verify: None,
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

    /// Pins `refs` of `text` to `to`, as `run` does (only references that change).
    fn repin(text: &str, to: &str) -> String {
        let mut refs = find_references(Path::new("m.yaml"), text).unwrap();
        for r in &mut refs {
            r.digest = Some(to.into());
        }
        let refs: Vec<&Reference> = refs.iter().filter(|r| r.changes()).collect();
        rewrite(text, &refs).unwrap()
    }

    const E: &str = "blake3:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn markers_re_pin_after_the_tag_moved() {
        let pinned = pin(DEPLOYMENT).unwrap();
        let moved = repin(&pinned, E);
        assert_eq!(moved, pinned.replace(D, E), "only the digest changes");
        // The marker may name the namespace; one in another form is an error naming the line.
        let text =
            format!("env:\n- name: W\n  value: {D} # sealed: volume=llama tag=prod namespace=ml\n");
        let refs = find_references(Path::new("m.yaml"), &text).unwrap();
        assert_eq!(refs[0].doc_namespace.as_deref(), Some("ml"));
        assert_eq!(repin(&text, E), text.replace(D, &format!("\"{E}\"")));
        let bad = format!("digest: {D} # sealed: volume=llama\n");
        let e = find_references(Path::new("v.yaml"), &bad).unwrap_err();
        assert!(format!("{e:#}").contains("v.yaml:1"), "{e:#}");
    }

    #[test]
    fn helm_values_at_any_depth() {
        let text = format!(
            "# values.yaml\nserver:\n  model:\n    volume: llama   # the SealedVolume\n    tag: prod\n    digest: \"\"  # pinned by sealed pin\n  replicas: 2\nsidecar:\n  weights: {{volume: lora, tag: canary, digest: {D}}}\n"
        );
        let refs = find_references(Path::new("values.yaml"), &text).unwrap();
        assert_eq!(refs.len(), 2, "{refs:?}");
        assert_eq!(refs[0].kind, "values");
        assert!(refs[0].floats(), "an empty digest floats");
        assert_eq!(refs[0].line, 6);
        assert_eq!(
            (refs[1].volume.as_str(), refs[1].tag.as_str()),
            ("lora", "canary")
        );
        assert!(!refs[1].floats());
        let new = repin(&text, E);
        assert!(
            new.contains(&format!("    digest: \"{E}\"  # pinned by sealed pin\n")),
            "{new}"
        );
        assert!(
            new.contains(&format!("{{volume: lora, tag: canary, digest: \"{E}\"}}")),
            "{new}"
        );
        assert!(new.contains("    volume: llama   # the SealedVolume\n    tag: prod\n"));
        // A null digest floats and is pinned too.
        let null = "model:\n  volume: llama\n  tag: prod\n  digest: ~\n";
        let refs = find_references(Path::new("values.yaml"), null).unwrap();
        assert!(refs[0].floats());
        assert_eq!(
            repin(null, E),
            format!("model:\n  volume: llama\n  tag: prod\n  digest: \"{E}\"\n")
        );
    }

    #[test]
    fn kustomize_images_style_entries_and_not_images() {
        let text = format!(
            "images:\n- name: nginx\n  newTag: \"1.27\"\n  digest: sha256:{}\nsealedVolumes:\n- name: llama\n  newTag: prod\n  digest: {D}\n",
            "ab".repeat(32)
        );
        let refs = find_references(Path::new("kustomization.yaml"), &text).unwrap();
        assert_eq!(refs.len(), 1, "the sha256 entry is an image's: {refs:?}");
        assert_eq!(refs[0].kind, "images");
        assert_eq!(
            (refs[0].volume.as_str(), refs[0].tag.as_str()),
            ("llama", "prod")
        );
        let new = repin(&text, E);
        assert_eq!(
            new,
            text.replace(&format!("digest: {D}"), &format!("digest: \"{E}\""))
        );
    }
}
