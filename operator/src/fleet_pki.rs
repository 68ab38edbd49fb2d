//! Certificates and shared secrets the operator makes and keeps in Secrets of its own
//! namespace: the peer tier's fleet token, CA and fleet certificate (docs/peer.md), and any
//! other serving certificate (an admission webhook's) through the same small API:
//!
//! - [`ensure_ca`] makes (once) or reads a CA kept in a Secret only the operator reads
//!   (`tls.crt`, `tls.key`);
//! - [`ensure_leaf`] makes or renews a `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`,
//!   `ca.crt`) signed by that CA for a [`LeafSpec`], renewed when a third of its life is left
//!   or when the CA changed;
//! - [`ensure_token`] makes (once) an `Opaque` Secret with a random token.
//!
//! Made by the operator rather than templated by Helm (as the attestation key is) so that a
//! GitOps render (`helm template`, which cannot `lookup`) or a `helm upgrade` never rotates
//! them. Two operators starting at once agree: a create that conflicts reads the winner's,
//! a renewal that conflicts is tried again at the next check. Rotating: delete the Secret;
//! [`keep_fleet`] makes a new one within a check, and the node plugins re-read their
//! mounted copy (`sealed_peer::reload`) without a restart.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Datelike as _, Utc};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{PostParams, ResourceExt as _};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use crate::error::{Error, Result};

/// Label on every Secret the operator makes (and so may renew).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "sealed-operator");
/// Annotation with a leaf's expiry (RFC 3339), read to decide its renewal.
pub const NOT_AFTER_ANNOTATION: &str = "sealedvolumes.io/not-after";
/// Annotation with a CA's common name: the issuer is rebuilt from it and the stored key.
const COMMON_NAME_ANNOTATION: &str = "sealedvolumes.io/common-name";
/// Annotation saying what a Secret is for and what deleting it does.
const PURPOSE_ANNOTATION: &str = "sealedvolumes.io/purpose";
/// Validity of a CA the operator makes.
pub const CA_DAYS: u32 = 3650;
/// Bytes of randomness in a token (hex: twice as many characters).
const TOKEN_BYTES: usize = 32;

/// A CA: its certificate (PEM) and what signs with it.
pub struct Ca {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// What a certificate is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// A TLS server (an admission webhook).
    Server,
    /// Server and client alike (the peer tier's one fleet certificate, mutual TLS).
    ServerAndClient,
}

/// A certificate to issue: the DNS names it is for, its use and its validity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeafSpec {
    pub dns_names: Vec<String>,
    pub usage: Usage,
    pub days: u32,
}

/// A certificate issued by a [`Ca`].
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: DateTime<Utc>,
}

fn pki_error(object: &str, e: impl std::fmt::Display) -> Error {
    Error::Invalid {
        object: object.into(),
        message: e.to_string(),
    }
}

fn ca_params(common_name: &str, days: u32) -> Result<CertificateParams> {
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(|e| pki_error("CA parameters", e))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut params, Utc::now(), days)?;
    Ok(params)
}

/// Valid from a day before `now` (clocks differ) to `days` after it; that end.
fn set_validity(
    params: &mut CertificateParams,
    now: DateTime<Utc>,
    days: u32,
) -> Result<DateTime<Utc>> {
    let day = |t: DateTime<Utc>| {
        u8::try_from(t.month())
            .ok()
            .zip(u8::try_from(t.day()).ok())
            .map(|(m, d)| rcgen::date_time_ymd(t.year(), m, d))
    };
    let start = now
        .checked_sub_signed(chrono::Duration::days(1))
        .and_then(day);
    let end = now.checked_add_signed(chrono::Duration::days(i64::from(days)));
    match (start, end.and_then(day), end) {
        (Some(s), Some(e), Some(t)) => {
            (params.not_before, params.not_after) = (s, e);
            Ok(t)
        }
        _ => Err(pki_error(
            "certificate validity",
            format!("{days} days from now"),
        )),
    }
}

impl Ca {
    /// A new CA named `common_name`, valid `days`.
    pub fn generate(common_name: &str, days: u32) -> Result<Ca> {
        let key = KeyPair::generate().map_err(|e| pki_error("CA key", e))?;
        let params = ca_params(common_name, days)?;
        let cert = params
            .self_signed(&key)
            .map_err(|e| pki_error("CA certificate", e))?;
        Ok(Ca {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// A CA from its certificate and key (PEM) and the common name it was made with.
    pub fn from_pem(common_name: &str, cert_pem: &str, key_pem: &str) -> Result<Ca> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| pki_error("CA key", e))?;
        Ok(Ca {
            cert_pem: cert_pem.to_owned(),
            key_pem: key_pem.to_owned(),
            issuer: Issuer::new(ca_params(common_name, CA_DAYS)?, key),
        })
    }

    /// The CA certificate (PEM): what clients trust (a `ca.crt`, a webhook's `caBundle`).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for `spec`, with a new key.
    pub fn issue(&self, spec: &LeafSpec) -> Result<Issued> {
        let object = "certificate";
        let mut params =
            CertificateParams::new(spec.dns_names.clone()).map_err(|e| pki_error(object, e))?;
        if let Some(first) = spec.dns_names.first() {
            params.distinguished_name = DistinguishedName::new();
            params.distinguished_name.push(DnType::CommonName, first);
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = match spec.usage {
            Usage::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Usage::ServerAndClient => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        };
        let end = set_validity(&mut params, Utc::now(), spec.days)?;
        let key = KeyPair::generate().map_err(|e| pki_error(object, e))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| pki_error(object, e))?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after: end,
        })
    }
}

fn meta(namespace: &str, name: &str, purpose: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(namespace.into()),
        labels: Some(BTreeMap::from([(
            MANAGED_BY.0.to_string(),
            MANAGED_BY.1.to_string(),
        )])),
        annotations: Some(BTreeMap::from([(
            PURPOSE_ANNOTATION.to_string(),
            purpose.to_string(),
        )])),
        ..Default::default()
    }
}

fn secret_data(pairs: &[(&str, &str)]) -> BTreeMap<String, ByteString> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
        .collect()
}

/// A Secret's text value, if it has one.
pub fn secret_text<'a>(secret: &'a Secret, key: &str) -> Option<&'a str> {
    secret
        .data
        .as_ref()?
        .get(key)
        .and_then(|b| std::str::from_utf8(&b.0).ok())
}

/// Creates `secret` unless a Secret of its name exists; either way, the one that is there
/// now (a concurrent creator's, on a conflict).
pub async fn create_or_read(secrets: &Api<Secret>, secret: &Secret) -> Result<Secret> {
    let name = secret.name_any();
    if let Some(existing) = secrets.get_opt(&name).await? {
        return Ok(existing);
    }
    match secrets.create(&PostParams::default(), secret).await {
        Ok(s) => {
            tracing::info!(secret = %name, "created");
            Ok(s)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(secrets.get(&name).await?),
        Err(e) => Err(e.into()),
    }
}

/// Reads the CA in Secret `namespace/name`, making it (named `common_name`, valid
/// [`CA_DAYS`]) when it does not exist.
pub async fn ensure_ca(
    client: &Client,
    namespace: &str,
    name: &str,
    common_name: &str,
) -> Result<Ca> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let object = format!("Secret {namespace}/{name}");
    let existing = secrets.get_opt(name).await?;
    let secret = match existing {
        Some(s) => s,
        None => {
            let ca = Ca::generate(common_name, CA_DAYS)?;
            let mut metadata = meta(
                namespace,
                name,
                "A CA the operator signs certificates with (only the operator reads it). \
                 Deleting it makes the operator issue a new CA and new certificates.",
            );
            if let Some(a) = metadata.annotations.as_mut() {
                a.insert(COMMON_NAME_ANNOTATION.into(), common_name.into());
            }
            let secret = Secret {
                metadata,
                data: Some(secret_data(&[
                    ("tls.crt", &ca.cert_pem),
                    ("tls.key", &ca.key_pem),
                ])),
                type_: Some("kubernetes.io/tls".into()),
                ..Default::default()
            };
            create_or_read(&secrets, &secret).await?
        }
    };
    let stored_name = secret
        .annotations()
        .get(COMMON_NAME_ANNOTATION)
        .map(String::as_str)
        .unwrap_or(common_name);
    match (
        secret_text(&secret, "tls.crt"),
        secret_text(&secret, "tls.key"),
    ) {
        (Some(cert), Some(key)) => Ca::from_pem(stored_name, cert, key),
        _ => Err(pki_error(&object, "has no tls.crt and tls.key")),
    }
}

/// Why the leaf in `secret` must be (re)issued, if it must.
fn leaf_outdated(secret: &Secret, ca: &Ca, spec: &LeafSpec, now: DateTime<Utc>) -> Option<String> {
    if secret_text(secret, "ca.crt") != Some(ca.cert_pem()) {
        return Some("its CA changed".into());
    }
    if secret_text(secret, "tls.crt").is_none() || secret_text(secret, "tls.key").is_none() {
        return Some("it has no tls.crt and tls.key".into());
    }
    let not_after = secret
        .annotations()
        .get(NOT_AFTER_ANNOTATION)
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));
    let Some(not_after) = not_after else {
        return Some(format!("it has no {NOT_AFTER_ANNOTATION} annotation"));
    };
    // Renewed with a third of its life left: a plugin that misses one check still has time.
    let third = chrono::Duration::days(i64::from(spec.days / 3));
    (not_after.signed_duration_since(now) < third).then(|| format!("it expires at {not_after}"))
}

/// Makes Secret `namespace/name` (`kubernetes.io/tls`: `tls.crt`, `tls.key`, `ca.crt`) with
/// a certificate for `spec` signed by `ca`, or renews it when it is the operator's and
/// outdated (CA changed, a third of its life left). A Secret the operator did not make is
/// left alone. Whether it was written.
pub async fn ensure_leaf(
    client: &Client,
    namespace: &str,
    name: &str,
    ca: &Ca,
    spec: &LeafSpec,
    purpose: &str,
) -> Result<bool> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let existing = secrets.get_opt(name).await?;
    let reason = match &existing {
        None => "it does not exist".to_string(),
        Some(s) if s.labels().get(MANAGED_BY.0).map(String::as_str) != Some(MANAGED_BY.1) => {
            return Ok(false);
        }
        Some(s) => match leaf_outdated(s, ca, spec, Utc::now()) {
            Some(reason) => reason,
            None => return Ok(false),
        },
    };
    let issued = ca.issue(spec)?;
    let mut metadata = meta(namespace, name, purpose);
    if let Some(a) = metadata.annotations.as_mut() {
        a.insert(NOT_AFTER_ANNOTATION.into(), issued.not_after.to_rfc3339());
    }
    let data = secret_data(&[
        ("tls.crt", &issued.cert_pem),
        ("tls.key", &issued.key_pem),
        ("ca.crt", ca.cert_pem()),
    ]);
    match existing {
        None => {
            let secret = Secret {
                metadata,
                data: Some(data),
                type_: Some("kubernetes.io/tls".into()),
                ..Default::default()
            };
            create_or_read(&secrets, &secret).await?;
        }
        Some(mut secret) => {
            // Replaced at the version read: a concurrent renewal makes this one conflict.
            secret.metadata.annotations = metadata.annotations;
            secret.data = Some(data);
            match secrets.replace(name, &PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
    }
    tracing::info!(secret = %format!("{namespace}/{name}"), %reason, not_after = %issued.not_after, "issued a certificate");
    Ok(true)
}

/// Makes Secret `namespace/name` with a random `key` (hex, printable) when it does not exist.
pub async fn ensure_token(
    client: &Client,
    namespace: &str,
    name: &str,
    key: &str,
    purpose: &str,
) -> Result<()> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    if secrets.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let token = hex::encode(crate::attestation::random_bytes::<TOKEN_BYTES>()?);
    let secret = Secret {
        metadata: meta(namespace, name, purpose),
        data: Some(secret_data(&[(key, &token)])),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    create_or_read(&secrets, &secret).await?;
    Ok(())
}

/// The peer tier's Secrets the operator keeps (`--peer-token-secret`, `--peer-tls-secret`).
#[derive(Clone, Debug, Default)]
pub struct FleetSecrets {
    /// Secret with key `token`; `None`: not the operator's to make.
    pub token: Option<String>,
    /// `kubernetes.io/tls` Secret with the fleet certificate; its CA is kept in
    /// `<name>-ca`. `None`: not the operator's to make.
    pub tls: Option<String>,
    /// The fleet name in the certificate (`--peer-tls-name` of the plugins).
    pub tls_name: String,
    /// Validity of the fleet certificate.
    pub tls_days: u32,
}

/// How often [`keep_fleet`] checks the Secrets.
pub const FLEET_CHECK: Duration = Duration::from_secs(60);

impl FleetSecrets {
    /// Makes or renews the Secrets once.
    pub async fn ensure(&self, client: &Client, namespace: &str) -> Result<()> {
        if let Some(name) = &self.token {
            ensure_token(
                client,
                namespace,
                name,
                "token",
                "The node plugins' peer token (docs/peer.md). Deleting it makes the operator \
                 make a new one; the plugins pick it up without a restart.",
            )
            .await?;
        }
        if let Some(name) = &self.tls {
            let ca_name = format!("{name}-ca");
            let ca = ensure_ca(client, namespace, &ca_name, &format!("{name} CA")).await?;
            let spec = LeafSpec {
                dns_names: vec![self.tls_name.clone()],
                usage: Usage::ServerAndClient,
                days: self.tls_days.max(3),
            };
            ensure_leaf(
                client,
                namespace,
                name,
                &ca,
                &spec,
                "The node plugins' fleet certificate for mutual TLS between peers \
                 (docs/peer.md); renewed by the operator, re-read by the plugins.",
            )
            .await?;
        }
        Ok(())
    }
}

/// Keeps the fleet's Secrets: made or renewed at once and then every [`FLEET_CHECK`] (a
/// deleted one comes back, new, within a check). Failures are logged and tried again.
pub async fn keep_fleet(client: Client, namespace: String, fleet: FleetSecrets) {
    let mut tick = tokio::time::interval(FLEET_CHECK);
    loop {
        tick.tick().await;
        if let Err(e) = fleet.ensure(&client, &namespace).await {
            tracing::warn!(error = %e, "cannot make or renew the peer tier's Secrets; trying again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(days: u32) -> LeafSpec {
        LeafSpec {
            dns_names: vec!["sealed-peer".into()],
            usage: Usage::ServerAndClient,
            days,
        }
    }

    /// What the peer tier loads (`sealed_peer::PeerTls`, the same checks as a peer's) accepts
    /// the fleet certificate, also from a CA read back from its Secret's PEM.
    #[test]
    fn issued_fleet_certificates_load_as_the_peer_tier_checks_them() {
        let ca = Ca::generate("fleet CA", CA_DAYS).unwrap();
        let leaf = ca.issue(&spec(365)).unwrap();
        assert!(leaf.not_after > Utc::now() + chrono::Duration::days(364));
        sealed_peer::PeerTls::from_pem(
            leaf.cert_pem.as_bytes(),
            leaf.key_pem.as_bytes(),
            ca.cert_pem().as_bytes(),
            "sealed-peer",
        )
        .unwrap();
        let again = Ca::from_pem("fleet CA", ca.cert_pem(), &ca.key_pem).unwrap();
        let leaf = again.issue(&spec(365)).unwrap();
        sealed_peer::PeerTls::from_pem(
            leaf.cert_pem.as_bytes(),
            leaf.key_pem.as_bytes(),
            ca.cert_pem().as_bytes(),
            "sealed-peer",
        )
        .unwrap();
        // Another CA's certificate is refused.
        let other = Ca::generate("fleet CA", CA_DAYS).unwrap();
        assert!(
            sealed_peer::PeerTls::from_pem(
                leaf.cert_pem.as_bytes(),
                leaf.key_pem.as_bytes(),
                other.cert_pem().as_bytes(),
                "sealed-peer",
            )
            .is_err()
        );
    }

    #[test]
    fn a_leaf_is_renewed_when_its_ca_changes_or_a_third_of_its_life_is_left() {
        let ca = Ca::generate("fleet CA", CA_DAYS).unwrap();
        let leaf = ca.issue(&spec(90)).unwrap();
        let mut secret = Secret {
            data: Some(secret_data(&[
                ("tls.crt", &leaf.cert_pem),
                ("tls.key", &leaf.key_pem),
                ("ca.crt", ca.cert_pem()),
            ])),
            ..Default::default()
        };
        secret.metadata.annotations = Some(BTreeMap::from([(
            NOT_AFTER_ANNOTATION.to_string(),
            leaf.not_after.to_rfc3339(),
        )]));
        let now = Utc::now();
        assert_eq!(leaf_outdated(&secret, &ca, &spec(90), now), None);
        let late = now + chrono::Duration::days(61);
        assert!(
            leaf_outdated(&secret, &ca, &spec(90), late)
                .unwrap()
                .contains("expires")
        );
        let other = Ca::generate("fleet CA", CA_DAYS).unwrap();
        assert!(
            leaf_outdated(&secret, &other, &spec(90), now)
                .unwrap()
                .contains("CA changed")
        );
    }
}
