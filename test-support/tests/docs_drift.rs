//! The docs cannot drift from the code and the chart (reading files only, no build):
//!
//! - every flag `--name` that `docs/*.md` gives one of our binaries is defined by a clap
//!   `#[arg(...)]` of the workspace (flags of other tools' command lines are skipped);
//! - every metric `sealed_*` named in `docs/*.md` is one the code registers;
//! - every value of `charts/sealed-volumes/values.yaml` is in the values table of
//!   `docs/helm.md`, and every value `docs/helm.md` names is in `values.yaml`.
//!
//! A failure lists every name it flags, with the file that names it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use sealed_test_support::servers::repo_root;

/// The workspace crates whose `src/` define our binaries' flags and metrics.
const CRATES: &[&str] = &[
    "store",
    "mount",
    "crds",
    "sources",
    "operator",
    "csi-driver",
    "fd-holder",
    "cli",
    "service",
    "peer",
];

/// Commands whose flags the docs quote but that are not ours: a flag in a command line or an
/// inline code span that starts with one of these is not checked.
const OTHER_TOOLS: &[&str] = &[
    "kubectl",
    "helm",
    "cargo",
    "rustup",
    "go",
    "docker",
    "podman",
    "crane",
    "ctr",
    "crictl",
    "csi-sanity",
    "promtool",
    "curl",
    "wget",
    "rclone",
    "fio",
    "git",
    "aws",
    "gcloud",
    "az",
    "python3",
    "python",
    "pip",
    "npm",
    "npx",
    "b3sum",
    "mount",
    "umount",
    "systemd-run",
    "taskset",
    "dd",
    "openssl",
    "apt-get",
    "apt",
    "tar",
    "ls",
    "cp",
    "rm",
    "chroot",
    "hf",
    "huggingface-cli",
    "argocd",
    "flux",
    "kind",
    "minikube",
    "kubeadm",
    "moto_server",
    "azurite",
    "s3s-fs",
    "server",
    "toxiproxy-cli",
    "just",
    "bash",
    "sh",
    "env",
];

/// Flags every clap command has without an `#[arg]`.
const CLAP_BUILTIN: &[&str] = &["help", "version"];

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn files_under(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_under(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

fn sources() -> Vec<(PathBuf, String)> {
    let mut files = vec![];
    for krate in CRATES {
        files_under(&repo_root().join(krate).join("src"), "rs", &mut files);
    }
    files.sort();
    files.into_iter().map(|p| (p.clone(), read(&p))).collect()
}

fn docs() -> Vec<(String, String)> {
    let mut files = vec![];
    files_under(&repo_root().join("docs"), "md", &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p
                .strip_prefix(repo_root())
                .unwrap_or(&p)
                .display()
                .to_string();
            (name, read(&p))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Flags

/// The text of `s` from `open` up to its matching close, `open` being at `start`.
fn balanced(s: &str, start: usize) -> Option<&str> {
    let mut depth = 0usize;
    for (i, c) in s[start..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return s.get(start + 1..start + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `"x"` string literals of `s`.
fn literals(s: &str) -> Vec<&str> {
    s.split('"').skip(1).step_by(2).collect()
}

fn is_word(s: &str, at: usize, len: usize) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    !s[..at].chars().next_back().is_some_and(ident)
        && !s[at + len..].chars().next().is_some_and(ident)
}

fn has_word(s: &str, word: &str) -> bool {
    s.match_indices(word)
        .any(|(i, _)| is_word(s, i, word.len()))
}

/// The field an attribute applies to, `rest` starting at the attribute's closing `)]`: the
/// first `name:` on the lines after it, past doc comments and other one-line attributes.
fn field_after(rest: &str) -> Option<String> {
    let line = rest
        .lines()
        .skip(1)
        .map(str::trim)
        .find(|l| !(l.is_empty() || l.starts_with("//") || l.starts_with("#[")))?;
    let line = line
        .strip_prefix("pub(crate) ")
        .or_else(|| line.strip_prefix("pub "))
        .unwrap_or(line);
    let (name, _) = line.split_once(':')?;
    let name = name.trim();
    name.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then(|| name.replace('_', "-"))
}

/// Every long flag (and alias) the workspace's clap derives define.
fn clap_flags(files: &[(PathBuf, String)]) -> BTreeSet<String> {
    let mut flags: BTreeSet<String> = CLAP_BUILTIN.iter().map(|s| s.to_string()).collect();
    for (_, text) in files {
        for (at, _) in text.match_indices("#[arg(") {
            let Some(body) = balanced(text, at + "#[arg".len()) else {
                continue;
            };
            let end = at + "#[arg(".len() + body.len();
            if has_word(body, "long") {
                let named = body
                    .split_once("long")
                    .and_then(|(_, r)| r.trim_start().strip_prefix('='))
                    .and_then(|r| {
                        literals(r.split_once(',').map_or(r, |(a, _)| a))
                            .first()
                            .copied()
                    });
                match named {
                    Some(name) => {
                        flags.insert(name.to_owned());
                    }
                    None => {
                        if let Some(field) = field_after(&text[end..]) {
                            flags.insert(field);
                        }
                    }
                }
            }
            for key in ["alias", "aliases", "visible_alias", "visible_aliases"] {
                for (i, _) in body.match_indices(key) {
                    if !is_word(body, i, key.len()) {
                        continue;
                    }
                    let rest = &body[i + key.len()..];
                    let rest = rest.split_once(']').map_or(rest, |(a, _)| a);
                    let rest = rest.split_once(')').map_or(rest, |(a, _)| a);
                    let value = if rest.trim_start().starts_with("= [") {
                        rest
                    } else {
                        rest.split_once(',').map_or(rest, |(a, _)| a)
                    };
                    flags.extend(literals(value).into_iter().map(str::to_owned));
                }
            }
        }
    }
    flags
}

/// The command a flag belongs to, from the text before it: in a code block the command line;
/// in prose the inline code span it is in (`None` outside one). The command is the first word
/// after the last `|`, `;`, `&&` or unclosed `$(`, past `$ `, `sudo` and `VAR=value`; empty
/// when the flag comes first.
fn command_word(before: &str, in_code_block: bool) -> Option<String> {
    let span = if in_code_block {
        before
    } else {
        // Inside an inline code span when an odd number of backticks precede it.
        if before.matches('`').count().is_multiple_of(2) {
            return None;
        }
        before.rsplit('`').next().unwrap_or("")
    };
    // Closed substitutions (`"$(date -Is)"`) are arguments, not the command.
    let mut span = span.to_owned();
    while let Some(open) = span.find("$(") {
        let Some(close) = span[open..].find(')') else {
            break;
        };
        span.replace_range(open..open + close + 1, "X");
    }
    let last = span
        .rsplit(['|', ';'])
        .next()
        .unwrap_or("")
        .rsplit("&&")
        .next()
        .unwrap_or("")
        .rsplit("$(")
        .next()
        .unwrap_or("");
    Some(
        last.split_whitespace()
            .find(|w| !(*w == "$" || *w == "sudo" || *w == "#" || w.contains('=')))
            .unwrap_or("")
            .to_owned(),
    )
}

fn is_other_tool(word: &str) -> bool {
    let base = word.rsplit('/').next().unwrap_or(word);
    OTHER_TOOLS.contains(&base) || word.starts_with("hack/") || word.starts_with("./hack/")
}

/// Other tools' flags the docs quote alone in a code span (`--set a=b` after "install with"),
/// where no command word says whose they are.
const OTHER_TOOLS_BARE_FLAGS: &[(&str, &str)] =
    &[("helm", "set"), ("helm", "set-json"), ("docker", "target")];

/// `(flag, where)` for every `--flag` the docs give our binaries.
fn doc_flags(docs: &[(String, String)]) -> Vec<(String, String)> {
    let mut out = vec![];
    for (file, text) in docs {
        let mut in_block = false;
        // A command line of a code block (with its `\` continuations), or a prose paragraph
        // (an inline code span may break across its lines).
        let mut context = String::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_block = !in_block;
                context.clear();
                continue;
            }
            if !in_block && line.trim().is_empty() {
                context.clear();
                continue;
            }
            let prefix_len = context.len();
            context.push_str(line);
            context.push('\n');
            for (i, _) in line.match_indices("--") {
                let rest = &line[i + 2..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                let after = rest[name.len()..].chars().next();
                let before = line[..i].chars().next_back();
                if name.is_empty()
                    || !name.starts_with(|c: char| c.is_ascii_lowercase())
                    || before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
                    // Go-style dotted flags (`--csi.endpoint`) are never ours.
                    || after == Some('.')
                {
                    continue;
                }
                let word = command_word(&context[..prefix_len + i], in_block)
                    // Outside code: a line that is itself a command (an indented example).
                    .unwrap_or_else(|| line.split_whitespace().next().unwrap_or("").to_owned());
                let bare =
                    word.is_empty() && OTHER_TOOLS_BARE_FLAGS.iter().any(|(_, f)| *f == name);
                if bare || is_other_tool(&word) {
                    continue;
                }
                out.push((name, format!("{file}:{}", n + 1)));
            }
            if in_block && !line.trim_end().ends_with('\\') {
                context.clear();
            }
        }
    }
    out
}

#[test]
fn every_flag_the_docs_name_is_defined() {
    let flags = clap_flags(&sources());
    assert!(
        flags.contains("store") && flags.contains("max-mount-memory"),
        "the clap parser found too little: {flags:?}"
    );
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (flag, at) in doc_flags(&docs()) {
        let known = if let Some(prefix) = flag.strip_suffix('-') {
            // A family written with a wildcard or braces: `--sync-{cpu,memory}-…`.
            flags.iter().any(|f| f.starts_with(prefix))
        } else {
            flags.contains(&flag)
        };
        if !known {
            missing.entry(flag).or_default().push(at);
        }
    }
    assert!(
        missing.is_empty(),
        "flags named in docs/ that no clap #[arg] of {CRATES:?} defines (fix the doc, or add the \
         tool to OTHER_TOOLS if it is not ours):\n{}",
        missing
            .iter()
            .map(|(f, at)| format!("  --{f}: {}", at.join(", ")))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Metrics

fn is_metric_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'
}

/// Every metric name the code registers: `"sealed_…"` literals, and the names of a registry
/// with a namespace (`Registry::new_custom(Some("sealed_operator"…))`) under it.
fn code_metrics(files: &[(PathBuf, String)]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, text) in files {
        let lits = literals(text);
        let namespace = text
            .split_once("new_custom(Some(")
            .and_then(|(_, r)| literals(r).first().copied());
        for lit in &lits {
            if !lit.chars().all(is_metric_char) || lit.is_empty() {
                continue;
            }
            if lit.starts_with("sealed_") {
                out.insert(lit.to_string());
            }
            if let Some(ns) = namespace {
                out.insert(format!("{ns}_{lit}"));
            }
        }
    }
    out
}

/// `sealed_…` names in `text` that are not crate paths (`sealed_store::…`, `sealed_mount=debug`).
fn doc_metrics(docs: &[(String, String)], crate_names: &BTreeSet<String>) -> Vec<(String, String)> {
    let mut out = vec![];
    for (file, text) in docs {
        for (n, line) in text.lines().enumerate() {
            for (i, _) in line.match_indices("sealed_") {
                if line[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '/')
                {
                    continue;
                }
                let name: String = line[i..]
                    .chars()
                    .take_while(|c| is_metric_char(*c))
                    .collect();
                if crate_names.contains(&name) || line[i + name.len()..].starts_with("::") {
                    continue;
                }
                out.push((name, format!("{file}:{}", n + 1)));
            }
        }
    }
    out
}

fn crate_lib_names() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for krate in CRATES.iter().chain(&["e2e", "test-support"]) {
        let toml = read(&repo_root().join(krate).join("Cargo.toml"));
        for line in toml.lines() {
            if let Some(name) = line.strip_prefix("name = ") {
                out.insert(name.trim_matches('"').replace('-', "_"));
            }
        }
    }
    out
}

#[test]
fn every_metric_the_docs_name_is_registered() {
    let metrics = code_metrics(&sources());
    assert!(
        metrics.contains("sealed_operator_leader") && metrics.contains("sealed_disk_cache_bytes"),
        "the metric scan found too little: {metrics:?}"
    );
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, at) in doc_metrics(&docs(), &crate_lib_names()) {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| metrics.contains(*b)))
            .unwrap_or(&name);
        let known = if name.ends_with('_') {
            metrics.iter().any(|m| m.starts_with(&name))
        } else {
            metrics.contains(base)
        };
        if !known {
            missing.entry(name).or_default().push(at);
        }
    }
    assert!(
        missing.is_empty(),
        "metrics named in docs/ that the code does not register:\n{}",
        missing
            .iter()
            .map(|(m, at)| format!("  {m}: {}", at.join(", ")))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Chart values

/// Every key path of a values file, with whether it is a leaf (no keys under it). Lists are
/// leaves: their items are examples, not values.
fn value_paths(yaml: &str) -> BTreeMap<String, bool> {
    let mut out: BTreeMap<String, bool> = BTreeMap::new();
    let mut stack: Vec<(usize, String)> = vec![];
    let mut list_indent: Option<usize> = None;
    for line in yaml.lines() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        if let Some(li) = list_indent {
            if indent > li {
                continue;
            }
            list_indent = None;
        }
        if trimmed.starts_with("- ") || trimmed == "-" {
            list_indent = Some(indent);
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            continue;
        };
        if !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        if let Some((_, parent)) = stack.last() {
            out.insert(parent.clone(), false);
        }
        let path = match stack.last() {
            Some((_, parent)) => format!("{parent}.{key}"),
            None => key.to_owned(),
        };
        out.insert(path.clone(), true);
        stack.push((indent, path));
    }
    out
}

/// Value paths named in `docs/helm.md`: `(documented in the values table, named anywhere)`.
/// A table cell's `.x.y` is relative: to the cell's first full path or one of its parents,
/// whichever makes an existing value (`operator.syncJobPod.serviceAccountName`,
/// `.imagePullSecrets`).
fn helm_md_values(
    md: &str,
    values: &BTreeMap<String, bool>,
) -> (BTreeSet<String>, BTreeMap<String, usize>) {
    let exists = |p: &str| value_exists(p, values);
    let tops: BTreeSet<&str> = values
        .keys()
        .filter(|k| !k.contains('.'))
        .map(String::as_str)
        .collect();
    let mut table = BTreeSet::new();
    let mut named = BTreeMap::new();
    for (n, line) in md.lines().enumerate() {
        // The values table's first cells.
        if let Some(cell) = line
            .strip_prefix("| `")
            .map(|r| r.split('|').next().unwrap_or(""))
        {
            let cell = format!("`{cell}");
            let tokens: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
            let full: Vec<&str> = tokens
                .iter()
                .copied()
                .filter(|t| !t.starts_with('.'))
                .collect();
            if full
                .first()
                .is_some_and(|t| tops.contains(t.split('.').next().unwrap_or("")))
            {
                for t in &tokens {
                    if !t.starts_with('.') {
                        table.insert(t.to_string());
                        continue;
                    }
                    let mut resolved = false;
                    for f in &full {
                        let segs: Vec<&str> = f.split('.').collect();
                        for k in 1..=segs.len() {
                            let candidate = format!("{}{t}", segs[..k].join("."));
                            if exists(&candidate) {
                                table.insert(candidate);
                                resolved = true;
                            }
                        }
                    }
                    if !resolved {
                        named.insert(format!("{}{t}", full.first().unwrap_or(&"")), n + 1);
                    }
                }
            }
        }
        // Every dotted path that starts with a top-level value, anywhere on the page.
        for (start, token) in runs(line) {
            let token = token.trim_end_matches('.');
            let top = token.split('.').next().unwrap_or("");
            let glued = line[..start].ends_with(['/', '-', '@', ':', '$']);
            let file = [".md", ".yaml", ".json", ".rs", ".io", ".sh", ".txt", ".tpl"]
                .iter()
                .any(|e| token.ends_with(e) || token.contains(&format!("{e}.")));
            if glued || file || !token.contains('.') || !tops.contains(top) {
                continue;
            }
            named.entry(token.to_owned()).or_insert(n + 1);
        }
    }
    for t in &table {
        named.entry(t.clone()).or_insert(0);
    }
    (table, named)
}

/// Maximal runs of `[A-Za-z0-9_.]` in `line`, with their byte offsets.
fn runs(line: &str) -> Vec<(usize, &str)> {
    let part = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    let mut out = vec![];
    let mut start = None;
    for (i, c) in line.char_indices().chain([(line.len(), ' ')]) {
        match (start, part(c)) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                out.push((s, &line[s..i]));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// A path is a value when `values.yaml` has it, or when it is under a leaf whose default is
/// free-form (`requests: {}` takes `requests.cpu`).
fn value_exists(path: &str, values: &BTreeMap<String, bool>) -> bool {
    if values.contains_key(path) {
        return true;
    }
    let segs: Vec<&str> = path.split('.').collect();
    (1..segs.len()).any(|k| values.get(&segs[..k].join(".")) == Some(&true))
}

/// Helm's own value (`global`, for subcharts): documented, never in `values.yaml`.
const HELM_VALUES: &[&str] = &["global"];

#[test]
fn every_chart_value_is_documented_and_every_documented_value_exists() {
    let values_file = repo_root().join("charts/sealed-volumes/values.yaml");
    let values = value_paths(&read(&values_file));
    assert!(
        values.get("node.learnedPrefetch") == Some(&true) && values.get("operator") == Some(&false),
        "the values parser found too little: {values:?}"
    );
    let (table, named) = helm_md_values(&read(&repo_root().join("docs/helm.md")), &values);

    // A leaf is documented when the table names it, a value above it, or one below it (a
    // free-form map documented by its keys).
    let undocumented: Vec<&String> = values
        .iter()
        .filter(|(_, leaf)| **leaf)
        .map(|(p, _)| p)
        .filter(|p| {
            !table.iter().any(|t| {
                t == *p || p.starts_with(&format!("{t}.")) || t.starts_with(&format!("{p}."))
            })
        })
        .collect();
    let unknown: Vec<String> = named
        .iter()
        .filter(|(p, _)| !HELM_VALUES.contains(&p.as_str()) && !value_exists(p, &values))
        .map(|(p, line)| format!("{p} (docs/helm.md:{line})"))
        .collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "values.yaml keys missing from docs/helm.md's values table: {undocumented:?}\n\
         values docs/helm.md names that values.yaml does not have: {unknown:?}"
    );
}

#[test]
fn the_parsers_read_the_shapes_they_meet() {
    let src = "struct A {\n    /// doc\n    #[arg(long, env = \"X\",\n          default_value_t = 1)]\n    \
               pub max_mount_memory: u64,\n    #[arg(long = \"allow-file-sources\")]\n    a: bool,\n    \
               #[arg(value_enum)]\n    shell: S,\n    #[arg(short, long, visible_alias = \"old-name\")]\n    \
               pub(crate) new_name: bool,\n}\n";
    let flags = clap_flags(&[(PathBuf::from("a.rs"), src.to_owned())]);
    for want in [
        "max-mount-memory",
        "allow-file-sources",
        "new-name",
        "old-name",
    ] {
        assert!(flags.contains(want), "{want} not in {flags:?}");
    }
    assert!(!flags.contains("shell"), "{flags:?}");

    let md = "Run `sealed pull --include '*.json'` or `kubectl wait --for=delete`.\n\
              ```sh\nhelm install x \\\n  --set a=b\nsealed-csi --cache-size 1Gi\n```\n";
    let flags: Vec<String> = doc_flags(&[("x.md".into(), md.into())])
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    assert_eq!(flags, ["include", "cache-size"]);

    let yaml = "a:\n  b: 1\n  c: {}\n  d:\n    - e: 1\n      f: 2\n  g: x\nh: []\n";
    let paths = value_paths(yaml);
    let leaves: Vec<&str> = paths
        .iter()
        .filter(|(_, l)| **l)
        .map(|(p, _)| p.as_str())
        .collect();
    assert_eq!(leaves, ["a.b", "a.c", "a.d", "a.g", "h"]);
    assert!(value_exists("a.c.cpu", &paths));
    assert!(!value_exists("a.x", &paths));
}
