use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use sealed_provenance::{CheckOptions, DEFAULT_SIGNATURE_NAME, PublicKey};
use sealed_store::manifest::{EntryKind, Manifest};
use sealed_store::verify::verify;
use sealed_store::{ChunkStore, Digest};

use crate::context::{Context, resolve_digest};
use crate::output::{Bars, bytes, print_json};

/// A signature or key file larger than this is refused before it is read.
const MAX_SIGNATURE_FILE: u64 = sealed_provenance::bundle::MAX_SIGNATURE_BYTES as u64;
const MAX_KEY_FILE: u64 = 64 * 1024;

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Version digest (blake3:…)
    pub digest: String,
    /// Chunks checked at once
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Check this OpenSSF model signature (`model_signing`'s model.sig) against the version's
    /// manifest instead of its chunks: the signed files, digests and signer, no file read
    #[arg(long, value_name = "FILE", requires = "key")]
    pub signature: Option<PathBuf>,
    /// The signer's public key (PEM, ECDSA P-256 or P-384) for --signature
    #[arg(long, value_name = "PEM", requires = "signature")]
    pub key: Option<PathBuf>,
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
    if let (Some(signature), Some(key)) = (&args.signature, &args.key) {
        return verify_signature(ctx, &store, &digest, signature, key, &args).await;
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

/// `verify --signature FILE --key PEM`: the manifest only (one GET), unless `--read-files`.
async fn verify_signature(
    ctx: &Context,
    store: &ChunkStore,
    digest: &Digest,
    signature: &std::path::Path,
    key: &std::path::Path,
    args: &VerifyArgs,
) -> anyhow::Result<ExitCode> {
    let key_pem = String::from_utf8(read_bounded(key, MAX_KEY_FILE, "key")?)
        .with_context(|| format!("key {} is not PEM text", key.display()))?;
    let public_key =
        PublicKey::from_pem(&key_pem).with_context(|| format!("key {}", key.display()))?;
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
    let verified = sealed_provenance::verify_with_key(&sig, &public_key, &manifest, &opts)
        .with_context(|| {
            format!(
                "signature {} does not verify version {digest}",
                signature.display()
            )
        })?;
    if ctx.json() {
        print_json(&serde_json::json!({"digest": digest, "signature": verified}))?;
    } else {
        println!(
            "OK {digest}: signed by the {} key {} (model {:?}): {} files match their {} digests{}",
            verified.key_curve,
            verified.key_hint,
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
