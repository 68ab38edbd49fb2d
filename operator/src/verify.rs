//! Verify at seal: a volume's `spec.verify` names who must have signed its versions; the
//! version reconciler checks the version's model signature (`model.sig`, synced with the
//! model like any file) against the sealed manifest with `sealed-provenance`. Only the
//! manifest and the signature file's own chunks are read, never the model's: BLAKE3 digests
//! come from the manifest.
//!
//! The signers' keys and CA bundles come from Secrets or ConfigMaps of the volume's namespace,
//! read when the version is checked. The result is the version's `status.verification` and
//! its `Verified` condition; a failure keeps the version from being Ready.

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use sealed_crds::volume::{KeyRef, Verify};
use sealed_provenance::{
    CertificatePolicy, CheckOptions, PublicKey, ValidAt, Verified, verify_with_certificate,
    verify_with_key,
};
use sealed_store::manifest::{EntryKind, Manifest};

use crate::context::Context;

/// A signature file larger than this is refused before a chunk of it is read.
pub const MAX_SIGNATURE_BYTES: u64 = 256 * 1024 * 1024;
/// A key or CA bundle larger than this is refused.
const MAX_PEM_BYTES: usize = 1024 * 1024;

/// Why a version did not verify, for its condition and Event: names the file, the signer or
/// the missing piece. Store and API errors that may pass are `Retry`.
#[derive(Debug)]
pub enum Failure {
    /// The version does not verify; the message says why.
    Refused(String),
    /// Something to try again (the store or the API server failed).
    Retry(String),
}

/// Checks `manifest` (of the version being sealed) against `spec`.
pub async fn check(
    ctx: &Context,
    namespace: &str,
    spec: &Verify,
    manifest: &Manifest,
) -> Result<Verified, Failure> {
    let signature = read_signature(ctx, manifest, &spec.signature_path).await?;
    let mut opts = CheckOptions {
        ignore_paths: spec.ignore_paths.clone(),
        digests: None,
    };
    opts.ignore_paths.push(spec.signature_path.clone());

    // Each configured signer is tried; the first that verifies wins. When none does, every
    // signer's reason is given (a changed file shows in each; a wrong key only in its own).
    let mut reasons = Vec::new();
    for (i, key_ref) in spec.keys.iter().enumerate() {
        let what = format!("spec.verify.keys[{i}] ({})", describe(key_ref));
        let pem = read_ref(ctx, namespace, key_ref, &what).await?;
        let key = match PublicKey::from_pem(&pem) {
            Ok(k) => k,
            Err(e) => {
                reasons.push(format!("{what}: {e}"));
                continue;
            }
        };
        match verify_with_key(&signature, &key, manifest, &opts) {
            Ok(v) => return Ok(v),
            Err(e) => reasons.push(format!("key {what}: {e}")),
        }
    }
    if let Some(certs) = &spec.certificates {
        let what = format!("spec.verify.certificates.ca ({})", describe(&certs.ca));
        let pem = read_ref(ctx, namespace, &certs.ca, &what).await?;
        let valid_at = if certs.require_valid_now {
            ValidAt::Time(std::time::SystemTime::now())
        } else {
            ValidAt::Issued
        };
        match CertificatePolicy::from_pem(pem.as_bytes(), certs.identities.clone(), valid_at) {
            Ok(policy) => match verify_with_certificate(&signature, &policy, manifest, &opts) {
                Ok(v) => return Ok(v),
                Err(e) => reasons.push(format!("certificate: {e}")),
            },
            Err(e) => reasons.push(format!("{what}: {e}")),
        }
    }
    if reasons.is_empty() {
        reasons.push("spec.verify names no key and no certificate".into());
    }
    Err(Failure::Refused(format!(
        "signature {} does not verify: {}",
        spec.signature_path,
        reasons.join("; ")
    )))
}

fn describe(r: &KeyRef) -> String {
    match (&r.secret_key_ref, &r.config_map_key_ref) {
        (Some(s), _) => format!("Secret {} key {}", s.name, s.key),
        (None, Some(c)) => format!("ConfigMap {} key {}", c.name, c.key),
        (None, None) => "no Secret or ConfigMap".into(),
    }
}

/// The PEM text a [`KeyRef`] names. A missing object or key is a refusal (it names which).
async fn read_ref(
    ctx: &Context,
    namespace: &str,
    r: &KeyRef,
    what: &str,
) -> Result<String, Failure> {
    let bytes: Option<Vec<u8>> = if let Some(s) = &r.secret_key_ref {
        let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
        let secret = api
            .get_opt(&s.name)
            .await
            .map_err(|e| Failure::Retry(format!("cannot read {what}: {e}")))?;
        secret.and_then(|sec| {
            sec.data
                .and_then(|d| d.get(&s.key).map(|b| b.0.clone()))
                .or_else(|| {
                    sec.string_data
                        .and_then(|d| d.get(&s.key).map(|v| v.clone().into_bytes()))
                })
        })
    } else if let Some(c) = &r.config_map_key_ref {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), namespace);
        let cm = api
            .get_opt(&c.name)
            .await
            .map_err(|e| Failure::Retry(format!("cannot read {what}: {e}")))?;
        cm.and_then(|cm| {
            cm.data
                .and_then(|d| d.get(&c.key).map(|v| v.clone().into_bytes()))
                .or_else(|| {
                    cm.binary_data
                        .and_then(|d| d.get(&c.key).map(|b| b.0.clone()))
                })
        })
    } else {
        None
    };
    let bytes = bytes.ok_or_else(|| Failure::Refused(format!("{what}: not found")))?;
    if bytes.len() > MAX_PEM_BYTES {
        return Err(Failure::Refused(format!(
            "{what}: {} bytes, more than the {MAX_PEM_BYTES} accepted",
            bytes.len()
        )));
    }
    String::from_utf8(bytes).map_err(|_| Failure::Refused(format!("{what}: not PEM text")))
}

/// The signature file's bytes, from its own chunks (each checked against its BLAKE3).
async fn read_signature(
    ctx: &Context,
    manifest: &Manifest,
    path: &str,
) -> Result<Vec<u8>, Failure> {
    let wanted = path.trim_start_matches("./").trim_matches('/');
    let entry = manifest
        .entries
        .iter()
        .find(|e| e.path == wanted)
        .ok_or_else(|| {
            Failure::Refused(format!(
                "no signature: the version has no file {wanted} (spec.verify.signaturePath); \
                 sign the model with model_signing or `sealed push --sign`"
            ))
        })?;
    let EntryKind::File(file) = &entry.kind else {
        return Err(Failure::Refused(format!(
            "no signature: {wanted} in the version is not a regular file"
        )));
    };
    if file.size > MAX_SIGNATURE_BYTES {
        return Err(Failure::Refused(format!(
            "signature {wanted} has {} bytes, more than the {MAX_SIGNATURE_BYTES} accepted",
            file.size
        )));
    }
    let mut out = Vec::with_capacity(usize::try_from(file.size).unwrap_or(0));
    for chunk in &file.chunks {
        let data = ctx
            .store
            .get_chunk_checked(chunk)
            .await
            .map_err(|e| Failure::Retry(format!("cannot read the signature {wanted}: {e}")))?;
        out.extend_from_slice(&data);
    }
    Ok(out)
}
