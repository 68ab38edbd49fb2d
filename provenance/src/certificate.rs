//! Certificate mode: the bundle carries an X.509 chain (`verificationMaterial.x509CertificateChain`,
//! the signing certificate first, then the chain the signer gave), and the signature verifies
//! with the signing certificate's key once that certificate is trusted:
//!
//! 1. the certificate chains to a CA of the verifier's bundle (path building, signatures,
//!    basic constraints, name constraints: `rustls-webpki`, the validator rustls uses);
//! 2. every certificate of that path, the CA included, is valid at the time checked. The bundle
//!    carries no trusted signing time, so `model_signing` checks the chain at the signing
//!    certificate's `notBefore` ([`ValidAt::Issued`], the default here too); [`ValidAt::Time`]
//!    checks it at a given time (now), which also refuses an expired signing certificate;
//! 3. the certificate may sign: key usage `digitalSignature` or extended key usage
//!    `codeSigning`, as `model_signing` requires;
//! 4. one of its subject alternative names (email, URI or DNS name) is an accepted identity
//!    (`model_signing` checks no identity in this mode; a CA alone would accept every
//!    certificate it ever issued);
//! 5. the DSSE signature verifies with its key (ECDSA P-256/SHA-256 or P-384/SHA-384).
//!
//! `x509-parser` reads what `rustls-webpki` does not expose: names, validity, key usage.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, TrustAnchor, UnixTime};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer as _;

use crate::error::{Error, Result};
use crate::keys::PublicKey;

/// At most this many certificates in a CA bundle or a signature's chain.
const MAX_CERTIFICATES: usize = 1000;

/// When the chain must be valid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ValidAt {
    /// When the signing certificate was issued (its `notBefore`), as `model_signing` checks:
    /// the bundle holds no trusted signing time. A signing certificate that expired since still
    /// verifies; a CA that had expired when it issued the certificate does not.
    #[default]
    Issued,
    /// At this time (the verifier's clock): an expired certificate of the path is refused.
    Time(SystemTime),
}

/// Who may have signed, in certificate mode.
#[derive(Clone, Debug)]
pub struct CertificatePolicy {
    /// The trusted CAs (DER).
    pub cas: Vec<CertificateDer<'static>>,
    /// Accepted identities: a subject alternative name (email, URI or DNS name) of the signing
    /// certificate must equal one of them. Never empty.
    pub identities: Vec<String>,
    pub valid_at: ValidAt,
}

impl CertificatePolicy {
    /// A policy from a PEM CA bundle (one or more `CERTIFICATE` blocks) and identities.
    pub fn from_pem(ca_pem: &[u8], identities: Vec<String>, valid_at: ValidAt) -> Result<Self> {
        let mut cas = Vec::new();
        for item in CertificateDer::pem_slice_iter(ca_pem) {
            let der = item.map_err(|e| cert_error(format!("CA bundle: {e}")))?;
            if cas.len() >= MAX_CERTIFICATES {
                return Err(cert_error(format!(
                    "CA bundle: more than {MAX_CERTIFICATES} certificates"
                )));
            }
            parse(&der, "a CA of the bundle")?;
            cas.push(der);
        }
        if cas.is_empty() {
            return Err(cert_error(
                "CA bundle: no PEM CERTIFICATE block".to_string(),
            ));
        }
        if identities.iter().all(|i| i.trim().is_empty()) {
            return Err(cert_error(
                "no identity given: certificate mode needs the signer's identity (an email, \
                 URI or DNS name of its certificate)"
                    .to_string(),
            ));
        }
        Ok(CertificatePolicy {
            cas,
            identities,
            valid_at,
        })
    }
}

/// The signing certificate a verified signature was made with.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SignerCertificate {
    /// The accepted identity it carries.
    pub identity: String,
    pub subject: String,
    pub issuer: String,
    /// The CA of the bundle the chain ends at.
    pub ca: String,
    pub serial: String,
    /// Validity, Unix seconds.
    pub not_before: i64,
    pub not_after: i64,
    /// The time the chain was checked at, Unix seconds.
    pub checked_at: i64,
}

fn cert_error(why: String) -> Error {
    Error::Certificate { why }
}

fn parse<'a>(der: &'a [u8], what: &str) -> Result<X509Certificate<'a>> {
    let (rest, cert) = X509Certificate::from_der(der)
        .map_err(|e| cert_error(format!("{what} is not a DER X.509 certificate: {e}")))?;
    if !rest.is_empty() {
        return Err(cert_error(format!(
            "{what} has {} bytes after the certificate",
            rest.len()
        )));
    }
    Ok(cert)
}

fn name(cert: &X509Certificate<'_>) -> String {
    let s = cert.subject().to_string();
    if s.is_empty() {
        "(empty subject)".into()
    } else {
        s
    }
}

/// RFC 3339 of Unix seconds (UTC), for messages and status.
pub fn rfc3339(secs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, 0)
        .map_or_else(|| format!("{secs} s since 1970"), |t| t.to_rfc3339())
}

/// Whether `cert` is valid at `at` (Unix seconds); the error names it and its role.
fn check_validity(cert: &X509Certificate<'_>, role: &str, at: i64, when: &str) -> Result<()> {
    let v = cert.validity();
    let (nb, na) = (v.not_before.timestamp(), v.not_after.timestamp());
    if at > na {
        return Err(Error::CertificateExpired {
            certificate: format!("{role} {}", name(cert)),
            not_after: rfc3339(na),
            at: format!("{} ({when})", rfc3339(at)),
        });
    }
    if at < nb {
        return Err(Error::CertificateNotYetValid {
            certificate: format!("{role} {}", name(cert)),
            not_before: rfc3339(nb),
            at: format!("{} ({when})", rfc3339(at)),
        });
    }
    Ok(())
}

/// The identities a certificate carries: its email, URI and DNS subject alternative names.
fn identities_of(cert: &X509Certificate<'_>) -> Result<Vec<String>> {
    let san = cert
        .subject_alternative_name()
        .map_err(|e| cert_error(format!("signing certificate: subjectAltName: {e}")))?;
    Ok(san
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::RFC822Name(s) | GeneralName::URI(s) | GeneralName::DNSName(s) => {
                        Some((*s).to_string())
                    }
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default())
}

fn identity_matches(wanted: &str, found: &str) -> bool {
    // A DNS name compares without case; emails and URIs exactly, as Sigstore compares them.
    wanted == found || (!found.contains(['@', ':', '/']) && wanted.eq_ignore_ascii_case(found))
}

/// Accepts any extended key usage in path building; whether the signing certificate may sign
/// is checked after, as `model_signing` checks it (key usage or extended key usage).
struct AnyUsage;

impl webpki::ExtendedKeyUsageValidator for AnyUsage {
    fn validate(&self, iter: webpki::KeyPurposeIdIter<'_, '_>) -> Result<(), webpki::Error> {
        for purpose in iter {
            purpose?;
        }
        Ok(())
    }
}

/// The certificates of a bundle's `x509CertificateChain` (DER), signing certificate first.
pub(crate) fn chain_of(material: &serde_json::Value) -> Result<Vec<Vec<u8>>> {
    let certs = material
        .get("certificates")
        .and_then(|c| c.as_array())
        .ok_or_else(|| Error::Malformed {
            why: "x509CertificateChain has no certificates list".into(),
        })?;
    if certs.is_empty() || certs.len() > MAX_CERTIFICATES {
        return Err(Error::Malformed {
            why: format!("x509CertificateChain holds {} certificates", certs.len()),
        });
    }
    certs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let raw =
                c.get("rawBytes")
                    .and_then(|r| r.as_str())
                    .ok_or_else(|| Error::Malformed {
                        why: format!("x509CertificateChain.certificates[{i}] has no rawBytes"),
                    })?;
            STANDARD.decode(raw).map_err(|e| Error::Malformed {
                why: format!("x509CertificateChain.certificates[{i}].rawBytes is not base64: {e}"),
            })
        })
        .collect()
}

fn secs(t: SystemTime) -> Result<i64> {
    let d = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| cert_error("the verification time is before 1970".into()))?;
    i64::try_from(d.as_secs()).map_err(|_| cert_error("the verification time is too late".into()))
}

/// Checks the chain against the policy (steps 1-4 of the module) and returns the signing
/// certificate's key with what it established.
pub(crate) fn trusted_signer(
    chain: &[Vec<u8>],
    policy: &CertificatePolicy,
) -> Result<(PublicKey, SignerCertificate)> {
    let (leaf_der, rest) = chain.split_first().ok_or_else(|| Error::Malformed {
        why: "x509CertificateChain is empty".into(),
    })?;
    let leaf = parse(leaf_der, "the signing certificate")?;
    let not_before = leaf.validity().not_before.timestamp();
    let (at, when) = match policy.valid_at {
        ValidAt::Issued => (
            not_before,
            "when the signing certificate was issued (its notBefore, the time model_signing checks)",
        ),
        ValidAt::Time(t) => (secs(t)?, "the time of verification"),
    };
    check_validity(&leaf, "the signing certificate", at, when)?;

    let anchors: Vec<TrustAnchor<'_>> = policy
        .cas
        .iter()
        .map(|ca| {
            webpki::anchor_from_trusted_cert(ca).map_err(|e| {
                cert_error(format!("a CA of the bundle cannot be a trust anchor: {e}"))
            })
        })
        .collect::<Result<_>>()?;
    let intermediates: Vec<CertificateDer<'_>> = rest
        .iter()
        .map(|c| CertificateDer::from(c.as_slice()))
        .collect();
    let leaf_cert_der = CertificateDer::from(leaf_der.as_slice());
    let end_entity = webpki::EndEntityCert::try_from(&leaf_cert_der)
        .map_err(|e| cert_error(format!("the signing certificate: {e}")))?;
    let time = UnixTime::since_unix_epoch(Duration::from_secs(
        u64::try_from(at).map_err(|_| cert_error("a certificate time before 1970".into()))?,
    ));
    let path = end_entity
        .verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &intermediates,
            time,
            AnyUsage,
            None,
            None,
        )
        .map_err(|e| path_error(e, &leaf, rest, policy, at, when))?;

    // rustls-webpki takes a trust anchor as trusted at any time; OpenSSL (model_signing)
    // checks the CA's validity too.
    let anchor = path.anchor();
    let ca = policy
        .cas
        .iter()
        .find(|der| {
            webpki::anchor_from_trusted_cert(der).is_ok_and(|a| {
                a.subject.as_ref() == anchor.subject.as_ref()
                    && a.subject_public_key_info.as_ref() == anchor.subject_public_key_info.as_ref()
            })
        })
        .ok_or_else(|| cert_error("the CA the chain ends at is not in the bundle".into()))?;
    let ca = parse(ca, "a CA of the bundle")?;
    check_validity(&ca, "the CA certificate", at, when)?;

    let usage_ok = leaf
        .key_usage()
        .ok()
        .flatten()
        .is_some_and(|ku| ku.value.digital_signature())
        || leaf
            .extended_key_usage()
            .ok()
            .flatten()
            .is_some_and(|eku| eku.value.code_signing);
    if !usage_ok {
        return Err(cert_error(format!(
            "the signing certificate {} cannot be used for signing: neither key usage \
             digitalSignature nor extended key usage codeSigning",
            name(&leaf)
        )));
    }

    let found = identities_of(&leaf)?;
    let Some(identity) = found
        .iter()
        .find(|f| policy.identities.iter().any(|w| identity_matches(w, f)))
        .cloned()
    else {
        return Err(Error::WrongIdentity {
            subject: name(&leaf),
            wanted: policy.identities.clone(),
            found,
        });
    };

    let key = PublicKey::from_spki_der(leaf.public_key().raw)?;
    Ok((
        key,
        SignerCertificate {
            identity,
            subject: name(&leaf),
            issuer: leaf.issuer().to_string(),
            ca: name(&ca),
            serial: leaf.raw_serial_as_string(),
            not_before,
            not_after: leaf.validity().not_after.timestamp(),
            checked_at: at,
        },
    ))
}

/// What a failed path means, naming the certificate where it can.
fn path_error(
    e: webpki::Error,
    leaf: &X509Certificate<'_>,
    intermediates: &[Vec<u8>],
    policy: &CertificatePolicy,
    at: i64,
    when: &str,
) -> Error {
    match e {
        webpki::Error::CertExpired { .. } | webpki::Error::CertNotValidYet { .. } => {
            // The signing certificate was checked before; an intermediate of the chain is out.
            for der in intermediates {
                if let Ok(c) = parse(der, "an intermediate certificate")
                    && let Err(e) = check_validity(&c, "the intermediate certificate", at, when)
                {
                    return e;
                }
            }
            cert_error(format!(
                "a certificate of the chain is not valid at {}: {e}",
                rfc3339(at)
            ))
        }
        webpki::Error::UnknownIssuer | webpki::Error::InvalidSignatureForPublicKey => {
            Error::WrongCa {
                subject: name(leaf),
                issuer: leaf.issuer().to_string(),
                cas: policy
                    .cas
                    .iter()
                    .filter_map(|der| parse(der, "a CA").ok().map(|c| name(&c)))
                    .collect(),
            }
        }
        other => cert_error(format!(
            "the certificate chain of {} does not verify: {other}",
            name(leaf)
        )),
    }
}
