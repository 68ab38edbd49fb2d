//! What a chart upgrade test needs besides the cluster: the previous chart from git history,
//! a second tag of an image already in the node's containerd (an upgrade to a new image
//! reference with the same bytes), and reader pods that read a volume once a second and say
//! in their log what they read.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};

use crate::{cluster_dir, repo_root};

/// The chart's directory in the repository.
pub const CHART: &str = "charts/sealed-volumes";

/// The commit whose chart is "the previous chart version", and why that one.
#[derive(Clone, Debug)]
pub struct PreviousChart {
    pub commit: String,
    pub why: String,
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(repo_root())
        .args(args)
        .output()
        .context("cannot run git")?;
    ensure!(
        out.status.success(),
        "git {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The previous chart version, from git history: `SEALED_PREVIOUS_CHART` (any revision) when
/// set; else the chart before the last change of `version:` in Chart.yaml; while the version
/// has never changed, the last chart that kept its CRDs in `crds/` (what every 0.1.0 install
/// before the CRDs became templates runs). `None` when there is no history here: not a git
/// checkout, or a shallow clone that cannot be deepened (a depth-1 CI clone is deepened once).
pub fn previous_chart() -> Result<Option<PreviousChart>> {
    if git(&["rev-parse", "--git-dir"]).is_err() {
        return Ok(None);
    }
    if let Ok(rev) = std::env::var("SEALED_PREVIOUS_CHART") {
        let commit = git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])?;
        return Ok(Some(PreviousChart {
            commit,
            why: format!("SEALED_PREVIOUS_CHART={rev}"),
        }));
    }
    if git(&["rev-parse", "--is-shallow-repository"])? == "true"
        && git(&["fetch", "--quiet", "--unshallow"]).is_err()
    {
        return Ok(None);
    }
    let chart_yaml = format!("{CHART}/Chart.yaml");
    // Every commit that changed the version line, newest first (the last one added the file).
    let changes = git(&["log", "--format=%H", "-G", "^version:", "--", &chart_yaml])?;
    let changes: Vec<&str> = changes.lines().collect();
    if changes.len() >= 2 {
        let newest = changes[0];
        let commit = git(&["rev-parse", &format!("{newest}^")])?;
        return Ok(Some(PreviousChart {
            why: format!("the chart before {newest:.10} changed the chart's version"),
            commit,
        }));
    }
    let templated = git(&[
        "log",
        "--format=%H",
        "--diff-filter=A",
        "--",
        &format!("{CHART}/templates/crds.yaml"),
    ])?;
    let Some(first) = templated.lines().last() else {
        bail!(
            "no commit added {CHART}/templates/crds.yaml and the chart's version never changed: no previous chart"
        );
    };
    let commit = git(&["rev-parse", &format!("{first}^")])?;
    Ok(Some(PreviousChart {
        why: format!(
            "the chart's version never changed: the last chart with its CRDs in crds/ (before \
             {first:.10} made them templates)"
        ),
        commit,
    }))
}

/// Writes the chart as it was at `commit` into `dir` (which then holds Chart.yaml).
pub fn export_chart(commit: &str, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let archive = Command::new("git")
        .current_dir(repo_root())
        .args(["archive", "--format=tar", commit, CHART])
        .output()
        .context("cannot run git archive")?;
    ensure!(
        archive.status.success(),
        "git archive {commit} {CHART} failed: {}",
        String::from_utf8_lossy(&archive.stderr).trim()
    );
    let mut tar = Command::new("tar")
        .args(["-x", "--strip-components=2", "-C"])
        .arg(dir)
        .stdin(Stdio::piped())
        .spawn()
        .context("cannot run tar")?;
    {
        use std::io::Write;
        let mut stdin = tar.stdin.take().context("tar has no stdin")?;
        stdin.write_all(&archive.stdout)?;
    }
    ensure!(tar.wait()?.success(), "tar -x of the chart failed");
    ensure!(
        dir.join("Chart.yaml").is_file(),
        "the chart at {commit} has no Chart.yaml"
    );
    Ok(())
}

fn ctr(args: &[&str]) -> Result<()> {
    let sock = cluster_dir().join("run/containerd.sock");
    let out = Command::new("ctr")
        .arg("--address")
        .arg(&sock)
        .args(["-n", "k8s.io"])
        .args(args)
        .output()
        .context("cannot run ctr")?;
    ensure!(
        out.status.success(),
        "ctr {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Gives image `from` (in the first node's containerd) the second reference `to`.
pub fn tag_image(from: &str, to: &str) -> Result<()> {
    ctr(&["images", "tag", "--force", from, to])
}

/// Removes image references from the first node's containerd (errors ignored).
pub fn remove_images(refs: &[String]) {
    let mut args = vec!["images", "rm"];
    args.extend(refs.iter().map(String::as_str));
    let _ = ctr(&args);
}

/// The mount point of the volume in a reader pod.
pub const MOUNT: &str = "/model";

/// What a reader pod runs (busybox `sh -c`): once a second it opens and reads two files of the
/// volume and prints `read N EPOCH ok CONTENT SHA256` (the content of `version.txt`, the
/// SHA-256 of `data.bin`), or `read N EPOCH failed: ERROR`. Every read opens the files anew
/// (a FUSE request to the node plugin each time).
pub const READER_SCRIPT: &str = r#"i=0
while :; do
  i=$((i+1)); v=""; s=""
  if v=$(cat /model/version.txt 2>&1) && s=$(sha256sum /model/data.bin 2>&1); then
    echo "read $i $(date +%s) ok $v ${s%% *}"
  else
    echo "read $i $(date +%s) failed: $v $s" | tr '\n' ' '; echo
  fi
  sleep 1
done"#;

/// Where a [`Gate`] directory is mounted in a gated reader pod.
pub const GATE_MOUNT: &str = "/gate";

/// What a reader pod that finishes runs: [`READER_SCRIPT`]'s read once a second, until the
/// [`Gate`] mounted at [`GATE_MOUNT`] is open (looked at after each read, so every pod reads
/// at least once); then it exits 0. A Job's pods run it: the first ones keep running (and
/// reading) until the test opens the gate, so the pods that replace them are created after
/// that.
pub fn gated_reader_script() -> String {
    format!(
        r#"i=0
while :; do
  i=$((i+1)); v=""; s=""
  if v=$(cat {MOUNT}/version.txt 2>&1) && s=$(sha256sum {MOUNT}/data.bin 2>&1); then
    echo "read $i $(date +%s) ok $v ${{s%% *}}"
  else
    echo "read $i $(date +%s) failed: $v $s" | tr '\n' ' '; echo
  fi
  [ -e {GATE_MOUNT}/open ] && exit 0
  sleep 1
done"#
    )
}

/// A one-bit signal to pods: a host directory they mount (`hostPath`; every node of the test
/// cluster runs on this machine) in which [`Gate::open`] creates the file `open`. (A gate
/// the pods asked over HTTP failed: the busybox image's `wget` crashed in the pods.) The
/// directory is removed when the gate drops.
pub struct Gate {
    dir: std::path::PathBuf,
}

impl Gate {
    /// A closed gate in a fresh directory under the system's temporary directory.
    pub fn new() -> Result<Gate> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("sealed-e2e-gate-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the gate {}", dir.display()))?;
        Ok(Gate { dir })
    }

    /// The host directory pods mount at [`GATE_MOUNT`].
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// True once [`Gate::open`] ran.
    pub fn is_open(&self) -> bool {
        self.dir.join("open").exists()
    }

    /// From now on the pods see the gate open.
    pub fn open(&self) -> Result<()> {
        std::fs::write(self.dir.join("open"), b"go\n")
            .with_context(|| format!("cannot open the gate {}", self.dir.display()))
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One line of a reader's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    /// The reader's count (1, 2, ...).
    pub n: u64,
    /// Seconds since the epoch when it read.
    pub at: u64,
    /// `Ok("CONTENT SHA256")` or `Err(the error printed)`.
    pub result: Result<String, String>,
}

/// The reads in a reader's log, in order (other lines skipped).
pub fn reads(log: &str) -> Vec<Read> {
    log.lines().filter_map(parse_read).collect()
}

fn parse_read(line: &str) -> Option<Read> {
    let rest = line.strip_prefix("read ")?;
    let (n, rest) = rest.split_once(' ')?;
    let (at, rest) = rest.split_once(' ')?;
    let result = if let Some(ok) = rest.strip_prefix("ok ") {
        Ok(ok.trim().to_string())
    } else {
        Err(rest
            .strip_prefix("failed:")
            .unwrap_or(rest)
            .trim()
            .to_string())
    };
    Some(Read {
        n: n.parse().ok()?,
        at: at.parse().ok()?,
        result,
    })
}

/// Seconds since the epoch, as the readers print them.
pub fn epoch_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_is_closed_until_opened_and_the_script_looks_at_it() {
        let gate = Gate::new().expect("gate");
        assert!(gate.dir().is_dir());
        assert!(!gate.is_open());
        gate.open().expect("open");
        assert!(gate.is_open());
        let script = gated_reader_script();
        assert!(
            script.contains(&format!("[ -e {GATE_MOUNT}/open ]")) && script.contains("${s%% *}")
        );
        let dir = gate.dir().to_path_buf();
        drop(gate);
        assert!(!dir.exists());
    }

    #[test]
    fn reads_are_parsed_and_failures_kept() {
        let log = "noise\nread 1 1700000000 ok v1-7 abc\nread 2 1700000001 failed: cat: can't open '/model/version.txt': Transport endpoint is not connected \nread x 1 ok y\n";
        assert_eq!(
            reads(log),
            vec![
                Read {
                    n: 1,
                    at: 1_700_000_000,
                    result: Ok("v1-7 abc".into())
                },
                Read {
                    n: 2,
                    at: 1_700_000_001,
                    result: Err(
                        "cat: can't open '/model/version.txt': Transport endpoint is not connected"
                            .into()
                    )
                },
            ]
        );
    }
}
