//! The AWS CLI's shared files, for `s3://` stores: `AWS_PROFILE` (else `default`) names a
//! section of `~/.aws/credentials` (`[name]`) and `~/.aws/config` (`[profile name]`, or
//! `[default]`), as `aws` reads them. The files' paths follow `AWS_SHARED_CREDENTIALS_FILE`
//! and `AWS_CONFIG_FILE`. Environment variables (`AWS_ACCESS_KEY_ID`, `AWS_REGION`, ...) win
//! over the files, as they do for `aws`.
//!
//! The files are INI-like but not INI (a `s3 =` line opens indented sub-settings), so this
//! reads the flat `key = value` lines of one section and skips the indented ones.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The settings of one profile that a store uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AwsProfile {
    pub name: String,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
}

/// Settings the shared files can hold that this reader does not carry out: a profile that
/// needs them is refused with a message, rather than silently used without them.
const UNSUPPORTED: &[&str] = &[
    "role_arn",
    "credential_process",
    "sso_session",
    "sso_start_url",
    "web_identity_token_file",
];

/// The profile named by `AWS_PROFILE` (else `default`) from the shared files, if either file
/// has it. A profile named in `AWS_PROFILE` that neither file has is an error; a missing
/// `default` is not (the environment or the instance may supply credentials).
pub fn load() -> Result<Option<AwsProfile>> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let named = env("AWS_PROFILE").or_else(|| env("AWS_DEFAULT_PROFILE"));
    let home = dirs::home_dir();
    let file = |var: &str, rel: &str| {
        env(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(rel)))
    };
    let credentials = file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
    let config = file("AWS_CONFIG_FILE", "config");
    let name = named.clone().unwrap_or_else(|| "default".to_owned());
    let profile = from_files(&name, credentials.as_deref(), config.as_deref())?;
    if profile.is_none() && named.is_some() {
        return Err(Error::Other(format!(
            "AWS_PROFILE={name}: no profile of that name in {} or {} (list them with `aws \
             configure list-profiles`)",
            shown(credentials.as_deref()),
            shown(config.as_deref()),
        )));
    }
    Ok(profile)
}

fn shown(p: Option<&Path>) -> String {
    p.map_or_else(|| "(no home directory)".into(), |p| p.display().to_string())
}

/// Profile `name` from the two files (either may be absent). Credentials-file values win over
/// config-file values, as for `aws`.
pub fn from_files(
    name: &str,
    credentials: Option<&Path>,
    config: Option<&Path>,
) -> Result<Option<AwsProfile>> {
    let read = |p: Option<&Path>| -> Result<Option<String>> {
        let Some(p) = p else { return Ok(None) };
        match std::fs::read_to_string(p) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(p, e)),
        }
    };
    let config_section = if name == "default" {
        "default".to_owned()
    } else {
        format!("profile {name}")
    };
    let from_config = read(config)?.and_then(|text| section(&text, &config_section));
    let from_credentials = read(credentials)?.and_then(|text| section(&text, name));
    if from_config.is_none() && from_credentials.is_none() {
        return Ok(None);
    }
    let mut merged = from_config.unwrap_or_default();
    merged.extend(from_credentials.unwrap_or_default());
    if let Some(key) = UNSUPPORTED.iter().find(|k| merged.contains_key(**k)) {
        return Err(Error::Other(format!(
            "AWS profile '{name}' uses {key}, which sealed does not carry out: export the \
             resulting credentials (`eval \"$(aws configure export-credentials --profile {name} \
             --format env)\"`) or use a profile with aws_access_key_id"
        )));
    }
    let mut take = |k: &str| merged.remove(k).filter(|v| !v.is_empty());
    Ok(Some(AwsProfile {
        name: name.to_owned(),
        access_key_id: take("aws_access_key_id"),
        secret_access_key: take("aws_secret_access_key"),
        session_token: take("aws_session_token"),
        region: take("region"),
        endpoint_url: take("endpoint_url"),
    }))
}

/// The flat `key = value` lines of section `[wanted]` (the last such section wins per key).
fn section(text: &str, wanted: &str) -> Option<HashMap<String, String>> {
    let mut found: Option<HashMap<String, String>> = None;
    let mut inside = false;
    for line in text.lines() {
        // Indented lines continue a nested setting (`s3 =` and its sub-keys).
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let line = line.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(head) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = head.split_whitespace().collect::<Vec<_>>().join(" ") == wanted;
            if inside {
                found.get_or_insert_with(HashMap::new);
            }
            continue;
        }
        if !inside {
            continue;
        }
        if let (Some(map), Some((k, v))) = (found.as_mut(), line.split_once('=')) {
            map.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_merges_both_files_credentials_winning() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = D\n\n[ml]\naws_access_key_id = AK\n\
             aws_secret_access_key=SK\n",
        )
        .unwrap();
        std::fs::write(
            &config,
            "# comment\n[profile ml]\nregion = eu-west-1\nendpoint_url = http://127.0.0.1:9\n\
             s3 =\n  addressing_style = path\naws_access_key_id = from-config\n",
        )
        .unwrap();
        let p = from_files("ml", Some(&creds), Some(&config))
            .unwrap()
            .unwrap();
        assert_eq!(p.access_key_id.as_deref(), Some("AK"));
        assert_eq!(p.secret_access_key.as_deref(), Some("SK"));
        assert_eq!(p.region.as_deref(), Some("eu-west-1"));
        assert_eq!(p.endpoint_url.as_deref(), Some("http://127.0.0.1:9"));
        let d = from_files("default", Some(&creds), Some(&config))
            .unwrap()
            .unwrap();
        assert_eq!(d.access_key_id.as_deref(), Some("D"));
        assert_eq!(d.region, None);
        assert!(
            from_files("nope", Some(&creds), Some(&config))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_profile_that_needs_what_we_do_not_do_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config");
        std::fs::write(&config, "[profile sso]\nsso_session = corp\n").unwrap();
        let e = from_files("sso", None, Some(&config))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sso_session") && e.contains("export-credentials"),
            "{e}"
        );
    }
}
