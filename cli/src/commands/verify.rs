use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{ArgGroup, Args};
use sealed_provenance::{
    CertificatePolicy, CheckOptions, DEFAULT_SIGNATURE_NAME, PublicKey, ValidAt,
};
use sealed_store::manifest::{EntryKind, Manifest};
use sealed_store::verify::verify;
use sealed_store::{ChunkStore, Digest};

use crate::context::{Context, resolve_digest};
use crate::output::{Bars, bytes, print_json};

/// A signature or key file larger than this is refused before it is read.
const MAX_SIGNATURE_FILE: u64 = sealed_provenance::bundle::MAX_SIGNATURE_BYTES as u64;
const MAX_KEY_FILE: u64 = 64 * 1024;
const MAX_CA_FILE: u64 = 16 * 1024 * 1024;

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("signer").args(["key", "ca"]).multiple(false)))]
pub struct VerifyArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// Chunks checked at once
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Check this OpenSSF model signature (`model_signing`'s model.sig) against the version's
    /// manifest instead of its chunks: the signed files, digests and signer, no file read
    #[arg(long, value_name = "FILE", requires = "signer")]
    pub signature: Option<PathBuf>,
    /// The signer's public key (PEM, ECDSA P-256 or P-384) for --signature (key mode)
    #[arg(long, value_name = "PEM", requires = "signature")]
    pub key: Option<PathBuf>,
    /// Certificate mode: the CA bundle (PEM certificates) the signature's signing certificate
    /// must chain to; with --cert-identity
    #[arg(long, value_name = "PEM", requires_all = ["signature", "cert_identity"])]
    pub ca: Option<PathBuf>,
    /// Certificate mode: an accepted signer, an email, URI or DNS name of the signing
    /// certificate (subject alternative name); repeatable, any one matches
    #[arg(long, value_name = "ID", requires = "ca")]
    pub cert_identity: Vec<String>,
    /// Certificate mode: check the certificate chain now, refusing an expired signing
    /// certificate (by default the chain is checked when the signing certificate was issued,
    /// as model_signing checks it)
    #[arg(long, requires = "ca")]
    pub cert_valid_now: bool,
    /// With --signature, also leave out PATH of the version (a file or a directory,
    /// repeatable), besides the signature's own ignore paths and model.sig
    #[arg(long, value_name = "PATH", requires = "signature")]
    pub ignore_path: Vec<String>,
    /// With --signature over SHA-256 (model_signing's default): read the version's files from
    /// the store to compute their SHA-256, which a manifest does not hold
    #[arg(long, requires = "signature")]
    pub read_files: bool,
}

pub async fn run(ctx: &Context, args: VerifyArgs) -> anyhow::Result<ExitCode> {
    let store = ctx.open_store().await?;
    let digest = resolve_digest(&store, &args.digest).await?;
    if let Some(signature) = &args.signature {
        return verify_signature(ctx, &store, &digest, signature, &args).await;
    }
    let bars = Arc::new(Bars::new(ctx.progress));
    let report = verify(&store, &digest, args.concurrency, bars).await?;
    if ctx.json() {
        print_json(&report)?;
    } else if report.ok() {
        println!(
            "OK {}: {} chunks, {} verified",
            report.digest,
            report.chunks_checked,
            bytes(report.bytes_checked)
        );
    } else {
        for p in &report.problems {
            println!(
                "{:?} chunk {} used by {}",
                p.problem,
                p.chunk,
                p.files.join(", ")
            );
        }
        println!(
            "FAILED {}: {} of {} chunks missing or corrupt",
            report.digest,
            report.problems.len(),
            report.chunks_checked
        );
    }
    Ok(if report.ok() {
        ExitCode::SUCCESS
    } else {
        crate::errors::Failure::Corrupt.code()
    })
}

/// Reads a small local file, refusing one larger than `max` before reading it.
fn read_bounded(path: &std::path::Path, max: u64, what: &str) -> anyhow::Result<Vec<u8>> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read {what} {}", path.display()))?
        .len();
    anyhow::ensure!(
        len <= max,
        "{what} {} has {len} bytes, more than the {max} accepted",
        path.display()
    );
    std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))
}

/// Who must have signed: a key, or a certificate under a CA bundle.
enum Signer {
    Key(PublicKey),
    Certificate(CertificatePolicy),
}

fn signer(args: &VerifyArgs) -> anyhow::Result<Signer> {
    if let Some(key) = &args.key {
        let key_pem = String::from_utf8(read_bounded(key, MAX_KEY_FILE, "key")?)
            .with_context(|| format!("key {} is not PEM text", key.display()))?;
        let public_key =
            PublicKey::from_pem(&key_pem).with_context(|| format!("key {}", key.display()))?;
        return Ok(Signer::Key(public_key));
    }
    let ca = args
        .ca
        .as_ref()
        .context("--signature needs --key PEM or --ca PEM with --cert-identity ID")?;
    let pem = read_bounded(ca, MAX_CA_FILE, "CA bundle")?;
    let valid_at = if args.cert_valid_now {
        ValidAt::Time(std::time::SystemTime::now())
    } else {
        ValidAt::Issued
    };
    let policy = CertificatePolicy::from_pem(&pem, args.cert_identity.clone(), valid_at)
        .with_context(|| format!("CA bundle {}", ca.display()))?;
    Ok(Signer::Certificate(policy))
}

/// `verify --signature FILE --key PEM | --ca PEM --cert-identity ID`: the manifest only (one
/// GET), unless `--read-files`.
async fn verify_signature(
    ctx: &Context,
    store: &ChunkStore,
    digest: &Digest,
    signature: &std::path::Path,
    args: &VerifyArgs,
) -> anyhow::Result<ExitCode> {
    let signer = signer(args)?;
    let sig = read_bounded(signature, MAX_SIGNATURE_FILE, "signature")?;
    let manifest = store.get_manifest(digest).await?;
    let mut opts = CheckOptions {
        ignore_paths: args.ignore_path.clone(),
        digests: None,
    };
    opts.ignore_paths.push(DEFAULT_SIGNATURE_NAME.into());
    if args.read_files {
        opts.digests = Some(sha256_of_files(store, &manifest).await?);
    }
    let verified = match &signer {
        Signer::Key(key) => sealed_provenance::verify_with_key(&sig, key, &manifest, &opts),
        Signer::Certificate(policy) => {
            sealed_provenance::verify_with_certificate(&sig, policy, &manifest, &opts)
        }
    }
    .with_context(|| {
        format!(
            "signature {} does not verify version {digest}",
            signature.display()
        )
    })?;
    if ctx.json() {
        print_json(&serde_json::json!({"digest": digest, "signature": verified}))?;
    } else {
        let by = match &verified.certificate {
            Some(c) => format!(
                "{} (certificate {}, CA {}, chain valid at {})",
                c.identity,
                c.subject,
                c.ca,
                sealed_provenance::certificate::rfc3339(c.checked_at)
            ),
            None => format!("the {} key {}", verified.key_curve, verified.key_hint),
        };
        println!(
            "OK {digest}: signed by {by} (model {:?}): {} files match their {} digests{}",
            verified.checked.model_name,
            verified.checked.files,
            verified.checked.algorithm,
            if args.read_files {
                ", read from the store"
            } else {
                ", from the manifest alone"
            },
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// SHA-256 of every regular file of the version, from its chunks (each checked against its
/// BLAKE3 as it is read): only on `--read-files`.
async fn sha256_of_files(
    store: &ChunkStore,
    manifest: &Manifest,
) -> anyhow::Result<HashMap<String, Vec<u8>>> {
    use sha2::Digest as _;
    let mut out = HashMap::new();
    for entry in &manifest.entries {
        let EntryKind::File(file) = &entry.kind else {
            continue;
        };
        let mut hasher = sha2::Sha256::new();
        for chunk in &file.chunks {
            let data = store
                .get_chunk_checked(chunk)
                .await
                .with_context(|| format!("reading {}", entry.path))?;
            hasher.update(&data);
        }
        out.insert(entry.path.clone(), hasher.finalize().to_vec());
    }
    Ok(out)
}
