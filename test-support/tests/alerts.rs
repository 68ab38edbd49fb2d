//! The chart's alert rules (`charts/sealed-volumes/files/alerts.yaml`) against their runbooks
//! and their `promtool test rules` cases (`charts/tests/alerts.test.yaml`): every alert links
//! a section of `docs/operations.md` that exists, every alert has a case in which it fires
//! (the `absent()` ones included), and promtool passes them all.
//!
//! promtool comes from `hack/build-test-tools.sh`; without it the promtool part prints why it
//! is skipped, unless `SEALED_REQUIRE_SERVERS=1` makes that a failure.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use sealed_test_support::servers::{missing, repo_root};

const RULES: &str = "charts/sealed-volumes/files/alerts.yaml";
const CASES: &str = "charts/tests/alerts.test.yaml";
const RUNBOOKS: &str = "docs/operations.md";
const RUNBOOK_URL: &str =
    "https://github.com/sealed-volumes/sealed-volumes/blob/main/docs/operations.md#";

fn read(path: &str) -> String {
    let file: PathBuf = repo_root().join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

/// The value after `key:` on a trimmed YAML line (`- alert: X`, `runbook_url: U`).
fn value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = line.trim().trim_start_matches("- ").strip_prefix(key)?;
    Some(rest.strip_prefix(':')?.trim().trim_matches('"'))
}

/// Each alert of the rules file with its `runbook_url` (None when it has none).
fn alerts(rules: &str) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in rules.lines() {
        if let Some(name) = value(line, "alert") {
            current = Some(name.to_owned());
            out.insert(name.to_owned(), None);
        } else if let (Some(url), Some(name)) = (value(line, "runbook_url"), &current) {
            out.insert(name.clone(), Some(url.to_owned()));
        }
    }
    out
}

/// GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(markdown: &str) -> BTreeSet<String> {
    markdown
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect()
}

/// Alerts that some case of the promtool file expects to fire (an `alertname:` followed,
/// before the next case, by a non-empty `exp_alerts:`).
fn alerts_expected_to_fire(cases: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut current: Option<&str> = None;
    for line in cases.lines() {
        if value(line, "eval_time").is_some() {
            current = None;
        } else if let Some(name) = value(line, "alertname") {
            current = Some(name);
        } else if let (Some(list), Some(name)) = (value(line, "exp_alerts"), current)
            && list != "[]"
        {
            out.insert(name.to_owned());
        }
    }
    out
}

#[test]
fn every_alert_links_a_runbook_that_exists() {
    let alerts = alerts(&read(RULES));
    assert!(alerts.len() >= 10, "too few alerts parsed: {alerts:?}");
    let anchors = anchors(&read(RUNBOOKS));
    let mut problems = vec![];
    for (name, url) in &alerts {
        match url.as_deref().map(|u| u.strip_prefix(RUNBOOK_URL)) {
            None => problems.push(format!("{name} has no runbook_url")),
            Some(None) => problems.push(format!("{name}'s runbook_url is not {RUNBOOK_URL}…")),
            Some(Some(a)) if !anchors.contains(a) => problems.push(format!(
                "{name} links #{a}, a heading {RUNBOOKS} does not have"
            )),
            Some(Some(_)) => {}
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_alert_has_a_promtool_case_and_they_pass() {
    let rules = read(RULES);
    let alerts: BTreeSet<String> = alerts(&rules).into_keys().collect();
    let tested = alerts_expected_to_fire(&read(CASES));
    let untested: Vec<&String> = alerts.difference(&tested).collect();
    assert!(
        untested.is_empty(),
        "alerts without a case in {CASES} where they fire: {untested:?}"
    );
    // Silence is down: the operator's and the node plugin's health alerts fire on absent series.
    assert!(rules.contains("absent(sealed_operator_leader)"), "{RULES}");
    assert!(rules.contains("absent(sealed_csi_build_info)"), "{RULES}");

    if missing("promtool", "hack/build-test-tools.sh") {
        return;
    }
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(repo_root().join(CASES))
        .output()
        .expect("cannot run promtool");
    assert!(
        out.status.success(),
        "promtool test rules {CASES}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn parsers_read_the_files_shapes() {
    let rules = "groups:\n  - name: g\n    rules:\n      - alert: A\n        annotations:\n          \
                 runbook_url: https://x#a\n      - alert: B\n";
    let got = alerts(rules);
    assert_eq!(got["A"].as_deref(), Some("https://x#a"));
    assert_eq!(got["B"], None);
    assert_eq!(
        anchor(" A version will not mount"),
        "a-version-will-not-mount"
    );
    assert_eq!(anchor("SealedVolumesNoLeader"), "sealedvolumesnoleader");
    let cases = "  - eval_time: 1m\n    alertname: A\n  - eval_time: 2m\n    alertname: B\n    \
                 exp_alerts:\n      - exp_labels: {}\n  - eval_time: 3m\n    alertname: C\n    \
                 exp_alerts: []\n";
    assert_eq!(
        alerts_expected_to_fire(cases),
        BTreeSet::from(["B".to_owned()])
    );
}
