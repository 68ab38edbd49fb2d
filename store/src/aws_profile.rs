//! The AWS CLI's shared files, for `s3://` stores: `AWS_PROFILE` (else `default`) names a
//! section of `~/.aws/credentials` (`[name]`) and `~/.aws/config` (`[profile name]`, or
//! `[default]`), as `aws` reads them. The files' paths follow `AWS_SHARED_CREDENTIALS_FILE`
//! and `AWS_CONFIG_FILE`. Environment variables (`AWS_ACCESS_KEY_ID`, `AWS_REGION`, ...) win
//! over the files, as they do for `aws`.
//!
//! The files are INI-like but not INI (a `s3 =` line opens indented sub-settings), so this
//! reads the flat `key = value` lines of one section and skips the indented ones.
//!
//! A profile without keys of its own says where they come from ([`AwsProfile::source`],
//! carried out by [`crate::aws_credentials`]): `credential_process`, an SSO profile (through
//! `aws configure export-credentials`), or `role_arn` with `source_profile` or
//! `credential_source = Environment` (STS AssumeRole, chains of them too).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::aws_credentials::{AssumeRole, CredentialSource};
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
    /// Where the credentials come from when they are not the keys above.
    pub source: Option<CredentialSource>,
}

/// Source profiles followed at most (role chains, and a loop's end).
const MAX_CHAIN: usize = 5;

/// Settings the shared files can hold that this reader does not carry out: a profile that
/// needs them is refused with a message, rather than silently used without them.
/// (`AWS_WEB_IDENTITY_TOKEN_FILE` with `AWS_ROLE_ARN` in the environment, as IRSA sets them,
/// is object_store's own.)
const UNSUPPORTED: &[(&str, &str)] = &[(
    "web_identity_token_file",
    "set AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN instead (EKS IRSA sets both)",
)];

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
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    from_files_with_env(name, credentials, config, &env)
}

/// [`from_files`] with `env` for the environment it reads (the STS endpoint and region of a
/// role: `AWS_ENDPOINT_URL_STS`, `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_DEFAULT_REGION`).
pub fn from_files_with_env(
    name: &str,
    credentials: Option<&Path>,
    config: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<AwsProfile>> {
    from_files_at(name, credentials, config, env, 0)
}

fn from_files_at(
    name: &str,
    credentials: Option<&Path>,
    config: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
    depth: usize,
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
    if let Some((key, hint)) = UNSUPPORTED.iter().find(|(k, _)| merged.contains_key(*k)) {
        return Err(Error::Other(format!(
            "AWS profile '{name}' uses {key}, which sealed does not carry out: {hint}, or \
             export the resulting credentials (`eval \"$(aws configure export-credentials \
             --profile {name} --format env)\"`)"
        )));
    }
    let mut take = |k: &str| merged.remove(k).filter(|v| !v.is_empty());
    let mut profile = AwsProfile {
        name: name.to_owned(),
        access_key_id: take("aws_access_key_id"),
        secret_access_key: take("aws_secret_access_key"),
        session_token: take("aws_session_token"),
        region: take("region"),
        endpoint_url: take("endpoint_url"),
        source: None,
    };
    let refuse = |what: String| Err(Error::Other(format!("AWS profile '{name}': {what}")));
    let sso = take("sso_session").is_some() || take("sso_start_url").is_some();
    if let Some(role_arn) = take("role_arn") {
        let source = match (take("source_profile"), take("credential_source")) {
            (Some(_), Some(_)) => {
                return refuse("has both source_profile and credential_source".into());
            }
            (Some(source), None) if source == name => match static_source(&profile) {
                Some(keys) => keys,
                None => return refuse(format!("source_profile = {name} without keys")),
            },
            (Some(source), None) => {
                if depth + 1 >= MAX_CHAIN {
                    return refuse(format!(
                        "source_profile chain longer than {MAX_CHAIN} (a loop?)"
                    ));
                }
                let Some(from) = from_files_at(&source, credentials, config, env, depth + 1)?
                else {
                    return refuse(format!("source_profile {source} is in neither file"));
                };
                match from.source.clone().or_else(|| static_source(&from)) {
                    Some(s) => s,
                    None => {
                        return refuse(format!("source_profile {source} has no credentials"));
                    }
                }
            }
            (None, Some(cs)) if cs == "Environment" => CredentialSource::Environment,
            (None, Some(cs)) => {
                return refuse(format!(
                    "credential_source = {cs} is not carried out (Environment is); on EC2, \
                     EKS or ECS the instance, IRSA or Pod Identity credentials are used \
                     without a profile"
                ));
            }
            (None, None) => {
                return refuse("role_arn needs source_profile or credential_source".into());
            }
        };
        let region = profile
            .region
            .clone()
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".to_owned());
        let sts_endpoint = env("AWS_ENDPOINT_URL_STS")
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| profile.endpoint_url.clone())
            .unwrap_or_else(|| format!("https://sts.{region}.amazonaws.com"));
        let duration_seconds = match take("duration_seconds") {
            None => None,
            Some(d) => match d.parse::<u32>() {
                Ok(d) if (900..=43_200).contains(&d) => Some(d),
                _ => return refuse(format!("duration_seconds = {d}: 900 to 43200")),
            },
        };
        let session_name = take("role_session_name").unwrap_or_else(|| {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            format!("sealed-{secs}")
        });
        profile.source = Some(CredentialSource::AssumeRole(Box::new(AssumeRole {
            role_arn,
            session_name,
            external_id: take("external_id"),
            duration_seconds,
            sts_endpoint,
            region,
            source,
        })));
    } else if let Some(command) = take("credential_process") {
        profile.source = Some(CredentialSource::Process(command));
    } else if sso && profile.access_key_id.is_none() {
        // The AWS CLI holds the SSO login (`aws sso login`) and refreshes it.
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.@+".contains(c))
        {
            return refuse("an SSO profile name sealed can pass to the aws CLI".into());
        }
        profile.source = Some(CredentialSource::Process(format!(
            "aws configure export-credentials --profile '{name}' --format process"
        )));
    }
    Ok(Some(profile))
}

/// A profile's own keys as a source, if it has both.
fn static_source(p: &AwsProfile) -> Option<CredentialSource> {
    Some(CredentialSource::Static {
        access_key_id: p.access_key_id.clone()?,
        secret_access_key: p.secret_access_key.clone()?,
        session_token: p.session_token.clone(),
    })
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
        std::fs::write(
            &config,
            "[profile wi]\nweb_identity_token_file = /t\nrole_arn = arn:aws:iam::1:role/r\n\
             [profile imds]\nrole_arn = arn:aws:iam::1:role/r\ncredential_source = Ec2InstanceMetadata\n\
             [profile lone]\nrole_arn = arn:aws:iam::1:role/r\n\
             [profile loop]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = loop2\n\
             [profile loop2]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = loop\n",
        )
        .unwrap();
        for (name, says) in [
            ("wi", "AWS_WEB_IDENTITY_TOKEN_FILE"),
            ("imds", "Ec2InstanceMetadata"),
            ("lone", "source_profile or credential_source"),
            ("loop", "chain longer"),
        ] {
            let e = from_files(name, None, Some(&config))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{name}: {e}");
        }
    }

    /// What the AWS CLI does with a profile that has no keys of its own: the source each
    /// becomes (carried out by crate::aws_credentials, tested against moto in
    /// tests/aws_profiles.rs).
    #[test]
    fn roles_processes_and_sso_profiles_become_sources() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(
            &creds,
            "[base]\naws_access_key_id = AK\naws_secret_access_key = SK\n",
        )
        .unwrap();
        std::fs::write(
            &config,
            "[profile role]\nrole_arn = arn:aws:iam::123456789012:role/reader\n\
             source_profile = base\nregion = eu-west-1\nexternal_id = x1\n\
             duration_seconds = 1800\nrole_session_name = me\n\
             [profile chained]\nrole_arn = arn:aws:iam::123456789012:role/second\n\
             source_profile = role\n\
             [profile proc]\ncredential_process = /usr/bin/get-creds --x\n\
             [profile corp]\nsso_session = corp\nsso_account_id = 1\nsso_role_name = r\n\
             [profile env]\nrole_arn = arn:aws:iam::1:role/r\ncredential_source = Environment\n",
        )
        .unwrap();
        let no_env = |_: &str| None;
        let get = |name: &str| {
            from_files_with_env(name, Some(&creds), Some(&config), &no_env)
                .unwrap()
                .unwrap()
                .source
                .unwrap()
        };
        let base = CredentialSource::Static {
            access_key_id: "AK".into(),
            secret_access_key: "SK".into(),
            session_token: None,
        };
        let role = AssumeRole {
            role_arn: "arn:aws:iam::123456789012:role/reader".into(),
            session_name: "me".into(),
            external_id: Some("x1".into()),
            duration_seconds: Some(1800),
            sts_endpoint: "https://sts.eu-west-1.amazonaws.com".into(),
            region: "eu-west-1".into(),
            source: base,
        };
        assert_eq!(
            get("role"),
            CredentialSource::AssumeRole(Box::new(role.clone()))
        );
        let CredentialSource::AssumeRole(chained) = get("chained") else {
            panic!("not a role")
        };
        assert_eq!(chained.source, CredentialSource::AssumeRole(Box::new(role)));
        assert_eq!(chained.sts_endpoint, "https://sts.us-east-1.amazonaws.com");
        assert_eq!(
            get("proc"),
            CredentialSource::Process("/usr/bin/get-creds --x".into())
        );
        assert_eq!(
            get("corp"),
            CredentialSource::Process(
                "aws configure export-credentials --profile 'corp' --format process".into()
            )
        );
        let CredentialSource::AssumeRole(env_role) = get("env") else {
            panic!("not a role")
        };
        assert_eq!(env_role.source, CredentialSource::Environment);
        // The environment's STS endpoint wins (moto in tests, a VPC endpoint in production).
        let with_env =
            |k: &str| (k == "AWS_ENDPOINT_URL_STS").then(|| "http://127.0.0.1:5000".to_owned());
        let p = from_files_with_env("role", Some(&creds), Some(&config), &with_env)
            .unwrap()
            .unwrap();
        let Some(CredentialSource::AssumeRole(r)) = p.source else {
            panic!("not a role")
        };
        assert_eq!(r.sts_endpoint, "http://127.0.0.1:5000");
    }
}
