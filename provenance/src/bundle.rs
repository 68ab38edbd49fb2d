//! The signature file `model_signing` writes (`model.sig`), read and written top to bottom:
//!
//! ```text
//! Sigstore bundle v0.3 JSON
//!   mediaType: application/vnd.dev.sigstore.bundle.v0.3+json
//!   verificationMaterial: {publicKey: {hint: sha256(PEM of the public key)}, tlogEntries: []}
//!                         (key mode; certificate mode has x509CertificateChain instead)
//!   dsseEnvelope: {payload: base64(statement), payloadType: application/vnd.in-toto+json,
//!                  signatures: [{sig: base64(DER ECDSA over PAE(payload)), keyid: ""}]}
//! statement (in-toto v1)
//!   _type: https://in-toto.io/Statement/v1
//!   subject: [{name: MODEL, digest: {sha256: sha256(concat of every file's raw digest)}}]
//!   predicateType: https://model_signing/signature/v1.0
//!   predicate: {resources: [{name: PATH, algorithm: sha256|blake3|blake2b, digest: HEX}],
//!               serialization: {method: files|shards, hash_type, allow_symlinks, ignore_paths}}
//! PAE = "DSSEv1 28 application/vnd.in-toto+json <len(payload)> " + payload
//! ```
//!
//! The reference is `model_signing` 1.1 (`_signing/signing.py`, `sign_sigstore_pb.py`,
//! `sign_ec_key.py`).

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::certificate::{CertificatePolicy, SignerCertificate, chain_of, trusted_signer};
use crate::error::{Error, Result};
use crate::keys::{PublicKey, SigningKey};

pub const BUNDLE_MEDIA_TYPE: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";
/// The pre-1.0 predicate (model_signing 0.2), which signed no file list we could check.
const PREDICATE_TYPE_COMPAT: &str = "https://model_signing/Digests/v0.1";

/// A signature file is refused past this size (a statement of ten million files fits).
pub const MAX_SIGNATURE_BYTES: usize = 1 << 30;
/// Files a statement may list.
pub const MAX_RESOURCES: usize = 10_000_000;

#[derive(Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Bundle {
    pub media_type: String,
    pub verification_material: VerificationMaterial,
    pub dsse_envelope: Option<Envelope>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerificationMaterial {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<PublicKeyIdentifier>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x509_certificate_chain: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<serde_json::Value>,
    #[serde(default)]
    pub tlog_entries: Vec<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
pub struct PublicKeyIdentifier {
    #[serde(default)]
    pub hint: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope {
    pub payload: String,
    pub payload_type: String,
    pub signatures: Vec<EnvelopeSignature>,
}

#[derive(Debug, Deserialize, Serialize)]
pub struct EnvelopeSignature {
    pub sig: String,
    #[serde(default)]
    pub keyid: String,
}

/// What a verified signature says: the files of a model and their digests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Statement {
    /// The subject's name: the signed directory's last component (informative only).
    pub model_name: String,
    /// `serialization.method`: `files` (one digest per file) or `shards`.
    pub method: String,
    /// `serialization.hash_type`.
    pub hash_type: String,
    pub allow_symlinks: bool,
    /// Paths (relative to the model's root) left out when signing: files, or directories
    /// with everything below them.
    pub ignore_paths: Vec<String>,
    pub resources: Vec<Resource>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// `/`-separated path relative to the model's root.
    pub name: String,
    pub algorithm: String,
    pub digest: Vec<u8>,
}

fn malformed(why: impl Into<String>) -> Error {
    Error::Malformed { why: why.into() }
}

fn b64(field: &str, text: &str) -> Result<Vec<u8>> {
    STANDARD
        .decode(text)
        .or_else(|_| URL_SAFE.decode(text))
        .map_err(|e| malformed(format!("{field} is not base64: {e}")))
}

/// DSSE's pre-authentication encoding of an in-toto payload.
pub fn pae(payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {PAYLOAD_TYPE} {} ",
        PAYLOAD_TYPE.len(),
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

impl Bundle {
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > MAX_SIGNATURE_BYTES {
            return Err(malformed(format!(
                "{} bytes, more than the {MAX_SIGNATURE_BYTES} accepted",
                bytes.len()
            )));
        }
        let bundle: Bundle = serde_json::from_slice(bytes)
            .map_err(|e| malformed(format!("not a Sigstore bundle JSON: {e}")))?;
        if bundle.media_type != BUNDLE_MEDIA_TYPE {
            return Err(malformed(format!(
                "media type {:?}, expected {BUNDLE_MEDIA_TYPE:?}",
                bundle.media_type
            )));
        }
        Ok(bundle)
    }

    /// How the bundle says it was signed: a key, a certificate chain, or Sigstore keyless.
    pub fn mode(&self) -> &'static str {
        let vm = &self.verification_material;
        if vm.x509_certificate_chain.is_some() {
            "certificate"
        } else if vm.certificate.is_some() || !vm.tlog_entries.is_empty() {
            "sigstore"
        } else {
            "key"
        }
    }

    /// Key mode: checks the bundle was signed by `key` and returns the signed statement.
    pub fn verify_with_key(&self, key: &PublicKey) -> Result<Statement> {
        match self.mode() {
            "key" => {}
            "certificate" => {
                return Err(Error::Unsupported {
                    what: "this signature was made in certificate mode (an X.509 chain): a key \
                           does not verify it; give the CA bundle and the signer's identity \
                           (sealed verify --ca PEM --cert-identity ID)"
                        .into(),
                });
            }
            _ => return Err(keyless()),
        }
        let given_hint = key.hint()?;
        if let Some(signed_hint) = self
            .verification_material
            .public_key
            .as_ref()
            .and_then(|k| k.hint.as_deref())
            .filter(|h| !h.is_empty())
            && !signed_hint.eq_ignore_ascii_case(&given_hint)
        {
            return Err(Error::WrongKey {
                signed_hint: signed_hint.to_string(),
                given_hint,
                curve: key.curve(),
            });
        }
        self.verify_envelope(key)
    }

    /// Certificate mode: checks the bundle's signing certificate against `policy` (chain to
    /// a CA, validity, usage, identity) and the signature with its key; returns the signed
    /// statement, the key and the certificate.
    pub fn verify_with_certificate(
        &self,
        policy: &CertificatePolicy,
    ) -> Result<(Statement, PublicKey, SignerCertificate)> {
        let chain = match (
            self.mode(),
            &self.verification_material.x509_certificate_chain,
        ) {
            ("certificate", Some(chain)) => chain_of(chain)?,
            ("key", _) => {
                return Err(Error::Unsupported {
                    what: "this signature was made in key mode (no certificate): verify it with \
                           the signer's public key (sealed verify --key PEM)"
                        .into(),
                });
            }
            _ => return Err(keyless()),
        };
        let (key, certificate) = trusted_signer(&chain, policy)?;
        let statement = self.verify_envelope(&key)?;
        Ok((statement, key, certificate))
    }

    /// The DSSE envelope's first signature over its payload, with `key`; the statement.
    fn verify_envelope(&self, key: &PublicKey) -> Result<Statement> {
        let envelope = self
            .dsse_envelope
            .as_ref()
            .ok_or_else(|| malformed("no dsseEnvelope"))?;
        let payload = b64("dsseEnvelope.payload", &envelope.payload)?;
        // model_signing checks the first signature only; so do we.
        let sig = envelope
            .signatures
            .first()
            .ok_or_else(|| malformed("dsseEnvelope.signatures is empty"))?;
        let sig = b64("dsseEnvelope.signatures[0].sig", &sig.sig)?;
        if envelope.payload_type != PAYLOAD_TYPE {
            return Err(malformed(format!(
                "payload type {:?}, expected {PAYLOAD_TYPE:?}",
                envelope.payload_type
            )));
        }
        if !key.verify(&pae(&payload), &sig) {
            return Err(Error::BadSignature { curve: key.curve() });
        }
        Statement::parse(&payload)
    }
}

fn keyless() -> Error {
    Error::Unsupported {
        what: "this is a Sigstore keyless signature (Fulcio certificate, Rekor transparency-log \
               entry); verifying one needs Sigstore's trust root and log proofs, which cannot be \
               checked offline here"
            .into(),
    }
}

fn str_field<'a>(v: &'a serde_json::Value, path: &str) -> Result<&'a str> {
    v.pointer(path)
        .and_then(|x| x.as_str())
        .ok_or_else(|| malformed(format!("statement has no string at {path}")))
}

impl Statement {
    /// Parses a signed in-toto statement (call only on verified bytes).
    pub fn parse(payload: &[u8]) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_slice(payload)
            .map_err(|e| malformed(format!("statement is not JSON: {e}")))?;
        let ty = str_field(&v, "/_type")?;
        if ty != STATEMENT_TYPE {
            return Err(malformed(format!(
                "statement type {ty:?}, expected {STATEMENT_TYPE:?}"
            )));
        }
        let predicate_type = str_field(&v, "/predicateType")?;
        if predicate_type == PREDICATE_TYPE_COMPAT {
            return Err(Error::Unsupported {
                what: "a model_signing 0.2 signature (predicate Digests/v0.1): it does not record \
                       how files were serialized; sign again with model_signing 1.x"
                    .into(),
            });
        }
        if predicate_type != PREDICATE_TYPE {
            return Err(malformed(format!(
                "predicate type {predicate_type:?}, expected {PREDICATE_TYPE:?}"
            )));
        }
        let subjects = v
            .get("subject")
            .and_then(|s| s.as_array())
            .ok_or_else(|| malformed("statement has no subject list"))?;
        let [subject] = subjects.as_slice() else {
            return Err(malformed(format!(
                "{} subjects, expected one",
                subjects.len()
            )));
        };
        let model_name = str_field(subject, "/name")?.to_string();
        let root = str_field(subject, "/digest/sha256")?.to_ascii_lowercase();
        let ser = v
            .pointer("/predicate/serialization")
            .ok_or_else(|| malformed("statement has no predicate.serialization"))?;
        let method = str_field(ser, "/method")?.to_string();
        let hash_type = str_field(ser, "/hash_type")?.to_string();
        let allow_symlinks = match ser.get("allow_symlinks") {
            Some(serde_json::Value::Bool(b)) => *b,
            // model_signing 1.0 wrote it as a string in some versions.
            Some(serde_json::Value::String(s)) => s.eq_ignore_ascii_case("true"),
            _ => false,
        };
        let ignore_paths = match ser.get("ignore_paths") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(normalize_rel)
                        .ok_or_else(|| malformed("ignore_paths holds a non-string"))
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(malformed("ignore_paths is not a list")),
        };
        let items = v
            .pointer("/predicate/resources")
            .and_then(|r| r.as_array())
            .ok_or_else(|| malformed("statement has no predicate.resources list"))?;
        if items.len() > MAX_RESOURCES {
            return Err(malformed(format!(
                "{} resources, more than {MAX_RESOURCES}",
                items.len()
            )));
        }
        let mut resources = Vec::with_capacity(items.len());
        let mut hasher = Sha256::new();
        for item in items {
            let name = str_field(item, "/name")?.to_string();
            let algorithm = str_field(item, "/algorithm")?.to_string();
            let digest = hex::decode(str_field(item, "/digest")?)
                .map_err(|e| malformed(format!("digest of {name:?} is not hex: {e}")))?;
            hasher.update(&digest);
            resources.push(Resource {
                name,
                algorithm,
                digest,
            });
        }
        let computed = hex::encode(hasher.finalize());
        if computed != root {
            return Err(Error::Inconsistent {
                subject: root,
                computed,
            });
        }
        Ok(Statement {
            model_name,
            method,
            hash_type,
            allow_symlinks,
            ignore_paths,
            resources,
        })
    }

    /// The in-toto JSON of this statement, as model_signing lays it out.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        let mut root = Sha256::new();
        let resources: Vec<serde_json::Value> = self
            .resources
            .iter()
            .map(|r| {
                root.update(&r.digest);
                serde_json::json!({
                    "name": r.name,
                    "algorithm": r.algorithm,
                    "digest": hex::encode(&r.digest),
                })
            })
            .collect();
        let mut serialization = serde_json::json!({
            "method": self.method,
            "hash_type": self.hash_type,
            "allow_symlinks": self.allow_symlinks,
        });
        if !self.ignore_paths.is_empty()
            && let Some(obj) = serialization.as_object_mut()
        {
            obj.insert("ignore_paths".into(), serde_json::json!(self.ignore_paths));
        }
        let statement = serde_json::json!({
            "_type": STATEMENT_TYPE,
            "subject": [{"name": self.model_name, "digest": {"sha256": hex::encode(root.finalize())}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": {"resources": resources, "serialization": serialization},
        });
        serde_json::to_vec_pretty(&statement)
            .map_err(|e| malformed(format!("cannot encode the statement: {e}")))
    }

    /// A key-mode bundle over this statement, as `model_signing sign key` writes it.
    pub fn sign(&self, key: &SigningKey) -> Result<Vec<u8>> {
        let payload = self.to_json()?;
        let sig = key.sign(&pae(&payload));
        let bundle = Bundle {
            media_type: BUNDLE_MEDIA_TYPE.into(),
            verification_material: VerificationMaterial {
                public_key: Some(PublicKeyIdentifier {
                    hint: Some(key.public_key().hint()?),
                }),
                ..Default::default()
            },
            dsse_envelope: Some(Envelope {
                payload: STANDARD.encode(&payload),
                payload_type: PAYLOAD_TYPE.into(),
                signatures: vec![EnvelopeSignature {
                    sig: STANDARD.encode(&sig),
                    keyid: String::new(),
                }],
            }),
        };
        serde_json::to_vec(&bundle).map_err(|e| malformed(format!("cannot encode the bundle: {e}")))
    }
}

/// `./a/b/` → `a/b`: how ignore paths are compared with manifest paths.
pub(crate) fn normalize_rel(p: &str) -> String {
    p.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}
